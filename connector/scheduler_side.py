"""The connector's scheduler side: runs inside vLLM's scheduler, never blocks it.

Push, decode: the moment vLLM allocates blocks for a request whose KV comes from a
prefill instance, publish the registration on NATS (no waiting for prefill, no extra
engine step). Pull, decode: at the same moment, tell the worker side to READ the
prefill's blocks (named in the request's parameters) into them.
Prefill, both modes: tell the worker side, in the step that computes a request's last
prompt token, which blocks hold that prompt, so the push can start right after that
step's forward pass; hold the blocks until the worker reports the KV gone (written,
or read by decode). In pull mode the block ids go back in the output's
kv_transfer_params (``wire.PrefilledKv``) for the scheduler to hand to decode.
Decode, both modes: from the moment the engine receives a request whose KV comes from a
prefill engine (``on_new_request``, even if it then queues) until its KV arrived, its
wait ended or it finished, renew prefill's lease on the prompt's blocks: one
``LeaseRenewal`` per prefill engine every heartbeat, sent from the NATS bridge's loop.

Requests' ``kv_transfer_params`` are ``wire.PrefillKvParams`` / ``wire.DecodeKvParams``.

Tensor parallelism. This side runs once per engine, in the engine core's process; every
rank is its own worker process. It speaks for the engine (its TP size and the model's KV
heads, in registrations and handoffs) and hears the ranks only through vLLM: finished
requests once every rank reported them, and the ranks' worker metas merged
(``KvpushWorkerMeta``): a received prompt is verified only once every rank verified its
heads, its path report says what landed in each rank (``wire.ReceivedKv.by_rank``), and a
pulled prompt's handoff gets every rank's digests (``checksums.HandoffDigests``).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from opentelemetry import trace

from kvpush.connector import checksums
from kvpush.connector.bridge import NatsBridge
from kvpush.connector.leases import Renewals
from kvpush.connector.metadata import ExpectedKv, KvpushMetadata, KvpushWorkerMeta, PullRead, ReadyPrefill
from kvpush.otel import attributes as A
from kvpush.otel.messaging import context_from_traceparent
from kvpush.shared import settings, wire

_tracer = trace.get_tracer("kvpush.connector")
MAX_LOAD_FAILURES = 10_000  # kept until the request computing the prompt again asks (bounded)
RENEWAL_BATCH = 2_000  # transfer ids per LeaseRenewal: ~70 kB, far under NATS's 1 MB default payload

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def prefill_params(params: dict[str, Any] | None) -> wire.PrefillKvParams | None:
    """A request's params if it is a prefill whose KV goes to a decode engine."""
    if not params or "do_remote_decode" not in params:
        return None
    prefill = wire.PrefillKvParams.of(params)
    return prefill if prefill.do_remote_decode else None


def fetch_params(params: dict[str, Any] | None) -> tuple[wire.DecodeKvParams, int] | None:
    """A request's READ of a prefix from another engine's prefix cache (``wire.Fetch``),
    if still to come: the read and the prefix's tokens (whole blocks)."""
    fetch = (params or {}).get(wire.FETCH_KEY)
    if not isinstance(fetch, dict) or not fetch.get("do_remote_prefill"):
        return None
    return wire.DecodeKvParams.of(fetch), int(fetch.get("tokens", 0))


def decode_params(params: dict[str, Any] | None) -> wire.DecodeKvParams | None:
    """A request's params if its KV is still to come from a prefill engine."""
    if not params or "do_remote_prefill" not in params:
        return None
    decode = wire.DecodeKvParams.of(params)
    return decode if decode.do_remote_prefill else None


@dataclass(frozen=True)
class _Received:
    """Decode: where a request's prompt comes from, for its path report."""

    local_tokens: int  # found in our own prefix cache
    tokens: int  # to come from prefill (a fetch: from the engine holding the prefix)
    blocks: int  # the blocks they fill
    holder: str = ""  # a fetch: the engine read from


@dataclass
class _Prefill:
    request: "Request"
    params: wire.PrefillKvParams
    block_ids: list[int] | None = None  # set once announced to the worker side


class ConnectorScheduler:
    def __init__(self, engine_id: str, block_size: int, tp_size: int, bridge: NatsBridge,
                 renew_every_s: float = settings.HEARTBEAT_INTERVAL_S, incarnation: str = "",
                 bytes_per_block: int = 0, kv_heads: int = 0):
        self.engine_id = engine_id
        self.incarnation = incarnation  # the worker's start: registrations are for this process's agents only
        self.block_size = block_size
        self.tp_size = tp_size
        self.kv_heads = kv_heads  # the model's KV heads, all ranks together (0: not known)
        self.bytes_per_block = bytes_per_block  # of every layer, all ranks: what one block's transfer moves
        self.bridge = bridge
        self.kv_cache_manager: "KVCacheManager | None" = None
        self._prefills: dict[str, _Prefill] = {}  # prefill side, do_remote_decode requests
        self._expected: list[ExpectedKv] = []  # decode side, push: for the next metadata
        self._reads: list[PullRead] = []  # decode side, pull: for the next metadata
        self._awaiting_send: set[str] = set()  # prefill requests whose blocks we hold
        self._received: dict[str, _Received] = {}  # decode: requests whose KV comes from prefill
        self._fetched: dict[str, _Received] = {}  # requests whose prefix is read from another engine's cache
        self._verified: dict[str, int] = {}  # of those, how many ranks' KV matched prefill's checksum
        self._landed: dict[str, dict[int, wire.RankKv]] = {}  # of those, what landed in each rank that said
        self._handoff_digests = checksums.HandoffDigests(tp_size)  # prefill, pull: the ranks' digests
        self._load_failures: dict[str, tuple[str, str]] = {}  # request -> (code, why) its load failed
        self._renewals = Renewals()  # decode side: transfers whose prefill blocks we still want
        self._renewals_lock = threading.Lock()  # protects _renewals (vLLM's scheduler thread and the bridge's)
        bridge.every(renew_every_s, self._lease_renewals)

    # ---------------------------------------------------------------- both sides

    def on_new_request(self, request: "Request") -> None:
        params = decode_params(request.kv_transfer_params)
        fetch = fetch_params(request.kv_transfer_params)
        if fetch is not None:  # the holder keeps the prefix's blocks while we renew its lease
            params = fetch[0]
        if params is not None:
            with self._renewals_lock:
                self._renewals.start(request.request_id, params.transfer_id, params.prefill_engine_id)

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int):
        if decode_params(request.kv_transfer_params) is not None:
            count = len(request.prompt_token_ids or ()) - num_computed_tokens
            if count > 0:
                return count, True
        fetch = fetch_params(request.kv_transfer_params)
        if fetch is not None:
            count = fetch[1] - num_computed_tokens
            if count > 0:
                return count, True
            self._stop_renewing([request.request_id])  # our own cache holds it: the holder's lease runs out
        return 0, False

    def update_state_after_alloc(
        self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int
    ) -> None:
        params = request.kv_transfer_params
        if not params:
            return
        prefill = prefill_params(params)
        if prefill is not None and request.request_id not in self._prefills:
            self._prefills[request.request_id] = _Prefill(request, prefill)
        fetch = fetch_params(params)
        if fetch is not None and num_external_tokens > 0:
            read, tokens = fetch
            first_block, block_ids = self._destinations(request, blocks, num_external_tokens, tokens)
            self._fetched[request.request_id] = _Received(first_block * self.block_size, num_external_tokens,
                                                          len(block_ids), holder=read.prefill_engine_id)
            self._read(request, first_block, block_ids, read, last_block=tokens // self.block_size)
            params[wire.FETCH_KEY]["do_remote_prefill"] = False  # a re-entry must not read again
        decode = decode_params(params)
        if decode is not None and num_external_tokens > 0:
            first_block, block_ids = self._destinations(request, blocks, num_external_tokens)
            self._received[request.request_id] = _Received(first_block * self.block_size, num_external_tokens,
                                                           len(block_ids))
            if decode.mode == "pull":
                self._read(request, first_block, block_ids, decode)
            else:
                self._register(request, first_block, block_ids, decode)
            params["do_remote_prefill"] = False  # a re-entry must not register again

    def _destinations(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int,
                      end_tokens: int | None = None) -> tuple[int, list[int]]:
        """The prompt's blocks the KV is to fill: after the prefix our own cache holds
        (``get_num_new_matched_tokens`` asked for everything after it up to ``end_tokens``,
        the whole prompt unless a fetch's prefix, and a cache hit is whole blocks). Cached
        blocks are shared with other requests: never a destination."""
        num_tokens = len(request.prompt_token_ids or ()) if end_tokens is None else end_tokens
        local_tokens = num_tokens - num_external_tokens
        if local_tokens % self.block_size:
            raise RuntimeError(f"a local prefix of {local_tokens} tokens is not whole blocks of {self.block_size}")
        first_block = local_tokens // self.block_size
        prompt_blocks = blocks.blocks[0][first_block:blocks_for(num_tokens, self.block_size)]
        taken = [block.block_id for block in prompt_blocks if block.block_hash is not None or block.ref_cnt != 1]
        if taken:  # vLLM allocates fresh blocks after a hit and caches them only once loaded
            raise RuntimeError(f"blocks {taken} hold cached or shared KV: they cannot receive a transfer")
        return first_block, [block.block_id for block in prompt_blocks]

    def _read(self, request: "Request", first_block: int, block_ids: list[int],
              params: wire.DecodeKvParams, last_block: int | None = None) -> None:
        self._reads.append(
            PullRead(
                request_id=request.request_id,
                transfer_id=params.transfer_id,
                local_block_ids=block_ids,
                first_block=first_block,
                prefill_engine_id=params.prefill_engine_id,
                remote_block_ids=list(params.remote_block_ids),  # what prefill's request_finished returned
                block_digests=list(params.block_digests),
                head_digests=[list(row) for row in params.head_digests],
                prefill_tp_size=params.prefill_tp_size,
                traceparent=params.traceparent,
                transfer_key=params.transfer_key,
                prefill_incarnation=params.prefill_incarnation,
                last_block=last_block,
            )
        )

    def _register(self, request: "Request", first_block: int, block_ids: list[int],
                  params: wire.DecodeKvParams) -> None:
        num_tokens = len(request.prompt_token_ids or ())
        registration = wire.Registration(
            transfer_id=params.transfer_id,
            request_id=params.request_id,
            decode_engine_id=self.engine_id,
            decode_request_id=request.request_id,
            decode_tp_size=self.tp_size,
            block_ids=block_ids,
            first_block=first_block,
            num_tokens=num_tokens,
            registered_at=time.time(),
            transfer_key=params.transfer_key,
            decode_incarnation=self.incarnation,
            kv_heads=self.kv_heads,
        )
        with _tracer.start_as_current_span(
            A.KV_REGISTER,
            context=context_from_traceparent(params.traceparent),
            attributes={
                A.REQUEST_ID: registration.request_id,
                A.TRANSFER_ID: registration.transfer_id,
                A.WORKER_ID: self.engine_id,
                A.BLOCKS: len(registration.block_ids),
            },
        ):
            body = wire.encode(registration)
            self.bridge.publish(wire.registration_subject(params.prefill_engine_id, self.engine_id), body)
        self._expected.append(
            ExpectedKv(request.request_id, params.transfer_id, params.prefill_tp_size, params.traceparent,
                       params.prefill_engine_id, body, params.transfer_key, registration.block_ids,
                       params.prefill_incarnation)
        )

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KvpushMetadata:
        meta = KvpushMetadata(
            expected=self._expected, reads=self._reads, idle=scheduler_output.total_num_scheduled_tokens == 0
        )
        self._expected, self._reads = [], []
        scheduled = scheduler_output.num_scheduled_tokens
        for request_id, prefill in self._prefills.items():
            if prefill.block_ids is not None or request_id not in scheduled:
                continue
            request = prefill.request
            # num_computed_tokens is not advanced until after this call.
            if request.num_computed_tokens + scheduled[request_id] < request.num_prompt_tokens:
                continue
            (block_ids,) = self.kv_cache_manager.get_block_ids(request_id)[:1]
            needed = blocks_for(request.num_prompt_tokens, self.block_size)
            prefill.block_ids = list(block_ids[:needed])
            meta.ready_prefills.append(
                ReadyPrefill(request_id, prefill.params.transfer_id, prefill.block_ids, prefill.params.traceparent,
                             prefill.params.mode, request.num_prompt_tokens, prefill.params.decode_engine_id,
                             prefill.params.transfer_key, prefill.params.checksum)
            )
        return meta

    def request_finished(self, request: "Request", block_ids: list[int]):
        """Prefill: keep the prompt's blocks until its KV left, and say where they are.
        Decode: say where the prompt came from (``wire.RECEIVED_KEY``, for the path
        report); vLLM passes both on in the request's last output."""
        self._stop_renewing([request.request_id])
        fetched = self._fetched_params(request.request_id)
        recompute_of = (request.kv_transfer_params or {}).get(wire.RECOMPUTE_OF_KEY)
        if isinstance(recompute_of, str):  # decode computed the prompt itself: why its KV did not come
            code, why = self._pop_load_failure(recompute_of)
            return False, {wire.LOAD_FAILURE_KEY: {"code": code, "reason": why}}
        received = self._received.pop(request.request_id, None)
        if received is not None:
            verified = self._verified.pop(request.request_id, 0) >= self.tp_size  # every rank checked its heads
            landed = self._landed.pop(request.request_id, {})
            return False, {wire.RECEIVED_KEY: wire.ReceivedKv(
                local_tokens=received.local_tokens, tokens=received.tokens, blocks=received.blocks,
                bytes=received.blocks * self.bytes_per_block,
                checksum="verified" if verified else "unchecked",
                by_rank=[landed[rank] for rank in sorted(landed)]).as_params()}
        prefill = self._prefills.pop(request.request_id, None)
        if prefill is None or prefill.block_ids is None:
            return False, fetched or None
        # Blocks stay ours (every rank's) until the workers report the KV gone (get_finished).
        self._awaiting_send.add(request.request_id)
        handoff = fetched | wire.PrefilledKv(
            transfer_id=prefill.params.transfer_id, prefill_engine_id=self.engine_id,
            prefill_tp_size=self.tp_size, kv_heads=self.kv_heads,  # each rank holds its share of the heads
            remote_block_ids=prefill.block_ids, prefill_incarnation=self.incarnation,
        ).as_params()
        if prefill.params.checksum and prefill.params.mode == "pull":  # the ranks' digests fill it (checksums.py)
            self._handoff_digests.handed(prefill.params.transfer_id, handoff)
        return True, handoff

    def _fetched_params(self, request_id: str) -> dict[str, Any]:
        """What came of the request's fetch, for its last output (``wire.FETCHED_KEY``):
        nothing read if its load failed (vLLM then computed those tokens)."""
        fetched = self._fetched.pop(request_id, None)
        if fetched is None:
            return {}
        failure = self._load_failures.pop(request_id, None)
        return {wire.FETCHED_KEY: wire.FetchedKv(
            tokens=0 if failure else fetched.tokens, blocks=0 if failure else fetched.blocks,
            holder_engine_id=fetched.holder, asked_tokens=fetched.tokens, failure=f"{failure[0]}: {failure[1]}" if failure else "").as_params()}

    def _pop_load_failure(self, engine_request_id: str) -> tuple[str, str]:
        """Why the load of the worker's ``engine_request_id`` failed (vLLM's own id for it
        adds "-" and 8 random characters)."""
        for request_id in self._load_failures:
            if request_id == engine_request_id or request_id.rpartition("-")[0] == engine_request_id:
                return self._load_failures.pop(request_id)
        return "kv_load_failed", ""

    def update_connector_output(self, connector_output) -> None:
        self._stop_renewing(connector_output.finished_recving or ())
        worker_meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(worker_meta, KvpushWorkerMeta):
            self._stop_renewing(worker_meta.given_up)  # decode gave up the wait: let prefill's lease run out
            for request_id, ranks in worker_meta.verified.items():
                if request_id in self._received:
                    self._verified[request_id] = self._verified.get(request_id, 0) + ranks
            for request_id, by_rank in worker_meta.received.items():  # before request_finished: it ran on them
                if request_id in self._received:
                    self._landed.setdefault(request_id, {}).update(by_rank)
            for transfer_id, by_rank in worker_meta.pull_digests.items():  # after request_finished: vLLM's order
                self._handoff_digests.arrived(transfer_id, by_rank)
            for request_id, failure in worker_meta.load_failures.items():  # for the request recomputing it
                self._load_failures[request_id] = failure
            while len(self._load_failures) > MAX_LOAD_FAILURES:
                del self._load_failures[next(iter(self._load_failures))]
        for request_id in connector_output.finished_sending or ():
            self._awaiting_send.discard(request_id)

    def has_pending_push_work(self) -> bool:
        return bool(self._awaiting_send)

    # ---------------------------------------------------------------- lease renewals

    def _stop_renewing(self, request_ids) -> None:
        with self._renewals_lock:
            self._renewals.stop(request_ids)

    def _lease_renewals(self) -> list[tuple[str, bytes]]:
        """On the bridge's loop, every heartbeat: renewals for each prefill engine, at most
        RENEWAL_BATCH transfer ids in one (a renewal must stay under the payload limit)."""
        with self._renewals_lock:
            due = self._renewals.by_prefill()
        return [
            (wire.registration_subject(prefill_engine_id, self.engine_id),
             wire.encode(wire.LeaseRenewal(decode_engine_id=self.engine_id,
                                           transfer_ids=transfer_ids[start:start + RENEWAL_BATCH])))
            for prefill_engine_id, transfer_ids in due.items()
            for start in range(0, len(transfer_ids), RENEWAL_BATCH)
        ]
