"""The worker's side of vLLM: engine settings and arguments, what each KV connector wants
in a request (engine request id, ``kv_transfer_params``), the engine's load (from vLLM's
stat logger hook) and its per-request stage times (as child spans)."""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass

import msgspec

from shared import settings, wire
from shared.settings import FaultSettings

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
    max_model_len: int = settings.MAX_MODEL_LEN
    block_size: int | None = None
    max_num_seqs: int = 16
    dtype: str = "float32"
    tensor_parallel_size: int = 1
    connector: str = settings.CONNECTOR  # or vLLM's own: "vllm-nixl" (pull), "vllm-nixl-push"
    faults: FaultSettings = settings.FAULTS
    incarnation: str = ""  # the worker's start, carried by its connector's agents and registrations
    prefix_caching: bool = settings.PREFIX_CACHING == "on"
    kv_events_endpoint: str | None = None  # where the engine publishes its KV cache events (cache_relay)


VLLM_CONNECTORS = {"vllm-nixl": "NixlConnector", "vllm-nixl-push": "NixlPushConnector"}


def engine_kwargs(engine: EngineSettings) -> dict:
    """Keyword arguments for vLLM's AsyncEngineArgs or LLM; the same for every role, so
    a plain single instance computes exactly what the disaggregated pair computes."""
    kwargs = dict(
        model=engine.model,
        tokenizer=engine.model,
        dtype=engine.dtype,
        enforce_eager=True,
        max_model_len=engine.max_model_len,
        block_size=engine.block_size,
        max_num_seqs=engine.max_num_seqs,
        enable_prefix_caching=engine.prefix_caching,
        tensor_parallel_size=engine.tensor_parallel_size,
    )
    if engine.role is not None and engine.connector == "kvpush":
        faults = engine.faults
        connector_config = wire.ConnectorConfig(nats_url=engine.nats_url, lease_s=faults.lease_s,
                                                kv_wait_s=faults.kv_wait_s, quarantine_s=faults.quarantine_s,
                                                incarnation=engine.incarnation)
        kwargs["kv_transfer_config"] = {
            "kv_connector": "KvpushConnector",
            "kv_connector_module_path": "connector.kvpush_connector",
            "kv_role": "kv_producer" if engine.role == "prefill" else "kv_consumer",
            "engine_id": engine.engine_id,
            "kv_connector_extra_config": msgspec.to_builtins(connector_config),
            "kv_load_failure_policy": faults.on_kv_failure,
        }
        kwargs["disable_hybrid_kv_cache_manager"] = True
    elif engine.role is not None:
        # vLLM's own connectors, configured the way their examples run them.
        kwargs["kv_transfer_config"] = {
            "kv_connector": VLLM_CONNECTORS[engine.connector],
            "kv_role": "kv_both",
            "engine_id": engine.engine_id,
        }
    return kwargs


def engine_args(engine: EngineSettings):
    from vllm.engine.arg_utils import AsyncEngineArgs

    kwargs = engine_kwargs(engine)
    if engine.tensor_parallel_size == 1:
        # One worker, in the engine-core process, as vLLM runs one GPU: on CPU vLLM would
        # otherwise put it in a process of its own, and the two busy-poll the shared-memory
        # queue between them (~1 CPU-s/s while requests only wait for KV). The engine core
        # itself still runs in a process apart from this one (AsyncLLM).
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        kwargs["distributed_executor_backend"] = "uni"
    if engine.kv_events_endpoint is not None:
        from vllm.config import KVEventsConfig

        from services.worker.cache_relay import kv_events_config

        kwargs["kv_events_config"] = KVEventsConfig(**kv_events_config(engine.kv_events_endpoint))
    return AsyncEngineArgs(**kwargs, disable_log_stats=False)


def wake_engine(engine: EngineSettings) -> None:
    """Tell the engine's kvpush connector that a request is being handed to the engine: an
    engine whose requests only wait for transfers sits in a long wait (see
    ``connector.engine_wake``). Costs a datagram; a missing listener is not an error."""
    if engine.role is None or engine.connector != "kvpush":
        return
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sender:
        sender.setblocking(False)
        for rank in range(engine.tensor_parallel_size):
            try:
                sender.sendto(b"\0", wire.engine_wake_address(engine.engine_id, engine.incarnation, rank))
            except OSError:
                pass


# --------------------------------------------------------------------------- requests
# What each connector wants in an engine request. kvpush's connector reads the
# ``shared.wire`` kv-params structs; vLLM's are driven the way its examples drive them:
# prefill and decode share the request id (the transfer id), and decode gets the
# prefill's address (push) or what the prefill engine returned (pull), verbatim.

def prefill_request(connector: str, job: wire.PrefillJob, traceparent: str) -> tuple[str, dict]:
    """(engine request id, kv_transfer_params) for a prefill job."""
    if connector != "kvpush":
        return job.transfer_id, {"do_remote_decode": True}
    params = wire.PrefillKvParams(transfer_id=job.transfer_id, mode=job.mode, decode_engine_id=job.decode_engine_id,
                                  traceparent=traceparent, transfer_key=job.transfer_key)
    return f"{job.request_id}-p-{job.transfer_id[:8]}", params.as_params()


def decode_request(connector: str, job: wire.DecodeJob, traceparent: str) -> tuple[str, dict]:
    """(engine request id, kv_transfer_params) for a decode job."""
    if job.mode == "local":
        return f"{job.request_id}-l-{job.transfer_id[:8]}", {}
    if connector == "vllm-nixl-push":
        return job.transfer_id, {"do_remote_prefill": True, "remote_request_id": job.transfer_id,
                                 **job.kv_transfer_params}
    if connector != "kvpush":
        return job.transfer_id, dict(job.kv_transfer_params)
    params = wire.DecodeKvParams(transfer_id=job.transfer_id, request_id=job.request_id,
                                 prefill_engine_id=job.prefill_engine_id, mode=job.mode, traceparent=traceparent,
                                 transfer_key=job.transfer_key, prefill_incarnation=job.prefill_incarnation)
    if job.mode == "pull":
        prefilled = wire.PrefilledKv.of(job.kv_transfer_params)
        params.prefill_tp_size = prefilled.prefill_tp_size
        params.remote_block_ids = prefilled.remote_block_ids
        params.prefill_incarnation = prefilled.prefill_incarnation
    return f"{job.request_id}-d-{job.transfer_id[:8]}", params.as_params()


def port_outside_ephemeral_range() -> int:
    """A free port below the kernel's ephemeral range. vLLM's engine binds the side channel
    seconds after it is chosen, while it and its peer pick their own ports with bind(0),
    which the kernel takes from that range: a port chosen there could be handed out again
    meanwhile (CI saw "Address already in use"). None of theirs lands below it."""
    import random
    import socket

    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
            low = int(ports.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(1024, low // 2), low)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port below {low} for vLLM's NIXL side channel")


def side_channel(engine_id: str, connector: str) -> dict:
    """vLLM's NIXL connectors talk over a side channel of their own, one port per engine:
    set it up for this process's engine, and return what peers need to reach it (the
    heartbeat's ``kv_params``). kvpush's connector needs none: it speaks NATS."""
    if connector == "kvpush":
        return {}
    port = port_outside_ephemeral_range()
    host = os.environ.get("KVPUSH_ADVERTISE_HOST") or "127.0.0.1"  # where other hosts reach this one
    os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] = host
    os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(port)
    return {"remote_engine_id": engine_id, "remote_host": host, "remote_port": port, "tp_size": 1}


# --------------------------------------------------------------------------- load and stages

class EngineLoad:
    """Latest scheduler stats of the engine, fed by vLLM's stat logger hook."""

    def __init__(self) -> None:
        self.kv_cache_usage = 0.0
        self.running = 0
        self.waiting = 0

    def factory(self):
        from vllm.v1.metrics.loggers import StatLoggerBase

        load = self

        class Recorder(StatLoggerBase):
            def __init__(self, vllm_config, engine_index: int = 0):
                pass

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
                if scheduler_stats is not None:
                    load.kv_cache_usage = scheduler_stats.kv_cache_usage
                    load.running = scheduler_stats.num_running_reqs
                    load.waiting = scheduler_stats.num_waiting_reqs + scheduler_stats.num_skipped_waiting_reqs

            def log_engine_initialized(self):
                pass

        return Recorder


class EngineStages:
    """Wall-clock times of vLLM's per-request stages, from its engine-core timestamps
    (monotonic, same host), recorded as child spans of the current span."""

    def __init__(self, output, tracer) -> None:
        stats = getattr(output, "metrics", None) if output is not None else None
        offset_ns = time.time_ns() - time.monotonic_ns()
        self._tracer = tracer

        def wall(ts: float) -> int | None:
            return int(ts * 1e9) + offset_ns if ts else None

        self.scheduled_ns = wall(stats.scheduled_ts) if stats else None
        self.first_token_ns = wall(stats.first_token_ts) if stats else None
        self.last_token_ns = wall(stats.last_token_ts) if stats else None

    def record(self, name: str, start_ns: int | None, end_ns: int | None) -> None:
        if start_ns is None or end_ns is None:
            return
        self._tracer.start_span(name, start_time=start_ns).end(end_time=max(start_ns, end_ns))
