"""The client's JSON: the requests a client publishes, the replies on its inbox, and the
words requests and path reports are written in. Every field a client may send is here;
unknown fields are refused (``forbid_unknown_fields``), and new fields get defaults, so an
older client's request still reads. docs/protocol.md has the subjects they travel on.

Pure: imports no NATS.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

ServeMode = Literal["push", "pull", "local"]
"""How a request is served: its KV pushed or pulled from a prefill worker, or its prompt
computed by the decode worker itself (``local``)."""
RequestedMode = Literal["push", "pull", "local", "auto"]  # what a request may ask; auto: decided from load
KvPolicy = Literal["recompute", "fail"]
"""What decode does with a request whose KV did not arrive intact: compute the prompt
itself (``recompute``), or end the request with ``kv_transfer_failed`` (``fail``)."""
KV_POLICIES: tuple[str, ...] = ("recompute", "fail")
KvChecksum = Literal["verified", "unchecked"]
KV_CHECKSUMS: tuple[str, ...] = ("off", "sampled", "full")  # which transfers get one (--kv-checksums)
ModeChooser = Literal["request", "scheduler", "auto"]
"""Who chose a request's mode: the request's transfer_mode, the scheduler's fixed --mode,
or --mode auto (or transfer_mode auto) from live load."""

class StructuredOutput(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """The answer constrained to a grammar: exactly one of these, with the meaning of vLLM's
    StructuredOutputsParams (``json`` is a JSON schema, as text or as an object)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False

    def kinds(self) -> list[str]:
        return [name for name in ("json", "regex", "choice", "grammar", "json_object")
                if getattr(self, name) is not None]


ToolChoiceKind = Literal["auto", "required", "function"]


class ToolFunction(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """A function the model may call, as OpenAI's ``tools[].function``."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of its arguments
    strict: bool | None = None  # True: the arguments are held to ``parameters`` as they are generated


class ToolCalling(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """Tool calls in the model's format, which vLLM's tool parser ``parser`` reads: the
    functions, and whether the model may call one (``auto``), must call some (``required``),
    or must call ``function`` (``function``). Decode constrains the answer as vLLM's server
    does for that parser (``kvpush.services.worker.tool_calling``); the gateway reads the
    calls out of the text."""

    parser: str
    tools: list[ToolFunction]
    choice: ToolChoiceKind = "auto"
    function: str | None = None  # choice "function": its name
    parallel: bool | None = None  # False: at most one call (OpenAI's parallel_tool_calls)


class GenerateRequest(msgspec.Struct, forbid_unknown_fields=True):
    """Body of a request on ``kvpush.generate``; exactly one of the two prompts."""

    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    max_tokens: int | None = None  # default: 128, or what the context has room for
    temperature: float = 0.0
    ignore_eos: bool = False
    request_id: str | None = None
    transfer_mode: RequestedMode | None = None  # default: the scheduler's --mode
    stop: list[str] | None = None  # strings that end the answer (not included in it, unless asked)
    # Sampling, with the names and meaning of vLLM's SamplingParams (the decode engine's):
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1): every token
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutput | None = None
    logprobs: int | None = None  # each token's logprob and this many of the most likely ones
    # Answers to sample from the one prompt (vLLM's n): its KV moves once; answer i is
    # sampled with seed + i when a seed is given, as vLLM's own fan-out does.
    n: int = 1
    # Each prompt position's logprob and this many of the most likely tokens there,
    # computed where the prompt is (prefill, or decode when local); on answer 0's first chunk.
    prompt_logprobs: int | None = None
    tool_calling: ToolCalling | None = None  # the functions the model may call, and how
    kv_policy: KvPolicy | None = None  # default: the scheduler's --kv-policy


class CancelRequest(msgspec.Struct, forbid_unknown_fields=True):
    """Body of a message on ``kvpush.cancel``: stop this request wherever it is."""

    request_id: str


class FinalRequest(msgspec.Struct, forbid_unknown_fields=True):
    """Body of a request on ``kvpush.final``: send me this request's last message again."""

    request_id: str


class ErrorBody(msgspec.Struct):
    code: str
    message: str


class _Reply(msgspec.Struct, tag_field="type"):
    """A message to a client's reply inbox; its ``type`` names which one."""


class TokenLogprob(msgspec.Struct, array_like=True):
    """One candidate at one position of the answer, as vLLM's Logprob (a logprob of -inf
    is sent as -9999.0, as vLLM's server writes it)."""

    token_id: int
    logprob: float
    rank: int | None
    token: str | None  # as the engine decoded it


class TokenChunk(_Reply, tag="chunk"):
    request_id: str
    token_ids: list[int]
    text: str
    finished: bool = False
    seq: int = 0  # 0, 1, 2, ... per request (all its answers): a gap is a lost chunk
    # With ``logprobs``: one list per token of ``token_ids``, in vLLM's order (the sampled
    # token first, then the most likely ones).
    logprobs: list[list[TokenLogprob]] | None = None
    index: int = 0  # which of the request's n answers these tokens belong to
    # With ``prompt_logprobs``, on the first chunk of answer 0 only: one entry per prompt
    # token (the first None: nothing precedes it), as ``logprobs``.
    prompt_logprobs: list[list[TokenLogprob] | None] | None = None


class Usage(msgspec.Struct, omit_defaults=True):  # no cached_tokens key when it is unknown
    prompt_tokens: int
    completion_tokens: int
    # Prompt tokens the engine that computed the prompt found in its prefix cache (prefill's,
    # or decode's when local); None when that engine's count did not reach decode.
    cached_tokens: int | None = None


Count = Annotated[int, msgspec.Meta(ge=0)]


class RankKv(msgspec.Struct, forbid_unknown_fields=True):
    """What one tensor-parallel rank of decode's engine received: the blocks its copies
    filled and the bytes that landed in them (the KV heads that rank holds, of every
    layer). At TP N each rank receives its own part, and the ranks' bytes add up to the
    request's ``received_bytes`` (above the model's KV heads, where vLLM gives every rank a
    copy of one, to more)."""

    rank: Count
    blocks: Count
    bytes: Count


class PathReport(msgspec.Struct):
    """How one request was served, in its final (``FinalReply.path``): the path it took
    and where each of its prompt's tokens came from. Counts are of the first answer's
    engine request (with n > 1 the others share its prompt through decode's prefix cache).

    Every prompt token is exactly one of: computed on prefill and received over NIXL
    (``received_tokens``), found in decode's prefix cache (``decode_cached_tokens``), or
    computed on decode (``decode_computed_tokens``: the whole prompt, less its cached
    part, when local, or after a failed transfer). ``prefill_computed_tokens`` is what
    prefill computed (its prompt less its own cache hits); ``None`` when unknown."""

    mode: ServeMode
    chosen_by: ModeChooser
    reason: str  # why that mode (the scheduler's placement)
    prefill_worker: str  # "" when local
    decode_worker: str
    attempt: int  # 1, 2, ...: each retry is a new attempt (new transfer, new workers)
    moves: int  # times this attempt's transfer went to another decode before its write
    takeovers: int  # times another scheduler took the request over
    kv_policy: KvPolicy
    prompt_tokens: int
    prefill_computed_tokens: int | None
    received_tokens: int | None  # None: the connector does not say (vLLM's own, for comparison)
    received_blocks: int | None
    received_bytes: int | None
    decode_cached_tokens: int | None
    decode_computed_tokens: int
    recomputed_tokens: int  # of decode_computed_tokens: the ones prefill computed but whose KV failed
    kv_failure: str = ""  # the code of why the KV did not arrive intact (checksum_mismatch, ...), when it did not
    kv_failure_reason: str = ""  # the same, in a sentence
    kv_checksum: KvChecksum | None = None  # the received KV against prefill's checksum (None: nothing received)
    # Mid-stream migrations: times its decode was lost (or stalled) after tokens went out
    # and another continued the stream; at each, the tokens the client had; and how the
    # last one resumed (``Continuation``). Each migration is an attempt too.
    migrations: int = 0
    resumed_after: list[int] = []
    continuation: str = ""
    # The prompt's longest cached prefix, wherever it was (``PrefixSource.choice``): held by
    # the engine that computed the prompt, fetched from ``fetched_from`` (``fetched_tokens``
    # read over NIXL, neither computed nor sent again), or recomputed; "" when no engine held any.
    prefix_source: str = ""
    fetched_tokens: int = 0
    fetched_from: str = ""
    prefix_reason: str = ""  # why the scheduler chose that source (its costs), or why a fetch did not happen
    # Each decode rank's part of what was received, in rank order (one entry at TP 1); empty
    # when nothing was received or the connector did not say (an older one, or vLLM's own).
    received_by_rank: list[RankKv] = []

    @property
    def retries(self) -> int:
        """Attempts that started over before any token went out (migrations are not)."""
        return self.attempt - 1 - self.migrations


class Timings(msgspec.Struct):
    ttft_ms: float
    tpot_ms: float
    e2e_ms: float


class FinalReply(_Reply, tag="final"):
    request_id: str
    finish_reason: str | None
    usage: Usage
    timings: Timings
    finished: bool = True
    chunks: int = 0  # how many token chunks came before this final
    # With n > 1: each answer's finish reason, by index (``finish_reason`` is the first's);
    # usage.completion_tokens counts the tokens of all of them.
    finish_reasons: list[str | None] | None = None
    path: PathReport | None = None  # how it was served (None from a worker that predates it)


class ErrorReply(_Reply, tag="error"):
    request_id: str
    error: ErrorBody
    finished: bool = True


LastMessage = FinalReply | ErrorReply
"""How a request ended: its last message on the reply inbox, and the answer on ``kvpush.final``."""
Reply = TokenChunk | LastMessage
"""Every message on a client's reply inbox."""


class SchedulerStatus(msgspec.Struct):
    """JSON reply on ``kvpush.scheduler.status``: the workers the scheduler would route to."""

    scheduler_id: str
    prefill_workers: list[str]
    decode_workers: list[str]
    max_model_len: int = 0  # the least context of the workers it routes to (0: none live)
