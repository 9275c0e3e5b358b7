"""Turn a raw ``kvpush.generate`` body into a request we can serve, or a RequestError.

Pure: no NATS, no vLLM. The tokenizer is passed in as a function (``load_validator``
reads it, and the limits, from a model folder).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import msgspec

from kvpush.shared import wire
from kvpush.shared.errors import BadJson, EmptyPrompt, InvalidField, PromptTooLong

MAX_REQUEST_ID_LEN = wire.MAX_REQUEST_ID_LEN
DEFAULT_MAX_TOKENS = 128  # when a request does not say, and the context has room
MAX_STOP_STRINGS = 4  # as OpenAI allows
MAX_STOP_LEN = 256


@dataclass(frozen=True)
class ValidRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: wire.SamplingSpec
    transfer_mode: str | None = None


class RequestValidator:
    def __init__(self, tokenize: Callable[[str], list[int]], vocab_size: int, max_model_len: int,
                 max_token_bytes: int = 4):
        """``max_token_bytes``: the most UTF-8 bytes one token of the vocabulary stands for.
        A text prompt longer than ``max_model_len`` of those cannot fit, and is refused
        before the tokenizer (one thread, shared by every request) spends time on it."""
        self.tokenize = tokenize
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_prompt_bytes = max_model_len * max(1, max_token_bytes)

    def validate(self, data: bytes, default_request_id: str | None = None) -> ValidRequest:
        """``default_request_id``: the id of a body that names none (else a new one)."""
        try:
            body = wire.decode_json(data, wire.GenerateRequest)
        except msgspec.ValidationError as exc:
            raise InvalidField(f"invalid request: {exc}") from None
        except msgspec.DecodeError as exc:
            raise BadJson(f"request body is not a JSON object: {exc}") from None
        request_id = body.request_id if body.request_id is not None else (default_request_id or uuid.uuid4().hex)
        if (problem := wire.request_id_problem(request_id)) is not None:
            raise InvalidField(problem)
        if body.prompt is not None and body.prompt_token_ids is not None:
            raise InvalidField("give either 'prompt' or 'prompt_token_ids', not both")
        if body.prompt is None and body.prompt_token_ids is None:
            raise EmptyPrompt("the request has no prompt: give 'prompt' or 'prompt_token_ids'")
        if body.prompt is not None:
            if not body.prompt:
                raise EmptyPrompt("the prompt is an empty string")
            if len(body.prompt) > self.max_prompt_bytes or len(body.prompt.encode()) > self.max_prompt_bytes:
                raise PromptTooLong(
                    f"the prompt is {len(body.prompt.encode())} bytes; no prompt over {self.max_prompt_bytes} bytes "
                    f"fits the model's context of {self.max_model_len} tokens")
            token_ids = self.tokenize(body.prompt)
            if not token_ids:
                raise EmptyPrompt("the prompt has no tokens")
        else:
            token_ids = body.prompt_token_ids
            if not token_ids:
                raise EmptyPrompt("the prompt_token_ids list is empty")
            bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise InvalidField(
                    f"token id {bad} is outside the model's vocabulary (0..{self.vocab_size - 1})"
                )
        if len(token_ids) >= self.max_model_len:
            raise PromptTooLong(
                f"the prompt has {len(token_ids)} tokens but the model's context is "
                f"{self.max_model_len} tokens, and at least one must be left to generate"
            )
        room = self.max_model_len - len(token_ids)
        max_tokens = min(DEFAULT_MAX_TOKENS, room) if body.max_tokens is None else body.max_tokens
        if max_tokens < 1:
            raise InvalidField(f"max_tokens must be at least 1, got {max_tokens}")
        if max_tokens > room:
            raise InvalidField(
                f"the model's context is {self.max_model_len} tokens, but the request asks for "
                f"{len(token_ids) + max_tokens} ({len(token_ids)} in the prompt, {max_tokens} to generate); "
                f"ask for at most {room} tokens")
        if body.temperature < 0:
            raise InvalidField(f"temperature must be 0 or more, got {body.temperature}")
        stop = body.stop or []
        if len(stop) > MAX_STOP_STRINGS or any(not s or len(s) > MAX_STOP_LEN for s in stop):
            raise InvalidField(f"stop takes at most {MAX_STOP_STRINGS} strings of 1 to {MAX_STOP_LEN} characters")
        return ValidRequest(
            request_id=request_id,
            prompt_token_ids=list(token_ids),
            sampling=wire.SamplingSpec(max_tokens, body.temperature, body.ignore_eos, stop=list(stop)),
            transfer_mode=body.transfer_mode,
        )


def request_id_of(data: bytes) -> str:
    """Best effort: the request_id a client sent, even in a body we reject."""
    try:
        value = json.loads(data)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return ""
    if isinstance(value, dict) and isinstance(value.get("request_id"), str):
        request_id = value["request_id"][:MAX_REQUEST_ID_LEN]
        try:
            request_id.encode()  # a lone surrogate cannot go back out in a reply
        except UnicodeEncodeError:
            return ""
        return request_id
    return ""


def load_validator(model: str, max_model_len: int) -> RequestValidator:
    """A validator with the tokenizer and limits of the model in folder ``model``.

    The tokenizer is the one vLLM loads from the folder (transformers' AutoTokenizer), so a
    text prompt becomes the ids a single vLLM instance would make of it; tokenizer.json
    read on its own can differ (transformers picks the tokenizer class from the model type).
    """
    from transformers import AutoTokenizer

    folder = Path(model)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    config = json.loads((folder / "config.json").read_text())
    vocab_size = int(config["vocab_size"])
    max_len = min(max_model_len, int(config.get("max_position_embeddings", max_model_len)))
    return RequestValidator(tokenizer.encode, vocab_size, max_len, max_token_bytes(tokenizer))


def max_token_bytes(tokenizer) -> int:
    """An upper bound on the UTF-8 bytes any one token of ``tokenizer`` stands for: the
    longest vocabulary entry's spelling, in UTF-8 (a byte-level BPE spells each byte as one
    character of at most two bytes, so this over-counts, which a bound may). At least 4."""
    return max(4, *(len(token.encode()) for token in tokenizer.get_vocab()))
