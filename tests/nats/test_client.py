"""The client side of kvpush.generate and kvpush.cancel, against a real NATS server (no
scheduler: the test plays it)."""

from __future__ import annotations

import asyncio
import json

import pytest

from services.cli import main as cli
from services.cli.client import generate
from shared import wire
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
    import nats

    with LocalNatsServer() as server:  # its own server: no scheduler of another test can answer
        conn = await nats.connect(server.url)
        try:
            with pytest.raises(NoScheduler, match="no scheduler is listening on kvpush.generate"):
                async for _ in generate(conn, {"prompt": "hi", "request_id": "r-alone"}, timeout=10):
                    pass
        finally:
            await conn.close()
