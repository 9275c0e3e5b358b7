"""`kvpush up` as a user runs it: its own NATS server, one ready line, requests served,
and Ctrl-C stops every child cleanly. Its engines run vLLM's own NixlConnector
(``--connector vllm-nixl``): the same stack, scheduler, workers and client path with vLLM's
pull connector in the engines instead of ours, its outputs equal to a single vLLM
instance's (vLLM's NixlPushConnector: tests/stack/test_vllm_connectors.py). One start of
the stack serves both checks. Runs last-ish (file name) to reuse a warm machine."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import nats
import psutil
import pytest

from kvpush.client import generate_all
from kvpush.shared import wire
from tests import prompts

pytestmark = pytest.mark.timeout(600)

PICKS = [0, 2, 4]  # short, one block, many blocks


async def test_up_serves_vllms_connector_then_ctrl_c_stops_everything(model_dir, reference, tmp_path):
    env = {**os.environ, "KVPUSH_LOG_LEVEL": "WARNING"}
    up = subprocess.Popen(
        [sys.executable, "-m", "kvpush.services.cli.main", "up", "--model", model_dir, "--prefill", "1", "--decode", "1",
         "--connector", "vllm-nixl", "--max-model-len", str(prompts.MAX_MODEL_LEN)],
        stdout=subprocess.PIPE, stderr=open(tmp_path / "up.log", "wb"), env=env, text=True,
        start_new_session=True,  # a terminal's Ctrl-C goes to the whole process group
    )
    try:
        ready = (await asyncio.to_thread(up.stdout.readline)).split()
        assert ready[:1] == ["ready"], (ready, (tmp_path / "up.log").read_text()[-3000:])
        nats_url = ready[1]
        assert nats_url.startswith("nats://127.0.0.1:")
        children = psutil.Process(up.pid).children(recursive=True)
        assert len(children) >= 4  # nats-server, scheduler, two workers (and their engines)

        conn = await nats.connect(nats_url)
        try:
            results = await asyncio.gather(*(
                generate_all(conn, {"prompt_token_ids": prompts.CORRECTNESS[i][1],
                                    "max_tokens": prompts.CORRECTNESS[i][2], "ignore_eos": True})
                for i in PICKS))
        finally:
            await conn.close()
        for i, (tokens, _, final) in zip(PICKS, results):
            assert isinstance(final, wire.FinalReply), final
            assert final.path.mode == "pull", final.path  # vLLM's NixlConnector pulls
            assert tokens == reference[i], prompts.CORRECTNESS[i][0]

        generated = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "kvpush.services.cli.main", "generate", "--nats-url", nats_url, "--max-tokens", "5",
             "--ignore-eos", "def main():"],
            capture_output=True, text=True, timeout=120,
        )
        assert generated.returncode == 0, generated.stderr[-2000:]
        assert "finish_reason=length tokens=5" in generated.stderr

        os.killpg(up.pid, signal.SIGINT)
        assert await asyncio.to_thread(up.wait, 120) == 0
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children):
            await asyncio.sleep(0.5)
        alive = [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
        assert alive == [], [c.cmdline()[:4] for c in alive]
        log = (tmp_path / "up.log").read_text()
        assert "Traceback" not in log and "never retrieved" not in log, log[-3000:]  # a clean stop
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()
