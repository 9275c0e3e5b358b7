"""Count producer notifications per transfer on the decode side.

Pure Python and thread-safe. A transfer is complete when every expected producer
rank has notified; notifications may arrive before decode says what it expects.
"""

from __future__ import annotations

import threading


def notification(transfer_id: str, rank: int, num_ranks: int) -> bytes:
    return f"{transfer_id}:{rank}:{num_ranks}".encode()


def parse_notification(message: bytes) -> tuple[str, int, int]:
    transfer_id, rank, num_ranks = message.decode().rsplit(":", 2)
    return transfer_id, int(rank), int(num_ranks)


class CompletionCounter:
    def __init__(self, max_tombstones: int = 100_000) -> None:
        self._lock = threading.Lock()  # protects _seen, _done and _taken
        self._seen: dict[str, set[int]] = {}
        self._done: set[str] = set()
        self._taken: dict[str, None] = {}  # insertion-ordered tombstones of handed-out ids
        self._max_tombstones = max_tombstones

    def record(self, transfer_id: str, rank: int, num_ranks: int) -> bool:
        """Record one rank's notification; True the first time the transfer completes."""
        if not 0 <= rank < num_ranks:
            raise ValueError(f"rank {rank} outside 0..{num_ranks - 1}")
        with self._lock:
            if transfer_id in self._done or transfer_id in self._taken:
                return False
            ranks = self._seen.setdefault(transfer_id, set())
            ranks.add(rank)
            if len(ranks) < num_ranks:
                return False
            del self._seen[transfer_id]
            self._done.add(transfer_id)
            return True

    def take_done(self, transfer_ids) -> set[str]:
        """Return and clear those of ``transfer_ids`` that completed."""
        with self._lock:
            done = self._done.intersection(transfer_ids)
            self._done -= done
            for transfer_id in done:
                self._tombstone(transfer_id)
            return done

    def forget(self, transfer_id: str) -> None:
        with self._lock:
            self._seen.pop(transfer_id, None)
            self._done.discard(transfer_id)
            self._tombstone(transfer_id)

    def _tombstone(self, transfer_id: str) -> None:
        self._taken[transfer_id] = None
        while len(self._taken) > self._max_tombstones:
            del self._taken[next(iter(self._taken))]
