"""The scheduler's watch over its flights, every ``WATCH_INTERVAL_S``: a flight past its
deadline is ended, one whose worker went silent (or whose decode stalled mid-stream) is
moved, retried, migrated or ended as ``FlightTable.check`` says; then orphaned flights and orphaned intake copies are taken
over. A stall of the scheduler's own loop counts as a pause in the evidence."""

from __future__ import annotations

import asyncio
import time

import structlog

from kvpush.services.lifecycle import BackgroundTasks
from kvpush.services.scheduler.admission import Admission
from kvpush.services.scheduler.adoption import Adoption
from kvpush.services.scheduler.flights import Flight, FlightTable, Verdict
from kvpush.services.scheduler.migrations import Migrations
from kvpush.services.scheduler.moves import Moves
from kvpush.services.scheduler.recovery import Recovery
from kvpush.services.scheduler.routing import WorkerPool
from kvpush.services.scheduler.takeover import SchedulerLiveness
from kvpush.services.scheduler.timing import WATCH_INTERVAL_S
from kvpush.shared.errors import DeadlineExceeded, WorkerLost

log = structlog.get_logger("kvpush.scheduler")


class FlightWatch:
    def __init__(self, pool: WorkerPool, flights: FlightTable, schedulers: SchedulerLiveness, recovery: Recovery,
                 moves: Moves, migrations: Migrations, adoption: Adoption, admission: Admission,
                 tasks: BackgroundTasks, deadline_s: float):
        self.pool = pool
        self.flights = flights
        self.schedulers = schedulers
        self.recovery = recovery
        self.moves = moves
        self.migrations = migrations
        self.adoption = adoption
        self.admission = admission
        self.tasks = tasks
        self.deadline_s = deadline_s

    async def run(self) -> None:
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
                    await self._act(flight, verdict, worker)
                except Exception:
                    log.exception("could not act on a request", request_id=flight.request_id, verdict=verdict)
            self.adoption.take_over_orphans(now)
            self.admission.take_orphans(now)

    async def _act(self, flight: Flight, verdict: Verdict, worker: str) -> None:
        if verdict == "deadline":
            await self.recovery.end(flight, DeadlineExceeded(f"no answer within the {self.deadline_s:g} s deadline"))
        elif verdict == "move":
            flight.start_move()
            flight.track(self.tasks.spawn(self.moves.move(flight, worker)))
        elif verdict in ("migrate", "stalled"):
            flight.migrating = True
            flight.track(self.tasks.spawn(self.migrations.migrate(flight, worker, stalled=verdict == "stalled")))
        elif verdict == "retry":
            await self.recovery.retry(flight, worker)
        else:
            self.pool.forget(worker)
            await self.recovery.end(flight, WorkerLost(
                f"worker {worker} went silent after the answer had started; "
                "the request was not retried, since that would repeat tokens"
                if flight.streaming else
                f"worker {worker} went silent and {flight.attempt} attempts were used"),
                decode_lost=worker == flight.decode_id)
