"""The one place that sets a flight on its next course: its attempts (``attempt``), and
what is done on each verdict about one (``act``), whoever made it: the watch
(``FlightTable.check``), a dispatch that failed, a retarget that could not be made, a
decode that gave up. A verdict starts at most one operation on the attempt
(``flights.Operation``): its transfer retargeted to another decode (``Retargets``), a
retry (``Recovery.retry``), or its stream migrated (``Migrations``); or it ends the flight
(``Recovery.end``).

The parts below do their step and say what comes next; only this module starts an
attempt or a migration, so none of them needs another's: a retry whose lost decode turns
out to be answering asks for a migration, a migration or a retry that fenced the old
attempt asks for a new one, a retarget that failed asks for a retry."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import structlog
from opentelemetry import trace

from kvpush.otel import attributes as A
from kvpush.services.lifecycle import BackgroundTasks
from kvpush.services.scheduler.attempts import Attempts
from kvpush.services.scheduler.flights import Flight, FlightTable, Operation, Verdict
from kvpush.services.scheduler.journal import TakenOver
from kvpush.services.scheduler.migrations import Migrations
from kvpush.services.scheduler.recovery import Recovery, Retry
from kvpush.services.scheduler.retargets import Retargets
from kvpush.services.scheduler.routing import WorkerPool
from kvpush.shared.errors import DeadlineExceeded, DispatchFailed, KvpushError, WorkerLost

log = structlog.get_logger("kvpush.scheduler")
_tracer = trace.get_tracer("kvpush.scheduler")


@dataclass
class FlightControl:
    """``attempt`` and ``attempt_again`` start attempts; ``act`` does what a verdict says;
    ``retry`` and ``end`` are the verdicts that other parts of the scheduler reach themselves."""

    pool: WorkerPool
    flights: FlightTable
    tasks: BackgroundTasks  # where attempts, retargets and migrations run
    attempts: Attempts
    recovery: Recovery
    retargets: Retargets
    migrations: Migrations
    deadline_s: float  # of each request: said in the error of one past it

    async def attempt(self, flight: Flight) -> None:
        """One try at dispatching the flight; retried or ended with an error if that fails."""
        try:
            await self.attempts.dispatch(flight)
        except (asyncio.CancelledError, TakenOver):
            pass  # replaced by a retry, ended, or held by another scheduler now
        except DispatchFailed as exc:
            if flight.attempt - flight.migrations < self.flights.max_attempts:  # a worker that does not take jobs is as good as lost
                await self.retry(flight, exc.worker_id)
            else:
                await self.recovery.end(flight, exc)
        except KvpushError as exc:
            await self.recovery.end(flight, exc)
        except Exception as exc:
            log.exception("dispatch failed")
            await self.recovery.end(flight, exc)

    def attempt_again(self, flight: Flight) -> None:
        """A new attempt at the flight, in its own trace span, in the background."""

        async def again() -> None:
            with _tracer.start_as_current_span(
                A.SCHEDULER_DISPATCH, context=flight.context,
                attributes={A.REQUEST_ID: flight.request_id, A.ATTEMPT: flight.attempt + 1},
            ):
                await self.attempt(flight)

        flight.track(self.tasks.spawn(again()))

    async def end(self, flight: Flight, error: BaseException, decode_lost: bool = False) -> None:
        """End the flight with ``error`` to its client (``Recovery.end``)."""
        await self.recovery.end(flight, error, decode_lost)

    async def act(self, flight: Flight, verdict: Verdict, worker: str) -> None:
        """Do what ``verdict`` on the flight says, about ``worker`` (``FlightTable.check``)."""
        if verdict == "deadline":
            await self.recovery.end(flight, DeadlineExceeded(f"no answer within the {self.deadline_s:g} s deadline"))
        elif verdict == "move":
            if flight.begin(Operation.RETARGET):
                flight.track(self.tasks.spawn(self._retarget(flight, worker)))
        elif verdict in ("migrate", "stalled"):
            self._migrate(flight, worker, stalled=verdict == "stalled")
        elif verdict == "retry":
            await self.retry(flight, worker)
        else:
            self.pool.forget(worker)
            await self.recovery.end(flight, WorkerLost(
                f"worker {worker} went silent after the answer had started; "
                "the request was not retried, since that would repeat tokens"
                if flight.streaming else
                f"worker {worker} went silent and {flight.attempt} attempts were used"),
                decode_lost=worker == flight.decode_id)

    async def retry(self, flight: Flight, lost_worker: str, decode_gave_up: bool = False) -> None:
        """A new attempt elsewhere once the old one is fenced, or, if its lost decode answers
        already, its stream migrated (``Recovery.retry`` says which; once per attempt)."""
        then = await self.recovery.retry(flight, lost_worker, decode_gave_up)
        if then is Retry.NEW_ATTEMPT:
            self.attempt_again(flight)
        elif then is Retry.MIGRATE:  # after what the client has (its token records), elsewhere
            self._migrate(flight, lost_worker, stalled=False)

    async def _retarget(self, flight: Flight, decode_id: str) -> None:
        if await self.retargets.retarget(flight, decode_id):
            await self.retry(flight, decode_id)

    def _migrate(self, flight: Flight, decode_id: str, stalled: bool) -> None:
        if flight.begin(Operation.MIGRATE):
            flight.track(self.tasks.spawn(self._continue_stream(flight, decode_id, stalled)))

    async def _continue_stream(self, flight: Flight, decode_id: str, stalled: bool) -> None:
        if await self.migrations.migrate(flight, decode_id, stalled):
            self.attempt_again(flight)
