"""The services' messages (msgpack): scheduler <-> worker, and scheduler <-> scheduler.

Every one is an ``Internal``, a struct tagged by its class name (``"type"``) that carries
the protocol version of its sender; new fields get defaults, so an older peer's message
still reads. A message that names its sender says which field does (``sender_field``), and
its subject ends in the same name (``kvpush.shared.wire.identity.forged_sender``).
docs/protocol.md has the subjects each travels on, and the protocol's history.

Pure: imports no NATS.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, get_args

import msgspec

from kvpush.shared import connector_kinds
from kvpush.shared.block_keys import KEY_BYTES
from kvpush.shared.wire.public import (ErrorBody, KvPolicy, ModeChooser, ServeMode, StructuredOutput, TokenLogprob,
                                       ToolCalling)

PROTOCOL_VERSION = 7  # its history: docs/protocol.md

Role = Literal["prefill", "decode"]
TransferMode = connector_kinds.TransferMode


class Internal(msgspec.Struct, tag=True, tag_field="type", kw_only=True):
    version: int = PROTOCOL_VERSION


Connector = connector_kinds.Name  # the kinds of KV connector: kvpush.shared.connector_kinds


class WorkerHeartbeat(Internal):
    sender_field: ClassVar[str] = "worker_id"

    worker_id: str
    role: Role
    free_kv_blocks: int
    total_kv_blocks: int
    running: int
    waiting: int
    block_size: int
    max_model_len: int
    connector: Connector = "kvpush"
    kv_params: dict[str, Any] = msgspec.field(default_factory=dict)  # vLLM connectors: how to reach us
    incarnation: str = ""  # new on every start: a restarted worker keeps its id, not its incarnation
    queued_prompt_tokens: int = 0  # prompt tokens of the jobs it holds, not yet computed (decode: local ones)
    prefill_tokens_per_s: float = 0.0  # prompt tokens it computes per second (decode: local ones; 0: unmeasured)
    lends: bool = False  # its engine lends cached prefixes (LendJob) and fetches them from others (Fetch)
    kv_bytes_per_block: int = 0  # one block's KV over every layer: what fetching a block moves (0: unknown)


class SamplingSpec(msgspec.Struct):
    """How the answer is sampled, checked (``kvpush.services.scheduler.validation``): the
    fields of vLLM's SamplingParams that decode (or a local request's engine) applies. A
    flight written before a field existed reads back with its neutral value."""

    max_tokens: int
    temperature: float
    ignore_eos: bool
    stop: list[str] = []
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    min_tokens: int = 0
    logit_bias: dict[int, float] = {}
    allowed_token_ids: list[int] = []
    bad_words: list[str] = []
    stop_token_ids: list[int] = []
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutput | None = None
    logprobs: int | None = None  # each token's logprob and this many of the most likely ones
    n: int = 1  # answers sampled from the prompt (vLLM's n)
    prompt_logprobs: int | None = None  # computed where the prompt is: prefill, or decode when local
    tool_calling: ToolCalling | None = None


class PromptReport(msgspec.Struct):
    """What the engine that computed a prompt says of it: how many of its tokens it found
    in its prefix cache, and, with ``prompt_logprobs``, each position's logprobs (the first
    None), as ``TokenChunk.logprobs``."""

    cached_tokens: int
    logprobs: list[list[TokenLogprob] | None] | None = None
    fetched_tokens: int = 0  # read from another engine's prefix cache before computing the rest (Fetch)
    fetched_from: str = ""  # that engine


class Fetch(msgspec.Struct):
    """Before computing a prompt, READ its first ``tokens`` (whole blocks) from the engine
    that holds them in its prefix cache: what ``holder_engine_id``'s engine returned for the
    lend (``lent``, a ``PrefilledKv``: its blocks, held for us under a lease we renew)."""

    holder_engine_id: str
    holder_incarnation: str
    transfer_id: str  # the lend's own, not the request's
    transfer_key: str  # the lend's secret, shared with the holder only
    tokens: int
    lent: dict[str, Any]


class PrefixSource(msgspec.Struct):
    """Where the scheduler meant a prompt's longest cached prefix to come from (``kvpush.services.scheduler.prefix_sources``):
    ``held`` (the engine computing the prompt has it), ``fetch`` (read from ``holder``),
    ``recompute`` (another engine holds more, and computing it again is cheaper or fetching is off)."""

    choice: str
    holder: str = ""
    held_tokens: int = 0  # the holder's cached prefix of the prompt
    reason: str = ""


class PrefillJob(Internal):
    request_id: str
    transfer_id: str
    prompt_token_ids: list[int]
    received_at: float
    mode: TransferMode = "push"
    decode_engine_id: str = ""  # push only: pull picks decode after prefill
    transfer_key: str = ""  # the transfer's secret, shared with its decode only
    prompt_logprobs: int | None = None  # the request's: prefill computes them with the prompt
    kv_checksum: bool = False  # send a checksum of the prompt's KV with it (--kv-checksums)
    fetch: Fetch | None = None  # read the prompt's first blocks from the engine holding them, then compute the rest


class RouteReport(msgspec.Struct):
    """What the scheduler knows of a request's path when it sends the decode job, for the
    path report decode puts in the final (``PathReport``)."""

    chosen_by: ModeChooser
    reason: str
    attempt: int = 1
    moves: int = 0
    takeovers: int = 0
    migrations: int = 0  # times the request moved to another decode mid-stream
    resumed_after: list[int] = []  # at each migration: the tokens its client had
    prefix: PrefixSource | None = None  # where the prompt's cached prefix was to come from


Continuation = Literal["reprefill", "replay"]
"""How a migrated request resumes on its new decode (``kvpush.shared.continuation``):
``reprefill``, its prompt is the original prompt and the tokens sent; ``replay``, the original
prompt, and the engine replays the tokens sent as its first outputs (the seed's generator,
the grammar and stop strings advance over them: ``kvpush.services.worker.replay``)."""
CONTINUATIONS: tuple[str, ...] = get_args(Continuation)


class Resume(msgspec.Struct):
    """Where a migrated request resumes: what its client already has of answer 0."""

    token_ids: list[int]  # every token sent, in order
    chunks: int  # chunks sent: the next one's seq
    first_token_at: float  # wall clock: when the first token went out (the request's TTFT)
    continuation: Continuation
    migrations: int = 1  # this is the request's n-th migration


class DecodeJob(Internal):
    request_id: str
    transfer_id: str
    prompt_token_ids: list[int]
    sampling: SamplingSpec
    prefill_engine_id: str
    reply_to: str
    received_at: float
    mode: ServeMode = "push"  # local: no prefill, the engine computes the prompt
    # What the prefill side said about itself: in push its heartbeat's kv_params (for
    # vLLM's push, its address); in pull what its engine returned (for kvpush, a
    # PrefilledKv: its block ids). The worker makes the engine's kv_transfer_params from it.
    kv_transfer_params: dict[str, Any] = msgspec.field(default_factory=dict)
    transfer_key: str = ""  # the transfer's secret, shared with its prefill only
    prefill_incarnation: str = ""  # the prefill engine's start the scheduler chose
    prompt: PromptReport | None = None  # pull: what prefill said of the prompt (push: PromptReady)
    route: RouteReport | None = None  # how the scheduler chose this path
    kv_policy: KvPolicy = "recompute"  # the request's (or the scheduler's default)
    # A migrated request: resume after what its client has (``prompt_token_ids`` is then
    # the original prompt, with a reprefill continuation the tokens sent too).
    resume: Resume | None = None


class LendJob(Internal):
    """Scheduler -> the engine holding a prompt's prefix in its prefix cache (request-reply
    on ``LEND_JOBS``): hold the first ``blocks`` blocks of ``prompt_token_ids`` (the prefix
    and one token after it, which the engine computes) for ``reader_engine_id`` to READ,
    under a lease the reader renews. Answered with ``Lent``."""

    request_id: str
    transfer_id: str
    prompt_token_ids: list[int]
    blocks: int
    reader_engine_id: str
    transfer_key: str


class Lent(Internal):
    """A holder's answer to a LendJob: where the blocks are (``kv_transfer_params``, a
    ``PrefilledKv``), or why not (``error``: ``prefix_not_held``, refused before any READ)."""

    sender_field: ClassVar[str] = "holder_engine_id"

    transfer_id: str
    holder_engine_id: str
    holder_incarnation: str
    kv_transfer_params: dict[str, Any] | None = None
    cached_tokens: int = 0  # of the lend's prompt, found in the holder's prefix cache
    error: ErrorBody | None = None


class CancelJob(Internal):
    """Stop this request: drop it if queued, discard it if running, give up its blocks.
    ``error``: what the client is told, by the decode if it holds the answer's claim."""

    request_id: str
    transfer_id: str
    reason: str
    error: ErrorBody | None = None


class PromptReady(Internal):
    """Push: the scheduler passes prefill's ``PromptReport`` on to the decode of the same
    attempt, which has been generating since before prefill finished. Decode puts it in the
    final (``cached_tokens``) and on the first chunk (``prompt_logprobs``), and waits for it
    only where it needs it."""

    request_id: str
    transfer_id: str
    prompt: PromptReport


PrefillMessage = PrefillJob | CancelJob
DecodeMessage = DecodeJob | CancelJob | PromptReady

ProgressStage = Literal["streaming", "ended"]


UNCLAIMED = "unclaimed"
"""A RequestProgress outcome: the decode could not learn whether it won the answer's claim
(JetStream did not say), so it sent the client nothing and never will for this attempt."""


class RequestProgress(Internal):
    """Decode worker -> schedulers: the first token went out (a retry would now repeat
    tokens), or the request ended (``outcome``: ok, error, cancelled, client_gone, fenced,
    ``UNCLAIMED``)."""

    sender_field: ClassVar[str] = "worker_id"

    request_id: str
    transfer_id: str
    worker_id: str
    stage: ProgressStage
    outcome: str = ""
    final: bytes = b""  # ended: the last message the client was sent (JSON), for kvpush.final


class TokensSent(Internal):
    """Decode worker -> schedulers (``TOKENS_SENT``): the token chunk ``seq`` is about to go
    to the client. Sent before the chunk, on the same connection: NATS keeps a connection's
    order, so a scheduler hears of every token no later than the client sees it, and a
    migration resumes after the last one (``kvpush.services.scheduler.migrations``)."""

    sender_field: ClassVar[str] = "worker_id"

    request_id: str
    transfer_id: str
    worker_id: str
    seq: int
    token_ids: list[int]
    index: int = 0  # its answer (n > 1)


MAX_CACHE_KEYS = 4096  # block keys in one CacheEvents: 64 KiB of keys, well under max_payload
BlockKey = Annotated[bytes, msgspec.Meta(min_length=KEY_BYTES, max_length=KEY_BYTES)]
CacheKeys = Annotated[list[BlockKey], msgspec.Meta(max_length=MAX_CACHE_KEYS)]


class CacheEvents(Internal):
    """Worker -> schedulers: blocks its engine's prefix cache stored and evicted, by their
    keys (``kvpush.shared.block_keys``, at the engine's block size), as vLLM's KV cache events
    reported them; ``cleared``: it dropped everything first. A worker that relays none
    (prefix caching off) holds nothing a scheduler routes by."""

    sender_field: ClassVar[str] = "worker_id"

    worker_id: str
    incarnation: str
    stored: CacheKeys = []
    removed: CacheKeys = []
    cleared: bool = False


class JobAck(Internal):
    accepted: bool
    error: ErrorBody | None = None


class Handoff(Internal):
    sender_field: ClassVar[str] = "prefill_engine_id"

    request_id: str
    transfer_id: str
    prefill_engine_id: str
    first_token_id: int | None
    prefill_started_at: float
    prefill_finished_at: float
    error: ErrorBody | None = None
    kv_transfer_params: dict[str, Any] | None = None  # what the prefill engine returned
    prompt: PromptReport | None = None  # its prefix-cache hits and, if asked, prompt logprobs


class InvalidMessage(Internal):
    """A service refused a message it could not use; it went on serving."""

    service: str
    subject: str
    code: str
    reason: str

class SchedulerHeartbeat(Internal):
    sender_field: ClassVar[str] = "scheduler_id"

    scheduler_id: str
    incarnation: str
    flights: int = 0


class IntakeSettled(Internal):
    """Scheduler -> schedulers: a request this one took was refused (or dropped as a
    resend), so the copies the others hold of it can go (services/scheduler/intake.py)."""

    sender_field: ClassVar[str] = "scheduler_id"

    scheduler_id: str
    key: str  # flight_key(client, request id)
