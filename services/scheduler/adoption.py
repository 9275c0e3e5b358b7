"""Taking over the flights of a scheduler that is gone: the NATS side of ``takeover``.

The flights bucket is mirrored here (who holds which request); a flight whose holder no
live scheduler is (``takeover.orphans``) is rewritten as ours, if no other scheduler is
quicker, and finished: its decode, if it answers already, is left to finish; else the
attempt it was in is fenced and a new one starts."""

from __future__ import annotations

import asyncio
import time

import structlog
from opentelemetry import trace

from kvpush.otel import attributes as A
from kvpush.otel.messaging import context_from_traceparent
from kvpush.otel.metrics import instruments
from kvpush.services.ledger import ClaimState, Ledger
from kvpush.services.lifecycle import BackgroundTasks
from kvpush.services.scheduler.control import FlightControl
from kvpush.services.scheduler.flights import Flight, FlightTable
from kvpush.services.scheduler.intake import EarlyCancels, IntakeBook
from kvpush.services.scheduler.outbox import Outbox
from kvpush.services.scheduler.recovery import otel_context_of
from kvpush.services.scheduler.takeover import Holding, SchedulerLiveness, orphans
from kvpush.shared import wire
from kvpush.shared.errors import Cancelled

log = structlog.get_logger("kvpush.scheduler")
_tracer = trace.get_tracer("kvpush.scheduler")


class Adoption:
    def __init__(self, ledger: Ledger, flights: FlightTable, schedulers: SchedulerLiveness, intake: IntakeBook,
                 early_cancels: EarlyCancels, control: FlightControl, outbox: Outbox, tasks: BackgroundTasks,
                 max_in_flight: int):
        self.ledger = ledger
        self.flights = flights
        self.schedulers = schedulers
        self.intake = intake
        self.early_cancels = early_cancels
        self.control = control
        self.outbox = outbox
        self.tasks = tasks
        self.max_in_flight = max_in_flight
        self.holdings: dict[str, Holding] = {}  # the flights bucket, as its watch last said
        self._adopting: set[str] = set()

    async def mirror_flights(self) -> None:
        """Keep ``holdings`` equal to the flights bucket: who holds which request."""
        while True:
            try:
                watcher = await self.ledger.watch_flights()
                holdings: dict[str, Holding] = {}
                live = False
                async for entry in watcher:
                    if entry is None:  # caught up with what was there before the watch
                        self.holdings, live = holdings, True
                        continue
                    if entry.operation is None and entry.value:
                        self.intake.settle(entry.key)  # written down: its copy here is not needed
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

    def take_over_orphans(self, now: float) -> None:
        if len(self.flights) + len(self._adopting) >= self.max_in_flight:
            return  # full: a scheduler with room takes them
        held = {flight.key for flight in self.flights}
        for key, _ in orphans(self.holdings, self.schedulers, now, held | self._adopting):
            if len(self.flights) + len(self._adopting) >= self.max_in_flight:
                break
            self._adopting.add(key)
            self.tasks.spawn(self._adopt(key))

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
            record.holder, record.holder_incarnation = self.schedulers.me, self.schedulers.incarnation
            revision = await self.ledger.rewrite(record, revision)
            if revision is None:
                return  # another scheduler took it first
            flight = Flight.from_record(record, revision, now_wall, now)
            if not self.flights.adopt(flight):
                return
            flight.trace_in(context_from_traceparent(record.traceparent))
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
        if self.early_cancels.take(flight.owner, flight.request_id, time.monotonic()):
            await self.control.end(flight, Cancelled(f"request {flight.request_id} was cancelled by the client"))
            return
        claim = await self.ledger.claim(flight.transfer_key, flight.decode_id)
        if claim.by_decode or claim.state is ClaimState.UNKNOWN:
            # We watch it to its end, as its holder did (or, if JetStream cannot say who
            # answers, until its deadline, when ending it asks again).
            flight.jobs_taken()
            flight.streaming_started()
            return
        if not claim.won:  # a scheduler that died as it answered, or as it took over
            if await self.ledger.final(flight.owner, flight.request_id) is not None:  # it answered: kept
                self.flights.remove(flight)
                await self.ledger.forget(flight.owner, flight.request_id, flight.revision)
                return
            if not await self.ledger.take_claim(flight.transfer_key, flight.decode_id, claim):
                self.flights.remove(flight)  # someone else moved first; it holds the flight
                return
        await self.outbox.cancel_jobs(flight, "its scheduler was lost; retried")
        flight.release_workers()
        self.control.attempt_again(flight)
