"""The requests a scheduler has accepted and not yet seen end, and what to do about each
when time passes or a worker goes silent.

Pure: no NATS. Time and worker liveness are passed in, so tests drive them directly.

A request ends when decode reports it ended, or when the scheduler ends it: past its
deadline, cancelled, or a worker it needs was lost with no safe retry. A lost worker
is retried around (a new attempt, new transfer id, other workers) while no token has
gone out and attempts remain. Once tokens went out, a decode lost (or stalled: no token
for ``stall_s``) is migrated: a new attempt resumes after the last token its client has,
which the flight knows because decode reports each chunk to it before sending it
(``tokens_sent``); past ``max_migrations``, or when the flight does not know every token
sent, the request fails with ``worker_lost``. A lost prefill no longer matters once its
KV was pushed or, in pull mode, once decode took the job.
"""

from __future__ import annotations

import enum
import secrets
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

from kvpush.services.scheduler.prefixes import Prompt
from kvpush.services.scheduler.validation import ValidRequest
from kvpush.shared import continuation, settings, wire
from kvpush.shared.stream import Arrival, StreamSoFar

Verdict = Literal["deadline", "move", "retry", "migrate", "stalled", "lost"]
MAX_MOVES = 2  # moves of one attempt's transfer to another decode


def new_transfer_key() -> str:
    """A fresh secret for one transfer: the scheduler sends it only to the workers it chose,
    and only a holder of it may claim the transfer's answer, write its KV, or move it."""
    return secrets.token_hex(16)


class Operation(enum.Enum):
    """What the scheduler is doing to a flight's attempt, apart from ``FlightState`` (the KV
    can land, or the answer start, meanwhile). One at a time: begun with ``Flight.begin``
    (refused while another is under way), ended with ``Flight.end``; a new attempt starts
    with none. A flight with one under way gets no verdict but its deadline
    (``FlightTable.check``)."""

    NONE = "none"
    RETARGET = "retarget"  # its transfer is being moved to another decode (``Retargets``)
    MIGRATE = "migrate"  # its old decode is being fenced for its stream to continue elsewhere (``Migrations``)
    # A retry of this attempt (``Recovery.retry``), until its new attempt begins: the
    # dispatch's own failure and the liveness watch can both ask for one, and only the
    # first may start an attempt.
    RETRY = "retry"


class FlightState(enum.IntEnum):
    """How far the current attempt got. Only ever forward within an attempt (a later step
    makes the earlier ones moot: a decode that streams took its job); a new attempt starts
    over. Kept in memory only: a flight's record does not carry it, and a flight taken
    over starts from ``DISPATCHING`` (``Flight.from_record``)."""

    DISPATCHING = 0  # its jobs are going out
    DISPATCHED = 1  # decode took its job (push: prefill too; pull: after prefill)
    KV_WRITTEN = 2  # push: prefill reported the KV written
    STREAMING = 3  # decode sent the first token (or holds the answer's claim)


@dataclass
class Flight:
    request: ValidRequest
    reply_to: str
    received_at: float  # wall clock, seconds
    deadline: float  # monotonic
    mode: str = "push"
    owner: str = ""  # the client that sent it ("" for an anonymous one): only it may cancel it
    attempt: int = 0
    transfer_id: str = ""
    # This attempt's secret, for its two workers only; before the first attempt, the key of
    # the flight's queued state (a scheduler claims it to answer or to take over).
    transfer_key: str = field(default_factory=new_transfer_key)
    prefill_id: str = ""  # "" until chosen
    decode_id: str = ""  # "" until chosen (pull: after prefill)
    prefill_incarnation: str = ""  # which start of that worker got the job
    decode_incarnation: str = ""
    state: FlightState = FlightState.DISPATCHING
    moves: int = 0  # tries at moving this attempt's transfer to another decode (declined ones too)
    times_moved: int = 0  # of those, the ones that moved it (the path report's)
    # The decodes this attempt's transfer moved away from: never moved back to (each was
    # told to drop the transfer, and drops a job for it that comes again).
    left_decodes: set[str] = field(default_factory=set)
    operation: Operation = Operation.NONE  # what is being done to this attempt (``begin`` .. ``end``)
    prompt: Any = None  # kvpush.services.scheduler.prefixes.Prompt, made at dispatch
    context: Any = None  # the request's trace context, for spans of later attempts
    task: Any = None  # the attempt under way
    revision: int = 0  # of its record in the flights bucket, as this scheduler last wrote it
    traceparent: str = ""
    kv_policy: str = settings.KV_POLICY  # what decode does if the KV does not arrive intact
    takeovers: int = 0  # times a scheduler took it over from its record
    mode_chosen_by: str = "scheduler"  # this attempt's placement: who chose its mode (wire.ModeChooser), and why
    mode_reason: str = ""
    # What its client has, from decode's token records (each before its chunk):
    sent: StreamSoFar = field(default_factory=StreamSoFar)
    last_token_at: float = 0.0  # monotonic: a streaming decode silent past stall_s has stalled
    sent_known: bool = True  # every chunk sent was recorded here (not so after a takeover, until proven)
    resume: wire.Resume | None = None  # migrated: where the current attempt resumes
    resumed_after: list[int] = field(default_factory=list)  # at each migration, the tokens its client had
    prefix: wire.PrefixSource | None = None  # this attempt: where its cached prefix comes from

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def key(self) -> str:
        """Its client's and its own id (``wire.flight_key``): what the table and JetStream key it by."""
        return wire.flight_key(self.owner, self.request.request_id)

    @property
    def migrations(self) -> int:
        return len(self.resumed_after)

    @property
    def streaming(self) -> bool:
        """Decode sent the first token: a retry would repeat tokens."""
        return self.state is FlightState.STREAMING

    def new_attempt(self, transfer_id: str) -> None:
        self.attempt += 1
        self.transfer_id = transfer_id
        self.transfer_key = new_transfer_key()
        self.prefill_id = self.decode_id = self.prefill_incarnation = self.decode_incarnation = ""
        self.state = FlightState.DISPATCHING
        self.operation = Operation.NONE
        self.moves = self.times_moved = 0
        self.left_decodes = set()
        self.last_token_at = 0.0  # the new decode's first token starts its stall clock

    def _reach(self, state: FlightState) -> None:
        self.state = max(self.state, state)

    # ------------------------------------------------ what happens to it, said by its scheduler

    def key_prompt(self) -> None:
        """Its attempt's prompt's block keys, for prefix-aware picks (made at dispatch)."""
        self.prompt = Prompt(self.attempt_prompt)

    @property
    def attempt_prompt(self) -> list[int]:
        """What this attempt computes as the prompt (a reprefill migration: the tokens sent too)."""
        return continuation.resumed_prompt(self.request.prompt_token_ids, self.resume)

    def tokens_sent(self, seq: int, index: int, token_ids: list[int], now_wall: float, now: float) -> None:
        """Decode is about to send chunk ``seq`` (answer ``index``): the client has it soon."""
        self._reach(FlightState.STREAMING)
        self.last_token_at = now
        match self.sent.add(seq, index, token_ids, now_wall):
            case Arrival.GAP:
                self.sent_known = False  # a record never came: what the client has is not known here
            case Arrival.NEXT:
                self.sent_known = True  # the chunk after what the record says: nothing is missing
            case Arrival.REPEAT:
                pass  # said again: recorded already

    def why_not_migrate(self, max_migrations: int) -> str | None:
        return continuation.why_not_migrate(self.request.sampling, self.migrations, max_migrations, self.sent_known)

    def migrate(self) -> wire.Resume:
        """The next attempt resumes after every token sent so far."""
        kind, _why = continuation.continuation_of(self.request.sampling)
        self.resumed_after.append(len(self.sent.tokens))
        self.resume = self.sent.resume(kind, self.migrations)
        self.end(Operation.MIGRATE)
        return self.resume

    def place(self, mode: str, chosen_by: str = "scheduler", reason: str = "") -> None:
        """This attempt serves it in ``mode`` (push, pull or local), as ``chosen_by`` chose
        it for ``reason``."""
        self.mode, self.mode_chosen_by, self.mode_reason = mode, chosen_by, reason

    def assign_prefill(self, beat: wire.WorkerHeartbeat) -> None:
        """The prefill chosen for this attempt: that start of it."""
        self.prefill_id, self.prefill_incarnation = beat.worker_id, beat.incarnation

    def assign_decode(self, beat: wire.WorkerHeartbeat) -> None:
        """The decode chosen for this attempt: that start of it."""
        self.decode_id, self.decode_incarnation = beat.worker_id, beat.incarnation

    def release_workers(self) -> None:
        """The fenced attempt's workers no longer matter: no liveness verdict on them."""
        self.prefill_id = self.decode_id = self.prefill_incarnation = self.decode_incarnation = ""

    def jobs_taken(self) -> None:
        """Its workers took this attempt's jobs."""
        self._reach(FlightState.DISPATCHED)

    def kv_written(self) -> None:
        """Push: prefill wrote the KV into decode's blocks."""
        self._reach(FlightState.KV_WRITTEN)

    def streaming_started(self, now: float | None = None) -> None:
        """Decode answers (or may: its claim was taken): watched to its end, never retried
        (migrated if its decode is lost)."""
        self._reach(FlightState.STREAMING)
        if now is not None and not self.last_token_at:
            self.last_token_at = now

    @property
    def busy(self) -> bool:
        """An operation is under way on this attempt: no other may begin, and the watch
        gives it no verdict but its deadline."""
        return self.operation is not Operation.NONE

    def begin(self, operation: Operation) -> bool:
        """Begin ``operation`` on this attempt; False (and nothing begun) while one is under way."""
        if self.busy:
            return False
        self.operation = operation
        return True

    def end(self, operation: Operation) -> None:
        """``operation`` is over (if it is the one under way; a new attempt ended it already)."""
        if self.operation is operation:
            self.operation = Operation.NONE

    def move_declined(self) -> None:
        """Asked once: the next check does not ask again at once."""
        self.moves += 1

    def moved(self, decode_id: str, decode_incarnation: str, transfer_key: str) -> None:
        """The transfer moved to that start of ``decode_id``, under a new secret."""
        self.moves += 1
        self.times_moved += 1
        self.left_decodes.add(self.decode_id)
        self.transfer_key = transfer_key
        self.decode_id, self.decode_incarnation = decode_id, decode_incarnation

    def written_down(self, revision: int) -> None:
        """Its record in the flights bucket is at ``revision``, as this scheduler wrote it."""
        self.revision = revision

    def trace_in(self, context: Any) -> None:
        """Later spans of the flight go under ``context`` (its request's trace)."""
        self.context = context

    def track(self, task: Any) -> None:
        """``task`` works on the flight now (an attempt, a move, an end tried again)."""
        self.task = task

    def record(self, holder: str, incarnation: str, now_wall: float, now: float) -> wire.FlightRecord:
        """The flight as its record in the flights bucket (wall-clock deadline)."""
        request = self.request
        return wire.FlightRecord(
            request_id=request.request_id, owner=self.owner, reply_to=self.reply_to, received_at=self.received_at,
            deadline_at=now_wall + (self.deadline - now), prompt_token_ids=request.prompt_token_ids,
            sampling=request.sampling, transfer_mode=request.transfer_mode, holder=holder,
            holder_incarnation=incarnation, mode=self.mode, attempt=self.attempt, transfer_id=self.transfer_id,
            transfer_key=self.transfer_key, prefill_id=self.prefill_id, decode_id=self.decode_id,
            prefill_incarnation=self.prefill_incarnation, decode_incarnation=self.decode_incarnation,
            traceparent=self.traceparent, kv_policy=self.kv_policy, takeovers=self.takeovers,
            mode_chosen_by=self.mode_chosen_by, mode_reason=self.mode_reason, resume=self.resume,
            resumed_after=list(self.resumed_after),
        )

    @classmethod
    def from_record(cls, record: wire.FlightRecord, revision: int, now_wall: float, now: float) -> "Flight":
        """A flight taken over from its record: where its last holder left it (one more
        takeover). What its client has is known up to the record's resume point; whether
        more went out since is not, until decode's next token record says (``tokens_sent``)."""
        request = ValidRequest(record.request_id, record.prompt_token_ids, record.sampling, record.transfer_mode)
        resume = record.resume
        return cls(request, record.reply_to, record.received_at, now + (record.deadline_at - now_wall),
                   resume=resume, resumed_after=list(record.resumed_after), sent_known=False,
                   sent=StreamSoFar.resuming(resume),
                   kv_policy=record.kv_policy, takeovers=record.takeovers + 1, mode_chosen_by=record.mode_chosen_by,
                   mode_reason=record.mode_reason,
                   mode=record.mode, owner=record.owner, attempt=record.attempt, transfer_id=record.transfer_id,
                   transfer_key=record.transfer_key, prefill_id=record.prefill_id, decode_id=record.decode_id,
                   prefill_incarnation=record.prefill_incarnation, decode_incarnation=record.decode_incarnation,
                   revision=revision, traceparent=record.traceparent)

    def can_move(self) -> bool:
        """Push, its decode chosen, and its KV not written yet: another decode can take it
        without the prompt computed again."""
        return (self.mode == "push" and self.state is FlightState.DISPATCHED
                and bool(self.prefill_id) and self.moves < MAX_MOVES)

    def needs_prefill(self) -> bool:
        if self.state >= FlightState.KV_WRITTEN:
            return False
        return not (self.mode == "pull" and self.state is FlightState.DISPATCHED)


@dataclass
class FlightTable:
    max_attempts: int = settings.MAX_ATTEMPTS  # of attempts that start over (migrations not counted)
    max_migrations: int = settings.MAX_MIGRATIONS
    stall_s: float = settings.STALL_S  # a streaming decode without a token this long has stalled (0: never)
    _flights: dict[str, Flight] = field(default_factory=dict)
    _by_transfer: dict[str, str] = field(default_factory=dict)  # transfer id -> flight key

    def add(self, flight: Flight) -> bool:
        """False if a request of its client with this id is already in flight."""
        if flight.key in self._flights:
            return False
        self._flights[flight.key] = flight
        return True

    def bind(self, flight: Flight, transfer_id: str) -> None:
        """The flight's next attempt uses ``transfer_id``; events for older ones are stale."""
        self._by_transfer.pop(flight.transfer_id, None)
        flight.new_attempt(transfer_id)
        self._by_transfer[transfer_id] = flight.key

    def by_request(self, owner: str, request_id: str) -> Flight | None:
        """The flight of ``owner``'s request ``request_id`` (another client's is not it)."""
        return self._flights.get(wire.flight_key(owner, request_id))

    def by_transfer(self, transfer_id: str) -> Flight | None:
        key = self._by_transfer.get(transfer_id)
        return self._flights.get(key) if key is not None else None

    def adopt(self, flight: Flight) -> bool:
        """Hold a flight taken over from another scheduler, at the attempt it was in."""
        if not self.add(flight):
            return False
        if flight.transfer_id:
            self._by_transfer[flight.transfer_id] = flight.key
        return True

    def remove(self, flight: Flight) -> bool:
        """Forget the flight; False if it had already ended."""
        if self._flights.get(flight.key) is not flight:
            return False
        del self._flights[flight.key]
        self._by_transfer.pop(flight.transfer_id, None)
        return True

    def __len__(self) -> int:
        return len(self._flights)

    def __iter__(self):
        return iter(list(self._flights.values()))

    def check(self, now: float, is_live: Callable[[str, str], bool],
              overloaded: Callable[[str], bool] = lambda decode_id: False) -> list[tuple[Flight, Verdict, str]]:
        """What must happen to each flight now: (flight, verdict, the worker concerned).
        ``is_live(worker_id, incarnation)``: that start of the worker still heartbeats;
        ``overloaded(decode_id)``: its transfers not yet written would do better elsewhere."""
        verdicts: list[tuple[Flight, Verdict, str]] = []
        for flight in self:
            if now >= flight.deadline:
                verdicts.append((flight, "deadline", ""))
                continue
            if flight.busy:
                continue
            lost = ""
            if flight.decode_id and not is_live(flight.decode_id, flight.decode_incarnation):
                lost = flight.decode_id
                if flight.can_move() and is_live(flight.prefill_id, flight.prefill_incarnation):
                    verdicts.append((flight, "move", lost))
                    continue
            elif (flight.prefill_id and flight.needs_prefill()
                  and not is_live(flight.prefill_id, flight.prefill_incarnation)):
                lost = flight.prefill_id
            if not lost:
                if flight.can_move() and overloaded(flight.decode_id):
                    verdicts.append((flight, "move", flight.decode_id))
                elif self._stalled(flight, now) and flight.why_not_migrate(self.max_migrations) is None:
                    verdicts.append((flight, "stalled", flight.decode_id))
                continue
            if flight.streaming:
                migratable = lost == flight.decode_id and flight.why_not_migrate(self.max_migrations) is None
                verdicts.append((flight, "migrate" if migratable else "lost", lost))
            elif flight.attempt - flight.migrations >= self.max_attempts:
                verdicts.append((flight, "lost", lost))
            else:
                verdicts.append((flight, "retry", lost))
        return verdicts

    def _stalled(self, flight: Flight, now: float) -> bool:
        """Its decode streams (and heartbeats), but no token came for ``stall_s``."""
        return (self.stall_s > 0 and flight.streaming and bool(flight.decode_id) and flight.last_token_at > 0
                and now - flight.last_token_at > self.stall_s)
