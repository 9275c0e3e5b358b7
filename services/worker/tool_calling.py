"""A request's tools as the constraint vLLM's OpenAI server puts on the answer for that
tool parser: the structural tag of the model's call format (``<tool_call>{"name": ...,
"arguments": ...}</tool_call>`` for ``hermes``) when a call is required, named, or held to
a strict schema, and none for ``auto`` with free arguments (the model may answer in text).

The rules are vLLM 0.32's ``DelegatingParser._apply_structural_tag`` (vllm/parser/
abstract_parser.py), applied with vLLM's own builders (xgrammar's model templates), so that
decode samples under the grammar a single ``vllm serve --tool-call-parser hermes``
samples under; ``kvpush conformance`` checks the two answers token for token. The server's
``--tool-strict-level`` is vLLM's default (auto): a tool's own ``strict`` decides whether
its arguments are held to its schema.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from kvpush.shared import wire


def _tool_choice(calling: wire.ToolCalling):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionNamedToolChoiceParam

    if calling.choice == "function":
        return ChatCompletionNamedToolChoiceParam.model_validate(
            {"type": "function", "function": {"name": calling.function}})
    return calling.choice


def structured_outputs(calling: wire.ToolCalling, structured: dict[str, Any] | None) -> dict[str, Any] | None:
    """The keyword arguments of vLLM's ``StructuredOutputsParams`` for the answer: the
    tools' structural tag (with ``auto`` and a structured output, either a call or that
    output), or ``structured`` as it was when the tools constrain nothing."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionToolsParam
    from vllm.parser.abstract_parser import _xgrammar_supports, structured_outputs_to_format
    from vllm.sampling_params import StructuredOutputsParams
    from vllm.tool_parsers.structural_tag_registry import (
        get_model_structural_tag,
        get_structural_tag_tools,
        limit_to_single_tool_call,
        resolve_tool_strictness,
    )
    from vllm.tool_parsers.tool_strict_level import ToolStrictLevel
    from vllm import envs
    from xgrammar import StructuralTag
    from xgrammar.structural_tag import OrFormat

    if not envs.VLLM_ENFORCE_STRICT_TOOL_CALLING:  # vLLM's switch for these tags
        return structured
    tools = [ChatCompletionToolsParam.model_validate({"type": "function", "function": msgspec.to_builtins(tool)})
             for tool in calling.tools]
    choice = _tool_choice(calling)
    is_auto = calling.choice == "auto"
    single_call = calling.parallel is False
    strict_level = ToolStrictLevel.AUTO
    if single_call and not (is_auto and structured is not None):
        strict_level = max(strict_level, ToolStrictLevel.FUNCTION)  # the call count needs the envelope
    resolved = resolve_tool_strictness(get_structural_tag_tools(calling.parser, tools, choice), choice, strict_level)
    output_format = None
    if resolved and is_auto and structured is not None:
        params = StructuredOutputsParams(**structured)
        if not _xgrammar_supports(params):
            return structured  # vLLM: the structured output applies, tool calls are not constrained
        output_format = structured_outputs_to_format(params)
    if resolved is None:
        return structured
    tag = get_model_structural_tag(model=calling.parser, tools=tools,
                                   tool_choice="required" if output_format is not None else choice,
                                   reasoning=False, strict_level=strict_level)
    if tag is None:
        return structured
    if single_call:
        limit_to_single_tool_call(tag)
    if output_format is not None:
        tag = StructuralTag(format=OrFormat(elements=[tag.format, output_format]))
    return {"structural_tag": json.dumps(tag.model_dump())}
