"""Which worker holds which prompt prefix in its prefix cache, block by block: what each
worker's engine reported it cached and evicted (vLLM's KV cache events, relayed onto
NATS by the worker as ``wire.CacheEvents``), by the keys of ``kvpush.shared.block_keys``.

Every scheduler hears every worker's events, so all of them see the same caches. Still
an estimate: an event may be lost, or arrive after the request that needed it. Being
wrong costs only speed: a decode asks prefill for whatever its own cache lacks, and
prefill computes what its cache lacks (``kvpush.connector.scheduler_side``).

Pure: no NATS. Bounded per worker and in all (``PrefixIndex``).
"""

from __future__ import annotations

from collections import OrderedDict

from kvpush.shared.block_keys import block_keys, leading_held

MAX_BLOCKS = 200_000  # (worker, block) entries kept in all: ~30 MB at most


class PrefixIndex:
    """A worker holds at most the blocks its engine has (``capacity``, its heartbeat's
    total): a worker that reports more, or junk, pushes out only its own oldest entries.
    Past ``max_blocks`` in all, the worker holding the most loses its oldest."""

    def __init__(self, max_blocks: int = MAX_BLOCKS):
        self.max_blocks = max_blocks
        self._held: dict[str, OrderedDict[bytes, None]] = {}  # worker id -> its block keys, oldest first
        self._incarnations: dict[str, str] = {}  # worker id -> the start its entries are from
        self._count = 0

    def stored(self, worker_id: str, incarnation: str, keys: list[bytes], capacity: int | None = None) -> None:
        """That start of ``worker_id`` cached blocks with these keys."""
        self.started(worker_id, incarnation)
        held = self._held.setdefault(worker_id, OrderedDict())
        self._count -= len(held)
        for key in keys:
            held.pop(key, None)
            held[key] = None
        while capacity is not None and len(held) > max(capacity, 0):
            held.popitem(last=False)
        self._count += len(held)
        while self._count > self.max_blocks:
            largest = max(self._held.values(), key=len)
            largest.popitem(last=False)
            self._count -= 1

    def removed(self, worker_id: str, incarnation: str, keys: list[bytes]) -> None:
        """That start of ``worker_id`` evicted blocks with these keys."""
        if self.started(worker_id, incarnation):
            return
        held = self._held.get(worker_id, {})
        for key in keys:
            if held.pop(key, 0) is None:
                self._count -= 1

    def started(self, worker_id: str, incarnation: str) -> bool:
        """Note the worker's start (from its events or its heartbeat); True if it is new:
        what an earlier start held is gone."""
        if self._incarnations.get(worker_id) == incarnation:
            return False
        self.forget(worker_id)
        self._incarnations[worker_id] = incarnation
        return True

    def cached_blocks(self, worker_id: str, keys: list[bytes]) -> int:
        """How many of a prompt's first blocks (``block_keys``) ``worker_id`` likely holds."""
        return leading_held(keys, self._held.get(worker_id, {}))

    def forget(self, worker_id: str) -> None:
        """A worker's engine cleared its cache, restarted (a new incarnation) or left."""
        self._incarnations.pop(worker_id, None)
        self._count -= len(self._held.pop(worker_id, {}))

    def __len__(self) -> int:
        return self._count


class Prompt:
    """A prompt's token ids and its block keys, made once per block size."""

    def __init__(self, token_ids: list[int]):
        self.token_ids = token_ids
        self._keys: dict[int, list[bytes]] = {}

    def keys(self, block_size: int) -> list[bytes]:
        if block_size not in self._keys:
            self._keys[block_size] = block_keys(self.token_ids, max(block_size, 1))
        return self._keys[block_size]

    def blocks(self, block_size: int) -> int:
        return -(-len(self.token_ids) // max(block_size, 1))
