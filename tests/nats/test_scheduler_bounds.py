"""The scheduler under load and outages, over a real nats-server with fake protocol
workers (tests/nats/test_scheduler.py's): it refuses work past its in-flight limit with
``overloaded``, and a NATS outage longer than the worker timeout makes no worker lost."""

from __future__ import annotations

import asyncio
from collections import Counter
import json
import contextlib
import threading
import time
import uuid

import nats
import pytest

from kvpush.client import cancel, client_of
from kvpush.services.launch.natsd import LocalNatsServer
from kvpush.services.scheduler.service import Scheduler
from kvpush.services.scheduler.validation import RequestValidator
from kvpush.shared import wire
from tests.nats.deployed import NATS_KINDS, NatsUnderTest
from tests.nats.test_scheduler import (
    MAX_MODEL_LEN,
    VOCAB,
    WORKER_TIMEOUT_S,
    FakeWorker,
    generate_subject,
    status_subject,
    client,  # noqa: F401 (fixtures)
    running,  # noqa: F401
    server,  # noqa: F401
    replies_to_final,
    request_body,
    scheduler,
    send,
    tokenize,
    until,
    workers_seen,
)

pytestmark = pytest.mark.timeout(60)


async def test_past_its_in_flight_limit_a_scheduler_refuses_with_overloaded_and_serves_on(server, client,
                                                                                          running):
    sched = await running(scheduler(server, max_in_flight=2))
    prefill = await running(FakeWorker(server, "prefill"))
    decode = await running(FakeWorker(server, "decode", "hold"))
    await workers_seen(client, prefill, decode)

    held = [await send(client, request_body(f"r-held-{i}")) for i in range(2)]
    await until(lambda: len(decode.jobs) == 2, what="both requests in flight")
    [final] = await replies_to_final(await send(client, request_body("r-over")))
    assert final["error"]["code"] == "overloaded", final
    assert "--max-in-flight 2" in final["error"]["message"]

    await cancel(client, "r-held-0")  # one ends: room again
    [ended] = await replies_to_final(held[0])
    assert ended["error"]["code"] == "cancelled"
    await until(lambda: len(sched.flights) == 1, what="the cancelled flight gone")
    await send(client, request_body("r-next"))
    await until(lambda: len(decode.jobs) == 3, what="the next request admitted")


async def test_a_request_whose_record_is_being_written_counts_once_against_the_limit(server, client, running):
    """A request is counted as being validated until it is a flight in the table, then as
    a flight: never both. Held inside its JetStream write (a hook around the real ledger
    call), the first of two requests at a limit of two leaves room for the second."""
    sched = await running(scheduler(server, max_in_flight=2))
    prefill = await running(FakeWorker(server, "prefill"))
    decode = await running(FakeWorker(server, "decode", "hold"))
    await workers_seen(client, prefill, decode)
    writing, release = asyncio.Event(), asyncio.Event()
    real_record = sched.ledger.record

    async def held_record(record):
        writing.set()
        await release.wait()
        return await real_record(record)

    sched.ledger.record = held_record
    first = await send(client, request_body("r-being-written"))
    await asyncio.wait_for(writing.wait(), 10)
    sched.ledger.record = real_record
    await send(client, request_body("r-next-to-it"))
    await until(lambda: [job.request_id for job in decode.jobs] == ["r-next-to-it"], what="the second admitted")
    release.set()
    await until(lambda: len(decode.jobs) == 2, what="the first dispatched once written")
    assert first is not None


@pytest.mark.parametrize("kind", NATS_KINDS)
async def test_a_nats_outage_longer_than_the_worker_timeout_loses_no_worker(kind):
    """Heartbeats cannot arrive while NATS is down; the scheduler must not take that
    silence for dead workers (a false worker_lost, or a retry that repeats tokens)."""
    with NatsUnderTest(kind) as own:
        async with contextlib.AsyncExitStack() as stack:
            nc = await own.connect(own.identity("client"), max_reconnect_attempts=-1, reconnect_time_wait=0.1)
            stack.push_async_callback(nc.close)
            await stack.enter_async_context(scheduler(own))
            prefill = await stack.enter_async_context(FakeWorker(own, "prefill"))
            decode = await stack.enter_async_context(FakeWorker(own, "decode", "hold"))
            await workers_seen(nc, prefill, decode)
            await send(nc, request_body("r-outage"))
            await until(lambda: decode.jobs and prefill.jobs, what="the request in flight")

            # Down three worker timeouts, from another thread: this loop (the scheduler's) runs on.
            await asyncio.to_thread(own.server.restart_after, 3 * WORKER_TIMEOUT_S)
            await until(lambda: nc.is_connected and decode.nc.is_connected, timeout=15, what="everyone back")
            await asyncio.sleep(WORKER_TIMEOUT_S / 2)  # the watch runs several times after the outage
            assert [job.request_id for job in decode.jobs] == ["r-outage"]  # not retried elsewhere
            assert decode.cancels == [] and prefill.cancels == []  # and not given up


async def test_after_the_schedulers_own_loop_stalls_no_worker_is_taken_for_lost(server, client, running):
    """A stall (a long pause of the event loop) leaves heartbeats unread; the verdicts that
    run first after it must not take that for silence."""
    await running(scheduler(server))
    prefill = await running(FakeWorker(server, "prefill"))
    decode = await running(FakeWorker(server, "decode", "hold"))
    await workers_seen(client, prefill, decode)
    await send(client, request_body("r-stall"))
    await until(lambda: decode.jobs and prefill.jobs, what="the request in flight")
    time.sleep(3 * WORKER_TIMEOUT_S)  # the stall itself: this loop is the scheduler's
    await asyncio.sleep(WORKER_TIMEOUT_S / 2)
    assert [job.request_id for job in decode.jobs] == ["r-stall"]
    assert decode.cancels == [] and prefill.cancels == []


async def test_a_prompt_being_tokenized_does_not_stop_the_scheduler_answering(server, client, running):
    """Tokenizing runs off the event loop: while one prompt is held in the tokenizer, the
    scheduler still answers status requests (and so heartbeats, cancels, other events)."""
    release = threading.Event()

    def slow_tokenize(text: str) -> list[int]:
        if text == "the long prompt":
            assert release.wait(20), "the test did not release the tokenizer"
        return tokenize(text)

    name = server.identity("scheduler")
    sched = await running(Scheduler(server.url_for(name), RequestValidator(slow_tokenize, VOCAB, MAX_MODEL_LEN),
                                    scheduler_id=name))
    prefill = await running(FakeWorker(server, "prefill"))
    decode = await running(FakeWorker(server, "decode"))
    await workers_seen(client, prefill, decode)
    sub = await send(client, request_body("r-long", prompt="the long prompt"))
    try:
        await until(lambda: sched.admission.validating == 1, what="the prompt in the tokenizer")
        status = await client.request(status_subject(client), b"", timeout=5)  # answered meanwhile
        assert decode.worker_id in wire.decode_json(status.data, wire.SchedulerStatus).decode_workers
    finally:
        release.set()
    replies = await replies_to_final(sub)
    assert "error" not in replies[-1], replies[-1]


async def test_a_cancel_that_arrives_before_its_request_still_cancels_it(server, client, running):
    """The client sent a request and cancelled it; the cancel (broadcast to every scheduler)
    overtook the request (queued to one). It is remembered, and the request ends cancelled
    without a job going out."""
    await running(scheduler(server))
    prefill = await running(FakeWorker(server, "prefill"))
    decode = await running(FakeWorker(server, "decode"))
    await workers_seen(client, prefill, decode)
    await cancel(client, "r-overtaken")
    await client.flush()
    await client.flush()  # nats-py: the second PING goes after the cancel
    [final] = await replies_to_final(await send(client, request_body("r-overtaken")))
    assert final["error"]["code"] == "cancelled", final
    assert decode.jobs == [] and prefill.jobs == []
    [served] = (await replies_to_final(await send(client, request_body("r-after"))))[-1:]  # the next is served
    assert "error" not in served


FLOOD = 3000
MAX_IN_FLIGHT = 50
FLOOD_RSS_BOUND = 150 * 2**20  # what the flood may add to this process (the scheduler, the workers, the client)


async def test_a_flood_of_unique_requests_and_cancels_stays_within_its_bounds_and_the_scheduler_serves_on(
        server, client, running):
    """3,000 unique request ids and 12,000 cancels of ids nobody sent, at a scheduler
    holding at most 50: every request gets a final (held or ``overloaded``), every table
    stays at its bound, and a request after the flood is served."""
    import psutil

    sched = await running(scheduler(server, max_in_flight=MAX_IN_FLIGHT))
    prefill = await running(FakeWorker(server, "prefill"))
    decode = await running(FakeWorker(server, "decode", "hold"))
    await workers_seen(client, prefill, decode)
    rss_before = psutil.Process().memory_info().rss

    finals: dict[str, dict] = {}
    inbox = client.new_inbox()

    async def collect(msg) -> None:
        reply = json.loads(msg.data)
        if reply.get("finished"):
            finals[reply["request_id"]] = reply

    await client.subscribe(inbox, cb=collect, pending_msgs_limit=FLOOD * 2)
    for n in range(FLOOD):
        await client.publish(generate_subject(client), json.dumps(request_body(f"flood-{n}")).encode(), reply=inbox)
    cancel_subject = wire.OWNED_CANCEL(client=client_of(client))
    for n in range(12_000):
        await client.publish(cancel_subject, wire.encode_json(wire.CancelRequest(f"never-sent-{n}")))
    # The admitted ones are in the table once their tokenizing and their record are done.
    try:
        await until(lambda: len(finals) >= FLOOD - MAX_IN_FLIGHT and len(sched.flights) == MAX_IN_FLIGHT,
                    timeout=45, what="a final for every refused request, and the admitted ones in flight")
    except AssertionError as exc:
        codes = Counter(f.get("error", {}).get("message", "ok")[:80] for f in finals.values())
        raise AssertionError(f"{exc}; {len(finals)} finals ({dict(codes)}), {len(sched.flights)} in flight; "
                             f"nats-server said: {server.log_tail()}") from None
    assert len(finals) == FLOOD - MAX_IN_FLIGHT
    assert {f["error"]["code"] for f in finals.values()} == {"overloaded"}
    assert len(sched.early_cancels) <= sched.early_cancels.max_entries == 10_000
    assert len(sched.adoption.holdings) <= MAX_IN_FLIGHT and len(sched.pool) == 2
    assert psutil.Process().memory_info().rss - rss_before < FLOOD_RSS_BOUND

    for flight in list(sched.flights):  # the held ones end: the scheduler is back to serving
        await cancel(client, flight.request_id)
    await until(lambda: len(sched.flights) == 0, timeout=15, what="the held flights cancelled")
    decode.on_job = "answer"
    final = (await replies_to_final(await send(client, request_body("after-the-flood"))))[-1]
    assert "error" not in final and final["finished"], final


async def test_a_request_ending_while_another_ends_into_a_slow_jetstream_leaves_the_table_at_once(
        server, client, running):
    """Every decode's progress reaches the scheduler through one subscription. The first
    request's end is held inside its JetStream write (a hook around the real ledger call);
    the second's end must still take its flight out of the table, or under load flights
    would pile up behind slow writes to --max-in-flight while their answers were long sent."""
    sched = await running(scheduler(server))
    prefill = await running(FakeWorker(server, "prefill"))
    decode = await running(FakeWorker(server, "decode"))
    await workers_seen(client, prefill, decode)
    writing, release = asyncio.Event(), asyncio.Event()
    real_keep = sched.ledger.keep_final

    async def held_keep(owner, request_id, body, reply_to=""):
        if request_id == "r-slow-end":
            writing.set()
            await release.wait()
        return await real_keep(owner, request_id, body, reply_to)

    sched.ledger.keep_final = held_keep
    try:
        first = await send(client, request_body("r-slow-end"))
        await replies_to_final(first)
        await asyncio.wait_for(writing.wait(), 10)
        second = await send(client, request_body("r-next-end"))
        await replies_to_final(second)
        await until(lambda: len(sched.flights) == 0, what="the second flight out of the table")
        assert not release.is_set()  # while the first's write still waits
    finally:
        release.set()
        sched.ledger.keep_final = real_keep


async def test_the_flights_bucket_keeps_nothing_past_twice_the_deadline():
    """Each ended flight leaves a delete marker; with no age limit they would pile up for
    ever (138 B a request, docs/scaling.md) and every scheduler would read them all at start."""
    from kvpush.services.ledger import Ledger

    with LocalNatsServer() as own:
        nc = await nats.connect(own.url)
        try:
            await Ledger.open(nc, wire.Claimant.scheduler("scheduler-ttl", "0"), deadline_s=40.0)
            info = await nc.jetstream().stream_info(f"KV_{wire.FLIGHTS_BUCKET}")
            assert info.config.max_age == 140.0  # 2 x deadline + 60 s: no flight lives that long
        finally:
            await nc.close()
