"""`kvpush bench` in CI size: two connectors on one stack, a few requests, every output."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest

from tools.bench.stats import RequestResult, percentile, summarize

pytestmark = pytest.mark.timeout(600)


def test_percentiles_interpolate_and_ignore_nan():
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == pytest.approx(2.5)
    assert percentile([5.0, float("nan"), 1.0], 0.99) == pytest.approx(4.96)
    assert percentile([], 0.5) != percentile([], 0.5)  # NaN


def test_summary_counts_failures_and_throughput():
    results = [RequestResult("kvpush-push", 8, 1.0, str(i), ok=i != 2, ttft_ms=10.0 * (i + 1), tpot_ms=5.0,
                             e2e_ms=100.0, split={"queueing": 1.0, "compute": 5.0, "coordination": 2.0,
                                                  "transfer": 0.5} if i != 2 else {})
               for i in range(4)]
    point = summarize(results, wall_s=2.0)
    assert point.failures == 1 and point.requests == 4
    assert point.throughput_rps == pytest.approx(1.5)
    assert point.ttft.p50 == pytest.approx(20.0)  # of 10, 20, 40
    assert point.split_mean["compute"] == pytest.approx(5.0)


def test_bench_smoke_writes_every_output(model_dir, tmp_path):
    out = tmp_path / "bench"
    run = subprocess.run(
        [sys.executable, "-m", "services.cli.main", "bench", "--model", model_dir, "--connectors", "kvpush-push,kvpush-pull",
         "--input-lens", "200", "--rates", "3", "--requests", "5", "--warmup", "1", "--output-len", "8",
         "--out", str(out)],
        capture_output=True, text=True, timeout=500,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert {p["connector"] for p in results["points"]} == {"kvpush-push", "kvpush-pull"}
    assert len(results["requests"]) == 10 and all(r["ok"] for r in results["requests"])
    for request in results["requests"]:
        assert request["ttft_ms"] > 0 and request["tpot_ms"] > 0
        assert sum(request["split"].values()) > 0, "the TTFT split comes from the services' spans"
    rows = list(csv.DictReader(open(out / "requests.csv")))
    assert len(rows) == 10
    table = (out / "table.md").read_text()
    assert "kvpush-push" in table and "kvpush-pull" in table
    for name in ("latency-200.png", "ttft-split-200.png"):
        assert (out / "plots" / name).read_bytes()[:4] == b"\x89PNG"
