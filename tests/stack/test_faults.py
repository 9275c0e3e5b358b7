"""Fault injection on a real stack (tests/fault_rig.py): for every scenario, every request
ends within the deadline, every completed output equals the single-instance reference,
both engines' free KV blocks return to their starting values, and no process dies but
the one killed.

The scenarios share one stack and run in file order; a killed worker is started again
(its identity, a new incarnation) for the scenarios after it.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import pytest

from kvpush.tools.reliability.fault_rig import DEADLINE_S, FaultRig, Outcome, running_rig, wait_until
from kvpush.tools.reliability.soak import FAULT_KINDS, Soak
from kvpush.client import cancel, fetch_final
from kvpush.shared import wire
from tests import prompts

pytestmark = pytest.mark.timeout(900)

LONG, MANY, EIGHT = 6, 4, 5  # indexes into prompts.CORRECTNESS (and the reference)
STREAM = len(prompts.CORRECTNESS) + 3  # prompts.STREAM_PROMPT in the reference
CHAOS = {
    "kvpush.kv.register.": {"drop": 0.25, "duplicate": 0.25, "delay": 0.25, "max_delay_s": 0.4},
    "kvpush.kv.completion.": {"drop": 0.25, "duplicate": 0.25, "delay": 0.25, "max_delay_s": 0.4},
}


@pytest.fixture(scope="module")
async def rig(model_dir, tmp_path_factory):
    async with running_rig(tmp_path_factory.mktemp("faults"), model_dir, prompts.MAX_MODEL_LEN) as rig:
        yield rig


def body(index: int, **extra) -> dict:
    _, prompt, max_tokens = prompts.CORRECTNESS[index]
    return {"prompt_token_ids": prompt, "max_tokens": max_tokens, **extra}


def assert_served(outcome: Outcome, expected: list[int]) -> None:
    assert isinstance(outcome.final, wire.FinalReply), outcome.final
    assert outcome.tokens == expected
    assert outcome.seconds < DEADLINE_S


async def assert_healthy(rig: FaultRig, reference) -> None:
    """Blocks back at their starting counts, nobody else died, and a request is served."""
    await rig.assert_blocks_back()
    rig.assert_nothing_else_died()
    assert_served(await rig.request(body(0)), reference[0])
    await rig.assert_blocks_back()


# ---------------------------------------------------------------------- cancellation

async def _cancel_when(rig: FaultRig, request: dict, trigger) -> Outcome:
    """Send ``request``; once ``trigger()`` (awaited) returns, cancel it as the client."""
    task = asyncio.create_task(rig.request(request))
    await trigger()
    await cancel(rig.conns["client"], request["request_id"])
    return await task


async def test_a_cancel_ends_the_request_at_every_stage_and_frees_both_engines_blocks(rig, reference):
    registrations, sub = await rig.observe("prefill", wire.KV_CONTROL.partly(engine_id="prefill-0"), wire.KvControl)
    try:
        # queued behind other prompts at prefill
        busy = [asyncio.create_task(rig.request(body(LONG))) for _ in range(2)]
        queued = {**body(LONG), "request_id": f"queued-{uuid.uuid4().hex[:6]}"}
        outcome = await _cancel_when(rig, queued, lambda: asyncio.sleep(0.05))
        assert outcome.code == "cancelled"
        for done in await asyncio.gather(*busy):
            assert_served(done, reference[LONG])

        # registered at decode, waiting for the KV that prefill computed: held there (at
        # producer.ready, before prefill offers it), not raced. Raced, a prompt prefill had
        # cached went through in 0.16 s and its final beat the cancel (a CI run).
        waiting = {**body(LONG), "request_id": f"waiting-{uuid.uuid4().hex[:6]}"}

        async def registered_and_held():
            await wait_until(lambda: any(getattr(r, "request_id", "") == waiting["request_id"] for r in registrations),
                             30, "the registration")
            await rig.wait_held("producer.ready", 60)

        rig.hold("producer.ready")
        try:
            outcome = await _cancel_when(rig, waiting, registered_and_held)
        finally:
            rig.release()
        assert outcome.code == "cancelled"

        # streaming tokens
        streaming = {**body(MANY), "max_tokens": 400, "request_id": f"streaming-{uuid.uuid4().hex[:6]}"}
        first_chunk = asyncio.Event()

        async def on_reply(reply):
            first_chunk.set()

        task = asyncio.create_task(rig.request(streaming, on_reply=on_reply))
        await first_chunk.wait()
        await cancel(rig.conns["client"], streaming["request_id"])
        outcome = await task
        assert outcome.code == "cancelled"
        assert 0 < len(outcome.tokens) < 400
    finally:
        await sub.unsubscribe()
    await assert_healthy(rig, reference)


async def test_a_client_that_drops_its_reply_subscription_stops_the_request(rig, reference):
    request_id = await rig.drop_reply_subscription({**body(MANY), "max_tokens": 400})  # no cancel: just gone
    await wait_until(lambda: any(p.request_id == request_id and p.stage == "ended" for p in rig.progress), 30,
                     "the decode worker noticing")
    ended = next(p for p in rig.progress if p.request_id == request_id and p.stage == "ended")
    assert ended.outcome == "client_gone"
    # A client whose connection only blinked (in a NATS cluster, its interest vanishes
    # while it moves to another server) comes back and asks: it is told why, not not_found.
    final = None
    for _ in range(20):  # the scheduler keeps the final in a task of its own, after the progress
        if (final := await fetch_final(rig.conns["client"], request_id)) is not None:
            break
        await asyncio.sleep(0.5)
    assert isinstance(final, wire.ErrorReply) and final.error.code == "stream_lost", final
    assert "nobody listened on the request's reply subject" in final.error.message
    await assert_healthy(rig, reference)


# ---------------------------------------------------------------------- untrusted input

async def test_malformed_messages_on_every_subject_are_refused_with_an_event(rig, reference):
    rig.invalid.clear()
    subjects = await rig.send_malformed()
    rejected = await rig.conns["client"].request(wire.OWNED_GENERATE(client="client-0"), b"\xc1 not json", timeout=10)
    assert json.loads(rejected.data)["error"]["code"] == "bad_json"
    await wait_until(lambda: subjects <= {e.subject for e in rig.invalid}, 15, "an invalid-message event per subject")
    assert all(e.code and e.reason for e in rig.invalid)
    await assert_healthy(rig, reference)


async def test_registrations_with_blocks_out_of_range_or_from_the_wrong_decode_are_refused(rig, reference):
    _, prompt, _ = prompts.CORRECTNESS[MANY]
    failures, sub = await rig.observe("scheduler", wire.COMPLETION_SUBJECTS, wire.Completion)
    try:
        # an impostor (another decode's identity) registers first (right shape, wrong decode),
        # then the chosen decode registers blocks that do not exist
        transfer_id, prefill_id, decode_id = await rig.forge_registration(
            prompt, block_ids=list(range(-(-len(prompt) // prompts.BLOCK_SIZE))), engine="decode-9")
        await wait_until(lambda: any(f.decode_engine_id == "decode-9" for f in failures), 30, "the impostor refused")
        bad = wire.Registration(
            transfer_id=transfer_id, request_id="forged", decode_engine_id=decode_id, decode_request_id="forged",
            decode_tp_size=1, block_ids=[10**9] * -(-len(prompt) // prompts.BLOCK_SIZE), num_tokens=len(prompt),
            registered_at=time.time(), transfer_key="rig-key")
        await rig.conns["decode"].publish(wire.registration_subject(prefill_id, decode_id), wire.encode(bad))
        await wait_until(lambda: any(f.decode_engine_id == decode_id and f.transfer_id == transfer_id
                                     for f in failures), 30, "the out-of-range registration refused")
    finally:
        await sub.unsubscribe()
    by_engine = {f.decode_engine_id: f for f in failures if isinstance(f, wire.TransferFailed)}
    assert by_engine["decode-9"].code == "bad_registration" and "scheduler chose" in by_engine["decode-9"].reason
    assert by_engine[decode_id].code == "bad_registration" and "outside" in by_engine[decode_id].reason
    assert not any(isinstance(f, wire.TransferDone) and f.transfer_id == transfer_id for f in failures)
    await assert_healthy(rig, reference)


# ---------------------------------------------------------------------- dead workers

async def _kill_on_first(rig: FaultRig, role: str, subject: str, indexes: list[int]) -> list[Outcome]:
    """Send requests; kill -9 ``role``'s worker as soon as the first message on
    ``subject`` is seen; start a replacement at once."""
    seen, sub = await rig.observe("prefill", subject)
    old = rig.live_incarnations(role)
    tasks = [asyncio.create_task(rig.request(body(i))) for i in indexes]
    try:
        await wait_until(lambda: seen, 60, f"a message on {subject}")
    finally:
        await sub.unsubscribe()
    rig.kill(role)
    rig.replace(role)
    outcomes = await asyncio.gather(*tasks)
    await rig.wait_for_new_worker(role, old)
    return outcomes


async def test_kill_9_of_decode_during_the_transfer(rig, reference):
    """Decode dies with its blocks registered and the push on its way: requests that had
    not streamed are retried (new transfer id) on the replacement; one that had streamed
    continues there after the tokens its client had (a migration, waiting for the
    replacement: the rig's only decode); prefill frees the blocks it could not push."""
    indexes = [LONG, MANY, EIGHT]
    outcomes = await _kill_on_first(rig, "decode", wire.KV_CONTROL.partly(engine_id="prefill-0"), indexes)
    for index, outcome in zip(indexes, outcomes):
        assert outcome.seconds < DEADLINE_S
        assert outcome.code is None, outcome.final  # nothing lost, streamed or not
        path = outcome.final.path  # and its path report says how
        assert len(outcome.tokens) == len(reference[index])
        if path.migrations:  # greedy: the prompt and the tokens sent, computed again (tests/stack/test_moves.py)
            assert outcome.tokens[:path.resumed_after[0]] == reference[index][:path.resumed_after[0]]
            continue
        assert outcome.tokens == reference[index]
        await rig.assert_pushed(outcome)  # the retry's KV was pushed, not recomputed
        assert path.attempt >= 2 and path.retries == path.attempt - 1 and path.recomputed_tokens == 0
        assert path.received_tokens + path.decode_cached_tokens == path.prompt_tokens
    await assert_healthy(rig, reference)


async def test_kill_9_of_prefill_during_prefill(rig, reference):
    """Prefill dies with a prompt computed and nothing written yet (held right after its
    forward pass): every request is retried with a new transfer id on the replacement,
    whose KV is pushed; decode gives up the blocks it had registered for the dead one.
    Seeded, sampled requests among them give the single engine's tokens after the retry.

    Held, not raced: killed on its first job's arrival, prefill sometimes finished a
    prompt decode mostly had cached and wrote it before the signal landed, and its
    TransferDone, the rig's proof of the push, died unsent with it."""
    indexes = [LONG, MANY, EIGHT]
    seeded = [3, 16]  # indexes into prompts.SEEDED: 64 and 1024 tokens
    old = rig.live_incarnations("prefill")
    rig.hold("producer.ready")
    try:
        tasks = [asyncio.create_task(rig.request(body(i))) for i in indexes]
        seeded_tasks = [asyncio.create_task(rig.request(
            {"prompt_token_ids": prompts.SEEDED[k], "max_tokens": prompts.SEEDED_MAX_TOKENS, "ignore_eos": True,
             **prompts.SEEDED_SAMPLING})) for k in seeded]
        await rig.wait_held("producer.ready", 60)
        rig.kill("prefill")
    finally:
        rig.release()
    rig.replace("prefill")
    outcomes = await asyncio.gather(*tasks)
    await rig.wait_for_new_worker("prefill", old)
    for index, outcome in zip(indexes, outcomes):
        assert_served(outcome, reference[index])
        await rig.assert_pushed(outcome)
    for k, outcome in zip(seeded, await asyncio.gather(*seeded_tasks)):
        assert_served(outcome, reference[prompts.SEEDED_AT + k])  # seed 7's tokens, retried or not
    await assert_healthy(rig, reference)


# ---------------------------------------------------------------------- scheduler death

async def _collect(rig: FaultRig, request: dict, on_reply) -> list[dict]:
    """Send ``request`` as the client on an inbox of its own; every message that comes."""
    client = rig.conns["client"]
    inbox = client.new_inbox()
    replies: list[dict] = []

    async def collect(msg) -> None:
        replies.append(json.loads(msg.data))
        await on_reply(replies[-1])

    await client.subscribe(inbox, cb=collect)
    await client.flush()
    await client.publish(wire.OWNED_GENERATE(client="client-0"), json.dumps(request).encode(), reply=inbox)
    return replies


@pytest.mark.parametrize("mode,stage", [("push", "in prefill"), ("push", "streaming"), ("pull", "in prefill"),
                                        ("pull", "waiting for KV"), ("pull", "streaming")])
async def test_kill_9_of_the_scheduler_that_accepted_a_request(rig, reference, mode, stage):
    """Two schedulers; the one holding the request dies at ``stage``. The other takes the
    flight over: before the first token it fences the attempt and starts a new one; once
    decode streams it lets that decode finish. The client gets exactly one final, with
    the reference output, no token twice."""
    request_id = f"takeover-{mode}-{stage.replace(' ', '-')}-{uuid.uuid4().hex[:6]}"
    request = {**body(LONG, transfer_mode=mode), "ignore_eos": True, "request_id": request_id}
    streaming, handoffs = asyncio.Event(), None

    async def on_reply(reply: dict) -> None:
        if not reply.get("finished"):
            streaming.set()

    if stage == "waiting for KV":
        handoffs, sub = await rig.observe("scheduler", wire.HANDOFFS.wildcard, wire.Handoff)
    started = time.monotonic()
    replies = await _collect(rig, request, on_reply)
    if stage == "streaming":
        await asyncio.wait_for(streaming.wait(), 60)
    elif stage == "waiting for KV":
        await wait_until(lambda: any(h.request_id == request_id for h in handoffs), 60, "the prefill's handoff")
        await sub.unsubscribe()
    record = None
    while record is None or (stage == "in prefill" and record.attempt < 1):
        record = await rig.holder_of(request_id)
        assert time.monotonic() - started < 60, "the flight was never written down"
    rig.kill_scheduler(record.holder)
    try:
        await wait_until(lambda: any(r.get("finished") for r in replies), DEADLINE_S, "the final")
        await asyncio.sleep(2.0)  # a second final would come now
        finals = [r for r in replies if r.get("finished")]
        assert len(finals) == 1, finals
        assert "error" not in finals[0], finals[0]
        assert [t for r in replies if not r.get("finished") for t in r["token_ids"]] == reference[LONG]
        assert time.monotonic() - started < DEADLINE_S
    finally:
        await rig.restart_scheduler(record.holder)
    await assert_healthy(rig, reference)


# ---------------------------------------------------------------------- message faults

async def test_registration_and_completion_messages_dropped_duplicated_delayed_reordered(rig, reference):
    """Lost registrations are sent again, duplicates refused, late ones meet a closed
    transfer; a transfer whose KV cannot come is recomputed by decode (the default
    policy): outputs stay right either way."""
    indexes = [i for i in range(len(prompts.CORRECTNESS)) if i != 7] * 2
    rig.set_chaos(CHAOS)
    try:
        outcomes = await asyncio.gather(*(rig.request(body(i)) for i in indexes))
    finally:
        rig.set_chaos(None)
    for index, outcome in zip(indexes, outcomes):
        assert_served(outcome, reference[index])
    injected = rig.injected()
    assert {"drop", "duplicate", "delay"} <= set(injected), injected
    await assert_healthy(rig, reference)


# ---------------------------------------------------------------------- kv_policy

async def test_a_transfer_that_fails_ends_kv_transfer_failed_with_policy_fail_and_is_recomputed_with_recompute(
        rig, reference):
    """Every registration lost (chaos drops them all): prefill never writes, and decode
    gives the wait up after --kv-wait-s (the rig's 15 s). With ``kv_policy: fail`` the
    request ends with kv_transfer_failed and no token; with ``recompute`` (the default)
    decode computes the prompt and the answer equals the reference. The path report says
    so, and decode's counters count both."""
    decode = (await rig.workers())[1]
    fallbacks = {outcome: rig.metric(decode, "kvpush_kv_fallbacks_total", outcome=outcome)
                 for outcome in ("failed", "recomputed")}
    recomputed_before = rig.metric(decode, "kvpush_kv_recomputed_tokens_total")
    await rig.apply_chaos({"kvpush.kv.register.": {"drop": 1.0}})
    try:
        failed, recomputed = await asyncio.gather(
            rig.request(body(LONG, transfer_mode="push", kv_policy="fail")),
            rig.request(body(EIGHT, transfer_mode="push")))
    finally:
        rig.set_chaos(None)
    assert failed.code == "kv_transfer_failed" and failed.tokens == [], failed.final
    assert "kv_policy is fail" in failed.final.error.message
    assert_served(recomputed, reference[EIGHT])
    path = recomputed.final.path
    assert (path.kv_policy, path.kv_failure, path.received_tokens, path.received_blocks) == (
        "recompute", "kv_wait_expired", 0, 0)
    assert 0 < path.recomputed_tokens == path.decode_computed_tokens == path.prompt_tokens - path.decode_cached_tokens
    assert rig.metric(decode, "kvpush_kv_fallbacks_total", outcome="failed") == fallbacks["failed"] + 1
    assert rig.metric(decode, "kvpush_kv_fallbacks_total", outcome="recomputed") == fallbacks["recomputed"] + 1
    # Why, counted by decode's connector in its engine core: both waits ran out.
    assert rig.metric(decode, "kvpush_kv_load_failures_total", engine_core=True, reason="kv_wait_expired") >= 2
    assert rig.metric(decode, "kvpush_kv_recomputed_tokens_total") == recomputed_before + path.recomputed_tokens
    await assert_healthy(rig, reference)


# ---------------------------------------------------------------------- NATS restart

async def test_nats_restart_while_tokens_stream(rig, reference):
    stream = {"prompt_token_ids": prompts.STREAM_PROMPT, "max_tokens": prompts.STREAM_MAX_TOKENS}
    streaming = asyncio.Event()

    async def on_reply(reply):
        if isinstance(reply, wire.TokenChunk):
            streaming.set()

    tasks = [asyncio.create_task(rig.request(dict(stream), on_reply=on_reply)) for _ in range(3)]
    await asyncio.wait_for(streaming.wait(), 120)
    rig.nats.restart()
    outcomes = await asyncio.gather(*tasks)
    for outcome in outcomes:
        assert outcome.seconds < DEADLINE_S
        if outcome.code is None:
            assert outcome.tokens == reference[STREAM]
        else:
            assert outcome.code, outcome.final  # an answer with a code
    await asyncio.sleep(2)  # heartbeats resume after the reconnect
    await assert_healthy(rig, reference)


# ---------------------------------------------------------------------- soak (CI-sized)

async def test_a_short_soak_loses_nothing_and_leaks_nothing(rig, reference):
    """``kvpush soak``'s loop, sized for CI: requests at a steady rate while the lighter
    faults (cancel, client gone, a dropped final, a scheduler killed, malformed and forged
    messages, message chaos) go in."""
    bodies = [{"prompt_token_ids": p, "max_tokens": n, "ignore_eos": True} for _, p, n in prompts.CORRECTNESS]
    soak = Soak(rig, bodies, reference[: len(bodies)], seed=3)
    wanted = FAULT_KINDS.index("message_chaos") + 1  # every kind up to message chaos, however slow the machine
    tally = await soak.run(seconds=40, rate=1.0, fault_every_s=5, at_least_faults=wanted, most_seconds=150)
    assert tally.sent >= 10
    assert {"cancel", "client_gone", "dropped_final", "kill_scheduler", "malformed", "forged_registration",
            "message_chaos"} <= set(tally.faults), tally.faults
    assert tally.lost == [] and tally.wrong == [] and tally.unexpected == []
    assert tally.leaked_blocks == {"prefill": 0, "decode": 0}
    assert tally.died == []
    assert tally.worst_final_s < DEADLINE_S
