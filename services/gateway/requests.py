"""OpenAI's completions and chat completions bodies, parsed into kvpush requests.

What a body may hold: the fields kvpush serves (``prompt``/``messages``, ``max_tokens``,
``max_completion_tokens``, ``n``, ``stream``, ``stream_options``, kvpush's own
``transfer_mode`` and ``kv_policy``, ``logprobs``/``top_logprobs``, ``prompt_logprobs``, a completion's
``echo``, a chat's ``tools``/``tool_choice``/``parallel_tool_calls``
(``kvpush.services.gateway.tool_calls``), and the sampling fields of ``SAMPLING``, which go
on the wire with vLLM's names and meaning and are checked by the scheduler,
``kvpush.services.scheduler.validation``); fields that never change the output, ignored
(``user``, ``metadata``, ...); and fields that would change it but are not served,
accepted only at their neutral value (``best_of``, which vLLM's V1 engine dropped; a
chat's ``echo``; ``tools`` on completions). ``response_format`` (``json_object``,
``json_schema``) and vLLM's ``structured_outputs`` constrain the answer on decode, which
samples all of it. Anything else is refused with a sentence that names it, as is a
neutral-only field at another value.

``parse``: a body as an ``OpenAiRequest`` (the ``GenerateRequest`` fields, and what the
response shows); the ``/tokenize`` and ``/detokenize`` bodies too. Pure: no HTTP, no NATS.
Why a mapping of our own, not vLLM's serving layer: ``kvpush.services.gateway``'s docstring.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

import msgspec

from kvpush.services.gateway import tool_calls
from kvpush.shared import wire
from kvpush.shared.errors import EmptyPrompt, InvalidField, NotFound

Kind = Literal["completion", "chat"]

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's (and vLLM's) for /v1/completions
DEFAULT_TEMPERATURE = 1.0  # OpenAI's; vLLM's too for a model without generation defaults


def _neutral(*values) -> Callable[[Any], bool]:
    return lambda v: v in values


# Fields that would change the output: served only at these values.
NEUTRAL: dict[str, Callable[[Any], bool]] = {
    "best_of": _neutral(None, 1),
    "echo": _neutral(None, False),  # chats: continuing the last message is not served
    "suffix": _neutral(None, ""),
    "tools": lambda v: not v,
    "tool_choice": _neutral(None, "none", "auto"),
    "skip_special_tokens": _neutral(None, True),
    "spaces_between_special_tokens": _neutral(None, True),
    "add_generation_prompt": _neutral(None, True),
}
# Fields that never change the output.
IGNORED = {"user", "metadata", "store", "service_tier", "parallel_tool_calls", "priority", "request_id"}
# Sampling: carried as they are to the engine that samples (vLLM's SamplingParams names).
SAMPLING = ("top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "seed",
            "min_tokens", "logit_bias", "allowed_token_ids", "bad_words", "stop_token_ids",
            "include_stop_str_in_output")
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")  # wire.StructuredOutput's
COMMON = {"model", "temperature", "ignore_eos", "stop", "stream", "stream_options", "transfer_mode", "kv_policy",
          "return_token_ids", "response_format", "structured_outputs", "n", *SAMPLING}
COMPLETION_FIELDS = COMMON | {"prompt", "max_tokens", "logprobs", "prompt_logprobs", "echo"}
CHAT_FIELDS = COMMON | {"messages", "max_tokens", "max_completion_tokens", "logprobs", "top_logprobs",
                        "prompt_logprobs", "tools", "tool_choice", "parallel_tool_calls"}
# vLLM 0.32 has no best_of: its V1 engine dropped it, and its server ignores the field as
# unknown. kvpush refuses it instead of ignoring a field that asks for other answers.
BEST_OF_REFUSED = ("'best_of' is not served: vLLM's V1 engine has no best_of (its server ignores the field, and "
                   "answers as if it were absent); leave it out, or ask for n answers with logprobs and pick")


@dataclass
class OpenAiRequest:
    kind: Kind
    model: str
    generate: dict  # a kvpush GenerateRequest body, less the prompt when ``messages`` holds it
    messages: list[dict] | None = None  # chat: rendered with the model's chat template
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False  # vLLM's extension: each choice carries its token ids
    logprobs: int | None = None  # each token's logprob, with this many of the most likely ones
    n: int = 1  # answers (choices) sampled from the prompt
    prompt_logprobs: int | None = None  # as asked: each prompt position's, in the response
    tools: list[dict] | None = None  # chat: the functions, for the chat template
    tool_calling: wire.ToolCalling | None = None  # chat: calls to read out of the answer
    echo: bool = False  # completions: the prompt before each choice's text (and logprobs)
    created: int = field(default_factory=lambda: int(time.time()))



def parse(kind: Kind, body: Any, served_model: str, tool_parser: str | None = None) -> OpenAiRequest:
    """The request, or a ``RequestError`` that says what is wrong with it. ``tool_parser``:
    the model's tool-call format (``tool_calls.PARSERS``), None if it has none."""
    if not isinstance(body, dict):
        raise InvalidField("the request body must be a JSON object")
    allowed = COMPLETION_FIELDS if kind == "completion" else CHAT_FIELDS
    for name, value in body.items():
        if name in allowed or name in IGNORED:
            continue
        if name in NEUTRAL:
            if name == "best_of" and not NEUTRAL[name](value):
                raise InvalidField(BEST_OF_REFUSED)
            if not NEUTRAL[name](value):
                raise InvalidField(f"'{name}': {value!r} is not supported by kvpush (it would change the output); "
                                   "leave it out or send its neutral value")
            continue
        raise InvalidField(f"unknown field '{name}'")
    _check_model(body, served_model)
    temperature = _number(body, "temperature", DEFAULT_TEMPERATURE)
    generate: dict[str, Any] = {"temperature": temperature}
    for name in SAMPLING:
        if body.get(name) is not None:
            generate[name] = body[name]
    structured = _structured_outputs(body.get("response_format"), body.get("structured_outputs"))
    if structured is not None:
        generate["structured_outputs"] = structured
    for flag in ("ignore_eos",):
        if body.get(flag) is not None:
            generate[flag] = _bool(body, flag)
    if body.get("transfer_mode") is not None:
        if body["transfer_mode"] not in ("push", "pull", "local", "auto"):
            raise InvalidField("'transfer_mode' must be \"push\", \"pull\", \"local\" or \"auto\"")
        generate["transfer_mode"] = body["transfer_mode"]
    if body.get("kv_policy") is not None:
        if body["kv_policy"] not in wire.KV_POLICIES:
            raise InvalidField("'kv_policy' must be \"recompute\" or \"fail\"")
        generate["kv_policy"] = body["kv_policy"]
    stop = _stop(body.get("stop"))
    if stop:
        generate["stop"] = stop
    stream = _bool(body, "stream") if body.get("stream") is not None else False
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise InvalidField("'stream_options' must be an object")
    options = options or {}
    if options.get("continuous_usage_stats"):
        raise InvalidField("'stream_options.continuous_usage_stats' is not supported; include_usage is")
    request = OpenAiRequest(kind, served_model, generate, stream=stream,
                            include_usage=bool(options.get("include_usage")),
                            return_token_ids=bool(body.get("return_token_ids")))
    if body.get("n") is not None:
        n = body["n"]
        if not isinstance(n, int) or isinstance(n, bool):
            raise InvalidField(f"'n' must be an integer, got {n!r}")
        request.n = generate["n"] = n  # bounds: the scheduler's
    request.logprobs = _logprobs(kind, body)
    if request.logprobs is not None:
        generate["logprobs"] = request.logprobs
    _prompt_logprobs(kind, body, request)
    if kind == "completion":
        _completion_prompt(body.get("prompt"), generate)
        max_tokens = body.get("max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS)
    else:
        request.messages = _messages(body.get("messages"))
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        request.tool_calling = tool_calls.tool_calling(body, tool_parser)
        if body.get("tools"):
            request.tools = tool_calls.template_tools(body)
        if request.tool_calling is not None:
            generate["tool_calling"] = msgspec.to_builtins(request.tool_calling)
    if max_tokens is not None:
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool):
            raise InvalidField(f"'max_tokens' must be an integer, got {max_tokens!r}")
        generate["max_tokens"] = max_tokens
    return request


def _structured_outputs(response_format: Any, structured: Any) -> dict | None:
    """OpenAI's ``response_format`` (and vLLM's own ``structured_outputs``) as the wire's
    ``StructuredOutput``; ``response_format`` wins where both are given, as in vLLM."""
    if structured is not None and not isinstance(structured, dict):
        raise InvalidField("'structured_outputs' must be an object")
    if response_format is None:
        return structured
    if not isinstance(response_format, dict) or not isinstance(response_format.get("type"), str):
        raise InvalidField("'response_format' must be an object with a 'type'")
    kind = response_format["type"]
    if kind == "text":
        return structured
    options = {k: v for k, v in (structured or {}).items() if k not in STRUCTURED_KINDS}  # whitespace, ...
    if kind == "json_object":
        return {**options, "json_object": True}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise InvalidField("'response_format' of type json_schema needs 'json_schema': {\"name\": ..., "
                               "\"schema\": {...}}")
        return {**options, "json": spec["schema"]}
    raise InvalidField(f"'response_format' type {kind!r} is not supported by kvpush "
                       "(text, json_object and json_schema are)")


def _logprobs(kind: Kind, body: dict) -> int | None:
    """How many of the most likely tokens to report beside each sampled one (None: no
    logprobs). Completions say it in ``logprobs``; chats turn ``logprobs`` on and say it in
    ``top_logprobs``."""
    if kind == "completion":
        value = body.get("logprobs")
        if value is None or value is False:
            return None
        if not isinstance(value, int) or isinstance(value, bool):
            raise InvalidField(f"'logprobs' must be an integer, got {value!r}")
        return value
    top = body.get("top_logprobs")
    if top is not None and (not isinstance(top, int) or isinstance(top, bool)):
        raise InvalidField(f"'top_logprobs' must be an integer, got {top!r}")
    if body.get("logprobs") is None or body.get("logprobs") is False:
        if top:
            raise InvalidField("'top_logprobs' needs 'logprobs': true")
        return None
    _bool(body, "logprobs")
    return top or 0


def _prompt_logprobs(kind: Kind, body: dict, request: OpenAiRequest) -> None:
    """``prompt_logprobs`` (computed where the prompt is; bounds: the scheduler's) and a
    completion's ``echo``, which with ``logprobs`` asks for the prompt's too, as vLLM reads them."""
    if kind == "completion" and body.get("echo") is not None:
        request.echo = _bool(body, "echo")
    value = body.get("prompt_logprobs")
    if value is not None:
        if not isinstance(value, int) or isinstance(value, bool):
            raise InvalidField(f"'prompt_logprobs' must be an integer, got {value!r}")
        if request.stream and value != 0:
            raise InvalidField("'prompt_logprobs' are not available when 'stream' is true")
        request.prompt_logprobs = value
    wanted = value if value is not None else (request.logprobs if request.echo else None)
    if wanted is not None:
        request.generate["prompt_logprobs"] = wanted


def _number(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise InvalidField(f"'{name}' must be a number, got {value!r}")
    return float(value)


def _bool(body: dict, name: str) -> bool:
    if not isinstance(body[name], bool):
        raise InvalidField(f"'{name}' must be true or false, got {body[name]!r}")
    return body[name]


def _stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return stop
    raise InvalidField("'stop' must be a string or a list of strings")


def _completion_prompt(prompt: Any, generate: dict) -> None:
    """A string, a list of token ids, or a list holding one of those (one prompt: n=1)."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > 1:
            raise InvalidField(f"'prompt' holds {len(prompt)} prompts; kvpush serves one per request")
        prompt = prompt[0]
    if prompt is None or prompt == "" or prompt == []:
        raise EmptyPrompt("the request has no prompt")
    if isinstance(prompt, str):
        generate["prompt"] = prompt
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        generate["prompt_token_ids"] = prompt
    else:
        raise InvalidField("'prompt' must be a string or a list of token ids")


def _messages(messages: Any) -> list[dict]:
    """The chat as its template reads it: text content; an assistant's earlier tool calls
    (arguments as objects, as vLLM hands them to templates) and a tool's answers."""
    if not isinstance(messages, list) or not messages:
        raise EmptyPrompt("'messages' must be a non-empty list")
    out = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidField("each message must be an object with a 'role'")
        calls = message.get("tool_calls")
        if message["role"] == "assistant" and calls:
            out.append({"role": "assistant", "content": _text(message.get("content") or ""),
                        "tool_calls": _earlier_calls(calls)})
            continue
        if message["role"] == "tool":
            shown = {"role": "tool", "content": _text(message.get("content"))}
            if isinstance(message.get("tool_call_id"), str):
                shown["tool_call_id"] = message["tool_call_id"]
            out.append(shown)
            continue
        out.append({"role": message["role"], "content": _text(message.get("content"))})
    return out


def _earlier_calls(calls: Any) -> list[dict]:
    if not isinstance(calls, list):
        raise InvalidField("an assistant message's 'tool_calls' must be a list")
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InvalidField("each earlier tool call must be {\"type\": \"function\", \"function\": "
                               "{\"name\": ..., \"arguments\": ...}}")
        arguments = function.get("arguments") or "{}"
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                raise InvalidField(f"the arguments of an earlier call to {function['name']!r} are not JSON") from None
        out.append({"id": call.get("id"), "type": "function",
                    "function": {"name": function["name"], "arguments": arguments}})
    return out


def _text(content: Any) -> str:
    """A message's content as text: a string, or a list of text parts."""
    if isinstance(content, list):  # content parts: text only
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidField("message content parts must be {\"type\": \"text\", \"text\": ...}; "
                                   "kvpush serves text only")
            texts.append(part["text"])
        content = "".join(texts)
    if not isinstance(content, str):
        raise InvalidField("a message's 'content' must be a string or a list of text parts")
    return content

# ------------------------------------------------------------------ /tokenize, /detokenize

@dataclass
class TokenizeRequest:
    """vLLM's ``/tokenize``: a text (``prompt``) or a chat (``messages``, through the chat
    template)."""

    prompt: str | None = None
    messages: list[dict] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


def tokenize_request(body: Any, served_model: str) -> TokenizeRequest:
    if not isinstance(body, dict):
        raise InvalidField("the request body must be a JSON object")
    _check_model(body, served_model)
    known = {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt", "return_token_strs"}
    unknown = sorted(set(body) - known)
    if unknown:
        raise InvalidField(f"unknown field '{unknown[0]}'")
    if body.get("return_token_strs"):
        raise InvalidField("'return_token_strs' is not supported by kvpush")
    request = TokenizeRequest()
    for flag in ("add_special_tokens", "add_generation_prompt"):
        if body.get(flag) is not None:
            setattr(request, flag, _bool(body, flag))
    if ("prompt" in body) == ("messages" in body):
        raise InvalidField("give either 'prompt' or 'messages'")
    if "messages" in body:
        request.messages = _messages(body["messages"])
    elif isinstance(body["prompt"], str):
        request.prompt = body["prompt"]
    else:
        raise InvalidField("'prompt' must be a string")
    return request


def detokenize_request(body: Any, served_model: str, vocab_size: int) -> list[int]:
    if not isinstance(body, dict):
        raise InvalidField("the request body must be a JSON object")
    _check_model(body, served_model)
    unknown = sorted(set(body) - {"model", "tokens"})
    if unknown:
        raise InvalidField(f"unknown field '{unknown[0]}'")
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise InvalidField("'tokens' must be a list of token ids")
    bad = next((t for t in tokens if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidField(f"token id {bad} is outside the model's vocabulary (0..{vocab_size - 1})")
    return tokens


def _check_model(body: dict, served_model: str) -> None:
    model = body.get("model")
    if model is not None and model != served_model:
        raise NotFound(f"the model '{model}' does not exist here; this server serves '{served_model}'")
