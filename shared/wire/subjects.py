"""The subjects kvpush's messages travel on, and the table of who publishes and who
subscribes on each (``SUBJECTS``).

A subject is fixed (``kvpush.generate``), a template with ``{parts}``
(``kvpush.prefill.{worker_id}``: call it for a concrete subject), or a tree, everything
under a prefix (``_INBOX.>``). Each has one row in ``SUBJECTS`` (the durable ones, JetStream's,
in ``kvpush.shared.wire.durable.DURABLE``): the wire types published on it, its publishers and
subscribers by role (``scheduler``, ``prefill``, ``decode``, ``client``), how each may use it
(``Grant``), and what it means. ``kvpush.shared.permissions`` derives every NATS user's
permissions from these rows, and docs/protocol.md writes them out (a test keeps the two equal).

Pure: imports no NATS.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Literal

GENERATE_SUBJECT = "kvpush.generate"
CANCEL_SUBJECT = "kvpush.cancel"
SCHEDULER_QUEUE_GROUP = "kvpush-schedulers"
INVALID_SUBJECT = "kvpush.invalid"
SCHEDULER_STATUS_SUBJECT = "kvpush.scheduler.status"
FINAL_SUBJECT = "kvpush.final"

CLIENT_INBOX_PREFIX = "_INBOX"
SERVICE_INBOX_PREFIX = "_KVPUSH_INBOX"


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

    @property
    def parts(self) -> list[str]:
        """The names of its placeholders, in order."""
        return re.findall(r"\{([^}]+)\}", self)


class SubjectTree(str):
    """Every subject under a prefix (an inbox prefix, a JetStream API): the tree's subjects
    are made by whoever owns them (nats-py's inboxes, JetStream), not by a template."""

    @property
    def wildcard(self) -> str:
        """Every subject of the tree."""
        return f"{self}.>"

    def under(self, name: str) -> str:
        """The subjects of the tree under ``name``'s own token (a named client's inboxes)."""
        return f"{self}.{name}.>"


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
CLIENT_INBOXES = SubjectTree(CLIENT_INBOX_PREFIX)
SERVICE_INBOXES = SubjectTree(SERVICE_INBOX_PREFIX)


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


# --------------------------------------------------------------------------- the table

IdentityRole = Literal["scheduler", "prefill", "decode", "client"]
"""Who a NATS user is: one user per scheduler, worker and client (``kvpush.shared.permissions``)."""


class Grant(enum.Enum):
    """How a role may use a subject."""

    EVERY = "every"  # every subject of it: a template's parts all wildcards, a tree's every subject
    OWN = "own"  # only with its own name in the named parts (a tree: under its own name)
    QUEUE = "queue"  # every subject of it, in the schedulers' queue group: one of them gets each message
    OPEN = "open"  # only on a server without users (a client of an open server): no user is granted it


@dataclass(frozen=True)
class Use:
    """One role's use of a subject. ``answers``: it answers each request at the reply
    subject the request names, wherever that is (NATS's ``allow_responses``)."""

    role: IdentityRole
    grant: Grant
    parts: tuple[str, ...] = ()  # OWN on a template: the parts that hold its own name
    answers: bool = False

    @property
    def label(self) -> str:
        """How docs/protocol.md writes it: ``prefill (own worker_id)``, ``scheduler (queue, answers)``."""
        notes = {Grant.EVERY: [], Grant.OWN: [" ".join(("own", " and ".join(self.parts))).strip()],
                 Grant.QUEUE: ["queue"], Grant.OPEN: ["open server"]}[self.grant] + (["answers"] if self.answers else [])
        return f"{self.role} ({', '.join(notes)})" if notes else self.role


def every(role: IdentityRole, answers: bool = False) -> Use:
    return Use(role, Grant.EVERY, answers=answers)


def own(role: IdentityRole, *parts: str) -> Use:
    return Use(role, Grant.OWN, parts)


@dataclass(frozen=True)
class Route:
    """A subject's row in the table. ``messages``: the wire types published on it, by name
    (none: an empty request); ``replies``: the types of the answer to a request on it, sent
    to the asker's inbox; ``store``: the JetStream stream or bucket that keeps what is
    published on it (durable rows only)."""

    subject: str  # a fixed subject, a SubjectTemplate or a SubjectTree
    messages: tuple[str, ...]
    publishers: tuple[Use, ...]
    subscribers: tuple[Use, ...]
    meaning: str
    replies: tuple[str, ...] = ()
    store: str = ""

    @property
    def pattern(self) -> str:
        """The subject as docs/protocol.md writes it."""
        return self.subject.wildcard if isinstance(self.subject, SubjectTree) else str(self.subject)


WORKERS_OWN_SENDER = (own("prefill", "sender"), own("decode", "sender"))
WORKERS_OWN_ENGINE = (own("prefill", "engine_id"), own("decode", "engine_id"))
WORKERS_OWN_JOBS = (own("prefill", "worker_id"), own("decode", "worker_id"))
WORKERS_EVERY = (every("prefill"), every("decode"))
SCHEDULERS = (every("scheduler"),)

SUBJECTS: tuple[Route, ...] = (
    # public (JSON, for clients)
    Route(GENERATE_SUBJECT, ("GenerateRequest",), (Use("client", Grant.OPEN),), SCHEDULERS,
          "a request (from a client of a server without users); every scheduler gets it (durable intake), "
          "the one rendezvous hashing names takes it"),
    Route(OWNED_GENERATE, ("GenerateRequest",), (own("client", "client"),), SCHEDULERS,
          "a named client's request, on its own subject only"),
    Route(CANCEL_SUBJECT, ("CancelRequest",), (Use("client", Grant.OPEN),), SCHEDULERS,
          "stop this request wherever it is"),
    Route(OWNED_CANCEL, ("CancelRequest",), (own("client", "client"),), SCHEDULERS,
          "a named client's cancel, of its own requests only"),
    Route(FINAL_SUBJECT, ("FinalRequest",), (Use("client", Grant.OPEN),), (Use("scheduler", Grant.QUEUE, answers=True),),
          "send a request's last message again (kept FINALS_KEEP_S after it ended); in_flight if it has not "
          "ended, not_found if no scheduler knows it",
          replies=("FinalReply", "ErrorReply")),
    Route(OWNED_FINAL, ("FinalRequest",), (own("client", "client"),), (Use("scheduler", Grant.QUEUE, answers=True),),
          "a named client's fetch again, of its own requests only", replies=("FinalReply", "ErrorReply")),
    Route(SCHEDULER_STATUS_SUBJECT, (), (Use("client", Grant.OPEN),), (every("scheduler", answers=True),),
          "the workers a scheduler would route to", replies=("SchedulerStatus",)),
    Route(OWNED_STATUS, (), (own("client", "client"),), (every("scheduler", answers=True),),
          "a named client's status request, answered only to its own inbox", replies=("SchedulerStatus",)),
    Route(CLIENT_INBOXES, ("TokenChunk", "FinalReply", "ErrorReply"), (every("decode"), every("scheduler")),
          (own("client"),), "a request's replies: token chunks, then its final (or an error from whichever "
          "service ended it); a named client's under _INBOX.<client>"),
    # internal (msgpack)
    Route(HEARTBEATS, ("WorkerHeartbeat",), WORKERS_OWN_SENDER, SCHEDULERS,
          "every second: a worker's load, layout and start"),
    Route(SCHEDULER_HEARTBEATS, ("SchedulerHeartbeat",), (own("scheduler", "sender"),), SCHEDULERS,
          "every second: which schedulers are alive, so whose flights are orphans"),
    Route(INTAKE, ("IntakeSettled",), (own("scheduler", "sender"),), SCHEDULERS,
          "a request this scheduler took needs no copy any more"),
    Route(PREFILL_JOBS, ("PrefillJob", "CancelJob"), SCHEDULERS, (own("prefill", "worker_id"),),
          "a prefill worker's jobs (acked) and their cancels", replies=("JobAck",)),
    Route(DECODE_JOBS, ("DecodeJob", "CancelJob", "PromptReady"), SCHEDULERS, (own("decode", "worker_id"),),
          "a decode worker's jobs (acked), their cancels, and push's prompt reports", replies=("JobAck",)),
    Route(LEND_JOBS, ("LendJob",), SCHEDULERS, WORKERS_OWN_JOBS,
          "hold a cached prefix for another engine to READ", replies=("Lent",)),
    Route(PROGRESS, ("RequestProgress",), (own("decode", "sender"),), SCHEDULERS,
          "a request's first token went out, or it ended"),
    Route(TOKENS_SENT, ("TokensSent",), (own("decode", "sender"),), SCHEDULERS,
          "a token chunk is about to go out (before it, on the same connection)"),
    Route(HANDOFFS, ("Handoff",), (own("prefill", "sender"),), SCHEDULERS,
          "prefill finished a prompt (in pull the scheduler then picks decode)"),
    Route(KV_CONTROL, ("Registration", "LeaseRenewal", "Revoke"), WORKERS_OWN_SENDER, WORKERS_OWN_ENGINE,
          "to the engine that writes or lends KV: blocks to push into; keep its blocks; give them up"),
    Route(KV_MOVES, ("MoveTransfer",), (own("scheduler", "sender"),), WORKERS_OWN_ENGINE,
          "push this transfer to another decode instead (answered with a TransferMoved)"),
    Route(KV_COMPLETIONS, ("TransferDone", "TransferFailed", "TransferMoved"), WORKERS_OWN_SENDER,
          WORKERS_OWN_ENGINE + SCHEDULERS, "how a transfer to that engine ended (or a lent prefix's lease)"),
    Route(KV_AGENT, (), WORKERS_EVERY, WORKERS_OWN_ENGINE,
          "a worker rank's NIXL agent and KV layout, on request", replies=("AgentInfo",)),
    Route(KV_AGENTS, ("AgentInfo",), WORKERS_OWN_SENDER, WORKERS_EVERY,
          "a rank's agent, announced once when it is ready"),
    Route(CACHE_EVENTS, ("CacheEvents",), WORKERS_OWN_SENDER, SCHEDULERS,
          "blocks a worker's prefix cache stored and evicted"),
    Route(INVALID_SUBJECT, ("InvalidMessage",), SCHEDULERS + WORKERS_EVERY, SCHEDULERS,
          "a message a service refused (it went on serving)"),
    Route(SERVICE_INBOXES, ("JobAck", "AgentInfo", "Lent"), WORKERS_EVERY,
          (own("scheduler"), own("prefill"), own("decode")),
          "answers to services, under _KVPUSH_INBOX.<identity>, out of clients' reach"),
)
"""Every subject of kvpush's messages, with its publishers and subscribers."""
