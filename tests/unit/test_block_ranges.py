"""Block ids -> runs -> byte ranges: the fewest descriptors a NIXL write needs."""

from __future__ import annotations

import random

import pytest

from kvpush.connector.block_ranges import BlockRun, HeadSlice, byte_ranges, coalesce
from kvpush.shared.wire import KvRegion

BLOCK = 64


def _packed(base: int) -> KvRegion:
    return KvRegion(base_addr=base, block_stride=BLOCK, block_len=BLOCK)


def _strided(base: int) -> KvRegion:
    return KvRegion(base_addr=base, block_stride=4 * BLOCK, block_len=BLOCK)


def test_contiguous_blocks_are_one_run():
    assert coalesce([4, 5, 6, 7], [10, 11, 12, 13]) == [BlockRun(4, 10, 4)]


def test_scattered_blocks_give_one_run_per_contiguous_stretch():
    runs = coalesce([1, 2, 3, 7, 8, 20], [1, 2, 3, 7, 8, 20])
    assert runs == [BlockRun(1, 1, 3), BlockRun(7, 7, 2), BlockRun(20, 20, 1)]


def test_a_run_breaks_when_only_the_destination_jumps():
    assert coalesce([1, 2, 3, 4], [5, 6, 9, 10]) == [BlockRun(1, 5, 2), BlockRun(3, 9, 2)]


def test_a_run_breaks_when_only_the_source_jumps():
    assert coalesce([1, 2, 8, 9], [5, 6, 7, 8]) == [BlockRun(1, 5, 2), BlockRun(8, 7, 2)]


def test_no_blocks_no_runs():
    assert coalesce([], []) == []


def test_block_lists_of_different_lengths_are_refused():
    with pytest.raises(ValueError, match="3 source, 2 destination"):
        coalesce([1, 2, 3], [1, 2])


def test_packed_regions_give_one_range_per_region_per_run():
    runs = coalesce([0, 1, 2, 7], [3, 4, 5, 9])
    src, dst = byte_ranges(runs, [_packed(1000), _packed(5000)], [_packed(2000), _packed(9000)])
    assert src == [(1000, 3 * BLOCK), (1000 + 7 * BLOCK, BLOCK),
                   (5000, 3 * BLOCK), (5000 + 7 * BLOCK, BLOCK)]
    assert dst == [(2000 + 3 * BLOCK, 3 * BLOCK), (2000 + 9 * BLOCK, BLOCK),
                   (9000 + 3 * BLOCK, 3 * BLOCK), (9000 + 9 * BLOCK, BLOCK)]


def test_strided_regions_give_one_range_per_block():
    runs = coalesce([0, 1, 2], [3, 4, 5])
    src, dst = byte_ranges(runs, [_strided(1000)], [_strided(2000)])
    stride = 4 * BLOCK
    assert src == [(1000 + b * stride, BLOCK) for b in (0, 1, 2)]
    assert dst == [(2000 + b * stride, BLOCK) for b in (3, 4, 5)]


def test_one_strided_side_is_enough_to_split_per_block():
    src, dst = byte_ranges([BlockRun(0, 0, 2)], [_packed(0)], [_strided(0)])
    assert (len(src), len(dst)) == (2, 2)


def test_different_block_sizes_are_refused():
    runs, src, dst = [BlockRun(0, 0, 1)], [_packed(0)], [KvRegion(base_addr=0, block_stride=2 * BLOCK,
                                                                  block_len=2 * BLOCK)]
    with pytest.raises(ValueError, match=f"block sizes differ: {BLOCK} vs {2 * BLOCK} bytes"):
        byte_ranges(runs, src, dst)


def test_different_region_counts_are_refused():
    runs, src, dst = [BlockRun(0, 0, 1)], [_packed(0)], [_packed(0), _packed(100)]
    with pytest.raises(ValueError, match="1 vs 2 regions"):
        byte_ranges(runs, src, dst)


def test_a_head_slice_is_one_range_per_block_at_its_heads_offset():
    """Prefill TP 1 (4 heads a block) to a decode rank of TP 2 (2 heads a block): heads
    2..3 of each source block fill the destination's whole block, block by block, even
    where both sides' blocks are consecutive."""
    head = BLOCK // 4
    src, dst = byte_ranges(coalesce([0, 1], [5, 6]), [_packed(1000)],
                           [KvRegion(base_addr=2000, block_stride=2 * head, block_len=2 * head)],
                           src_part=HeadSlice(2, 2, 4))
    assert src == [(1000 + 2 * head, 2 * head), (1000 + BLOCK + 2 * head, 2 * head)]
    assert dst == [(2000 + 5 * 2 * head, 2 * head), (2000 + 6 * 2 * head, 2 * head)]


def test_a_writer_fills_its_part_of_a_bigger_block():
    half = BLOCK // 2
    src, dst = byte_ranges([BlockRun(3, 7, 1)], [KvRegion(base_addr=0, block_stride=half, block_len=half)],
                           [_packed(4000)], dst_part=HeadSlice(1, 1, 2))
    assert (src, dst) == ([(3 * half, half)], [(4000 + 7 * BLOCK + half, half)])


def test_slices_that_come_to_different_sizes_are_refused():
    with pytest.raises(ValueError, match="the heads moved differ in size"):
        byte_ranges([BlockRun(0, 0, 1)], [_packed(0)], [_packed(0)], src_part=HeadSlice(0, 1, 2))
    with pytest.raises(ValueError, match="not within a block of 2"):
        HeadSlice(1, 2, 2)
    with pytest.raises(ValueError, match="does not split into 3 heads"):
        HeadSlice(0, 1, 3).bytes(BLOCK)


def test_runs_expand_back_to_the_pairs_and_are_minimal():
    rng = random.Random(20240611)
    for _ in range(300):
        n = rng.randint(0, 40)
        src = _random_blocks(rng, n)
        dst = _random_blocks(rng, n)
        runs = coalesce(src, dst)
        expanded = [(r.src_start + k, r.dst_start + k) for r in runs for k in range(r.count)]
        breaks = sum(1 for i in range(1, n) if src[i] != src[i - 1] + 1 or dst[i] != dst[i - 1] + 1)
        assert expanded == list(zip(src, dst))
        assert len(runs) == (1 + breaks if n else 0)


def _random_blocks(rng: random.Random, n: int) -> list[int]:
    """Distinct block ids with stretches of consecutive ones, like a real allocator gives."""
    blocks: list[int] = []
    used: set[int] = set()
    while len(blocks) < n:
        start = rng.randrange(200)
        for b in range(start, start + rng.randint(1, 6)):
            if len(blocks) == n or b in used:
                break
            blocks.append(b)
            used.add(b)
    return blocks
