"""The OpenAI-compatible gateway, driven by the real ``openai`` client and plain HTTP, over
a real nats-server, a real scheduler and fake workers (tests/nats/test_scheduler.py's,
which answer with REPLY_TOKENS). The built-in model's tokenizer renders chat prompts.
Each test runs on a plain server (the gateway anonymous) and on the deployed per-identity
one (tests/nats/deployed.py; the gateway a client identity of its own).

What an answer says, how each error maps to an HTTP status and an OpenAI error object,
the request id, the trace, and a client that disconnects mid-stream."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import urllib.parse

import httpx
import openai
import pytest

from kvpush.services.gateway.service import Gateway
from kvpush.services.scheduler.service import Scheduler
from kvpush.services.scheduler.validation import load_validator
from kvpush.shared import wire
from tests.nats.test_scheduler import MAX_MODEL_LEN as WORKERS_MAX_MODEL_LEN
from tests.nats.test_scheduler import (  # noqa: F401  (fixtures)
    PLAIN_ONLY,
    REPLY_TOKENS,
    FakeWorker,
    client,
    running,
    server,
    until,
    workers_seen,
)

pytestmark = pytest.mark.timeout(90)

TEXT = "".join(chr(ord("a") + t % 26) for t in REPLY_TOKENS)  # what the fake decode streams
MAX_MODEL_LEN = 256


def scheduler(server, model_dir: str, **kwargs) -> Scheduler:
    """A scheduler with the built-in model's tokenizer, as the gateway renders chats with it."""
    name = server.identity("scheduler")
    return Scheduler(server.url_for(name), load_validator(model_dir, MAX_MODEL_LEN), scheduler_id=name, **kwargs)


def password_of(server, name: str) -> str | None:
    """``name``'s NATS password on the deployed server (None on the plain one)."""
    return urllib.parse.urlsplit(server.url_for(name)).password


@contextlib.contextmanager
def environment(variables: dict[str, str]):
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.asynccontextmanager
async def gateway_on(server, model_dir: str, **kwargs):
    """The gateway on a free port. On the deployed server it logs in as a client identity
    of its own, as ``kvpush gateway`` does: from KVPUSH_NATS_USER and _PASSWORD (set only
    while it connects, so that no other connection of the test reads them)."""
    login = {}
    if server.deployed:
        name = server.identity("client")
        login = {"KVPUSH_NATS_USER": name, "KVPUSH_NATS_PASSWORD": password_of(server, name)}
    gateway = Gateway(server.url, model_dir, port=0, **kwargs)
    with environment(login):
        await gateway.__aenter__()
    try:
        yield gateway
    finally:
        await gateway.close()


@pytest.fixture
async def stack(server, client, running, model_dir):
    """A scheduler, a prefill and a decode (answering), and the gateway on a free port."""
    sched = await running(scheduler(server, model_dir, deadline_s=5.0))
    prefill = await running(FakeWorker(server, "prefill", "answer"))
    decode = await running(FakeWorker(server, "decode", "answer"))
    await workers_seen(client, prefill, decode)
    gateway = await running(gateway_on(server, model_dir))
    return sched, prefill, decode, gateway


def api(gateway: Gateway) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)


async def test_a_completion_streamed_and_whole_is_what_decode_sent(stack):
    _, _, decode, gateway = stack
    oai = api(gateway)
    whole = await oai.completions.create(model=gateway.served_model_name, prompt="hello", max_tokens=3,
                                         temperature=0)
    assert whole.choices[0].text == TEXT and whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == len(REPLY_TOKENS)
    assert whole.usage.prompt_tokens == len(gateway.prompts.tokenizer.encode("hello"))
    assert whole.object == "text_completion" and whole.model == gateway.served_model_name

    events = [e async for e in await oai.completions.create(
        model=gateway.served_model_name, prompt=[1, 2, 3], max_tokens=3, temperature=0, stream=True,
        stream_options={"include_usage": True})]
    assert "".join(e.choices[0].text for e in events if e.choices) == TEXT
    assert events[-1].choices == [] and events[-1].usage.completion_tokens == len(REPLY_TOKENS)
    assert [e.choices[0].finish_reason for e in events if e.choices][-1] == "length"
    assert decode.jobs[-1].prompt_token_ids == [1, 2, 3]


async def test_a_chat_is_rendered_with_the_models_template_and_answered(stack):
    _, _, decode, gateway = stack
    oai = api(gateway)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def main():"}]
    whole = await oai.chat.completions.create(model=gateway.served_model_name, messages=messages,
                                              max_completion_tokens=3, temperature=0)
    assert whole.choices[0].message.content == TEXT and whole.choices[0].message.role == "assistant"
    expected = gateway.prompts.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                     return_dict=False)
    assert decode.jobs[-1].prompt_token_ids == expected
    assert decode.jobs[-1].sampling.max_tokens == 3

    events = [e async for e in await oai.chat.completions.create(
        model=gateway.served_model_name, messages=messages, max_tokens=3, temperature=0, stream=True)]
    assert events[0].choices[0].delta.role == "assistant"
    assert "".join(e.choices[0].delta.content or "" for e in events) == TEXT


async def test_tokenize_detokenize_and_version_answer_as_vllm_serves_them(stack):
    _, _, _, gateway = stack
    tokenizer = gateway.prompts.tokenizer
    messages = [{"role": "user", "content": "def main():"}]
    async with httpx.AsyncClient() as http:
        text = await http.post(gateway.url + "/tokenize", json={"prompt": "import os"})
        assert text.json()["tokens"] == tokenizer.encode("import os") and text.json()["count"] > 0
        chat = await http.post(gateway.url + "/tokenize", json={"messages": messages})
        assert chat.json()["tokens"] == tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                                      tokenize=True, return_dict=False)
        back = await http.post(gateway.url + "/detokenize", json={"tokens": text.json()["tokens"]})
        assert back.json() == {"prompt": tokenizer.decode(text.json()["tokens"])}
        for path, body, code in [("/tokenize", {"prompt": 3}, "invalid_field"),
                                 ("/tokenize", {"prompt": "x", "messages": messages}, "invalid_field"),
                                 ("/detokenize", {"tokens": [len(tokenizer)]}, "invalid_field"),
                                 ("/detokenize", {"tokens": [1], "model": "gpt-9"}, "not_found")]:
            refused = await http.post(gateway.url + path, json=body)
            assert refused.status_code in (400, 404) and refused.json()["error"]["code"] == code, (path, body)
        assert (await http.get(gateway.url + "/version")).json()["version"]


async def test_the_openai_clients_sampling_fields_reach_the_decode_job_with_vllms_meaning(stack):
    """What a chat front end sends by default (top_p, penalties, a seed with temperature)
    is served, not refused, and decode gets it as vLLM's SamplingParams would."""
    _, _, decode, gateway = stack
    oai = api(gateway)
    events = [e async for e in await oai.chat.completions.create(
        model=gateway.served_model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
        temperature=0.8, top_p=0.9, presence_penalty=0.5, frequency_penalty=0.25, seed=7,
        logit_bias={"5": 250}, stream=True,
        extra_body={"top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 2,
                    "stop_token_ids": [3], "bad_words": ["xyz"], "include_stop_str_in_output": True})]
    assert "".join(e.choices[0].delta.content or "" for e in events) == TEXT
    sampling = decode.jobs[-1].sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.min_p) == (0.8, 0.9, 40, 0.05)
    assert (sampling.presence_penalty, sampling.frequency_penalty, sampling.repetition_penalty) == (0.5, 0.25, 1.1)
    assert sampling.seed == 7 and sampling.min_tokens == 2 and sampling.stop_token_ids == [3]
    assert sampling.logit_bias == {5: 100.0}  # clamped, as vLLM's SamplingParams.from_optional does
    assert sampling.bad_words == ["xyz"] and sampling.include_stop_str_in_output


async def test_what_vllm_bench_serve_sends_is_served(stack):
    """Its payload as vLLM 0.32's benchmark client builds it, neutral fields and all."""
    _, _, decode, gateway = stack
    payload = {"model": gateway.served_model_name, "prompt": "hello", "repetition_penalty": 1.0, "max_tokens": 3,
               "logprobs": None, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    async with httpx.AsyncClient() as http:
        reply = await http.post(gateway.url + "/v1/completions", json=payload,
                                headers={"x-request-id": "benchmark-serving0"})
    assert reply.status_code == 200 and reply.headers["x-request-id"] == "benchmark-serving0"
    lines = [line for line in reply.text.split("\n\n") if line]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2].removeprefix("data: "))["usage"]["completion_tokens"] == len(REPLY_TOKENS)
    assert decode.jobs[-1].request_id == "benchmark-serving0" and decode.jobs[-1].sampling.ignore_eos


@pytest.mark.parametrize("body, status, code", [
    ({"prompt": "hello", "max_tokens": 0}, 400, "invalid_field"),
    ({"prompt": "hello", "max_tokens": 10**9}, 400, "invalid_field"),
    ({"prompt": "hello", "max_tokens": "ten"}, 400, "invalid_field"),
    ({"prompt": ""}, 400, "empty_prompt"),
    ({"prompt": "def f(x):\n    return x\n" * 200}, 400, "prompt_too_long"),
    ({"prompt": "hello", "n": 17}, 400, "invalid_field"),
    ({"prompt": "hello", "top_p": 1.5}, 400, "invalid_field"),
    ({"prompt": "hello", "frobnicate": True}, 400, "invalid_field"),
    ({"prompt": ["a", "b"]}, 400, "invalid_field"),
    ({"prompt": "hello", "model": "gpt-9"}, 404, "not_found"),
], ids=["max-tokens-0", "max-tokens-huge", "max-tokens-type", "empty", "too-long", "n-17", "top-p", "unknown",
        "two-prompts", "model"])
async def test_bad_input_gets_its_status_and_an_openai_error_and_the_next_request_is_served(stack, body, status,
                                                                                           code):
    _, _, _, gateway = stack
    async with httpx.AsyncClient() as http:
        reply = await http.post(gateway.url + "/v1/completions", json=body)
        assert reply.status_code == status, reply.text
        error = reply.json()["error"]
        assert error["code"] == code and error["message"] and error["type"]
        assert (await http.post(gateway.url + "/v1/completions",
                                json={"prompt": "hello", "max_tokens": 3})).status_code == 200


async def test_malformed_json_and_a_body_too_large_are_refused(stack):
    _, _, _, gateway = stack
    async with httpx.AsyncClient() as http:
        reply = await http.post(gateway.url + "/v1/completions", content=b"{not json",
                                headers={"content-type": "application/json"})
        assert reply.status_code == 400 and reply.json()["error"]["code"] == "bad_json"
        big = json.dumps({"prompt": "x" * (gateway.nc.max_payload + 10)})
        reply = await http.post(gateway.url + "/v1/completions", content=big.encode(),
                                headers={"content-type": "application/json"})
        assert reply.status_code == 413 and reply.json()["error"]["code"] == "payload_too_large"


async def test_the_openai_client_raises_its_own_errors_for_ours(stack):
    _, _, _, gateway = stack
    oai = api(gateway)
    with pytest.raises(openai.BadRequestError) as bad:
        await oai.completions.create(model=gateway.served_model_name, prompt="hello", max_tokens=0)
    assert bad.value.body["code"] == "invalid_field"
    with pytest.raises(openai.NotFoundError):
        await oai.completions.create(model="another", prompt="hello")


async def test_overloaded_no_workers_and_deadline_map_to_429_503_504(server, client, running, model_dir):
    sched = await running(scheduler(server, model_dir, max_in_flight=1, deadline_s=1.5))
    prefill = await running(FakeWorker(server, "prefill", "hold"))
    decode = await running(FakeWorker(server, "decode", "hold"))
    await workers_seen(client, prefill, decode)
    gateway = await running(gateway_on(server, model_dir))
    async with httpx.AsyncClient(timeout=30) as http:
        held = asyncio.create_task(http.post(gateway.url + "/v1/completions", json={"prompt": "hi"}))
        await until(lambda: len(sched.flights) == 1, what="the first request held")
        over = await http.post(gateway.url + "/v1/completions", json={"prompt": "hi"})
        assert over.status_code == 429 and over.json()["error"]["code"] == "overloaded"
        late = await held
        assert late.status_code == 504 and late.json()["error"]["code"] == "deadline_exceeded"
        await prefill.stop_heartbeats()
        await decode.stop_heartbeats()
        await until(lambda: not sched.pool.live("prefill", __import__("time").monotonic()), timeout=10,
                    what="the workers lost")
        ready = await http.get(gateway.url + "/ready")
        assert ready.status_code == 503 and ready.json()["ready"] is False


async def test_health_ready_models_and_a_generated_request_id(stack):
    _, _, decode, gateway = stack
    async with httpx.AsyncClient() as http:
        assert (await http.get(gateway.url + "/health")).json() == {"status": "ok"}
        ready = await http.get(gateway.url + "/ready")
        assert ready.status_code == 200 and ready.json()["prefill_workers"] == 1
        models = (await http.get(gateway.url + "/v1/models")).json()
        assert [m["id"] for m in models["data"]] == [gateway.served_model_name]
        # the workers' context, from their heartbeats (not the tokenizer's model_max_length)
        assert models["data"][0]["max_model_len"] == WORKERS_MAX_MODEL_LEN != gateway.prompts.tokenizer.model_max_length
        reply = await http.post(gateway.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 3})
    assert reply.headers["x-request-id"] == decode.jobs[-1].request_id
    assert reply.json()["id"] == "cmpl-" + decode.jobs[-1].request_id


@PLAIN_ONLY  # it listens on kvpush.generate beside the schedulers, which no deployed identity may
async def test_an_incoming_traceparent_joins_the_requests_trace(stack, client):
    _, _, _, gateway = stack
    seen = []

    async def listen(msg):
        seen.append(msg.headers or {})

    await client.subscribe(wire.GENERATE_SUBJECT, cb=listen)  # beside the scheduler's queue group
    await client.flush()
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    async with httpx.AsyncClient() as http:
        reply = await http.post(gateway.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 3},
                                headers={"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"})
    assert reply.status_code == 200
    await until(lambda: seen, what="the request on NATS")
    assert seen[0]["traceparent"].split("-")[1] == trace_id


async def test_a_client_that_disconnects_mid_stream_cancels_its_request(server, client, running, model_dir):
    sched = await running(scheduler(server, model_dir))
    prefill = await running(FakeWorker(server, "prefill", "hold"))
    decode = await running(FakeWorker(server, "decode", "start_then_hold"))
    await workers_seen(client, prefill, decode)
    gateway = await running(gateway_on(server, model_dir))
    async with httpx.AsyncClient(timeout=30) as http:
        async with http.stream("POST", gateway.url + "/v1/completions",
                               json={"prompt": "hello", "max_tokens": 3, "stream": True}) as reply:
            async for line in reply.aiter_lines():
                if line.startswith("data: "):
                    break  # the first token came: go away
    await until(lambda: decode.cancels, timeout=10, what="the decode's CancelJob")
    assert decode.cancels[0].reason == "cancelled"
    await until(lambda: len(sched.flights) == 0, what="the flight's end")
