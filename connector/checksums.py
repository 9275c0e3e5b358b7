"""End-to-end KV checksums: a digest of a transfer's blocks as prefill computed them,
checked over the blocks decode received before the request runs.

The digest is xxHash's XXH3 (64 bits; ~12 GB/s on one core of this project's CPU
machine, docs/benchmarks.md) over the blocks' bytes, region by region (K and V of every
layer, in the layout's order: ``kv_layout``), and within a region block by block in the
prompt's order. Both sides walk their own block ids in the same order, so equal bytes
give equal digests whatever ids each engine chose (a run of consecutive blocks is hashed
in one call: the same bytes, in the same order). It detects damage (a torn or misplaced write, a layout
that differs between engine versions); it is not a signature: who wrote is proven by
the notification's tag, which covers the digest (``completion.block_tag``).

Push: one digest per copy (per layer with layer-wise push), in the WRITE's notification.
Pull: one digest per prompt block, in the handoff's ``kv_transfer_params``
(``wire.PrefilledKv.block_digests``), since decode reads only the blocks its own cache
lacks and which those are is known only then.

Reads memory by address: engines whose KV is in host memory (``DRAM``). On a GPU the
digest would have to run on the device; kvpush does not do that yet, and a prefill on a
``VRAM`` layout sends no digest (decode then reports its KV unchecked).

No NATS, no NIXL; ``PullDigests`` hands pull digests from the worker side of the
connector to its scheduler side when both live in one process (one rank, vLLM's
in-process executor); otherwise none are sent and decode reports the KV unchecked.
"""

from __future__ import annotations

import ctypes
import random
import threading
from typing import Iterable

import xxhash

from kvpush.connector.block_ranges import HeadSlice, part_of
from kvpush.connector.kv_layout import KvLayout
from kvpush.shared import wire


def readable(layout: KvLayout) -> bool:
    """The blocks are in host memory, where this module reads them."""
    return layout.mem_type == "DRAM"


def _regions(layout: KvLayout, regions: tuple[int, int] | None) -> list[wire.KvRegion]:
    first, end = regions if regions is not None else (0, len(layout.regions))
    return layout.regions[first:end]


def digest(layout: KvLayout, block_ids: Iterable[int], regions: tuple[int, int] | None = None,
           part: HeadSlice | None = None) -> str:
    """Of these blocks (in this order), over ``layout.regions[first:end]`` (default all);
    of each block only ``part``'s heads when given (a copy between different TP sizes)."""
    hasher = xxhash.xxh3_64()
    runs = _runs(list(block_ids))
    for region in _regions(layout, regions):
        offset, length = part_of(region.block_len, part)
        contiguous = region.block_stride == region.block_len == length
        for first, count in runs if contiguous else ((block, 1) for block, n in runs for block in range(block, block + n)):
            address = region.base_addr + first * region.block_stride + offset
            hasher.update((ctypes.c_char * (length * count)).from_address(address))
    return hasher.hexdigest()


def _runs(block_ids: list[int]) -> list[tuple[int, int]]:
    """Consecutive ids as (first, count), in order."""
    runs: list[tuple[int, int]] = []
    for block in block_ids:
        if runs and block == runs[-1][0] + runs[-1][1]:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((block, 1))
    return runs


def block_digests(layout: KvLayout, block_ids: Iterable[int]) -> list[str]:
    """One digest per block, over all its regions."""
    return [digest(layout, [block]) for block in block_ids]


def head_digests(layout: KvLayout, block_ids: Iterable[int]) -> list[list[str]]:
    """Per block, one digest per KV head this rank holds (in order), each over that head's
    bytes in every region; [] if the layout's heads are not known (``KvLayout.heads``)."""
    if not layout.heads:
        return []
    heads = [HeadSlice(head, 1, layout.heads) for head in range(layout.heads)]
    return [[digest(layout, [block], part=head) for head in heads] for block in block_ids]


def flip_byte(layout: KvLayout, block_ids: list[int], seed: int) -> tuple[int, int, int]:
    """Chaos: flip every bit of one byte of one of these blocks, chosen by ``seed``, in
    place. (block, region, offset) it flipped."""
    rng = random.Random(seed)
    block = rng.choice(block_ids)
    index = rng.randrange(len(layout.regions))
    region = layout.regions[index]
    offset = rng.randrange(region.block_len)
    cell = ctypes.c_ubyte.from_address(region.base_addr + block * region.block_stride + offset)
    cell.value ^= 0xFF
    return block, index, offset


class PullDigests:
    """Pull: digests the worker side computed for a finished prompt, until the scheduler
    side's ``request_finished`` puts them in the handoff. Bounded; thread-safe."""

    def __init__(self, max_entries: int = 10_000) -> None:
        self._lock = threading.Lock()
        self._digests: dict[str, list[str]] = {}
        self._max_entries = max_entries

    def put(self, transfer_id: str, digests: list[str]) -> None:
        with self._lock:
            self._digests[transfer_id] = digests
            while len(self._digests) > self._max_entries:
                del self._digests[next(iter(self._digests))]

    def take(self, transfer_id: str) -> list[str] | None:
        with self._lock:
            return self._digests.pop(transfer_id, None)


PULL_DIGESTS = PullDigests()  # the process's: both halves of a one-rank connector see it
