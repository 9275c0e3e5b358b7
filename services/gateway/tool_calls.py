"""OpenAI's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` as kvpush's
``ToolCalling``, and the calls read back out of an answer's text, as vLLM 0.32's server
reads them with its ``hermes`` tool parser: every ``<tool_call>{"name": ...,
"arguments": ...}</tool_call>`` (or one left open at the end), its arguments re-serialized
as JSON text; the text before the first call is the message's content.

The server is the reference for what a client gets (``kvpush conformance``): the message's
``content`` and ``tool_calls``, and the finish reason (``tool_calls`` when ``auto`` called
one, or ``required`` stopped; a named call keeps the engine's reason).

Pure: no HTTP, no NATS, no vLLM.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvpush.shared import wire
from kvpush.shared.errors import InvalidField

PARSERS = ("hermes",)  # the formats read here (and constrained on decode)
START, END = "<tool_call>", "</tool_call>"
_CALLS = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


def parser_of(setting: str, chat_template: str | None) -> str | None:
    """The tool-call format the gateway reads: the one named, none, or (``auto``) hermes
    when the model's chat template writes Hermes-style ``<tool_call>`` calls."""
    if setting == "none":
        return None
    if setting != "auto":
        return setting
    return "hermes" if chat_template and START in chat_template else None


def tool_calling(body: dict, parser: str | None) -> wire.ToolCalling | None:
    """The request's tools and choice; None when it has none (or chose ``none``: the tools
    are still shown to the model by the chat template, and nothing is read back)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not tools:
        if choice not in (None, "none"):
            raise InvalidField("'tool_choice' needs 'tools'")
        return None
    functions = _functions(tools)
    if choice is None:
        choice = "auto"  # OpenAI's default when tools are given
    if choice == "none":
        return None
    if parser is None:
        raise InvalidField("tool calls need the model's tool-call format: start the gateway with --tool-call-parser "
                           "(as vllm serve needs --enable-auto-tool-choice --tool-call-parser)")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidField(f"'parallel_tool_calls' must be true or false, got {parallel!r}")
    calling = wire.ToolCalling(parser=parser, tools=functions, parallel=parallel)
    if choice in ("auto", "required"):
        calling.choice = choice
        return calling
    name = ((choice or {}).get("function") or {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise InvalidField("'tool_choice' must be \"none\", \"auto\", \"required\" or "
                           "{\"type\": \"function\", \"function\": {\"name\": ...}}")
    if name not in {f.name for f in functions}:
        raise InvalidField(f"'tool_choice' names the function {name!r}, which is not among the tools")
    calling.choice, calling.function = "function", name
    return calling


def _functions(tools: Any) -> list[wire.ToolFunction]:
    if not isinstance(tools, list):
        raise InvalidField("'tools' must be a list")
    functions = []
    for tool in tools:
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" \
                or not isinstance(tool.get("function"), dict):
            raise InvalidField("each tool must be {\"type\": \"function\", \"function\": {\"name\": ..., ...}}; "
                               "kvpush serves function tools")
        try:
            functions.append(msgspec.convert(tool["function"], wire.ToolFunction))
        except msgspec.ValidationError as exc:
            raise InvalidField(f"a tool's function: {exc}") from None
    return functions


def template_tools(calling_or_body: dict) -> list[dict] | None:
    """The tools as the chat template sees them (what vLLM's server passes it)."""
    tools = calling_or_body.get("tools")
    return [{"type": "function", "function": tool["function"]} for tool in tools] if tools else None


@dataclass
class Call:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: "chatcmpl-tool-" + secrets.token_hex(8))

    def as_json(self, index: int | None = None) -> dict:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            out = {"index": index, **out}
        return out


def read(text: str) -> tuple[str | None, list[Call]]:
    """(the content before the first call, the calls), as vLLM's hermes parser reads a
    whole answer: no call, or calls it cannot read, leave the whole text as content."""
    if START not in text:
        return text, []
    try:
        calls = []
        for closed, open_ended in _CALLS.findall(text):
            call = json.loads(closed if closed else open_ended)
            calls.append(Call(call["name"], json.dumps(call["arguments"], ensure_ascii=False)))
    except Exception:  # vLLM: "Error in extracting tool call from response": the text, as is
        return text, []
    content = text[:text.find(START)]
    return content or None, calls


def message(calling: wire.ToolCalling, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
    """The chat message and finish reason of an answer to a request with tools."""
    content, calls = read(text)
    if calling.parallel is False:
        calls = calls[:1]  # vLLM's maybe_filter_parallel_tool_calls
    if calling.choice == "auto":
        if not calls:
            return {"role": "assistant", "content": text}, finish_reason
        if content is not None and not content.strip():
            content = None
        return {"role": "assistant", "content": content, "tool_calls": [c.as_json() for c in calls]}, "tool_calls"
    # required / named: constrained to calls; without one, the text as content
    if not calls and not text.strip():
        content = None
    elif not calls:
        content = text
    shown = {"role": "assistant", "content": content or "", "tool_calls": [c.as_json() for c in calls]}
    if calling.choice == "required" and finish_reason == "stop":
        return shown, "tool_calls"
    return shown, finish_reason


class StreamedCalls:
    """A streamed answer to a request with tools: text before any call streams as content
    (holding back what could be the start of ``<tool_call>``); from the first call on,
    nothing streams until the answer ends, and then its calls go out whole."""

    def __init__(self, calling: wire.ToolCalling):
        self.calling = calling
        self.text = ""  # everything so far
        self.sent = 0  # characters of content sent

    def feed(self, piece: str) -> str:
        """The content that may go out now."""
        self.text += piece
        if self.calling.choice != "auto":
            return ""  # constrained to calls from the first token: nothing is content
        start = self.text.find(START)
        if start >= 0:
            limit = start
        else:
            limit = len(self.text)
            for keep in range(min(len(START) - 1, len(self.text)), 0, -1):  # a partial "<tool_call>"
                if START.startswith(self.text[-keep:]):
                    limit = len(self.text) - keep
                    break
        out = self.text[self.sent:limit] if limit > self.sent else ""
        self.sent = max(self.sent, limit)
        return out

    def finish(self, finish_reason: str | None) -> tuple[str, list[dict], str | None]:
        """(content still to send, the calls' deltas, the finish reason) at the end."""
        shown, reason = message(self.calling, self.text, finish_reason)
        calls = shown.get("tool_calls") or []
        if not calls:
            content = shown.get("content") or ""
            rest = content[self.sent:] if content.startswith(self.text[:self.sent]) else ""
            return rest, [], reason
        return "", [{"index": i, **call} for i, call in enumerate(calls)], reason
