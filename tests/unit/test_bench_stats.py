"""`kvpush bench`'s own arithmetic: percentiles, the result summary it reads from
``vllm bench serve``'s file, and the reading of a point against its capacity."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from kvpush.tools.bench import client
from kvpush.tools.bench.results import Point, within_capacity
from kvpush.tools.bench.stats import percentile


def test_percentiles_interpolate_and_ignore_nan():
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == pytest.approx(2.5)
    assert percentile([5.0, float("nan"), 1.0], 0.99) == pytest.approx(4.96)  # of 1 and 5
    assert math.isnan(percentile([], 0.5))
    assert math.isnan(percentile([float("nan")], 0.5))


def test_the_summary_reads_vllms_percentile_keys():
    result = {"completed": 9, "failed": 1, "request_throughput": 1.5, "duration": 6.0,
              "mean_ttft_ms": 120.0, "p50_ttft_ms": 100.0, "p90_ttft_ms": 150.0, "p99_ttft_ms": 200.0,
              "p50_tpot_ms": 30.0, "p99_tpot_ms": 35.0}
    summary = client.summary(result)
    assert summary["completed"] == 9 and summary["failed"] == 1
    assert (summary["p50_ttft_ms"], summary["p99_ttft_ms"], summary["p50_tpot_ms"]) == (100.0, 200.0, 30.0)
    assert summary["p50_e2el_ms"] is None  # not in the file: missing, not zero


def test_the_client_command_fixes_what_makes_points_comparable():
    load = client.Load(input_len=1024, output_len=128, rate=2.0, requests=16, seed=7)
    args = client.command("http://127.0.0.1:1", "m", "/models/m", load, Path("/tmp/r/x.json"), "p-",
                          {"transfer_mode": "pull"})
    joined = " ".join(args)
    for expected in ("--dataset-name random", "--random-input-len 1024", "--random-output-len 128",
                     "--request-rate 2.0", "--seed 7", "--ignore-eos", "--save-detailed", "--result-filename x.json",
                     '--extra-body {"transfer_mode": "pull"}', "--random-range-ratio 0.0"):
        assert expected in joined, expected
    assert "--temperature" not in joined  # no sampling flag: vllm bench serve's own defaults
    sampled = client.Load(input_len=8, output_len=8, rate=1.0, requests=1, sampling_flags=("--temperature", "0.7",
                                                                                           "--top-p", "0.9"))
    assert client.command("u", "m", "t", sampled, Path("/tmp/r/x.json"), "p-", {})[-4:] == \
        ["--temperature", "0.7", "--top-p", "0.9"]
    assert "--random-prefix-len 0" in joined


def test_a_shared_prefix_is_counted_within_the_input_length_as_the_published_table_counts_it():
    """vLLM's random dataset adds --random-prefix-len to --random-input-len; the sonnet set the
    published table used (512 tokens, 50 of them shared) counts the prefix within the length."""
    load = client.Load(input_len=512, output_len=128, rate=4.0, requests=100, prefix_len=50)
    joined = " ".join(client.command("u", "m", "t", load, Path("/tmp/r/x.json"), "p-", {}))
    assert "--random-input-len 462" in joined and "--random-prefix-len 50" in joined


def test_a_point_is_within_capacity_until_its_ttft_passes_the_knee():
    def point(rate, ttft, variant="kvpush-push", error=""):
        p = Point("1k", "1P1D", "kvpush", variant, "auto", 1024, rate, 16, "raw/x.json", error=error)
        p.summary = {"p50_ttft_ms": ttft}
        return p

    light, loaded, beyond = point(0.5, 100.0), point(2.0, 290.0), point(5.0, 310.0)
    other = point(0.5, 1000.0, variant="vllm-nixl")  # another system's lightest point does not count
    points = [light, loaded, beyond, other]
    assert within_capacity(light, points) and within_capacity(loaded, points)
    assert not within_capacity(beyond, points)  # past 3x its own lightest TTFT
    assert not within_capacity(point(0.5, 100.0, error="client failed"), points)


def test_cpu_at_rest_is_told_per_vllm_engine_process_by_its_title():
    import os
    import subprocess
    import sys

    from kvpush.tools.bench.report import at_rest_table
    from kvpush.tools.bench.run import _engine_rates

    # a process titled as vLLM titles a rank's worker; this test's own process has no such title
    rank = subprocess.Popen([sys.executable, "-c", "import setproctitle, sys, time; "
                             "setproctitle.setproctitle('VLLM::Worker_TP1'); print(flush=True); time.sleep(60)"],
                            stdout=subprocess.PIPE)
    try:
        rank.stdout.readline()
        rates = _engine_rates({"decode-0": {rank.pid: 1.0, os.getpid(): 0.0}},
                              {"decode-0": {rank.pid: 3.0, os.getpid(): 5.0}, "scheduler": {os.getpid(): 9.0}}, 4.0)
    finally:
        rank.kill()
        rank.wait()
    assert rates == {"decode-0": {"Worker_TP1": 0.5}}
    table = at_rest_table([{"system": "kvpush", "binding": "auto", "topology": "1P1D-tp2x2",
                            "cpu_s_per_s": {"decode-0": 0.75}, "busiest_thread_s_per_s": {"decode-0": 0.5},
                            "engine_processes": rates}])
    assert "| kvpush | 1P1D-tp2x2 | auto | 0.75 |" in table and "decode-0: Worker_TP1 0.500" in table
