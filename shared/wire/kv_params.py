"""The worker service <-> kvpush's connector, inside one worker: no NATS between them.

vLLM carries a connector's per-request parameters as a dict (``kv_transfer_params``). The
worker service writes them and kvpush's connector reads them back: these types are that
contract. ``as_params()`` gives the dict vLLM wants; ``of(params)`` reads one. The keys
below name what travels in a request's other dicts (its last output's
``kv_transfer_params``, its ``SamplingParams.extra_args``); ``ConnectorConfig`` is the
connector's own configuration, and ``engine_wake_address`` the socket on which the worker
wakes it.

Pure: imports no NATS.
"""

from __future__ import annotations

import hashlib
from typing import Any, ClassVar

import msgspec

from kvpush.shared.connector_kinds import TransferMode
from kvpush.shared.wire.public import KvChecksum, RankKv


class _KvParams(msgspec.Struct, kw_only=True):
    # Fields left out of ``as_params`` while empty: added later, so that the dict a peer
    # gets is the one it got before them unless they say something.
    omitted_when_empty: ClassVar[tuple[str, ...]] = ()

    def as_params(self) -> dict[str, Any]:
        params = msgspec.to_builtins(self)
        for name in self.omitted_when_empty:
            if not params.get(name):
                params.pop(name, None)
        return params

    @classmethod
    def of(cls, params: dict[str, Any]):
        return msgspec.convert(params, cls)


class PrefillKvParams(_KvParams, kw_only=True):
    """A prefill request on a kvpush engine: keep the prompt's blocks for ``transfer_id``."""

    do_remote_decode: bool = True
    transfer_id: str
    mode: TransferMode = "push"
    decode_engine_id: str = ""  # push: the only decode whose registration may be written to
    traceparent: str = ""
    transfer_key: str = ""
    checksum: bool = False  # send a checksum of the KV with it (connector/checksums.py)


class PrefilledKv(_KvParams, kw_only=True):
    """What a kvpush prefill engine returns for a finished prompt (``request_finished``):
    where its blocks are, for a pull-mode decode to READ."""

    transfer_id: str
    prefill_engine_id: str
    prefill_tp_size: int
    remote_block_ids: list[int]
    prefill_incarnation: str = ""  # read through this start's agents only
    block_digests: list[str] = msgspec.field(default_factory=list)  # one checksum per block (from TP-1 peers)
    kv_heads: int = 0  # the model's KV heads, all ranks together (0: not said)
    # When asked for: one checksum per prompt block and KV head (global index), over that
    # head's bytes in every layer, so a decode at any TP checks the heads it holds.
    head_digests: list[list[str]] = msgspec.field(default_factory=list)


class DecodeKvParams(_KvParams, kw_only=True):
    """A decode request on a kvpush engine: the prompt's KV comes from ``prefill_engine_id``
    (pushed into the blocks we register, or, in pull mode, read from ``remote_block_ids``)."""

    do_remote_prefill: bool = True
    transfer_id: str
    request_id: str
    prefill_engine_id: str
    prefill_tp_size: int = 1
    mode: TransferMode = "push"
    remote_block_ids: list[int] = msgspec.field(default_factory=list)
    prefill_incarnation: str = ""
    traceparent: str = ""
    transfer_key: str = ""
    block_digests: list[str] = msgspec.field(default_factory=list)  # pull: prefill's checksums of its blocks
    head_digests: list[list[str]] = msgspec.field(default_factory=list)  # pull: the same per block and KV head

    omitted_when_empty: ClassVar[tuple[str, ...]] = ("head_digests",)


RECEIVED_KEY = "kvpush_received"  # a decode request's last output's kv_transfer_params: ReceivedKv
# Decode computing a prompt whose KV did not come names the failed engine request (a
# request's kv_transfer_params); its last output says why that load failed ({code, reason}).
RECOMPUTE_OF_KEY = "kvpush_recompute_of"
LOAD_FAILURE_KEY = "kvpush_load_failure"
# A migrated request's SamplingParams.extra_args: the tokens its client already has, which
# the engine replays as its first outputs (kvpush.services.worker.replay).
REPLAY_KEY = "kvpush_replay"
# A request that first READs a prefix from another engine's cache (``Fetch``): its
# kv_transfer_params carry the read (a DecodeKvParams) under FETCH_KEY, and its last output
# what came (a FetchedKv) under FETCHED_KEY.
FETCH_KEY = "kvpush_fetch"
FETCHED_KEY = "kvpush_fetched"


class ReceivedKv(_KvParams, kw_only=True):
    """What a kvpush decode engine returns for a finished request whose KV came from a
    prefill engine (``request_finished``, under ``RECEIVED_KEY``): where its prompt came
    from, for the path report."""

    local_tokens: int  # found in this engine's prefix cache
    tokens: int  # received from prefill
    blocks: int  # the blocks they filled
    bytes: int  # the bytes written (read) into them
    checksum: KvChecksum = "unchecked"  # verified: equal to prefill's checksum before the request ran
    by_rank: list[RankKv] = msgspec.field(default_factory=list)  # each rank's part, as the ranks said (rank order)


class FetchedKv(_KvParams, kw_only=True):
    """What came of a request's fetch (under ``FETCHED_KEY``): the tokens read from the
    holder into our blocks (0: the read failed and the engine computed them)."""

    tokens: int
    blocks: int
    holder_engine_id: str
    asked_tokens: int = 0  # the tokens asked of the holder (vLLM counts them as cache hits, read or not)
    failure: str = ""  # why the read failed, when it did


class ConnectorConfig(msgspec.Struct, kw_only=True):
    """kvpush's connector's ``kv_connector_extra_config``; the timing defaults are
    ``kvpush.shared.settings.FaultSettings``'s."""

    nats_url: str
    lease_s: float
    kv_wait_s: float
    quarantine_s: float
    incarnation: str = ""  # the worker's start: carried by this engine's agents and registrations
    push_by_layer: bool = False  # prefill: write each layer's KV as the forward finishes it (connector/layer_writes.py)
    role: str = ""  # the worker's (prefill, decode): its connector's service name; every kvpush engine is kv_both


def engine_wake_address(engine_id: str, incarnation: str, rank: int) -> bytes:
    """The local datagram socket (Linux abstract namespace) on which a worker tells its
    engine's connector rank that a request was handed to the engine. Not NATS: the worker
    and its engine share a host, and the wake must beat the request into the engine.
    Unique per engine start, so that two stacks on one host never share one."""
    digest = hashlib.sha256(f"{engine_id}\0{incarnation}\0{rank}".encode()).hexdigest()[:32]
    return b"\0kvpush-wake-" + digest.encode()
