"""One answer of an OpenAI-compatible server in a comparable form, and what differs between
two: token ids, text and finish reasons exactly, logprobs within a tolerance, usage
exactly (``cached_tokens`` where the row asks). Pure: JSON in, sentences out.

Streamed answers are gathered first (``gather``): the events' pieces joined per choice,
the usage from the last event that has one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

LOGPROB_TOLERANCE = 1e-4


@dataclass
class Choice:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    # each token: (token, logprob, {candidate: logprob})
    logprobs: list[tuple[str, float | None, dict[str, float]]] | None = None
    tool_calls: list[tuple[str, Any]] = field(default_factory=list)  # (function name, parsed arguments)
    prompt_token_ids: list[int] | None = None  # completions, with return_token_ids
    # each prompt position: {token id: logprob}, the first None (completions: per choice)
    prompt_logprobs: list[dict[str, float] | None] | None = None


@dataclass
class Answer:
    choices: list[Choice]
    usage: dict[str, int | None]


def gather(endpoint: str, events: list[dict]) -> dict:
    """A streamed answer's events as the one object the same request without ``stream``
    gets: each choice's text, token ids and logprobs joined, its last finish reason."""
    choices: dict[int, dict] = {}
    usage = None
    for event in events:
        if event.get("usage"):
            usage = event["usage"]
        for piece in event.get("choices") or []:
            choice = choices.setdefault(piece.get("index", 0), {"index": piece.get("index", 0), "text": "",
                                                                "token_ids": [], "finish_reason": None,
                                                                "logprobs": None, "tool_calls": []})
            text = piece.get("text") if endpoint == "completions" else (piece.get("delta") or {}).get("content")
            choice["text"] += text or ""
            choice["token_ids"] += piece.get("token_ids") or []
            if piece.get("prompt_token_ids") is not None:  # on a choice's first event
                choice["prompt_token_ids"] = piece["prompt_token_ids"]
            choice["tool_calls"] += (piece.get("delta") or {}).get("tool_calls") or []
            if piece.get("finish_reason") is not None:
                choice["finish_reason"] = piece["finish_reason"]
            if piece.get("logprobs"):
                choice["logprobs"] = _join_logprobs(choice["logprobs"], piece["logprobs"])
    whole = []
    for index in sorted(choices):
        c = choices[index]
        if endpoint == "chat":
            c["message"] = {"content": c.pop("text"), "tool_calls": c.pop("tool_calls") or None}
        whole.append(c)
    return {"choices": whole, "usage": usage}


def _join_logprobs(so_far: dict | None, more: dict) -> dict:
    if so_far is None:
        return json.loads(json.dumps(more))
    for key, values in more.items():
        if isinstance(values, list):
            so_far.setdefault(key, []).extend(values)
    return so_far


def answer(endpoint: str, body: dict) -> Answer:
    """The parts of a (gathered) response object that the comparison reads."""
    choices = []
    for raw in sorted(body.get("choices") or [], key=lambda c: c.get("index", 0)):
        choice = Choice(token_ids=list(raw.get("token_ids") or []), finish_reason=raw.get("finish_reason"))
        if endpoint == "completions":
            choice.text = raw.get("text") or ""
            choice.logprobs = _completion_logprobs(raw.get("logprobs"))
            choice.prompt_token_ids = raw.get("prompt_token_ids")
            choice.prompt_logprobs = _prompt_logprobs(raw.get("prompt_logprobs"))
        else:
            message = raw.get("message") or {}
            choice.text = message.get("content") or ""
            choice.logprobs = _chat_logprobs(raw.get("logprobs"))
            choice.prompt_logprobs = _prompt_logprobs(body.get("prompt_logprobs"))  # the response's
            for call in message.get("tool_calls") or []:
                function = call.get("function") or {}
                try:
                    arguments = json.loads(function.get("arguments") or "null")
                except ValueError:
                    arguments = function.get("arguments")
                choice.tool_calls.append((function.get("name"), arguments))
        choices.append(choice)
    usage = body.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    return Answer(choices, {"prompt_tokens": usage.get("prompt_tokens"),
                            "completion_tokens": usage.get("completion_tokens"),
                            "total_tokens": usage.get("total_tokens"),
                            "cached_tokens": details.get("cached_tokens")})


def _prompt_logprobs(positions: list | None):
    if positions is None:
        return None
    return [None if position is None else {token: (entry or {}).get("logprob") for token, entry in position.items()}
            for position in positions]


def _completion_logprobs(logprobs: dict | None):
    if not logprobs:
        return None
    return [(token, value, dict(top or {})) for token, value, top in
            zip(logprobs.get("tokens") or [], logprobs.get("token_logprobs") or [], logprobs.get("top_logprobs") or [])]


def _chat_logprobs(logprobs: dict | None):
    if not logprobs or logprobs.get("content") is None:
        return None
    return [(entry.get("token"), entry.get("logprob"), {c.get("token"): c.get("logprob")
                                                        for c in entry.get("top_logprobs") or []})
            for entry in logprobs["content"]]


def differences(expected: Answer, got: Answer, compare_cached: bool = False,
                tolerance: float = LOGPROB_TOLERANCE) -> list[str]:
    """Each way ``got`` differs from ``expected``, as a sentence; none when they agree."""
    found = []
    if len(expected.choices) != len(got.choices):
        found.append(f"{len(got.choices)} choices, not {len(expected.choices)}")
    for i, (want, have) in enumerate(zip(expected.choices, got.choices)):
        where = f"choice {i}: " if len(expected.choices) > 1 else ""
        if want.token_ids != have.token_ids:
            found.append(f"{where}token ids {have.token_ids}, not {want.token_ids}")
        if want.text != have.text:
            found.append(f"{where}text {have.text!r}, not {want.text!r}")
        if want.finish_reason != have.finish_reason:
            found.append(f"{where}finish_reason {have.finish_reason!r}, not {want.finish_reason!r}")
        if want.tool_calls != have.tool_calls:
            found.append(f"{where}tool calls {have.tool_calls}, not {want.tool_calls}")
        found += [where + d for d in _logprob_differences(want.logprobs, have.logprobs, tolerance)]
        if want.prompt_token_ids != have.prompt_token_ids:
            found.append(f"{where}prompt token ids {have.prompt_token_ids}, not {want.prompt_token_ids}")
        found += [where + d for d in _prompt_logprob_differences(want.prompt_logprobs, have.prompt_logprobs,
                                                                   tolerance)]
    names = ["prompt_tokens", "completion_tokens", "total_tokens"] + (["cached_tokens"] if compare_cached else [])
    for name in names:
        if expected.usage.get(name) != got.usage.get(name):
            found.append(f"usage {name} {got.usage.get(name)}, not {expected.usage.get(name)}")
    return found


def _logprob_differences(want, have, tolerance: float) -> list[str]:
    if (want is None) != (have is None):
        return [f"logprobs {'missing' if have is None else 'not asked for'}"]
    if want is None:
        return []
    if len(want) != len(have):
        return [f"logprobs for {len(have)} tokens, not {len(want)}"]
    found = []
    for position, ((token, value, top), (h_token, h_value, h_top)) in enumerate(zip(want, have)):
        if token != h_token:
            found.append(f"logprobs token {position}: {h_token!r}, not {token!r}")
        if not _close(value, h_value, tolerance):
            found.append(f"logprob {position}: {h_value}, not {value}")
        if set(top) != set(h_top):
            found.append(f"top logprobs {position}: {sorted(h_top)}, not {sorted(top)}")
        elif not all(_close(top[k], h_top[k], tolerance) for k in top):
            found.append(f"top logprobs {position}: values differ by more than {tolerance:g}")
    return found


def _prompt_logprob_differences(want, have, tolerance: float) -> list[str]:
    if (want is None) != (have is None):
        return [f"prompt logprobs {'missing' if have is None else 'not asked for'}"]
    if want is None:
        return []
    if len(want) != len(have):
        return [f"prompt logprobs for {len(have)} positions, not {len(want)}"]
    found = []
    for position, (expected, got) in enumerate(zip(want, have)):
        if expected is None and got is None:
            continue
        if (expected is None) != (got is None) or set(expected or {}) != set(got or {}):
            found.append(f"prompt logprobs {position}: tokens {sorted(got or {})}, not {sorted(expected or {})}")
        elif not all(_close(expected[k], got[k], tolerance) for k in expected):
            found.append(f"prompt logprobs {position}: values differ by more than {tolerance:g}")
    return found


def _close(a: float | None, b: float | None, tolerance: float) -> bool:
    if a is None or b is None:
        return a is b
    return abs(a - b) <= tolerance
