"""Which ranks of the other engine a rank copies KV with, which heads of each block, and
how many senders each receiver counts (connector/tp_map.py); checked against vLLM's own
NixlConnector mapping (``compute_tp_mapping``, ``TransferTopology``) where both apply."""

from __future__ import annotations

import pytest
from vllm.distributed.kv_transfer.kv_connector.utils import TransferTopology
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.tp_mapping import compute_tp_mapping
from vllm.v1.kv_cache_interface import FullAttentionSpec

from kvpush.connector import tp_map
from kvpush.connector.block_ranges import HeadSlice
from kvpush.connector.tp_map import Exchange, Shard

H = 4  # the model's KV heads in the tables below


def S(first: int, count: int, of: int) -> HeadSlice:
    return HeadSlice(first, count, of)


# (my TP, my rank, peer TP) -> every exchange of that rank, read from the layout by hand
TABLE = {
    (1, 0, 1): [Exchange(0, None, None, 0, 1)],
    (2, 0, 2): [Exchange(0, None, None, 0, 1)],
    (2, 1, 2): [Exchange(1, None, None, 0, 1)],
    # prefill TP 2 -> decode TP 1: each prefill rank's whole block is half of decode's
    (2, 0, 1): [Exchange(0, None, S(0, 2, 4), 0, 2)],
    (2, 1, 1): [Exchange(0, None, S(2, 2, 4), 1, 2)],
    # decode TP 1 <- prefill TP 2, seen from decode: two peers, each filling half
    (1, 0, 2): [Exchange(0, S(0, 2, 4), None, 0, 1), Exchange(1, S(2, 2, 4), None, 0, 1)],
    # TP 4 with TP 2: one head of mine in half of a peer's block, two of mine per peer
    (4, 0, 2): [Exchange(0, None, S(0, 1, 2), 0, 2)],
    (4, 3, 2): [Exchange(1, None, S(1, 1, 2), 1, 2)],
    (2, 1, 4): [Exchange(2, S(0, 1, 2), None, 0, 1), Exchange(3, S(1, 1, 2), None, 0, 1)],
}


@pytest.mark.parametrize("mine,peer_tp", [((tp, rank), peer) for tp, rank, peer in TABLE])
def test_each_rank_exchanges_with_the_peer_ranks_whose_heads_overlap(mine, peer_tp):
    tp, rank = mine
    assert tp_map.exchanges(Shard(H, tp, rank), peer_tp) == TABLE[tp, rank, peer_tp]


@pytest.mark.parametrize("prefill_tp,decode_tp", [(1, 1), (2, 2), (2, 1), (1, 2), (4, 2), (2, 4), (4, 1), (1, 4)])
def test_every_head_of_every_block_is_copied_once_and_both_sides_agree_on_it(prefill_tp, decode_tp):
    """Push seen from prefill and pull seen from decode describe the same copies: the
    same global heads, the same slices, and the receiver's count of senders is the
    number of ranks that copy into it."""
    from_prefill, from_decode = set(), set()
    for p in range(prefill_tp):
        for e in tp_map.exchanges(Shard(H, prefill_tp, p), decode_tp):
            from_prefill.add((p, e.peer_rank, _global(Shard(H, prefill_tp, p), e.mine), e.mine, e.theirs))
            writers = tp_map.peer_ranks(decode_tp, e.peer_rank, prefill_tp)  # what decode rank counts
            assert (writers.index(p), len(writers)) == (e.index, e.partners)
    for d in range(decode_tp):
        for e in tp_map.exchanges(Shard(H, decode_tp, d), prefill_tp):
            from_decode.add((e.peer_rank, d, _global(Shard(H, decode_tp, d), e.mine), e.theirs, e.mine))
    assert from_prefill == from_decode
    heads = sorted(head for _, _, heads, _, _ in from_prefill for head in heads)
    assert heads == list(range(H))


def _global(shard: Shard, part: HeadSlice | None) -> tuple[int, ...]:
    first, count = (0, shard.heads) if part is None else (part.first, part.count)
    return tuple(range(shard.first_head + first, shard.first_head + first + count))


def test_a_decode_rank_knows_the_part_each_writer_fills_from_the_notification_alone():
    assert tp_map.partner_slice(0, 1, 2) is None  # one writer: the whole block
    assert [tp_map.partner_slice(i, 2, 4) for i in (0, 1)] == [S(0, 2, 4), S(2, 2, 4)]
    with pytest.raises(ValueError, match="partner 0 of 3"):
        tp_map.partner_slice(0, 3, 4)


@pytest.mark.parametrize("prefill,decode,why", [
    (Shard(4, 2), Shard(4, 3), "decode's TP 3 does not divide the model's 4 KV heads"),
    (Shard(2, 4), Shard(2, 1), "prefill's TP 4 does not divide the model's 2 KV heads"),  # vLLM would replicate
    (Shard(12, 4), Shard(12, 6), "neither TP divides the other (prefill 4, decode 6)"),
    (Shard(4, 2), Shard(8, 1), "prefill's model has 4 KV heads, decode's 8"),
    (Shard(0, 2), Shard(4, 1), "prefill did not say its KV heads"),
    (Shard(4, 1), Shard(0, 2), "decode did not say its KV heads"),
    (Shard(0, 1), Shard(0, 2), "neither said its KV heads: only equal sizes can be paired then"),
    (Shard(4, 0), Shard(4, 1), "must be at least 1"),
])
def test_unsupported_pairs_are_refused_with_a_reason(prefill, decode, why):
    assert why in tp_map.problem(prefill, decode)


def test_a_rank_asked_to_exchange_with_an_unsupported_size_refuses_before_anything_moves():
    with pytest.raises(ValueError, match="neither TP divides the other"):
        tp_map.exchanges(Shard(12, 4, 0), 6)
    with pytest.raises(ValueError, match="does not divide the model's 4 KV heads"):
        tp_map.exchanges(Shard(4, 2, 0), 8)


def test_equal_sizes_pair_whole_blocks_even_when_heads_are_not_known():
    assert tp_map.problem(Shard(0, 2), Shard(0, 2)) is None
    assert tp_map.exchanges(Shard(0, 2, 1), 2) == [Exchange(1, None, None, 0, 1)]


# ---------------------------------------------------------------- vLLM's own mapping


def _vllm(local_tp: int, rank: int, remote_tp: int):
    topology = TransferTopology(tp_rank=rank, tp_size=local_tp, block_size=128, engine_id="local", is_mla=False,
                                is_mamba=False, total_num_kv_heads=H, attn_backends=[])
    return topology, compute_tp_mapping(topology, remote_tp, (FullAttentionSpec,))


@pytest.mark.parametrize("local_tp,remote_tp", [(1, 1), (2, 2), (2, 1), (1, 2), (4, 2), (2, 4), (4, 1), (1, 4)])
def test_the_same_peers_heads_and_reader_counts_as_vllms_nixl_connector(local_tp, remote_tp):
    """vLLM's reading rank (local) and its remote: the ranks it reads, where in the remote
    block its heads are (``rank_offset_factor``, in local blocks), where each remote rank's
    heads go in its own block (``rank_to_attention_slot``, in remote blocks), and how many
    local ranks read one remote rank (``local_consumers``)."""
    for rank in range(local_tp):
        topology, mapping = _vllm(local_tp, rank, remote_tp)
        ours = tp_map.exchanges(Shard(H, local_tp, rank), remote_tp)
        assert [e.peer_rank for e in ours] == list(mapping.all_source_ranks)
        assert [e.peer_rank for e in ours] == topology.handshake_target_ranks(remote_tp)
        local, remote = Shard(H, local_tp).heads, Shard(H, remote_tp).heads
        for e in ours:
            assert (e.theirs.first if e.theirs else 0) == mapping.rank_offset_factor * local
            assert (e.mine.first if e.mine else 0) == mapping.rank_to_attention_slot[e.peer_rank] * remote
            readers = tp_map.peer_ranks(remote_tp, e.peer_rank, local_tp)
            assert len(readers) == mapping.local_consumers
