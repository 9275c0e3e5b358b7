"""`kvpush bench` in CI size: two connectors on one stack, a few requests, every output.
Its statistics are tested in tests/unit/test_bench_stats.py."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(600)


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
