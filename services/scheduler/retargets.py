"""Push: an attempt's transfer retargeted to another decode, when the decode chosen at
arrival went silent or is overloaded before its KV was written. Prefill writes into the
new decode's registration (the connector's ``Rendezvous.retarget``), the first decode's
blocks come back through its revoke, and nothing is recomputed. A transfer that cannot be
retargeted is retried if its decode is silent (``retarget`` says so to its caller,
``control``), or stays if it is only overloaded.

On the wire and in the path report this is a move (``MoveTransfer``, ``TransferMoved``,
the ``scheduler.move`` span, ``RouteReport.moves``): those names are contracts and stay."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import structlog
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from kvpush.otel import attributes as A
from kvpush.services.bus import Bus
from kvpush.services.ledger import ClaimState, Ledger
from kvpush.services.scheduler import dispatch
from kvpush.services.scheduler.flights import Flight, FlightTable, Operation, new_transfer_key
from kvpush.services.scheduler.journal import Journal
from kvpush.services.scheduler.outbox import Outbox
from kvpush.services.scheduler.routing import WorkerPool
from kvpush.services.scheduler.timing import MOVE_TIMEOUT_S
from kvpush.shared import wire
from kvpush.shared.errors import DispatchFailed, NoWorkers

log = structlog.get_logger("kvpush.scheduler")
_tracer = trace.get_tracer("kvpush.scheduler")


@dataclass
class Retargets:
    bus: Bus
    ledger: Ledger
    pool: WorkerPool
    flights: FlightTable
    journal: Journal
    outbox: Outbox
    scheduler_id: str
    # transfer id -> its prefill's TransferMoved, for the retargets under way
    _answers: dict[str, asyncio.Future] = field(default_factory=dict, init=False)

    def answer_arrived(self, moved: wire.TransferMoved) -> None:
        """Prefill's answer to a retarget this scheduler asked for (a late one is dropped)."""
        waiting = self._answers.get(moved.transfer_id)
        if waiting is not None and not waiting.done():
            waiting.set_result(moved)

    async def retarget(self, flight: Flight, lost: str) -> bool:
        """Retarget the flight's transfer away from decode ``lost`` (the flight's operation
        is ``Operation.RETARGET``; this ends it). True if the flight must be retried instead:
        its decode is silent and its transfer cannot move (prefill says its write began, or
        no other decode is live); an overloaded one keeps it."""
        with _tracer.start_as_current_span(
            A.SCHEDULER_MOVE, context=flight.context,
            attributes={A.REQUEST_ID: flight.request_id, A.TRANSFER_ID: flight.transfer_id, A.MOVED_FROM: lost,
                        A.MOVE_REASON: "overloaded" if self.pool.is_live(lost, flight.decode_incarnation,
                                                                          time.monotonic()) else "lost"},
        ) as span:
            try:
                why_not = await self._retarget_transfer(flight, lost)
            except DispatchFailed as exc:
                why_not = str(exc)
            finally:
                flight.end(Operation.RETARGET)
            if why_not is None:
                span.set_attribute(A.DECODE_WORKER, flight.decode_id)
                return False
            span.set_status(Status(StatusCode.ERROR, why_not))
        if self.pool.is_live(lost, flight.decode_incarnation, time.monotonic()) and flight.decode_id == lost:
            log.info("could not move the transfer; it stays", request_id=flight.request_id, reason=why_not)
            flight.move_declined()
            return False
        log.info("could not move the transfer; retrying", request_id=flight.request_id, reason=why_not)
        return True

    async def _retarget_transfer(self, flight: Flight, lost: str) -> str | None:
        """Why the transfer could not move, or None once it did."""
        now = time.monotonic()
        if not self.pool.is_live(lost, flight.decode_incarnation, now):
            self.pool.forget(lost)
        try:
            # Never back to a decode this transfer left: it drops a job for a transfer it
            # was told to drop, and the request would wait for its deadline.
            decode = self.pool.pick_decode(len(flight.request.prompt_token_ids), now, prompt=flight.prompt,
                                           exclude=flight.left_decodes | {lost})
        except NoWorkers:
            return "no other decode worker is live that this transfer has not left"
        new_key = new_transfer_key()
        moved = await self._ask_prefill(flight, decode.worker_id, new_key)
        if isinstance(moved, str):
            return moved
        if not moved.moved:
            return f"prefill {flight.prefill_id} did not move it: {moved.reason}"
        # Fence the first decode: from now on it can never answer this attempt.
        claim = await self.ledger.claim(flight.transfer_key, flight.decode_id)
        if claim.by_decode or claim.state is ClaimState.UNKNOWN:
            # It answers already (it computed the prompt itself), or it may: watch it as streaming.
            flight.streaming_started()
            return None
        if not claim.won:  # another scheduler fenced it: the flight is its now
            self.flights.remove(flight)
            return None
        await self.bus.publish(wire.decode_job_subject(lost), wire.encode(wire.CancelJob(
            request_id=flight.request_id, transfer_id=flight.transfer_id, reason=f"moved to {decode.worker_id}")))
        latest = self.pool.beat(decode.worker_id)  # its start now: it may have restarted meanwhile
        flight.moved(decode.worker_id, latest.incarnation if latest else "", new_key)
        await self.journal.write_down(flight)
        beat = self.pool.beat(flight.prefill_id)
        await self.outbox.send(decode.worker_id, dispatch.decode_job(flight, beat.kv_params if beat else None))
        log.info("transfer moved", request_id=flight.request_id, transfer_id=flight.transfer_id, moved_from=lost,
                 decode=decode.worker_id)
        return None

    async def _ask_prefill(self, flight: Flight, decode_id: str, new_key: str) -> wire.TransferMoved | str:
        """Prefill's answer to the retarget, or why none came."""
        answer = asyncio.get_running_loop().create_future()
        self._answers[flight.transfer_id] = answer
        try:
            await self.bus.publish(wire.move_subject(flight.prefill_id, self.scheduler_id), wire.encode(
                wire.MoveTransfer(transfer_id=flight.transfer_id, scheduler_id=self.scheduler_id,
                                  transfer_key=flight.transfer_key, decode_engine_id=decode_id,
                                  new_transfer_key=new_key)))
            return await asyncio.wait_for(answer, MOVE_TIMEOUT_S)
        except asyncio.TimeoutError:
            return f"prefill {flight.prefill_id} did not answer the move within {MOVE_TIMEOUT_S:g} s"
        finally:
            self._answers.pop(flight.transfer_id, None)
