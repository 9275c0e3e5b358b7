"""The client side of kvpush.generate and kvpush.cancel, against a real NATS server (no
scheduler: the test plays it)."""

from __future__ import annotations

import asyncio
import json
import uuid

import nats
import pytest

from services.cli import main as cli
from services.cli.client import cancel, client_of, generate
from shared import permissions, wire
from services.launch.natsd import LocalNatsServer
from shared.errors import NoScheduler, PayloadTooLarge


def _collect(into: list):
    async def on_msg(msg):
        into.append(msg.data)

    return on_msg


async def _until(condition, timeout: float = 5.0) -> None:
    """Poll ``condition()`` until it holds; fail after ``timeout`` seconds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"not within {timeout} s"
        await asyncio.sleep(0.01)


async def test_a_request_over_the_servers_payload_limit_is_refused_before_sending(nc):
    seen = []
    sub = await nc.subscribe(wire.GENERATE_SUBJECT, cb=_collect(seen))
    huge = {"prompt": "x" * (nc.max_payload + 1)}
    with pytest.raises(PayloadTooLarge, match="max_payload"):
        async for _ in generate(nc, huge):
            pass
    await nc.flush()
    await sub.unsubscribe()
    assert seen == []


async def test_leaving_the_stream_early_cancels_the_request(nc):
    """The client stops reading after the first chunk: it unsubscribes and sends a cancel."""
    cancels: list[bytes] = []

    async def fake_scheduler(msg):
        chunk = wire.TokenChunk(request_id="r-early", token_ids=[1], text="a")
        await nc.publish(msg.reply, wire.encode_json(chunk))

    sched = await nc.subscribe(wire.GENERATE_SUBJECT, cb=fake_scheduler)
    cancel_sub = await nc.subscribe(wire.CANCEL_SUBJECT, cb=_collect(cancels))
    async for reply in generate(nc, {"prompt": "hi", "request_id": "r-early"}):
        assert reply["token_ids"] == [1]
        break
    await _until(lambda: cancels)  # the generator's cleanup runs as a task once it is dropped
    await nc.flush()
    await sched.unsubscribe()
    await cancel_sub.unsubscribe()
    assert [json.loads(c) for c in cancels] == [{"request_id": "r-early"}]


async def test_the_cancel_command_publishes_the_request_id(nc, nats_server):
    cancels: list[bytes] = []
    sub = await nc.subscribe(wire.CANCEL_SUBJECT, cb=_collect(cancels))
    await nc.flush()
    code = await asyncio.to_thread(cli.main, ["cancel", "r-42", "--nats-url", nats_server.url])
    assert code == 0
    await _until(lambda: cancels)
    await nc.flush()
    await sub.unsubscribe()
    assert [wire.decode_json(c, wire.CancelRequest).request_id for c in cancels] == ["r-42"]


async def test_a_request_nobody_listens_for_is_refused_with_a_sentence():
    with LocalNatsServer() as server:  # its own server: no scheduler of another test can answer
        conn = await nats.connect(server.url)
        try:
            with pytest.raises(NoScheduler, match="no scheduler is listening on kvpush.generate"):
                async for _ in generate(conn, {"prompt": "hi", "request_id": "r-alone"}, timeout=10):
                    pass
        finally:
            await conn.close()


async def test_a_named_client_requests_and_cancels_on_its_own_subjects(nc, nats_server):
    """A connection logged in as a client has its inboxes under ``_INBOX.<client>``
    (``connect_options`` sets the prefix); it sends on ``kvpush.generate.<client>``, and
    leaving the stream early cancels on ``kvpush.cancel.<client>``: the only subjects the
    scheduler lets cancel its requests."""
    name = f"app-{uuid.uuid4().hex[:8]}"
    requests: list[tuple[str, str]] = []
    cancels: list[tuple[str, bytes]] = []

    async def fake_scheduler(msg):
        requests.append((msg.subject, msg.reply))
        await nc.publish(msg.reply, wire.encode_json(wire.TokenChunk(request_id="r-named", token_ids=[1], text="a")))

    async def on_cancel(msg):
        cancels.append((msg.subject, msg.data))

    subs = [await nc.subscribe(wire.OWNED_GENERATE.wildcard, cb=fake_scheduler),
            await nc.subscribe(wire.OWNED_CANCEL.wildcard, cb=on_cancel),
            await nc.subscribe(wire.GENERATE_SUBJECT, cb=fake_scheduler),
            await nc.subscribe(wire.CANCEL_SUBJECT, cb=on_cancel)]
    await nc.flush()
    named = await nats.connect(nats_server.url, inbox_prefix=permissions.client_inbox(name))
    try:
        assert (client_of(named), client_of(nc)) == (name, "")
        async for reply in generate(named, {"prompt": "hi", "request_id": "r-named"}):
            assert reply["token_ids"] == [1]
            break
        await _until(lambda: cancels)
        await cancel(named, "r-again")
        await _until(lambda: len(cancels) == 2)
        await named.flush()
        await nc.flush()
    finally:
        await named.close()
        for sub in subs:
            await sub.unsubscribe()
    [(subject, reply_to)] = requests
    assert subject == wire.OWNED_GENERATE(client=name)
    assert reply_to.startswith(f"{wire.CLIENT_INBOX_PREFIX}.{name}.")
    assert [(s, json.loads(c)) for s, c in cancels] == [
        (wire.OWNED_CANCEL(client=name), {"request_id": "r-named"}),
        (wire.OWNED_CANCEL(client=name), {"request_id": "r-again"})]
