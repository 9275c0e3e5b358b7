"""What outlives a process (JetStream, msgpack values): the flights and finals buckets, the
answer claims' streams, and the subjects they are written on (``DURABLE``: who may write
each, beside ``kvpush.shared.wire.subjects.SUBJECTS``). ``kvpush.services.ledger`` makes and
uses them; only schedulers may touch the JetStream API, and a decode only its own claims.

Pure: imports no NATS.
"""

from __future__ import annotations

import hashlib
from typing import Literal

import msgspec

from kvpush.shared.wire.identity import identity_problem
from kvpush.shared.wire.internal import Internal, Resume, SamplingSpec
from kvpush.shared.wire.public import KvPolicy, ModeChooser
from kvpush.shared.wire.subjects import SCHEDULERS, Route, SubjectTemplate, SubjectTree, own

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


class StoredFinal(Internal):
    """A request's last message, kept for a client that missed it (``kvpush.final``)."""

    owner: str
    body: bytes  # the JSON the client was sent
    reply_to: str = ""  # where it was sent


# --------------------------------------------------------------------------- the table

JETSTREAM_API = SubjectTree("$JS.API")
JETSTREAM_FLOW_CONTROL = SubjectTree("$JS.FC")
JETSTREAM_ACKS = SubjectTree("$JS.ACK")
FLIGHT_RECORDS = SubjectTree(f"$KV.{FLIGHTS_BUCKET}")
STORED_FINALS = SubjectTree(f"$KV.{FINALS_BUCKET}")
SCHEDULER_CLAIMS = SubjectTemplate(CLAIMS_SUBJECT_PREFIX + ".{decode}.{key}.scheduler.{sender}.{incarnation}")
DECODE_CLAIMS = SubjectTemplate(CLAIMS_SUBJECT_PREFIX + ".{decode}.{key}.decode.{sender}")
OWN_CLAIM_READS = SubjectTemplate(f"$JS.API.DIRECT.GET.{CLAIMS_STREAM_PREFIX}_{{decode}}.{DECODE_CLAIMS}")
"""A direct get of one claim subject: the query form, which could walk the stream, is not allowed."""

DURABLE: tuple[Route, ...] = (
    Route(JETSTREAM_API, (), SCHEDULERS, (), "make the buckets and streams, write, read and watch them"),
    Route(JETSTREAM_FLOW_CONTROL, (), SCHEDULERS, (), "flow control of the flights watch"),
    Route(JETSTREAM_ACKS, (), SCHEDULERS, (), "acknowledge what a consumer delivered"),
    Route(FLIGHT_RECORDS, ("FlightRecord",), SCHEDULERS, (),
          "by flight_key(client, request id): the scheduler that holds it, and its attempt; another adopts it",
          store=FLIGHTS_BUCKET),
    Route(STORED_FINALS, ("StoredFinal",), SCHEDULERS, (),
          "by flight_key(client, request id): its last message, for a fetch again (FINALS_KEEP_S)",
          store=FINALS_BUCKET),
    Route(SCHEDULER_CLAIMS, (), (own("scheduler", "sender"),), (),
          "a scheduler answers the attempt's client (first claim), or takes that over (appended)",
          store=f"{CLAIMS_STREAM_PREFIX}_<decode>"),
    Route(DECODE_CLAIMS, (), (own("decode", "decode", "sender"),), (),
          "the decode answers its own attempt's client (before its first message)",
          store=f"{CLAIMS_STREAM_PREFIX}_<decode>"),
    Route(OWN_CLAIM_READS, (), (own("decode", "decode", "sender"),), (),
          "a decode reads its own claim, one subject at a time"),
)
"""Every subject of JetStream kvpush writes on, and who may write there. No role
subscribes to these: readers read through the JetStream API."""
