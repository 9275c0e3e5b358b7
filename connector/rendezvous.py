"""Match a decode registration with a finished prefill, whichever arrives first.

Pure Python and thread-safe: the NATS thread offers registrations, vLLM's worker
thread offers finished prefills. ``offer_*`` returns a ``Match`` exactly once per
transfer id, to whichever call completed the pair; duplicates of either half and
arrivals after the match (``forget`` leaves a tombstone) return None.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Generic, TypeVar

R = TypeVar("R")
P = TypeVar("P")


@dataclass(slots=True)
class Match(Generic[R, P]):
    transfer_id: str
    registration: R
    prefill: P
    order: str  # "registration_first" | "prefill_first"
    waited_s: float  # how long the first half waited for the second


@dataclass(slots=True)
class _Half(Generic[R, P]):
    registration: R | None = None
    prefill: P | None = None
    first_at: float = field(default_factory=time.monotonic)


class Rendezvous(Generic[R, P]):
    def __init__(self, max_tombstones: int = 100_000):
        self._lock = threading.Lock()  # protects _pending and _matched
        self._pending: dict[str, _Half[R, P]] = {}
        self._matched: dict[str, None] = {}  # insertion-ordered tombstones
        self._max_tombstones = max_tombstones

    def offer_registration(self, transfer_id: str, registration: R) -> Match[R, P] | None:
        return self._offer(transfer_id, registration=registration)

    def offer_prefill(self, transfer_id: str, prefill: P) -> Match[R, P] | None:
        return self._offer(transfer_id, prefill=prefill)

    def _offer(self, transfer_id: str, registration: R | None = None, prefill: P | None = None):
        with self._lock:
            if transfer_id in self._matched:
                return None
            half = self._pending.get(transfer_id)
            if half is None:
                self._pending[transfer_id] = _Half(registration, prefill)
                return None
            if registration is not None:
                if half.registration is not None:
                    return None  # duplicate registration
                half.registration = registration
                order = "prefill_first"
            else:
                if half.prefill is not None:
                    return None  # duplicate prefill
                half.prefill = prefill
                order = "registration_first"
            del self._pending[transfer_id]
            self._tombstone(transfer_id)
            return Match(
                transfer_id,
                half.registration,
                half.prefill,
                order,
                time.monotonic() - half.first_at,
            )

    def forget(self, transfer_id: str) -> _Half[R, P] | None:
        """Drop a transfer (aborted, expired); later halves for it are ignored."""
        with self._lock:
            self._tombstone(transfer_id)
            return self._pending.pop(transfer_id, None)

    def pending(self) -> list[str]:
        with self._lock:
            return list(self._pending)

    def _tombstone(self, transfer_id: str) -> None:
        self._matched[transfer_id] = None
        while len(self._matched) > self._max_tombstones:
            del self._matched[next(iter(self._matched))]
