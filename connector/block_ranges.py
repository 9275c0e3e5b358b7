"""Block ids -> the fewest byte ranges a NIXL transfer needs.

Pure Python: no NIXL, no torch. The two block lists are paired position by position
(prompt block i on prefill is block i on decode); a run is coalesced only while *both*
sides stay contiguous, so one descriptor pair moves ``count`` whole blocks. "src" and
"dst" name the two sides; for a READ the local side is the destination.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from kvpush.shared.wire import KvRegion


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
    runs: Sequence[BlockRun], src_regions: Sequence[KvRegion], dst_regions: Sequence[KvRegion]
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(addr, length) lists for source and destination, one entry per region and run.

    A run of blocks is one range only when a region's blocks are packed back to back
    (``block_stride == block_len``); otherwise each block of the run is its own range.
    """
    if len(src_regions) != len(dst_regions):
        raise ValueError(f"KV layouts differ: {len(src_regions)} vs {len(dst_regions)} regions")
    src_ranges: list[tuple[int, int]] = []
    dst_ranges: list[tuple[int, int]] = []
    for src_region, dst_region in zip(src_regions, dst_regions):
        if src_region.block_len != dst_region.block_len:
            raise ValueError(
                f"KV block sizes differ: {src_region.block_len} vs {dst_region.block_len} bytes"
            )
        packed = (
            src_region.block_stride == src_region.block_len
            and dst_region.block_stride == dst_region.block_len
        )
        for run in runs:
            pieces = [(0, run.count)] if packed else [(i, 1) for i in range(run.count)]
            for offset, count in pieces:
                length = count * src_region.block_len
                src_ranges.append(
                    (src_region.base_addr + (run.src_start + offset) * src_region.block_stride, length)
                )
                dst_ranges.append(
                    (dst_region.base_addr + (run.dst_start + offset) * dst_region.block_stride, length)
                )
    return src_ranges, dst_ranges
