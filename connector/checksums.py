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

Push: one digest per copy (per layer with layer-wise push, per decode rank written to at
tensor parallelism), in the WRITE's notification, over the heads that copy moves.
Pull: one digest per prompt block and KV head, in the handoff's ``kv_transfer_params``
(``wire.PrefilledKv.head_digests``), since decode reads only the blocks its own cache
lacks and which those are is known only then, and a decode at any tensor-parallel size
checks the heads it holds.

Reads memory by address: engines whose KV is in host memory (``DRAM``). On a GPU the
digest would have to run on the device; kvpush does not do that yet, and a prefill on a
``VRAM`` layout sends no digest (decode then reports its KV unchecked).

No NATS, no NIXL; ``HandoffDigests`` puts the ranks' pull digests, carried to the
scheduler side by vLLM's worker meta, into the handoff.
"""

from __future__ import annotations

import ctypes
import random
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


class HandoffDigests:
    """Pull: the ranks' digests of finished prompts, put into the handoffs vLLM returns.

    Every rank computes its heads' digests after the forward pass that finished the prompt
    (``head_digests``), in its own process at TP > 1; they reach the scheduler side in that
    step's worker meta, which vLLM merges over the ranks. vLLM hands the scheduler side
    that step's output in one call (``Scheduler.update_from_output``): ``request_finished``
    builds the handoff first, ``update_connector_output`` brings the digests after. The
    handoff's dict is kept (``handed``) and filled once every rank's digests came
    (``arrived``), before vLLM sends it; digests that come first wait for their handoff.
    Only on vLLM's scheduler thread; bounded.
    """

    def __init__(self, tp_size: int, max_entries: int = 10_000) -> None:
        self.tp_size = tp_size
        self._max_entries = max_entries
        self._handed: dict[str, dict] = {}  # transfer id -> the handoff's params, awaiting digests
        self._digests: dict[str, dict[int, list[list[str]]]] = {}  # transfer id -> rank -> its rows

    def handed(self, transfer_id: str, params: dict) -> None:
        """``request_finished`` returned ``params`` for a prompt whose digests were asked for."""
        self._put(self._handed, transfer_id, params)
        self._fill(transfer_id)

    def arrived(self, transfer_id: str, by_rank: dict[int, list[list[str]]]) -> None:
        """Ranks' digests (rank -> [prompt block][head the rank holds]) came in a worker meta."""
        self._put(self._digests, transfer_id, {**self._digests.get(transfer_id, {}), **by_rank})
        self._fill(transfer_id)

    def _fill(self, transfer_id: str) -> None:
        params, by_rank = self._handed.get(transfer_id), self._digests.get(transfer_id, {})
        if params is None or any(rank not in by_rank for rank in range(self.tp_size)):
            return
        del self._handed[transfer_id], self._digests[transfer_id]
        rows = [by_rank[rank] for rank in range(self.tp_size)]
        if len({len(blocks) for blocks in rows}) == 1:  # one row per prompt block on every rank
            params["head_digests"] = [[digest for blocks in rows for digest in blocks[b]] for b in range(len(rows[0]))]

    def _put(self, entries: dict, transfer_id: str, value) -> None:
        entries[transfer_id] = value
        while len(entries) > self._max_entries:
            del entries[next(iter(entries))]
