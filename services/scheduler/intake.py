"""Durable intake: a request taken by a scheduler survives that scheduler's death at any
moment after the client published it, and its final reaches the client's reply subject
without the client ever asking again.

Core NATS delivers a message once, to the subscribers it has then. A queue group gives a
request to one scheduler only, and a scheduler that died before it wrote the request down
took it with it (issue 24: 0-5 of 6 requests lost per kill). So every scheduler gets every
request (no queue group), and exactly one of them takes it: the one that rendezvous
hashing of the request's key over the live schedulers designates (``designated``). The
others hold a copy (``IntakeBook``) until the request is settled: its designated scheduler
wrote its flight record (seen on the flights bucket's watch) or said it refused it
(``kvpush.scheduler.intake.<scheduler>``). A copy whose designated scheduler is gone before
that is taken by the one designated among those still live: it runs the request from the
start, as if it had just arrived (``orphaned``).

Why this and not the alternatives (issue 24 lists three):
- a record written before validation still loses what arrives between the delivery and the
  record's write, which is where a kill "right after receipt" lands;
- a JetStream stream behind the generate subjects keeps the body but not the reply
  subject, and answers the publisher with a PubAck the plain-client contract does not
  expect.
The cost: each scheduler decodes every request's id and keeps its bytes until it is settled
(milliseconds), and the designated one publishes one small notice per request it refuses
(docs/reliability.md has the measured latency).

Two schedulers can disagree on who is live (one just started, or a heartbeat was lost).
A copy left unsettled for a grace period is then taken by whoever the holder now finds
designated, so no request waits on a scheduler that does not know it is its. Both may
then take a request: the flight record's create-if-absent decides, and the loser finds
the record held for the same client and inbox and drops its copy; a copy taken as an
orphan is also dropped if its final is kept already (it ended meanwhile). A scheduler
counts itself live only after a whole heartbeat round, so that a new one does not take
requests the others still give to someone else.

A cancel can come before its request, or to a scheduler that does not hold it: each is
kept until its request could no longer be running (``EarlyCancels``).

Pure: no NATS. Time and liveness are passed in.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

import msgspec

from kvpush.shared import settings, wire

MAX_HELD = 20_000  # copies held at once; past it the oldest go (each is a request's bytes)


class _JustTheId(msgspec.Struct):
    request_id: str | None = None


def intake_key(owner: str, reply: str, data: bytes) -> tuple[str, str]:
    """(flight key, request id) of a request as it arrives. A body without a valid
    ``request_id`` gets one derived from its reply subject and bytes, the same on every
    scheduler (and for a client's resend of it on the same inbox)."""
    try:
        request_id = msgspec.json.decode(data, type=_JustTheId).request_id
    except msgspec.MsgspecError:
        request_id = None
    if request_id is None or wire.request_id_problem(request_id) is not None:
        digest = hashlib.blake2b(data, digest_size=12, key=reply.encode()[:64], person=b"kvpush-intake")
        request_id = "gen-" + digest.hexdigest()
    return wire.flight_key(owner, request_id), request_id


def designated(key: str, live: list[str]) -> str | None:
    """The scheduler among ``live`` that takes the request with this key: the highest
    hash of (key, scheduler), so that a scheduler's leaving moves only its own share."""
    if not live:
        return None
    return max(live, key=lambda scheduler: hashlib.blake2b(f"{key}\0{scheduler}".encode(), digest_size=8).digest())


@dataclass
class HeldRequest:
    """A copy of a request another scheduler was designated to take."""

    key: str
    request_id: str
    subject: str
    reply: str
    data: bytes
    headers: dict | None
    received_ns: int
    held_since: float  # monotonic
    designated: str  # the scheduler that takes it...
    designated_incarnation: str  # ...in this start of it (one that restarted never had it)


@dataclass
class IntakeBook:
    """The copies this scheduler holds, and when one is an orphan to take."""

    me: str
    keep_s: float  # a copy older than this goes: its request has long been settled or answered
    grace_s: float  # a copy unsettled this long is taken by whoever is designated now
    max_held: int = MAX_HELD
    _held: "OrderedDict[str, HeldRequest]" = field(default_factory=OrderedDict)

    def hold(self, request: HeldRequest) -> None:
        self._held.pop(request.key, None)
        self._held[request.key] = request
        while len(self._held) > self.max_held:
            self._held.popitem(last=False)

    def settle(self, key: str) -> None:
        """Its designated scheduler wrote it down or refused it: the copy is not needed."""
        self._held.pop(key, None)

    def orphaned(self, live: dict[str, str], now: float) -> list[HeldRequest]:
        """The copies to take now (``live``: each live scheduler's incarnation): among the
        live schedulers this one is designated, and the start designated at arrival is no
        longer live (it left, or restarted), or has left the copy unsettled for
        ``grace_s`` (the two saw different schedulers live: neither took it). Copies past
        ``keep_s`` are dropped."""
        taken = []
        for key, request in list(self._held.items()):
            age = now - request.held_since
            gone = live.get(request.designated) != request.designated_incarnation
            # A restarted taker is live under the same id but never had the request: not it.
            candidates = [s for s in live if not (gone and s == request.designated)]
            if age > self.keep_s:
                del self._held[key]
            elif designated(key, candidates) == self.me and (gone or age > self.grace_s):
                del self._held[key]
                taken.append(request)
        return taken

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, key: str) -> bool:
        return key in self._held


@dataclass
class EarlyCancels:
    """Cancels that came before their request (or to a scheduler that does not hold it):
    each is kept until the request's deadline could have passed, so a request that arrives
    after its cancel, here, is cancelled at once. Bounded: the oldest go first."""

    keep_s: float = settings.DEADLINE_S
    max_entries: int = 10_000
    _until: dict[tuple[str, str], float] = field(default_factory=dict)  # (owner, request id) -> expiry

    def remember(self, owner: str, request_id: str, now: float) -> None:
        self._until.pop((owner, request_id), None)
        self._until[(owner, request_id)] = now + self.keep_s
        while self._until and (len(self._until) > self.max_entries or next(iter(self._until.values())) <= now):
            del self._until[next(iter(self._until))]

    def take(self, owner: str, request_id: str, now: float) -> bool:
        """True (once) if that owner cancelled that request id within ``keep_s``."""
        until = self._until.pop((owner, request_id), None)
        return until is not None and now < until

    def __len__(self) -> int:
        return len(self._until)
