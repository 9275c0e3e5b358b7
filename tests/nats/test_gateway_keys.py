"""The gateway's API keys and per-key limits, driven by the real ``openai`` client over a
real nats-server, a real scheduler and fake workers (tests/nats/test_scheduler.py's):
401 without a valid key, 429 past a key's concurrency or rate, each as OpenAI's error
object; and two keys that send the same ``X-Request-Id`` through one NATS identity each
get their own answer. (With a NATS user per key, on the per-identity server:
tests/nats/test_gateway_tenants.py.)"""

from __future__ import annotations

import httpx
import openai
import pytest

from kvpush.services.gateway.keys import KeyRing
from kvpush.services.gateway.limits import Limits
from kvpush.services.gateway.service import Gateway
from tests.nats.test_gateway import REPLY_TOKENS, TEXT, gateway_on, scheduler
from tests.nats.test_scheduler import (  # noqa: F401  (fixtures)
    FakeWorker,
    client,
    running,
    server,
    until,
    workers_seen,
)

pytestmark = pytest.mark.timeout(90)

KEYS = """
[tenants.team-a]
key = "sk-team-a"
max_concurrent = 1

[tenants.team-b]
key = "sk-team-b"

[tenants.team-c]
key = "sk-team-c"
rate_per_s = 0.001
burst = 2
"""


@pytest.fixture
async def workers(server, client, running, model_dir):
    sched = await running(scheduler(server, model_dir, deadline_s=10.0))
    prefill = await running(FakeWorker(server, "prefill", "answer"))
    decode = await running(FakeWorker(server, "decode", "answer"))
    await workers_seen(client, prefill, decode)
    return sched, prefill, decode


@pytest.fixture
def keys(tmp_path) -> KeyRing:
    path = tmp_path / "keys.toml"
    path.write_text(KEYS)
    return KeyRing.from_file(path)


def api(gateway: Gateway, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0)


async def complete(gateway: Gateway, key: str, **fields):
    return await api(gateway, key).completions.create(
        model=gateway.served_model_name, **({"prompt": "hello", "max_tokens": 3, "temperature": 0} | fields))


async def test_without_a_valid_key_v1_is_401_as_an_openai_error_and_health_needs_none(workers, running,
                                                                                      model_dir, server):
    gateway = await running(gateway_on(server, model_dir, keys=KeyRing.single("sk-right")))
    with pytest.raises(openai.AuthenticationError) as refused:
        await complete(gateway, "sk-wrong")
    assert refused.value.status_code == 401
    assert refused.value.body["code"] == "invalid_api_key" and refused.value.body["type"] == "invalid_request_error"
    assert "not valid" in refused.value.body["message"]
    async with httpx.AsyncClient() as http:
        for method, path in (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models")):
            reply = await http.request(method, gateway.url + path, json={"prompt": "hello"})
            assert reply.status_code == 401, path
            assert reply.json()["error"]["code"] == "invalid_api_key" and reply.json()["error"]["message"]
        for path in ("/health", "/ready", "/metrics"):
            assert (await http.get(gateway.url + path)).status_code == 200, path
    answer = await complete(gateway, "sk-right")
    assert answer.choices[0].text == TEXT


async def test_a_key_past_its_concurrency_limit_gets_429_and_other_keys_are_served(workers, running, model_dir,
                                                                                  server, keys):
    _, _, decode = workers
    decode.on_job = "start_then_hold"  # team-a's first request streams one token, then waits
    gateway = await running(gateway_on(server, model_dir, keys=keys))
    held = await api(gateway, "sk-team-a").completions.create(
        model=gateway.served_model_name, prompt="hello", max_tokens=3, temperature=0, stream=True)
    first = await held.__anext__()
    assert first.choices[0].text == TEXT[0]
    decode.on_job = "answer"
    with pytest.raises(openai.RateLimitError) as refused:
        await complete(gateway, "sk-team-a")
    assert refused.value.status_code == 429
    assert refused.value.body["code"] == "concurrency_limit_exceeded"
    assert refused.value.body["type"] == "rate_limit_error" and "max_concurrent 1" in refused.value.body["message"]
    assert (await complete(gateway, "sk-team-b")).choices[0].text == TEXT  # its own limits
    decode.release.set()
    assert "".join([first.choices[0].text] + [e.choices[0].text async for e in held]) == TEXT
    await until(lambda: gateway.limiter(keys.tenant("Bearer sk-team-a")).in_progress == 0,
                what="team-a's stream to give its place back")
    assert (await complete(gateway, "sk-team-a")).choices[0].text == TEXT


async def test_a_key_past_its_rate_gets_429_with_retry_after_and_other_keys_are_served(workers, running, model_dir,
                                                                                      server, keys):
    gateway = await running(gateway_on(server, model_dir, keys=keys))
    for _ in range(2):  # its burst
        assert (await complete(gateway, "sk-team-c")).choices[0].text == TEXT
    with pytest.raises(openai.RateLimitError) as refused:
        await complete(gateway, "sk-team-c")
    assert refused.value.body["code"] == "rate_limit_exceeded" and refused.value.body["type"] == "rate_limit_error"
    assert int(refused.value.response.headers["retry-after"]) > 900  # 0.001 requests/s: one in 1,000 s
    assert (await complete(gateway, "sk-team-b")).choices[0].text == TEXT


async def test_two_keys_sharing_the_gateways_identity_with_one_request_id_each_get_their_own(workers, running,
                                                                                             model_dir, server, keys):
    """Both keys have no NATS user of their own: the gateway keeps their ids apart (``<tenant>/``)."""
    _, _, decode = workers
    decode.on_job = "start_then_hold"
    gateway = await running(gateway_on(server, model_dir, keys=keys))
    same = {"x-request-id": "same-id"}
    a = await api(gateway, "sk-team-a").completions.with_raw_response.create(
        model=gateway.served_model_name, prompt=[1, 2, 3, 4], max_tokens=3, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_headers=same)
    a_events = a.parse()
    a_first = await a_events.__anext__()  # team-a's request is in flight, held after its first token
    decode.on_job = "answer"
    b = await api(gateway, "sk-team-b").completions.with_raw_response.create(
        model=gateway.served_model_name, prompt=[1], max_tokens=3, temperature=0, extra_headers=same)
    b_answer = b.parse()
    assert b.headers["x-request-id"] == "same-id" and b_answer.id == "cmpl-same-id"
    assert b_answer.choices[0].text == TEXT and b_answer.usage.prompt_tokens == 1  # its own, not team-a's
    decode.release.set()
    a_rest = [e async for e in a_events]
    assert a.headers["x-request-id"] == "same-id"
    assert "".join([a_first.choices[0].text] + [e.choices[0].text for e in a_rest if e.choices]) == TEXT
    assert a_rest[-1].usage.prompt_tokens == 4 and a_rest[-1].usage.completion_tokens == len(REPLY_TOKENS)
    assert sorted(job.request_id for job in decode.jobs) == ["team-a/same-id", "team-b/same-id"]
    assert not decode.cancels
