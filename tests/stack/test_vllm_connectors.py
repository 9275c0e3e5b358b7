"""vLLM's own push connector as a peer: the same stack (scheduler, workers, client path) with
vLLM's NixlPushConnector in the engines instead of ours. Its pull connector, NixlConnector,
runs in the engines `kvpush up` starts in tests/stack/test_cli_up.py (one stack start for
both checks)."""

from __future__ import annotations

import asyncio

import nats
import pytest

from kvpush.client import generate_all
from kvpush.services.launch.natsd import LocalNatsServer
from kvpush.services.launch.stack import Stack
from kvpush.shared import wire
from tests import prompts

pytestmark = pytest.mark.timeout(600)


async def test_vllms_push_connector_serves_through_the_stack(model_dir, reference, tmp_path):
    connector = "vllm-nixl-push"
    # A NATS server of its own, so this stack's workers never mix with the session's.
    with LocalNatsServer() as server:
        peer = Stack(model_dir, nats_url=server.url, max_model_len=prompts.MAX_MODEL_LEN,
                     connector=connector, log_dir=tmp_path)
        peer.start()
        try:
            await peer.wait_ready(timeout=300)
            conn = await nats.connect(server.url)
            try:
                picks = [0, 2, 4]  # short, one block, many blocks
                results = await asyncio.gather(*(
                    generate_all(conn, {"prompt_token_ids": prompts.CORRECTNESS[i][1],
                                        "max_tokens": prompts.CORRECTNESS[i][2], "ignore_eos": True})
                    for i in picks
                ))
            finally:
                await conn.close()
        finally:
            peer.stop()
    for i, (tokens, _, final) in zip(picks, results):
        assert isinstance(final, wire.FinalReply), final
        assert tokens == reference[i], prompts.CORRECTNESS[i][0]
