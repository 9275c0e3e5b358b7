"""The scheduler: takes ``kvpush.generate`` requests (as a queue group, so several
schedulers can share the load), validates them, and dispatches them, each attempt with a
fresh transfer id. Push: prefill and decode at the same time. Pull: prefill first, then
decode, chosen by the load at that moment.

It then watches each request to its end (``services.scheduler.flights``): every accepted request
gets a final message within its deadline. It ends requests past their deadline or
cancelled by the client (``kvpush.cancel``), telling the workers to drop them, and
retries requests whose worker went silent on other workers.

Each flight is written down in JetStream (``services.ledger``) before any worker hears of
it, and again before each attempt's jobs go out. A scheduler that hears no heartbeat from
the holder of a record for a timeout takes the flight over (``takeover``) and finishes
it. Exactly one party answers each attempt's client: whoever wins its claim (the decode,
before its first message; a scheduler, before an error final, a retry or a takeover)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import secrets
import time
import uuid
from dataclasses import dataclass

import structlog
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from otel import attributes as A
from otel import endpoint
from otel.messaging import TEMPORARY, consumer, context_from_traceparent, current_traceparent
from otel.metrics import instruments
from services.bus import Bus
from services.ledger import ClaimState, Ledger
from services.scheduler import dispatch
from connector import chaos
from services.scheduler.flights import EarlyCancels, Flight, FlightTable
from services.scheduler.intake import HeldRequest, IntakeBook, designated, intake_key
from services.scheduler.placement import Placement, PlacementSettings, place
from services.scheduler.prefixes import Prompt
from services.scheduler.routing import WorkerPool
from services.scheduler.takeover import Holding, SchedulerLiveness, orphans
from services.lifecycle import BackgroundTasks, Service
from services.scheduler.validation import RequestValidator, request_id_of
from shared import settings, wire
from shared.nats_security import nats_user
from shared.errors import (
    Cancelled,
    DeadlineExceeded,
    DispatchFailed,
    EngineFailed,
    InFlight,
    InvalidField,
    InvalidReply,
    KvpushError,
    LedgerUnavailable,
    NoWorkers,
    NotFound,
    Overloaded,
    PayloadTooLarge,
    RequestError,
    WorkerLost,
    refusal,
    to_error_body,
)

log = structlog.get_logger("kvpush.scheduler")
_tracer = trace.get_tracer("kvpush.scheduler")

DISPATCH_TIMEOUT_S = 5.0
MOVE_TIMEOUT_S = 2.0  # for prefill's answer to a MoveTransfer
WATCH_INTERVAL_S = 0.25  # how often deadlines and worker liveness are checked
UNKNOWN_CLAIM_RETRY_S = 1.0  # an end whose claim JetStream could not settle is tried again this often...
UNKNOWN_CLAIM_GRACE_S = 60.0  # ...until this long past the request's deadline
HEARD_A_ROUND_S = 1.5 * settings.HEARTBEAT_INTERVAL_S  # up this long, a scheduler has heard every live worker
INTAKE_GRACE_S = 2 * settings.HEARTBEAT_INTERVAL_S  # a copy unsettled this long goes to whoever is designated now


class _TakenOver(Exception):
    """Another scheduler wrote this flight's record since we did: it holds the flight now."""


class Scheduler(Service):
    """``async with Scheduler(url, validator):`` serves until closed. ``validator`` turns a
    request body into a ``ValidRequest`` (``validation.load_validator`` makes one from a
    model folder)."""

    def __init__(self, nats_url: str, validator: RequestValidator, scheduler_id: str | None = None,
                 mode: str = settings.TRANSFER_MODE, deadline_s: float = settings.DEADLINE_S,
                 worker_timeout_s: float = settings.WORKER_TIMEOUT_S, max_attempts: int = settings.MAX_ATTEMPTS,
                 max_in_flight: int = settings.MAX_IN_FLIGHT,
                 scheduler_timeout_s: float = settings.SCHEDULER_TIMEOUT_S, ledger_replicas: int = 1,
                 local_below_tokens: int = settings.LOCAL_PREFILL_TOKENS,
                 push_within_s: float = settings.PUSH_WITHIN_S):
        self.placement = PlacementSettings(policy=mode, local_below_tokens=local_below_tokens,
                                           push_within_s=push_within_s)
        self.mode = mode
        self.deadline_s = deadline_s
        self._handoffs: dict[str, asyncio.Future] = {}  # pull: transfer id -> its prefill's handoff
        self._move_answers: dict[str, asyncio.Future] = {}  # transfer id -> its prefill's TransferMoved
        self.nats_url = nats_url
        self.scheduler_id = scheduler_id or nats_user() or f"scheduler-{uuid.uuid4().hex[:10]}"
        if (problem := wire.identity_problem(self.scheduler_id)) is not None:
            raise ValueError(f"scheduler id: {problem}")
        self.validator = validator
        self.max_in_flight = max_in_flight
        # Tokenizing a long prompt takes a while: off the event loop, one at a time (a
        # Hugging Face tokenizer must not be used from two threads at once).
        self._tokenizer = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        self._validating = 0  # requests taken, not yet refused or in flight
        self.pool = WorkerPool(stale_after_s=worker_timeout_s)
        self.flights = FlightTable(max_attempts=max_attempts)
        self._early_cancels = EarlyCancels(keep_s=deadline_s)
        self.incarnation = uuid.uuid4().hex[:12]
        self.schedulers = SchedulerLiveness(self.scheduler_id, self.incarnation, scheduler_timeout_s,
                                            started_at=time.monotonic())
        self._holdings: dict[str, Holding] = {}  # the flights bucket, as its watch last said
        self._intake = IntakeBook(self.scheduler_id, keep_s=deadline_s, grace_s=INTAKE_GRACE_S)
        self._adopting: set[str] = set()
        self.ledger_replicas = ledger_replicas
        self.ledger: Ledger | None = None
        self._mirror: asyncio.Task | None = None
        self._beats: asyncio.Task | None = None
        self._requests = BackgroundTasks()
        self._watch: asyncio.Task | None = None
        self._closed = False
        self._started_at = time.monotonic()
        self.bus: Bus | None = None

    async def _start(self) -> None:
        self.bus = await Bus.connect(self.nats_url, self.scheduler_id, disconnected_cb=self._on_disconnected,
                                     reconnected_cb=self._on_reconnected)
        self.ledger = await Ledger.open(self.bus.nc, me=self._claimant(), replicas=self.ledger_replicas,
                                        deadline_s=self.deadline_s)
        # Heartbeats and status polls are periodic, not part of any request: not traced.
        await self.bus.subscribe_plain(wire.HEARTBEATS.wildcard, self._on_heartbeat)
        await self.bus.subscribe_plain(wire.SCHEDULER_HEARTBEATS.wildcard, self._on_scheduler_heartbeat)
        await self.bus.subscribe_plain(wire.CACHE_EVENTS.wildcard, self._on_cache_events)
        for final in (wire.FINAL_SUBJECT, wire.OWNED_FINAL.wildcard):
            await self.bus.nc.subscribe(final, queue=wire.SCHEDULER_QUEUE_GROUP, cb=self._on_final_request)
        for status in (wire.SCHEDULER_STATUS_SUBJECT, wire.OWNED_STATUS.wildcard):
            await self.bus.subscribe_plain(status, self._on_status)
        await self.bus.subscribe(wire.HANDOFFS.wildcard, self._on_handoff, template=wire.HANDOFFS)
        await self.bus.subscribe(wire.COMPLETION_SUBJECTS, self._on_completion, template=wire.KV_COMPLETIONS)
        await self.bus.subscribe(wire.PROGRESS.wildcard, self._on_progress, template=wire.PROGRESS)
        for cancel in (wire.CANCEL_SUBJECT, wire.OWNED_CANCEL.wildcard):
            await self.bus.subscribe(cancel, self._on_cancel, template=wire.CANCEL_SUBJECT)
        await self.bus.subscribe_plain(wire.INTAKE.wildcard, self._on_intake_settled)
        # Every scheduler gets every request (no queue group): one takes it, the others keep
        # a copy until it is settled (services/scheduler/intake.py says why).
        for generate in (wire.GENERATE_SUBJECT, wire.OWNED_GENERATE.wildcard):
            await self.bus.subscribe(generate, self._on_generate, template=wire.GENERATE_SUBJECT)
        await self.bus.nc.flush()
        self._started_at = time.monotonic()
        loop = asyncio.get_running_loop()
        self._mirror = loop.create_task(self._mirror_flights())
        self._beats = loop.create_task(self._heartbeat_loop())
        self._watch = loop.create_task(self._watch_flights())
        endpoint.mark_ready()  # /ready: it takes requests
        log.info("scheduler ready", scheduler_id=self.scheduler_id)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        background = [task for task in (self._watch, self._mirror, self._beats) if task is not None]
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        if self.bus is not None:
            await self.bus.close()  # stop taking requests, finish the callbacks under way
        await self._requests.close(grace_s=DISPATCH_TIMEOUT_S)
        self._tokenizer.shutdown(wait=False, cancel_futures=True)
        log.info("scheduler stopped", scheduler_id=self.scheduler_id)

    # ---------------------------------------------------------------- events

    async def _on_disconnected(self) -> None:
        self.pool.pause_evidence()  # no heartbeat can arrive: silence proves nothing
        self.schedulers.pause_evidence()
        log.warning("lost the NATS connection: no worker is declared lost until it is back")

    async def _on_reconnected(self) -> None:
        now = time.monotonic()
        self.pool.resume_evidence(now)
        self.schedulers.resume_evidence(now)
        if self._mirror is not None and not self._closed:  # its consumer may not have survived the server
            self._mirror.cancel()
            self._mirror = asyncio.get_running_loop().create_task(self._mirror_flights())
        log.info("NATS connection back: workers get a full timeout to be heard again")

    async def _on_scheduler_heartbeat(self, msg) -> None:
        beat = await self.bus.decoded(msg, wire.SchedulerHeartbeat)
        if beat is not None:
            self.schedulers.observe(beat.scheduler_id, beat.incarnation, time.monotonic())

    async def _heartbeat_loop(self) -> None:
        subject = wire.SCHEDULER_HEARTBEATS(sender=self.scheduler_id)
        while True:
            beat = wire.SchedulerHeartbeat(scheduler_id=self.scheduler_id, incarnation=self.incarnation,
                                           flights=len(self.flights))
            instruments().in_flight.set(len(self.flights), {"scheduler_id": self.scheduler_id})
            try:
                await self.bus.nc.publish(subject, wire.encode(beat))
            except Exception as exc:
                log.warning("scheduler heartbeat failed", error=str(exc))
            await asyncio.sleep(settings.HEARTBEAT_INTERVAL_S)

    async def _mirror_flights(self) -> None:
        """Keep ``_holdings`` equal to the flights bucket: who holds which request."""
        while True:
            try:
                watcher = await self.ledger.watch_flights()
                holdings: dict[str, Holding] = {}
                live = False
                async for entry in watcher:
                    if entry is None:  # caught up with what was there before the watch
                        self._holdings, live = holdings, True
                        continue
                    if entry.operation is None and entry.value:
                        self._intake.settle(entry.key)  # written down: its copy here is not needed
                        record = wire.decode(entry.value, wire.FlightRecord)
                        holdings[entry.key] = Holding(record.holder, record.holder_incarnation, entry.revision)
                    else:
                        holdings.pop(entry.key, None)
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("the flights watch failed; starting it again", error=f"{type(exc).__name__}: {exc}")
                await asyncio.sleep(1.0)

    async def _on_final_request(self, msg) -> None:
        """``kvpush.final``: the request's last message again, to the client that sent it."""
        owner = wire.owner_of(msg.subject)
        if not msg.reply or wire.reply_problem(msg.reply, owner) is not None:
            return
        asked = await self.bus.decoded(msg, wire.FinalRequest, wire.decode_json)
        if asked is None:
            return
        try:
            stored = await self.ledger.final(owner, asked.request_id)
            if stored is not None and stored.owner == owner:
                await self.bus.nc.publish(msg.reply, stored.body)
                return
            flying = (self.flights.by_request(owner, asked.request_id)
                      or await self._held_record(owner, asked.request_id))
        except Exception as exc:  # JetStream cannot say: the client asks again on its next silence
            log.warning("could not look up a final", request_id=asked.request_id, error=f"{type(exc).__name__}: {exc}")
            return
        # Another client's request is another key: its ids are not this one's to probe.
        if flying is not None and flying.owner == owner:
            answer: KvpushError = InFlight(f"request {asked.request_id!r} is in flight: its last message is not "
                                           "there yet")
        else:
            answer = NotFound(f"no request {asked.request_id!r} is in flight or kept: it never reached a "
                              f"scheduler, or it ended over {wire.FINALS_KEEP_S:g} s ago")
        await self.bus.nc.publish(msg.reply, wire.encode_json(wire.ErrorReply(asked.request_id, to_error_body(answer))))

    async def _held_record(self, owner: str, request_id: str) -> wire.FlightRecord | None:
        """The request's flight record in JetStream (whichever scheduler holds it), if any."""
        found = await self.ledger.flight(wire.flight_key(owner, request_id))
        return found[0] if found is not None else None

    async def _on_heartbeat(self, msg) -> None:
        beat = await self.bus.decoded(msg, wire.WorkerHeartbeat)
        if beat is not None:
            self.pool.observe(beat, time.monotonic())

    async def _on_cache_events(self, msg) -> None:
        events = await self.bus.decoded(msg, wire.CacheEvents)
        if events is not None:
            self.pool.cache_events(events)

    async def _on_status(self, msg) -> None:
        now = time.monotonic()
        status = wire.SchedulerStatus(
            scheduler_id=self.scheduler_id,
            prefill_workers=[b.worker_id for b in self.pool.live("prefill", now)],
            decode_workers=[b.worker_id for b in self.pool.live("decode", now)],
        )
        # Only to the asker's own inbox: never make a scheduler publish into another's.
        if msg.reply and wire.reply_problem(msg.reply, wire.owner_of(msg.subject)) is None:
            await self.bus.nc.publish(msg.reply, wire.encode_json(status))

    async def _on_handoff(self, msg) -> None:
        handoff = await self.bus.decoded(msg, wire.Handoff)
        if handoff is None:
            return
        flight = self.flights.by_transfer(handoff.transfer_id)
        if flight is None:
            return  # another scheduler's, or an attempt we already replaced
        if handoff.prefill_engine_id != flight.prefill_id:
            await self.bus.wrong_party(msg, f"a Handoff from {handoff.prefill_engine_id} for {handoff.transfer_id}, "
                                            f"whose prefill is {flight.prefill_id or 'not chosen'}")
            return
        waiting = self._handoffs.get(handoff.transfer_id)
        if waiting is not None and not waiting.done():
            waiting.set_result(handoff)  # pull: now pick decode
        elif handoff.error is not None:
            await self._end(flight, EngineFailed(handoff.error.message))  # push: decode would wait in vain
        log.debug("prefill finished", request_id=handoff.request_id, transfer_id=handoff.transfer_id,
                  prefill_ms=round((handoff.prefill_finished_at - handoff.prefill_started_at) * 1000, 1))

    async def _on_completion(self, msg) -> None:
        event = await self.bus.decoded(msg, wire.Completion)
        if isinstance(event, wire.TransferFailed):
            # Decode hears it too and recomputes or fails the request, per its policy.
            log.warning("kv transfer failed", transfer_id=event.transfer_id, code=event.code, reason=event.reason)
            return
        if event is None:
            return
        flight = self.flights.by_transfer(event.transfer_id)
        if flight is not None and event.prefill_engine_id != flight.prefill_id:
            await self.bus.wrong_party(msg, f"a {type(event).__name__} from {event.prefill_engine_id} for "
                                            f"{event.transfer_id}, whose prefill is {flight.prefill_id}")
            return
        if isinstance(event, wire.TransferDone):
            if flight is not None:
                flight.kv_pushed = True
            log.debug("kv pushed", transfer_id=event.transfer_id, order=event.order,
                      bytes=event.bytes, descriptors=event.descriptors, write_ms=round(event.write_ms, 2))
            return
        waiting = self._move_answers.get(event.transfer_id)  # a TransferMoved
        if waiting is not None and not waiting.done():
            waiting.set_result(event)

    async def _on_progress(self, msg) -> None:
        event = await self.bus.decoded(msg, wire.RequestProgress)
        flight = self.flights.by_transfer(event.transfer_id) if event is not None else None
        if flight is None:
            return  # another scheduler's, or an attempt we already replaced
        if event.worker_id != flight.decode_id:
            await self.bus.wrong_party(msg, f"progress from {event.worker_id} for {event.transfer_id}, "
                                            f"whose decode is {flight.decode_id or 'not chosen'}")
            return
        if event.stage == "streaming":
            flight.streaming = True
            return
        if event.outcome == wire.UNCLAIMED:  # it sent nothing, and never will: another attempt
            self._requests.spawn(self._retry(flight, flight.decode_id, decode_gave_up=True))
            return
        if not self.flights.remove(flight):
            return
        # Every decode's progress comes through this one subscription: writing the end down
        # waits on JetStream, and must not hold up the next request's progress behind it.
        self._requests.spawn(self._ended(flight, event))

    async def _ended(self, flight: Flight, event: wire.RequestProgress) -> None:
        if event.final:
            await self.ledger.keep_final(flight.owner, flight.request_id, event.final, flight.reply_to)
        await self.ledger.forget(flight.owner, flight.request_id, flight.revision)
        if event.outcome == "client_gone":
            await self._cancel_jobs(flight, "the client went away")  # prefill may still hold work for it

    async def _on_cancel(self, msg) -> None:
        cancel = await self.bus.decoded(msg, wire.CancelRequest, wire.decode_json)
        owner = wire.owner_of(msg.subject)
        flight = self.flights.by_request(owner, cancel.request_id) if cancel is not None else None
        if flight is not None:
            await self._end(flight, Cancelled(f"request {cancel.request_id} was cancelled by the client"))
        elif cancel is not None:  # another scheduler's, already ended, or not here yet: keep it for a while
            self._early_cancels.remember(owner, cancel.request_id, time.monotonic())

    def _live_schedulers(self, now: float) -> dict[str, str]:
        """Who takes requests, as far as this scheduler can tell (each with its current
        start): those heard within the timeout, and itself once it has heard a whole round
        (or if it hears nobody)."""
        live = self.schedulers.live_incarnations(now)
        live.pop(self.scheduler_id, None)
        if not live or now - self._started_at > HEARD_A_ROUND_S:
            live[self.scheduler_id] = self.incarnation
        return live

    async def _on_intake_settled(self, msg) -> None:
        settled = await self.bus.decoded(msg, wire.IntakeSettled)
        if settled is not None and settled.scheduler_id != self.scheduler_id:
            self._intake.settle(settled.key)

    async def _on_generate(self, msg) -> None:
        now = time.monotonic()
        key, request_id = intake_key(wire.owner_of(msg.subject), msg.reply or "", msg.data)
        live = self._live_schedulers(now)
        chosen = designated(key, list(live))
        if chosen != self.scheduler_id:
            self._intake.hold(HeldRequest(key, request_id, msg.subject, msg.reply or "", msg.data,
                                          dict(msg.headers) if msg.headers else None, time.time_ns(), now, chosen,
                                          live.get(chosen, "")))
            return
        self._take(msg, key, request_id, time.time_ns())

    def _take(self, msg, key: str, request_id: str, received_ns: int, orphan: bool = False) -> None:
        chaos.point("scheduler.received")
        held = len(self.flights) + self._validating
        if held >= self.max_in_flight:  # admission: refused before any work, the loop stays free
            self._requests.spawn(self._refuse_overloaded(msg, key, request_id, held))
            return
        self._validating += 1
        self._requests.spawn(self._serve(msg, received_ns, key, request_id, orphan))

    async def _refuse_overloaded(self, msg, key: str, request_id: str, held: int) -> None:
        if msg.reply and wire.reply_problem(msg.reply, wire.owner_of(msg.subject)) is None:
            await self._reply_error(msg.reply, request_id, Overloaded(
                f"this scheduler holds {held} requests, its limit (--max-in-flight {self.max_in_flight}); "
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

    # ---------------------------------------------------------------- a request's life

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
            flight.context = otel_context.get_current()
            flight.task = asyncio.current_task()
            await self._attempt(flight)

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
            request = await asyncio.get_running_loop().run_in_executor(self._tokenizer, self._validate, msg.data,
                                                                       request_id)
        except RequestError as exc:
            # Kept, as every final is: a scheduler taking this request over as an orphan
            # (its designated one died as it answered) finds it answered.
            await self._reply_error(msg.reply, request_id_of(msg.data), exc, keep_for=owner, kept_as=request_id)
            return None
        flight = Flight(request, msg.reply, received_ns / 1e9, time.monotonic() + self.deadline_s,
                        mode=request.transfer_mode or self.mode, owner=owner,
                        traceparent=current_traceparent())
        in_flight = InvalidField(f"request_id {request.request_id!r} is already in flight; "
                                 "use a new id for a new request")
        if not self.flights.add(flight):
            if not _resent(self.flights.by_request(owner, request.request_id), owner, msg.reply):
                await self._reply_error(msg.reply, request.request_id, in_flight)
            return None
        validating.done()  # it counts against the limit as a flight now, not twice
        try:  # written down before any worker hears of it; a final kept from the id's last use goes
            revision, _ = await asyncio.gather(self.ledger.record(self._record(flight)),
                                               self.ledger.drop_final(owner, request.request_id))
            chaos.point("scheduler.recorded")
        except Exception as exc:
            self.flights.remove(flight)
            await self._reply_error(msg.reply, request.request_id, LedgerUnavailable(
                f"the request could not be written down in JetStream ({type(exc).__name__}), so no scheduler "
                "could finish it if this one died; retry later"))
            return None
        if revision is None:  # another scheduler holds that id
            self.flights.remove(flight)
            held = await self._held_record(owner, request.request_id)
            if not _resent(held, owner, msg.reply):
                await self._reply_error(msg.reply, request.request_id, in_flight)
            return None
        flight.revision = revision
        if self._early_cancels.take(owner, request.request_id, time.monotonic()):
            await self._end(flight, Cancelled(f"request {request.request_id} was cancelled before it arrived"))
            return None
        return flight

    def _validate(self, data: bytes, request_id: str):
        """On the tokenizer's thread."""
        chaos.point("scheduler.validating")
        return self.validator.validate(data, request_id)

    def _record(self, flight: Flight) -> wire.FlightRecord:
        return flight.record(self.scheduler_id, self.incarnation, time.time(), time.monotonic())

    async def _write_down(self, flight: Flight) -> None:
        """Write the flight's attempt over our last revision before its jobs go out; raises
        ``_TakenOver`` if another scheduler holds it now (then we let it go, silently)."""
        revision = await self.ledger.rewrite(self._record(flight), flight.revision)
        if revision is None:
            log.warning("another scheduler took this flight over", request_id=flight.request_id)
            self.flights.remove(flight)
            raise _TakenOver(flight.request_id)
        flight.revision = revision

    async def _attempt(self, flight: Flight) -> None:
        """One try at dispatching the flight; ends it with an error if that fails."""
        try:
            await self._dispatch(flight)
        except (asyncio.CancelledError, _TakenOver):
            pass  # replaced by a retry, ended, or held by another scheduler now
        except DispatchFailed as exc:
            if flight.attempt < self.flights.max_attempts:  # a worker that does not take jobs is as good as lost
                await self._retry(flight, exc.worker_id)
            else:
                await self._end(flight, exc)
        except KvpushError as exc:
            await self._end(flight, exc)
        except Exception as exc:
            log.exception("dispatch failed")
            await self._end(flight, exc)

    def _claimant(self) -> wire.Claimant:
        return wire.Claimant.scheduler(self.scheduler_id, self.incarnation)

    async def _retry(self, flight: Flight, lost_worker: str, decode_gave_up: bool = False) -> None:
        """A new attempt elsewhere, once the old one is fenced. ``decode_gave_up``: its
        decode said it will send nothing (it could not learn whether it won the claim), so
        even a claim it holds does not answer the client."""
        # Fence the attempt first: once we hold its claim, its decode can never answer.
        claim = await self.ledger.claim(flight.transfer_key, flight.decode_id)
        if claim.state is ClaimState.UNKNOWN:
            return  # JetStream cannot say: the next check tries again
        if claim.by_decode and not decode_gave_up:  # the decode answers already: tokens may be out
            if lost_worker == flight.decode_id:
                flight.streaming = True
                await self._end(flight, WorkerLost(
                    f"worker {lost_worker} went silent after the answer had started; "
                    "the request was not retried, since that would repeat tokens"), decode_lost=True)
            else:
                flight.streaming = True  # it has the KV: the lost prefill no longer matters
            return
        if not claim.won and not claim.by_decode:  # another scheduler fenced it: the flight is its now
            self.flights.remove(flight)
            self._stop_attempt(flight)
            return
        log.warning("worker lost, retrying elsewhere", request_id=flight.request_id, worker=lost_worker,
                    attempt=flight.attempt)
        instruments().failures.add(1, {"reason": "worker_lost_retried"})
        self.pool.forget(lost_worker)
        self._stop_attempt(flight)
        await self._cancel_jobs(flight, f"retried: worker {lost_worker} was lost")
        self._attempt_again(flight)

    async def _move(self, flight: Flight, lost: str) -> None:
        """Push: the decode chosen at arrival went silent, or is overloaded, before its KV
        was written. Move the transfer to another decode: prefill writes into the new
        decode's registration, the first decode's blocks come back through its revoke, and
        nothing is recomputed. A silent decode whose transfer cannot move (prefill says its
        write began, or no other decode is live) is retried as before; an overloaded one
        keeps it."""
        with _tracer.start_as_current_span(
            A.SCHEDULER_MOVE, context=flight.context,
            attributes={A.REQUEST_ID: flight.request_id, A.TRANSFER_ID: flight.transfer_id, A.MOVED_FROM: lost,
                        A.MOVE_REASON: "overloaded" if self.pool.is_live(lost, flight.decode_incarnation,
                                                                          time.monotonic()) else "lost"},
        ) as span:
            try:
                why_not = await self._move_transfer(flight, lost)
            except DispatchFailed as exc:
                why_not = str(exc)
            finally:
                flight.moving = False
            if why_not is None:
                span.set_attribute(A.DECODE_WORKER, flight.decode_id)
                return
            span.set_status(Status(StatusCode.ERROR, why_not))
        if self.pool.is_live(lost, flight.decode_incarnation, time.monotonic()) and flight.decode_id == lost:
            log.info("could not move the transfer; it stays", request_id=flight.request_id, reason=why_not)
            flight.moves += 1  # asked once: the next check does not ask again at once
            return
        log.info("could not move the transfer; retrying", request_id=flight.request_id, reason=why_not)
        await self._retry(flight, lost)

    async def _move_transfer(self, flight: Flight, lost: str) -> str | None:
        """Why the transfer could not move, or None once it did."""
        now = time.monotonic()
        if not self.pool.is_live(lost, flight.decode_incarnation, now):
            self.pool.forget(lost)
        try:
            decode_id = self.pool.pick_decode(len(flight.request.prompt_token_ids), now, prompt=flight.prompt,
                                              exclude=lost)
        except NoWorkers:
            return "no other decode worker is live"
        new_key = secrets.token_hex(16)
        answer = asyncio.get_running_loop().create_future()
        self._move_answers[flight.transfer_id] = answer
        try:
            await self.bus.publish(wire.move_subject(flight.prefill_id, self.scheduler_id), wire.encode(
                wire.MoveTransfer(transfer_id=flight.transfer_id, scheduler_id=self.scheduler_id,
                                  transfer_key=flight.transfer_key, decode_engine_id=decode_id,
                                  new_transfer_key=new_key)))
            moved: wire.TransferMoved = await asyncio.wait_for(answer, MOVE_TIMEOUT_S)
        except asyncio.TimeoutError:
            return f"prefill {flight.prefill_id} did not answer the move within {MOVE_TIMEOUT_S:g} s"
        finally:
            self._move_answers.pop(flight.transfer_id, None)
        if not moved.moved:
            return f"prefill {flight.prefill_id} did not move it: {moved.reason}"
        # Fence the first decode: from now on it can never answer this attempt.
        claim = await self.ledger.claim(flight.transfer_key, flight.decode_id)
        if claim.by_decode or claim.state is ClaimState.UNKNOWN:
            # It answers already (it computed the prompt itself), or it may: watch it as streaming.
            flight.streaming = True
            return None
        if not claim.won:  # another scheduler fenced it: the flight is its now
            self.flights.remove(flight)
            return None
        await self.bus.publish(wire.decode_job_subject(lost), wire.encode(wire.CancelJob(
            request_id=flight.request_id, transfer_id=flight.transfer_id, reason=f"moved to {decode_id}")))
        flight.moves += 1
        flight.transfer_key = new_key
        self._bind_workers(flight, decode_id=decode_id)
        await self._write_down(flight)
        beat = self.pool.beat(flight.prefill_id)
        await self._send(decode_id, dispatch.decode_job(flight, beat.kv_params if beat else None))
        log.info("transfer moved", request_id=flight.request_id, transfer_id=flight.transfer_id, moved_from=lost,
                 decode=decode_id)
        return None

    def _attempt_again(self, flight: Flight) -> None:
        """A new attempt at the flight, in its own trace span, in the background."""

        async def again() -> None:
            with _tracer.start_as_current_span(
                A.SCHEDULER_DISPATCH, context=flight.context,
                attributes={A.REQUEST_ID: flight.request_id, A.ATTEMPT: flight.attempt + 1},
            ):
                await self._attempt(flight)

        flight.task = self._requests.spawn(again())

    async def _end(self, flight: Flight, error: BaseException, decode_lost: bool = False) -> None:
        """End the flight: the workers drop the request and the client gets ``error``, from
        us if we win the attempt's claim, else from the decode that holds it (if it was
        ``decode_lost``, from us all the same)."""
        if not self.flights.remove(flight):
            return
        self._stop_attempt(flight)
        body = to_error_body(error)
        claim = await self.ledger.claim(flight.transfer_key, flight.decode_id)
        if claim.state is ClaimState.UNKNOWN:
            # Whether the decode answers cannot be told: saying it too could be a second
            # final. The flight stays ours; the watch ends it again once JetStream answers.
            self.flights.adopt(flight)
            if time.monotonic() < flight.deadline + UNKNOWN_CLAIM_GRACE_S:
                flight.task = self._requests.spawn(self._end_later(flight, error, decode_lost))
            else:
                log.error("JetStream cannot say who answers this request; leaving it to the client's own "
                          "fetch of its final", request_id=flight.request_id)
                self.flights.remove(flight)
            return
        if claim.won or (decode_lost and claim.by_decode):
            await self._cancel_jobs(flight, body.code)
            with otel_context_of(flight):
                await self._reply_error(flight.reply_to, flight.request_id, error, keep_for=flight.owner)
        elif claim.by_decode:
            await self._cancel_jobs(flight, body.code, error=body)
        else:
            return  # another scheduler fenced the attempt: the flight is its now
        await self.ledger.forget(flight.owner, flight.request_id, flight.revision)

    async def _end_later(self, flight: Flight, error: BaseException, decode_lost: bool) -> None:
        await asyncio.sleep(UNKNOWN_CLAIM_RETRY_S)
        await self._end(flight, error, decode_lost)

    def _stop_attempt(self, flight: Flight) -> None:
        if flight.task is not None and flight.task is not asyncio.current_task():
            flight.task.cancel()
        waiting = self._handoffs.pop(flight.transfer_id, None)
        if waiting is not None and not waiting.done():
            waiting.cancel()

    async def _cancel_jobs(self, flight: Flight, reason: str, error: wire.ErrorBody | None = None) -> None:
        """Tell the flight's current workers to drop the request (queued or running).
        ``error``: what the decode tells the client, if it holds the answer's claim."""
        cancel = wire.encode(wire.CancelJob(request_id=flight.request_id, transfer_id=flight.transfer_id,
                                            reason=reason, error=error))
        if flight.prefill_id:
            await self.bus.publish(wire.prefill_job_subject(flight.prefill_id), cancel)
        if flight.decode_id:
            await self.bus.publish(wire.decode_job_subject(flight.decode_id), cancel)

    async def _watch_flights(self) -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            now = time.monotonic()
            if now - last > WATCH_INTERVAL_S + self.pool.stale_after_s / 2:
                # Our own loop stalled: heartbeats queued behind it have not been read yet.
                log.warning("the scheduler's loop stalled; liveness waits for fresh heartbeats",
                            stalled_s=round(now - last, 2))
                self.pool.resume_evidence(now)
                self.schedulers.resume_evidence(now)
            last = now
            for flight, verdict, worker in self.flights.check(now, lambda w, i: self.pool.is_live(w, i, now),
                                                              lambda decode_id: self.pool.overloaded(decode_id, now)):
                try:
                    if verdict == "deadline":
                        await self._end(flight, DeadlineExceeded(
                            f"no answer within the {self.deadline_s:g} s deadline"))
                    elif verdict == "move":
                        flight.moving = True
                        flight.task = self._requests.spawn(self._move(flight, worker))
                    elif verdict == "retry":
                        await self._retry(flight, worker)
                    else:
                        self.pool.forget(worker)
                        await self._end(flight, WorkerLost(
                            f"worker {worker} went silent after the answer had started; "
                            "the request was not retried, since that would repeat tokens"
                            if flight.streaming else
                            f"worker {worker} went silent and {flight.attempt} attempts were used"),
                            decode_lost=worker == flight.decode_id)
                except Exception:
                    log.exception("could not act on a request", request_id=flight.request_id, verdict=verdict)
            self._take_over_orphans(now)
            for held in self._intake.orphaned(self._live_schedulers(now), now):
                self._requests.spawn(self._take_orphan(held))

    # ---------------------------------------------------------------- takeover

    def _take_over_orphans(self, now: float) -> None:
        if len(self.flights) + len(self._adopting) >= self.max_in_flight:
            return  # full: a scheduler with room takes them
        held = {flight.key for flight in self.flights}
        for key, _ in orphans(self._holdings, self.schedulers, now, held | self._adopting):
            if len(self.flights) + len(self._adopting) >= self.max_in_flight:
                break
            self._adopting.add(key)
            self._requests.spawn(self._adopt(key))

    async def _adopt(self, key: str) -> None:
        """Take over the flight under ``key`` whose scheduler is gone, if no other scheduler is quicker."""
        try:
            found = await self.ledger.flight(key)
            if found is None:
                return
            record, revision = found
            request_id = record.request_id
            now, now_wall = time.monotonic(), time.time()
            lost = record.holder
            if not self.schedulers.is_gone(record.holder, record.holder_incarnation, now):
                return
            record.holder, record.holder_incarnation = self.scheduler_id, self.incarnation
            revision = await self.ledger.rewrite(record, revision)
            if revision is None:
                return  # another scheduler took it first
            flight = Flight.from_record(record, revision, now_wall, now)
            if not self.flights.adopt(flight):
                return
            flight.context = context_from_traceparent(record.traceparent)
            instruments().failures.add(1, {"reason": "flight_taken_over"})
            with otel_context_of(flight), _tracer.start_as_current_span(
                A.SCHEDULER_TAKEOVER, attributes={A.REQUEST_ID: request_id, A.ATTEMPT: flight.attempt}):
                log.warning("taking over a flight whose scheduler was lost", request_id=request_id,
                            lost_scheduler=lost, attempt=flight.attempt)
                await self._resume(flight)
        except Exception:
            log.exception("could not take a flight over", flight_key=key)
        finally:
            self._adopting.discard(key)

    async def _resume(self, flight: Flight) -> None:
        """Finish a flight taken over: let its decode finish if it answers already; else
        fence the attempt it was in and start a new one."""
        if self._early_cancels.take(flight.owner, flight.request_id, time.monotonic()):
            await self._end(flight, Cancelled(f"request {flight.request_id} was cancelled by the client"))
            return
        claim = await self.ledger.claim(flight.transfer_key, flight.decode_id)
        if claim.by_decode or claim.state is ClaimState.UNKNOWN:
            # We watch it to its end, as its holder did (or, if JetStream cannot say who
            # answers, until its deadline, when ending it asks again).
            flight.streaming = flight.decode_took_job = True
            return
        if not claim.won:  # a scheduler that died as it answered, or as it took over
            if await self.ledger.final(flight.owner, flight.request_id) is not None:  # it answered: kept
                self.flights.remove(flight)
                await self.ledger.forget(flight.owner, flight.request_id, flight.revision)
                return
            if not await self.ledger.take_claim(flight.transfer_key, flight.decode_id, claim):
                self.flights.remove(flight)  # someone else moved first; it holds the flight
                return
        await self._cancel_jobs(flight, "its scheduler was lost; retried")
        self._bind_workers_none(flight)
        self._attempt_again(flight)

    @staticmethod
    def _bind_workers_none(flight: Flight) -> None:
        """The fenced attempt's workers no longer matter: no liveness verdict on them."""
        flight.prefill_id = flight.decode_id = flight.prefill_incarnation = flight.decode_incarnation = ""

    # ---------------------------------------------------------------- dispatch

    async def _pick(self, flight: Flight, pick):
        """``pick()`` now. With no live worker: fail at once if this deployment never had
        one (as far as a whole heartbeat round since our start can tell: a scheduler that
        just joined has heard nobody yet); otherwise they are down (crashed, restarting),
        and the request waits for one until its deadline."""
        while True:
            try:
                return pick()
            except NoWorkers:
                heard_a_round = time.monotonic() - self._started_at > HEARD_A_ROUND_S
                if flight.attempt <= 1 and not self.pool.has_served() and heard_a_round:
                    raise
            await asyncio.sleep(WATCH_INTERVAL_S)

    async def _dispatch(self, flight: Flight) -> None:
        flight.prompt = Prompt(flight.request.prompt_token_ids)  # its block keys, for prefix-aware picks
        placement = self._place(flight)
        flight.mode = placement.mode
        self.flights.bind(flight, uuid.uuid4().hex)
        span = trace.get_current_span()
        span.set_attributes({A.TRANSFER_MODE: flight.mode, A.PLACEMENT_REASON: placement.reason,
                             **{f"{A.PLACEMENT_PREFIX}{k}": v for k, v in placement.numbers.items()}})
        if flight.mode == "pull":
            await self._dispatch_pull(flight)
        elif flight.mode == "local":
            await self._dispatch_local(flight)
        else:
            await self._dispatch_push(flight)
        flight.decode_took_job = True
        log.info("dispatched", transfer_id=flight.transfer_id, prefill=flight.prefill_id, decode=flight.decode_id,
                 prompt_tokens=len(flight.request.prompt_token_ids), mode=flight.mode, attempt=flight.attempt)

    def _place(self, flight: Flight) -> Placement:
        now = time.monotonic()
        prompt_tokens = len(flight.request.prompt_token_ids)
        return place(prompt_tokens, flight.request.transfer_mode, self.placement,
                     dispatch.CONNECTOR_MODES.get(self.pool.connector(now), ("push", "pull")),
                     self.pool.prefill_load(now, flight.prompt), self.pool.decode_load(prompt_tokens, now, flight.prompt))

    async def _dispatch_local(self, flight: Flight) -> None:
        """The decode computes the prompt itself: no prefill, no transfer."""
        decode_id = await self._pick(
            flight, lambda: self.pool.pick_decode(len(flight.request.prompt_token_ids), time.monotonic(),
                                                  prompt=flight.prompt))
        self._bind_workers(flight, decode_id=decode_id)
        trace.get_current_span().set_attributes({A.TRANSFER_ID: flight.transfer_id, A.DECODE_WORKER: decode_id})
        await self._write_down(flight)
        await self._send(decode_id, dispatch.decode_job(flight, None))

    async def _dispatch_push(self, flight: Flight) -> None:
        prefill_id, decode_id = await self._pick(
            flight, lambda: self.pool.pick(len(flight.request.prompt_token_ids), time.monotonic(), prompt=flight.prompt))
        self._bind_workers(flight, prefill_id, decode_id)
        trace.get_current_span().set_attributes(
            {A.TRANSFER_ID: flight.transfer_id, A.PREFILL_WORKER: prefill_id, A.DECODE_WORKER: decode_id}
        )
        await self._write_down(flight)
        beat = self.pool.beat(prefill_id)
        # Both at once: decode registers its blocks while prefill computes.
        await asyncio.gather(
            self._send(prefill_id, dispatch.prefill_job(flight)),
            self._send(decode_id, dispatch.decode_job(flight, beat.kv_params if beat else None)),
        )

    def _bind_workers(self, flight: Flight, prefill_id: str | None = None, decode_id: str | None = None) -> None:
        for worker_id, role in ((prefill_id, "prefill"), (decode_id, "decode")):
            if worker_id:
                beat = self.pool.beat(worker_id)
                setattr(flight, f"{role}_id", worker_id)
                setattr(flight, f"{role}_incarnation", beat.incarnation if beat else "")

    async def _dispatch_pull(self, flight: Flight) -> None:
        """Pull, the way vLLM's default connector is driven: prefill first; decode is chosen
        from the load at the moment prefill finished, and reads the prefill's blocks."""
        request, transfer_id = flight.request, flight.transfer_id
        # A retry waits for a live decode *before* prefill: once prefill is done, its
        # blocks are held only for a lease, and a READ after that would read freed ones.
        await self._pick(flight, lambda: self.pool.require("decode", time.monotonic()))
        prefill_id = await self._pick(
            flight, lambda: self.pool.pick_prefill(time.monotonic(), len(request.prompt_token_ids), prompt=flight.prompt))
        self._bind_workers(flight, prefill_id)
        span = trace.get_current_span()
        span.set_attributes({A.TRANSFER_ID: transfer_id, A.PREFILL_WORKER: prefill_id})
        await self._write_down(flight)
        handoff_arrived = asyncio.get_running_loop().create_future()
        self._handoffs[transfer_id] = handoff_arrived
        try:
            await self._send(prefill_id, dispatch.prefill_job(flight))
            with _tracer.start_as_current_span(A.SCHEDULER_WAIT_PREFILL):
                handoff: wire.Handoff = await handoff_arrived  # the deadline watch bounds this wait
        finally:
            self._handoffs.pop(transfer_id, None)
        if handoff.error is not None:
            raise EngineFailed(handoff.error.message)
        decode_id = self.pool.pick_decode(len(request.prompt_token_ids), time.monotonic(),
                                          prompt=flight.prompt)  # no waiting now
        self._bind_workers(flight, decode_id=decode_id)
        span.set_attribute(A.DECODE_WORKER, decode_id)
        await self._write_down(flight)
        # What the prefill engine returned goes to decode as is (vLLM's examples do the same).
        await self._send(decode_id, dispatch.decode_job(flight, handoff.kv_transfer_params))

    async def _send(self, worker_id: str, job: wire.PrefillJob | wire.DecodeJob) -> None:
        """Hand a job to a worker and wait for its ack."""
        body = wire.encode(job)
        if len(body) > self.bus.max_payload:
            raise PayloadTooLarge(
                f"the prompt makes a {len(body)}-byte job, over the NATS server's max_payload of "
                f"{self.bus.max_payload} bytes; raise max_payload or send a shorter prompt"
            )
        subject = (wire.prefill_job_subject if isinstance(job, wire.PrefillJob) else wire.decode_job_subject)(worker_id)
        if isinstance(job, wire.DecodeJob):  # where it claims its answer: there before it can
            await self.ledger.claims.ensure_stream(worker_id)
        try:
            reply = await self.bus.request(subject, body, DISPATCH_TIMEOUT_S)
        except Exception as exc:
            raise DispatchFailed(f"worker {worker_id} did not accept the job: {type(exc).__name__}",
                                 worker_id) from None
        ack = wire.decode(reply.data, wire.JobAck)
        if not ack.accepted:
            reason = ack.error.message if ack.error is not None else "it gave no reason"
            raise DispatchFailed(f"worker {worker_id} refused the job: {reason}", worker_id)

    async def _reply_error(self, reply_to: str, request_id: str, exc: BaseException,
                           keep_for: str | None = None, kept_as: str | None = None) -> None:
        """Send the client an error final; ``keep_for`` (the flight's owner): keep it for
        ``kvpush.final`` first (under ``kept_as``, by default the request id), so a client
        that misses it can fetch it."""
        body = to_error_body(exc)
        log.info("request rejected", request_id=request_id, code=body.code, message=body.message)
        span = trace.get_current_span()
        span.set_attributes({A.REQUEST_ID: request_id, A.ERROR_CODE: body.code})
        span.set_status(Status(StatusCode.ERROR, body.message))
        instruments().failures.add(1, {"reason": body.code})
        instruments().requests.add(1, {"outcome": "error"})
        data = wire.encode_json(wire.ErrorReply(request_id, body))
        if keep_for is not None:
            await self.ledger.keep_final(keep_for, kept_as or request_id, data, reply_to)
        await self.bus.publish(reply_to, data, template=TEMPORARY)


class _Validating:
    """A request counted in ``Scheduler._validating`` until it is a flight in the table or
    refused, once."""

    def __init__(self, scheduler: Scheduler):
        self._scheduler = scheduler
        self._counted = True

    def done(self) -> None:
        if self._counted:
            self._counted = False
            self._scheduler._validating -= 1


@dataclass(frozen=True)
class _Arrival:
    """A request as a held copy kept it: what ``_serve`` reads of a NATS message."""

    subject: str
    reply: str
    data: bytes
    headers: dict | None


@contextlib.contextmanager
def otel_context_of(flight: Flight):
    """Run under the flight's trace context (events ending a flight arrive in other traces)."""
    token = otel_context.attach(flight.context) if flight.context is not None else None
    try:
        yield
    finally:
        if token is not None:
            otel_context.detach(token)


def _resent(held, owner: str, reply_to: str) -> bool:
    """Whether a request whose id is in flight already is the same request sent again (its
    client heard nothing, and asked again on the same inbox): then the flight answers it."""
    return held is not None and held.owner == owner and held.reply_to == reply_to
