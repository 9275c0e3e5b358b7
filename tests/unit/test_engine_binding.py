"""An engine whose one worker runs in the engine-core process gets vLLM's CPU binding.

vLLM applies ``VLLM_CPU_OMP_THREADS_BIND`` only around the worker processes of its
multiprocess executor; kvpush runs TP 1 engines with the ``uni`` executor, so
``start_engine`` applies vLLM's own ``OMPProcessManager`` around the start of the
engine-core process (docs/benchmarks.md, "Push's own costs"). Here: the environment that
process would inherit, for a real vLLM config built from kvpush's engine arguments (no
engine is started)."""

from __future__ import annotations

import os

import pytest
from vllm.usage.usage_lib import UsageContext

from kvpush.services.launch.model import build_model, default_model_dir
from kvpush.services.worker import engine
from kvpush.services.worker.engine_settings import EngineSettings


@pytest.fixture(scope="module")
def model() -> str:
    return str(build_model(default_model_dir("small"), profile="small"))


def _config(model: str, role: str | None):
    settings = EngineSettings(model=model, role=role, engine_id="bound", nats_url="nats://127.0.0.1:4222",
                              connector="kvpush")
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
