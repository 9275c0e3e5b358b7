"""`kvpush bench-scheduler` in CI size: the real scheduler (its own process), a real
nats-server with JetStream and the real client, against the bench's idle stand-in
workers (its load generator, not kvpush's workers). It asserts that every request was
answered right and that every stand-in was used, not speed."""

from __future__ import annotations

import json
import sys

import pytest

from tests.bench.whole_group import run_whole

from kvpush.tools.bench.scheduler_rate import expected_tokens

pytestmark = pytest.mark.timeout(300)

REQUESTS = 200
WARMUP = 20


def test_every_request_gets_its_own_single_token_and_every_stand_in_works(model_dir, tmp_path):
    out = tmp_path / "scheduler"
    run = run_whole(
        [sys.executable, "-m", "kvpush.services.cli.main", "bench-scheduler", "--model", model_dir,
         "--requests", str(REQUESTS), "--warmup", str(WARMUP), "--concurrency", "16", "--topologies", "2P2D",
         "--time-limit-s", "120", "--detail", "--out", str(out)],
        timeout=280,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    results = json.loads((out / "scheduler_rate.json").read_text())
    assert results["errors"] == []
    (point,) = results["points"]
    assert (point["started"], point["ok"], point["errors"], point["wrong"]) == (REQUESTS, REQUESTS, {}, 0)
    vocab = json.loads(open(f"{model_dir}/config.json").read())["vocab_size"]
    detail = point["detail"]
    assert len(detail) == REQUESTS and len({r["request_id"] for r in detail}) == REQUESTS
    for record in detail:  # checked here again, from what the client received
        final = record["final"]
        assert record["error"] == "" and "error" not in final, record
        assert record["tokens"] == expected_tokens(record["prompt"], 1, vocab) and record["chunks"] == [0]
        assert (final["finished"], final["finish_reason"], final["chunks"]) == (True, "length", 1)
        assert final["usage"] == {"prompt_tokens": 128, "completion_tokens": 1}
        assert final["request_id"] == record["request_id"] and record["latency_ms"] > 0
    assert point["rate_rps"] > 0 and point["latency_ms"]["p50"] > 0
    done = point["scheduler_done"]
    assert done["all_done"] and done["rate_rps"] > 0, "the scheduler ended every flight"
    assert point["cpu_ms_per_request"]["scheduler"] > 0 and point["cpu_s"]["nats_server"] >= 0
    jobs = point["jobs_per_worker"]
    assert set(jobs) == {"prefill-0", "prefill-1", "decode-0", "decode-1"}
    assert all(count > 0 for count in jobs.values()), jobs
    for role in ("prefill", "decode"):  # each request once to one prefill and one decode: no retries
        assert sum(count for worker, count in jobs.items() if worker.startswith(role)) == REQUESTS, jobs
    stand_ins = point["stand_ins"]
    for prefill in ("prefill-0", "prefill-1"):  # every registration met its prompt, none was refused
        assert stand_ins[prefill]["transfers"] == stand_ins[prefill]["jobs"] and stand_ins[prefill]["refused"] == 0
    for decode in ("decode-0", "decode-1"):
        assert stand_ins[decode]["finals"] == stand_ins[decode]["jobs"] and stand_ins[decode]["fenced"] == 0
    for moment in ("machine_start", "machine_end"):
        assert len(point[moment]["loadavg"]) == 3 and point[moment]["nproc"] >= 1
    assert "| 2P2D | 16 | 200/200 |" in run.stdout
