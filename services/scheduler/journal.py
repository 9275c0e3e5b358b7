"""A flight's record in JetStream's flights bucket, as this scheduler writes and reads it.

A flight is written down before any worker hears of it and again before each attempt's
jobs go out, each time over the revision this scheduler last wrote: a newer revision means
another scheduler took the flight over (``TakenOver``), and this one lets it go."""

from __future__ import annotations

import time

import structlog

from kvpush.services.ledger import Ledger
from kvpush.services.scheduler.flights import Flight, FlightTable
from kvpush.shared import wire

log = structlog.get_logger("kvpush.scheduler")


class TakenOver(Exception):
    """Another scheduler wrote this flight's record since we did: it holds the flight now."""


class Journal:
    def __init__(self, ledger: Ledger, flights: FlightTable, scheduler_id: str, incarnation: str):
        self.ledger = ledger
        self.flights = flights
        self.scheduler_id = scheduler_id
        self.incarnation = incarnation

    def record(self, flight: Flight) -> wire.FlightRecord:
        return flight.record(self.scheduler_id, self.incarnation, time.time(), time.monotonic())

    async def write_down(self, flight: Flight) -> None:
        """Write the flight's attempt over our last revision before its jobs go out; raises
        ``TakenOver`` if another scheduler holds it now (then we let it go, silently)."""
        revision = await self.ledger.rewrite(self.record(flight), flight.revision)
        if revision is None:
            log.warning("another scheduler took this flight over", request_id=flight.request_id)
            self.flights.remove(flight)
            raise TakenOver(flight.request_id)
        flight.written_down(revision)

    async def held_record(self, owner: str, request_id: str) -> wire.FlightRecord | None:
        """The request's flight record in JetStream (whichever scheduler holds it), if any."""
        found = await self.ledger.flight(wire.flight_key(owner, request_id))
        return found[0] if found is not None else None
