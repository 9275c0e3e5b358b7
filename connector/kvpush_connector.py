"""kvpush's vLLM KV connector: a thin facade over one role object.

Load it with::

    kv_transfer_config = {
        "kv_connector": "KvpushConnector",
        "kv_connector_module_path": "kvpush.connector.kvpush_connector",
        "kv_role": "kv_producer" (prefill) | "kv_consumer" (decode) | "kv_both",
        "engine_id": "<worker id>",
        "kv_connector_extra_config": msgspec.to_builtins(wire.ConnectorConfig(...)),
        "kv_load_failure_policy": "recompute" | "fail",  # when pushed KV will not come
    }

Per request, ``kv_transfer_params``: ``wire.PrefillKvParams(...).as_params()`` on a
prefill engine, ``wire.DecodeKvParams(...).as_params()`` on a decode engine (in pull
mode with the ``wire.PrefilledKv`` the prefill engine returned).

Scheduler side (``ConnectorScheduler``, in vLLM's scheduler; never blocks):
    on_new_request              decode: start renewing prefill's lease on the prompt's blocks
    get_num_new_matched_tokens  decode: the whole prompt comes from prefill, asynchronously
    update_state_after_alloc    decode: publish the registration (push) or plan the READ (pull)
    build_connector_meta        what the workers do this step: prompts finished, KV to expect or READ
    request_finished            prefill: keep the blocks until the KV left; returns ``PrefilledKv``;
                                decode: where the prompt came from (``ReceivedKv``, for the path report)
    update_connector_output     stop renewing what arrived or was given up; forget what was sent
    has_pending_push_work       prefill: blocks are still held for a transfer
Worker side (``ConnectorWorker``, in each TP rank; its ``Producer`` and/or ``Consumer``):
    register_kv_caches          start the transfer thread (the NIXL agent), subscribe, announce
    start_load_kv               decode: wait for pushed KV, post pull READs
    wait_for_layer_load         no-op: the KV is whole before the request is scheduled
    save_kv_layer               no-op: the push starts once the whole forward pass is done
    wait_for_save               prefill: offer finished prompts to the rendezvous (or hold them for a READ)
    get_transfer_results        blocks that may be freed, waits that ended, loads that failed
    build_connector_worker_meta decode: the waits given up, and verified, this step; prefill: pull digests
    shutdown                    stop the transfer thread

Tensor parallelism: the scheduler side runs once, in the engine core's process, and a
worker side in each rank's process (one process at TP 1, vLLM's in-process executor).
Each rank moves its own KV heads (``kvpush.connector.tp_map``); vLLM's ``KVOutputAggregator``
makes a request's transfer whole only once every rank reported it. Metrics: the engine
core serves its connector's on ``KVPUSH_METRICS_PORT`` + 1 (``engine_metrics_port``); at
TP > 1 rank r's process serves its own on that port + 1 + r, so a launcher reserves
2 + TP ports per engine.
"""

from __future__ import annotations

from typing import Any

import msgspec
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from kvpush.connector.agents import AgentDirectory
from kvpush.connector.bridge import NatsBridge
from kvpush.connector.consumer import Consumer
from kvpush.connector.metadata import KvpushMetadata
from kvpush.connector.producer import Producer
from kvpush.connector.scheduler_side import ConnectorScheduler
from kvpush.connector.worker_side import ConnectorWorker
from kvpush.otel import setup as otel_setup
from kvpush.shared import wire
from kvpush.shared.settings import FaultSettings

SIDES = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "both"}  # kv role -> service name


class KvpushConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        transfer_config = self._kv_transfer_config
        try:
            config = msgspec.convert(transfer_config.kv_connector_extra_config or {}, wire.ConnectorConfig)
        except msgspec.ValidationError as exc:
            raise ValueError(f"KvpushConnector's kv_connector_extra_config: {exc}") from None
        if not config.nats_url:
            raise ValueError("KvpushConnector needs kv_connector_extra_config['nats_url']")
        FaultSettings(lease_s=config.lease_s, kv_wait_s=config.kv_wait_s, quarantine_s=config.quarantine_s)  # checks
        engine_id = transfer_config.engine_id
        tp_size = vllm_config.parallel_config.tensor_parallel_size
        rank = 0
        if role != KVConnectorRole.SCHEDULER:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            rank = get_tensor_model_parallel_rank()
        # The engine core is a process of its own, and so is each rank at TP > 1: their
        # metrics get ports of their own. Named by the worker's role: every kvpush engine
        # runs kv_both (a prefill also reads prefixes it fetches, a decode also lends its own).
        otel_setup.configure(f"kvpush-{config.role or SIDES[transfer_config.kv_role]}-connector",
                             port=_metrics_port(role, tp_size, rank))
        total_heads, heads_per_rank = _kv_heads(vllm_config)
        kv_heads = total_heads if total_heads == heads_per_rank * tp_size else 0  # said only when split evenly
        bridge = NatsBridge.shared(config.nats_url, name=engine_id)
        self._scheduler: ConnectorScheduler | None = None
        self._worker: ConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = ConnectorScheduler(
                engine_id, vllm_config.cache_config.block_size, tp_size, bridge, incarnation=config.incarnation,
                bytes_per_block=_bytes_per_block(kv_cache_config) * total_heads // heads_per_rank,
                kv_heads=kv_heads,
            )
        else:
            self._num_blocks = kv_cache_config.num_blocks if kv_cache_config else None
            agents = AgentDirectory(bridge, rank, service=engine_id)
            producer = consumer = None
            if transfer_config.is_kv_producer:
                producer = Producer(engine_id, rank, tp_size, bridge, agents, lease_s=config.lease_s,
                                    push_by_layer=config.push_by_layer, kv_heads=kv_heads)
            if transfer_config.is_kv_consumer:
                consumer = Consumer(engine_id, rank, tp_size, bridge, agents, kv_wait_s=config.kv_wait_s,
                                    quarantine_s=config.quarantine_s, kv_heads=kv_heads)
            self._worker = ConnectorWorker(engine_id, rank, bridge, agents, producer=producer, consumer=consumer,
                                           incarnation=config.incarnation)

    # ---------------------------------------------------------------- scheduler side

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._scheduler.kv_cache_manager = kv_cache_manager

    def on_new_request(self, request) -> None:
        self._scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request, block_ids)

    def update_connector_output(self, connector_output) -> None:
        self._scheduler.update_connector_output(connector_output)

    def has_pending_push_work(self) -> bool:
        return self._scheduler.has_pending_push_work()

    # ---------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches) -> None:
        num_blocks = self._num_blocks or _num_blocks_of(kv_caches)
        self._worker.register_kv_caches(kv_caches, num_blocks)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvpushMetadata)
        self._worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        meta = self._get_connector_metadata()  # bound before the forward
        assert isinstance(meta, KvpushMetadata)
        self._worker.save_kv_layer(layer_name, meta)

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvpushMetadata)
        self._worker.wait_for_save(meta)

    def get_finished(self, finished_req_ids: set[str]):
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        idle = isinstance(meta, KvpushMetadata) and meta.idle
        sending, receiving, failed = self._worker.get_finished(finished_req_ids, idle=idle)
        return KVConnectorTransferResults(sending, receiving, failed)

    def build_connector_worker_meta(self):
        return self._worker.build_worker_meta()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        otel_setup.shutdown()


def _metrics_port(role: KVConnectorRole, tp_size: int, rank: int) -> int | None:
    """The engine core's port (``engine_metrics_port``), or at TP > 1, for a rank's own
    process, that port + 1 + rank (None: no port set)."""
    port = otel_setup.engine_metrics_port()
    if port is None or role == KVConnectorRole.SCHEDULER or tp_size == 1:
        return port
    return port + 1 + rank


def _kv_heads(vllm_config) -> tuple[int, int]:
    """(the model's KV heads, the heads each rank's blocks hold, as vLLM sizes them: at
    least one, replicated at TP above the model's)."""
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    return model.get_total_num_kv_heads(), max(1, model.get_num_kv_heads(parallel))


def _bytes_per_block(kv_cache_config) -> int:
    """One block's KV over every layer, on one rank (0 if vLLM did not say); the scheduler
    side scales it to all the model's heads (at TP above the KV heads vLLM replicates
    them: the ranks together hold more than one copy moves)."""
    if kv_cache_config is None:
        return 0
    return sum(group.kv_cache_spec.page_size_bytes * len(group.layer_names)
               for group in kv_cache_config.kv_cache_groups)


def _num_blocks_of(kv_caches) -> int:
    tensor = next(iter(kv_caches.values()))
    return int(tensor.shape[0])
