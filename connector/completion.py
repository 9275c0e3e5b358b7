"""NIXL notifications, and counting them per transfer.

A notification says one rank's copy of a transfer landed. It carries a tag: a keyed
hash, with the transfer's secret key, of the block ids the copy went to on the
receiver's side. The receiver recomputes it over the blocks it named itself, so it
accepts a notification only from a peer that holds the key (the scheduler gave it to
the two workers it chose, and no one else) and only for its own blocks.

Who sends how many. A notification's ``rank`` is the sender's place among the ranks
that copy into its receiver for the transfer, and ``num_ranks`` how many those are
(``kvpush.connector.tp_map``): push, the prefill ranks writing into one decode rank;
pull, the decode ranks reading one prefill rank. At equal tensor-parallel sizes each
receiver has one sender: 0 of 1.

Pure Python and thread-safe. A transfer is complete when every sender has notified
(with layer-wise push, once per layer: every part of every sender); notifications may
arrive before decode says what it expects.
"""

from __future__ import annotations

import hashlib
import hmac
import threading
from dataclasses import dataclass


def block_tag(transfer_key: str, block_ids: list[int], digest: str = "") -> str:
    """The tag of a copy into ``block_ids`` (the receiver's), made with the transfer's key;
    over the copy's checksum too when it has one (``kvpush.connector.checksums``), so
    nobody without the key can change it."""
    message = ",".join(map(str, block_ids)) + (f"|{digest}" if digest else "")
    return hashlib.blake2b(message.encode(), key=transfer_key.encode()[:64], digest_size=16).hexdigest()


def tag_matches(tag: str, transfer_key: str, block_ids: list[int], digest: str = "") -> bool:
    return bool(transfer_key) and keys_match(tag, block_tag(transfer_key, block_ids, digest))


def keys_match(given: str, expected: str) -> bool:
    """Constant-time comparison of two secrets (any text: a peer's may not be ASCII)."""
    return hmac.compare_digest(given.encode(), expected.encode())


@dataclass(frozen=True, slots=True)
class Notification:
    """One sender's copy landed (``rank`` of the ``num_ranks`` that copy into this
    receiver); with layer-wise push, one part (a layer) of it: ``part`` of ``parts``, and
    the sender's copy is whole when all its parts came."""

    transfer_id: str
    rank: int
    num_ranks: int
    tag: str
    part: int = 0
    parts: int = 1
    digest: str = ""  # the copy's checksum (its part's, layer-wise), when prefill computed one


def notification(transfer_id: str, rank: int, num_ranks: int, tag: str, part: int = 0, parts: int = 1,
                 digest: str = "") -> bytes:
    """``<transfer>:<rank>:<ranks>:<part>:<parts>[:d=<digest>]:<tag>`` (a transfer id may
    hold colons)."""
    checksum = f":d={digest}" if digest else ""
    return f"{transfer_id}:{rank}:{num_ranks}:{part}:{parts}{checksum}:{tag}".encode()


def parse_notification(message: bytes) -> Notification:
    """Raises ValueError for anything that is not one."""
    text = message.decode()
    fields = text.rsplit(":", 6)
    if len(fields) == 7 and fields[5].startswith("d="):
        transfer_id, rank, num_ranks, part, parts, digest, tag = fields
        digest = digest[2:]
    else:
        (transfer_id, rank, num_ranks, part, parts, tag), digest = text.rsplit(":", 5), ""
    note = Notification(transfer_id, int(rank), int(num_ranks), tag, int(part), int(parts), digest)
    if not 0 <= note.part < note.parts:
        raise ValueError(f"part {note.part} outside 0..{note.parts - 1}")
    return note


class CompletionCounter:
    """Counts, per transfer, each sender's parts; complete once every sender's parts all
    came. Every notification of a transfer must name the same number of senders, and a
    sender the same part count each time."""

    def __init__(self, max_tombstones: int = 100_000) -> None:
        self._lock = threading.Lock()  # protects _seen, _senders, _done and _taken
        self._seen: dict[str, dict[int, tuple[int, set[int]]]] = {}  # transfer -> sender -> (parts, parts seen)
        self._senders: dict[str, int] = {}  # transfer -> how many senders its notifications named
        self._done: set[str] = set()
        self._taken: dict[str, None] = {}  # insertion-ordered tombstones of handed-out ids
        self._max_tombstones = max_tombstones

    def record(self, transfer_id: str, rank: int, num_ranks: int, part: int = 0, parts: int = 1) -> bool:
        """Record one sender's notification (one part of it); True the first time the
        transfer completes."""
        if not 0 <= rank < num_ranks:
            raise ValueError(f"rank {rank} outside 0..{num_ranks - 1}")
        if not 0 <= part < parts:
            raise ValueError(f"part {part} outside 0..{parts - 1}")
        with self._lock:
            if transfer_id in self._done or transfer_id in self._taken:
                return False
            senders = self._senders.setdefault(transfer_id, num_ranks)
            if senders != num_ranks:
                raise ValueError(f"a notification said {senders} senders, now {num_ranks}")
            ranks = self._seen.setdefault(transfer_id, {})
            expected, seen = ranks.setdefault(rank, (parts, set()))
            if expected != parts:
                raise ValueError(f"rank {rank} said {expected} parts, now {parts}")
            seen.add(part)
            if len(ranks) < num_ranks or any(len(got) < want for want, got in ranks.values()):
                return False
            del self._seen[transfer_id], self._senders[transfer_id]
            self._done.add(transfer_id)
            return True

    def landed(self, transfer_id: str) -> set[int]:
        """The senders of a transfer not yet complete whose parts all came."""
        with self._lock:
            return {rank for rank, (want, got) in self._seen.get(transfer_id, {}).items() if len(got) == want}

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
            self._senders.pop(transfer_id, None)
            self._done.discard(transfer_id)
            self._tombstone(transfer_id)

    def _tombstone(self, transfer_id: str) -> None:
        self._taken[transfer_id] = None
        while len(self._taken) > self._max_tombstones:
            del self._taken[next(iter(self._taken))]
