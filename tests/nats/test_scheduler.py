"""The real scheduler over a real nats-server, without vLLM: fake prefill and decode
workers speak the wire protocol (shared/wire/) the way services/worker/service.py does
(heartbeats, job acks, a handoff, progress, token chunks and the final reply), each on
the subject that names it, and a client sends raw ``kvpush.generate`` requests (a named
client on ``kvpush.generate.<client>``, with its inboxes under ``_INBOX.<client>``).

The fakes are protocol peers, not mocks: the scheduler under test is the one that ships.
Every test starts its own scheduler and workers (unique ids) on this module's own
nats-server, so no other scheduler in the session (a stack's) shares its queue group.

Each test runs twice: on a plain nats-server, and on one under the generated per-identity
configuration with TLS (``tests/nats/deployed.py``), where every scheduler, worker and
client logs in as its own user. A test marked ``PLAIN_ONLY`` checks what the scheduler
itself refuses, which the deployed server already refuses before it: it says why."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
import uuid

import msgspec
import nats
import nats.js.errors
import pytest

from kvpush.client import cancel, client_of, generate_all
from kvpush.services.ledger import Claims
from kvpush.services.scheduler import timing
from kvpush.services.scheduler.flights import FlightState
from kvpush.services.scheduler.prefixes import Prompt
from kvpush.services.scheduler.service import Scheduler
from kvpush.services.scheduler.validation import RequestValidator
from kvpush.shared import wire
from kvpush.shared.block_keys import block_keys
from tests.nats.deployed import NATS_KINDS, NatsUnderTest

pytestmark = pytest.mark.timeout(60)

VOCAB = 100
MAX_MODEL_LEN = 64
HEARTBEAT_S = 0.2
WORKER_TIMEOUT_S = 1.0  # five heartbeats: a loaded test machine does not lose a live worker
REPLY_TOKENS = [11, 12, 13]


def tokenize(text: str) -> list[int]:
    return [ord(c) % VOCAB for c in text]


async def until(condition, timeout: float = 5.0, what: str = "the condition") -> None:
    """Poll ``condition()`` every 10 ms until it holds; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout} s"
        await asyncio.sleep(0.01)


class FakeWorker:
    """A prefill or decode worker as the scheduler meets it on NATS.

    ``on_job``: ``"answer"`` acks every job and (decode) streams REPLY_TOKENS and a final
    reply to the client; ``"hold"`` acks and never answers; ``"go_silent"`` acks, then stops
    heartbeating (a worker that died after taking the job); ``"no_ack"`` takes the job and
    never replies; ``"refuse_silently"`` refuses it with no error body; ``"start_then_hold"``
    (decode) claims the answer, sends the first token and waits for ``release``, then
    finishes; ``"stall_mid_stream"`` (decode) claims, sends two tokens, and sends nothing
    more until it is told to stop: then one more token (it was on its way) before it says
    it stopped. A decode job that resumes a stream (``job.resume``) goes on from its seq.
    ``subscribe=False``: heartbeats only, no job subscription at all.
    ``ack_after``: hold the ack until this event is set (at most 3 s). ``running``: the load
    its heartbeats report, to steer the scheduler's choice. A prefill never hands off by
    itself: the test calls ``handoff()``."""

    def __init__(self, server: "NatsUnderTest | str", role: str, on_job: str = "answer", *, subscribe: bool = True,
                 ack_after: asyncio.Event | None = None, running: int = 0):
        self.server, self.role, self.on_job = server, role, on_job
        self.worker_id = server.identity(role) if isinstance(server, NatsUnderTest) else f"{role}-{uuid.uuid4().hex[:8]}"
        self.incarnation = uuid.uuid4().hex
        self.subscribe, self.ack_after, self.running = subscribe, ack_after, running
        self.jobs: list[wire.PrefillJob | wire.DecodeJob] = []
        self.arrived_at: dict[str, float] = {}  # transfer id -> monotonic time its job came
        self.cancels: list[wire.CancelJob] = []
        self.job_arrived = asyncio.Event()
        self.release = asyncio.Event()
        self.stopped = asyncio.Event()  # a CancelJob came
        self._answering: set[asyncio.Task] = set()
        self.claims_won: dict[str, bool] = {}  # transfer id -> whether this decode won the answer
        self.nc: nats.NATS | None = None
        self.claims: Claims | None = None
        self._beating: asyncio.Task | None = None
        self._stop_beating = asyncio.Event()

    async def __aenter__(self) -> "FakeWorker":
        if isinstance(self.server, NatsUnderTest):
            self.nc = await self.server.connect(self.worker_id)
        else:
            self.nc = await nats.connect(self.server, name=self.worker_id)
        self.claims = Claims(self.nc, wire.Claimant.decode(self.worker_id))
        if self.subscribe:
            subject = (wire.prefill_job_subject if self.role == "prefill" else wire.decode_job_subject)(self.worker_id)
            await self.nc.subscribe(subject, cb=self._on_job)
        await round_trip(self.nc)  # the job subscription is at the server
        self._beating = asyncio.get_running_loop().create_task(self._heartbeats())
        return self

    async def __aexit__(self, *exc) -> None:
        for task in self._answering:
            task.cancel()
        await asyncio.gather(*self._answering, return_exceptions=True)
        await self.stop_heartbeats()
        await self.nc.close()

    async def stop_heartbeats(self) -> None:
        """Stop beating; no heartbeat goes out after this returns. Asked by an event, not by
        cancelling: on Python 3.11, asyncio.wait_for (which nats-py's flush and request use)
        can swallow a cancellation that arrives as its future completes."""
        self._stop_beating.set()
        if self._beating is not None:
            await asyncio.wait_for(self._beating, 5)

    async def beat(self) -> None:
        heartbeat = wire.WorkerHeartbeat(
            worker_id=self.worker_id, role=self.role, free_kv_blocks=1000, total_kv_blocks=1000,
            running=self.running, waiting=0, block_size=16, max_model_len=MAX_MODEL_LEN,
            incarnation=self.incarnation)
        await self.nc.publish(wire.HEARTBEATS(sender=self.worker_id), wire.encode(heartbeat))

    async def _heartbeats(self) -> None:
        while not self._stop_beating.is_set():
            await self.beat()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stop_beating.wait(), HEARTBEAT_S)

    async def _on_job(self, msg) -> None:
        job = wire.decode(msg.data, wire.PrefillMessage if self.role == "prefill" else wire.DecodeMessage)
        if isinstance(job, wire.CancelJob):
            self.cancels.append(job)
            self.stopped.set()
            return
        self.jobs.append(job)
        self.arrived_at[job.transfer_id] = time.monotonic()
        self.job_arrived.set()
        if self.on_job == "no_ack":
            return
        if self.on_job == "refuse_silently":  # a refusal that gives no reason (error=None)
            await self.nc.publish(msg.reply, wire.encode(wire.JobAck(accepted=False)))
            return
        if self.ack_after is not None:
            await asyncio.wait_for(self.ack_after.wait(), 3)
        if self.on_job == "go_silent":
            await self.stop_heartbeats()  # its last heartbeat went out before the ack
        await self.nc.publish(msg.reply, wire.encode(wire.JobAck(accepted=True)))
        if self.on_job == "answer" and self.role == "decode":
            await self.answer(job)
        elif self.on_job == "start_then_hold" and self.role == "decode":  # off the callback: cancels still come
            self._answering.add(asyncio.get_running_loop().create_task(self.answer(job, hold=True)))
        elif self.on_job == "stall_mid_stream" and self.role == "decode":
            self._answering.add(asyncio.get_running_loop().create_task(self.stall_mid_stream(job)))

    async def send_chunk(self, job: wire.DecodeJob, seq: int, token: int) -> None:
        """A token chunk as decode sends it: its record to the schedulers first, on the same connection."""
        record = wire.TokensSent(request_id=job.request_id, transfer_id=job.transfer_id, worker_id=self.worker_id,
                                 seq=seq, token_ids=[token])
        await self.nc.publish(wire.TOKENS_SENT(sender=self.worker_id), wire.encode(record))
        chunk = wire.TokenChunk(job.request_id, [token], chr(ord("a") + token % 26), seq=seq)
        await self.nc.publish(job.reply_to, wire.encode_json(chunk))

    async def stall_mid_stream(self, job: wire.DecodeJob) -> None:
        assert (await self.claims.claim(job.transfer_key)).won
        for seq, token in enumerate(REPLY_TOKENS[:2]):
            await self.send_chunk(job, seq, token)
        await asyncio.wait_for(self.stopped.wait(), 30)  # its engine hangs; the fence comes
        await self.send_chunk(job, 2, REPLY_TOKENS[2])  # the chunk that was on its way
        await self.progress(job, "ended", "cancelled")

    async def answer(self, job: wire.DecodeJob, hold: bool = False) -> None:
        """What services/worker/decode.py sends for a finished decode, in its order: the
        claim to answer first, and nothing at all if a scheduler holds it."""
        self.claims_won[job.transfer_id] = won = (await self.claims.claim(job.transfer_key)).won
        if not won:
            await self.progress(job, "ended", "fenced")
            return
        first_seq = job.resume.chunks if job.resume is not None else 0
        tokens = REPLY_TOKENS[:job.sampling.max_tokens]
        for seq, token in enumerate(tokens, start=first_seq):
            await self.send_chunk(job, seq, token)
            if hold and seq == 0:
                await asyncio.wait_for(self.release.wait(), 30)
        final = wire.encode_json(self.final_reply(job))
        await self.nc.publish(job.reply_to, final)
        await self.progress(job, "ended", "ok", final)

    def final_reply(self, job: wire.DecodeJob) -> wire.FinalReply:
        tokens = REPLY_TOKENS[:job.sampling.max_tokens]
        sent = job.resume.chunks if job.resume is not None else 0
        return wire.FinalReply(request_id=job.request_id, finish_reason="length",
                               usage=wire.Usage(len(job.prompt_token_ids), sent + len(tokens)),
                               timings=wire.Timings(ttft_ms=1.5, tpot_ms=0.5, e2e_ms=2.5),
                               chunks=sent + len(tokens))

    async def progress(self, job: wire.DecodeJob, stage: str, outcome: str = "", final: bytes = b"") -> None:
        event = wire.RequestProgress(request_id=job.request_id, transfer_id=job.transfer_id,
                                     worker_id=self.worker_id, stage=stage, outcome=outcome, final=final)
        await self.nc.publish(wire.PROGRESS(sender=self.worker_id), wire.encode(event))

    async def handoff(self, job: wire.PrefillJob, kv_transfer_params: dict | None = None,
                      error: wire.ErrorBody | None = None) -> None:
        """Prefill finished ``job`` (or failed it, with ``error``): what
        services/worker/service.py publishes then."""
        now = time.time()
        handoff = wire.Handoff(request_id=job.request_id, transfer_id=job.transfer_id,
                               prefill_engine_id=self.worker_id,
                               first_token_id=REPLY_TOKENS[0] if error is None else None,
                               prefill_started_at=now - 0.01, prefill_finished_at=now,
                               error=error, kv_transfer_params=kv_transfer_params)
        await self.nc.publish(wire.HANDOFFS(sender=self.worker_id), wire.encode(handoff))
        await self.nc.flush()


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module", params=NATS_KINDS)
def server(request):
    with NatsUnderTest(request.param) as nats_server:
        yield nats_server


PLAIN_ONLY = pytest.mark.parametrize("server", ["plain"], indirect=True)
"""For a test of what the scheduler itself refuses: on the deployed server NATS refuses it first."""


@pytest.fixture
async def client(server):
    """A named client (its own user on the deployed server)."""
    nc = await server.connect(server.identity("client"))
    yield nc
    await nc.close()


@contextlib.asynccontextmanager
async def named_client(server, name: str | None = None):
    """A client connection that is ``name`` (a fresh client identity if None): its inboxes
    are under ``_INBOX.<name>``, as ``kvpush.shared.nats_security.connect_options`` sets them for a
    client logged in as that user."""
    nc = await server.connect(name or server.identity("client"))
    try:
        yield nc
    finally:
        await nc.close()


@pytest.fixture
async def running(server):
    """``await running(thing)`` enters an async context manager for the rest of the test.
    The flights its schedulers left behind go with it: no later test's scheduler takes
    them over."""
    stack = contextlib.AsyncExitStack()
    try:
        yield stack.enter_async_context
    finally:
        # CI once saw this teardown pass its 60 s (2026-12-07, not seen again in 5 runs):
        # what every task waits on is printed before pytest-timeout ends it.
        with tasks_printed_after(45, "the running fixture's exit"):
            await stack.aclose()
            await forget_flights(server)


@contextlib.contextmanager
def tasks_printed_after(seconds: float, what: str):
    """If the block still runs after ``seconds``, print every task's stack to stderr."""

    def print_tasks() -> None:
        print(f"\n{what} still runs after {seconds:g} s; its loop's tasks:", file=sys.stderr)
        for task in asyncio.all_tasks():
            task.print_stack(file=sys.stderr)

    timer = asyncio.get_running_loop().call_later(seconds, print_tasks)
    try:
        yield
    finally:
        timer.cancel()


async def forget_flights(server) -> None:
    nc = await server.connect(server.observer())
    try:
        js = nc.jetstream()
        for bucket in (wire.FLIGHTS_BUCKET, wire.FINALS_BUCKET):
            with contextlib.suppress(nats.js.errors.NotFoundError):
                await js.delete_key_value(bucket)
        for stream in await js.streams_info():
            if stream.config.name.startswith(wire.CLAIMS_STREAM_PREFIX):
                with contextlib.suppress(nats.js.errors.NotFoundError):
                    await js.delete_stream(stream.config.name)
    finally:
        await nc.close()


def scheduler(server, **kwargs) -> Scheduler:
    name = server.identity("scheduler")
    return Scheduler(server.url_for(name), RequestValidator(tokenize, VOCAB, MAX_MODEL_LEN),
                     scheduler_id=name, **kwargs)


async def round_trip(nc) -> None:
    """Everything ``nc`` sent so far has reached the server. nats-py 2.16's flush() writes
    its PING straight to the socket, ahead of commands still queued for the flusher task;
    the first flush lets the flusher write them, the second PING goes after them."""
    await nc.flush()
    await nc.flush()


async def workers_seen(client, *workers: FakeWorker, timeout: float = 5.0) -> None:
    """Poll ``kvpush.scheduler.status`` until the scheduler answers and lists every worker as
    live. Until its subscriptions reach the server, NATS answers "no responders": right
    after ``Scheduler.__aenter__`` a request from another connection can meet that."""
    wanted = {(w.role, w.worker_id) for w in workers}
    deadline = time.monotonic() + timeout
    live: set = set()
    while True:
        try:
            reply = await client.request(status_subject(client), b"", timeout=timeout)
        except nats.errors.NoRespondersError:
            pass
        else:
            status = wire.decode_json(reply.data, wire.SchedulerStatus)
            live = {("prefill", w) for w in status.prefill_workers} | {("decode", w) for w in status.decode_workers}
            if wanted <= live:
                return
        assert time.monotonic() < deadline, f"the scheduler lists {live}, not yet {wanted}"
        await asyncio.sleep(0.01)


async def holds(worker: FakeWorker, transfer_id: str) -> None:
    """Wait until ``worker`` has the job of ``transfer_id``: decode's reply to the client
    can overtake the scheduler's job to the prefill (they travel different connections)."""
    await until(lambda: transfer_id in {job.transfer_id for job in worker.jobs},
                what=f"{worker.worker_id} getting the job of {transfer_id}")


async def cancelled(worker: FakeWorker, transfer_ids) -> None:
    await until(lambda: set(transfer_ids) <= {c.transfer_id for c in worker.cancels},
                what=f"{worker.worker_id} getting a CancelJob for each of {transfer_ids}")


def request_body(request_id: str, **fields) -> dict:
    return {"prompt": "hello", "max_tokens": 3, "request_id": request_id} | fields


def generate_subject(nc) -> str:
    """Where ``nc`` sends requests: its own subject if it is a named client."""
    owner = client_of(nc)
    return wire.OWNED_GENERATE(client=owner) if owner else wire.GENERATE_SUBJECT


def status_subject(nc) -> str:
    owner = client_of(nc)
    return wire.OWNED_STATUS(client=owner) if owner else wire.SCHEDULER_STATUS_SUBJECT


def final_subject(nc) -> str:
    owner = client_of(nc)
    return wire.OWNED_FINAL(client=owner) if owner else wire.FINAL_SUBJECT


async def send(nc, body: dict | bytes, subject: str | None = None):
    """Publish a request with a fresh reply inbox; returns the inbox's subscription."""
    subject = subject or generate_subject(nc)
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish(subject, body if isinstance(body, bytes) else json.dumps(body).encode(), reply=inbox)
    return sub


async def refused(invalid, sched: Scheduler, timeout: float = 5.0) -> wire.InvalidMessage:
    """The next refusal ``sched`` says on ``kvpush.invalid`` (``invalid`` subscribes there);
    another service's are skipped."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        assert left > 0, f"{sched.scheduler_id} refused nothing within {timeout} s"
        try:
            msg = await invalid.next_msg(timeout=left)
        except nats.errors.TimeoutError:
            raise AssertionError(f"{sched.scheduler_id} refused nothing within {timeout} s") from None
        refusal = wire.decode(msg.data, wire.InvalidMessage)
        if refusal.service == sched.scheduler_id:
            return refusal


async def replies_to_final(sub, timeout: float = 10.0) -> list[dict]:
    replies = []
    while not (replies and replies[-1].get("finished")):
        replies.append(json.loads((await sub.next_msg(timeout=timeout)).data))
    return replies


async def assert_nothing_more(sched: Scheduler, client, sub) -> None:
    """The request has ended at the scheduler, and nothing more reached the client: after a
    round trip from the scheduler's and then the client's connection, anything the
    scheduler had sent would be in the subscription's queue."""
    await until(lambda: len(sched.flights) == 0, what="the request ending at the scheduler")
    await round_trip(sched.bus.nc)
    await client.flush()
    assert sub.pending_msgs == 0


# --------------------------------------------------------------------------- dispatch


async def test_push_sends_both_jobs_at_once_and_the_client_gets_decodes_reply(server, client, running):
    sched = await running(scheduler(server, mode="push"))
    decode = await running(FakeWorker(server, "decode"))
    # Prefill acks only once decode has its job: a scheduler that waited for prefill's ack
    # before sending decode's job would never get it.
    prefill = await running(FakeWorker(server, "prefill", ack_after=decode.job_arrived))
    await workers_seen(client, prefill, decode)

    sub = await send(client, request_body("r-push", temperature=0.5, ignore_eos=True))
    replies = await replies_to_final(sub)

    [decode_job] = decode.jobs
    await holds(prefill, decode_job.transfer_id)
    [prefill_job] = prefill.jobs
    prompt = tokenize("hello")
    assert prefill_job.transfer_id == decode_job.transfer_id != ""
    assert (prefill_job.mode, decode_job.mode) == ("push", "push")
    assert prefill_job.decode_engine_id == decode.worker_id
    assert decode_job.prefill_engine_id == prefill.worker_id
    assert prefill_job.request_id == decode_job.request_id == "r-push"
    assert prefill_job.prompt_token_ids == decode_job.prompt_token_ids == prompt
    assert decode_job.sampling == wire.SamplingSpec(max_tokens=3, temperature=0.5, ignore_eos=True)
    assert decode_job.reply_to == sub.subject
    assert abs(prefill.arrived_at[prefill_job.transfer_id] - decode.arrived_at[decode_job.transfer_id]) < 1.0

    assert [r["token_ids"] for r in replies[:-1]] == [[t] for t in REPLY_TOKENS]
    assert replies[-1] == msgspec.to_builtins(decode.final_reply(decode_job))
    await assert_nothing_more(sched, client, sub)
    assert prefill.cancels == decode.cancels == []


async def test_pull_sends_decode_its_job_after_the_handoff_with_the_prefills_kv_params(server, client, running):
    sched = await running(scheduler(server, mode="push"))
    prefill = await running(FakeWorker(server, "prefill"))
    decode = await running(FakeWorker(server, "decode"))
    await workers_seen(client, prefill, decode)

    sub = await send(client, request_body("r-pull", transfer_mode="pull"))
    await asyncio.wait_for(prefill.job_arrived.wait(), 5)
    [prefill_job] = prefill.jobs
    assert prefill_job.mode == "pull" and prefill_job.decode_engine_id == ""  # decode is picked later
    await round_trip(decode.nc)
    assert decode.jobs == []  # prefill has its job; decode still has nothing

    kv_params = {"transfer_id": prefill_job.transfer_id, "prefill_engine_id": prefill.worker_id,
                 "prefill_tp_size": 1, "remote_block_ids": [4, 5, 6]}
    handed_off_at = time.monotonic()
    await prefill.handoff(prefill_job, kv_params)
    replies = await replies_to_final(sub)

    [decode_job] = decode.jobs
    assert decode.arrived_at[decode_job.transfer_id] >= handed_off_at
    assert decode_job.transfer_id == prefill_job.transfer_id
    assert decode_job.mode == "pull"
    assert decode_job.prefill_engine_id == prefill.worker_id
    assert decode_job.kv_transfer_params == kv_params
    assert replies[-1] == msgspec.to_builtins(decode.final_reply(decode_job))
    await assert_nothing_more(sched, client, sub)


# --------------------------------------------------------------------------- retries


async def test_a_decode_that_went_silent_after_taking_the_job_is_retried_around(server, client, running):
    sched = await running(scheduler(server, worker_timeout_s=WORKER_TIMEOUT_S, deadline_s=20))
    prefill = await running(FakeWorker(server, "prefill"))
    silent = await running(FakeWorker(server, "decode", "go_silent"))
    spare = await running(FakeWorker(server, "decode", running=5))  # busier: picked second
    await workers_seen(client, prefill, silent, spare)

    sub = await send(client, request_body("r-silent"))
    replies = await replies_to_final(sub)

    [first] = silent.jobs
    [second] = spare.jobs
    await holds(prefill, second.transfer_id)
    await cancelled(silent, [first.transfer_id])
    assert second.transfer_id != first.transfer_id
    assert [job.transfer_id for job in prefill.jobs] == [first.transfer_id, second.transfer_id]
    assert second.prefill_engine_id == prefill.worker_id
    assert [c.transfer_id for c in silent.cancels] == [c.transfer_id for c in prefill.cancels] == [first.transfer_id]
    assert silent.cancels[0].request_id == "r-silent" and silent.worker_id in silent.cancels[0].reason
    assert "error" not in replies[-1]
    assert replies[-1] == msgspec.to_builtins(spare.final_reply(second))
    await assert_nothing_more(sched, client, sub)
    assert spare.cancels == []


async def test_a_decode_that_stalls_mid_stream_is_fenced_before_its_stream_moves(server, client, running):
    """A decode streams two tokens, then its engine hangs (its worker heartbeats): past
    --stall-s the scheduler tells it to stop and, before the stream moves, waits for it to
    say it did. A chunk it sent meanwhile (here: in answer to the stop, after the
    scheduler's decision) is on record, so the other decode resumes after it: the client
    gets every seq once, and the final counts every chunk."""
    sched = await running(scheduler(server, worker_timeout_s=WORKER_TIMEOUT_S, deadline_s=20, stall_s=0.5))
    prefill = await running(FakeWorker(server, "prefill"))
    stalled = await running(FakeWorker(server, "decode", "stall_mid_stream"))
    spare = await running(FakeWorker(server, "decode", running=5))  # busier: picked second
    await workers_seen(client, prefill, stalled, spare)

    sub = await send(client, request_body("r-stalled", max_tokens=10))
    replies = await replies_to_final(sub)

    [first] = stalled.jobs
    [second] = spare.jobs
    assert [c.transfer_id for c in stalled.cancels] == [first.transfer_id] and stalled.cancels[0].error is None
    assert second.resume == wire.Resume(token_ids=REPLY_TOKENS, chunks=3, first_token_at=second.resume.first_token_at,
                                        continuation="reprefill")
    assert second.prompt_token_ids == tokenize("hello") + REPLY_TOKENS  # greedy: the tokens sent are prompt now
    assert (second.route.migrations, second.route.resumed_after) == (1, [3])
    assert [r["seq"] for r in replies[:-1]] == list(range(6))
    assert [r["token_ids"] for r in replies[:-1]] == [[t] for t in REPLY_TOKENS * 2]
    assert replies[-1] == msgspec.to_builtins(spare.final_reply(second)) and replies[-1]["chunks"] == 6
    await assert_nothing_more(sched, client, sub)


@pytest.mark.parametrize("how", ["no_subscription", "no_reply"])
async def test_a_decode_that_does_not_ack_is_retried_around(server, client, running, how):
    """``no_subscription``: it heartbeats but takes no jobs (NATS answers "no responders" at
    once). ``no_reply``: it takes the job and never acks (the scheduler's request times out
    after timing.DISPATCH_TIMEOUT_S)."""
    sched = await running(scheduler(server, deadline_s=4 * timing.DISPATCH_TIMEOUT_S))
    prefill = await running(FakeWorker(server, "prefill"))
    mute = await running(FakeWorker(server, "decode", "no_ack", subscribe=how == "no_reply"))
    spare = await running(FakeWorker(server, "decode", running=5))  # busier: picked second
    await workers_seen(client, prefill, mute, spare)

    started = time.monotonic()
    sub = await send(client, request_body(f"r-{how}"))
    replies = await replies_to_final(sub, timeout=3 * timing.DISPATCH_TIMEOUT_S)
    took = time.monotonic() - started

    [answered] = spare.jobs
    assert "error" not in replies[-1]
    assert replies[-1] == msgspec.to_builtins(spare.final_reply(answered))
    await holds(prefill, answered.transfer_id)
    if how == "no_reply":
        await cancelled(mute, [job.transfer_id for job in mute.jobs])
    # Each attempt had its own transfer id, and every failed one was cancelled. The mute
    # decode heartbeats on, so the next heartbeat may put it back and a later attempt pick
    # it again; the scheduler may also cancel a failed attempt twice (its liveness watch
    # can act on it too): both are allowed, and nothing else.
    attempts = [job.transfer_id for job in prefill.jobs]
    seen = f"attempts {attempts}, answered {answered.transfer_id}, prefill cancels " \
           f"{[c.transfer_id for c in prefill.cancels]}, mute jobs {[j.transfer_id for j in mute.jobs]}"
    failed = attempts[:-1]
    assert attempts[-1] == answered.transfer_id and len(set(attempts)) == len(attempts), seen
    assert 1 <= len(failed) <= 2, seen
    assert {c.transfer_id for c in prefill.cancels} == set(failed), seen
    if how == "no_reply":
        assert [job.transfer_id for job in mute.jobs] == failed, seen
        assert {c.transfer_id for c in mute.cancels} == set(failed), seen
        assert took >= timing.DISPATCH_TIMEOUT_S
    else:
        assert mute.jobs == [] and took < timing.DISPATCH_TIMEOUT_S, seen
    await assert_nothing_more(sched, client, sub)


@pytest.mark.parametrize("second_ask", ["while_retrying", "after_the_new_attempt"])
async def test_one_attempt_is_retried_once_however_often_it_is_asked(server, client, running, second_ask):
    """The dispatch's own failure (its decode never acked) and the liveness watch can both
    ask to retry one attempt; a CI run saw the second ask start a third attempt that
    cancelled the second one on the spare. ``while_retrying``: the second ask comes before
    the new attempt has begun; ``after_the_new_attempt``: it comes once the new attempt's
    jobs are out, its decode not yet answering (a verdict the watch made before that
    attempt began). Either way it does nothing: one new attempt, answered by the spare."""
    sched = await running(scheduler(server, deadline_s=4 * timing.DISPATCH_TIMEOUT_S))
    prefill = await running(FakeWorker(server, "prefill"))
    mute = await running(FakeWorker(server, "decode", "no_ack"))
    spare_acks = asyncio.Event()
    spare = await running(FakeWorker(server, "decode", ack_after=spare_acks, running=5))  # busier: picked second
    await workers_seen(client, prefill, mute, spare)

    sub = await send(client, request_body(f"r-{second_ask}"))
    await until(lambda: mute.jobs and prefill.jobs, what="the first attempt's jobs out")
    await mute.stop_heartbeats()  # no heartbeat puts it back in the pool
    [flight] = list(sched.flights)
    control = sched.flight_watch.control
    await control.retry(flight, mute.worker_id)  # the new attempt is spawned, not yet begun
    if second_ask == "after_the_new_attempt":
        await until(lambda: spare.jobs, what="the new attempt's decode job out")
    await control.retry(flight, mute.worker_id)
    spare_acks.set()
    replies = await replies_to_final(sub)

    [first] = mute.jobs
    [answered] = spare.jobs
    assert [job.transfer_id for job in prefill.jobs] == [first.transfer_id, answered.transfer_id]
    assert replies[-1] == msgspec.to_builtins(spare.final_reply(answered))
    assert {c.transfer_id for c in mute.cancels} == {first.transfer_id}
    assert answered.transfer_id not in {c.transfer_id for c in spare.cancels}
    await assert_nothing_more(sched, client, sub)


async def test_a_lost_decode_found_answering_when_its_attempt_is_retried_has_its_stream_migrated(
        server, client, running):
    """A retry fences the attempt first; if the lost decode holds the answer's claim
    already (the scheduler had not heard it stream yet), tokens may be out, so the request
    is not started over but migrated: the old decode is told to stop without an error, and
    a new attempt resumes after what the client has (nothing, here) on the spare."""
    sched = await running(scheduler(server, deadline_s=20))
    prefill = await running(FakeWorker(server, "prefill"))
    holder = await running(FakeWorker(server, "decode", "hold"))
    spare = await running(FakeWorker(server, "decode", running=5))  # busier: picked second
    await workers_seen(client, prefill, holder, spare)

    sub = await send(client, request_body("r-claimed"))
    await until(lambda: holder.jobs and prefill.jobs, what="the first attempt's jobs out")
    [flight] = list(sched.flights)
    await until(lambda: flight.state is FlightState.DISPATCHED, what="the first attempt's jobs taken")
    [first] = holder.jobs
    assert (await holder.claims.claim(first.transfer_key)).won  # it answers: as far as it knows, it streams
    await holder.stop_heartbeats()  # no heartbeat puts it back in the pool
    await sched.flight_watch.control.retry(flight, holder.worker_id)
    replies = await replies_to_final(sub)

    [second] = spare.jobs
    assert [(c.transfer_id, c.error) for c in holder.cancels] == [(first.transfer_id, None)]
    assert second.resume is not None and second.resume.token_ids == [] and second.route.migrations == 1
    assert replies[-1] == msgspec.to_builtins(spare.final_reply(second))
    await assert_nothing_more(sched, client, sub)


async def test_a_decode_that_refuses_without_a_reason_is_retried_around(server, client, running):
    sched = await running(scheduler(server))
    prefill = await running(FakeWorker(server, "prefill"))
    refuser = await running(FakeWorker(server, "decode", "refuse_silently"))
    spare = await running(FakeWorker(server, "decode", running=5))  # busier: picked second
    await workers_seen(client, prefill, refuser, spare)

    sub = await send(client, request_body("r-refused"))
    replies = await replies_to_final(sub, timeout=10)

    assert refuser.jobs, "the refusing decode was tried first"
    [answered] = spare.jobs
    assert replies[-1] == msgspec.to_builtins(spare.final_reply(answered))
    await assert_nothing_more(sched, client, sub)


# --------------------------------------------------------------------------- ending requests


async def test_past_the_deadline_the_client_gets_an_error_and_the_workers_a_cancel(server, client, running):
    deadline_s = 1.5
    sched = await running(scheduler(server, deadline_s=deadline_s))
    prefill = await running(FakeWorker(server, "prefill"))
    decode = await running(FakeWorker(server, "decode", "hold"))
    await workers_seen(client, prefill, decode)

    started = time.monotonic()
    sub = await send(client, request_body("r-late"))
    [final] = await replies_to_final(sub, timeout=deadline_s + 5)
    took = time.monotonic() - started

    assert final["request_id"] == "r-late" and final["finished"] is True
    assert final["error"]["code"] == "deadline_exceeded", final
    assert deadline_s <= took < deadline_s + 2 * timing.WATCH_INTERVAL_S + 1.0
    [job] = decode.jobs
    await until(lambda: prefill.cancels and decode.cancels, what="the workers' CancelJob")
    for cancels in (prefill.cancels, decode.cancels):
        assert [(c.request_id, c.transfer_id, c.reason) for c in cancels] == [
            ("r-late", job.transfer_id, "deadline_exceeded")]
    await assert_nothing_more(sched, client, sub)


async def test_with_no_workers_at_all_the_request_fails_at_once(server, client, running):
    await running(scheduler(server))
    await workers_seen(client)
    started = time.monotonic()
    token_ids, _, final = await generate_all(client, request_body("r-alone"), timeout=5)
    assert time.monotonic() - started < 2.0
    assert token_ids == []
    assert final.request_id == "r-alone"
    assert isinstance(final, wire.ErrorReply) and final.error.code == "no_workers", final


@pytest.mark.parametrize("data", [
    b"\xc1 not msgpack",
    wire.encode(wire.JobAck(accepted=True)),  # msgpack, the wrong message
    msgspec.msgpack.encode({"type": "WorkerHeartbeat", "worker_id": 7, "role": "decode"}),
], ids=["not-msgpack", "another-message", "wrong-fields"])
async def test_a_malformed_heartbeat_is_reported_and_the_scheduler_serves_on(server, client, running, data):
    sched = await running(scheduler(server))
    await workers_seen(client)
    invalid = await (await running(_scheduler_connection(server))).subscribe(wire.INVALID_SUBJECT)
    garbled = await running(FakeWorker(server, "decode", subscribe=False))
    await garbled.stop_heartbeats()
    subject = wire.HEARTBEATS(sender=garbled.worker_id)  # its own subject: a worker gone wrong
    await garbled.nc.publish(subject, data)
    refusal = await refused(invalid, sched)
    await invalid.unsubscribe()
    assert (refusal.subject, refusal.code) == (subject, "bad_message")
    assert refusal.reason

    prefill = await running(FakeWorker(server, "prefill"))
    decode = await running(FakeWorker(server, "decode"))
    await workers_seen(client, prefill, decode)
    sched.pool.forget(garbled.worker_id)  # its good heartbeats came before: not the decode to pick
    token_ids, _, final = await generate_all(client, request_body("r-after-garbage"), timeout=10)
    assert token_ids == REPLY_TOKENS
    assert isinstance(final, wire.FinalReply) and final.request_id == "r-after-garbage"


async def test_a_bad_request_is_refused_and_the_next_one_served(server, client, running):
    """The scheduler's boundary turns a body it cannot use into an error reply, and serves on."""
    await running(scheduler(server))
    prefill = await running(FakeWorker(server, "prefill"))
    decode = await running(FakeWorker(server, "decode"))
    await workers_seen(client, prefill, decode)
    token_ids, _, final = await generate_all(client, b"{not json", timeout=5)
    assert token_ids == [] and isinstance(final, wire.ErrorReply) and final.finished is True
    assert (final.request_id, final.error.code) == ("", "bad_json")
    assert prefill.jobs == decode.jobs == []
    token_ids, _, final = await generate_all(client, request_body("r-good"), timeout=10)
    assert token_ids == REPLY_TOKENS and isinstance(final, wire.FinalReply)
    assert prefill.jobs[0].request_id == decode.jobs[0].request_id == "r-good"


# --------------------------------------------------------------------------- who may say what


async def test_a_heartbeat_naming_another_worker_than_its_subject_is_refused_and_leaves_the_pool_alone(
        server, client, running):
    """A forged restart of the flight's decode (a new incarnation under its id) would make
    the scheduler retry the request around a worker that is alive and holds it."""
    sched = await running(scheduler(server, worker_timeout_s=WORKER_TIMEOUT_S))
    prefill = await running(FakeWorker(server, "prefill"))
    decode = await running(FakeWorker(server, "decode", "hold"))
    await workers_seen(client, prefill, decode)
    invalid = await (await running(_scheduler_connection(server))).subscribe(wire.INVALID_SUBJECT)

    sub = await send(client, request_body("r-forged-beat"))
    await asyncio.wait_for(decode.job_arrived.wait(), 5)
    [job] = decode.jobs
    flight = sched.flights.by_request(client_of(client), "r-forged-beat")
    assert flight.decode_incarnation == decode.incarnation

    intruder = await running(FakeWorker(server, "decode", subscribe=False))
    await intruder.stop_heartbeats()
    sched.pool.forget(intruder.worker_id)
    subject = wire.HEARTBEATS(sender=intruder.worker_id)  # its own subject, another's name
    forged = wire.WorkerHeartbeat(
        worker_id=decode.worker_id, role="decode", free_kv_blocks=0, total_kv_blocks=1000, running=99, waiting=0,
        block_size=16, max_model_len=MAX_MODEL_LEN, incarnation=uuid.uuid4().hex)
    await intruder.nc.publish(subject, wire.encode(forged))
    refusal = await refused(invalid, sched)
    assert (refusal.subject, refusal.code) == (subject, "forged_sender")
    assert decode.worker_id in refusal.reason

    beat = sched.pool.beat(decode.worker_id)
    assert (beat.incarnation, beat.running) == (decode.incarnation, 0)
    assert sched.pool.beat(intruder.worker_id) is None
    now = time.monotonic()
    assert sched.flights.check(now, lambda w, i: sched.pool.is_live(w, i, now)) == []  # nothing to retry
    assert (flight.attempt, flight.transfer_id) == (1, job.transfer_id)

    await decode.answer(job)
    replies = await replies_to_final(sub)
    assert replies[-1] == msgspec.to_builtins(decode.final_reply(job))
    await assert_nothing_more(sched, client, sub)
    assert [j.transfer_id for j in prefill.jobs] == [job.transfer_id]
    assert prefill.cancels == decode.cancels == []


async def test_progress_from_a_worker_that_is_not_the_flights_decode_is_refused_and_does_not_end_it(
        server, client, running):
    sched = await running(scheduler(server))
    prefill = await running(FakeWorker(server, "prefill"))
    decode = await running(FakeWorker(server, "decode", "hold"))
    other = await running(FakeWorker(server, "decode", running=5))  # busier: not picked
    await workers_seen(client, prefill, decode, other)
    invalid = await (await running(_scheduler_connection(server))).subscribe(wire.INVALID_SUBJECT)

    sub = await send(client, request_body("r-other-progress"))
    await asyncio.wait_for(decode.job_arrived.wait(), 5)
    [job] = decode.jobs
    flight = sched.flights.by_request(client_of(client), "r-other-progress")
    for stage, outcome in (("streaming", ""), ("ended", "client_gone")):
        await other.progress(job, stage, outcome)  # on its own subject: not forged, just not its flight
        refusal = await refused(invalid, sched)
        assert (refusal.subject, refusal.code) == (wire.PROGRESS(sender=other.worker_id), "wrong_party")

    assert sched.flights.by_request(client_of(client), "r-other-progress") is flight
    assert not flight.streaming  # a retry is still allowed
    await round_trip(sched.bus.nc)
    await client.flush()
    assert sub.pending_msgs == 0
    assert prefill.cancels == decode.cancels == []  # "client_gone" would have cancelled the jobs

    await decode.answer(job)  # the flight's own decode still ends it
    replies = await replies_to_final(sub)
    assert replies[-1] == msgspec.to_builtins(decode.final_reply(job))
    await assert_nothing_more(sched, client, sub)
    assert other.jobs == []


@pytest.mark.parametrize("mode", ["push", "pull"])
async def test_a_failed_handoff_from_a_prefill_that_is_not_the_flights_does_not_end_it(
        server, client, running, mode):
    sched = await running(scheduler(server))
    prefill = await running(FakeWorker(server, "prefill"))
    other = await running(FakeWorker(server, "prefill", running=5))  # busier: not picked
    decode = await running(FakeWorker(server, "decode", "hold"))
    await workers_seen(client, prefill, other, decode)
    invalid = await (await running(_scheduler_connection(server))).subscribe(wire.INVALID_SUBJECT)

    sub = await send(client, request_body(f"r-other-handoff-{mode}", transfer_mode=mode))
    await asyncio.wait_for(prefill.job_arrived.wait(), 5)
    [job] = prefill.jobs
    flight = sched.flights.by_request(client_of(client), f"r-other-handoff-{mode}")
    await other.handoff(job, error=wire.ErrorBody("engine_failed", "forged failure"))
    refusal = await refused(invalid, sched)
    assert (refusal.subject, refusal.code) == (wire.HANDOFFS(sender=other.worker_id), "wrong_party")

    assert sched.flights.by_request(client_of(client), f"r-other-handoff-{mode}") is flight
    await round_trip(sched.bus.nc)
    await client.flush()
    assert sub.pending_msgs == 0
    assert prefill.cancels == decode.cancels == []
    if mode == "pull":
        await round_trip(decode.nc)
        assert decode.jobs == []  # the forged handoff did not move the flight on either

    await prefill.handoff(job, error=wire.ErrorBody("engine_failed", "out of memory"))  # the flight's own prefill
    [final] = await replies_to_final(sub)
    assert final["error"]["code"] == "engine_failed" and "out of memory" in final["error"]["message"], final
    await cancelled(prefill, [job.transfer_id])
    await assert_nothing_more(sched, client, sub)
    assert other.jobs == []


async def test_only_the_client_that_sent_a_request_can_cancel_it(server, client, running):
    await _only_the_sender_cancels(server, client, running, owned=True)


@PLAIN_ONLY  # an anonymous client cannot log in to the deployed server
async def test_only_the_client_that_sent_an_anonymous_request_can_cancel_it(server, client, running):
    await _only_the_sender_cancels(server, client, running, owned=False)


async def _only_the_sender_cancels(server, client, running, owned: bool) -> None:
    """A named client's request arrives on ``kvpush.generate.<client>``; a cancel counts only
    on the same client's ``kvpush.cancel.<client>`` (an anonymous request: the bare
    ``kvpush.cancel``). Another client's cancel of the same id is a cancel of its own
    request of that id, which does not exist: it touches nothing, and tells it nothing.
    ``kvpush.client.cancel`` picks the subject from the connection."""
    sched = await running(scheduler(server))
    prefill = await running(FakeWorker(server, "prefill"))
    decode = await running(FakeWorker(server, "decode", "hold"))
    await workers_seen(client, prefill, decode)
    owner = client if owned else await server.connect_anonymous()
    intruder = await running(named_client(server))
    request_id = f"r-cancel-{'named' if owned else 'anonymous'}"

    sub = await send(owner, request_body(request_id))
    await asyncio.wait_for(decode.job_arrived.wait(), 5)
    [job] = decode.jobs
    flight = sched.flights.by_request(client_of(owner), request_id)
    assert flight.owner == client_of(owner) and (flight.owner != "") == owned

    intruders = [(intruder, wire.OWNED_CANCEL(client=client_of(intruder)))]
    if owned and not server.deployed:
        intruders.append((await server.connect_anonymous(), wire.CANCEL_SUBJECT))
    for n, (nc, subject) in enumerate(intruders, start=1):
        await nc.publish(subject, wire.encode_json(wire.CancelRequest(request_id)))
        await until(lambda: len(sched.early_cancels) == n, what="the scheduler taking the cancel as another's")
    assert sched.flights.by_request(client_of(owner), request_id) is flight
    await round_trip(sched.bus.nc)
    await owner.flush()
    assert sub.pending_msgs == 0
    assert prefill.cancels == decode.cancels == []

    await cancel(owner, request_id)
    [final] = await replies_to_final(sub)
    assert (final["request_id"], final["error"]["code"]) == (request_id, "cancelled"), final
    await cancelled(decode, [job.transfer_id])
    await cancelled(prefill, [job.transfer_id])
    await assert_nothing_more(sched, owner, sub)
    for nc, _ in intruders[1:]:
        await nc.close()
    if not owned:
        await owner.close()


BAD_REPLIES = {
    "internal-subject": "kvpush.kv.register.x.y",  # a prefill's registrations
    "a-services-inbox": "_KVPUSH_INBOX.scheduler-x.ack",
    "another-clients-inbox": "_INBOX.someone-else.r1",
}


@pytest.mark.parametrize("reply", BAD_REPLIES.values(), ids=BAD_REPLIES.keys())
async def test_a_request_whose_reply_subject_is_not_its_senders_inbox_is_refused_and_nothing_goes_there(
        server, client, running, reply):
    await _bad_reply_refused(server, client, running, reply, owned=True)


@PLAIN_ONLY  # an anonymous client cannot log in to the deployed server
@pytest.mark.parametrize("reply", list(BAD_REPLIES.values())[:2], ids=list(BAD_REPLIES)[:2])
async def test_an_anonymous_request_whose_reply_subject_is_not_an_inbox_is_refused(server, client, running, reply):
    await _bad_reply_refused(server, client, running, reply, owned=False)


async def _bad_reply_refused(server, client, running, reply: str, owned: bool) -> None:
    sched = await running(scheduler(server))
    prefill = await running(FakeWorker(server, "prefill"))
    decode = await running(FakeWorker(server, "decode"))
    await workers_seen(client, prefill, decode)
    sender = client if owned else await server.connect_anonymous()
    invalid = await (await running(_scheduler_connection(server))).subscribe(wire.INVALID_SUBJECT)
    target = await sender.subscribe(reply)  # the deployed server refuses a client this: nothing can arrive
    await round_trip(sender)

    subject = generate_subject(sender)
    await sender.publish(subject, json.dumps(request_body("r-bad-reply")).encode(), reply=reply)
    refusal = await refused(invalid, sched)
    assert (refusal.subject, refusal.code) == (subject, "invalid_reply")
    assert reply in refusal.reason

    assert len(sched.flights) == 0
    await round_trip(sched.bus.nc)
    await sender.flush()
    assert target.pending_msgs == 0
    assert prefill.jobs == decode.jobs == []

    token_ids, _, final = await generate_all(sender, request_body("r-good-reply"), timeout=10)  # served on
    assert token_ids == REPLY_TOKENS and isinstance(final, wire.FinalReply)
    if not owned:
        await sender.close()


@contextlib.asynccontextmanager
async def _scheduler_connection(server):
    """A connection that may read ``kvpush.invalid`` on either server (a client may not)."""
    nc = await server.connect(server.observer())
    try:
        yield nc
    finally:
        await nc.close()


# --------------------------------------------------------------------------- a request sent again


async def test_a_request_sent_again_on_its_inbox_is_taken_for_a_repeat_and_answered_once(server, client, running):
    """A client that heard nothing and found no scheduler knowing its request sends it again
    (services/cli/client.py): if it had arrived after all, the repeat changes nothing."""
    sched = await running(scheduler(server, mode="push"))
    prefill = await running(FakeWorker(server, "prefill"))
    decode = await running(FakeWorker(server, "decode", "hold"))
    await workers_seen(client, prefill, decode)
    body = json.dumps(request_body("r-repeat")).encode()
    inbox = client.new_inbox()
    sub = await client.subscribe(inbox)
    await client.publish(generate_subject(client), body, reply=inbox)
    await until(lambda: len(decode.jobs) == 1, what="decode holding the job")
    asked = await client.request(final_subject(client), wire.encode_json(wire.FinalRequest("r-repeat")), timeout=2)
    assert json.loads(asked.data)["error"]["code"] == "in_flight"

    await client.publish(generate_subject(client), body, reply=inbox)  # the repeat
    other_inbox = client.new_inbox()
    other = await client.subscribe(other_inbox)
    await client.publish(generate_subject(client), body, reply=other_inbox)  # the same id from elsewhere
    refusal = json.loads((await other.next_msg(timeout=5)).data)
    assert refusal["error"]["code"] == "invalid_field" and "already in flight" in refusal["error"]["message"]
    await round_trip(sched.bus.nc)
    await client.flush()
    assert sub.pending_msgs == 0  # the repeat got no error: the flight answers it
    assert len(decode.jobs) == 1 and len(sched.flights) == 1  # and it started nothing


async def test_asking_for_the_final_of_a_request_no_scheduler_knows_says_not_found(server, client, running):
    await running(scheduler(server, mode="push"))
    for _ in range(200):  # until the scheduler's subscription is in place
        try:
            asked = await client.request(final_subject(client), wire.encode_json(wire.FinalRequest("r-never")),
                                         timeout=2)
            break
        except nats.errors.NoRespondersError:
            await asyncio.sleep(0.01)
    error = json.loads(asked.data)["error"]
    assert error["code"] == "not_found" and "never reached a scheduler" in error["message"]


# --------------------------------------------------------------------------- prefix caches


async def test_a_request_goes_to_the_decode_whose_cache_events_say_it_holds_the_prefix(server, client, running):
    """Schedulers route by what each engine's prefix cache holds, as the worker relays its
    KV cache events; events that name another worker than their subject are refused."""
    sched = await running(scheduler(server))
    prefill = await running(FakeWorker(server, "prefill"))
    decodes = [await running(FakeWorker(server, "decode")) for _ in range(2)]
    await workers_seen(client, prefill, *decodes)
    other, holder = sorted(decodes, key=lambda d: d.worker_id)  # equal load picks the first by id: not holder
    prompt = list(range(40))  # two whole blocks of 16
    invalid = await (await running(_scheduler_connection(server))).subscribe(wire.INVALID_SUBJECT)

    held = wire.CacheEvents(worker_id=holder.worker_id, incarnation=holder.incarnation,
                            stored=block_keys(prompt, 16))
    await other.nc.publish(wire.CACHE_EVENTS(sender=other.worker_id), wire.encode(held))
    refusal = await refused(invalid, sched)
    assert (refusal.subject, refusal.code) == (wire.CACHE_EVENTS(sender=other.worker_id), "forged_sender")
    assert sched.pool.cached_tokens(holder.worker_id, Prompt(prompt)) == 0

    await holder.nc.publish(wire.CACHE_EVENTS(sender=holder.worker_id), wire.encode(held))
    await until(lambda: sched.pool.cached_tokens(holder.worker_id, Prompt(prompt)) == 32,
                what="the scheduler taking the holder's events")
    sub = await send(client, {"prompt_token_ids": prompt, "max_tokens": 3, "request_id": "r-held"})
    await replies_to_final(sub)
    assert [job.request_id for job in holder.jobs] == ["r-held"] and other.jobs == []
