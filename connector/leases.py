"""Leases on blocks one engine holds for another, as pure bookkeeping.

No NATS, NIXL or vLLM; time is passed in, so tests drive it directly. Neither class
locks: its owner holds a lock around it.

- ``ServedReads`` (prefill, pull): a finished prompt's blocks wait for decode's READ
  under a lease that decode's ``LeaseRenewal`` extends; a lease that ran out hands the
  blocks back.
- ``Renewals`` (decode): the transfers whose KV it still waits for, by the prefill engine
  that holds their blocks: one ``LeaseRenewal`` per prefill engine per heartbeat.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable


@dataclass(slots=True)
class Lease:
    request_id: str  # the prefill request whose blocks are held
    expires_at: float


class ServedReads:
    """Prefill, pull: transfer id -> the lease on the blocks decode will READ."""

    def __init__(self, lease_s: float):
        self.lease_s = lease_s
        self._leases: dict[str, Lease] = {}

    def hold(self, transfer_id: str, request_id: str, now: float) -> None:
        self._leases[transfer_id] = Lease(request_id, now + self.lease_s)

    def holds(self, transfer_id: str) -> bool:
        return transfer_id in self._leases

    def renew(self, transfer_id: str, now: float) -> bool:
        """Extend the lease on ``transfer_id``'s blocks; False if none is held."""
        lease = self._leases.get(transfer_id)
        if lease is None:
            return False
        lease.expires_at = now + self.lease_s
        return True

    def release(self, transfer_id: str) -> str | None:
        """Stop holding ``transfer_id``'s blocks (read, or given up): the request id that
        held them, or None if none was held."""
        lease = self._leases.pop(transfer_id, None)
        return lease.request_id if lease is not None else None

    def lapsed(self, now: float) -> list[tuple[str, str]]:
        """Take out the leases that ran out: (transfer id, request id) each."""
        gone = [(tid, lease.request_id) for tid, lease in self._leases.items() if lease.expires_at <= now]
        for transfer_id, _ in gone:
            del self._leases[transfer_id]
        return gone

    def __len__(self) -> int:
        return len(self._leases)


@dataclass(frozen=True, slots=True)
class Renewed:
    transfer_id: str
    prefill_engine_id: str


class Renewals:
    """Decode: engine request id -> the transfer whose prefill blocks it still wants."""

    def __init__(self) -> None:
        self._by_request: dict[str, Renewed] = {}

    def start(self, request_id: str, transfer_id: str, prefill_engine_id: str) -> None:
        self._by_request[request_id] = Renewed(transfer_id, prefill_engine_id)

    def stop(self, request_ids: Iterable[str]) -> None:
        """These requests' KV arrived, their wait ended, or they finished."""
        for request_id in request_ids:
            self._by_request.pop(request_id, None)

    def by_prefill(self) -> dict[str, list[str]]:
        """Prefill engine id -> the transfer ids to renew there now."""
        due: dict[str, list[str]] = {}
        for renewed in self._by_request.values():
            due.setdefault(renewed.prefill_engine_id, []).append(renewed.transfer_id)
        return due

    def __len__(self) -> int:
        return len(self._by_request)
