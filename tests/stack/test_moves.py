"""Requests that move to the other decode, on a real 1P2D rig (tools/reliability/fault_rig.py).

Before the KV is written: push binds its decode at arrival. When that decode stalls, the
scheduler moves the transfer to another decode: prefill writes into the new decode's
registration, the first decode's blocks come back through its revoke, and the prompt is
not computed again. Prefill is held where its KV is ready (``producer.ready``, through the
rig's hold file) until the move is done, so the order is certain; the stalled decode is
SIGSTOPped, and let go at the end.

Mid-stream: a decode killed (kill -9) or whose engine hangs (SIGSTOP of its engine process,
its worker heartbeating) after tokens went out; the stream continues on the other decode
(kvpush.services.scheduler.migrations), and the client sees one stream: seq contiguous,
one final counting every chunk, the single engine's continuation.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass, field

import jsonschema
import pytest

from kvpush.shared import wire
from tests import prompts
from kvpush.tools.reliability.fault_rig import running_rig, wait_until

pytestmark = pytest.mark.timeout(600)

LONG = 6  # prompts.CORRECTNESS index


@pytest.fixture(scope="module")
async def rig(model_dir, tmp_path_factory):
    # Leases outlast the worker timeout (3 s): the KV waits while the scheduler notices.
    # A streaming decode without a token for 5 s has stalled (the tests' requests make one
    # every ~0.1 s here); compact JSON, as the stack's: a random-weight model spins in whitespace.
    env = {"KVPUSH_LEASE_S": "20", "KVPUSH_QUARANTINE_S": "25", "KVPUSH_STALL_S": "5",
           "KVPUSH_JSON_WHITESPACE": "none"}
    async with running_rig(tmp_path_factory.mktemp("moves"), model_dir, prompts.MAX_MODEL_LEN, decodes=2,
                           extra_env=env) as rig:
        yield rig


async def test_a_transfer_whose_decode_stalls_moves_to_the_other_decode(rig, reference):
    registrations, reg_sub = await rig.observe("prefill", wire.KV_CONTROL.partly(engine_id="prefill-0"),
                                               wire.KvControl)
    events, event_sub = await rig.observe("scheduler", wire.COMPLETION_SUBJECTS, wire.Completion)
    _, prompt, max_tokens = prompts.CORRECTNESS[LONG]
    request_id = "moved-once"
    rig.hold("producer.ready")
    stalled = None
    try:
        served = asyncio.create_task(rig.request({"prompt_token_ids": prompt, "max_tokens": max_tokens,
                                                  "transfer_mode": "push", "request_id": request_id}))

        def registered(by=None):
            return [r for r in registrations if isinstance(r, wire.Registration) and r.request_id == request_id
                    and (by is None or r.decode_engine_id == by)]

        first = (await wait_until(registered, 60, "the first decode's registration"))[0]
        stalled = first.decode_engine_id
        rig.pause(stalled)
        other = next(name for name in ("decode-0", "decode-1") if name != stalled)
        moved = await wait_until(lambda: [e for e in events if isinstance(e, wire.TransferMoved)
                                          and e.transfer_id == first.transfer_id], 30, "the move's answer")
        assert moved[0].moved and moved[0].decode_engine_id == other
        second = (await wait_until(lambda: registered(other), 30, "the other decode's registration"))[0]
        assert second.transfer_id == first.transfer_id  # the same transfer: prefill computes nothing again
        assert second.transfer_key != first.transfer_key  # a key of its own: the stalled decode's is spent
        rig.release()

        outcome = await served
        assert isinstance(outcome.final, wire.FinalReply), outcome.final
        assert outcome.tokens == reference[LONG]
        done = await wait_until(lambda: [e for e in events if isinstance(e, wire.TransferDone)
                                         and e.transfer_id == first.transfer_id], 10, "the write's end")
        assert {e.decode_engine_id for e in done} == {other}  # written once, into the new decode
        ended = await wait_until(lambda: [p for p in rig.progress if p.request_id == request_id
                                          and p.stage == "ended"], 10, "the end reported")
        assert ended[-1].transfer_id == first.transfer_id  # no retry: the first attempt answered
        # The path report says so: one attempt, one move, the other decode, the whole prompt received.
        path = outcome.final.path
        assert (path.mode, path.attempt, path.moves, path.decode_worker, path.prefill_worker) == (
            "push", 1, 1, other, "prefill-0")
        assert (path.received_tokens, path.received_blocks, path.decode_computed_tokens, path.recomputed_tokens) == (
            len(prompt) - path.decode_cached_tokens, len(second.block_ids), 0, 0)
        assert path.received_bytes == sum(e.bytes for e in done)  # what prefill's WRITE moved
    finally:
        rig.release()
        if stalled is not None:
            rig.resume(stalled)
        await reg_sub.unsubscribe()
        await event_sub.unsubscribe()
    # The stalled decode wakes to its cancel: its Revoke is answered and its blocks come back.
    await rig.assert_blocks_back(timeout=60)
    rig.assert_nothing_else_died()
    assert rig.live_workers("decode").keys() == {"decode-0", "decode-1"}


# ------------------------------------------------------------------ mid-stream migration

DIGITS = {"type": "object", "properties": {"values": {"type": "array", "minItems": 40, "maxItems": 40,
                                                      "items": {"type": "integer", "minimum": 0, "maximum": 99}}},
          "required": ["values"], "additionalProperties": False}
MAX_TOKENS = 300  # long enough that every stream still runs when its decode dies


@dataclass
class Stream:
    """One request as its client saw it."""

    body: dict
    seqs: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    arrivals: list[float] = field(default_factory=list)  # when each chunk came (monotonic)
    outcome: object = None

    @property
    def request_id(self) -> str:
        return self.body["request_id"]

    async def on_reply(self, reply) -> None:
        if isinstance(reply, wire.TokenChunk):
            self.seqs.append(reply.seq)
            self.tokens.extend(reply.token_ids)
            self.text += reply.text
            self.arrivals.append(time.monotonic())


def _body(name: str, mode: str, length: int, prompt_seed: int, **sampling) -> dict:
    return {"request_id": f"{name}-{time.monotonic_ns()}", "transfer_mode": mode, "max_tokens": MAX_TOKENS,
            "prompt_token_ids": prompts.token_prompt(length, prompt_seed), **sampling}


@contextlib.asynccontextmanager
async def _streaming_on(rig, decode: str, bodies: list[dict], at_least: int):
    """Send ``bodies`` while the other decode is stopped, so each streams on ``decode``;
    yields (each request's stream, its task) once each has sent ``at_least`` tokens, and
    lets the other decode go on when the block ends (a migration waits for a live decode)."""
    other = next(name for name in ("decode-0", "decode-1") if name != decode)
    rig.pause(other)
    try:
        await wait_until(lambda: other not in rig.live_workers("decode", within_s=3.2), 15, f"{other} silent")
        await asyncio.sleep(1.0)  # past the schedulers' worker timeout (3 s): nothing goes to it
        streams = [Stream(body) for body in bodies]
        tasks = [asyncio.create_task(rig.request(s.body, on_reply=s.on_reply)) for s in streams]
        await wait_until(lambda: all(len(s.tokens) >= at_least for s in streams) or any(t.done() for t in tasks),
                         120, f"every request {at_least} tokens in")
        assert not any(t.done() for t in tasks), [t.result() for t in tasks if t.done()]
        assert {rig.streaming_on[s.request_id] for s in streams} == {decode}
        yield list(zip(streams, tasks))
    finally:
        rig.resume(other)


async def _continuation(rig, stream: Stream, resumed_after: int) -> list[int]:
    """What a single engine generates given the prompt and the first ``resumed_after``
    tokens as its prompt (local: one engine computes the prompt and decodes)."""
    body = {**stream.body, "request_id": f"ref-{time.monotonic_ns()}", "transfer_mode": "local",
            "prompt_token_ids": stream.body["prompt_token_ids"] + stream.tokens[:resumed_after],
            "max_tokens": MAX_TOKENS - resumed_after}
    outcome = await rig.request(body)
    assert isinstance(outcome.final, wire.FinalReply), outcome.final
    return outcome.tokens


async def _uninterrupted(rig, stream: Stream) -> Stream:
    again = Stream({**stream.body, "request_id": f"again-{time.monotonic_ns()}"})
    again.outcome = await rig.request(again.body, on_reply=again.on_reply)
    assert isinstance(again.outcome.final, wire.FinalReply), again.outcome.final
    return again


def _migrations(rig, why: str) -> float:
    """Streams continued on another decode, as both schedulers count them."""
    return sum(rig.metric(name, "kvpush_migrations_total", why=why) for name in ("scheduler", "scheduler-1")
               if name in rig.stack.metrics_targets)


async def _check_migrated(rig, stream: Stream, from_decode: str, to_decode: str, continuation: str) -> int:
    """One stream, contiguous and counted, continued on ``to_decode``; returns the tokens
    its client had at the break."""
    final = stream.outcome.final
    assert isinstance(final, wire.FinalReply), final
    assert stream.seqs == list(range(len(stream.seqs))) and final.chunks == len(stream.seqs)
    assert final.usage.completion_tokens == len(stream.tokens) and \
        final.usage.prompt_tokens == len(stream.body["prompt_token_ids"])
    path = final.path
    assert (path.migrations, path.decode_worker, path.continuation, path.retries) == (1, to_decode, continuation, 0)
    assert path.mode == stream.body["transfer_mode"]
    resumed_after = path.resumed_after[0]
    assert 0 < resumed_after < len(stream.tokens)
    ended = [p for p in rig.progress if p.request_id == stream.request_id and p.stage == "ended" and p.outcome == "ok"]
    assert len(ended) == 1 and ended[0].worker_id == to_decode  # one final, from the new decode
    return resumed_after


async def test_a_decode_killed_mid_stream_continues_on_the_other_in_every_mode(rig):
    """kill -9 of the decode streaming seven requests: push, pull and local, greedy and
    seeded, and a JSON-schema answer. Each continues on the other decode after the last
    token its client had: greedy as a single engine continues the prompt plus those tokens;
    seeded and JSON exactly as the uninterrupted request (replayed: the seed's generator
    and the grammar advance over the tokens sent)."""
    metric_before = _migrations(rig, "lost")
    bodies = [_body(f"{mode}-{kind}", mode, 200 + 40 * i, 900 + i, **sampling)
              for i, (mode, kind, sampling) in enumerate(
                  [(mode, kind, sampling) for mode in ("push", "pull", "local")
                   for kind, sampling in (("greedy", {}), ("seeded", prompts.SEEDED_SAMPLING))])]
    bodies.append({**_body("json", "push", 120, 950), "ignore_eos": False,
                   "structured_outputs": {"json": DIGITS}})
    old = rig.live_incarnations("decode")
    async with _streaming_on(rig, "decode-0", bodies, at_least=4) as running:
        rig.kill_worker("decode-0")
    for stream, task in running:
        stream.outcome = await task
    rig.replace("decode", "decode-0")
    for stream, _ in running:
        greedy = "temperature" not in stream.body and "structured_outputs" not in stream.body
        resumed_after = await _check_migrated(rig, stream, "decode-0", "decode-1",
                                              "reprefill" if greedy else "replay")
        if greedy:
            assert stream.tokens[resumed_after:] == await _continuation(rig, stream, resumed_after), stream.body
        else:
            again = await _uninterrupted(rig, stream)
            assert stream.tokens == again.tokens, stream.body  # exactly the uninterrupted request
            if "structured_outputs" in stream.body:
                assert stream.text == again.text
                jsonschema.validate(json.loads(stream.text), DIGITS)
    assert _migrations(rig, "lost") == metric_before + len(bodies)
    await rig.wait_for_new_worker("decode", old)
    await rig.assert_blocks_back(timeout=60)
    rig.assert_nothing_else_died()


async def test_a_decode_whose_engine_hangs_mid_stream_is_migrated(rig):
    """The engine of the streaming decode stops (SIGSTOP of its engine process) while its
    worker heartbeats: no token for --stall-s (5 s), and the streams continue on the other
    decode; the stalled worker was told to stop, sends nothing more, and once its engine
    runs again gives its blocks back."""
    bodies = [_body("stall-greedy", "push", 300, 960), _body("stall-seeded", "pull", 200, 961,
                                                              **prompts.SEEDED_SAMPLING)]
    async with _streaming_on(rig, "decode-1", bodies, at_least=4) as running:
        rig.pause_engine("decode-1")
    try:
        for stream, task in running:
            stream.outcome = await task
    finally:
        rig.resume_engine("decode-1")
    greedy, seeded = (stream for stream, _ in running)
    resumed_after = await _check_migrated(rig, greedy, "decode-1", "decode-0", "reprefill")
    assert greedy.tokens[resumed_after:] == await _continuation(rig, greedy, resumed_after)
    await _check_migrated(rig, seeded, "decode-1", "decode-0", "replay")
    assert seeded.tokens == (await _uninterrupted(rig, seeded)).tokens
    assert _migrations(rig, "stalled") == 2
    await rig.assert_blocks_back(timeout=60)
    rig.assert_nothing_else_died()
