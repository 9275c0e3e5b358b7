"""Where a request enters: every scheduler hears every ``kvpush.generate`` request; the one
designated for it (``intake``) takes it, the others keep a copy until it is settled. The
taker admits it (room, a valid reply subject, a valid request, an id not in flight), writes
it down in JetStream before any worker hears of it, and starts its first attempt."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from dataclasses import dataclass

import structlog
from opentelemetry import context as otel_context
from opentelemetry import trace

from kvpush.shared import chaos
from kvpush.otel import attributes as A
from kvpush.otel.messaging import consumer, current_traceparent
from kvpush.otel.metrics import instruments
from kvpush.services.bus import Bus
from kvpush.services.ledger import Ledger
from kvpush.services.lifecycle import BackgroundTasks
from kvpush.services.scheduler.control import FlightControl
from kvpush.services.scheduler.flights import Flight, FlightTable
from kvpush.services.scheduler.intake import EarlyCancels, HeldRequest, IntakeBook, designated, intake_key
from kvpush.services.scheduler.journal import Journal
from kvpush.services.scheduler.outbox import Outbox
from kvpush.services.scheduler.takeover import SchedulerLiveness
from kvpush.services.scheduler.timing import Uptime
from kvpush.services.scheduler.validation import RequestValidator, request_id_of
from kvpush.shared import settings, wire
from kvpush.shared.errors import Cancelled, InvalidField, InvalidReply, LedgerUnavailable, Overloaded, RequestError, refusal

log = structlog.get_logger("kvpush.scheduler")
_tracer = trace.get_tracer("kvpush.scheduler")


@dataclass(frozen=True)
class AdmissionSettings:
    deadline_s: float  # of each request, from its arrival
    mode: str  # the transfer mode of a request that names none
    max_in_flight: int  # requests held (validating or in flight) before more are refused
    kv_policy: str = settings.KV_POLICY  # of a request that names none


class Admission:
    """``tokenizer``: the one thread requests are validated on (a Hugging Face tokenizer
    must not be used from two threads at once); ``validating``: requests taken, not yet
    refused or in flight."""

    def __init__(self, bus: Bus, ledger: Ledger, validator: RequestValidator,
                 tokenizer: concurrent.futures.Executor, flights: FlightTable, early_cancels: EarlyCancels,
                 intake: IntakeBook, schedulers: SchedulerLiveness, journal: Journal, outbox: Outbox,
                 control: FlightControl, tasks: BackgroundTasks, uptime: Uptime, config: AdmissionSettings):
        self.bus = bus
        self.ledger = ledger
        self.validator = validator
        self.tokenizer = tokenizer
        self.flights = flights
        self.early_cancels = early_cancels
        self.intake = intake
        self.schedulers = schedulers
        self.journal = journal
        self.outbox = outbox
        self.control = control
        self.tasks = tasks
        self.uptime = uptime
        self.config = config
        self.scheduler_id = schedulers.me
        self.validating = 0

    def live_schedulers(self, now: float) -> dict[str, str]:
        """Who takes requests, as far as this scheduler can tell (each with its current
        start): those heard within the timeout, and itself once it has heard a whole round
        (or if it hears nobody)."""
        live = self.schedulers.live_incarnations(now)
        live.pop(self.scheduler_id, None)
        if not live or self.uptime.heard_a_round(now):
            live[self.scheduler_id] = self.schedulers.incarnation
        return live

    async def on_intake_settled(self, msg) -> None:
        settled = await self.bus.decoded(msg, wire.IntakeSettled)
        if settled is not None and settled.scheduler_id != self.scheduler_id:
            self.intake.settle(settled.key)

    async def on_generate(self, msg) -> None:
        now = time.monotonic()
        key, request_id = intake_key(wire.owner_of(msg.subject), msg.reply or "", msg.data)
        live = self.live_schedulers(now)
        chosen = designated(key, list(live))
        if chosen != self.scheduler_id:
            self.intake.hold(HeldRequest(key, request_id, msg.subject, msg.reply or "", msg.data,
                                         dict(msg.headers) if msg.headers else None, time.time_ns(), now, chosen,
                                         live.get(chosen, "")))
            return
        self._take(msg, key, request_id, time.time_ns())

    def take_orphans(self, now: float) -> None:
        """Take the copies whose designated scheduler left them unsettled."""
        for held in self.intake.orphaned(self.live_schedulers(now), now):
            self.tasks.spawn(self._take_orphan(held))

    def _take(self, msg, key: str, request_id: str, received_ns: int, orphan: bool = False) -> None:
        chaos.point("scheduler.received")
        held = len(self.flights) + self.validating
        if held >= self.config.max_in_flight:  # admission: refused before any work, the loop stays free
            self.tasks.spawn(self._refuse_overloaded(msg, key, request_id, held))
            return
        self.validating += 1
        self.tasks.spawn(self._serve(msg, received_ns, key, request_id, orphan))

    async def _refuse_overloaded(self, msg, key: str, request_id: str, held: int) -> None:
        if msg.reply and wire.reply_problem(msg.reply, wire.owner_of(msg.subject)) is None:
            await self.outbox.reply_error(msg.reply, request_id, Overloaded(
                f"this scheduler holds {held} requests, its limit (--max-in-flight {self.config.max_in_flight}); "
                "retry later"))
        await self._settled(key)

    async def _settled(self, key: str) -> None:
        """Tell the other schedulers that a request this one took needs no copy any more
        (its record, when it was accepted, tells them too)."""
        try:
            await self.bus.nc.publish(wire.INTAKE(sender=self.scheduler_id),
                                      wire.encode(wire.IntakeSettled(scheduler_id=self.scheduler_id, key=key)))
        except Exception as exc:  # they drop the copy at its keep time: a resend is never wrong
            log.warning("could not say a request was settled", error=f"{type(exc).__name__}: {exc}")

    async def _take_orphan(self, held: HeldRequest) -> None:
        """A request whose designated scheduler left before it was settled: take it as if
        it had just arrived, unless it was answered meanwhile (its final is kept)."""
        try:
            owner = wire.owner_of(held.subject)
            stored = await self.ledger.final(owner, held.request_id)
        except Exception as exc:
            log.warning("could not look up a request's final; taking it", error=f"{type(exc).__name__}: {exc}")
            stored = None
        if stored is not None and stored.reply_to == held.reply:
            return  # it ended before its scheduler left
        log.warning("taking a request whose scheduler left before writing it down", request_id=held.request_id,
                    designated=held.designated)
        instruments().failures.add(1, {"reason": "intake_taken_over"})
        with consumer(held.subject, wire.GENERATE_SUBJECT, held.headers):
            self._take(_Arrival(held.subject, held.reply, held.data, held.headers), held.key, held.request_id,
                       held.received_ns, orphan=True)

    async def _serve(self, msg, received_ns: int, key: str, request_id: str, orphan: bool = False) -> None:
        validating = _Validating(self)
        try:
            flight = await self._admit(msg, received_ns, request_id, validating)
        finally:
            validating.done()
        if flight is None:
            await self._settled(key)
            return
        request = flight.request
        with structlog.contextvars.bound_contextvars(request_id=request.request_id), _tracer.start_as_current_span(
            A.SCHEDULER_DISPATCH,
            attributes={A.REQUEST_ID: request.request_id, A.PROMPT_TOKENS: len(request.prompt_token_ids)},
        ):
            flight.trace_in(otel_context.get_current())
            flight.track(asyncio.current_task())
            await self.control.attempt(flight)

    async def _admit(self, msg, received_ns: int, request_id: str, validating: "_Validating") -> Flight | None:
        """The request as a flight in the table, or None once it was refused."""
        _tracer.start_span(A.SCHEDULER_QUEUE, start_time=received_ns).end()
        if not msg.reply:
            log.warning("dropped a request without a reply subject")
            return None
        owner = wire.owner_of(msg.subject)
        bad_reply = wire.reply_problem(msg.reply, owner)
        if bad_reply is not None:  # never publish there: it could be another's inbox, or internal
            await self.bus.refuse(refusal(self.scheduler_id, msg.subject, ValueError(bad_reply), InvalidReply))
            return None
        try:
            request = await asyncio.get_running_loop().run_in_executor(self.tokenizer, self._validate, msg.data,
                                                                       request_id)
        except RequestError as exc:
            # Kept, as every final is: a scheduler taking this request over as an orphan
            # (its designated one died as it answered) finds it answered.
            await self.outbox.reply_error(msg.reply, request_id_of(msg.data), exc, keep_for=owner, kept_as=request_id)
            return None
        flight = Flight(request, msg.reply, received_ns / 1e9, time.monotonic() + self.config.deadline_s,
                        mode=request.transfer_mode or self.config.mode, owner=owner,
                        kv_policy=request.kv_policy or self.config.kv_policy,
                        traceparent=current_traceparent())
        in_flight = InvalidField(f"request_id {request.request_id!r} is already in flight; "
                                 "use a new id for a new request")
        if not self.flights.add(flight):
            if not _resent(self.flights.by_request(owner, request.request_id), owner, msg.reply):
                await self.outbox.reply_error(msg.reply, request.request_id, in_flight)
            return None
        validating.done()  # it counts against the limit as a flight now, not twice
        try:  # written down before any worker hears of it; a final kept from the id's last use goes
            revision, _ = await asyncio.gather(self.ledger.record(self.journal.record(flight)),
                                               self.ledger.drop_final(owner, request.request_id))
            chaos.point("scheduler.recorded")
        except Exception as exc:
            self.flights.remove(flight)
            await self.outbox.reply_error(msg.reply, request.request_id, LedgerUnavailable(
                f"the request could not be written down in JetStream ({type(exc).__name__}), so no scheduler "
                "could finish it if this one died; retry later"))
            return None
        if revision is None:  # another scheduler holds that id
            self.flights.remove(flight)
            held = await self.journal.held_record(owner, request.request_id)
            if not _resent(held, owner, msg.reply):
                await self.outbox.reply_error(msg.reply, request.request_id, in_flight)
            return None
        flight.written_down(revision)
        if self.early_cancels.take(owner, request.request_id, time.monotonic()):
            await self.control.end(flight, Cancelled(f"request {request.request_id} was cancelled before it arrived"))
            return None
        return flight

    def _validate(self, data: bytes, request_id: str):
        """On the tokenizer's thread."""
        chaos.point("scheduler.validating")
        return self.validator.validate(data, request_id)


class _Validating:
    """A request counted in ``Admission.validating`` until it is a flight in the table or
    refused, once."""

    def __init__(self, admission: Admission):
        self._admission = admission
        self._counted = True

    def done(self) -> None:
        if self._counted:
            self._counted = False
            self._admission.validating -= 1


@dataclass(frozen=True)
class _Arrival:
    """A request as a held copy kept it: what ``_serve`` reads of a NATS message."""

    subject: str
    reply: str
    data: bytes
    headers: dict | None


def _resent(held, owner: str, reply_to: str) -> bool:
    """Whether a request whose id is in flight already is the same request sent again (its
    client heard nothing, and asked again on the same inbox): then the flight answers it."""
    return held is not None and held.owner == owner and held.reply_to == reply_to
