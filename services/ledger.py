"""What must outlive a process, in JetStream KV buckets (``shared.wire``, "durable state"):

- **flight records** (schedulers only): each accepted request, which start of which
  scheduler holds it, and its attempt. Every write is checked against the revision its
  writer last saw, so of two schedulers that both think they hold a flight, only one
  write lands and the other learns it lost the flight.
- **answer claims**: exactly one party answers an attempt's client. The decode claims
  before its first message to the client; a scheduler claims before it sends an error
  final, or before it retries or takes over (a *fence*: the old attempt's decode, should
  it wake up, finds the claim taken and sends nothing).
- **stored finals** (schedulers only): a request's last message, for a client that
  missed it (``kvpush.final``).

    ledger = await Ledger.open(bus.nc)                       # a scheduler: creates the buckets
    ledger = await Ledger.open(bus.nc, create_buckets=False)  # a decode worker: claims only
    if await ledger.claim(flight.transfer_key, "scheduler:scheduler-0") == "scheduler:scheduler-0": ...
"""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable, TypeVar

import nats.errors
import nats.js.errors
import structlog
from nats.js import api
from nats.js.client import KV_PRE_TEMPLATE, KV_STREAM_TEMPLATE
from nats.js.kv import KeyValue

from shared import wire

log = structlog.get_logger("kvpush.ledger")

JS_TIMEOUT_S = 5.0  # a JetStream ack under a burst of thousands of requests took over 2 s here
# When the server leading a bucket's stream dies, the others elect a new leader (3-4 s seen
# on the multi-host rig); until then a write meets no responder. It did not land, so it is
# safe to send again: each call waits out an election this long before it gives up.
ELECTION_S = 10.0
LEADERLESS = (nats.js.errors.NoStreamResponseError, nats.errors.NoRespondersError,
              nats.js.errors.ServiceUnavailableError)

T = TypeVar("T")


async def through_elections(call: Callable[[], Awaitable[T]], within_s: float = ELECTION_S) -> T:
    """``await call()``, again while the bucket has no leader (``LEADERLESS``), up to ``within_s``."""
    deadline = time.monotonic() + within_s
    pause = 0.05
    while True:
        try:
            return await call()
        except LEADERLESS:
            if time.monotonic() + pause > deadline:
                raise
            await asyncio.sleep(pause)
            pause = min(pause * 2, 1.0)


class Ledger:
    def __init__(self, flights: KeyValue, claims: KeyValue, finals: KeyValue):
        self.flights = flights
        self.claims = claims
        self.finals = finals

    @classmethod
    async def open(cls, nc, create_buckets: bool = True, replicas: int = 1,
                   deadline_s: float = 300.0) -> "Ledger":
        """``create_buckets``: make them if they are missing (schedulers do). A worker only
        addresses them: it needs no JetStream API rights, only the bucket's subjects."""
        js = nc.jetstream(timeout=JS_TIMEOUT_S)
        configs = {
            # A flight ends by its deadline; without a TTL each one would leave its delete
            # marker for ever, and every scheduler's mirror reads them all at start.
            wire.FLIGHTS_BUCKET: api.KeyValueConfig(bucket=wire.FLIGHTS_BUCKET, replicas=replicas,
                                                    ttl=deadline_s * 2 + 60, storage=api.StorageType.FILE),
            # A claim must outlive every message of its attempt; the deadline bounds those.
            wire.CLAIMS_BUCKET: api.KeyValueConfig(bucket=wire.CLAIMS_BUCKET, replicas=replicas,
                                                   ttl=deadline_s * 2 + 60, max_bytes=wire.CLAIMS_MAX_BYTES,
                                                   storage=api.StorageType.FILE),
            wire.FINALS_BUCKET: api.KeyValueConfig(bucket=wire.FINALS_BUCKET, replicas=replicas,
                                                   ttl=wire.FINALS_KEEP_S, max_bytes=wire.FINALS_MAX_BYTES,
                                                   storage=api.StorageType.FILE),
        }
        buckets = {}
        for name, config in configs.items():
            if not create_buckets:
                buckets[name] = KeyValue(name=name, stream=KV_STREAM_TEMPLATE.format(bucket=name),
                                         pre=KV_PRE_TEMPLATE.format(bucket=name), js=js, direct=False)
                continue
            try:
                buckets[name] = await js.create_key_value(config)
            except nats.js.errors.BadRequestError:  # there already, made by another scheduler (maybe another version)
                buckets[name] = await js.key_value(name)
            except (nats.errors.NoRespondersError, nats.js.errors.ServiceUnavailableError,
                    nats.errors.TimeoutError) as exc:
                raise RuntimeError(
                    f"JetStream did not answer ({type(exc).__name__}): kvpush keeps flights in JetStream, so "
                    "start nats-server with -js (kvpush up and the compose file do)") from None
        return cls(buckets[wire.FLIGHTS_BUCKET], buckets[wire.CLAIMS_BUCKET], buckets[wire.FINALS_BUCKET])

    # ------------------------------------------------------------ answer claims

    async def claim(self, transfer_key: str, who: str) -> str:
        """Who answers the attempt with this key: ``who`` if it won the claim (or held it
        already), else the one that did. ``who`` if JetStream cannot say: then the
        answer is sent rather than lost (a duplicate is possible only in that case)."""
        key = wire.claim_key(transfer_key)
        try:
            await through_elections(lambda: self.claims.create(key, who.encode()))
            return who
        except nats.js.errors.KeyWrongLastSequenceError:
            pass
        except Exception as exc:
            log.warning("could not claim an answer; answering anyway", error=f"{type(exc).__name__}: {exc}")
            return who
        try:
            return (await through_elections(lambda: self.claims.get(key))).value.decode()
        except Exception as exc:
            log.warning("a claim was taken but cannot be read", error=f"{type(exc).__name__}: {exc}")
            return ""

    async def take_claim(self, transfer_key: str, who: str, was: str) -> bool:
        """Take over a claim ``was`` held (a dead scheduler's); False if it changed meanwhile."""
        key = wire.claim_key(transfer_key)
        try:
            entry = await through_elections(lambda: self.claims.get(key))
            if entry.value.decode() != was:
                return False
            await through_elections(lambda: self.claims.update(key, who.encode(), last=entry.revision))
            return True
        except (nats.js.errors.KeyWrongLastSequenceError, nats.js.errors.KeyNotFoundError):
            return False

    # ------------------------------------------------------------ flight records

    async def record(self, flight: wire.FlightRecord) -> int | None:
        """Write a new flight; its revision, or None if that request id is in flight already."""
        try:
            return await through_elections(lambda: self.flights.create(flight.request_id, wire.encode(flight)))
        except nats.js.errors.KeyWrongLastSequenceError:
            return None

    async def rewrite(self, flight: wire.FlightRecord, revision: int) -> int | None:
        """Write the flight over the revision its writer last saw; None if another
        scheduler wrote it since (took it over): the writer no longer holds it."""
        try:
            return await through_elections(
                lambda: self.flights.update(flight.request_id, wire.encode(flight), last=revision))
        except nats.js.errors.KeyWrongLastSequenceError:
            return None

    async def forget(self, request_id: str, revision: int) -> None:
        """The flight ended; unless another scheduler holds it now."""
        try:
            await through_elections(lambda: self.flights.delete(request_id, last=revision))
        except nats.js.errors.APIError as exc:  # another revision: taken over, or gone
            log.debug("flight record not removed", request_id=request_id, error=str(exc))

    async def flight(self, request_id: str) -> tuple[wire.FlightRecord, int] | None:
        try:
            entry = await through_elections(lambda: self.flights.get(request_id))
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
            return None
        return wire.decode(entry.value, wire.FlightRecord), entry.revision

    async def watch_flights(self):
        """Every flight record as it is written or removed (nats-py's ``KeyWatcher``)."""
        return await self.flights.watchall()

    # ------------------------------------------------------------ stored finals

    async def keep_final(self, request_id: str, owner: str, body: bytes) -> None:
        try:
            stored = wire.encode(wire.StoredFinal(owner=owner, body=body))
            await through_elections(lambda: self.finals.put(request_id, stored))
        except Exception as exc:  # the client got it; only a fetch again is lost
            log.warning("could not keep a final", request_id=request_id, error=f"{type(exc).__name__}: {exc}")

    async def final(self, request_id: str) -> wire.StoredFinal | None:
        try:
            entry = await through_elections(lambda: self.finals.get(request_id))
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
            return None
        return wire.decode(entry.value, wire.StoredFinal) if entry.value else None

    async def drop_final(self, request_id: str) -> None:
        """A new request reuses the id: the old one's final must not be fetched for it."""
        try:
            await through_elections(lambda: self.finals.purge(request_id))
        except Exception as exc:
            log.warning("could not drop an old final", request_id=request_id, error=f"{type(exc).__name__}: {exc}")
