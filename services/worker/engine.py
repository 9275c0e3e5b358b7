"""Build a vLLM AsyncLLM for a prefill or decode worker, with kvpush's connector."""

from __future__ import annotations

import os
from dataclasses import dataclass

# Set before vLLM is imported anywhere in this process.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("UCX_TCP_NODELAY", "y")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


@dataclass
class EngineSettings:
    model: str
    role: str | None  # "prefill", "decode", or None for a plain single instance
    engine_id: str
    nats_url: str | None
    max_model_len: int = 2048
    block_size: int | None = None
    max_num_seqs: int = 16
    dtype: str = "float32"
    tensor_parallel_size: int = 1
    connector: str = "kvpush"  # or vLLM's own: "vllm-nixl" (pull), "vllm-nixl-push"
    faults: "FaultSettings | None" = None


@dataclass
class FaultSettings:
    """How long kvpush's connector waits for a peer before giving blocks up, and what
    decode does when pushed KV will not come (vLLM recomputes the prompt, or fails)."""

    lease_s: float = 10.0  # prefill keeps an unclaimed prompt's blocks this long without a renewal
    kv_wait_s: float = 120.0  # decode gives registered blocks up after this long without the KV
    quarantine_s: float = 10.0  # ...and keeps them this long more unless prefill answers the revoke
    on_kv_failure: str = "recompute"  # or "fail"


VLLM_CONNECTORS = {"vllm-nixl": "NixlConnector", "vllm-nixl-push": "NixlPushConnector"}


def engine_kwargs(settings: EngineSettings) -> dict:
    """Keyword arguments for vLLM's AsyncEngineArgs or LLM; the same for every role, so
    a plain single instance computes exactly what the disaggregated pair computes."""
    kwargs = dict(
        model=settings.model,
        tokenizer=settings.model,
        dtype=settings.dtype,
        enforce_eager=True,
        max_model_len=settings.max_model_len,
        block_size=settings.block_size,
        max_num_seqs=settings.max_num_seqs,
        enable_prefix_caching=False,
        tensor_parallel_size=settings.tensor_parallel_size,
    )
    if settings.role is not None and settings.connector == "kvpush":
        faults = settings.faults or FaultSettings()
        kwargs["kv_transfer_config"] = {
            "kv_connector": "KvpushConnector",
            "kv_connector_module_path": "connector.kvpush_connector",
            "kv_role": "kv_producer" if settings.role == "prefill" else "kv_consumer",
            "engine_id": settings.engine_id,
            "kv_connector_extra_config": {
                "nats_url": settings.nats_url,
                "lease_s": faults.lease_s,
                "kv_wait_s": faults.kv_wait_s,
                "quarantine_s": faults.quarantine_s,
            },
            "kv_load_failure_policy": faults.on_kv_failure,
        }
        kwargs["disable_hybrid_kv_cache_manager"] = True
    elif settings.role is not None:
        # vLLM's own connectors, configured the way their examples run them.
        kwargs["kv_transfer_config"] = {
            "kv_connector": VLLM_CONNECTORS[settings.connector],
            "kv_role": "kv_both",
            "engine_id": settings.engine_id,
        }
    return kwargs


def engine_args(settings: EngineSettings):
    from vllm.engine.arg_utils import AsyncEngineArgs

    return AsyncEngineArgs(**engine_kwargs(settings), disable_log_stats=False)
