"""kvpush's replies as OpenAI's objects: a whole response's choices, a stream's chunks,
each choice's ``logprobs`` object (and the prompt's), ``usage``, the request's path report
(the ``kvpush`` object and the ``X-Kvpush-Path`` header), and error objects.

They are written as vLLM's OpenAI server writes them, field by field (``kvpush
conformance`` compares them). Pure: no HTTP, no NATS. ``requests`` parses the request
they answer; ``serving`` sends them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvpush.services.gateway import tool_calls
from kvpush.services.gateway.requests import Kind, OpenAiRequest
from kvpush.shared import wire
from kvpush.shared.errors import http_status


@dataclass
class Answer:
    """One choice of a whole response: its text, token ids and ``logprobs`` object."""

    text: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: dict | None = None


def response_id(kind: Kind, request_id: str) -> str:
    return ("cmpl-" if kind == "completion" else "chatcmpl-") + request_id


LOWEST_LOGPROB = -9999.0  # vLLM's server's stand-in for -inf


def usage(final: wire.FinalReply) -> dict:
    """OpenAI's usage; ``prompt_tokens_details.cached_tokens`` when the engine that computed
    the prompt said how many of its tokens it found cached (as ``vllm serve
    --enable-prompt-tokens-details``)."""
    prompt, completion = final.usage.prompt_tokens, final.usage.completion_tokens
    out: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                           "total_tokens": prompt + completion}
    if final.usage.cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": final.usage.cached_tokens}
    return out


def prompt_logprobs_object(positions: list[list[wire.TokenLogprob] | None] | None) -> list | None:
    """vLLM's ``prompt_logprobs``: per prompt position ``{token id: {logprob, rank,
    decoded_token}}``, the first None."""
    if positions is None:
        return None
    return [None if position is None else
            {str(c.token_id): {"logprob": max(c.logprob, LOWEST_LOGPROB), "rank": c.rank, "decoded_token": c.token}
             for c in position}
            for position in positions]


def logprobs_object(request: OpenAiRequest, token_ids: list[int], positions: list | None,
                    text_offset: int = 0, unscored: dict[int, str] | None = None) -> dict | None:
    """A choice's ``logprobs`` for these tokens, as vLLM's server writes them
    (``_create_completion_logprobs``, ``_create_chat_logprobs``): over each position's
    candidates in the engine's order, the sampled token first. ``text_offset``: the
    characters of the answer before these tokens (completions). ``unscored``: the text of
    tokens at positions without logprobs (an echoed prompt's first), by position."""
    if request.logprobs is None:
        return None
    positions = positions or []
    if request.kind == "completion":
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        for i, token_id in enumerate(token_ids):
            candidates = (positions[i] if i < len(positions) else None) or []
            sampled = next((c for c in candidates if c.token_id == token_id), None)
            token = (sampled.token if sampled is not None else (unscored or {}).get(i)) or ""
            tokens.append(token)
            token_logprobs.append(sampled.logprob if sampled is not None else None)
            top_logprobs.append({(c.token or ""): max(c.logprob, LOWEST_LOGPROB)
                                 for place, c in enumerate(candidates) if place <= request.logprobs}
                                if sampled is not None else None)
            offsets.append(text_offset)
            text_offset += len(token)
        return {"text_offset": offsets, "token_logprobs": token_logprobs, "tokens": tokens,
                "top_logprobs": top_logprobs}
    content = []
    for i, token_id in enumerate(token_ids):
        candidates = positions[i] if i < len(positions) else []
        sampled = next((c for c in candidates if c.token_id == token_id), None)
        token = (sampled.token if sampled is not None else None) or ""
        entry: dict[str, Any] = {"token": token, "logprob": LOWEST_LOGPROB, "bytes": _bytes(token),
                                 "top_logprobs": []}
        if sampled is not None:
            entry["logprob"] = max(sampled.logprob, LOWEST_LOGPROB)
            entry["bytes"] = None if sampled.token is None else _bytes(sampled.token)
            entry["top_logprobs"] = [{"token": c.token or "", "logprob": max(c.logprob, LOWEST_LOGPROB),
                                      "bytes": _bytes(c.token or "")}
                                     for place, c in enumerate(candidates) if place < request.logprobs]
        content.append(entry)
    return {"content": content}


def _bytes(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="replace"))


def chunk(request: OpenAiRequest, request_id: str, text: str, finish_reason: str | None = None,
          first: bool = False, token_ids: list[int] | None = None, logprobs: dict | None = None,
          index: int = 0, prompt_token_ids: list[int] | None = None, tool_calls: list[dict] | None = None) -> dict:
    """One server-sent event's object, for choice ``index``; ``prompt_token_ids`` on a
    completion choice's first event when the client asked for token ids; a chat's
    ``tool_calls`` deltas (each whole) in its delta."""
    if request.kind == "completion":
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        if request.return_token_ids and prompt_token_ids is not None:
            choice["prompt_token_ids"] = prompt_token_ids
        kind = "text_completion"
    else:
        delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
        if finish_reason is not None and not text:
            delta = {}
        if tool_calls:
            delta = {"role": "assistant", "tool_calls": tool_calls} if first else {"tool_calls": tool_calls}
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        kind = "chat.completion.chunk"
    if request.return_token_ids:
        choice["token_ids"] = token_ids or []
    event = {"id": response_id(request.kind, request_id), "object": kind, "created": request.created,
             "model": request.model, "choices": [choice]}
    return event


def usage_chunk(request: OpenAiRequest, request_id: str, final: wire.FinalReply) -> dict:
    """The last event before ``[DONE]`` with ``stream_options.include_usage``: no choices."""
    kind = "text_completion" if request.kind == "completion" else "chat.completion.chunk"
    return {"id": response_id(request.kind, request_id), "object": kind, "created": request.created,
            "model": request.model, "choices": [], "usage": usage(final)}


PATH_HEADER = "X-Kvpush-Path"
# The header's fields, in order (the path report's reason is free text: the body's only).
_HEADER_FIELDS = ("mode", "chosen_by", "prefill_worker", "decode_worker", "attempt", "moves", "takeovers",
                  "kv_policy", "prompt_tokens", "prefill_computed_tokens", "received_tokens", "received_blocks",
                  "received_bytes", "decode_cached_tokens", "decode_computed_tokens", "recomputed_tokens", "kv_checksum",
                  "kv_failure", "prefix_source", "fetched_tokens", "fetched_from")


def path_object(final: wire.FinalReply) -> dict | None:
    """The response's ``kvpush`` object: the request's path report (``wire.PathReport``);
    None from a decode that predates it."""
    return msgspec.to_builtins(final.path) if final.path is not None else None


def path_header(final: wire.FinalReply) -> dict[str, str]:
    """``X-Kvpush-Path: mode=push; chosen_by=auto; prefill_worker=...; ...`` for a whole
    (unstreamed) answer; a stream's headers go before its path is known (its ``kvpush``
    object comes in its last event instead). Unknown counts are left out."""
    if final.path is None:
        return {}
    fields = msgspec.structs.asdict(final.path)
    return {PATH_HEADER: "; ".join(f"{name}={fields[name]}" for name in _HEADER_FIELDS
                                   if fields[name] is not None and fields[name] != "")}


def parse_path_header(value: str) -> dict[str, str]:
    """The header back as {field: value} (for clients and tests)."""
    return dict(part.split("=", 1) for part in value.split("; ") if "=" in part)


def finish_reasons(final: wire.FinalReply) -> list[str | None]:
    """Each choice's finish reason, by index."""
    return list(final.finish_reasons) if final.finish_reasons else [final.finish_reason]


def response(request: OpenAiRequest, request_id: str, answers: list[Answer], final: wire.FinalReply,
             prompt_logprobs: list | None = None, prompt_token_ids: list[int] | None = None) -> dict:
    """The whole answer, for a request without ``stream``: one choice per answer.
    ``prompt_logprobs``: vLLM's object (``prompt_logprobs_object``), on each completion
    choice or on the chat response, when the client asked for them."""
    choices = []
    for index, (answer, finish) in enumerate(zip(answers, finish_reasons(final))):
        if request.kind == "completion":
            choice = {"index": index, "text": answer.text, "logprobs": answer.logprobs, "finish_reason": finish}
            if prompt_logprobs is not None:  # asked for, or by echo with logprobs (as vLLM)
                choice["prompt_logprobs"] = prompt_logprobs
        else:
            shown = {"role": "assistant", "content": answer.text}
            if request.tool_calling is not None:  # the calls read out of the text, as vLLM's parser reads them
                shown, finish = tool_calls.message(request.tool_calling, answer.text, finish)
            choice = {"index": index, "message": shown, "logprobs": answer.logprobs, "finish_reason": finish}
        if request.return_token_ids:
            choice["token_ids"] = answer.token_ids
            if request.kind == "completion" and prompt_token_ids is not None:
                choice["prompt_token_ids"] = prompt_token_ids
        choices.append(choice)
    kind = "text_completion" if request.kind == "completion" else "chat.completion"
    body = {"id": response_id(request.kind, request_id), "object": kind, "created": request.created,
            "model": request.model, "choices": choices, "usage": usage(final)}
    if request.kind == "chat" and request.prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs
    if (path := path_object(final)) is not None:
        body["kvpush"] = path
    return body


ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "not_found_error",
               413: "invalid_request_error", 429: "rate_limit_error", 499: "cancelled", 503: "service_unavailable",
               504: "timeout"}


def error(code: str, message: str, param: str | None = None, status: int | None = None) -> tuple[int, dict]:
    """(HTTP status, OpenAI error object) for a kvpush error code; ``status`` for a code
    that is the gateway's own (``kvpush.services.gateway.errors``), not the wire's."""
    status = status or http_status(code)
    return status, {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"),
                              "param": param, "code": code}}
