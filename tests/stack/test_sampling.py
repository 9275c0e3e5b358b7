"""Sampling across the split (issue 28): logprobs equal a single plain vLLM instance's,
whichever path the request took, a structured output holds from the answer's first token,
and what a chat front end sends is served. Decode (or a local request's own engine)
samples every token of the answer, the first one included; prefill's one token is never
part of it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import openai
import pytest

from kvpush.client import generate
from kvpush.shared import wire
from tests import prompts

pytestmark = pytest.mark.timeout(900)


def _openai(stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.gateway_url + "/v1", api_key="unused", max_retries=0)


async def test_a_choice_constrains_the_answer_and_a_grammar_the_engine_refuses_is_a_400(stack):
    oai = _openai(stack)
    reply = await oai.completions.create(model=Path(stack.model).name, prompt="yes or no?", max_tokens=8,
                                         temperature=1.0,
                                         extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert reply.choices[0].text in ("yes", "no")
    with pytest.raises(openai.BadRequestError) as refused:
        await oai.completions.create(model=Path(stack.model).name, prompt="x", max_tokens=4,
                                     extra_body={"structured_outputs": {"regex": "(unclosed"}})
    assert refused.value.body["code"] == "invalid_field" and "refused" in refused.value.body["message"]
    again = await oai.completions.create(model=Path(stack.model).name, prompt="x", max_tokens=2, temperature=0)
    assert again.choices[0].finish_reason == "length"


@pytest.mark.parametrize("mode", ["push", "pull", "local"])
async def test_logprobs_equal_a_single_instances_within_1e_4_in_every_mode(stack, nc, reference, reference_logprobs,
                                                                            mode):
    """Each token's logprob, and its candidates in the engine's order, as the single engine
    computed them; through the gateway too, as vLLM's server writes them."""
    at = prompts.LOGPROBS_AT
    bodies = [{"prompt_token_ids": prompt, "max_tokens": prompts.LOGPROBS_MAX_TOKENS, "ignore_eos": True,
               "request_id": f"logprobs-{mode}-{i}", "transfer_mode": mode, **sampling}
              for i, (prompt, sampling) in enumerate(prompts.LOGPROBS)]
    replies = await asyncio.gather(*(_replies(nc, body) for body in bodies))
    for i, chunks in enumerate(replies):
        token_ids = [t for c in chunks for t in c.token_ids]
        positions = [p for c in chunks for p in c.logprobs]
        assert token_ids == reference[at + i], i
        expected = reference_logprobs[at + i]
        assert len(positions) == len(expected) == len(token_ids)
        for got, want in zip(positions, expected):
            assert [c.token_id for c in got] == [token_id for token_id, _ in want]
            assert all(abs(c.logprob - logprob) <= 1e-4 for c, (_, logprob) in zip(got, want)), (got, want)
            assert all(c.token is not None for c in got)  # decoded by the engine ("" for a byte piece)
    # through the gateway: as the completions API writes them
    prompt, sampling = prompts.LOGPROBS[0]
    reply = await _openai(stack).completions.create(
        model=Path(stack.model).name, prompt=prompt, max_tokens=prompts.LOGPROBS_MAX_TOKENS, temperature=0,
        logprobs=5, extra_body={"ignore_eos": True, "transfer_mode": mode})
    logprobs = reply.choices[0].logprobs
    want = reference_logprobs[at]
    assert len(logprobs.token_logprobs) == len(want)
    assert all(abs(got - position[0][1]) <= 1e-4 for got, position in zip(logprobs.token_logprobs, want))
    assert all(len(top) == 6 or len(top) == 5 for top in logprobs.top_logprobs)  # the sampled one and 5 more


async def _replies(nc, body: dict) -> list[wire.TokenChunk]:
    chunks = []
    async for reply in generate(nc, body):
        if isinstance(reply, wire.TokenChunk):
            chunks.append(reply)
        else:
            assert isinstance(reply, wire.FinalReply), reply
    return chunks


async def test_the_openai_client_streams_a_chat_with_top_p_and_presence_penalty(stack):
    """What a chat front end sends by default: served on real engines, not refused."""
    events = [e async for e in await _openai(stack).chat.completions.create(
        model=Path(stack.model).name, messages=[{"role": "user", "content": "tell me about NATS"}], max_tokens=12,
        temperature=0.8, top_p=0.9, presence_penalty=0.5, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True})]
    text = "".join(e.choices[0].delta.content or "" for e in events if e.choices)
    assert text and events[-1].usage.completion_tokens == 12
    assert [e.choices[0].finish_reason for e in events if e.choices][-1] == "length"
