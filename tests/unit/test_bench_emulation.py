"""``kvpush bench --emulate``'s own arithmetic (tools/bench/emulation.py): emulated time from the
client's dilated figures, the CPU share from the forward logs, and the grid's cut."""

from __future__ import annotations

import json

import pytest

from kvpush.tools.bench.emulation import Emulation, cpu_share, grid, rates_it_holds
from kvpush.tools.bench.run import Workload
from kvpush.tools.bench.systems import Topology


def test_the_summary_is_reported_in_emulated_time_and_keeps_the_dilation():
    emulated = Emulation("qwen3-32b@p5en", dilation=25)
    measured = {"completed": 6, "failed": 0, "request_throughput": 0.08, "output_throughput": 2.0,
                "duration_s": 75.0, "p50_ttft_ms": 2500.0, "p99_tpot_ms": 125.0, "mean_e2el_ms": None}
    out = emulated.summary(measured)
    assert out["p50_ttft_ms"] == pytest.approx(100.0)
    assert out["p99_tpot_ms"] == pytest.approx(5.0)
    assert out["request_throughput"] == pytest.approx(2.0)
    assert out["output_throughput"] == pytest.approx(50.0)
    assert out["duration_s"] == pytest.approx(3.0)
    assert out["completed"] == 6 and out["mean_e2el_ms"] is None and out["dilation"] == 25
    assert emulated.client_rate(2.0) == pytest.approx(0.08)
    assert emulated.segments({"prefill compute": {"p50": 50.0, "n": 6}}) == {"prefill compute": {"p50": 2.0, "n": 6}}


def test_every_engine_gets_the_target_the_dilation_and_the_progress_thread_switch(tmp_path):
    env = Emulation("llama-3.1-8b@h100", dilation=20).engine_env(tmp_path)
    assert env["KVPUSH_EMULATION_TARGET"] == "llama-3.1-8b@h100"
    assert env["KVPUSH_EMULATION_DILATION"] == "20"
    assert env["KVPUSH_NIXL_PROGRESS_THREAD"] == "paced"
    assert env["KVPUSH_EMULATION_LOG"] == str(tmp_path / "forwards.jsonl")
    assert Emulation("llama-3.1-8b@h100", 20).profile == "timed-llama-3.1-8b"


def test_bad_emulations_are_refused_with_a_sentence():
    with pytest.raises(ValueError, match="no emulated deployment"):
        Emulation("qwen3-32b@tpu", 25)
    with pytest.raises(ValueError, match="positive"):
        Emulation("qwen3-32b@p5en", 0)


def test_the_cpu_share_sums_each_engines_forwards_inside_the_point(tmp_path):
    log = tmp_path / "forwards.jsonl"
    rows = [{"pid": 1, "at": 10.0, "busy_s": 1.0, "target_s": 10.0},
            {"pid": 1, "at": 11.0, "busy_s": 3.0, "target_s": 10.0},
            {"pid": 2, "at": 12.0, "busy_s": 1.0, "target_s": 20.0},
            {"pid": 2, "at": 99.0, "busy_s": 50.0, "target_s": 1.0}]  # after the point
    log.write_text("\n".join(json.dumps(r) for r in rows) + "\n{\"pid\": 3, \"at\"")  # a line cut by a kill
    share = cpu_share(log, since=9.0, until=20.0)
    assert share == {"all": pytest.approx(0.125), "by_pid": {"1": 0.2, "2": 0.05}, "forwards": 3}
    assert cpu_share(tmp_path / "missing.jsonl", 0, 1)["all"] is None


def test_the_grid_keeps_only_the_rates_one_emulated_prefill_holds():
    # Qwen3-32B on a P5en (modeled): 16k prefills take ~0.46 s, so 1 and 2 req/s only.
    assert rates_it_holds("qwen3-32b@p5en", 1024) == (1.0, 2.0, 4.0, 8.0)
    assert rates_it_holds("qwen3-32b@p5en", 16384) == (1.0, 2.0)
    workloads = {w.name: w for w in grid(Workload, "qwen3-32b@p5en")}
    assert {"1k", "4k", "8k", "16k", "4k 1P2D", "4k 2P1D", "mixed 200-16k"} == set(workloads)
    assert workloads["4k 1P2D"].topology == Topology(1, 2)
    mixed = workloads["mixed 200-16k"]
    assert int(mixed.input_len * (1 - mixed.range_ratio)) == 199 and mixed.longest <= 16384 + 2


def test_the_shaped_link_carries_the_timed_models_kv_in_the_deployments_ratio():
    # Qwen3-32B on P5en: 3,200 Gbps for 256 KiB a token; the timed model has 16 KiB a token.
    assert Emulation("qwen3-32b@p5en", 25).link_bits_per_s == pytest.approx(3200e9 * (16 / 256) / 25)
    # Llama-3.1-8B on one H100: 400 Gbps for 128 KiB a token; the timed model 8 KiB (32 layers).
    assert Emulation("llama-3.1-8b@h100", 25).link_bits_per_s == pytest.approx(400e9 * (8 / 128) / 25)
    assert Emulation("qwen3-32b@p5en", 25, link="loopback").link_bits_per_s is None
    with pytest.raises(ValueError, match="shaped"):
        Emulation("qwen3-32b@p5en", 25, link="wifi")
