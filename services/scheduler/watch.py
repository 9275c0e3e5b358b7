"""The scheduler's watch over its flights, every ``WATCH_INTERVAL_S``: a flight past its
deadline is ended, one whose worker went silent (or whose decode stalled mid-stream) is
retargeted, retried, migrated or ended as ``FlightTable.check`` says (``FlightControl.act``
does it); then orphaned flights and orphaned intake copies are taken over. A stall of the
scheduler's own loop counts as a pause in the evidence."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import structlog

from kvpush.services.scheduler.admission import Admission
from kvpush.services.scheduler.adoption import Adoption
from kvpush.services.scheduler.control import FlightControl
from kvpush.services.scheduler.flights import FlightTable
from kvpush.services.scheduler.routing import WorkerPool
from kvpush.services.scheduler.takeover import SchedulerLiveness
from kvpush.services.scheduler.timing import WATCH_INTERVAL_S

log = structlog.get_logger("kvpush.scheduler")


@dataclass
class FlightWatch:
    pool: WorkerPool
    flights: FlightTable
    schedulers: SchedulerLiveness
    control: FlightControl
    adoption: Adoption
    admission: Admission

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
                    await self.control.act(flight, verdict, worker)
                except Exception:
                    log.exception("could not act on a request", request_id=flight.request_id, verdict=verdict)
            self.adoption.take_over_orphans(now)
            self.admission.take_orphans(now)
