"""What becomes of an attempt that did not go to plan: another attempt elsewhere once the
old one is fenced (``retry``), or the flight's end with an error to its client (``end``).

Exactly one party answers each attempt's client: whoever wins its claim (the decode,
before its first message; a scheduler, before an error final, a retry or a takeover).
So each step here first takes the attempt's claim, and does nothing another party owns."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

import structlog
from opentelemetry import context as otel_context
from opentelemetry import trace

from kvpush.otel import attributes as A
from kvpush.otel.metrics import instruments
from kvpush.services.ledger import ClaimState, Ledger
from kvpush.services.lifecycle import BackgroundTasks
from kvpush.services.scheduler.attempts import Attempts
from kvpush.services.scheduler.flights import Flight, FlightTable
from kvpush.services.scheduler.journal import TakenOver
from kvpush.services.scheduler.outbox import Outbox
from kvpush.services.scheduler.routing import WorkerPool
from kvpush.services.scheduler.timing import UNKNOWN_CLAIM_GRACE_S, UNKNOWN_CLAIM_RETRY_S
from kvpush.shared.errors import DispatchFailed, KvpushError, WorkerLost, to_error_body

log = structlog.get_logger("kvpush.scheduler")
_tracer = trace.get_tracer("kvpush.scheduler")


class Recovery:
    def __init__(self, ledger: Ledger, pool: WorkerPool, flights: FlightTable, tasks: BackgroundTasks,
                 attempts: Attempts, outbox: Outbox):
        self.ledger = ledger
        self.pool = pool
        self.flights = flights
        self.tasks = tasks
        self.attempts = attempts
        self.outbox = outbox
        # Continues a stream whose decode was lost (``Migrations.migrate``, wired by the service).
        self.migrate: Callable[[Flight, str, bool], Awaitable[None]] | None = None

    async def attempt(self, flight: Flight) -> None:
        """One try at dispatching the flight; ends it with an error if that fails."""
        try:
            await self.attempts.dispatch(flight)
        except (asyncio.CancelledError, TakenOver):
            pass  # replaced by a retry, ended, or held by another scheduler now
        except DispatchFailed as exc:
            if flight.attempt - flight.migrations < self.flights.max_attempts:  # a worker that does not take jobs is as good as lost
                await self.retry(flight, exc.worker_id)
            else:
                await self.end(flight, exc)
        except KvpushError as exc:
            await self.end(flight, exc)
        except Exception as exc:
            log.exception("dispatch failed")
            await self.end(flight, exc)

    def attempt_again(self, flight: Flight) -> None:
        """A new attempt at the flight, in its own trace span, in the background."""

        async def again() -> None:
            with _tracer.start_as_current_span(
                A.SCHEDULER_DISPATCH, context=flight.context,
                attributes={A.REQUEST_ID: flight.request_id, A.ATTEMPT: flight.attempt + 1},
            ):
                await self.attempt(flight)

        flight.track(self.tasks.spawn(again()))

    async def retry(self, flight: Flight, lost_worker: str, decode_gave_up: bool = False) -> None:
        """A new attempt elsewhere, once the old one is fenced. ``decode_gave_up``: its
        decode said it will send nothing (it could not learn whether it won the claim), so
        even a claim it holds does not answer the client. One retry per attempt: a second
        ask while one is under way (the dispatch's own failure and the liveness watch can
        both ask) does nothing; the new attempt clears the mark. So does an ask about a
        worker the current attempt does not use (a verdict made before that attempt began)."""
        if flight.retrying or lost_worker not in (flight.prefill_id, flight.decode_id):
            return
        flight.retrying = True
        retried = False
        try:
            retried = await self._retry(flight, lost_worker, decode_gave_up)
        finally:
            if not retried:
                flight.retrying = False

    async def _retry(self, flight: Flight, lost_worker: str, decode_gave_up: bool) -> bool:
        """True if it started a new attempt."""
        # Fence the attempt first: once we hold its claim, its decode can never answer.
        claim = await self.ledger.claim(flight.transfer_key, flight.decode_id)
        if claim.state is ClaimState.UNKNOWN:
            return False  # JetStream cannot say: the next check tries again
        if claim.by_decode and not decode_gave_up:  # the decode answers already: tokens may be out
            if lost_worker == flight.decode_id:
                flight.streaming_started()
                if self.migrate is not None:  # after what the client has (its token records), elsewhere
                    flight.migrating = True
                    flight.track(self.tasks.spawn(self.migrate(flight, lost_worker, False)))
                    return False
                await self.end(flight, WorkerLost(
                    f"worker {lost_worker} went silent after the answer had started; "
                    "the request was not retried, since that would repeat tokens"), decode_lost=True)
            else:
                flight.streaming_started()  # it has the KV: the lost prefill no longer matters
            return False
        if not claim.won and not claim.by_decode:  # another scheduler fenced it: the flight is its now
            self.flights.remove(flight)
            self.stop_attempt(flight)
            return False
        log.warning("worker lost, retrying elsewhere", request_id=flight.request_id, worker=lost_worker,
                    attempt=flight.attempt)
        instruments().failures.add(1, {"reason": "worker_lost_retried"})
        self.pool.forget(lost_worker)
        self.stop_attempt(flight)
        await self.outbox.cancel_jobs(flight, f"retried: worker {lost_worker} was lost")
        self.attempt_again(flight)
        return True

    async def end(self, flight: Flight, error: BaseException, decode_lost: bool = False) -> None:
        """End the flight: the workers drop the request and the client gets ``error``, from
        us if we win the attempt's claim, else from the decode that holds it (if it was
        ``decode_lost``, from us all the same)."""
        if not self.flights.remove(flight):
            return
        self.stop_attempt(flight)
        body = to_error_body(error)
        claim = await self.ledger.claim(flight.transfer_key, flight.decode_id)
        if claim.state is ClaimState.UNKNOWN:
            # Whether the decode answers cannot be told: saying it too could be a second
            # final. The flight stays ours; the watch ends it again once JetStream answers.
            self.flights.adopt(flight)
            if time.monotonic() < flight.deadline + UNKNOWN_CLAIM_GRACE_S:
                flight.track(self.tasks.spawn(self._end_later(flight, error, decode_lost)))
            else:
                log.error("JetStream cannot say who answers this request; leaving it to the client's own "
                          "fetch of its final", request_id=flight.request_id)
                self.flights.remove(flight)
            return
        if claim.won or (decode_lost and claim.by_decode):
            await self.outbox.cancel_jobs(flight, body.code)
            with otel_context_of(flight):
                await self.outbox.reply_error(flight.reply_to, flight.request_id, error, keep_for=flight.owner)
        elif claim.by_decode:
            await self.outbox.cancel_jobs(flight, body.code, error=body)
        else:
            return  # another scheduler fenced the attempt: the flight is its now
        await self.ledger.forget(flight.owner, flight.request_id, flight.revision)

    async def _end_later(self, flight: Flight, error: BaseException, decode_lost: bool) -> None:
        await asyncio.sleep(UNKNOWN_CLAIM_RETRY_S)
        await self.end(flight, error, decode_lost)

    def stop_attempt(self, flight: Flight) -> None:
        if flight.task is not None and flight.task is not asyncio.current_task():
            flight.task.cancel()
        self.attempts.stop_waiting(flight.transfer_id)


@contextlib.contextmanager
def otel_context_of(flight: Flight):
    """Run under the flight's trace context (events ending a flight arrive in other traces)."""
    token = otel_context.attach(flight.context) if flight.context is not None else None
    try:
        yield
    finally:
        if token is not None:
            otel_context.detach(token)
