"""Mid-stream migration: a request whose decode was lost (silent past the worker timeout)
or stalled (it heartbeats, but no token came for ``--stall-s``) after tokens went out
continues on another decode, and its client sees one stream.

What the client has is what the flight recorded: decode reports each chunk to the
schedulers before it sends it, on the same NATS connection, and NATS keeps a connection's
order, so no chunk reaches the client before its record reaches the server
(``Flight.tokens_sent``). The old decode is then fenced: told to stop (a CancelJob with no
error: it sends the client nothing more, not even a final). A stalled one, whose worker
still answers, says when it stopped (its ``ended`` progress, after every record it sent);
the migration waits for that, so a token it sent meanwhile is in the record too. If it
finished the request first, its final stands and there is nothing to migrate. A lost one
is not waited for: it sends nothing more once dead.

The new attempt is an ordinary one (placement, push, pull or local), with a ``Resume``:
the tokens sent and the next chunk's seq, and how it continues
(``kvpush.shared.continuation``); ``migrate`` says when it is due, and its caller
(``kvpush.services.scheduler.control``) starts it. Its decode claims the new attempt's
answer and sends the final, counting every chunk."""

from __future__ import annotations

import asyncio
import time

import structlog
from opentelemetry import trace

from kvpush.otel import attributes as A
from kvpush.otel.metrics import instruments
from kvpush.services.scheduler.flights import Flight, FlightTable, Operation
from kvpush.services.scheduler.outbox import Outbox
from kvpush.services.scheduler.recovery import Recovery
from kvpush.services.scheduler.routing import WorkerPool
from kvpush.shared import continuation, wire
from kvpush.shared.errors import WorkerLost

log = structlog.get_logger("kvpush.scheduler")
_tracer = trace.get_tracer("kvpush.scheduler")

FENCE_S = 5.0  # a stalled decode's worker has this long to say it stopped


class Migrations:
    def __init__(self, pool: WorkerPool, flights: FlightTable, outbox: Outbox, recovery: Recovery):
        self.pool = pool
        self.flights = flights
        self.outbox = outbox
        self.recovery = recovery
        self._fences: dict[str, asyncio.Future] = {}  # old transfer id -> its decode's "ended" progress

    def fenced(self, event: wire.RequestProgress) -> None:
        """A decode being fenced ended its request (a late one is dropped)."""
        waiting = self._fences.get(event.transfer_id)
        if waiting is not None and not waiting.done():
            waiting.set_result(event)

    async def migrate(self, flight: Flight, decode_id: str, stalled: bool) -> bool:
        """Fence the flight's decode for its stream to continue on another (the flight's
        operation is ``Operation.MIGRATE``; this ends it). True once the old attempt is
        stopped and the resume point set: the caller starts the new attempt at once.
        False if there is none to start: refused (a lost decode's flight ended), the
        stalled decode finished first, or the flight ended meanwhile."""
        why = "stalled" if stalled else "lost"
        refused = flight.why_not_migrate(self.flights.max_migrations)
        if refused is not None:
            flight.end(Operation.MIGRATE)
            if not stalled:  # a stalled decode may yet go on: it is left to it
                instruments().migrations.add(1, {"why": why, "outcome": "refused"})
                await self.recovery.end(flight, WorkerLost(
                    f"decode {decode_id} went silent after the answer had started, and the stream could not "
                    f"continue elsewhere: {refused}"), decode_lost=True)
            return False
        kind, because = continuation.continuation_of(flight.request.sampling)
        with _tracer.start_as_current_span(
            A.SCHEDULER_MIGRATE, context=flight.context,
            attributes={A.REQUEST_ID: flight.request_id, A.TRANSFER_ID: flight.transfer_id,
                        A.MIGRATED_FROM: decode_id, A.MIGRATION_WHY: why, A.MIGRATION_CONTINUATION: kind},
        ) as span:
            old_transfer = flight.transfer_id
            if stalled:
                fence = self._fences[old_transfer] = asyncio.get_running_loop().create_future()
            try:
                self.recovery.stop_attempt(flight)
                await self.outbox.cancel_jobs(flight, f"migrated: decode {decode_id} {why} mid-stream")
                if stalled:
                    try:
                        ended: wire.RequestProgress = await asyncio.wait_for(fence, FENCE_S)
                    except asyncio.TimeoutError:
                        log.warning("a stalled decode did not say it stopped; migrating on what was recorded",
                                    request_id=flight.request_id, decode=decode_id)
                    else:
                        if ended.outcome != "cancelled":  # it finished first: its final stands
                            flight.end(Operation.MIGRATE)
                            return False
            finally:
                self._fences.pop(old_transfer, None)
            if self.flights.by_transfer(old_transfer) is not flight:
                return False  # ended meanwhile (deadline, cancel)
            if stalled:
                self.pool.avoid(decode_id, time.monotonic() + self.flights.stall_s)
            else:
                self.pool.forget(decode_id)
            resume = flight.migrate()
            span.set_attribute(A.MIGRATION_SENT_TOKENS, len(resume.token_ids))
        log.warning("decode lost mid-stream, continuing on another", request_id=flight.request_id,
                    decode=decode_id, why=why, sent_tokens=len(resume.token_ids), chunks=resume.chunks,
                    continuation=kind, because=because, migration=resume.migrations)
        instruments().migrations.add(1, {"why": why, "outcome": kind})
        return True
