"""Match a decode registration with a finished prefill, whichever arrives first.

Pure Python and thread-safe: the NATS thread offers registrations, vLLM's worker
thread offers finished prefills. ``offer_*`` returns a ``Match`` exactly once per
transfer id, to whichever call completed the pair, ``None`` while the half waits, or
``Refused``:

- ``duplicate``: a second copy of a half already offered or matched (ignore it);
- ``closed``: the transfer was given up (its lease expired, decode revoked it, its
  write failed); the half must not be used: free its blocks, tell its sender;
- ``incompatible``: ``check(registration, prefill)`` found the pair unusable (the
  wrong decode, a different prompt length); the registration is dropped and the
  prefill keeps waiting for the right one.

Each waiting half holds a lease: ``lease_s`` after its arrival or its last ``renew``,
``expired()`` hands it back (tombstoned) so the caller frees what it holds.

Bounded: any decode may send registrations and renew them, so a registration that would
wait past ``max_pending`` waiting halves is refused as ``closed`` (not tombstoned: its
sender is told, and may try again), and no renewal keeps a half past ``max_life_s``
from its arrival. A finished prefill always gets in: it is this engine's own work.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Generic, Literal, TypeVar

from kvpush.shared import settings

R = TypeVar("R")
P = TypeVar("P")

Closed = Literal["matched", "expired", "revoked", "failed"]


@dataclass(slots=True)
class Match(Generic[R, P]):
    transfer_id: str
    registration: R
    prefill: P
    order: str  # "registration_first" | "prefill_first"
    waited_s: float  # how long the first half waited for the second


@dataclass(slots=True)
class Refused(Generic[R]):
    transfer_id: str
    code: Literal["duplicate", "closed", "incompatible"]
    reason: str
    registration: R | None = None  # the registration refused, if that was the half offered or dropped


@dataclass(slots=True)
class Half(Generic[R, P]):
    registration: R | None = None
    prefill: P | None = None
    first_at: float = 0.0
    expires_at: float = 0.0


class Rendezvous(Generic[R, P]):
    def __init__(
        self,
        lease_s: float = settings.FAULTS.lease_s,
        check: Callable[[R, P], str | None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_tombstones: int = 100_000,
        max_pending: int = 10_000,
        max_life_s: float = settings.DEADLINE_S,
    ):
        self.lease_s = lease_s
        self._check = check
        self._clock = clock
        self._lock = threading.Lock()  # protects _pending and _closed
        self._pending: dict[str, Half[R, P]] = {}
        self._closed: dict[str, Closed] = {}  # insertion-ordered tombstones
        self._max_tombstones = max_tombstones
        self.max_pending = max_pending
        self.max_life_s = max_life_s

    def offer_registration(self, transfer_id: str, registration: R) -> Match[R, P] | Refused[R] | None:
        return self._offer(transfer_id, registration=registration)

    def offer_prefill(self, transfer_id: str, prefill: P) -> Match[R, P] | Refused[R] | None:
        return self._offer(transfer_id, prefill=prefill)

    def _offer(self, transfer_id: str, registration: R | None = None, prefill: P | None = None):
        now = self._clock()
        with self._lock:
            closed = self._closed.get(transfer_id)
            if closed == "matched":
                return Refused(transfer_id, "duplicate", "already matched", registration)
            if closed is not None:
                return Refused(transfer_id, "closed", f"transfer {closed}", registration)
            half = self._pending.get(transfer_id)
            if half is None:
                if registration is not None and len(self._pending) >= self.max_pending:
                    return Refused(transfer_id, "closed", f"{len(self._pending)} transfers wait for their other "
                                   "half here already, the most this prefill keeps", registration)
                self._pending[transfer_id] = Half(registration, prefill, now, now + self.lease_s)
                return None
            if (registration is not None and half.registration is not None) or (
                prefill is not None and half.prefill is not None
            ):
                return Refused(transfer_id, "duplicate", "this half is already waiting", registration)
            pair_registration = registration if registration is not None else half.registration
            pair_prefill = prefill if prefill is not None else half.prefill
            problem = self._check(pair_registration, pair_prefill) if self._check else None
            if problem is not None:
                half.registration = None  # the prefill (offered now or waiting) waits on
                half.prefill = pair_prefill
                return Refused(transfer_id, "incompatible", problem, pair_registration)
            del self._pending[transfer_id]
            self._tombstone(transfer_id, "matched")
            return Match(
                transfer_id,
                pair_registration,
                pair_prefill,
                "prefill_first" if registration is not None else "registration_first",
                now - half.first_at,
            )

    def retarget(self, transfer_id: str, update: Callable[[P], P]) -> tuple[str | None, R | None]:
        """Point a transfer that has not matched at another decode: the registration
        waiting for it (if any) is dropped and returned, a waiting prefill is replaced by
        ``update(prefill)`` (checked against the next registration) with a fresh lease.
        Returns (why not, or None; the registration dropped)."""
        with self._lock:
            closed = self._closed.get(transfer_id)
            if closed is not None:
                return f"the transfer is {closed}" if closed != "matched" else "its write has begun", None
            half = self._pending.get(transfer_id)
            if half is None:
                return None, None
            dropped, half.registration = half.registration, None
            if half.prefill is None:
                del self._pending[transfer_id]  # nothing waits any more
            else:
                half.prefill = update(half.prefill)
                half.expires_at = min(self._clock() + self.lease_s, half.first_at + self.max_life_s)
            return None, dropped

    def reopen(self, transfer_id: str) -> bool:
        """Undo a "revoked" close that turned out forged (no half had arrived to check it
        against); False if the transfer is not closed that way."""
        with self._lock:
            if self._closed.get(transfer_id) != "revoked":
                return False
            del self._closed[transfer_id]
            return True

    def peek(self, transfer_id: str) -> Half[R, P] | None:
        """The half waiting for ``transfer_id``, if one does (not a copy: do not change it)."""
        with self._lock:
            return self._pending.get(transfer_id)

    def renew(self, transfer_id: str) -> bool:
        """Extend the lease of the half waiting for ``transfer_id``; False if none waits."""
        with self._lock:
            half = self._pending.get(transfer_id)
            if half is None:
                return False
            half.expires_at = min(self._clock() + self.lease_s, half.first_at + self.max_life_s)
            return True

    def close(self, transfer_id: str, reason: Closed = "revoked") -> tuple[Half[R, P] | None, bool]:
        """Give a transfer up; later halves for it are refused as closed.

        Returns (the half that was waiting, or None; whether it had already matched).
        A transfer already matched stays matched (its write is under way or done) unless
        ``reason`` is "failed": that write ended without the KV, and later halves are told so.
        """
        with self._lock:
            if self._closed.get(transfer_id) == "matched":
                if reason == "failed":
                    self._tombstone(transfer_id, reason)
                return None, True
            self._tombstone(transfer_id, reason)
            return self._pending.pop(transfer_id, None), False

    def expired(self) -> list[tuple[str, Half[R, P]]]:
        """Take out the halves whose lease ran out; their transfers are closed."""
        now = self._clock()
        with self._lock:
            gone = [(tid, half) for tid, half in self._pending.items() if half.expires_at <= now]
            for transfer_id, _ in gone:
                del self._pending[transfer_id]
                self._tombstone(transfer_id, "expired")
            return gone

    def pending(self) -> list[str]:
        with self._lock:
            return list(self._pending)

    def _tombstone(self, transfer_id: str, reason: Closed) -> None:
        self._closed.pop(transfer_id, None)
        self._closed[transfer_id] = reason
        while len(self._closed) > self._max_tombstones:
            del self._closed[next(iter(self._closed))]
