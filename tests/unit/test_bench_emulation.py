"""``kvpush bench --emulate``'s own arithmetic (tools/bench/emulation.py): emulated time from the
client's dilated figures, the CPU share from the forward logs, and the grid's cut."""

from __future__ import annotations

import json

import pytest

from kvpush.tools.bench.emulation import Emulation, cpu_share, grid, late_transfers, rates_it_holds, select
from kvpush.tools.bench.run import Workload
from kvpush.tools.bench.systems import Topology
from kvpush.tools.emulation import catalog
from kvpush.tools.emulation.time_model import transfer_seconds


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
    env = Emulation("llama-3.1-8b@h100", dilation=20).engine_env(tmp_path / "forwards-k20.jsonl")
    assert env["KVPUSH_EMULATION_TARGET"] == "llama-3.1-8b@h100"
    assert env["KVPUSH_EMULATION_DILATION"] == "20"
    assert env["KVPUSH_NIXL_PROGRESS_THREAD"] == "paced"
    assert env["KVPUSH_EMULATION_LOG"] == str(tmp_path / "forwards-k20.jsonl")  # the file the bench reads back
    assert env["KVPUSH_KV_CHECKSUMS"] == "off"  # as on a real GPU (VRAM): no CPU digest in emulated time
    assert Emulation("llama-3.1-8b@h100", 20).profile == "timed-llama-3.1-8b"


def test_bad_emulations_are_refused_with_a_sentence():
    with pytest.raises(ValueError, match="no emulated deployment"):
        Emulation("qwen3-32b@tpu", 25)
    with pytest.raises(ValueError, match="positive"):
        Emulation("qwen3-32b@p5en", 0)


def test_the_cpu_share_sums_each_engines_forwards_inside_the_point(tmp_path):
    log = tmp_path / "forwards.jsonl"
    rows = [{"pid": 1, "at": 10.0, "busy_s": 1.0, "target_s": 10.0, "wall_s": 10.0},
            {"pid": 1, "at": 11.0, "busy_s": 3.0, "target_s": 10.0, "wall_s": 12.0},  # ended late
            {"pid": 2, "at": 12.0, "busy_s": 1.0, "target_s": 20.0, "wall_s": 20.0},
            {"pid": 2, "at": 99.0, "busy_s": 50.0, "target_s": 1.0, "wall_s": 50.0}]  # after the point
    log.write_text("\n".join(json.dumps(r) for r in rows) + "\n{\"pid\": 3, \"at\"")  # a line cut by a kill
    share = cpu_share(log, since=9.0, until=20.0)
    assert share == {"all": pytest.approx(0.125), "by_pid": {"1": 0.2, "2": 0.05}, "forwards": 3, "late": 1,
                     "step_gap_ms": {}}  # pid 1's forwards overlap (made-up rows), pid 2 has one
    # The forward thread's own CPU time, where logged, rather than its wall time less its
    # sleeps (which counts the time other processes held the core).
    log.write_text(json.dumps({"pid": 1, "at": 10.0, "busy_s": 4.0, "cpu_s": 1.0, "target_s": 10.0,
                               "wall_s": 10.0}) + "\n")
    assert cpu_share(log, since=9.0, until=20.0)["all"] == pytest.approx(0.1)
    assert cpu_share(tmp_path / "missing.jsonl", 0, 1)["all"] is None


def test_the_step_gap_is_the_median_time_between_an_engines_forwards_while_it_keeps_stepping(tmp_path):
    log = tmp_path / "forwards.jsonl"
    ends = [10.010, 10.023, 10.035, 10.049, 15.0]  # 10 ms forwards, 3, 2 and 4 ms apart; then idle 4.9 s
    log.write_text("".join(json.dumps({"pid": 7, "at": at, "busy_s": 0.001, "target_s": 0.01, "wall_s": 0.01}) + "\n"
                           for at in ends))
    assert cpu_share(log, since=0, until=20)["step_gap_ms"] == {"7": pytest.approx(3.0)}


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


def test_auto_k_grows_with_the_prompt_and_keeps_the_aimed_share_at_the_longest_one():
    from kvpush.tools.bench.emulation import TINY_NETWORK_COST, auto_dilation
    from kvpush.tools.emulation import catalog
    from kvpush.tools.emulation.time_model import decode_step_seconds, prefill_seconds

    ks = [auto_dilation("qwen3-32b@p5en", n) for n in (1024, 4096, 8192, 16384)]
    assert ks == sorted(ks) and ks[0] < ks[-1] and all(k % 25 == 0 for k in ks)
    deployment = catalog.deployment("qwen3-32b@p5en")
    for n, k in zip((1024, 4096, 8192, 16384), ks):
        prefill_share = TINY_NETWORK_COST.prefill_s(n) / (k * prefill_seconds(deployment, n))
        decode_share = TINY_NETWORK_COST.decode_step_s / (k * decode_step_seconds(deployment, [n]))
        assert max(prefill_share, decode_share) <= 0.15  # the aim, under the 0.2 a valid point keeps
        assert max(prefill_share, decode_share) > 0.15 * (k - 25) / k  # and k no larger than that needs
    # By hand at 4k: 0.24 ms a token + 5.9e-8 s per token pair = 0.98 + 0.49 s against 106 ms modeled.
    assert TINY_NETWORK_COST.prefill_s(4096) == pytest.approx(0.24e-3 * 4096 + 5.9e-8 * 4096 ** 2 / 2)


def test_an_auto_emulation_has_no_k_until_a_workload_gives_it_one():
    auto = Emulation("qwen3-32b@p5en", "auto")
    with pytest.raises(ValueError, match="per workload"):
        auto.client_rate(1.0)
    at_4k = auto.for_workload(4096)
    assert at_4k.k == at_4k.dilation != "auto" and at_4k.client_rate(4.0) == pytest.approx(4.0 / at_4k.k)
    assert Emulation("qwen3-32b@p5en", 40).for_workload(16384).k == 40  # a given k is kept
    with pytest.raises(ValueError, match="positive number or 'auto'"):
        Emulation("qwen3-32b@p5en", "fast")


def test_a_points_real_time_is_its_arrivals_and_its_drain_times_k():
    from kvpush.tools.bench.emulation import real_seconds
    from kvpush.tools.emulation import catalog
    from kvpush.tools.emulation.time_model import decode_step_seconds, prefill_seconds

    deployment = catalog.deployment("qwen3-32b@p5en")
    one = prefill_seconds(deployment, 4096) + 128 * decode_step_seconds(deployment, [4096])
    assert real_seconds("qwen3-32b@p5en", 4096, 128, 4.0, 8, 1, 100) == pytest.approx(100 * (8 / 4 + 2 * one))


def _point(variant: str, rate: float, ttft: float, tpot: float, repeat: int = 0, k: float = 100.0, error: str = ""):
    from kvpush.tools.bench.results import Point

    return Point("4k", "1P1D", "kvpush", variant, "split", 4096, rate, 6, "raw/x.json",
                 summary={"p50_ttft_ms": ttft, "p99_ttft_ms": 2 * ttft, "p50_tpot_ms": tpot, "dilation": k},
                 error=error, repeat=repeat)


def test_resume_keeps_the_points_measured_and_runs_the_failed_and_missing_ones_again(tmp_path):
    from dataclasses import asdict

    from kvpush.tools.bench.run import Bench, BenchConfig

    kept = [_point("kvpush-push", 4.0, 117, 4.0), _point("kvpush-push", 4.0, 119, 4.0, repeat=1),
            _point("kvpush-pull", 4.0, 0, 0, error="the client timed out")]
    (tmp_path / "results.json").write_text(json.dumps({"points": [asdict(p) for p in kept]}))
    workload = Workload("4k", 4096, (4.0,), 6)
    at_100 = Emulation("qwen3-32b@p5en", 100)
    bench = Bench(BenchConfig("model", "timed-qwen3-32b", ["kvpush-push", "kvpush-pull"], [workload], out=tmp_path,
                              emulation=at_100, resume=True, repeats=3), say=lambda line: None)
    assert len(bench.points) == 2  # the failed one is measured again
    assert bench._done("kvpush-push", workload, 4.0, at_100, 0) and bench._done("kvpush-push", workload, 4.0, at_100, 1)
    assert not bench._done("kvpush-push", workload, 4.0, at_100, 2)  # the third repeat is still to come
    assert not bench._done("kvpush-pull", workload, 4.0, at_100, 0)
    assert not bench._done("kvpush-push", workload, 4.0, Emulation("qwen3-32b@p5en", 25), 0)  # another k
    fresh = Bench(BenchConfig("model", "timed-qwen3-32b", ["kvpush-push"], [workload], out=tmp_path,
                              emulation=at_100), say=lambda line: None)
    assert fresh.points == []  # without --resume nothing is kept


def test_push_is_set_against_pull_at_every_point_and_every_repeat():
    from kvpush.tools.bench.report import push_against_pull

    table = push_against_pull([_point("kvpush-push", 4.0, 100, 4.0), _point("kvpush-pull", 4.0, 125, 5.0),
                               _point("kvpush-push", 4.0, 120, 4.0, repeat=1),
                               _point("kvpush-pull", 4.0, 100, 4.0, repeat=1),
                               _point("kvpush-push", 8.0, 90, 4.0)])  # no pull at 8 req/s: no row
    rows = [line for line in table.splitlines() if line.startswith("| 4k")]
    assert len(rows) == 2
    assert "| 0.80 | 0.80 |" in rows[0] and rows[0].endswith("| 0.80 |")
    assert "| 1.20 | 1.20 |" in rows[1] and rows[1].endswith("| 1.00 |")
    assert push_against_pull([_point("kvpush-push", 4.0, 100, 4.0)]) == ""


def test_workloads_picks_a_piece_of_the_grid_and_refuses_what_it_lacks():
    workloads = grid(Workload, "qwen3-32b@p5en", requests=8)
    piece = select(workloads, "8k@4, 16k, 8k@1")
    assert [(w.name, w.rates) for w in piece] == [("8k", (1.0, 4.0)), ("16k", (1.0, 2.0))]
    assert all(w.requests == 8 for w in piece)
    assert [w.topology for w in select(workloads, "4k 2P1D")] == [Topology(2, 1)]
    with pytest.raises(ValueError, match="no workload '32k'"):
        select(workloads, "32k")
    with pytest.raises(ValueError, match="16k runs at 1, 2 req/s, not 8"):
        select(workloads, "16k@8")
    with pytest.raises(ValueError, match="a number"):
        select(workloads, "1k@fast")


def test_the_seeds_claim_sets_each_push_against_nixlconnector_at_its_own_point_and_repeat():
    from kvpush.tools.bench.report import seed_headline

    table = seed_headline([_point("vllm-nixl", 4.0, 300, 5.0), _point("kvpush-push", 4.0, 100, 3.5),
                           _point("vllm-nixl-push", 4.0, 150, 6.0), _point("kvpush-pull", 4.0, 120, 5.0),
                           _point("vllm-nixl", 4.0, 200, 4.0, repeat=1), _point("kvpush-push", 4.0, 250, 4.0, repeat=1),
                           _point("kvpush-push", 8.0, 90, 4.0)])  # no NixlConnector at 8 req/s: no row
    rows = [line for line in table.splitlines() if line.startswith("| 4k")]
    assert len(rows) == 3  # pull is not in the seed's claim
    assert rows[0] == "| 4k | 4 | kvpush-push | 3.00x | 3.00x | +30% |"
    assert rows[1] == "| 4k | 4 | vllm-nixl-push | 2.00x | 2.00x | -20% |"
    assert rows[2] == "| 4k | 4 | kvpush-push | 0.80x | 0.80x | +0% |"  # repeat 1 against repeat 1's NixlConnector
    assert "up to 3x" in table and "about 30%" in table
    assert seed_headline([_point("kvpush-push", 4.0, 100, 4.0)]) == ""


def test_waits_that_stand_for_device_time_scale_with_k_and_reach_every_system(tmp_path, monkeypatch):
    """Issue 45: at k = 175, kvpush's 120 s wait for pushed KV was 0.69 s emulated, and push's
    16k p99 was a decode that gave up. Waits that stand for device time are k times longer;
    liveness (heartbeats, a worker or scheduler lost) stays real."""
    from pathlib import Path

    from kvpush.services.cli.main import build_parser
    from kvpush.shared import settings
    from kvpush.tools.bench.systems import VllmServeSystem

    emulated = Emulation("qwen3-32b@p5en", dilation=50)
    env = emulated.engine_env(tmp_path / "forwards.jsonl")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    worker = build_parser().parse_args(["worker", "--role", "decode"])
    assert worker.kv_wait_s == 50 * settings.FAULTS.kv_wait_s
    assert worker.lease_s == 50 * settings.FAULTS.lease_s
    assert worker.quarantine_s == 50 * settings.FAULTS.quarantine_s  # still ≥ lease + 2 heartbeats
    scheduler = build_parser().parse_args(["scheduler"])
    assert (scheduler.stall_s, scheduler.deadline_s) == (50 * settings.STALL_S, 50 * settings.DEADLINE_S)
    assert scheduler.push_within_s == 50 * settings.PUSH_WITHIN_S
    assert scheduler.worker_timeout_s == settings.WORKER_TIMEOUT_S  # a host's heartbeat: real time
    vllm = VllmServeSystem("vllm-nixl-push", "/models/tiny", "tiny", 512, Topology(), "auto", Path("/nonexistent"),
                           kv_extra_config=emulated.vllm_extra_config())
    config = json.loads(vllm.serve_command("decode", 8200, "decode-0")[10])
    assert config["kv_connector_extra_config"] == {"kv_lease_duration": 1500, "decoder_kv_blocks_ttl": 24000}
    assert Emulation("qwen3-32b@p5en", dilation=1).modeled_waits()["KVPUSH_KV_WAIT_S"] == "120"


def test_a_transfer_slower_than_the_deployments_link_is_late():
    """Llama-3.3-70B on a P5en at TP 4: 512 tokens of its KV (320 KiB each) cross 1,600 Gbit/s
    in 0.84 ms; at k = 1 a crossing of 11 ms (loopback, measured) is late, at k = 20 it is not."""
    modeled = transfer_seconds(catalog.deployment("llama-3.3-70b@p5en"), 512)
    assert modeled == pytest.approx(512 * 327_680 / 200e9)
    crossings = [(512, 0.011), (512, modeled * 0.9), (1024, 0.0015)]
    assert late_transfers(crossings, "llama-3.3-70b@p5en", 1.0) == {"late": 1, "transfers": 3}
    assert late_transfers(crossings, "llama-3.3-70b@p5en", 20.0) == {"late": 0, "transfers": 3}
