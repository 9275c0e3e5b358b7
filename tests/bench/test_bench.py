"""`kvpush bench` in CI size: every system (kvpush push, pull, auto and local through its gateway, and
two `vllm serve` pairs with NixlConnector and NixlPushConnector behind their proxies),
one tiny point each, driven by `vllm bench serve`. It asserts the result files are
complete, not speed. The arithmetic is tested in tests/unit/test_bench_stats.py."""

from __future__ import annotations

import csv
import json

import pytest

from tests.early import BENCH_REQUESTS as REQUESTS, BENCH_VARIANTS as VARIANTS, EARLY, bench

pytestmark = pytest.mark.timeout(1200)


@pytest.fixture(scope="module")
def bench_run(model_dir):
    """The bench's run, in the session's background lane (tests/early.py): every system at
    128 tokens, 2 req/s, three requests and a warm-up, through `vllm bench serve`, with the
    hook that makes NixlConnector's first try at its point fail (its first attempt gets 1 s:
    the client is killed, a system that stopped answering) so the bench starts it again."""
    return EARLY.result("bench", lambda: bench(model_dir))


def test_bench_runs_every_system_with_vllms_client_and_keeps_every_result(bench_run):
    out = bench_run.out
    assert bench_run.returncode == 0, bench_run.output()[-4000:]
    results = json.loads((out / "results.json").read_text())
    assert results["errors"] == []
    retried = {row["variant"]: row for row in results["retried"]}
    assert "no result within 1 s" in retried["vllm-nixl"]["first_error"]  # failed once, measured again below
    assert not any(variant.startswith("kvpush") for variant in retried), "kvpush's points pass the first time"
    points = {p["variant"]: p for p in results["points"]}
    assert set(points) == set(VARIANTS)
    for variant, point in points.items():
        assert point["summary"]["completed"] == REQUESTS and point["summary"]["failed"] == 0, (variant, point)
        assert point["summary"]["p50_ttft_ms"] > 0 and point["summary"]["p50_tpot_ms"] > 0
        raw = json.loads((out / point["result_file"]).read_text())  # vLLM's own file, per request
        assert len(raw["ttfts"]) == REQUESTS and len(raw["itls"]) == REQUESTS
        assert all(length == 8 for length in raw["output_lens"]), "ignore_eos with a fixed output length"
        assert point["cpu_s_per_s"] and all(value >= 0 for value in point["cpu_s_per_s"].values())
    assert {"prefill-0", "decode-0", "scheduler", "gateway"} <= set(points["kvpush-push"]["cpu_s_per_s"])
    assert {"prefill-0", "decode-0", "proxy"} <= set(points["vllm-nixl"]["cpu_s_per_s"])
    for variant in ("kvpush-push", "kvpush-pull"):  # the TTFT split from our spans
        segments = points[variant]["segments_ms"]
        assert {"prefill compute", "decode first token"} <= set(segments), segments
        assert segments["prefill compute"]["n"] == REQUESTS
        assert points[variant]["handoff_overhead_ms"], "prefill finished to decode holding the KV, less the bytes"
    for variant in ("kvpush-local", "kvpush-auto"):  # 128-token prompts: auto computes them on decode too
        assert points[variant]["segments_ms"]["decode prompt and first token"]["n"] == REQUESTS, variant
    assert results["raw_nixl"] and all(row["raw_gib_s"] > 0 for row in results["raw_nixl"])
    idle = results["idle_cpu"]
    assert len(idle) == 1 and idle[0]["waiting_by_process"], "the decode's CPU while a request waits for KV"
    at_rest = {row["system"]: row for row in results["at_rest"]}  # each system with no request, its engines up
    assert set(at_rest) == {"kvpush", "vllm-nixl", "vllm-nixl-push"}
    for row in at_rest.values():
        assert {"prefill-0", "decode-0"} <= set(row["cpu_s_per_s"]), row
        assert all(0 <= row["busiest_thread_s_per_s"][name] <= rate + 0.05 for name, rate in row["cpu_s_per_s"].items())
    rows = list(csv.DictReader(open(out / "points.csv")))
    assert {row["variant"] for row in rows} == set(VARIANTS)
    tables = (out / "tables.md").read_text()
    for variant in VARIANTS:
        assert f"| {variant} |" in tables
    assert "### CPU at rest" in tables
    assert (out / "plots" / "latency-128_tokens.png").read_bytes()[:4] == b"\x89PNG"
