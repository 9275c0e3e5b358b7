"""Turn a raw ``kvpush.generate`` body into a request we can serve, or a RequestError.

Pure: no NATS, no vLLM. The tokenizer is passed in as a function (``load_validator``
reads it, and the limits, from a model folder).
"""

from __future__ import annotations

import json
import math
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
MAX_BAD_WORDS = 64
MAX_TEMPERATURE = 2.0  # vLLM's bound
MAX_LOGIT_BIAS = 100.0  # a bias beyond it is clamped to it, as vLLM's SamplingParams.from_optional does
MAX_LOGPROBS = 20  # vLLM's default max_logprobs, which kvpush's engines keep
# prompt tokens x (prompt_logprobs + 1): what one chunk carries back (about 30 bytes of JSON
# each), well inside a NATS message.
MAX_PROMPT_LOGPROB_ENTRIES = 16384
# Answers from one prompt (n): each is a sequence on the decode engine, which runs at most
# 16 at once (kvpush's max_num_seqs), so more could never run together.
MAX_N = 16
MAX_STRUCTURED_BYTES = 64 * 1024  # a JSON schema, regex, grammar or choice list, as JSON
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # what vLLM's server takes (and its engine's transport carries)


@dataclass(frozen=True)
class ValidRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: wire.SamplingSpec
    transfer_mode: str | None = None
    kv_policy: str | None = None  # None: the scheduler's --kv-policy


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
        return ValidRequest(
            request_id=request_id,
            prompt_token_ids=list(token_ids),
            sampling=sampling_of(body, max_tokens, self.vocab_size, len(token_ids)),
            transfer_mode=body.transfer_mode,
            kv_policy=body.kv_policy,
        )


def sampling_of(body: wire.GenerateRequest, max_tokens: int, vocab_size: int, prompt_tokens: int) -> wire.SamplingSpec:
    """The request's sampling, within the bounds vLLM's SamplingParams (and its input
    processor) set, checked here so that a request is refused with a sentence before any
    engine sees it, never failed by the engine halfway through the split."""
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        if not math.isfinite(getattr(body, name)):
            raise InvalidField(f"{name} must be a finite number, got {getattr(body, name)}")
    if not 0 <= body.temperature <= MAX_TEMPERATURE:
        raise InvalidField(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {body.temperature}")
    if not 0 < body.top_p <= 1:
        raise InvalidField(f"top_p must be in (0, 1], got {body.top_p}")
    if body.top_k < -1:
        raise InvalidField(f"top_k must be 0 (every token; -1 too) or at least 1, got {body.top_k}")
    if not 0 <= body.min_p <= 1:
        raise InvalidField(f"min_p must be in [0, 1], got {body.min_p}")
    for name in ("presence_penalty", "frequency_penalty"):
        if not -2 <= getattr(body, name) <= 2:
            raise InvalidField(f"{name} must be in [-2, 2], got {getattr(body, name)}")
    if body.repetition_penalty <= 0:
        raise InvalidField(f"repetition_penalty must be greater than 0, got {body.repetition_penalty}")
    if body.seed is not None and not SEED_MIN <= body.seed <= SEED_MAX:
        raise InvalidField(f"seed must be a 64-bit signed integer, got {body.seed}")
    if not 0 <= body.min_tokens <= max_tokens:
        raise InvalidField(f"min_tokens must be in [0, max_tokens = {max_tokens}], got {body.min_tokens}")
    stop = body.stop or []
    if len(stop) > MAX_STOP_STRINGS or any(not s or len(s) > MAX_STOP_LEN for s in stop):
        raise InvalidField(f"stop takes at most {MAX_STOP_STRINGS} strings of 1 to {MAX_STOP_LEN} characters")
    bad_words = body.bad_words or []
    if len(bad_words) > MAX_BAD_WORDS or any(not w or len(w) > MAX_STOP_LEN for w in bad_words):
        raise InvalidField(f"bad_words takes at most {MAX_BAD_WORDS} strings of 1 to {MAX_STOP_LEN} characters")
    logit_bias = body.logit_bias or {}
    for token, bias in logit_bias.items():
        if not 0 <= token < vocab_size:
            raise InvalidField(f"logit_bias: token id {token} is outside the model's vocabulary "
                               f"(0..{vocab_size - 1})")
        if not math.isfinite(bias):
            raise InvalidField(f"logit_bias: the bias of token {token} must be a finite number, got {bias}")
    for name in ("allowed_token_ids", "stop_token_ids"):
        ids = getattr(body, name)
        if ids is None:
            continue
        if name == "allowed_token_ids" and not ids:
            raise InvalidField("allowed_token_ids must hold at least one token id (leave it out for every token)")
        if len(ids) > vocab_size:
            raise InvalidField(f"{name} holds {len(ids)} ids; the vocabulary has {vocab_size}")
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise InvalidField(f"{name}: token id {bad} is outside the model's vocabulary (0..{vocab_size - 1})")
    structured = _structured(body.structured_outputs)
    if not 1 <= body.n <= MAX_N:
        raise InvalidField(f"n must be in [1, {MAX_N}] (answers sampled from the one prompt), got {body.n}")
    if body.seed is not None and body.n > 1 and body.seed + body.n - 1 > SEED_MAX:
        raise InvalidField(f"seed + n - 1 must be a 64-bit signed integer (answer i is sampled with seed + i), "
                           f"got {body.seed} + {body.n - 1}")
    if body.logprobs is not None and not 0 <= body.logprobs <= MAX_LOGPROBS:
        raise InvalidField(f"logprobs must be in [0, {MAX_LOGPROBS}] (the most likely tokens to report), "
                           f"got {body.logprobs}")
    if body.prompt_logprobs is not None:
        if not 0 <= body.prompt_logprobs <= MAX_LOGPROBS:
            raise InvalidField(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}] (the most likely tokens to report "
                               f"at each prompt position), got {body.prompt_logprobs}")
        entries = prompt_tokens * (body.prompt_logprobs + 1)
        if entries > MAX_PROMPT_LOGPROB_ENTRIES:
            raise InvalidField(f"prompt_logprobs {body.prompt_logprobs} over {prompt_tokens} prompt tokens "
                               f"makes {entries} entries, over kvpush's {MAX_PROMPT_LOGPROB_ENTRIES}; ask for fewer")
    return wire.SamplingSpec(
        max_tokens, body.temperature, body.ignore_eos, stop=list(stop), top_p=body.top_p, top_k=body.top_k,
        min_p=body.min_p, presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty, seed=body.seed, min_tokens=body.min_tokens,
        logit_bias={token: min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, bias)) for token, bias in logit_bias.items()},
        allowed_token_ids=list(body.allowed_token_ids or []),
        bad_words=list(bad_words), stop_token_ids=list(body.stop_token_ids or []),
        include_stop_str_in_output=body.include_stop_str_in_output, structured_outputs=structured,
        logprobs=body.logprobs, n=body.n, prompt_logprobs=body.prompt_logprobs,
        tool_calling=_tool_calling(body.tool_calling))


def _structured(structured: wire.StructuredOutput | None) -> wire.StructuredOutput | None:
    """Its shape; whether the grammar compiles is the decode engine's to say (vLLM's own
    check, refused there with its sentence before anything is generated)."""
    if structured is None:
        return None
    kinds = structured.kinds()
    if len(kinds) != 1:
        raise InvalidField("structured_outputs takes exactly one of json, regex, choice, grammar or json_object, "
                           f"got {len(kinds)}" + (f" ({', '.join(kinds)})" if kinds else ""))
    size = len(msgspec.json.encode(structured))
    if size > MAX_STRUCTURED_BYTES:
        raise InvalidField(f"the output's schema or grammar is {size} bytes; at most {MAX_STRUCTURED_BYTES}")
    if structured.json_object is False:
        raise InvalidField("structured_outputs.json_object must be true if given")
    if isinstance(structured.json, str):
        try:
            schema = json.loads(structured.json)
        except ValueError:
            raise InvalidField("structured_outputs.json must be a JSON schema (an object, or its JSON text)") from None
        if not isinstance(schema, dict):
            raise InvalidField("structured_outputs.json must be a JSON schema (an object, or its JSON text)")
    if structured.choice is not None and (not structured.choice or not all(structured.choice)):
        raise InvalidField("structured_outputs.choice must be a list of non-empty strings")
    for name in ("regex", "grammar"):
        if getattr(structured, name) == "":
            raise InvalidField(f"structured_outputs.{name} must not be empty")
    return structured


TOOL_PARSERS = ("hermes",)  # the tool-call formats decode constrains and the gateway reads
MAX_TOOLS = 128


def _tool_calling(calling: wire.ToolCalling | None) -> wire.ToolCalling | None:
    """Its shape (the schemas themselves are the decode engine's grammar compiler's to judge)."""
    if calling is None:
        return None
    if calling.parser not in TOOL_PARSERS:
        raise InvalidField(f"tool_calling.parser {calling.parser!r} is not one kvpush reads "
                           f"({', '.join(TOOL_PARSERS)})")
    if not 1 <= len(calling.tools) <= MAX_TOOLS:
        raise InvalidField(f"tool_calling.tools must hold 1 to {MAX_TOOLS} functions, got {len(calling.tools)}")
    names = [tool.name for tool in calling.tools]
    if not all(names) or len(set(names)) != len(names):
        raise InvalidField("each tool needs a name of its own")
    size = len(msgspec.json.encode(calling))
    if size > MAX_STRUCTURED_BYTES:
        raise InvalidField(f"the tools are {size} bytes; at most {MAX_STRUCTURED_BYTES}")
    if (calling.choice == "function") != (calling.function is not None):
        raise InvalidField("tool_calling.function names the function exactly when the choice is \"function\"")
    if calling.function is not None and calling.function not in names:
        raise InvalidField(f"the tool choice names {calling.function!r}, which is not among the tools")
    return calling


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
