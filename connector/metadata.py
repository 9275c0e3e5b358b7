"""What the scheduler-side connector hands the worker side each step, and what it hears back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeVar

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from kvpush.shared.wire import RankKv

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ReadyPrefill:
    """Prefill of this request completes in this step. Push: push its blocks afterwards.
    Pull: keep them until decode's READ notification arrives."""

    request_id: str
    transfer_id: str
    block_ids: list[int]
    traceparent: str = ""
    mode: str = "push"
    num_tokens: int = 0
    decode_engine_id: str = ""  # push: the only decode whose registration may be written to
    transfer_key: str = ""  # the transfer's secret: a registration and a revoke must carry it
    checksum: bool = False  # the scheduler asked for a checksum of its KV (connector/checksums.py)


@dataclass(frozen=True, slots=True)
class ExpectedKv:
    """Decode registered blocks for this request; a producer will WRITE into them."""

    request_id: str
    transfer_id: str
    num_producer_ranks: int  # unused: a decode rank counts the writers its notifications name (tp_map)
    traceparent: str = ""
    prefill_engine_id: str = ""
    registration: bytes = b""  # as published; sent again while the KV has not come
    transfer_key: str = ""  # the producers' notifications are tagged with it
    block_ids: list[int] = field(default_factory=list)  # the blocks registered: the only ones a write may fill
    prefill_incarnation: str = ""  # the prefill engine's start the scheduler chose


@dataclass(frozen=True, slots=True)
class PullRead:
    """Pull: decode allocated ``local_block_ids`` for the prompt's blocks from
    ``first_block`` on (those before it are in decode's prefix cache); READ the prefill's
    blocks (all the prompt's, ``remote_block_ids``, as prefill returned them) into them."""

    request_id: str
    transfer_id: str
    local_block_ids: list[int]
    prefill_engine_id: str
    remote_block_ids: list[int]
    traceparent: str = ""
    transfer_key: str = ""
    prefill_incarnation: str = ""  # read through that start's agent only
    first_block: int = 0
    block_digests: list[str] = field(default_factory=list)  # prefill's, one per prompt block (none: unchecked)
    last_block: int | None = None  # a fetch: read only up to here (the holder's lend holds one block more)
    prefill_tp_size: int = 1  # read our heads from each prefill rank holding some (tp_map)
    head_digests: list[list[str]] = field(default_factory=list)  # prefill's, per prompt block and global KV head

    @property
    def sources(self) -> list[int]:
        return self.remote_block_ids[self.first_block:self.last_block]


@dataclass
class KvpushMetadata(KVConnectorMetadata):
    ready_prefills: list[ReadyPrefill] = field(default_factory=list)
    expected: list[ExpectedKv] = field(default_factory=list)
    reads: list[PullRead] = field(default_factory=list)
    idle: bool = False  # nothing to compute this step: the worker may wait for transfers instead of spinning


@dataclass
class KvpushWorkerMeta(KVConnectorWorkerMetadata):
    """What the worker side tells the scheduler side after a step, one per rank; vLLM's
    ``KVOutputAggregator`` merges the ranks' (``aggregate``) before the scheduler side
    sees them. The scheduler side runs in the engine core's process, and at TP > 1 every
    rank in a process of its own: this is their only way there."""

    given_up: set[str] = field(default_factory=set)  # decode requests whose KV wait was given up: stop renewing
    # decode request -> the ranks whose KV matched prefill's checksum (verified once all did)
    verified: dict[str, int] = field(default_factory=dict)
    load_failures: dict[str, tuple[str, str]] = field(default_factory=dict)  # decode request -> (code, why)
    # prefill, pull: transfer -> rank -> that rank's digests per prompt block and head it holds
    pull_digests: dict[str, dict[int, list[list[str]]]] = field(default_factory=dict)
    # decode request -> rank -> what landed in that rank's blocks (its path report, per rank)
    received: dict[str, dict[int, RankKv]] = field(default_factory=dict)

    def aggregate(self, other: "KvpushWorkerMeta") -> "KvpushWorkerMeta":
        verified = dict(self.verified)
        for request_id, ranks in other.verified.items():
            verified[request_id] = verified.get(request_id, 0) + ranks
        return KvpushWorkerMeta(self.given_up | other.given_up, verified,
                                {**self.load_failures, **other.load_failures},
                                _by_rank(self.pull_digests, other.pull_digests),
                                _by_rank(self.received, other.received))


def _by_rank(mine: dict[str, dict[int, T]], theirs: dict[str, dict[int, T]]) -> dict[str, dict[int, T]]:
    """Two ranks' (or groups of ranks') entries per request or transfer, together."""
    merged = {key: dict(by_rank) for key, by_rank in mine.items()}
    for key, by_rank in theirs.items():
        merged.setdefault(key, {}).update(by_rank)
    return merged
