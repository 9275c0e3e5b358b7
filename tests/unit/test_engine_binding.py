"""An engine whose one worker runs in the engine-core process gets vLLM's CPU binding.

vLLM applies ``VLLM_CPU_OMP_THREADS_BIND`` only around the worker processes of its
multiprocess executor; kvpush runs TP 1 engines with the ``uni`` executor, so
``start_engine`` applies vLLM's own ``OMPProcessManager`` around the start of the
engine-core process (docs/benchmarks.md, "Push's own costs"). At TP above 1 vLLM's executor
binds each rank process, and kvpush names one core list per rank (vLLM's ``auto`` refuses a
one-node machine). Here: the environment that process would inherit, for a real vLLM config
built from kvpush's engine arguments (no engine is started); and a KV block's bytes, which
the heartbeat reports, from the same configs at TP 1 and 2."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from vllm.usage.usage_lib import UsageContext

from kvpush.services.launch.model import build_model, default_model_dir
from kvpush.services.worker import engine
from kvpush.services.worker.cpu_binding import default_binding
from kvpush.services.worker.engine_settings import EngineSettings


@pytest.fixture(scope="module")
def model() -> str:
    return str(build_model(default_model_dir("small"), profile="small"))


def _config(model: str, role: str | None, tensor_parallel_size: int = 1):
    settings = EngineSettings(model=model, role=role, engine_id="bound", nats_url="nats://127.0.0.1:4222",
                              connector="kvpush", tensor_parallel_size=tensor_parallel_size)
    return engine.engine_args(settings).create_engine_config(UsageContext.ENGINE_CONTEXT)


_BINDING = ("OMP_NUM_THREADS", "GOMP_CPU_AFFINITY", "OMP_PLACES", "OMP_PROC_BIND")


@pytest.fixture
def clean_env(monkeypatch):
    """No binding yet, and vLLM's own LD_PRELOAD (it adds libgomp) undone after the test."""
    monkeypatch.setenv("LD_PRELOAD", os.environ.get("LD_PRELOAD", ""))
    for name in _BINDING:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _cores() -> list[int]:
    """The cores the binding names: GOMP_CPU_AFFINITY with libgomp preloaded, else OMP_PLACES."""
    if "GOMP_CPU_AFFINITY" in os.environ:
        return [int(c) for c in os.environ["GOMP_CPU_AFFINITY"].split()]
    return [int(c) for c in os.environ["OMP_PLACES"].strip("{}").split(",")]


@pytest.mark.parametrize("bind, cores", [("1", [1]), ("0-1", [0, 1])])
def test_the_engine_core_starts_with_the_binding_vllm_gives_a_worker_process(model, clean_env, bind, cores):
    clean_env.setenv("VLLM_CPU_OMP_THREADS_BIND", bind)
    config = _config(model, "prefill")
    assert config.parallel_config.distributed_executor_backend == "uni"
    with engine._omp_binding(config):
        assert os.environ.get("OMP_NUM_THREADS") == str(len(cores))
        assert _cores() == cores
    assert not any(name in os.environ for name in _BINDING)  # only the engine core's start is bound


def test_nobind_leaves_the_environment_alone(model, clean_env):
    clean_env.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    with engine._omp_binding(_config(model, None)):
        assert not any(name in os.environ for name in _BINDING)


def test_above_tp1_the_ranks_get_one_core_list_each_unless_the_environment_names_them(model, clean_env):
    config = _config(model, "prefill", tensor_parallel_size=2)
    assert config.parallel_config.distributed_executor_backend == "mp"  # vLLM binds each rank's process
    clean_env.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    cores = sorted(os.sched_getaffinity(0))
    with engine._omp_binding(config), engine.rank_binding(2):
        assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == default_binding(2, cores, {})  # "0|1" on two cores
        assert not any(name in os.environ for name in _BINDING)  # the ranks bind themselves
    assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ  # only the engine core's start sees it
    clean_env.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|0")
    with engine.rank_binding(2):
        assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0|0"
    with engine.rank_binding(1):
        assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0|0"


@pytest.mark.parametrize("tp", [1, 2])
def test_a_blocks_bytes_count_every_kv_head_once_at_any_tensor_parallelism(model, tp):
    """What the heartbeat reports and the scheduler's fetch costs read: the bytes a block
    moves, all heads, not the share of the heads one rank holds."""
    hf = json.loads((Path(model) / "config.json").read_text())
    config = _config(model, "decode", tensor_parallel_size=tp)
    head_size = hf["hidden_size"] // hf["num_attention_heads"]
    fp32 = 4
    assert engine.kv_bytes_per_block(config) == (hf["num_hidden_layers"] * 2 * hf["num_key_value_heads"] * head_size
                                                 * fp32 * config.cache_config.block_size)
