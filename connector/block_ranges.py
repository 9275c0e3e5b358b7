"""Block ids -> the fewest byte ranges a NIXL transfer needs.

Pure Python: no NIXL, no torch. The two block lists are paired position by position
(prompt block i on prefill is block i on decode); a run is coalesced only while *both*
sides stay contiguous, so one descriptor pair moves ``count`` whole blocks. "src" and
"dst" name the two sides; for a READ the local side is the destination.

Across tensor-parallel sizes a copy may move part of each block (``HeadSlice``: some of
its KV heads, ``kvpush.connector.tp_map``). A block holds its heads one after another,
each one contiguous run of bytes (K then V), so a slice is one range per block: head h
of block b is ``[b * stride + h * head_len, + head_len)``, ``head_len = block_len / heads``.
A partial slice on either side gives one range per block and region; whole blocks
coalesce as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from kvpush.shared.wire import KvRegion


@dataclass(frozen=True, slots=True)
class HeadSlice:
    """Heads ``[first, first + count)`` of a block that holds ``of`` heads."""

    first: int
    count: int
    of: int

    def __post_init__(self) -> None:
        if not (self.of > 0 and self.count > 0 and 0 <= self.first and self.first + self.count <= self.of):
            raise ValueError(f"heads {self.first}..{self.first + self.count - 1} are not within a block of {self.of}")

    def bytes(self, block_len: int) -> tuple[int, int]:
        """(offset, length) of these heads within a block of ``block_len`` bytes."""
        if block_len % self.of:
            raise ValueError(f"a block of {block_len} bytes does not split into {self.of} heads")
        head_len = block_len // self.of
        return self.first * head_len, self.count * head_len


def part_of(block_len: int, part: HeadSlice | None) -> tuple[int, int]:
    """(offset, length) of ``part`` (None: all) within a block of ``block_len`` bytes."""
    return (0, block_len) if part is None else part.bytes(block_len)


@dataclass(frozen=True, slots=True)
class BlockRun:
    src_start: int
    dst_start: int
    count: int


def coalesce(src_blocks: Sequence[int], dst_blocks: Sequence[int]) -> list[BlockRun]:
    """Pair ``src_blocks[i]`` with ``dst_blocks[i]`` and merge consecutive pairs."""
    if len(src_blocks) != len(dst_blocks):
        raise ValueError(
            f"block lists differ in length: {len(src_blocks)} source, {len(dst_blocks)} destination"
        )
    runs: list[BlockRun] = []
    for src, dst in zip(src_blocks, dst_blocks):
        if runs:
            last = runs[-1]
            if src == last.src_start + last.count and dst == last.dst_start + last.count:
                runs[-1] = BlockRun(last.src_start, last.dst_start, last.count + 1)
                continue
        runs.append(BlockRun(src, dst, 1))
    return runs


def byte_ranges(
    runs: Sequence[BlockRun], src_regions: Sequence[KvRegion], dst_regions: Sequence[KvRegion],
    src_part: HeadSlice | None = None, dst_part: HeadSlice | None = None,
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(addr, length) lists for source and destination, one entry per region and run.

    A run of blocks is one range only when a region's blocks are packed back to back
    (``block_stride == block_len``) and both sides move whole blocks; otherwise each
    block of the run is its own range. ``src_part``/``dst_part``: the heads of each block
    that move on that side (None: all); both must come to the same bytes.
    """
    if len(src_regions) != len(dst_regions):
        raise ValueError(f"KV layouts differ: {len(src_regions)} vs {len(dst_regions)} regions")
    src_ranges: list[tuple[int, int]] = []
    dst_ranges: list[tuple[int, int]] = []
    for src_region, dst_region in zip(src_regions, dst_regions):
        src_offset, length = part_of(src_region.block_len, src_part)
        dst_offset, dst_length = part_of(dst_region.block_len, dst_part)
        if length != dst_length:
            if src_part is None and dst_part is None:
                raise ValueError(f"KV block sizes differ: {src_region.block_len} vs {dst_region.block_len} bytes")
            raise ValueError(f"the heads moved differ in size: {length} bytes from each source block, "
                             f"{dst_length} into each destination block")
        packed = (
            src_region.block_stride == src_region.block_len == length
            and dst_region.block_stride == dst_region.block_len == length
        )
        for run in runs:
            pieces = [(0, run.count)] if packed else [(i, 1) for i in range(run.count)]
            for offset, count in pieces:
                src_ranges.append((src_region.base_addr + (run.src_start + offset) * src_region.block_stride
                                   + src_offset, count * length))
                dst_ranges.append((dst_region.base_addr + (run.dst_start + offset) * dst_region.block_stride
                                   + dst_offset, count * length))
    return src_ranges, dst_ranges
