"""The worker's side of vLLM: engine settings and arguments, the engine's start (bound to
its cores, one list per rank at TP above 1), its KV block size in bytes, and its load (from
vLLM's stat logger hook). What each KV connector wants in a request is its kind's strategy's
(``kvpush.services.worker.kinds``); a request's stage times are
``kvpush.services.worker.stages``."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from kvpush.services.worker.cpu_binding import BIND_ENV, default_binding
from kvpush.services.worker.engine_settings import EngineSettings, whole_prompt_steps
from kvpush.services.worker.kinds import strategy

REPLAY_FQCN = "kvpush.services.worker.replay:ReplayTokens"  # imports vLLM: named, loaded by the engine

# Set before vLLM is imported anywhere in this process.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("UCX_TCP_NODELAY", "y")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


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
        # inert unless a request asks: a migrated request replays the tokens its client has
        logits_processors=[REPLAY_FQCN],
    )
    if engine.json_whitespace == "none":
        from vllm.config import StructuredOutputsConfig

        # vLLM takes it for one backend named, not "auto": xgrammar, auto's first choice
        kwargs["structured_outputs_config"] = StructuredOutputsConfig(backend="xgrammar", disable_any_whitespace=True)
    kwargs.update(whole_prompt_steps(engine.max_model_len, on_cpu(), _emulated(engine.model)))
    if engine.role is not None:
        kwargs.update(strategy(engine.connector).transfer_kwargs(engine))
    return kwargs


def on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _emulated(model: str) -> bool:
    """Whether ``model`` is an emulated-GPU model (tools/emulation; its config.json says)."""
    try:
        return "kvpush_emulation" in json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return False


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

        from kvpush.services.worker.cache_relay import kv_events_config

        kwargs["kv_events_config"] = KVEventsConfig(**kv_events_config(engine.kv_events_endpoint))
    return AsyncEngineArgs(**kwargs, disable_log_stats=False)


def start_engine(engine: EngineSettings, stat_loggers: list):
    """vLLM's AsyncLLM for these settings, its engine core started bound to its cores.

    With one worker in the engine-core process (``engine_args``), nothing in vLLM applies
    ``VLLM_CPU_OMP_THREADS_BIND``: its CPU binding (``OMPProcessManager``) runs only in the
    multiprocess executor, around each worker process it starts. The engine core then ran
    with as many OpenMP threads as the machine has cores, on every core, beside the other
    engine's (on two cores: two engines, four spinning OpenMP threads; push TTFT p50 at
    1k, 1.5 req/s, "split", 0.87 s before, 2.0 s after). So the same binding is applied
    here, by vLLM's own manager, around the start of the engine-core process, which
    inherits it."""
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.executor import Executor

    args = engine_args(engine)
    config = args.create_engine_config(UsageContext.ENGINE_CONTEXT)
    with _omp_binding(config), rank_binding(engine.tensor_parallel_size):
        return AsyncLLM(vllm_config=config, executor_class=Executor.get_class(config),
                        log_requests=args.enable_log_requests, log_stats=not args.disable_log_stats,
                        stat_loggers=stat_loggers)


def _omp_binding(config):
    """vLLM's OpenMP environment for the engine's one worker (rank 0), when that worker runs
    in the engine-core process on CPUs; otherwise nothing (vLLM's executor does it)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or config.parallel_config.distributed_executor_backend != "uni":
        return contextlib.nullcontext()
    from vllm.utils.ompmultiprocessing import OMPProcessManager

    return OMPProcessManager(config).configure_omp_envs(rank=0, local_rank=0)


@contextlib.contextmanager
def rank_binding(tensor_parallel_size: int):
    """At TP above 1 on CPUs, one core list per rank in ``VLLM_CPU_OMP_THREADS_BIND`` while
    the engine core starts (its rank processes, which vLLM's executor binds, inherit it):
    ``cpu_binding.default_binding``, the ranks spread over this process's cores, unless the
    environment names a binding. vLLM's own default (``auto``) refuses TP above 1 on a
    machine with one NUMA node."""
    binding = None
    if tensor_parallel_size > 1 and on_cpu():
        binding = default_binding(tensor_parallel_size, sorted(os.sched_getaffinity(0)), dict(os.environ))
    if binding is None:
        yield
        return
    os.environ[BIND_ENV] = binding
    try:
        yield
    finally:
        os.environ.pop(BIND_ENV, None)


def kv_bytes_per_block(config) -> int:
    """One KV block's bytes over every layer (K and V) and every KV head, from the engine's
    config; 0 if it cannot be told. What fetching a block from another engine moves, at any
    tensor parallelism: each rank holds its share of the heads (all of them, replicated, when
    there are more ranks than heads), and the heads are counted once."""
    try:
        import torch

        model, cache, parallel = config.model_config, config.cache_config, config.parallel_config
        dtype = model.dtype if cache.cache_dtype in (None, "auto") else getattr(torch, str(cache.cache_dtype), None)
        element = torch.tensor([], dtype=dtype).element_size()
        return (model.get_num_layers(parallel) * 2 * model.get_total_num_kv_heads() * model.get_head_size()
                * element * cache.block_size)
    except Exception:
        return 0


# --------------------------------------------------------------------------- load

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
