"""The one table of KV connector kinds (shared/connector_kinds.py), and what each kind asks
of the worker (services/worker/kinds.py, through services/worker/engine.py) and of the
bench (tools/bench/systems.py). The engine arguments, requests and commands are pinned as
the code made them before the kinds were one table: vLLM gets them byte for byte."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import get_args

import pytest
import torch

from kvpush.services.worker import kinds
from kvpush.services.worker.engine import engine_kwargs
from kvpush.services.worker.kinds import strategy
from kvpush.services.worker.engine_settings import EngineSettings, whole_prompt_steps
from kvpush.shared import connector_kinds, wire
from kvpush.shared.settings import FaultSettings
from kvpush.tools.bench import vllm_proxy
from kvpush.tools.bench.systems import Topology, VllmServeSystem, core_binding

NAMES = ("kvpush", "vllm-nixl", "vllm-nixl-push")


def same(actual, expected) -> None:
    """Equal, keys in the same order too."""
    assert json.dumps(actual) == json.dumps(expected)


# --------------------------------------------------------------------------- the registry

def test_the_registry_names_each_kind_once_with_its_modes_and_vllms_class():
    assert connector_kinds.NAMES == NAMES
    assert get_args(connector_kinds.Name) == NAMES
    assert get_args(wire.Connector) == NAMES  # what a heartbeat may carry
    table = {kind.name: (kind.modes, kind.vllm_connector, kind.ours) for kind in connector_kinds.KINDS.values()}
    assert table == {
        "kvpush": (("push", "pull"), None, True),
        "vllm-nixl": (("pull",), "NixlConnector", False),
        "vllm-nixl-push": (("push",), "NixlPushConnector", False),
    }
    assert set(connector_kinds.of("vllm-nixl").modes) <= set(get_args(wire.TransferMode))


def test_an_unknown_kind_is_refused_by_name():
    with pytest.raises(ValueError, match="nixl-pull"):
        connector_kinds.of("nixl-pull")
    with pytest.raises(ValueError, match="nixl-pull"):
        kinds.strategy("nixl-pull")


def test_every_kind_has_one_worker_strategy():
    assert tuple(kinds.STRATEGIES) == NAMES
    for name in NAMES:
        assert kinds.strategy(name).kind is connector_kinds.of(name)


# --------------------------------------------------------------------------- engine arguments

ENGINE = {"model": "/models/tiny", "tokenizer": "/models/tiny", "dtype": "float32", "enforce_eager": True,
          "max_model_len": 512, "block_size": 16, "max_num_seqs": 8, "enable_prefix_caching": True,
          "tensor_parallel_size": 2,
          # every engine, as the single-engine reference: inert unless a migrated request replays tokens
          "logits_processors": ["kvpush.services.worker.replay:ReplayTokens"],
          **whole_prompt_steps(512, on_cpu=not torch.cuda.is_available())}  # on CPUs: no chunked prefill
KVPUSH_EXTRA = {"nats_url": "nats://n:4222", "lease_s": 7.0, "kv_wait_s": 90.0, "quarantine_s": 11.0,
                "incarnation": "inc-w", "push_by_layer": False}
TRANSFER = {
    ("kvpush", "prefill"): {
        "kv_transfer_config": {"kv_connector": "KvpushConnector", "kv_connector_module_path": "kvpush.connector.kvpush_connector",
                               "kv_role": "kv_both", "engine_id": "prefill-e1",
                               "kv_connector_extra_config": {**KVPUSH_EXTRA, "role": "prefill"}, "kv_load_failure_policy": "recompute"},
        "disable_hybrid_kv_cache_manager": True},
    ("kvpush", "decode"): {
        "kv_transfer_config": {"kv_connector": "KvpushConnector", "kv_connector_module_path": "kvpush.connector.kvpush_connector",
                               "kv_role": "kv_both", "engine_id": "decode-e1",
                               "kv_connector_extra_config": {**KVPUSH_EXTRA, "role": "decode"}, "kv_load_failure_policy": "fail"},
        "disable_hybrid_kv_cache_manager": True},
    ("vllm-nixl", "prefill"): {
        "kv_transfer_config": {"kv_connector": "NixlConnector", "kv_role": "kv_both", "engine_id": "prefill-e1"}},
    ("vllm-nixl", "decode"): {
        "kv_transfer_config": {"kv_connector": "NixlConnector", "kv_role": "kv_both", "engine_id": "decode-e1"}},
    ("vllm-nixl-push", "prefill"): {
        "kv_transfer_config": {"kv_connector": "NixlPushConnector", "kv_role": "kv_both", "engine_id": "prefill-e1"}},
    ("vllm-nixl-push", "decode"): {
        "kv_transfer_config": {"kv_connector": "NixlPushConnector", "kv_role": "kv_both", "engine_id": "decode-e1"}},
    **{(name, None): {} for name in NAMES},  # a plain single instance loads no connector
}


@pytest.mark.parametrize("name,role", list(TRANSFER))
def test_the_engine_arguments_of_each_kind_and_role(name, role):
    engine = EngineSettings(model="/models/tiny", role=role, engine_id=f"{role}-e1", nats_url="nats://n:4222",
                            max_model_len=512, block_size=16, max_num_seqs=8, tensor_parallel_size=2, connector=name,
                            faults=FaultSettings(lease_s=7.0, kv_wait_s=90.0, quarantine_s=11.0, on_kv_failure="fail"),
                            incarnation="inc-w", prefix_caching=True)
    same(engine_kwargs(engine), {**ENGINE, **TRANSFER[name, role]})


def test_kvpush_without_a_nats_url_or_fault_settings_gets_the_defaults():
    engine = EngineSettings(model="m", role="decode", engine_id="x", nats_url=None, max_model_len=2048,
                            connector="kvpush", faults=FaultSettings(), prefix_caching=False)
    same(engine_kwargs(engine)["kv_transfer_config"]["kv_connector_extra_config"],
         {"nats_url": None, "lease_s": 10.0, "kv_wait_s": 120.0, "quarantine_s": 15.0, "incarnation": "", "push_by_layer": False,
          "role": "decode"})
    # vLLM fails a request whose KV did not come; decode applies the request's kv_policy itself.
    assert engine_kwargs(engine)["kv_transfer_config"]["kv_load_failure_policy"] == "fail"


def test_layer_wise_push_reaches_the_connector_of_a_prefill_that_asks_for_it():
    engine = EngineSettings(model="m", role="prefill", engine_id="x", nats_url="nats://n:4222", max_model_len=2048,
                            connector="kvpush", push_by_layer=True)
    assert engine_kwargs(engine)["kv_transfer_config"]["kv_connector_extra_config"]["push_by_layer"] is True


# --------------------------------------------------------------------------- requests

def prefill_job(mode: str) -> wire.PrefillJob:
    return wire.PrefillJob(request_id="req-1", transfer_id="0123456789abcdef", prompt_token_ids=[1, 2],
                           received_at=1.0, mode=mode, decode_engine_id="decode-7" if mode == "push" else "",
                           transfer_key="key-1", kv_checksum=mode == "pull")


VLLM_PREFILL = ("0123456789abcdef", {"do_remote_decode": True})
PREFILLS = {
    ("kvpush", "push"): ("req-1-p-01234567", {"do_remote_decode": True, "transfer_id": "0123456789abcdef",
                                              "mode": "push", "decode_engine_id": "decode-7",
                                              "traceparent": "00-tp-01", "transfer_key": "key-1", "checksum": False}),
    ("kvpush", "pull"): ("req-1-p-01234567", {"do_remote_decode": True, "transfer_id": "0123456789abcdef",
                                              "mode": "pull", "decode_engine_id": "",
                                              "traceparent": "00-tp-01", "transfer_key": "key-1", "checksum": True}),
    **{(name, mode): VLLM_PREFILL for name in ("vllm-nixl", "vllm-nixl-push") for mode in ("push", "pull")},
}


@pytest.mark.parametrize("name,mode", list(PREFILLS))
def test_the_prefill_request_of_each_kind(name, mode):
    same(strategy(name).prefill_request(prefill_job(mode), "00-tp-01"), PREFILLS[name, mode])


PUSHED = {"remote_engine_id": "prefill-3", "remote_host": "10.0.0.9", "remote_port": 5600, "tp_size": 1}
PULLED = {"do_remote_prefill": True, "transfer_id": "0123456789abcdef", "prefill_engine_id": "prefill-3",
          "prefill_tp_size": 2, "remote_block_ids": [4, 5, 6], "prefill_incarnation": "inc-p2",
          "block_digests": ["a1", "b2", "c3"], **PUSHED}
PREFILL_SAYS = {"push": PUSHED, "push-empty": {}, "pull": PULLED, "local": {}}


def decode_job(case: str) -> wire.DecodeJob:
    return wire.DecodeJob(request_id="req-2", transfer_id="fedcba9876543210", prompt_token_ids=[3],
                          sampling=wire.SamplingSpec(max_tokens=4, temperature=0.0, ignore_eos=True),
                          prefill_engine_id="prefill-3", reply_to="r", received_at=2.0, mode=case.split("-")[0],
                          kv_transfer_params=PREFILL_SAYS[case], transfer_key="key-2", prefill_incarnation="inc-p1")


KVPUSH_PUSHED = ("req-2-d-fedcba98", {"do_remote_prefill": True, "transfer_id": "fedcba9876543210",
                                      "request_id": "req-2", "prefill_engine_id": "prefill-3", "prefill_tp_size": 1,
                                      "mode": "push", "remote_block_ids": [], "prefill_incarnation": "inc-p1",
                                      "traceparent": "00-tp-02", "transfer_key": "key-2", "block_digests": []})
PUSH_PREFIX = {"do_remote_prefill": True, "remote_request_id": "fedcba9876543210"}
DECODES = {
    ("kvpush", "push"): KVPUSH_PUSHED,
    ("kvpush", "push-empty"): KVPUSH_PUSHED,
    ("kvpush", "pull"): ("req-2-d-fedcba98", {"do_remote_prefill": True, "transfer_id": "fedcba9876543210",
                                              "request_id": "req-2", "prefill_engine_id": "prefill-3",
                                              "prefill_tp_size": 2, "mode": "pull", "remote_block_ids": [4, 5, 6],
                                              "prefill_incarnation": "inc-p2", "traceparent": "00-tp-02",
                                              "transfer_key": "key-2", "block_digests": ["a1", "b2", "c3"]}),
    ("vllm-nixl", "push"): ("fedcba9876543210", PUSHED),
    ("vllm-nixl", "push-empty"): ("fedcba9876543210", {}),
    ("vllm-nixl", "pull"): ("fedcba9876543210", PULLED),
    ("vllm-nixl-push", "push"): ("fedcba9876543210", {**PUSH_PREFIX, **PUSHED}),
    ("vllm-nixl-push", "push-empty"): ("fedcba9876543210", PUSH_PREFIX),
    ("vllm-nixl-push", "pull"): ("fedcba9876543210", {**PUSH_PREFIX, **PULLED}),
    **{(name, "local"): ("req-2-l-fedcba98", {}) for name in NAMES},
}


@pytest.mark.parametrize("name,case", list(DECODES))
def test_the_decode_request_of_each_kind(name, case):
    same(strategy(name).decode_request(decode_job(case), "00-tp-02"), DECODES[name, case])


def test_a_pulled_prompts_digests_per_head_reach_decodes_connector():
    """Prefill's per-head checksums (PrefilledKv.head_digests, from every rank) go on to
    decode's connector, which checks the heads each of its ranks holds."""
    job = decode_job("pull")
    job.kv_transfer_params = {**PULLED, "head_digests": [["a", "b"], ["c", "d"], ["e", "f"]]}
    _, params = strategy("kvpush").decode_request(job, "")
    assert wire.DecodeKvParams.of(params).head_digests == [["a", "b"], ["c", "d"], ["e", "f"]]


def test_a_decode_request_is_a_copy_of_what_prefill_said():
    job = decode_job("pull")
    _, params = strategy("vllm-nixl").decode_request(job, "")
    params["remote_port"] = 1
    assert job.kv_transfer_params["remote_port"] == 5600


# --------------------------------------------------------------------------- side channel

def test_only_vllms_kinds_open_a_side_channel(monkeypatch):
    monkeypatch.setenv("KVPUSH_ADVERTISE_HOST", "10.1.2.3")
    for variable in ("VLLM_NIXL_SIDE_CHANNEL_HOST", "VLLM_NIXL_SIDE_CHANNEL_PORT"):
        monkeypatch.setenv(variable, "unset")  # and put back as it was after the test
    assert strategy("kvpush").side_channel("decode-0") == {}
    assert os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "unset"
    for name in ("vllm-nixl", "vllm-nixl-push"):
        params = strategy(name).side_channel("decode-0")
        port = params["remote_port"]
        same(params, {"remote_engine_id": "decode-0", "remote_host": "10.1.2.3", "remote_port": port, "tp_size": 1})
        assert (os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"], os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"]) == \
            ("10.1.2.3", str(port))


def test_vllms_side_channel_names_the_engines_tp_one_port_for_every_rank(monkeypatch):
    """What a peer's NixlConnector maps its ranks by (vLLM's scheduler side answers for
    every rank on one port): the push flow hands it to decode verbatim."""
    for variable in ("VLLM_NIXL_SIDE_CHANNEL_HOST", "VLLM_NIXL_SIDE_CHANNEL_PORT"):
        monkeypatch.setenv(variable, "unset")
    for name in ("vllm-nixl", "vllm-nixl-push"):
        params = strategy(name).side_channel("prefill-0", 2)
        assert params["tp_size"] == 2 and os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(params["remote_port"])
    assert strategy("kvpush").side_channel("prefill-0", 2) == {}


# --------------------------------------------------------------------------- bench

KV_TRANSFER_CONFIGS = {  # what each `vllm serve` is given, as given
    ("vllm-nixl", "prefill"): '{"kv_connector": "NixlConnector", "kv_role": "kv_producer", "kv_buffer_device": "cpu", '
                              '"engine_id": "prefill-0"}',
    ("vllm-nixl", "decode"): '{"kv_connector": "NixlConnector", "kv_role": "kv_consumer", "kv_buffer_device": "cpu", '
                             '"engine_id": "decode-0"}',
    ("vllm-nixl-push", "prefill"): '{"kv_connector": "NixlPushConnector", "kv_role": "kv_both", '
                                   '"kv_buffer_device": "cpu", "engine_id": "prefill-0"}',
    ("vllm-nixl-push", "decode"): '{"kv_connector": "NixlPushConnector", "kv_role": "kv_both", '
                                  '"kv_buffer_device": "cpu", "engine_id": "decode-0"}',
}


@pytest.mark.parametrize("variant,connector,flow", [("vllm-nixl", "NixlConnector", "pull"),
                                                    ("vllm-nixl-push", "NixlPushConnector", "push")])
def test_the_bench_serves_vllms_kinds_with_their_class_and_flow(variant, connector, flow):
    system = VllmServeSystem(variant, "/models/tiny", "tiny", 512, Topology(), "auto", Path("/nonexistent"))
    assert (system.connector, system.flow) == (connector, flow)
    for role in ("prefill", "decode"):
        assert system.serve_command(role, 8100, f"{role}-0") == [
            "kvpush.tools.bench.vllm_cli", "serve", "/models/tiny", "--host", "127.0.0.1", "--port", "8100",
            "--served-model-name", "tiny", "--kv-transfer-config", KV_TRANSFER_CONFIGS[variant, role],
            "--enforce-eager", "--no-enable-prefix-caching", "--dtype", "float32", "--max-model-len", "512"]
    env = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
           "VLLM_NIXL_SIDE_CHANNEL_PORT": "5601", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if flow == "push":
        env["VLLM_DISABLE_REQUEST_ID_RANDOMIZATION"] = "1"
    same(system.engine_env(0, 5601), env)


@pytest.mark.parametrize("variant", ["vllm-nixl", "vllm-nixl-push"])
def test_the_bench_serves_vllms_kinds_at_each_roles_tp_and_its_proxy_knows_the_prefills(variant):
    topology = Topology(prefill=1, decode=1, prefill_tp=2, decode_tp=1)
    system = VllmServeSystem(variant, "/models/tiny", "tiny", 512, topology, "auto", Path("/nonexistent"))
    assert system.serve_command("prefill", 8100, "prefill-0")[-2:] == ["--tensor-parallel-size", "2"]
    assert "--tensor-parallel-size" not in system.serve_command("decode", 8200, "decode-0")
    command = system.proxy_command(["127.0.0.1:8100:prefill-0:5600"], ["127.0.0.1:8200"])
    assert command[0] == "kvpush.tools.bench.vllm_proxy"
    proxy = vllm_proxy.parse_args(command[1:])
    assert proxy.flow == system.flow and [p.tp_size for p in proxy.prefill] == [2]


def test_the_bench_bindings_give_each_rank_its_own_core_list():
    topology = Topology(prefill=1, decode=1, prefill_tp=2, decode_tp=2)
    cores = os.cpu_count()
    split = [core_binding("split", i, topology)["VLLM_CPU_OMP_THREADS_BIND"] for i in range(2)]
    assert split == [f"{0 % cores}|{1 % cores}", f"{2 % cores}|{3 % cores}"]  # "0|1" twice on 2 cores
    assert core_binding("all", 1, topology) == {"VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}|0-{cores - 1}",
                                                "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    assert core_binding("auto", 0, topology) == {}
    mixed = Topology(prefill=1, decode=2, prefill_tp=2, decode_tp=1)
    assert [core_binding("split", i, mixed)["VLLM_CPU_OMP_THREADS_BIND"] for i in range(3)] == \
        [f"{0 % cores}|{1 % cores}", f"{2 % cores}", f"{3 % cores}"]
    assert [core_binding("split", i, Topology(1, 2))["VLLM_CPU_OMP_THREADS_BIND"] for i in range(3)] == \
        [str(i % cores) for i in range(3)]  # TP 1: engine i on core i, as before


def test_the_benchs_kvpush_stack_starts_each_worker_at_its_roles_tp_bound_as_the_binding_says(monkeypatch):
    from kvpush.services.cli.main import build_parser
    from kvpush.tools.bench.systems import KvpushSystem

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    topology = Topology(prefill=1, decode=1, prefill_tp=2, decode_tp=2)
    stack = KvpushSystem("/models/tiny", 512, topology, "split", Path("/nonexistent"), "http://127.0.0.1:1").stack
    stack.nats_url = "nats://127.0.0.1:4222"
    for index, name in enumerate(("prefill-0", "decode-0")):
        role = name.split("-")[0]
        assert build_parser().parse_args(stack.worker_args(role, name)).tensor_parallel_size == 2
        assert stack._env(role, name)["VLLM_CPU_OMP_THREADS_BIND"] == \
            core_binding("split", index, topology)["VLLM_CPU_OMP_THREADS_BIND"]
        assert stack.worker_binding(role, name) == {}  # the bench's binding stands


def test_kvpush_bench_takes_a_tp_per_role_for_every_workload_and_the_probe():
    from kvpush.services.cli.main import build_parser
    from kvpush.tools.bench.run import BINDING_PROBE, GRID, at_tensor_parallel

    args = build_parser().parse_args(["bench", "--prefill-tp", "2", "--decode-tp", "2"])
    assert (args.prefill_tp, args.decode_tp) == (2, 2)
    workload = at_tensor_parallel(GRID[0], args.prefill_tp, args.decode_tp)
    assert (workload.topology.prefill_tp, workload.topology.decode_tp) == (2, 2)
    assert workload.topology.label == "1P1D-tp2x2" and workload.name == f"{GRID[0].name} tp2x2"
    assert at_tensor_parallel(BINDING_PROBE, 1, 1) is BINDING_PROBE and Topology().label == "1P1D"


def test_the_bench_serves_no_kvpush_through_vllm_serve():
    with pytest.raises(ValueError, match="kvpush"):
        VllmServeSystem("kvpush", "/models/tiny", "tiny", 512, Topology(), "auto", Path("/nonexistent"))


def test_layer_wise_push_is_on_by_default_where_it_measured_better_engines_on_gpus():
    from kvpush.services.worker.engine_settings import layer_wise

    assert layer_wise("auto", on_gpu=True) and not layer_wise("auto", on_gpu=False)
    assert layer_wise("on", on_gpu=False) and not layer_wise("off", on_gpu=True)
    import torch

    assert layer_wise("auto") is torch.cuda.is_available()  # on CPUs (CI's machine): one WRITE
    with pytest.raises(ValueError, match="on, off or auto"):
        layer_wise("sometimes")


def test_json_without_free_whitespace_is_an_engine_setting_vllm_takes():
    """This vLLM reads disable_any_whitespace from the engine's config, not the request's:
    ``--json-whitespace none`` is how a deployment gets compact JSON answers."""
    plain = engine_kwargs(EngineSettings(model="m", role="decode", engine_id="x", nats_url=None))
    assert "structured_outputs_config" not in plain
    compact = engine_kwargs(EngineSettings(model="m", role="decode", engine_id="x", nats_url=None,
                                           json_whitespace="none"))
    config = compact["structured_outputs_config"]  # vLLM's own type: it validated the pair when made
    assert config.disable_any_whitespace is True and config.backend == "xgrammar"
