"""Bounded work before the bounds: a body is refused (413) the moment it would pass the
limit, whatever its transfer encoding, and the gateway never holds more of it; a prompt
too long in bytes is refused before anything tokenizes it; the chat template runs off the
event loop. Real nats-server, scheduler and gateway, fake workers, as
tests/nats/test_gateway.py."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from tests.nats.test_gateway import TEXT, gateway_on, scheduler
from tests.nats.test_scheduler import (  # noqa: F401  (fixtures)
    FakeWorker,
    client,
    running,
    server,
    until,
    workers_seen,
)
from kvpush.tools.bench import gateway_body

pytestmark = pytest.mark.timeout(120)

MIB = 1024 * 1024


class WatchedTemplate:
    """The model's own tokenizer, its chat template watched: on which thread it renders,
    and, with ``hold``, held there until the test lets it go (``release``)."""

    def __init__(self, tokenizer, hold: bool = False):
        self._tokenizer = tokenizer
        self.hold = hold
        self.threads: list[int] = []
        self.entered = threading.Event()
        self.release = threading.Event()
        self.released_by_test: bool | None = None

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def apply_chat_template(self, *args, **kwargs):
        self.threads.append(threading.get_ident())
        self.entered.set()
        if self.hold:  # on the event loop, this would stop it until the wait gave up
            self.released_by_test = self.release.wait(timeout=30)
        return self._tokenizer.apply_chat_template(*args, **kwargs)


@pytest.fixture
async def stack(server, client, running, model_dir):
    sched = await running(scheduler(server, model_dir, deadline_s=10.0))
    prefill = await running(FakeWorker(server, "prefill", "answer"))
    decode = await running(FakeWorker(server, "decode", "answer"))
    await workers_seen(client, prefill, decode)
    return sched, prefill, decode


def chunked(total: int, prefix: bytes = b'{"prompt": "', suffix: bytes = b'", "max_tokens": 3}', chunk: int = 65536):
    """A JSON body of about ``total`` bytes, sent chunked (a generator: no Content-Length)."""
    async def body():
        yield prefix
        left = total
        while left > 0:
            yield b"x" * min(chunk, left)
            left -= chunk
        yield suffix
    return body()


async def test_a_chunked_body_is_counted_and_refused_at_the_limit_and_one_under_it_is_served(stack, running,
                                                                                            model_dir, server):
    gateway = await running(gateway_on(server, model_dir))
    limit = gateway.nc.max_payload
    async with httpx.AsyncClient(timeout=30) as http:
        over = await http.post(gateway.url + "/v1/completions", content=chunked(limit + 1),
                               headers={"content-type": "application/json"})
        assert "content-length" not in over.request.headers and over.request.headers["transfer-encoding"] == "chunked"
        assert over.status_code == 413 and over.json()["error"]["code"] == "payload_too_large"
        assert f"over the {limit}-byte limit" in over.json()["error"]["message"]
        under = await http.post(gateway.url + "/v1/completions", content=chunked(1000, b'{"prompt": [1, 2, 3', b"]}"),
                                headers={"content-type": "application/json"})
        assert under.status_code == 400 and under.json()["error"]["code"] == "bad_json"  # read whole: "1, 2, 3xxx..."
        whole = await http.post(gateway.url + "/v1/completions",
                                content=chunked(0, b'{"prompt": "hello", "max_tokens": 3}', b""),
                                headers={"content-type": "application/json"})
        assert whole.status_code == 200 and whole.json()["choices"][0]["text"] == TEXT


def test_a_96_mib_chunked_body_costs_the_gateway_process_less_than_20_mib():
    """``kvpush gateway`` in its own process (tools/bench/gateway_body.py), NATS's
    max_payload 8 MB: its peak RSS (the kernel's high-water mark) before and after."""
    measured = gateway_body.measure(gateway_body.REPO, mib=96)
    assert measured["status"] == 413 and measured["error"] == "payload_too_large", measured
    assert measured["hwm_growth_mib"] < 20, measured
    assert measured["sent_mib"] < 96, measured  # the connection closed: the rest was never read


async def test_a_prompt_too_long_in_bytes_is_refused_before_anything_tokenizes_it(stack, running, model_dir, server):
    """The gateway serves a 4-token context here, the scheduler 256 tokens: a refusal that
    names 4 tokens is the gateway's own, given before the request left it."""
    gateway = await running(gateway_on(server, model_dir, max_model_len=4))
    watched = gateway.prompts.tokenizer = WatchedTemplate(gateway.prompts.tokenizer)
    bound = gateway.prompts.max_prompt_bytes
    async with httpx.AsyncClient(timeout=30) as http:
        chat = await http.post(gateway.url + "/v1/chat/completions",
                               json={"messages": [{"role": "user", "content": "y" * bound}], "max_tokens": 1})
        text = await http.post(gateway.url + "/v1/completions", json={"prompt": "é" * (bound // 2 + 1),
                                                                      "max_tokens": 1, "temperature": 0})
        fits = await http.post(gateway.url + "/v1/completions", json={"prompt": "ok", "max_tokens": 1,
                                                                      "temperature": 0})
    for refused in (chat, text):
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["code"] == "prompt_too_long"
        assert f"more than 4 tokens of this model can hold (at most {bound} bytes)" in error["message"]
    assert not watched.threads  # the chat template never ran
    assert fits.status_code == 200 and fits.json()["choices"][0]["text"] == TEXT[:1]


async def test_the_chat_template_runs_off_the_event_loop_which_answers_meanwhile(stack, running, model_dir, server):
    gateway = await running(gateway_on(server, model_dir))
    watched = gateway.prompts.tokenizer = WatchedTemplate(gateway.prompts.tokenizer, hold=True)
    loop_thread = threading.get_ident()
    async with httpx.AsyncClient(timeout=60) as http:
        chat = asyncio.get_running_loop().create_task(http.post(
            gateway.url + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "def main():"}], "max_tokens": 3, "temperature": 0}))
        assert await asyncio.to_thread(watched.entered.wait, 30), "the chat template never ran"
        health = await http.get(gateway.url + "/health")  # the template is held: only a free loop answers
        watched.release.set()
        reply = await chat
    assert health.status_code == 200
    assert watched.released_by_test is True  # let go by the test, after /health, not by its own timeout
    assert watched.threads and loop_thread not in watched.threads
    assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] == TEXT
