"""What becomes of an attempt that did not go to plan: its fence before another attempt
elsewhere (``retry``), or the flight's end with an error to its client (``end``). Whatever
starts next (a new attempt, a migration of the stream) is its caller's to start
(``kvpush.services.scheduler.control``): ``retry`` says which.

Exactly one party answers each attempt's client: whoever wins its claim (the decode,
before its first message; a scheduler, before an error final, a retry or a takeover).
So each step here first takes the attempt's claim, and does nothing another party owns."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import time
from dataclasses import dataclass

import structlog
from opentelemetry import context as otel_context

from kvpush.otel.metrics import instruments
from kvpush.services.ledger import ClaimState, Ledger
from kvpush.services.lifecycle import BackgroundTasks
from kvpush.services.scheduler.attempts import Attempts
from kvpush.services.scheduler.flights import Flight, FlightTable, Operation
from kvpush.services.scheduler.outbox import Outbox
from kvpush.services.scheduler.routing import WorkerPool
from kvpush.services.scheduler.timing import UNKNOWN_CLAIM_GRACE_S, UNKNOWN_CLAIM_RETRY_S
from kvpush.shared.errors import to_error_body

log = structlog.get_logger("kvpush.scheduler")


class Retry(enum.Enum):
    """What a retry leaves its caller to start."""

    NOTHING = "nothing"  # asked already, about a worker the attempt no longer uses, not ours now, or not yet
    NEW_ATTEMPT = "new_attempt"  # the old attempt is fenced and stopped: a new one, elsewhere
    MIGRATE = "migrate"  # its lost decode answers already: the stream continues elsewhere


@dataclass
class Recovery:
    ledger: Ledger
    pool: WorkerPool
    flights: FlightTable
    tasks: BackgroundTasks
    attempts: Attempts
    outbox: Outbox

    async def retry(self, flight: Flight, lost_worker: str, decode_gave_up: bool = False) -> Retry:
        """Fence the attempt for a new one elsewhere (``Retry.NEW_ATTEMPT``: the caller starts
        it at once); if its lost decode answers already, ``Retry.MIGRATE``. ``decode_gave_up``:
        its decode said it will send nothing (it could not learn whether it won the claim),
        so even a claim it holds does not answer the client. One retry per attempt
        (``Operation.RETRY``): a second ask while one is under way (the dispatch's own
        failure and the liveness watch can both ask) does nothing, and neither does an ask
        while the attempt has another operation under way; the new attempt ends the
        operation. So does an ask about a worker the current attempt does not use (a
        verdict made before that attempt began)."""
        if lost_worker not in (flight.prefill_id, flight.decode_id) or not flight.begin(Operation.RETRY):
            return Retry.NOTHING
        then = Retry.NOTHING
        try:
            then = await self._retry(flight, lost_worker, decode_gave_up)
        finally:
            if then is not Retry.NEW_ATTEMPT:
                flight.end(Operation.RETRY)
        return then

    async def _retry(self, flight: Flight, lost_worker: str, decode_gave_up: bool) -> Retry:
        # Fence the attempt first: once we hold its claim, its decode can never answer.
        claim = await self.ledger.claim(flight.transfer_key, flight.decode_id)
        if claim.state is ClaimState.UNKNOWN:
            return Retry.NOTHING  # JetStream cannot say: the next check tries again
        if claim.by_decode and not decode_gave_up:  # the decode answers already: tokens may be out
            flight.streaming_started()  # a lost prefill no longer matters: the decode has the KV
            return Retry.MIGRATE if lost_worker == flight.decode_id else Retry.NOTHING
        if not claim.won and not claim.by_decode:  # another scheduler fenced it: the flight is its now
            self.flights.remove(flight)
            self.stop_attempt(flight)
            return Retry.NOTHING
        log.warning("worker lost, retrying elsewhere", request_id=flight.request_id, worker=lost_worker,
                    attempt=flight.attempt)
        instruments().failures.add(1, {"reason": "worker_lost_retried"})
        self.pool.forget(lost_worker)
        self.stop_attempt(flight)
        await self.outbox.cancel_jobs(flight, f"retried: worker {lost_worker} was lost")
        return Retry.NEW_ATTEMPT

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
