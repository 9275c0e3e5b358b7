"""End-to-end KV checksums catch corrupted KV (issue 29). A chaos point in decode's
connector (``kv.flip``, shared/chaos.py) flips one byte of one destination block of
every transfer after it landed and before the request runs. With ``--kv-checksums
full`` every flip is caught: the transfer fails, decode computes the prompt itself
(``kv_policy: recompute``), and no answer is wrong; in push, pull and layer-wise push.
With checksums off, the same run serves what the corrupted KV gives: the figure is
reported (docs/reliability.md), not hidden.

One 1P1D rig (tools/reliability/fault_rig.py), prefix caching off so every request's
whole prompt crosses and runs do not share KV; the reference is the same prompts
computed by decode alone (``local``: no transfer, nothing to corrupt).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import time

import pytest

from kvpush.shared import wire
from kvpush.tools.reliability.fault_rig import FaultRig, Outcome, running_rig
from tests import prompts

pytestmark = pytest.mark.timeout(1500)

REQUESTS = 200  # per run
CONCURRENT = 8
FLIP_EVERY_TRANSFER = {"kv.flip": {"flip": 1.0}}
SCHEDULERS = ("scheduler-0", "scheduler-1")


def corpus(seed: int = 29) -> list[list[int]]:
    """Prompts of 17..300 tokens (whole and partial blocks)."""
    rng = random.Random(seed)
    return [[rng.randrange(1, 4000) for _ in range(rng.randrange(17, 300))] for _ in range(REQUESTS)]


@pytest.fixture(scope="module")
async def rig(model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("checksums")
    env = {"KVPUSH_KV_CHECKSUMS": "full", "KVPUSH_TRACE_DIR": str(folder / "traces")}  # span files: kvpush explain
    async with running_rig(folder, model_dir, prompts.MAX_MODEL_LEN, extra_env=env, prefix_caching="off") as rig:
        yield rig


@pytest.fixture(scope="module")
async def reference(rig) -> list[list[int]]:
    outcomes = await run(rig, "local")
    assert all(isinstance(o.final, wire.FinalReply) for o in outcomes)
    return [o.tokens for o in outcomes]


async def run(rig: FaultRig, mode: str) -> list[Outcome]:
    gate = asyncio.Semaphore(CONCURRENT)

    async def one(index: int, prompt: list[int]) -> Outcome:
        async with gate:
            return await rig.request({"prompt_token_ids": prompt, "max_tokens": 4, "transfer_mode": mode,
                                      "request_id": f"sum-{mode}-{index}-{random.getrandbits(32):08x}"})

    return await asyncio.gather(*(one(i, p) for i, p in enumerate(corpus())))


async def flipped_run(rig: FaultRig, mode: str) -> tuple[list[Outcome], int]:
    """A run with a byte of every transfer flipped; (outcomes, flips injected)."""
    before = rig.injected()["flip"]
    await rig.apply_chaos(FLIP_EVERY_TRANSFER)
    try:
        outcomes = await run(rig, mode)
    finally:
        await rig.apply_chaos(None)
    return outcomes, rig.injected()["flip"] - before


async def set_checksums(rig: FaultRig, setting: str) -> None:
    """Both schedulers again, with ``--kv-checksums setting`` (the scheduler decides per transfer)."""
    rig.stack.extra_env["KVPUSH_KV_CHECKSUMS"] = setting
    for scheduler_id in SCHEDULERS:
        rig.kill_scheduler(scheduler_id)
        await rig.restart_scheduler(scheduler_id)


def record(rig: FaultRig, name: str, outcomes: list[Outcome], reference: list[list[int]], flips: int) -> dict:
    wrong_ok = sum(isinstance(o.final, wire.FinalReply) and o.tokens != want for o, want in zip(outcomes, reference))
    caught = sum(isinstance(o.final, wire.FinalReply) and o.final.path.kv_failure == "checksum_mismatch"
                 for o in outcomes)
    figures = {"run": name, "requests": len(outcomes), "flips": flips, "caught": caught, "wrong_with_status_ok": wrong_ok,
               "errors": sum(o.code is not None for o in outcomes)}
    with open(rig.folder / "checksum_figures.jsonl", "a") as out:
        out.write(json.dumps(figures) + "\n")
    print(figures)
    return figures


@pytest.mark.parametrize("mode", ["push", "pull"])
async def test_with_checksums_full_every_flipped_byte_is_caught_and_nothing_wrong_is_served(rig, reference, mode):
    mismatches = rig.metric("decode-0", "kvpush_kv_checksum_mismatches_total", engine_core=True)
    load_failures = rig.metric("decode-0", "kvpush_kv_load_failures_total", engine_core=True,
                               reason="checksum_mismatch")
    outcomes, flips = await flipped_run(rig, mode)
    figures = record(rig, f"{mode}, checksums full", outcomes, reference, flips)
    assert flips == REQUESTS  # every transfer was corrupted
    assert figures["wrong_with_status_ok"] == 0 and figures["errors"] == 0
    for outcome in outcomes:  # each caught, recomputed on decode, and said so
        path = outcome.final.path
        assert (path.mode, path.kv_failure, path.received_tokens) == (mode, "checksum_mismatch", 0), path
        assert path.recomputed_tokens == path.prompt_tokens
    # Decode's connector counts them, in its engine core's /metrics.
    assert rig.metric("decode-0", "kvpush_kv_checksum_mismatches_total", engine_core=True) == mismatches + REQUESTS
    assert rig.metric("decode-0", "kvpush_kv_load_failures_total", engine_core=True,
                      reason="checksum_mismatch") == load_failures + REQUESTS
    await rig.assert_blocks_back()


async def test_intact_transfers_are_verified_and_received(rig, reference):
    """No flips: the KV crosses, is checked, and the report says so; outputs equal."""
    outcomes = await run(rig, "push")
    for outcome, want in zip(outcomes, reference):
        assert outcome.tokens == want
        path = outcome.final.path
        assert (path.kv_checksum, path.received_tokens, path.recomputed_tokens) == (
            "verified", path.prompt_tokens, 0), path


async def test_kvpush_explain_prints_the_path_report_and_the_critical_path(rig, reference):
    """Asked as the client that sent it: the kept final's path report, and the trace's
    critical path from the span files."""
    request_id = f"explain-{random.getrandbits(32):08x}"
    outcome = await rig.request({"prompt_token_ids": corpus()[0], "max_tokens": 4, "transfer_mode": "pull",
                                 "request_id": request_id})
    assert outcome.tokens == reference[0]
    command = [sys.executable, "-m", "kvpush.services.cli.main", "explain", request_id, "--nats-url", rig.nats.url,
               "--dir", str(rig.folder / "traces")]
    env = {**os.environ, **rig.identity_env("client-0")}
    deadline = time.monotonic() + 40  # spans reach the files in batches
    while True:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
        if "critical path to the first token" in done.stdout or time.monotonic() > deadline:
            break
        await asyncio.sleep(2)
    assert done.returncode == 0, done.stderr
    assert "path: pull, chosen by request (the request asked for it)" in done.stdout, done.stdout
    assert "KV checksum: verified" in done.stdout and "workers: prefill prefill-0, decode decode-0" in done.stdout
    assert "critical path to the first token" in done.stdout and "transfer" in done.stdout, done.stdout
    # An id none of this client's requests had: nothing kept, exit 1.
    other = subprocess.run([*command[:4], "no-such-request", *command[5:]], env=env, capture_output=True, text=True,
                           timeout=60)
    assert other.returncode == 1 and "no final kept" in other.stdout, other.stdout


async def test_with_checksums_off_the_same_run_serves_the_corrupted_kv(rig, reference):
    await set_checksums(rig, "off")
    try:
        outcomes, flips = await flipped_run(rig, "push")
    finally:
        await set_checksums(rig, "full")
    figures = record(rig, "push, checksums off", outcomes, reference, flips)
    assert flips == REQUESTS and figures["errors"] == 0 and figures["caught"] == 0
    for outcome in outcomes:  # served from the KV as it landed: unchecked, nothing recomputed
        path = outcome.final.path
        assert (path.kv_checksum, path.recomputed_tokens, path.kv_failure) == ("unchecked", 0, ""), path
    await rig.assert_blocks_back()


async def test_layer_wise_push_is_checked_layer_by_layer(rig, reference):
    rig.stack.extra_env["KVPUSH_PUSH_BY_LAYER"] = "on"
    await rig.kill_and_replace("prefill")
    outcomes, flips = await flipped_run(rig, "push")
    figures = record(rig, "layer-wise push, checksums full", outcomes, reference, flips)
    assert flips == REQUESTS and figures["wrong_with_status_ok"] == 0 and figures["errors"] == 0
    assert figures["caught"] == REQUESTS
    await rig.assert_blocks_back()
    rig.assert_nothing_else_died()
