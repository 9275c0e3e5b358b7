"""Tensor parallelism across the split: which ranks of the other engine a rank copies KV
with, and which heads of each block.

Pure Python: no NATS, NIXL, vLLM or torch. A model has ``kv_heads`` KV heads; an engine
at tensor-parallel size ``tp`` gives rank r heads ``[r * h, (r + 1) * h)``, with
``h = kv_heads / tp``, and each of its blocks holds those heads, one after another (the
CPU layout, ``kvpush.connector.kv_layout``). Two engines exchange KV rank by rank: a rank
copies with every rank of the other engine whose heads overlap its own, and the overlap
is one run of heads inside each side's block (``block_ranges.HeadSlice``):

- equal TP: rank r with rank r, whole blocks (what kvpush did at TP 1, unchanged);
- prefill TP 2, decode TP 1: both prefill ranks write (push) into decode rank 0, each
  into its half of every block; decode rank 0 reads (pull) both;
- prefill TP 1, decode TP 2: prefill rank 0 writes half of every block to each decode
  rank; each decode rank reads its half of prefill's block.

Who waits for whom. A copy's receiver counts the notifications of the ranks that copy
into it (``Exchange.partners``): push, a decode rank waits for its writers; pull, a
prefill rank frees its blocks after its readers. Each notification names the sender's
place among them (``Exchange.index``). vLLM's ``KVOutputAggregator`` then makes the
request whole only when every rank of the engine reported it.

Supported: both TPs divide ``kv_heads`` and one TP divides the other, as vLLM's
NixlConnector requires (``TransferTopology.tp_ratio``). A rank holding fewer than one
head (TP above ``kv_heads``, where vLLM replicates KV) is refused, and so is a pair
of sizes that do not divide: ``problem`` says why, before anything moves.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpush.connector.block_ranges import HeadSlice


@dataclass(frozen=True, slots=True)
class Shard:
    """One rank's part of the model's KV heads. ``kv_heads`` 0: not known (an engine
    that says nothing of its heads: only an equal TP can be paired with it)."""

    kv_heads: int
    tp_size: int = 1
    rank: int = 0

    @property
    def heads(self) -> int:
        """The KV heads in each of this rank's blocks (0 if not known)."""
        return self.kv_heads // self.tp_size

    @property
    def first_head(self) -> int:
        return self.rank * self.heads


@dataclass(frozen=True, slots=True)
class Exchange:
    """What one rank copies with one rank of the other engine: ``mine`` of each of its
    blocks is ``theirs`` of the peer's (None: the whole block). ``index`` is this rank's
    place among the ``partners``, the ranks of its engine that exchange with that peer rank
    (sorted by rank)."""

    peer_rank: int
    mine: HeadSlice | None
    theirs: HeadSlice | None
    index: int = 0
    partners: int = 1


def problem(prefill: Shard, decode: Shard, names: tuple[str, str] = ("prefill", "decode")) -> str | None:
    """Why a prefill engine and a decode engine cannot exchange KV rank by rank, or None
    (``names``: what to call the two in the answer)."""
    p, d = prefill.tp_size, decode.tp_size
    first, second = names
    if p < 1 or d < 1:
        return f"tensor-parallel sizes must be at least 1 ({first} {p}, {second} {d})"
    if prefill.kv_heads and decode.kv_heads and prefill.kv_heads != decode.kv_heads:
        return f"{first}'s model has {prefill.kv_heads} KV heads, {second}'s {decode.kv_heads}"
    if p == d:
        return None
    heads = prefill.kv_heads or decode.kv_heads
    if not (prefill.kv_heads and decode.kv_heads):
        silent = "neither said its" if not heads else f"{second if prefill.kv_heads else first} did not say its"
        return f"{first} runs TP {p} and {second} TP {d}, and {silent} KV heads: only equal sizes can be paired then"
    for side, tp in ((first, p), (second, d)):
        if heads % tp:
            return f"{side}'s TP {tp} does not divide the model's {heads} KV heads"
    if max(p, d) % min(p, d):
        return f"neither TP divides the other ({first} {p}, {second} {d})"
    return None


def peer_ranks(tp_size: int, rank: int, peer_tp_size: int) -> list[int]:
    """The ranks of an engine at ``peer_tp_size`` whose heads overlap ``rank``'s (any
    head count both sizes divide): the one holding them when the peer has fewer ranks,
    the consecutive ones sharing them when it has more."""
    if tp_size >= peer_tp_size:
        return [rank * peer_tp_size // tp_size]
    ratio = peer_tp_size // tp_size
    return list(range(rank * ratio, (rank + 1) * ratio))


def answering_ranks(tp_size: int, rank: int, peer_tp_size: int) -> list[int]:
    """The peer ranks whose answers about a transfer this rank waits for: those it
    exchanges with, or every one for sizes that do not divide each other (each peer rank
    refuses such a pair, and answers so)."""
    if max(tp_size, peer_tp_size) % min(tp_size, peer_tp_size):
        return list(range(peer_tp_size))
    return peer_ranks(tp_size, rank, peer_tp_size)


def exchanges(me: Shard, peer_tp_size: int) -> list[Exchange]:
    """Every rank of the peer engine ``me`` copies KV with, and which heads. Equal sizes
    pair rank r with rank r whole, whether heads are known or not; other sizes need
    ``me.kv_heads`` (checked with ``problem`` first; raises ValueError if unsupported)."""
    if peer_tp_size == me.tp_size:
        return [Exchange(me.rank, None, None)]
    peer = Shard(me.kv_heads, peer_tp_size)
    why = problem(me, peer, ("this engine", "the peer"))
    if why is not None:
        raise ValueError(why)
    found = []
    for peer_rank in peer_ranks(me.tp_size, me.rank, peer_tp_size):
        other = Shard(me.kv_heads, peer_tp_size, peer_rank)
        start = max(me.first_head, other.first_head)
        count = min(me.first_head + me.heads, other.first_head + other.heads) - start
        partners = peer_ranks(peer_tp_size, peer_rank, me.tp_size)
        found.append(Exchange(peer_rank, _slice(start - me.first_head, count, me.heads),
                              _slice(start - other.first_head, count, other.heads),
                              partners.index(me.rank), len(partners)))
    return found


def partner_slice(index: int, partners: int, heads: int) -> HeadSlice | None:
    """Of a rank with ``heads`` per block, the part that partner ``index`` of ``partners``
    fills: a decode rank's part written by each of its writers, without knowing prefill's
    TP (a lone partner fills the whole block). Raises ValueError if ``partners`` does not
    divide ``heads``."""
    if partners == 1:
        return None
    if heads <= 0 or heads % partners or not 0 <= index < partners:
        raise ValueError(f"partner {index} of {partners} cannot fill a part of {heads} heads")
    share = heads // partners
    return HeadSlice(index * share, share, heads)


def _slice(first: int, count: int, of: int) -> HeadSlice | None:
    return None if (first, count) == (0, of) else HeadSlice(first, count, of)
