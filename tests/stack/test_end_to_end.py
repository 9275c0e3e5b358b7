"""The whole stack on real parts: nats-server, scheduler, prefill and decode workers on
vLLM, KV pushed by NIXL WRITE. Output must equal a single plain vLLM instance's."""

from __future__ import annotations

import asyncio

import pytest

from kvpush.client import generate, generate_all
from kvpush.shared import wire
from tests import prompts

pytestmark = pytest.mark.timeout(900)


@pytest.mark.parametrize("mode", ["push", "pull"])
async def test_disaggregated_output_equals_a_single_instance(stack, nc, reference, mode):
    requests = [
        {"prompt_token_ids": p, "max_tokens": n, "ignore_eos": True, "request_id": f"eq-{mode}-{name}",
         "transfer_mode": mode}
        for name, p, n in prompts.CORRECTNESS
    ]
    results = await asyncio.gather(*(generate_all(nc, body) for body in requests))
    for (name, prompt, max_tokens), expected, (token_ids, _, final) in zip(
        prompts.CORRECTNESS, reference, results
    ):
        assert isinstance(final, wire.FinalReply), (name, final)
        assert final.request_id == f"eq-{mode}-{name}"
        assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (len(prompt), len(expected))
        # prefill's prefix-cache hits (the session's other tests may have sent the prompt)
        assert final.usage.cached_tokens is not None and 0 <= final.usage.cached_tokens < len(prompt)
        assert token_ids == expected, name


async def test_replies_stream_in_chunks_then_one_final_message(stack, nc):
    replies = [r async for r in generate(nc, {"prompt": "def main():", "max_tokens": 12, "ignore_eos": True})]
    chunks, final = replies[:-1], replies[-1]
    assert len(chunks) >= 2, "tokens should stream, not arrive all at once"
    assert all(isinstance(c, wire.TokenChunk) and c.finished is False and c.token_ids for c in chunks)
    assert sum(len(c.token_ids) for c in chunks) == 12
    assert [c.seq for c in chunks] == list(range(len(chunks)))  # a gap would be a lost chunk
    assert isinstance(final, wire.FinalReply) and final.chunks == len(chunks)
    assert final.finished is True and final.finish_reason == "length"
    assert final.usage.completion_tokens == 12
    timings = final.timings
    assert 0 < timings.ttft_ms <= timings.e2e_ms
    assert timings.tpot_ms > 0


async def test_text_prompt_is_tokenized_like_the_engine(stack, nc):
    token_ids, text, final = await generate_all(nc, {"prompt": "import os\n", "max_tokens": 8})
    assert final.finish_reason in ("length", "stop")
    assert final.usage.prompt_tokens > 0
    assert len(token_ids) == final.usage.completion_tokens
    assert isinstance(text, str)
