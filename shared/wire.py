"""Every message kvpush puts on NATS, and the subject each one travels on.

Identity. Core NATS never says who published a message, but the server can enforce who
may publish on which subject. So wherever a message says who sent it, the sender's
identity is also the last token of its subject (``<sender>`` below), and the receiver
refuses the message if the two differ (``forged_sender``). With one NATS user per worker
(``kvpush.shared.permissions``, ``deploy/``), only that worker may publish under its own name,
and each worker may read only its own jobs. A worker's id is its NATS user; a restart
keeps the id and gets a new ``incarnation``.

Public (JSON, for clients):

    kvpush.generate[.<client>]      GenerateRequest  client -> every scheduler, one takes it; with
                                    per-client users, on the client's own subject
    <client reply subject>          Reply: TokenChunk* then FinalReply   decode worker -> client
                                    (or ErrorReply, from whichever service ended it); an inbox
                                    under ``_INBOX.`` (``_INBOX.<client>.`` for a named client)
    kvpush.cancel[.<client>]        CancelRequest    client -> every scheduler; a named client
                                    cancels only its own requests
    kvpush.final[.<client>]         FinalRequest (request), reply: the request's last message
                                    again (LastMessage: FinalReply or ErrorReply), kept FINALS_KEEP_S after
                                    it ended; ErrorReply ``in_flight`` if it has not ended,
                                    ``not_found`` if no scheduler knows it (never arrived)

Internal (msgpack):

    kvpush.scheduler.status[.<client>]  SchedulerStatus (JSON reply, only to the asking
                                    client's own inbox)
    kvpush.worker.heartbeat.<sender>  WorkerHeartbeat   worker -> scheduler, every second
    kvpush.prefill.<worker_id>      PrefillJob (request, ack) | CancelJob   scheduler -> prefill
    kvpush.decode.<worker_id>       DecodeJob (request, ack) | CancelJob | PromptReady
                                                      scheduler -> decode
    kvpush.request.progress.<sender>  RequestProgress   decode worker -> schedulers: streaming, ended
    kvpush.request.tokens.<sender>  TokensSent        decode worker -> schedulers: a chunk is about
                                                      to go out (before it, on the same connection)
    kvpush.kv.register.<engine_id>.<sender>  Registration | LeaseRenewal | Revoke
                                                      decode -> prefill connector: blocks to push
                                                      into; keep my prefill's blocks; give up
    kvpush.kv.move.<engine_id>.<sender>  MoveTransfer  scheduler -> prefill connector: push
                                                      this transfer to another decode instead
    kvpush.kv.agent.<engine_id>.<rank>  AgentInfo     reply to an empty request: a worker
                                                       rank's NIXL agent and KV layout
    kvpush.kv.agents.<sender>       AgentInfo         announced once when a rank is ready
    kvpush.handoff.<sender>         Handoff           prefill worker: prefill finished (in pull
                                                       mode the scheduler then picks decode)
    kvpush.kv.completion.<decode_engine_id>.<sender>  TransferDone | TransferFailed |
                                                      TransferMoved   prefill connector -> that
                                                      decode and the schedulers
                                                      (``kvpush.kv.completion.*.*``)
    kvpush.scheduler.heartbeat.<sender>  SchedulerHeartbeat  scheduler -> schedulers, every
                                                      second: whose flights are orphans
    kvpush.scheduler.intake.<sender>  IntakeSettled   scheduler -> schedulers: a request it
                                                      took needs no copy any more
    kvpush.cache.<sender>           CacheEvents       worker -> schedulers: blocks its engine's
                                                      prefix cache stored and evicted
    kvpush.invalid                  InvalidMessage    any service: a message it refused

Durable (JetStream KV buckets, msgpack values; see "durable state" below):

    kvpush_flights   flight_key(<client>, <request id>)  FlightRecord   the scheduler that
                                          holds it, and its attempt; another scheduler adopts it
    kvpush_finals    flight_key(<client>, <request id>)  StoredFinal    the last message, for a
                                          fetch again
    kvpush_claims_<decode>  (a stream per decode) kvpush.claims.<decode>.<claim_key(key)>.<claimant>:
                     who answers that attempt's client: the decode (before its first message)
                     or a scheduler

Services take replies on inboxes under ``_KVPUSH_INBOX.<identity>``, out of clients' reach;
clients on inboxes under ``_INBOX.<client>``.

A transfer's ``transfer_key`` is a secret the scheduler gives only the two workers it
chose (on their private job subjects). Registrations and revokes carry it, and every
NIXL notification carries a tag made with it over the receiver's block ids
(``kvpush.connector.completion``): a completion is accepted only from the chosen peer, for the
blocks the receiver itself named.

Protocol history:
    1 - first version (push); pull and vLLM's own connectors added with defaulted fields
        (mode, engine_request_id, kv_transfer_params, connector, kv_params), so version-1
        peers still decode each other.
    2 - fault handling: CancelRequest, CancelJob, RequestProgress, LeaseRenewal, Revoke,
        InvalidMessage; completions on a per-decode subject; heartbeats carry an incarnation.
    3 - engine request ids are the worker's business: PrefillJob/DecodeJob lose
        engine_request_id (a version-2 peer's is ignored). Decode renews leases from its
        connector; the LeaseRenewal message is unchanged.
    4 - identities NATS enforces: the sender's id is the last token of every subject whose
        message names its sender; per-client request and cancel subjects; transfer keys,
        tagged notifications, and incarnations on agents and registrations. Not
        compatible with version 3 peers (their subjects differ).
    5 - flights outlive their scheduler: flight records, answer claims and stored finals
        in JetStream; scheduler heartbeats; ``kvpush.final``; CancelJob carries the error
        the decode sends when it holds the answer; RequestProgress carries the final.
    6 - integrity under per-identity users: answer claims move from a KV bucket to a
        stream per decode, the claimant named by the subject; flights and finals
        are keyed by (client, request id); status on ``kvpush.scheduler.status.<client>``.
        Not compatible with version 5 peers (their claims and keys differ).
    7 - replies are a tagged union (``Reply``): TokenChunk, FinalReply and ErrorReply carry
        ``"type"`` (``chunk``, ``final``, ``error``), and a client decodes each reply once
        (``decode_reply``, ``decode_last``) instead of reading a dict. Their other fields
        are unchanged. A version-6 client still reads version-7 replies (one more JSON
        field, which it ignores); a version-7 client refuses an untagged version-6 reply,
        a kept final of a version-6 service too: upgrade services before clients.
        Later, with defaulted fields only: prompt reports (Handoff.prompt, DecodeJob.prompt,
        PromptReady on decode's job subject), prompt logprobs (TokenChunk.prompt_logprobs),
        Usage.cached_tokens, tool calling. A decode that predates PromptReady refuses it as
        an unknown message and answers without cached_tokens. Path reports and per-request
        KV policies: GenerateRequest.kv_policy, DecodeJob.route and kv_policy, FlightRecord's
        kv_policy, takeovers and placement, FinalReply.path (``null`` from an older decode).
"""

from __future__ import annotations

import hashlib
import re
from typing import Annotated, Any, ClassVar, Literal, get_args

import msgspec

from kvpush.shared import connector_kinds
from kvpush.shared.block_keys import KEY_BYTES

PROTOCOL_VERSION = 7

GENERATE_SUBJECT = "kvpush.generate"
CANCEL_SUBJECT = "kvpush.cancel"
SCHEDULER_QUEUE_GROUP = "kvpush-schedulers"
INVALID_SUBJECT = "kvpush.invalid"
SCHEDULER_STATUS_SUBJECT = "kvpush.scheduler.status"
FINAL_SUBJECT = "kvpush.final"

CLIENT_INBOX_PREFIX = "_INBOX"
SERVICE_INBOX_PREFIX = "_KVPUSH_INBOX"

Role = Literal["prefill", "decode"]
TransferMode = connector_kinds.TransferMode
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

IDENTITY_PATTERN = r"[A-Za-z0-9_-]{1,64}"
"""A worker, scheduler or client name: one NATS subject token, no wildcards, no dots."""


def identity_problem(name: str) -> str | None:
    """Why ``name`` cannot be a kvpush identity (it becomes a subject token), or None."""
    if re.fullmatch(IDENTITY_PATTERN, name):
        return None
    return f"{name!r} is not a valid id: use 1-64 letters, digits, '-' and '_'"


MAX_REQUEST_ID_LEN = 128
REQUEST_ID_PATTERN = r"[-/_=.a-zA-Z0-9]+"  # NATS KV key characters: a request id keys its flight's record


def request_id_problem(request_id: str) -> str | None:
    """Why ``request_id`` cannot be a request's id, or None."""
    if not request_id or len(request_id) > MAX_REQUEST_ID_LEN:
        return f"request_id must be 1 to {MAX_REQUEST_ID_LEN} characters"
    if not re.fullmatch(REQUEST_ID_PATTERN, request_id):
        return "request_id may hold only letters, digits and - / _ = . (no spaces or wildcards)"
    return None


class Subject(str):
    """A concrete subject that remembers its template: span names use the template, so
    worker ids and engine ids stay out of them."""

    template: str

    def __new__(cls, pattern: str, template: str | None = None, **parts: object) -> "Subject":
        subject = super().__new__(cls, pattern.format(**parts))
        subject.template = template or pattern
        return subject


class SubjectTemplate(str):
    """A subject with ``{placeholders}``: call it for a concrete one."""

    def __call__(self, **parts: object) -> Subject:
        return Subject(self, **parts)

    @property
    def wildcard(self) -> "Subject":
        """The subscription that matches every subject of this template."""
        return self.partly()

    def partly(self, **parts: object) -> "Subject":
        """The subscription for the given parts, every other part a wildcard (it carries
        the template too, so its spans are named by it)."""
        return Subject(re.sub(r"\{([^}]+)\}", lambda m: "{" + m.group(1) + "}" if m.group(1) in parts else "*",
                              self), template=self, **parts)


OWNED_GENERATE = SubjectTemplate("kvpush.generate.{client}")
OWNED_CANCEL = SubjectTemplate("kvpush.cancel.{client}")
OWNED_FINAL = SubjectTemplate("kvpush.final.{client}")
OWNED_STATUS = SubjectTemplate("kvpush.scheduler.status.{client}")
SCHEDULER_HEARTBEATS = SubjectTemplate("kvpush.scheduler.heartbeat.{sender}")
INTAKE = SubjectTemplate("kvpush.scheduler.intake.{sender}")
HEARTBEATS = SubjectTemplate("kvpush.worker.heartbeat.{sender}")
PREFILL_JOBS = SubjectTemplate("kvpush.prefill.{worker_id}")
DECODE_JOBS = SubjectTemplate("kvpush.decode.{worker_id}")
PROGRESS = SubjectTemplate("kvpush.request.progress.{sender}")
TOKENS_SENT = SubjectTemplate("kvpush.request.tokens.{sender}")  # not traced: one a chunk
HANDOFFS = SubjectTemplate("kvpush.handoff.{sender}")
KV_CONTROL = SubjectTemplate("kvpush.kv.register.{engine_id}.{sender}")
KV_COMPLETIONS = SubjectTemplate("kvpush.kv.completion.{engine_id}.{sender}")
KV_MOVES = SubjectTemplate("kvpush.kv.move.{engine_id}.{sender}")
KV_AGENT = SubjectTemplate("kvpush.kv.agent.{engine_id}.{rank}")
KV_AGENTS = SubjectTemplate("kvpush.kv.agents.{sender}")
CACHE_EVENTS = SubjectTemplate("kvpush.cache.{sender}")
LEND_JOBS = SubjectTemplate("kvpush.lend.{worker_id}")  # scheduler -> holder: lend a cached prefix (request-reply)
COMPLETION_SUBJECTS = KV_COMPLETIONS.wildcard


def prefill_job_subject(worker_id: str) -> Subject:
    return PREFILL_JOBS(worker_id=worker_id)


def decode_job_subject(worker_id: str) -> Subject:
    return DECODE_JOBS(worker_id=worker_id)


def registration_subject(prefill_engine_id: str, decode_engine_id: str) -> Subject:
    return KV_CONTROL(engine_id=prefill_engine_id, sender=decode_engine_id)


def move_subject(prefill_engine_id: str, scheduler_id: str) -> Subject:
    return KV_MOVES(engine_id=prefill_engine_id, sender=scheduler_id)


def completion_subject(decode_engine_id: str, sender: str) -> Subject:
    return KV_COMPLETIONS(engine_id=decode_engine_id, sender=sender)


def agent_subject(engine_id: str, rank: int) -> Subject:
    return KV_AGENT(engine_id=engine_id, rank=rank)


def engine_wake_address(engine_id: str, incarnation: str, rank: int) -> bytes:
    """The local datagram socket (Linux abstract namespace) on which a worker tells its
    engine's connector rank that a request was handed to the engine. Not NATS: the worker
    and its engine share a host, and the wake must beat the request into the engine.
    Unique per engine start, so that two stacks on one host never share one."""
    digest = hashlib.sha256(f"{engine_id}\0{incarnation}\0{rank}".encode()).hexdigest()[:32]
    return b"\0kvpush-wake-" + digest.encode()


def sender_of(subject: str) -> str:
    """The sender token of a subject that ends in one (the templates with ``{sender}``)."""
    return subject.rsplit(".", 1)[-1]


def forged_sender(subject: str, message: msgspec.Struct) -> str | None:
    """Why ``message`` must be refused because it names a sender other than the one its
    subject (which NATS lets only that sender publish on) proves; None if it is fine.
    A message kind without ``sender_field`` names nobody and is never forged."""
    field = getattr(type(message), "sender_field", None)
    if field is None:
        return None
    claimed = getattr(message, field)
    if claimed == sender_of(subject):
        return None
    return f"a {type(message).__name__} that says it is from {claimed!r} came on {subject}"


def owner_of(subject: str) -> str:
    """The client a request or cancel subject names (``kvpush.generate.<client>``), or ""."""
    for template in (OWNED_GENERATE, OWNED_CANCEL, OWNED_FINAL, OWNED_STATUS):
        base = template.split("{")[0]
        if subject.startswith(base):
            return subject[len(base):]
    return ""


def is_inbox(reply: str) -> bool:
    """A reply subject a service may answer on: an inbox, never one of kvpush's subjects
    (a server lets a responder publish on whatever reply subject it was given)."""
    return reply.startswith((CLIENT_INBOX_PREFIX + ".", SERVICE_INBOX_PREFIX + "."))


def reply_problem(reply: str, owner: str) -> str | None:
    """Why a client's reply subject is refused (it must be an inbox, the client's own when
    it is named), or None: output must never be pointed at an internal subject."""
    prefix = f"{CLIENT_INBOX_PREFIX}.{owner}." if owner else f"{CLIENT_INBOX_PREFIX}."
    if not reply.startswith(prefix) or "*" in reply or ">" in reply or " " in reply:
        return f"the reply subject {reply!r} must be an inbox under {prefix}"
    return None


# --------------------------------------------------------------------------- public JSON

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


# --------------------------------------------------------------------------- internal msgpack

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
"""How a migrated request resumes on its new decode (``kvpush.services.scheduler.continuation``):
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


class KvRegion(msgspec.Struct, array_like=True):
    """One run of equally sized blocks in registered memory: block b lives at
    ``base_addr + b * block_stride`` and is ``block_len`` bytes long."""

    base_addr: int
    block_stride: int
    block_len: int


class AgentInfo(Internal):
    sender_field: ClassVar[str] = "engine_id"

    engine_id: str
    rank: int
    agent_name: str
    agent_metadata: bytes
    mem_type: str
    device_id: int
    num_blocks: int
    regions: list[KvRegion]
    incarnation: str = ""  # the engine's start this agent belongs to


class Registration(Internal):
    """Decode allocated ``block_ids`` for the prompt of ``transfer_id``; push into them,
    through the agent of ``decode_incarnation`` only (an earlier process of the same
    engine id has other memory).

    With prefix caching, decode already holds the prompt's first ``first_block`` blocks
    (its own cache, shared with other requests: never a destination); ``block_ids`` are
    for the prompt's blocks from ``first_block`` on."""

    sender_field: ClassVar[str] = "decode_engine_id"

    transfer_id: str
    request_id: str
    decode_engine_id: str
    decode_request_id: str
    decode_tp_size: int
    block_ids: list[int]
    num_tokens: int
    registered_at: float
    transfer_key: str = ""
    decode_incarnation: str = ""
    first_block: int = 0


class LeaseRenewal(Internal):
    """Decode still wants these transfers: prefill keeps their blocks a lease longer."""

    sender_field: ClassVar[str] = "decode_engine_id"

    decode_engine_id: str
    transfer_ids: list[str]


class Revoke(Internal):
    """Decode gave the blocks of ``transfer_id`` up: start no write into them, and answer
    (a completion event) once no write of ours can still land in them."""

    sender_field: ClassVar[str] = "decode_engine_id"

    transfer_id: str
    decode_engine_id: str
    reason: str
    transfer_key: str = ""


KvControl = Registration | LeaseRenewal | Revoke


class MoveTransfer(Internal):
    """The decode chosen for ``transfer_id`` was lost or overloaded before its KV was
    written: push it to ``decode_engine_id`` instead, whose registration carries
    ``new_transfer_key``; nothing is recomputed. Only a scheduler may send it (NATS
    permissions on ``kvpush.kv.move.*.<scheduler>``). Answered with a TransferMoved."""

    sender_field: ClassVar[str] = "scheduler_id"

    transfer_id: str
    scheduler_id: str
    transfer_key: str  # the transfer's key until now: proves the scheduler is the transfer's
    decode_engine_id: str
    new_transfer_key: str


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


RendezvousOrder = Literal["registration_first", "prefill_first"]


class TransferDone(Internal):
    sender_field: ClassVar[str] = "prefill_engine_id"

    transfer_id: str
    prefill_engine_id: str
    decode_engine_id: str
    rank: int
    order: RendezvousOrder
    waited_ms: float
    bytes: int
    descriptors: int
    write_ms: float
    finished_at: float


class TransferFailed(Internal):
    """``prefill_engine_id`` is whoever reports it: the prefill, or decode for its own READ."""

    sender_field: ClassVar[str] = "prefill_engine_id"

    transfer_id: str
    prefill_engine_id: str
    decode_engine_id: str
    rank: int
    code: str
    reason: str


class TransferMoved(Internal):
    """Prefill's answer to a MoveTransfer, on the new decode's completion subject:
    ``moved``, or why not (its write had begun, or the transfer was over)."""

    sender_field: ClassVar[str] = "prefill_engine_id"

    transfer_id: str
    prefill_engine_id: str
    decode_engine_id: str
    moved: bool
    reason: str = ""


Completion = TransferDone | TransferFailed | TransferMoved


class InvalidMessage(Internal):
    """A service refused a message it could not use; it went on serving."""

    service: str
    subject: str
    code: str
    reason: str

# --------------------------------------------------------------------------- engine requests
# vLLM carries a connector's per-request parameters as a dict (``kv_transfer_params``).
# The worker service writes them and kvpush's connector reads them back: these types are
# that contract. ``as_params()`` gives the dict vLLM wants; ``of(params)`` reads one.


class _KvParams(msgspec.Struct, kw_only=True):
    def as_params(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)

    @classmethod
    def of(cls, params: dict[str, Any]):
        return msgspec.convert(params, cls)


class PrefillKvParams(_KvParams, kw_only=True):
    """A prefill request on a kvpush engine: keep the prompt's blocks for ``transfer_id``."""

    do_remote_decode: bool = True
    transfer_id: str
    mode: TransferMode = "push"
    decode_engine_id: str = ""  # push: the only decode whose registration may be written to
    traceparent: str = ""
    transfer_key: str = ""
    checksum: bool = False  # send a checksum of the KV with it (connector/checksums.py)


class PrefilledKv(_KvParams, kw_only=True):
    """What a kvpush prefill engine returns for a finished prompt (``request_finished``):
    where its blocks are, for a pull-mode decode to READ."""

    transfer_id: str
    prefill_engine_id: str
    prefill_tp_size: int
    remote_block_ids: list[int]
    prefill_incarnation: str = ""  # read through this start's agents only
    block_digests: list[str] = msgspec.field(default_factory=list)  # one checksum per block, when asked for


class DecodeKvParams(_KvParams, kw_only=True):
    """A decode request on a kvpush engine: the prompt's KV comes from ``prefill_engine_id``
    (pushed into the blocks we register, or, in pull mode, read from ``remote_block_ids``)."""

    do_remote_prefill: bool = True
    transfer_id: str
    request_id: str
    prefill_engine_id: str
    prefill_tp_size: int = 1
    mode: TransferMode = "push"
    remote_block_ids: list[int] = msgspec.field(default_factory=list)
    prefill_incarnation: str = ""
    traceparent: str = ""
    transfer_key: str = ""
    block_digests: list[str] = msgspec.field(default_factory=list)  # pull: prefill's checksums of its blocks


RECEIVED_KEY = "kvpush_received"  # a decode request's last output's kv_transfer_params: ReceivedKv
# Decode computing a prompt whose KV did not come names the failed engine request (a
# request's kv_transfer_params); its last output says why that load failed ({code, reason}).
RECOMPUTE_OF_KEY = "kvpush_recompute_of"
LOAD_FAILURE_KEY = "kvpush_load_failure"
# A migrated request's SamplingParams.extra_args: the tokens its client already has, which
# the engine replays as its first outputs (kvpush.services.worker.replay).
REPLAY_KEY = "kvpush_replay"
# A request that first READs a prefix from another engine's cache (``Fetch``): its
# kv_transfer_params carry the read (a DecodeKvParams) under FETCH_KEY, and its last output
# what came (a FetchedKv) under FETCHED_KEY.
FETCH_KEY = "kvpush_fetch"
FETCHED_KEY = "kvpush_fetched"


class ReceivedKv(_KvParams, kw_only=True):
    """What a kvpush decode engine returns for a finished request whose KV came from a
    prefill engine (``request_finished``, under ``RECEIVED_KEY``): where its prompt came
    from, for the path report."""

    local_tokens: int  # found in this engine's prefix cache
    tokens: int  # received from prefill
    blocks: int  # the blocks they filled
    bytes: int  # the bytes written (read) into them
    checksum: KvChecksum = "unchecked"  # verified: equal to prefill's checksum before the request ran


class FetchedKv(_KvParams, kw_only=True):
    """What came of a request's fetch (under ``FETCHED_KEY``): the tokens read from the
    holder into our blocks (0: the read failed and the engine computed them)."""

    tokens: int
    blocks: int
    holder_engine_id: str
    asked_tokens: int = 0  # the tokens asked of the holder (vLLM counts them as cache hits, read or not)
    failure: str = ""  # why the read failed, when it did


class ConnectorConfig(msgspec.Struct, kw_only=True):
    """kvpush's connector's ``kv_connector_extra_config``; the timing defaults are
    ``kvpush.shared.settings.FaultSettings``'s."""

    nats_url: str
    lease_s: float
    kv_wait_s: float
    quarantine_s: float
    incarnation: str = ""  # the worker's start: carried by this engine's agents and registrations
    push_by_layer: bool = False  # prefill: write each layer's KV as the forward finishes it (connector/layer_writes.py)
    role: str = ""  # the worker's (prefill, decode): its connector's service name; every kvpush engine is kv_both


_encoder = msgspec.msgpack.Encoder()
_decoders: dict[type, msgspec.msgpack.Decoder] = {}


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes, kind):
    """Decode ``data`` as ``kind`` (a Struct type or a union of them).

    Raises ``msgspec.ValidationError`` / ``msgspec.DecodeError`` on bad input; callers
    turn those into an error event and keep serving.
    """
    decoder = _decoders.get(kind)
    if decoder is None:
        decoder = _decoders[kind] = msgspec.msgpack.Decoder(kind)
    return _guarded(decoder.decode, data)


def _guarded(decode, data: bytes):
    """msgspec raises UnicodeDecodeError on bad UTF-8 in a string and RecursionError on
    absurd nesting (msgspec issue #714); callers expect only its own errors."""
    try:
        return decode(data)
    except (UnicodeDecodeError, RecursionError) as exc:
        raise msgspec.DecodeError(f"malformed: {type(exc).__name__}") from None


class SchedulerStatus(msgspec.Struct):
    """JSON reply on ``kvpush.scheduler.status``: the workers the scheduler would route to."""

    scheduler_id: str
    prefill_workers: list[str]
    decode_workers: list[str]
    max_model_len: int = 0  # the least context of the workers it routes to (0: none live)


_json_encoder = msgspec.json.Encoder()
_json_decoders: dict[type, msgspec.json.Decoder] = {}


def encode_json(message: msgspec.Struct) -> bytes:
    return _json_encoder.encode(message)


def decode_json(data: bytes, kind):
    """Decode a public JSON message (``GenerateRequest``, ``CancelRequest``,
    ``SchedulerStatus``); raises msgspec's errors like ``decode``."""
    decoder = _json_decoders.get(kind)
    if decoder is None:
        decoder = _json_decoders[kind] = msgspec.json.Decoder(kind)
    return _guarded(decoder.decode, data)


_reply_decoder = msgspec.json.Decoder(Reply)
_last_decoder = msgspec.json.Decoder(LastMessage)


def decode_reply(data: bytes) -> Reply:
    """A message from a client's reply inbox; raises msgspec's errors like ``decode``."""
    return _guarded(_reply_decoder.decode, data)


def decode_last(data: bytes) -> LastMessage:
    """A ``kvpush.final`` answer (or a kept final); raises msgspec's errors like ``decode``."""
    return _guarded(_last_decoder.decode, data)


# --------------------------------------------------------------------------- durable state

FLIGHTS_BUCKET = "kvpush_flights"
FINALS_BUCKET = "kvpush_finals"
FINALS_KEEP_S = 600.0  # how long a client can fetch a request's last message again
# Past this, JetStream refuses new writes (nats-py makes KV buckets "discard new"): a final
# then is not kept (only a fetch again is lost). Sized for ~1,400 requests/s over its keep
# time (docs/scaling.md).
FINALS_MAX_BYTES = 256 * 1024 * 1024


def flight_key(owner: str, request_id: str) -> str:
    """The flights and finals buckets' key of a request: its client's and its own id, so
    the same id from two clients is two requests. ``o.<client>.<id>`` for a named client,
    ``p.<id>`` for one on the public subject; a client name holds no dot, so the two never
    meet."""
    return f"o.{owner}.{request_id}" if owner else f"p.{request_id}"


# Answer claims: plain streams, not a KV bucket. nats-py's buckets always allow rollups
# (one ``Nats-Rollup: all`` publish wipes every claim) and a decode's writes to ``$KV.``
# subjects cannot be told apart from a rollup by subject permissions. Each decode has a
# stream of its own (``claims_stream``), so that a decode that floods claims fills only its
# own; the attempts whose decode is not chosen yet (pull, before prefill ended) have one of
# the schedulers'. In these streams the claimant's identity is part of the subject, which
# NATS lets only that identity publish:
#
#     kvpush.claims.<decode id>.<claim key>.decode.<decode id>
#     kvpush.claims.<decode id>.<claim key>.scheduler.<scheduler id>.<incarnation>
#
# A claim is a publish with ``Nats-Expected-Last-Subject-Sequence: 0`` over
# ``kvpush.claims.<decode id>.<claim key>.>``: the first one lands, every later one is
# refused. The attempt's answerer is the first message; when that is a scheduler's, a
# scheduler that takes the flight over appends its own over the last scheduler message's
# sequence, and the last scheduler message answers. The streams refuse rollups, purges,
# deletes and any message over CLAIM_MAX_MSG_BYTES.
CLAIMS_STREAM_PREFIX = "kvpush_claims"
CLAIMS_SUBJECT_PREFIX = "kvpush.claims"
NO_DECODE = "="  # the decode token of an attempt with none chosen: no identity can be it
CLAIM_MAX_MSG_BYTES = 512  # headers and all: a claim's value is empty
CLAIMS_MAX_BYTES = 16 * 1024 * 1024  # per stream: ~55,000 claims of ~300 B in their keep time


def claims_stream(decode_id: str) -> str:
    """The stream that holds the claims of the attempts whose decode is ``decode_id``."""
    return f"{CLAIMS_STREAM_PREFIX}_{decode_id}" if decode_id else CLAIMS_STREAM_PREFIX


def claims_scope(decode_id: str) -> str:
    """The subjects of ``claims_stream(decode_id)``."""
    return f"{CLAIMS_SUBJECT_PREFIX}.{decode_id or NO_DECODE}.>"


def claim_key(transfer_key: str) -> str:
    """The claims stream's key of one attempt. Made from its secret key, so only the
    attempt's own decode and the schedulers can claim (or fence) it."""
    return hashlib.blake2b(transfer_key.encode(), digest_size=16, person=b"kvpush-claim").hexdigest()


ClaimantRole = Literal["decode", "scheduler"]


class Claimant(msgspec.Struct, frozen=True):
    """Who claims an attempt's answer: a decode worker, or one start of a scheduler. Its
    subject tokens (``token``) are what NATS permissions let only that identity publish."""

    role: ClaimantRole
    name: str
    incarnation: str = ""

    @classmethod
    def decode(cls, worker_id: str) -> "Claimant":
        return cls("decode", worker_id)

    @classmethod
    def scheduler(cls, scheduler_id: str, incarnation: str) -> "Claimant":
        return cls("scheduler", scheduler_id, incarnation)

    @property
    def token(self) -> str:
        return f"decode.{self.name}" if self.role == "decode" else f"scheduler.{self.name}.{self.incarnation}"

    def subject(self, decode_id: str, key: str) -> str:
        """Where this claimant claims the attempt of decode ``decode_id`` whose claim key is ``key``."""
        return f"{CLAIMS_SUBJECT_PREFIX}.{decode_id or NO_DECODE}.{key}.{self.token}"

    @classmethod
    def of_subject(cls, subject: str) -> "Claimant | None":
        """The claimant a claim subject names, or None if it names none."""
        parts = subject.split(".")
        if len(parts) == 6 and parts[4] == "decode" and identity_problem(parts[5]) is None:
            return cls.decode(parts[5])
        if len(parts) == 7 and parts[4] == "scheduler" and identity_problem(parts[5]) is None:
            return cls.scheduler(parts[5], parts[6])
        return None

    def __str__(self) -> str:
        return self.token


def claims_of(decode_id: str, key: str) -> str:
    """Every claim message of one attempt."""
    return f"{CLAIMS_SUBJECT_PREFIX}.{decode_id or NO_DECODE}.{key}.>"


def scheduler_claims_of(decode_id: str, key: str) -> str:
    """The schedulers' claim messages of one attempt (a takeover checks the last one)."""
    return f"{CLAIMS_SUBJECT_PREFIX}.{decode_id or NO_DECODE}.{key}.scheduler.>"


class FlightRecord(Internal):
    """A request as the scheduler holding it wrote it down: enough for another scheduler
    to take it over. ``holder``/``holder_incarnation``: which start of which scheduler."""

    request_id: str
    owner: str
    reply_to: str
    received_at: float  # wall clock
    deadline_at: float  # wall clock
    prompt_token_ids: list[int]
    sampling: SamplingSpec
    transfer_mode: str | None
    holder: str
    holder_incarnation: str
    mode: str = "push"
    attempt: int = 0
    transfer_id: str = ""
    transfer_key: str = ""
    prefill_id: str = ""
    decode_id: str = ""
    prefill_incarnation: str = ""
    decode_incarnation: str = ""
    traceparent: str = ""
    kv_policy: KvPolicy = "recompute"
    takeovers: int = 0  # times a scheduler took it over from its record
    mode_chosen_by: ModeChooser = "scheduler"  # the current attempt's placement
    mode_reason: str = ""
    resume: Resume | None = None  # migrated: where the current attempt resumes
    resumed_after: list[int] = []  # at each migration, the tokens its client had


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


class StoredFinal(Internal):
    """A request's last message, kept for a client that missed it (``kvpush.final``)."""

    owner: str
    body: bytes  # the JSON the client was sent
    reply_to: str = ""  # where it was sent
