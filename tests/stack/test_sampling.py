"""Sampling across the split (issue 28): a request sampled with a seed gives the tokens a
single plain vLLM instance gives with the same seed, whichever path it took, and a
structured output holds from the answer's first token. Decode (or a local request's own
engine) samples every token of the answer, the first one included, from the request's own
seeded generator; prefill's one token is never part of it."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path

import jsonschema
import openai
import pytest

from kvpush.client import generate, generate_all
from kvpush.otel import attributes as A
from kvpush.otel import trace_view as view
from kvpush.shared import wire
from tests import prompts

pytestmark = pytest.mark.timeout(900)

COUNT = len(prompts.SEEDED)


def _references(reference: list[list[int]]) -> tuple[list, list, list]:
    at = prompts.SEEDED_AT
    return reference[at:at + COUNT], reference[at + COUNT:at + 2 * COUNT], reference[at + 2 * COUNT:at + 3 * COUNT]


def test_the_references_sample_so_a_dropped_field_would_show(reference):
    """The single engine's answers with seed 7 differ from its greedy ones and from seed
    8's: a path that ignored temperature, top_p or the seed could not match them."""
    seed7, seed8, greedy = _references(reference)
    assert sum(a != b for a, b in zip(seed7, greedy)) >= COUNT - 2
    assert sum(a != b for a, b in zip(seed7, seed8)) >= COUNT - 2


@pytest.mark.parametrize("mode", ["push", "pull", "local"])
async def test_seeded_sampling_equals_a_single_instance_in_every_mode(stack, nc, reference, mode):
    seed7, _, _ = _references(reference)
    bodies = [{"prompt_token_ids": prompt, "max_tokens": prompts.SEEDED_MAX_TOKENS, "ignore_eos": True,
               "request_id": f"seeded-{mode}-{i}", "transfer_mode": mode, **prompts.SEEDED_SAMPLING}
              for i, prompt in enumerate(prompts.SEEDED)]
    results = await asyncio.gather(*(generate_all(nc, body) for body in bodies))
    differ = []
    for i, (expected, (token_ids, _, final)) in enumerate(zip(seed7, results)):
        assert isinstance(final, wire.FinalReply), (i, final)
        if token_ids != expected:
            differ.append((i, len(prompts.SEEDED[i]), token_ids, expected))
    assert not differ, f"{len(differ)} of {COUNT} differ from the single engine: {differ[:3]}"


@pytest.mark.parametrize("mode", ["push", "pull", "local"])
async def test_n_4_moves_the_kv_once_and_samples_the_single_engines_four_answers(stack, nc, otlp, reference, mode):
    """n = 4, seeded: one prefill, one registration and one WRITE in the trace (push and
    pull move the prompt's KV once), and answer i equals the single engine's answer i
    (vLLM samples it with seed + i); the final gives each answer's finish reason."""
    request_id = f"n4-{mode}-{uuid.uuid4().hex[:6]}"
    body = {"prompt_token_ids": prompts.N_PROMPT, "max_tokens": prompts.SEEDED_MAX_TOKENS, "ignore_eos": True,
            "request_id": request_id, "transfer_mode": mode, **prompts.N_SAMPLING}
    answers: dict[int, list[int]] = {}
    final = None
    async for reply in generate(nc, body):
        if isinstance(reply, wire.TokenChunk):
            answers.setdefault(reply.index, []).extend(reply.token_ids)
        else:
            final = reply
    assert isinstance(final, wire.FinalReply), final
    expected = reference[prompts.N_AT]
    assert len(expected) == 4 and len({tuple(a) for a in expected}) > 1, "the reference's answers differ"
    assert [answers.get(i) for i in range(4)] == expected
    assert final.finish_reasons == ["length"] * 4 and final.usage.completion_tokens == 4 * prompts.SEEDED_MAX_TOKENS
    if mode == "local":
        return

    def moved_once(spans):
        trace = view.find_trace(spans, request_id)
        names = [s["name"] for s in trace or []]
        return names if A.DECODE in names and (A.KV_WRITE in names or A.KV_READ in names) else None

    names = otlp.wait_for(moved_once, timeout=20)
    assert names, "the request's trace did not arrive"
    assert names.count(A.PREFILL) == 1
    assert names.count(A.KV_WRITE) + names.count(A.KV_READ) == 1, sorted(names)


# Bounded: enums and fixed fields, so a random-weight model closes its JSON; no free
# whitespace (vLLM's disable_any_whitespace), which such a model would otherwise spin in.
PICK = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"enum": ["S", "M", "L"]},
                                         "count": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["color", "size", "count"], "additionalProperties": False}


def _openai(stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.gateway_url + "/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("mode", ["push", "pull", "local"])
async def test_a_json_schema_answer_parses_and_validates_in_every_mode(stack, mode):
    """Decode samples every token of the answer, so the grammar holds from the first token
    on, whichever engine computed the prompt."""
    oai = _openai(stack)

    async def one(i: int):
        reply = await oai.chat.completions.create(
            model=Path(stack.model).name, messages=[{"role": "user", "content": f"pick one, {i}"}], max_tokens=48,
            temperature=0.8, seed=i, response_format={"type": "json_schema", "json_schema": {"name": "pick",
                                                                                              "schema": PICK}},
            extra_body={"transfer_mode": mode})  # compact JSON: the stack's decode has --json-whitespace none
        return reply.choices[0]

    for choice in await asyncio.gather(*(one(i) for i in range(6))):
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), PICK)


WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER, "strict": True}},
         {"type": "function", "function": {"name": "get_time", "strict": True, "parameters": {
             "type": "object", "properties": {}, "additionalProperties": False}}}]


def _no_whitespace(model: str) -> dict[str, int]:
    """A bias against every all-whitespace token: vLLM lets JSON inside a tool call's
    arguments have any whitespace (its --json-whitespace does not reach tool grammars), and
    a random-weight model would spin in it until max_tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    return {str(i): -100 for i in range(len(tokenizer)) if tokenizer.decode([i]).isspace()}


@pytest.mark.parametrize("mode", ["push", "pull", "local"])
async def test_tool_calls_parse_to_the_named_function_with_valid_arguments(stack, mode):
    """A strict tool: the call names the function asked for (or one of the tools, when
    some call is required) and its arguments validate against its schema, whole and
    streamed (the real openai client gathers the streamed call)."""
    oai = _openai(stack)
    bias = _no_whitespace(stack.model)

    async def call(i: int, choice, stream: bool = False, **more):
        request = dict(model=Path(stack.model).name, messages=[{"role": "user", "content": f"weather {i}, please"}],
                       tools=TOOLS, tool_choice=choice, max_tokens=160, temperature=0.8, seed=i, logit_bias=bias,
                       extra_body={"transfer_mode": mode}, **more)
        if not stream:
            reply = await oai.chat.completions.create(**request)
            return reply.choices[0].message.tool_calls, reply.choices[0].finish_reason
        calls: dict[int, dict] = {}
        finish = None
        async for event in await oai.chat.completions.create(**request, stream=True):
            for piece in event.choices:
                finish = piece.finish_reason or finish
                for delta in piece.delta.tool_calls or []:
                    entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                    entry["name"] += delta.function.name or ""
                    entry["arguments"] += delta.function.arguments or ""
        return [openai.types.chat.ChatCompletionMessageToolCall(
            id=f"s{i}", type="function", function={"name": c["name"], "arguments": c["arguments"]})
            for _, c in sorted(calls.items())], finish

    named = {"type": "function", "function": {"name": "get_weather"}}
    # parallel_tool_calls false: one call, then the end (else the grammar allows more calls)
    results = await asyncio.gather(*(call(i, named, parallel_tool_calls=False) for i in range(3)),
                                   call(3, named, stream=True, parallel_tool_calls=False))
    for calls, finish in results:
        assert finish == "stop" and len(calls) == 1, (calls, finish)  # a named call keeps the engine's reason
        assert calls[0].function.name == "get_weather"
        jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER)
    calls, finish = await call(4, "required", parallel_tool_calls=False)  # one call, then the end
    assert finish == "tool_calls" and len(calls) == 1 and all(c.function.name in ("get_weather", "get_time") for c in calls)
    for c in calls:
        if c.function.name == "get_weather":
            jsonschema.validate(json.loads(c.function.arguments), WEATHER)


async def test_a_choice_constrains_the_answer_and_a_grammar_the_engine_refuses_is_a_400(stack):
    oai = _openai(stack)
    reply = await oai.completions.create(model=Path(stack.model).name, prompt="yes or no?", max_tokens=8,
                                         temperature=1.0, seed=3,
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
