"""Two API keys, each its own kvpush client with its own NATS user (the keys file's
``nats_user``), send the same ``X-Request-Id``: each gets its own answer, and a cancel or
a final fetched again through one key never touches the other's request. On the deployed
server (tests/nats/deployed.py: the per-identity config ``kvpush.shared.permissions.render_config``
writes, with TLS) NATS lets each tenant's connection send only on its own subjects and
read only its own inbox; the scheduler keys requests by (client, id). On the plain server
only the scheduler's keying keeps them apart. Real nats-server, scheduler and gateway
(``kvpush.client`` on the gateway's own tenant connections), fake workers."""

from __future__ import annotations

import asyncio
import time

import openai
import pytest

from kvpush.client import ask_final, cancel, client_of
from kvpush.services.gateway.keys import KeyRing
from kvpush.shared import wire
from tests.nats.test_gateway import REPLY_TOKENS, TEXT, gateway_on, password_of, scheduler
from tests.nats.test_scheduler import (  # noqa: F401  (fixtures)
    FakeWorker,
    client,
    running,
    server,
    until,
    workers_seen,
)

pytestmark = pytest.mark.timeout(90)

SAME = {"x-request-id": "same-id"}


@pytest.fixture
def tenants(server, tmp_path) -> tuple[KeyRing, str, str]:
    """team-a and team-b, each logged in as a client identity of its own."""
    users = [server.identity("client") for _ in range(2)]
    text = "".join(f'[tenants.team-{t}]\nkey = "sk-team-{t}"\nnats_user = "{user}"\n'
                   f'nats_password = "{password_of(server, user) or "unused"}"\n\n'
                   for t, user in zip("ab", users))
    path = tmp_path / "keys.toml"
    path.write_text(text)
    return KeyRing.from_file(path), *users


def api(gateway, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0)


async def final_of(nc, request_id: str, timeout: float = 5.0) -> wire.LastMessage:
    """The final kept for ``request_id``, asked as ``nc``'s client, once it is kept (or
    the schedulers' ``not_found``)."""
    deadline = time.monotonic() + timeout
    while True:
        final = await ask_final(nc, request_id)
        if final is not None and not (isinstance(final, wire.ErrorReply) and final.error.code == "in_flight"):
            return final
        assert time.monotonic() < deadline, f"no final kept for {request_id} within {timeout} s: {final}"
        await asyncio.sleep(0.05)


async def test_two_tenants_with_one_request_id_each_get_their_own_and_never_touch_the_others(
        server, client, running, model_dir, tenants):
    keys, user_a, user_b = tenants
    sched = await running(scheduler(server, model_dir, deadline_s=20.0))
    prefill = await running(FakeWorker(server, "prefill", "answer"))
    decode = await running(FakeWorker(server, "decode", "start_then_hold"))
    await workers_seen(client, prefill, decode)
    gateway = await running(gateway_on(server, model_dir, keys=keys))
    a_nc = gateway.connection(keys.tenant("Bearer sk-team-a"))
    b_nc = gateway.connection(keys.tenant("Bearer sk-team-b"))
    assert (client_of(a_nc), client_of(b_nc)) == (user_a, user_b)  # each tenant its own kvpush client

    # team-a's request is in flight, held after its first token.
    a = await api(gateway, "sk-team-a").completions.with_raw_response.create(
        model=gateway.served_model_name, prompt=[1, 2, 3, 4], max_tokens=3, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_headers=SAME)
    a_events = a.parse()
    a_first = await a_events.__anext__()
    a_job = decode.jobs[-1]

    # team-b, same id, meanwhile: its own request, its own answer.
    decode.on_job = "answer"
    b = await api(gateway, "sk-team-b").completions.with_raw_response.create(
        model=gateway.served_model_name, prompt=[1], max_tokens=3, temperature=0, extra_headers=SAME)
    b_answer = b.parse()
    assert b.headers["x-request-id"] == "same-id" and b_answer.id == "cmpl-same-id"
    assert b_answer.choices[0].text == TEXT and b_answer.usage.prompt_tokens == 1
    assert [job.request_id for job in decode.jobs] == ["same-id", "same-id"]  # no prefix: two clients

    # Fetched again through team-b: team-b's final, not team-a's (in flight).
    b_final = await final_of(b_nc, "same-id")
    assert b_final.usage.prompt_tokens == 1

    # A cancel of "same-id" through team-b, then one of a request team-b holds: once the
    # second has reached the decode, the scheduler has handled the first (one subscription,
    # in order), and team-a's request is untouched.
    decode.on_job = "start_then_hold"
    b_held = await api(gateway, "sk-team-b").completions.create(
        model=gateway.served_model_name, prompt=[1, 2], max_tokens=3, temperature=0, stream=True,
        extra_headers={"x-request-id": "b-held"})
    await b_held.__anext__()
    b_held_job = decode.jobs[-1]
    await cancel(b_nc, "same-id")
    await cancel(b_nc, "b-held")
    await until(lambda: b_held_job.transfer_id in {c.transfer_id for c in decode.cancels},
                what="team-b's cancel of its own held request at the decode")
    assert a_job.transfer_id not in {c.transfer_id for c in decode.cancels}
    assert sched.flights.by_request(user_a, "same-id") is not None

    # team-a's request ends as it would have: every token, its own usage.
    decode.release.set()
    a_rest = [e async for e in a_events]
    assert a.headers["x-request-id"] == "same-id"
    assert "".join([a_first.choices[0].text] + [e.choices[0].text for e in a_rest if e.choices]) == TEXT
    assert a_rest[-1].usage.prompt_tokens == 4 and a_rest[-1].usage.completion_tokens == len(REPLY_TOKENS)

    # Each tenant's "same-id" final is its own, fetched through its own connection.
    assert (await final_of(a_nc, "same-id")).usage.prompt_tokens == 4
    assert (await final_of(b_nc, "same-id")).usage.prompt_tokens == 1
