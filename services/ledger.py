"""What must outlive a process, in JetStream KV buckets (``kvpush.shared.wire``, "durable state"):

- **flight records** (schedulers only): each accepted request, which start of which
  scheduler holds it, and its attempt. Every write is checked against the revision its
  writer last saw, so of two schedulers that both think they hold a flight, only one
  write lands and the other learns it lost the flight.
- **answer claims** (``Claims``, a ``kvpush_claims_<decode>`` stream per decode): exactly one party answers
  an attempt's client. The decode claims before its first message to the client; a
  scheduler claims before it sends an error final, or before it retries or takes over (a
  *fence*: the old attempt's decode, should it wake up, finds the claim taken and sends
  nothing). A claim whose outcome cannot be established is never won (``ClaimState.UNKNOWN``).
- **stored finals** (schedulers only): a request's last message, for a client that
  missed it (``kvpush.final``).

Flights and finals are keyed by ``wire.flight_key(client, request id)``: the same id from
two clients is two requests.

    ledger = await Ledger.open(bus.nc, me=wire.Claimant.scheduler(id, incarnation))  # makes the buckets
    if (await ledger.claim(flight.transfer_key, flight.decode_id)).won: ...   # a scheduler's fence
    claims = Claims(bus.nc, wire.Claimant.decode(worker_id))   # a decode worker: claims only
    if (await claims.claim(job.transfer_key)).won: ...
"""

from __future__ import annotations

import asyncio
import enum
import json
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, TypeVar

import nats.errors
import nats.js.errors
import structlog
from nats.js import api
from nats.js.kv import KeyValue

from kvpush.shared import wire

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


class ClaimState(enum.Enum):
    WON = "won"  # the claimant answers the attempt
    LOST = "lost"  # another does (``Claim.holder``, when the claimant could read it)
    UNKNOWN = "unknown"  # JetStream could not say: never taken as won


@dataclass(frozen=True)
class Claim:
    state: ClaimState
    holder: wire.Claimant | None = None  # who answers, where known
    sequence: int = 0  # the holder's claim message (a takeover appends over it)

    @property
    def won(self) -> bool:
        return self.state is ClaimState.WON

    @property
    def by_decode(self) -> bool:
        return self.holder is not None and self.holder.role == "decode"


WRONG_LAST_SEQUENCE = 10071  # JetStream's error code: the expected-sequence check failed
_UNREAD = (nats.errors.TimeoutError, *LEADERLESS)


class Claims:
    """One identity's claims on attempts' answers, in the claim streams (``wire.Claimant``
    says why streams and how a claim is decided; ``wire.claims_stream``, one per decode).

    A decode needs to publish only on its own claim subjects and to read only its own
    claim messages (a direct get by that subject); a scheduler reads the first and last
    messages of a claim with the JetStream API, which only schedulers may use, and makes
    each decode's stream before that decode's first job (``ensure_stream``)."""

    def __init__(self, nc, me: wire.Claimant, timeout_s: float = JS_TIMEOUT_S, within_s: float = ELECTION_S,
                 replicas: int = 1, keep_s: float = 660.0):
        self.nc = nc
        self.me = me
        self.timeout_s = timeout_s
        self.within_s = within_s
        self.replicas = replicas
        self.keep_s = keep_s  # a claim must outlive every message of its attempt: twice the deadline and more
        self._made: set[str] = set()  # streams this scheduler made or found

    def stream_config(self, decode_id: str) -> api.StreamConfig:
        return api.StreamConfig(
            name=wire.claims_stream(decode_id), subjects=[wire.claims_scope(decode_id)], num_replicas=self.replicas,
            storage=api.StorageType.FILE, max_age=self.keep_s, max_bytes=wire.CLAIMS_MAX_BYTES,
            max_msg_size=wire.CLAIM_MAX_MSG_BYTES, max_msgs_per_subject=1, discard=api.DiscardPolicy.NEW,
            deny_delete=True, deny_purge=True, allow_rollup_hdrs=False, allow_direct=True)

    async def ensure_stream(self, decode_id: str) -> None:
        """A scheduler: make ``decode_id``'s claim stream unless this scheduler made or found it before."""
        if decode_id in self._made:
            return
        js = self.nc.jetstream(timeout=self.timeout_s)
        try:
            await through_elections(lambda: js.add_stream(self.stream_config(decode_id)))
        except nats.js.errors.BadRequestError:
            pass  # there already, made by another scheduler
        self._made.add(decode_id)

    def _decode_of(self, decode_id: str | None) -> str:
        return self.me.name if self.me.role == "decode" else (decode_id or "")

    async def claim(self, transfer_key: str, decode_id: str | None = None) -> Claim:
        """Claim the attempt with this key, whose decode is ``decode_id`` (a decode claims
        only its own): WON if this claimant answers it (now, or by an earlier try of its
        own whose acknowledgement was lost), LOST if another does, UNKNOWN if JetStream
        could not say within ``within_s``."""
        decode = self._decode_of(decode_id)
        key = wire.claim_key(transfer_key)
        deadline = time.monotonic() + self.within_s
        pause = 0.05
        while True:
            try:
                if self.me.role == "scheduler":
                    await self.ensure_stream(decode)
                ack = await self._append(self.me.subject(decode, key), 0, wire.claims_of(decode, key))
                break
            except _UNREAD as exc:
                if time.monotonic() + pause > deadline:
                    log.warning("could not claim an answer: not answering", error=type(exc).__name__)
                    return Claim(ClaimState.UNKNOWN)
                await asyncio.sleep(pause)
                pause = min(pause * 2, 1.0)
        if "error" not in ack:
            return Claim(ClaimState.WON, self.me, ack.get("seq", 0))
        if ack["error"].get("err_code") != WRONG_LAST_SEQUENCE:
            log.warning("JetStream refused a claim: not answering", error=ack["error"].get("description"))
            return Claim(ClaimState.UNKNOWN)
        return await self.holder(decode, key)

    async def holder(self, decode_id: str, key: str) -> Claim:
        """Who answers the attempt of ``decode_id`` whose claim key is ``key``, as this claimant can tell."""
        stream = wire.claims_stream(decode_id)
        try:
            if self.me.role == "decode":  # it may read only its own claims: is one there?
                found = await self._direct_get(stream, self.me.subject(decode_id, key))
                if found is None:
                    return Claim(ClaimState.LOST)
                return Claim(ClaimState.WON, self.me, found[1])
            first = await self._direct_get(stream, None, {"seq": 1, "next_by_subj": wire.claims_of(decode_id, key)})
            if first is None:
                return Claim(ClaimState.UNKNOWN)  # refused, yet none there: expired meanwhile
            holder, sequence = first
            if holder.role == "scheduler":  # a takeover may have appended since
                holder, sequence = await self._direct_get(stream, wire.scheduler_claims_of(decode_id, key)) or first
        except _UNREAD as exc:
            log.warning("a claim was taken but cannot be read", error=type(exc).__name__)
            return Claim(ClaimState.UNKNOWN)
        return Claim(ClaimState.WON if holder == self.me else ClaimState.LOST, holder, sequence)

    async def take(self, transfer_key: str, decode_id: str, was: Claim) -> bool:
        """A scheduler takes over a claim ``was`` (a dead scheduler's); False if another
        scheduler appended since, or JetStream could not say."""
        key = wire.claim_key(transfer_key)
        try:
            ack = await through_elections(lambda: self._append(
                self.me.subject(decode_id, key), was.sequence, wire.scheduler_claims_of(decode_id, key)))
        except _UNREAD:
            return False
        return "error" not in ack

    async def _append(self, subject: str, expected: int, over: str) -> dict:
        reply = await self.nc.request(subject, b"", timeout=self.timeout_s, headers={
            "Nats-Expected-Last-Subject-Sequence": str(expected),
            "Nats-Expected-Last-Subject-Sequence-Subject": over,
        })
        return json.loads(reply.data)

    async def _direct_get(self, stream: str, subject: str | None,
                          query: dict | None = None) -> tuple[wire.Claimant, int] | None:
        """The last claim message on ``subject`` (or the one ``query`` finds) in
        ``stream``: its claimant and sequence; None if there is none."""
        api_subject = f"$JS.API.DIRECT.GET.{stream}" + (f".{subject}" if subject else "")
        body = json.dumps(query).encode() if query else b""
        reply = await through_elections(lambda: self.nc.request(api_subject, body, timeout=self.timeout_s))
        headers = reply.headers or {}
        if headers.get("Status") == "404":
            return None
        if headers.get("Status"):
            raise nats.errors.TimeoutError  # refused or unavailable: unread
        claimant = wire.Claimant.of_subject(headers.get("Nats-Subject", ""))
        if claimant is None:
            return None
        return claimant, int(headers.get("Nats-Sequence", "0"))


class Ledger:
    def __init__(self, flights: KeyValue, finals: KeyValue, claims: Claims):
        self.flights = flights
        self.finals = finals
        self.claims = claims

    @classmethod
    async def open(cls, nc, me: wire.Claimant, replicas: int = 1, deadline_s: float = 300.0) -> "Ledger":
        """A scheduler's ledger: makes the buckets and the claims stream if they are missing."""
        js = nc.jetstream(timeout=JS_TIMEOUT_S)
        configs = {
            # A flight ends by its deadline; without a TTL each one would leave its delete
            # marker for ever, and every scheduler's mirror reads them all at start.
            wire.FLIGHTS_BUCKET: api.KeyValueConfig(bucket=wire.FLIGHTS_BUCKET, replicas=replicas,
                                                    ttl=deadline_s * 2 + 60, storage=api.StorageType.FILE),
            wire.FINALS_BUCKET: api.KeyValueConfig(bucket=wire.FINALS_BUCKET, replicas=replicas,
                                                   ttl=wire.FINALS_KEEP_S, max_bytes=wire.FINALS_MAX_BYTES,
                                                   storage=api.StorageType.FILE),
        }
        buckets = {}
        try:
            for name, config in configs.items():
                try:
                    buckets[name] = await js.create_key_value(config)
                except nats.js.errors.BadRequestError:  # there already, made by another scheduler (maybe another version)
                    buckets[name] = await js.key_value(name)
            claims = Claims(nc, me, replicas=replicas, keep_s=deadline_s * 2 + 60)
            await claims.ensure_stream("")  # the attempts with no decode yet
        except (nats.errors.NoRespondersError, nats.js.errors.ServiceUnavailableError,
                nats.errors.TimeoutError) as exc:
            raise RuntimeError(
                f"JetStream did not answer ({type(exc).__name__}): kvpush keeps flights in JetStream, so "
                "start nats-server with -js (kvpush up and the compose file do)") from None
        return cls(buckets[wire.FLIGHTS_BUCKET], buckets[wire.FINALS_BUCKET], claims)

    # ------------------------------------------------------------ answer claims

    async def claim(self, transfer_key: str, decode_id: str) -> Claim:
        return await self.claims.claim(transfer_key, decode_id)

    async def take_claim(self, transfer_key: str, decode_id: str, was: Claim) -> bool:
        return await self.claims.take(transfer_key, decode_id, was)

    # ------------------------------------------------------------ flight records

    async def record(self, flight: wire.FlightRecord) -> int | None:
        """Write a new flight; its revision, or None if its client's request id is in flight already."""
        key = wire.flight_key(flight.owner, flight.request_id)
        try:
            return await through_elections(lambda: self.flights.create(key, wire.encode(flight)))
        except nats.js.errors.KeyWrongLastSequenceError:
            return None

    async def rewrite(self, flight: wire.FlightRecord, revision: int) -> int | None:
        """Write the flight over the revision its writer last saw; None if another
        scheduler wrote it since (took it over): the writer no longer holds it."""
        key = wire.flight_key(flight.owner, flight.request_id)
        try:
            return await through_elections(lambda: self.flights.update(key, wire.encode(flight), last=revision))
        except nats.js.errors.KeyWrongLastSequenceError:
            return None

    async def forget(self, owner: str, request_id: str, revision: int) -> None:
        """The flight ended; unless another scheduler holds it now. A JetStream that
        cannot be reached leaves the record to its TTL (and a takeover finds it ended)."""
        try:
            await through_elections(lambda: self.flights.delete(wire.flight_key(owner, request_id), last=revision))
        except nats.js.errors.APIError as exc:  # another revision: taken over, or gone
            log.debug("flight record not removed", request_id=request_id, error=str(exc))
        except (nats.errors.TimeoutError, nats.errors.ConnectionClosedError, *LEADERLESS) as exc:
            log.warning("flight record not removed", request_id=request_id, error=type(exc).__name__)

    async def flight(self, key: str) -> tuple[wire.FlightRecord, int] | None:
        """The flight record under ``key`` (``wire.flight_key``) and its revision."""
        try:
            entry = await through_elections(lambda: self.flights.get(key))
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
            return None
        return wire.decode(entry.value, wire.FlightRecord), entry.revision

    async def watch_flights(self):
        """Every flight record as it is written or removed (nats-py's ``KeyWatcher``)."""
        return await self.flights.watchall()

    # ------------------------------------------------------------ stored finals

    async def keep_final(self, owner: str, request_id: str, body: bytes, reply_to: str = "") -> None:
        try:
            stored = wire.encode(wire.StoredFinal(owner=owner, body=body, reply_to=reply_to))
            await through_elections(lambda: self.finals.put(wire.flight_key(owner, request_id), stored))
        except Exception as exc:  # the client got it; only a fetch again is lost
            log.warning("could not keep a final", request_id=request_id, error=f"{type(exc).__name__}: {exc}")

    async def final(self, owner: str, request_id: str) -> wire.StoredFinal | None:
        try:
            entry = await through_elections(lambda: self.finals.get(wire.flight_key(owner, request_id)))
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
            return None
        return wire.decode(entry.value, wire.StoredFinal) if entry.value else None

    async def drop_final(self, owner: str, request_id: str) -> None:
        """A new request of the same client reuses the id: the old one's final must not be
        fetched for it."""
        try:
            await through_elections(lambda: self.finals.purge(wire.flight_key(owner, request_id)))
        except Exception as exc:
            log.warning("could not drop an old final", request_id=request_id, error=f"{type(exc).__name__}: {exc}")
