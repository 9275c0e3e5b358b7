"""Flights outlive their scheduler: a real nats-server with JetStream, schedulers, and
fake workers (tests/nats/test_scheduler.py's). A scheduler dies as a ``kill -9`` leaves
it: its tasks stop where they are and its connection drops, with no word to anyone.
Another scheduler takes its flights over and finishes each with exactly one final.

Also here: the answer claim (a fenced attempt's decode sends nothing), a final a client
missed and fetches again (``kvpush.final``), and a deadline while decode streams (the
decode, which holds the answer, says it; the scheduler does not say it twice)."""

from __future__ import annotations

import asyncio
import json
import time

import nats
import pytest

from kvpush.client import fetch_final, generate
from kvpush.client import client_of
from kvpush.services.ledger import ClaimState
from kvpush.services.scheduler.service import Scheduler
from kvpush.shared import wire
from tests.nats.test_scheduler import (  # noqa: F401  (fixtures)
    FakeWorker,
    REPLY_TOKENS,
    WORKER_TIMEOUT_S,
    cancelled,
    client,
    generate_subject,
    holds,
    running,
    scheduler,
    server,
    until,
    workers_seen,
)

pytestmark = pytest.mark.timeout(90)

SCHEDULER_TIMEOUT_S = 1.0


def takeover_scheduler(server, **kwargs) -> Scheduler:
    return scheduler(server, worker_timeout_s=WORKER_TIMEOUT_S, scheduler_timeout_s=SCHEDULER_TIMEOUT_S, **kwargs)


async def die(s: Scheduler) -> None:
    """What ``kill -9`` leaves of a scheduler: nothing runs, the connection drops."""
    s._closed = True  # the fixture's close() finds nothing left to do
    for task in (s._watch, s._mirror, s._beats):
        task.cancel()
    await s._requests.close()
    await s.bus.nc.close()


class Replies:
    """Everything that comes to one client inbox, in order (NATS' own statuses apart)."""

    def __init__(self) -> None:
        self.messages: list[dict] = []
        self.no_responders = 0  # 503s: the request found no subscriber, and was sent again

    def finals(self) -> list[dict]:
        return [m for m in self.messages if m.get("finished")]

    def tokens(self) -> list[int]:
        return [t for m in self.messages if not m.get("finished") for t in m["token_ids"]]


async def send(client, request_id: str, **body) -> Replies:
    """Publish a request with an inbox of our own, and collect what comes there."""
    replies = Replies()
    inbox = client.new_inbox()

    request = {"prompt": "hello", "max_tokens": len(REPLY_TOKENS), "request_id": request_id, **body}

    async def collect(msg) -> None:
        if not msg.data and msg.headers and msg.headers.get("Status") == "503":
            # No subscriber had the subject when it came (seen once in CI on the deployed
            # server, right after a scheduler said it was ready); kvpush.client sends it
            # again, and so does this, a bounded number of times.
            replies.no_responders += 1
            assert replies.no_responders <= 5, "no scheduler listened to five sends"
            await asyncio.sleep(0.1)
            await client.publish(generate_subject(client), json.dumps(request).encode(), reply=inbox)
            return
        replies.messages.append(json.loads(msg.data))

    await client.subscribe(inbox, cb=collect)
    await client.flush()
    await client.publish(generate_subject(client), json.dumps(request).encode(), reply=inbox)
    return replies


async def until_async(probe, timeout: float = 10.0, what: str = "it") -> None:
    deadline = time.monotonic() + timeout
    while not await probe():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout} s"
        await asyncio.sleep(0.05)


async def one_final(replies: Replies, timeout: float = 15.0, settle_s: float = 1.0) -> dict:
    """The one final the client got; fails on none, or on a second one within ``settle_s``."""
    await until(lambda: replies.finals(), timeout=timeout, what="a final message")
    await asyncio.sleep(settle_s)
    assert len(replies.finals()) == 1, replies.finals()
    return replies.finals()[0]


async def started(running, server, client, *workers) -> Scheduler:
    s = await running(takeover_scheduler(server))
    await workers_seen(client, *workers)
    return s


@pytest.mark.parametrize("mode", ["push", "pull"])
async def test_a_flight_whose_scheduler_died_in_prefill_is_taken_over_fenced_and_answered_once(
        server, client, running, mode):
    prefill = await running(FakeWorker(server, "prefill", "hold"))
    decode = await running(FakeWorker(server, "decode", "hold"))
    first = await started(running, server, client, prefill, decode)
    replies = await send(client, f"r-died-{mode}", transfer_mode=mode)
    await until(lambda: prefill.jobs, what="the prefill job")
    old = prefill.jobs[0]
    await die(first)

    decode.on_job = "answer"
    await running(takeover_scheduler(server))  # a new scheduler: it adopts after a timeout
    await until(lambda: len(prefill.jobs) == 2, timeout=10, what="a second attempt")
    retried = prefill.jobs[1]
    assert retried.transfer_id != old.transfer_id and retried.transfer_key != old.transfer_key
    await cancelled(prefill, [old.transfer_id])  # the fenced attempt's workers drop it
    if mode == "pull":
        await prefill.handoff(retried, kv_transfer_params={"remote_block_ids": [1]})
    final = await one_final(replies)
    assert replies.tokens() == REPLY_TOKENS and final["finish_reason"] == "length"
    if mode == "push":  # the fenced attempt's decode can never answer: a scheduler holds its claim
        late = await decode.claims.claim(old.transfer_key)
        assert late.state is ClaimState.LOST and not decode.claims_won.get(old.transfer_id)
    else:  # pull: that attempt died in prefill, so it never had a decode that could answer it
        assert old.transfer_id not in {job.transfer_id for job in decode.jobs}


async def test_a_flight_whose_scheduler_died_while_it_waited_for_a_worker_is_dispatched_by_the_next(
        server, client, running):
    prefill = await running(FakeWorker(server, "prefill", "answer"))
    decode = await running(FakeWorker(server, "decode", "answer"))
    first = await started(running, server, client, prefill, decode)
    await prefill.stop_heartbeats()  # known, but not live: the request waits in the queue for one
    await asyncio.sleep(WORKER_TIMEOUT_S + 0.3)
    replies = await send(client, "r-queued")
    await until(lambda: first.flights.by_request(client_of(client), "r-queued") is not None, what="the flight")
    # Accepted means written down: a flight enters the table a moment before its record
    # lands in JetStream, and a scheduler dead in between leaves nothing to take over.
    await until_async(lambda: first.ledger.flight(wire.flight_key(client_of(client), "r-queued")),
                      what="the flight's record")
    await die(first)

    spare = await running(FakeWorker(server, "prefill", "answer"))
    await running(takeover_scheduler(server))
    final = await one_final(replies)
    assert replies.tokens() == REPLY_TOKENS and final["usage"]["completion_tokens"] == len(REPLY_TOKENS)
    assert [job.request_id for job in spare.jobs] == ["r-queued"]


async def test_a_flight_whose_scheduler_died_while_decode_streamed_is_finished_by_that_decode(
        server, client, running):
    prefill = await running(FakeWorker(server, "prefill", "hold"))
    decode = await running(FakeWorker(server, "decode", "start_then_hold"))
    first = await started(running, server, client, prefill, decode)
    replies = await send(client, "r-streaming")
    await until(lambda: replies.tokens(), what="the first token")
    await die(first)

    second = await running(takeover_scheduler(server))
    await until(lambda: second.flights.by_request(client_of(client), "r-streaming") is not None, timeout=10, what="the takeover")
    decode.release.set()
    await one_final(replies)
    assert replies.tokens() == REPLY_TOKENS  # no token twice: the decode kept its claim
    assert len(decode.jobs) == 1
    await until(lambda: second.flights.by_request(client_of(client), "r-streaming") is None, what="the flight's end")


async def test_one_of_two_live_schedulers_takes_a_dead_ones_flight_and_only_one(server, client, running):
    prefill = await running(FakeWorker(server, "prefill", "hold"))
    decode = await running(FakeWorker(server, "decode", "hold"))
    first = await started(running, server, client, prefill, decode)
    replies = await send(client, "r-two-heirs")
    await until(lambda: prefill.jobs, what="the prefill job")
    heirs = [await running(takeover_scheduler(server)) for _ in range(2)]
    await asyncio.sleep(0.5)  # both heard the first one's heartbeats
    await die(first)

    decode.on_job = "answer"
    await one_final(replies, settle_s=2.0)
    assert replies.tokens() == REPLY_TOKENS
    assert sum(h.flights.by_request(client_of(client), "r-two-heirs") is not None for h in heirs) <= 1
    assert len(prefill.jobs) == 2  # one takeover, one new attempt


async def test_an_adopted_flight_past_its_deadline_gets_one_deadline_final(server, client, running):
    prefill = await running(FakeWorker(server, "prefill", "hold"))
    decode = await running(FakeWorker(server, "decode", "hold"))
    first = await running(takeover_scheduler(server, deadline_s=2.5))
    await workers_seen(client, prefill, decode)
    replies = await send(client, "r-late")
    await until(lambda: prefill.jobs, what="the prefill job")
    await die(first)

    await running(takeover_scheduler(server, deadline_s=2.5))
    final = await one_final(replies)
    assert final["error"]["code"] == "deadline_exceeded"


async def test_a_deadline_while_decode_streams_is_told_by_the_decode_that_holds_the_answer(
        server, client, running):
    prefill = await running(FakeWorker(server, "prefill", "hold"))
    decode = await running(FakeWorker(server, "decode", "start_then_hold"))
    await running(takeover_scheduler(server, deadline_s=1.5))
    await workers_seen(client, prefill, decode)
    replies = await send(client, "r-deadline-streaming")
    await until(lambda: decode.cancels, timeout=5, what="the decode's CancelJob")
    cancel = decode.cancels[0]
    assert cancel.error is not None and cancel.error.code == "deadline_exceeded"
    await asyncio.sleep(0.5)
    assert replies.finals() == []  # the scheduler lost the claim: the decode says it, once


async def test_a_client_that_missed_its_final_fetches_it_again(server, client, running):
    prefill = await running(FakeWorker(server, "prefill", "answer"))
    decode = await running(FakeWorker(server, "decode", "answer"))
    await started(running, server, client, prefill, decode)
    dropped = []

    def drop_the_final(reply: wire.Reply) -> bool:
        if isinstance(reply, wire.TokenChunk):
            return True
        dropped.append(reply)
        return False

    body = {"prompt": "hello", "max_tokens": len(REPLY_TOKENS), "request_id": "r-refetch"}
    got = [reply async for reply in generate(client, body, timeout=10, refetch_after_s=0.3,
                                             received=drop_the_final)]
    assert len(dropped) == 1  # the final did come once, and the hook lost it
    assert got[-1] == dropped[0] == decode.final_reply(decode.jobs[0])
    assert [t for reply in got[:-1] for t in reply.token_ids] == REPLY_TOKENS


async def test_a_final_is_fetched_only_by_the_client_that_sent_the_request(server, client, running):
    prefill = await running(FakeWorker(server, "prefill", "answer"))
    decode = await running(FakeWorker(server, "decode", "answer"))
    await started(running, server, client, prefill, decode)
    replies = await send(client, "r-anon")
    await one_final(replies, settle_s=0.2)
    assert isinstance(await fetch_final(client, "r-anon"), wire.FinalReply)
    other = await server.connect(server.identity("client"))
    try:
        assert await fetch_final(other, "r-anon") is None  # reads as not found: not its request
        reply = await other.request(wire.OWNED_FINAL(client=client_of(other)),
                                    wire.encode_json(wire.FinalRequest("r-anon")), timeout=2)
        assert json.loads(reply.data)["error"]["code"] == "not_found"
    finally:
        await other.close()


async def test_a_reused_request_id_does_not_fetch_the_last_uses_final(server, client, running):
    prefill = await running(FakeWorker(server, "prefill", "answer"))
    decode = await running(FakeWorker(server, "decode", "hold"))
    await started(running, server, client, prefill, decode)
    decode.on_job = "answer"
    await one_final(await send(client, "r-reused"), settle_s=0.2)
    decode.on_job = "hold"
    await send(client, "r-reused")
    await until(lambda: len(decode.jobs) == 2, what="the second use's decode job")
    assert await fetch_final(client, "r-reused") is None


async def test_a_scheduler_that_just_joined_waits_a_heartbeat_round_before_it_says_no_workers(
        server, client, running):
    prefill = await running(FakeWorker(server, "prefill", "answer"))
    decode = await running(FakeWorker(server, "decode", "answer"))
    for worker in (prefill, decode):
        await worker.stop_heartbeats()  # they beat before the scheduler was there to hear it
    await running(takeover_scheduler(server))
    replies = await send(client, "r-joined")
    await asyncio.sleep(0.3)
    for worker in (prefill, decode):
        await worker.beat()  # the next round, a moment after the request came
    final = await one_final(replies, settle_s=0.2)
    assert "error" not in final, final
    assert replies.tokens() == REPLY_TOKENS
