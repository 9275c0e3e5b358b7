"""End-to-end KV checksums (connector/checksums.py) over real KV tensors laid out as
vLLM's CPU engine lays them out, the notification that carries them
(connector/completion.py), and which transfers get one (services/scheduler/dispatch.py);
how a failed load is named: tests/unit/test_kv_wait.py. Against real engines and NIXL:
tests/stack/test_checksums.py."""

from __future__ import annotations

import torch

from kvpush.connector import checksums, kv_layout
from kvpush.connector.completion import block_tag, notification, parse_notification, tag_matches
from kvpush.services.scheduler.dispatch import checksum_for

NUM_BLOCKS = 12


def caches(seed: int) -> dict[str, torch.Tensor]:
    """Two layers of (K/V, blocks, block size 16, 2 heads, 8 dims), bfloat16."""
    generator = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.attn": torch.randn(2, NUM_BLOCKS, 16, 2, 8, generator=generator).to(torch.bfloat16)
            for i in range(2)}


def test_equal_bytes_in_other_blocks_give_the_same_digest():
    source, destination = caches(1), caches(2)
    src_blocks, dst_blocks = [3, 7, 1], [0, 5, 9]
    for name in source:  # what a WRITE does: block i's bytes into the receiver's block i
        destination[name][:, dst_blocks] = source[name][:, src_blocks]
    here, there = kv_layout.describe(source, NUM_BLOCKS), kv_layout.describe(destination, NUM_BLOCKS)
    assert checksums.readable(here)
    assert checksums.digest(here, src_blocks) == checksums.digest(there, dst_blocks)
    assert checksums.digest(here, src_blocks) != checksums.digest(here, list(reversed(src_blocks)))  # order counts
    assert checksums.block_digests(here, src_blocks) == checksums.block_digests(there, dst_blocks)
    # A run of consecutive blocks is hashed in one call: the same digest as block by block.
    for name in source:
        destination[name][:, [11, 2, 8]] = source[name][:, [4, 5, 6]]
    assert checksums.digest(here, [4, 5, 6]) == checksums.digest(there, [11, 2, 8])
    # One layer's regions (layer-wise push): equal too, and not the whole copy's.
    _, first, end = here.layers[1]
    assert checksums.digest(here, src_blocks, (first, end)) == checksums.digest(there, dst_blocks, (first, end))
    assert checksums.digest(here, src_blocks, (first, end)) != checksums.digest(here, src_blocks)


def test_one_flipped_byte_anywhere_changes_the_digest():
    tensors = caches(3)
    layout = kv_layout.describe(tensors, NUM_BLOCKS)
    blocks = [2, 4, 6]
    before = checksums.digest(layout, blocks)
    per_block = checksums.block_digests(layout, blocks)
    for seed in range(20):
        block, region, offset = checksums.flip_byte(layout, blocks, seed)
        assert block in blocks and 0 <= region < len(layout.regions) and 0 <= offset < layout.regions[region].block_len
        assert checksums.digest(layout, blocks) != before
        changed = [b for b, old, new in zip(blocks, per_block, checksums.block_digests(layout, blocks)) if old != new]
        assert changed == [block]  # pull checks block by block: the flipped one is the one that differs
        checksums.flip_byte(layout, blocks, seed)  # flipped back
        assert checksums.digest(layout, blocks) == before


def test_the_digest_rides_the_notification_under_the_tag():
    tag = block_tag("key", [5, 6], "00ff")
    note = parse_notification(notification("tr:with:colons", 0, 1, tag, digest="00ff"))
    assert (note.transfer_id, note.digest, note.tag) == ("tr:with:colons", "00ff", tag)
    assert tag_matches(note.tag, "key", [5, 6], note.digest)
    assert not tag_matches(note.tag, "key", [5, 6], "00fe")  # a changed checksum does not carry the tag
    assert not tag_matches(note.tag, "key", [5, 6])
    plain = parse_notification(notification("tr:with:colons", 1, 2, block_tag("key", [5, 6]), part=1, parts=3))
    assert (plain.transfer_id, plain.rank, plain.part, plain.parts, plain.digest) == ("tr:with:colons", 1, 1, 3, "")


def test_which_transfers_get_a_checksum():
    ids = [f"{i:032x}" for i in range(4000)]
    assert all(checksum_for(t, "full") for t in ids)
    assert not any(checksum_for(t, "off") for t in ids)
    share = sum(checksum_for(t, "sampled", 0.125) for t in ids) / len(ids)
    assert 0.10 < share < 0.15
    assert [checksum_for(t, "sampled") for t in ids[:50]] == [checksum_for(t, "sampled") for t in ids[:50]]


def test_pull_digests_wait_for_their_handoff_bounded():
    """Every rank's digests fill the handoff, whichever comes first; a handoff missing a
    rank's digests gets none (decode then reports the KV unchecked, never half-checked)."""
    book = checksums.HandoffDigests(tp_size=2, max_entries=2)
    rank0, rank1 = [["a0", "a1"], ["b0", "b1"]], [["a2", "a3"], ["b2", "b3"]]
    early: dict = {}
    book.arrived("early", {0: rank0, 1: rank1})  # the digests before request_finished
    book.handed("early", early)
    assert early["head_digests"] == [["a0", "a1", "a2", "a3"], ["b0", "b1", "b2", "b3"]]
    late: dict = {}
    book.handed("late", late)  # vLLM's order: request_finished, then the step's worker meta
    book.arrived("late", {1: rank1})
    assert "head_digests" not in late
    book.arrived("late", {0: rank0})
    assert late["head_digests"][0] == ["a0", "a1", "a2", "a3"]
    for name in "abc":
        book.handed(name, {})
    forgotten: dict = {}
    book.handed("d", forgotten)
    book.arrived("a", {0: rank0, 1: rank1})  # "a" was forgotten: its handoff went out without digests
    assert forgotten == {}


def cpu_caches(seed: int, heads: int) -> dict[str, torch.Tensor]:
    """Two layers as vLLM's CPU engine lays them out: (blocks, heads, block size 16, 2 * 8)."""
    generator = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.attn": torch.randn(NUM_BLOCKS, heads, 16, 16, generator=generator)
            for i in range(2)}


def test_a_head_slice_digest_equals_the_same_heads_in_a_rank_that_holds_only_them():
    """Prefill at TP 1 holds 4 heads a block; decode rank 1 at TP 2 holds heads 2..3. The
    digest of heads 2..3 of prefill's blocks is that of decode's whole blocks once the
    heads landed, and each head's digest is the same on both sides."""
    from kvpush.connector.block_ranges import HeadSlice

    whole, half = cpu_caches(3, heads=4), cpu_caches(4, heads=2)
    src, dst = [2, 5], [7, 1]
    for name in whole:
        half[name][dst] = whole[name][src, 2:4]
    here = kv_layout.describe(whole, NUM_BLOCKS, heads=4)
    there = kv_layout.describe(half, NUM_BLOCKS, heads=2)
    assert (here.heads, there.heads) == (4, 2)
    assert checksums.digest(here, src, part=HeadSlice(2, 2, 4)) == checksums.digest(there, dst)
    assert checksums.digest(here, src, part=HeadSlice(0, 2, 4)) != checksums.digest(there, dst)
    assert [row[2:] for row in checksums.head_digests(here, src)] == checksums.head_digests(there, dst)


def test_heads_that_are_not_outermost_in_a_block_are_not_known():
    """The GPU-like layout (K/V leading, tokens before heads) cannot be split by heads."""
    layout = kv_layout.describe(caches(1), NUM_BLOCKS, heads=2)
    assert layout.heads == 0 and checksums.head_digests(layout, [0]) == []
