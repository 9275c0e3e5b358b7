"""The client side of kvpush.generate and kvpush.cancel, against a real NATS server (no
scheduler: the test plays it)."""

from __future__ import annotations

import asyncio
import json
import uuid

import nats
import pytest

from kvpush.services.cli import main as cli
from kvpush.client import cancel, client_of, generate
from kvpush.shared import permissions, wire
from kvpush.services.launch.natsd import LocalNatsServer
from kvpush.shared.errors import NoScheduler, PayloadTooLarge


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
        assert reply.token_ids == [1]
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


async def test_a_request_refused_while_schedulers_reconnect_is_sent_again_and_served():
    """NATS answers "no responders" while no scheduler listens (a failover: they are on
    their way to another server). The client sends again until one listens, within its
    grace, and gets that scheduler's answer instead of NoScheduler."""
    with LocalNatsServer() as server:
        client, scheduler = await nats.connect(server.url), await nats.connect(server.url)
        try:
            sent_before = client.stats["out_msgs"]
            served = asyncio.create_task(_collect_replies(generate(client, {"prompt": "hi", "request_id": "r-late"},
                                                                   timeout=30, no_scheduler_grace_s=30)))
            await _until(lambda: client.stats["out_msgs"] >= sent_before + 2, 10)  # refused once, sent again

            async def answer(msg):
                await scheduler.publish(msg.reply, wire.encode_json(wire.FinalReply(
                    "r-late", "length", wire.Usage(1, 0), wire.Timings(0, 0, 0))))

            await scheduler.subscribe(wire.GENERATE_SUBJECT, cb=answer)
            await scheduler.flush()
            replies = await asyncio.wait_for(served, 30)
            assert [type(r).__name__ for r in replies] == ["FinalReply"] and replies[0].request_id == "r-late"
        finally:
            await client.close()
            await scheduler.close()


async def _collect_replies(stream) -> list:
    return [reply async for reply in stream]


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
            assert reply.token_ids == [1]
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


async def _stream_with(nc, replies: list, request_id: str) -> list[wire.Reply]:
    """Play decode: answer the request with ``replies`` (TokenChunk / FinalReply), in order."""
    async def fake_decode(msg):
        for reply in replies:
            await nc.publish(msg.reply, wire.encode_json(reply))

    sched = await nc.subscribe(wire.GENERATE_SUBJECT, cb=fake_decode)
    try:
        return [reply async for reply in generate(nc, {"prompt": "hi", "request_id": request_id}, timeout=5)]
    finally:
        await sched.unsubscribe()


def _chunk(request_id: str, seq: int) -> wire.TokenChunk:
    return wire.TokenChunk(request_id=request_id, token_ids=[seq + 1], text="t", seq=seq)


def _final(request_id: str, chunks: int) -> wire.FinalReply:
    return wire.FinalReply(request_id=request_id, finish_reason="length", usage=wire.Usage(3, chunks),
                           timings=wire.Timings(1.0, 1.0, 1.0), chunks=chunks)


async def test_a_whole_stream_ends_with_its_final(nc):
    replies = await _stream_with(nc, [_chunk("r-whole", 0), _chunk("r-whole", 1), _final("r-whole", 2)], "r-whole")
    assert [r.token_ids for r in replies[:-1]] == [[1], [2]]
    assert isinstance(replies[-1], wire.FinalReply) and replies[-1].finish_reason == "length"


async def test_a_chunk_lost_mid_stream_ends_the_request_with_stream_lost_not_a_short_answer(nc):
    """A NATS server that dies mid-stream takes the chunks it held: chunk 1 never comes."""
    cancels: list[bytes] = []
    cancel_sub = await nc.subscribe(wire.CANCEL_SUBJECT, cb=_collect(cancels))
    replies = await _stream_with(nc, [_chunk("r-gap", 0), _chunk("r-gap", 2), _final("r-gap", 3)], "r-gap")
    assert [r.token_ids for r in replies[:-1]] == [[1]]  # nothing after the gap is passed on
    assert isinstance(replies[-1], wire.ErrorReply) and replies[-1].error.code == "stream_lost"
    assert "chunk 1 never arrived" in replies[-1].error.message
    await _until(lambda: cancels)  # the rest of the request is cancelled
    await cancel_sub.unsubscribe()
    assert json.loads(cancels[0])["request_id"] == "r-gap"


async def test_chunks_lost_at_the_end_turn_the_final_into_stream_lost(nc):
    replies = await _stream_with(nc, [_chunk("r-tail", 0), _final("r-tail", 3)], "r-tail")
    assert isinstance(replies[-1], wire.ErrorReply) and replies[-1].error.code == "stream_lost"
    assert "2 of its 3 token chunks never arrived" in replies[-1].error.message


async def _generate_against(nc, request_id: str, on_generate, final_code: str) -> list[wire.Reply]:
    """generate() against a scheduler played by ``on_generate`` that answers every
    ``kvpush.final`` with ``final_code`` (``not_found`` or ``in_flight``)."""
    async def final_requests(msg):
        body = wire.ErrorReply(request_id, wire.ErrorBody(final_code, f"request {request_id!r}: {final_code}"))
        await nc.publish(msg.reply, wire.encode_json(body))

    subs = [await nc.subscribe(wire.GENERATE_SUBJECT, cb=on_generate),
            await nc.subscribe(wire.FINAL_SUBJECT, cb=final_requests)]
    try:
        return [r async for r in generate(nc, {"prompt": "hi", "request_id": request_id}, timeout=5,
                                          refetch_after_s=0.2)]
    finally:
        for sub in subs:
            await sub.unsubscribe()


async def test_a_request_no_scheduler_got_is_sent_again_on_the_same_inbox(nc):
    """The first publish is lost on its way (a NATS server died with it): on the client's
    next silence the schedulers say ``not_found``, and it sends the same request again."""
    arrived: list = []

    async def scheduler_that_missed_the_first(msg):
        arrived.append((json.loads(msg.data)["request_id"], msg.reply))
        if len(arrived) == 1:
            return  # lost
        for reply in (_chunk("r-lost", 0), _final("r-lost", 1)):
            await nc.publish(msg.reply, wire.encode_json(reply))

    replies = await _generate_against(nc, "r-lost", scheduler_that_missed_the_first, "not_found")
    assert [type(r) for r in replies] == [wire.TokenChunk, wire.FinalReply] and replies[0].token_ids == [1]
    assert len(arrived) == 2 and arrived[0] == arrived[1]  # the same id on the same inbox


async def test_a_request_in_flight_is_not_sent_again(nc):
    arrived: list = []

    async def slow_scheduler(msg):
        arrived.append(msg.reply)
        await asyncio.sleep(0.8)
        for reply in (_chunk("r-slow", 0), _final("r-slow", 1)):
            await nc.publish(msg.reply, wire.encode_json(reply))

    replies = await _generate_against(nc, "r-slow", slow_scheduler, "in_flight")
    assert isinstance(replies[-1], wire.FinalReply) and replies[-1].finish_reason == "length"
    assert len(arrived) == 1


async def test_a_request_that_streamed_and_is_then_forgotten_ends_with_an_error_not_a_timeout(nc):
    """Its end was lost with a NATS server (nothing kept it): every scheduler says
    ``not_found``. The client ends it with stream_lost, and does not send it again."""
    arrived: list = []

    async def scheduler_whose_end_was_lost(msg):
        arrived.append(msg.reply)
        await nc.publish(msg.reply, wire.encode_json(_chunk("r-forgotten", 0)))

    started = asyncio.get_running_loop().time()
    replies = await _generate_against(nc, "r-forgotten", scheduler_whose_end_was_lost, "not_found")
    assert asyncio.get_running_loop().time() - started < 5  # the timeout, had it waited on
    assert replies[0].token_ids == [1]
    assert isinstance(replies[-1], wire.ErrorReply) and replies[-1].error.code == "stream_lost"
    assert "no scheduler knows it any more" in replies[-1].error.message
    assert len(arrived) == 1
