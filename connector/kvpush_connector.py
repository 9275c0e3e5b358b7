"""kvpush's vLLM KV connector: a thin facade over one role object.

Load it with::

    kv_transfer_config = {
        "kv_connector": "KvpushConnector",
        "kv_connector_module_path": "connector.kvpush_connector",
        "kv_role": "kv_producer" (prefill) | "kv_consumer" (decode),
        "engine_id": "<worker id>",
        "kv_connector_extra_config": {"nats_url": "nats://127.0.0.1:4222",
                                      # optional, seconds: see connector.worker_side
                                      "lease_s": 10, "kv_wait_s": 120, "quarantine_s": 10},
        "kv_load_failure_policy": "recompute" | "fail",  # when pushed KV will not come
    }

Per request, ``kv_transfer_params``:
    prefill: {"do_remote_decode": True, "transfer_id": ...}
    decode:  {"do_remote_prefill": True, "transfer_id": ..., "prefill_engine_id": ...,
              "prefill_tp_size": 1}

Scheduler side (ConnectorScheduler): get_num_new_matched_tokens, update_state_after_alloc
(decode publishes its registration here), build_connector_meta, request_finished
(prefill keeps blocks until pushed), update_connector_output, has_pending_push_work.
Worker side (ConnectorWorker): register_kv_caches (starts the transfer thread),
start_load_kv (decode learns what to expect), wait_for_save (prefill offers finished
prompts to the rendezvous), get_transfer_results (also the loads that failed), shutdown. Per-layer hooks are no-ops: the
push starts once the whole forward pass is done.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from connector.bridge import NatsBridge
from connector.metadata import KvpushMetadata
from connector.scheduler_side import ConnectorScheduler
from connector.worker_side import ConnectorWorker
from otel import setup as otel_setup


class KvpushConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        transfer_config = self._kv_transfer_config
        extra = transfer_config.kv_connector_extra_config or {}
        nats_url = extra.get("nats_url")
        if not nats_url:
            raise ValueError("KvpushConnector needs kv_connector_extra_config['nats_url']")
        engine_id = transfer_config.engine_id
        side = "prefill" if transfer_config.is_kv_producer else "decode"
        otel_setup.configure(f"kvpush-{side}-connector")
        tp_size = vllm_config.parallel_config.tensor_parallel_size
        bridge = NatsBridge.shared(nats_url, name=f"{engine_id}-connector")
        self._scheduler: ConnectorScheduler | None = None
        self._worker: ConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = ConnectorScheduler(
                engine_id, vllm_config.cache_config.block_size, tp_size, bridge
            )
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self._num_blocks = kv_cache_config.num_blocks if kv_cache_config else None
            self._worker = ConnectorWorker(
                engine_id,
                get_tensor_model_parallel_rank(),
                tp_size,
                transfer_config.is_kv_producer,
                bridge,
                lease_s=float(extra.get("lease_s", 10.0)),
                kv_wait_s=float(extra.get("kv_wait_s", 120.0)),
                quarantine_s=float(extra.get("quarantine_s", 10.0)),
            )

    # ---------------------------------------------------------------- scheduler side

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._scheduler.kv_cache_manager = kv_cache_manager

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
        return None

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

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        otel_setup.shutdown()


def _num_blocks_of(kv_caches) -> int:
    tensor = next(iter(kv_caches.values()))
    return int(tensor.shape[0])
