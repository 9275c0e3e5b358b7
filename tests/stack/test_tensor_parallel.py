"""Tensor parallelism across the split (issue 44), on real vLLM engines under the rig's
generated NATS identities (tools/reliability/fault_rig.py: mutual TLS, one user per service).

One rig serves every combination: prefill-0 at TP 2, prefill-1 at TP 1, decode-0 at TP 2,
decode-1 at TP 1 (``Stack(worker_tp=)``), each rank with vLLM's default KV space. A test
picks its pair of engines by stopping the other two workers (SIGSTOP of the worker and its
engine's processes): silent past the schedulers' worker timeout, they are routed nothing,
and they go on when let go. Prefix caching is off, so every request's whole prompt crosses.

- Every pair (P TP 2 -> D TP 2, TP 2 -> TP 1, TP 1 -> TP 2), in push and pull, gives the
  tokens of one plain vLLM engine at TP 1 (the session's reference: at this model's size TP
  changes no output), each rank's KV verified (``--kv-checksums full``), and one kv.write
  span per pair of ranks that copied.
- One prefill rank's WRITE dropped (``kv.write.1``): the request never runs on part of its
  KV; ``kv_policy: fail`` ends it with an error, ``recompute`` computes the prompt on decode;
  every engine's blocks come back.
- One decode rank's landed bytes flipped (``kv.flip.1``): its checksum fails the load;
  nothing wrong is served, in push and pull.
- A transfer moved before its write: decode-0 (TP 2) stalls after registering, and prefill-0's
  two ranks write into decode-1 (TP 1) instead; decode-0's ranks free their blocks after.
- Layer-wise push from the TP-2 prefill (started again with ``--push-by-layer on``) to the
  TP-2 and the TP-1 decode: one WRITE a layer per pair of ranks, every rank verified.
- One decode rank's process killed mid-stream (kill -9 of ``VLLM::Worker_TP1``): vLLM stops
  the engine, the worker exits without a word (services/worker/service.py), and the
  schedulers continue the stream on the other decode; the client gets one whole stream.
  It runs last: decode-0 stays dead.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import Counter
from pathlib import Path

import psutil
import pytest

from kvpush.otel import attributes as A
from kvpush.otel import trace_view as view
from kvpush.shared import wire
from kvpush.tools.reliability.fault_rig import FaultRig, Outcome, running_rig, wait_until
from tests import prompts

pytestmark = pytest.mark.timeout(900)

ENGINES = {"prefill-0": "prefill", "prefill-1": "prefill", "decode-0": "decode", "decode-1": "decode"}
TP = {"prefill-0": 2, "prefill-1": 1, "decode-0": 2, "decode-1": 1}
PAIRS = {"P2-D2": ("prefill-0", "decode-0"), "P2-D1": ("prefill-0", "decode-1"), "P1-D2": ("prefill-1", "decode-0")}
# The (prefill rank, decode rank) pairs that copy a request's KV: each prefill rank holds
# half of the two KV heads at TP 2, all at TP 1 (kvpush.connector.tp_map).
RANK_PAIRS = {"P2-D2": {(0, 0), (1, 1)}, "P2-D1": {(0, 0), (1, 0)}, "P1-D2": {(0, 0), (0, 1)}}
CORRECT = (1, 3, 4)  # prompts.CORRECTNESS: 127, 129 and 1000 tokens
SEEDED = 12  # prompts.SEEDED[12]: 500 tokens, sampled with SEEDED_SAMPLING (seed 7)
STREAMED = prompts.token_prompt(300, 4400)  # long enough a stream that it still runs when its rank dies
STREAMED_TOKENS = 400
WORKER_TIMEOUT_S = 3.0  # the rig's KVPUSH_WORKER_TIMEOUT_S


@pytest.fixture(scope="module")
async def rig(model_dir, tmp_path_factory, otlp):
    env = {"KVPUSH_KV_CHECKSUMS": "full", "OTEL_EXPORTER_OTLP_ENDPOINT": otlp.endpoint,
           "KVPUSH_JSON_WHITESPACE": "none"}
    async with running_rig(tmp_path_factory.mktemp("tp"), model_dir, prompts.MAX_MODEL_LEN, prefills=2, decodes=2,
                           worker_tp={name: tp for name, tp in TP.items() if tp != 1}, extra_env=env,
                           prefix_caching="off") as rig:
        yield rig


class Router:
    """Which engines the schedulers may route to: the others' workers stopped (SIGSTOP)."""

    def __init__(self, rig: FaultRig):
        self.rig = rig
        self.stopped: set[str] = set()

    async def only(self, *names: str) -> None:
        """From now on every request goes to ``names`` (one prefill and one decode, or fewer)."""
        wanted = set(ENGINES) - set(names)
        for name in sorted(self.stopped - wanted):
            self.rig.resume(name)
        for name in sorted(wanted - self.stopped):
            self.rig.pause(name)
        self.stopped = wanted

        def settled() -> bool:
            live = {**self.rig.live_workers("prefill", within_s=WORKER_TIMEOUT_S + 0.2),
                    **self.rig.live_workers("decode", within_s=WORKER_TIMEOUT_S + 0.2)}
            fresh = {**self.rig.live_workers("prefill", within_s=1.5), **self.rig.live_workers("decode", within_s=1.5)}
            return not (live.keys() & self.stopped) and set(names) <= fresh.keys()

        await wait_until(settled, 30, f"only {names} heard")
        await asyncio.sleep(1.0)  # past the schedulers' worker timeout: nothing goes to the stopped ones


@pytest.fixture(scope="module")
async def router(rig):
    routed = Router(rig)
    yield routed
    for name in routed.stopped:
        rig.resume(name)


def body(index: int, mode: str, **extra) -> dict:
    _, prompt, max_tokens = prompts.CORRECTNESS[index]
    return {"prompt_token_ids": prompt, "max_tokens": max_tokens, "transfer_mode": mode,
            "request_id": f"tp-{mode}-{index}-{uuid.uuid4().hex[:8]}", **extra}


def seeded_body(mode: str) -> dict:
    return {"prompt_token_ids": prompts.SEEDED[SEEDED], "max_tokens": prompts.SEEDED_MAX_TOKENS, "transfer_mode": mode,
            "request_id": f"tp-seeded-{mode}-{uuid.uuid4().hex[:8]}", **prompts.SEEDED_SAMPLING}


def assert_received_whole(outcome: Outcome, mode: str, pair: tuple[str, str]) -> None:
    """Served on the pair, the whole prompt's KV received (checked apart: ``kv_checksum``)."""
    assert isinstance(outcome.final, wire.FinalReply), outcome.final
    path = outcome.final.path
    assert (path.mode, path.prefill_worker, path.decode_worker, path.attempt) == (mode, *pair, 1), path
    assert (path.received_tokens, path.decode_computed_tokens, path.kv_failure) == (path.prompt_tokens, 0, ""), path
    assert path.received_bytes > 0, path
    if TP[pair[1]] > 1:  # each decode rank says what landed in its blocks (kvpush explain prints it)
        assert [part.rank for part in path.received_by_rank] == list(range(TP[pair[1]])), path
        assert all(part.blocks == path.received_blocks for part in path.received_by_rank), path
        assert sum(part.bytes for part in path.received_by_rank) == path.received_bytes, path


def _ranks(span: dict) -> tuple[int, int]:
    return int(span["attributes"][A.RANK]), int(span["attributes"][A.PEER_RANK])


async def write_pairs(otlp, request_id: str, expected: set[tuple[int, int]]) -> set[tuple[int, int]]:
    """The (rank, peer rank) of each kv.write span in the request's trace, once the expected
    ones came; each pair of ranks has one span."""
    def writes(spans: list[dict]) -> list[dict] | None:
        found = [s for s in view.find_trace(spans, request_id) or [] if s["name"] == A.KV_WRITE]
        return found if {_ranks(s) for s in found} >= expected else None

    pairs = [_ranks(s) for s in await asyncio.to_thread(otlp.wait_for, writes, 20) or []]
    assert len(pairs) == len(set(pairs)), pairs
    return set(pairs)


@pytest.mark.parametrize("pair", list(PAIRS))
async def test_every_pair_of_tensor_parallel_sizes_gives_the_single_engines_tokens(rig, router, otlp, reference,
                                                                                  pair):
    """Greedy and seeded, push and pull: each rank's heads cross to the decode ranks that hold
    them, are checked there, and the tokens are a single plain engine's."""
    await router.only(*PAIRS[pair])
    sent = [(body(i, mode), prompts.CORRECTNESS[i][0], reference[i]) for mode in ("push", "pull") for i in CORRECT]
    sent += [(seeded_body(mode), "seeded", reference[prompts.SEEDED_AT + SEEDED]) for mode in ("push", "pull")]
    outcomes = await asyncio.gather(*(rig.request(b) for b, _, _ in sent))
    for (request, name, want), outcome in zip(sent, outcomes):
        assert outcome.tokens == want, (pair, request["transfer_mode"], name, outcome.final)
        assert_received_whole(outcome, request["transfer_mode"], PAIRS[pair])
    pushed = next(b for b, _, _ in sent if b["transfer_mode"] == "push")
    assert await write_pairs(otlp, pushed["request_id"], RANK_PAIRS[pair]) == RANK_PAIRS[pair]
    await rig.assert_blocks_back(workers=set(PAIRS[pair]))
    # Every rank checked the heads that landed in its blocks against prefill's digests.
    checked = {(b["transfer_mode"], o.final.path.kv_checksum) for (b, _, _), o in zip(sent, outcomes)}
    assert checked == {("push", "verified"), ("pull", "verified")}, checked


async def test_one_prefill_ranks_write_dropped_is_never_served_and_every_rank_frees_its_blocks(rig, router, reference):
    """Prefill rank 1's WRITEs fail (rank 0's land): no request runs on half its heads. Under
    ``fail`` the client gets the error; under ``recompute`` decode computes the prompt and
    the tokens are right; both engines' blocks, every rank's, come back."""
    await router.only(*PAIRS["P2-D2"])
    drops = rig.injected()["drop"]
    await rig.apply_chaos({"kv.write.1": {"drop": 1.0}})
    try:
        failed, recomputed = await asyncio.gather(rig.request(body(4, "push", kv_policy="fail")),
                                                  rig.request(body(3, "push", kv_policy="recompute")))
    finally:
        await rig.apply_chaos(None)
    assert rig.injected()["drop"] - drops == 2  # one WRITE each, both of rank 1
    assert failed.code == "kv_transfer_failed" and failed.tokens == [], failed.final
    assert isinstance(recomputed.final, wire.FinalReply), recomputed.final
    path = recomputed.final.path
    assert (path.kv_failure, path.received_tokens, path.kv_policy) == ("write_failed", 0, "recompute"), path
    assert path.recomputed_tokens == path.prompt_tokens
    assert recomputed.tokens == reference[3]
    await rig.assert_blocks_back(workers=set(PAIRS["P2-D2"]))


@pytest.mark.parametrize("mode", ["push", "pull"])
async def test_one_decode_ranks_flipped_byte_fails_the_load_and_nothing_wrong_is_served(rig, router, reference, mode):
    await router.only(*PAIRS["P2-D2"])
    flips = rig.injected()["flip"]
    await rig.apply_chaos({"kv.flip.1": {"flip": 1.0}})
    try:
        outcomes = await asyncio.gather(*(rig.request(body(i, mode, kv_policy="recompute")) for i in CORRECT),
                                        rig.request(body(4, mode, kv_policy="fail")))
    finally:
        await rig.apply_chaos(None)
    assert rig.injected()["flip"] - flips == len(outcomes)  # rank 1 only: one flip a transfer
    *served, failed = outcomes
    for index, outcome in zip(CORRECT, served):
        assert isinstance(outcome.final, wire.FinalReply), outcome.final
        assert outcome.tokens == reference[index], outcome.final.path  # nothing wrong served
        path = outcome.final.path
        assert (path.mode, path.kv_failure, path.received_tokens) == (mode, "checksum_mismatch", 0), path
        assert path.recomputed_tokens == path.prompt_tokens
    assert failed.code == "kv_transfer_failed" and failed.tokens == [], failed.final
    await rig.assert_blocks_back(workers=set(PAIRS["P2-D2"]))


async def test_a_transfer_moves_before_its_write_from_the_tp_2_decode_to_the_tp_1_decode(rig, router, reference):
    """Prefill-0's two ranks hold the prompt's KV before writing it (``producer.ready``);
    decode-0 (TP 2), which registered, stalls: the scheduler moves the transfer to decode-1
    (TP 1), each prefill rank writes its heads into decode-1's one rank, the tokens are a
    single engine's, and decode-0's ranks give back their blocks once it runs again."""
    await router.only(*PAIRS["P2-D2"])
    registrations, reg_sub = await rig.observe("prefill", wire.KV_CONTROL.partly(engine_id="prefill-0"),
                                               wire.KvControl)
    events, event_sub = await rig.observe("scheduler", wire.COMPLETION_SUBJECTS, wire.Completion)
    request = body(4, "push")

    def registered(by: str) -> list[wire.Registration]:
        return [r for r in registrations if isinstance(r, wire.Registration)
                and r.request_id == request["request_id"] and r.decode_engine_id == by]

    rig.hold("producer.ready")
    try:
        served = asyncio.create_task(rig.request(request))
        first = (await wait_until(lambda: registered("decode-0"), 60, "decode-0's registration"))[0]
        await rig.wait_held("producer.ready", 60)
        rig.pause("decode-0")
        rig.resume("decode-1")
        router.stopped = {"prefill-1", "decode-0"}
        moved = await wait_until(lambda: [e for e in events if isinstance(e, wire.TransferMoved)
                                          and e.transfer_id == first.transfer_id], 30, "the move's answer")
        assert moved[0].moved and moved[0].decode_engine_id == "decode-1"
        second = (await wait_until(lambda: registered("decode-1"), 30, "decode-1's registration"))[0]
        assert second.transfer_id == first.transfer_id and second.decode_tp_size == 1
        rig.release()
        outcome = await served
    finally:
        rig.release()
        await reg_sub.unsubscribe()
        await event_sub.unsubscribe()
    assert outcome.tokens == reference[4], outcome.final
    path = outcome.final.path
    assert (path.mode, path.attempt, path.moves, path.prefill_worker, path.decode_worker) == (
        "push", 1, 1, "prefill-0", "decode-1"), path
    assert (path.received_tokens, path.kv_checksum) == (path.prompt_tokens, "verified"), path
    done = [e for e in events if isinstance(e, wire.TransferDone) and e.transfer_id == first.transfer_id]
    assert {e.decode_engine_id for e in done} == {"decode-1"}  # written once, into the new decode only
    await rig.assert_blocks_back(workers={"prefill-0", "decode-1"})
    await router.only(*PAIRS["P2-D2"])  # decode-0 runs again and hears its registration is gone
    await rig.assert_blocks_back(workers={"decode-0"})


async def write_spans(otlp, request_id: str, expected: int) -> Counter:
    """How many kv.write spans each (rank, peer rank) has in the request's trace, once
    ``expected`` came."""
    def writes(spans: list[dict]) -> list[dict] | None:
        found = [s for s in view.find_trace(spans, request_id) or [] if s["name"] == A.KV_WRITE]
        return found if len(found) >= expected else None

    return Counter(_ranks(s) for s in await asyncio.to_thread(otlp.wait_for, writes, 20) or [])


async def test_layer_wise_push_from_a_tp_2_prefill_writes_each_ranks_layers_to_either_decode(rig, router, otlp,
                                                                                           reference):
    """prefill-0 again with ``--push-by-layer on``: each of its ranks WRITEs its heads one
    layer at a time as the forward finishes them, into decode-0's two ranks and into
    decode-1's one; every rank's KV is verified and the tokens are a single engine's."""
    layers = json.loads((Path(rig.model) / "config.json").read_text())["num_hidden_layers"]
    rig.stack.extra_env["KVPUSH_PUSH_BY_LAYER"] = "on"
    try:
        old = rig.live_incarnations("prefill")
        rig.replace("prefill", rig.kill_worker("prefill-0"))
        await rig.wait_for_new_worker("prefill", old)
    finally:
        del rig.stack.extra_env["KVPUSH_PUSH_BY_LAYER"]  # a later start of any worker: whole prompts
    for pair in ("P2-D2", "P2-D1"):
        await router.only(*PAIRS[pair])
        sent = [(body(i, "push"), reference[i]) for i in CORRECT]
        outcomes = await _behind_a_held_forward(rig, [b for b, _ in sent])
        for (request, want), outcome in zip(sent, outcomes):
            assert outcome.tokens == want, (pair, outcome.final)
            assert_received_whole(outcome, "push", PAIRS[pair])
            assert outcome.final.path.kv_checksum == "verified", outcome.final.path
            writes = await write_spans(otlp, request["request_id"], layers * len(RANK_PAIRS[pair]))
            assert writes == {ranks: layers for ranks in RANK_PAIRS[pair]}, writes  # a WRITE a layer, per pair of ranks
        await rig.assert_blocks_back(workers=set(PAIRS[pair]))


async def _behind_a_held_forward(rig: FaultRig, bodies: list[dict]) -> list[Outcome]:
    """Send ``bodies`` while prefill's forward of another prompt is held at its first layer,
    and let it go once decode registered every one of them: they are computed in a later
    step, with their registrations there (a prompt whose registration comes after its
    forward began is written whole, after it)."""
    registrations, sub = await rig.observe("prefill", wire.KV_CONTROL.partly(engine_id="prefill-0"), wire.KvControl)
    rig.hold("producer.first_layer")
    try:
        blocker = asyncio.create_task(rig.request(body(4, "push")))
        await rig.wait_held("producer.first_layer", 120)
        tasks = [asyncio.create_task(rig.request(b)) for b in bodies]
        wanted = {b["request_id"] for b in bodies}
        await wait_until(lambda: wanted <= {getattr(r, "request_id", "") for r in registrations}, 60,
                         "decode's registrations")
    finally:
        rig.release()
        await sub.unsubscribe()
    assert isinstance((await blocker).final, wire.FinalReply)
    return await asyncio.gather(*tasks)


def engine_processes(rig: FaultRig, worker: str) -> list[psutil.Process]:
    return psutil.Process(dict(rig.stack.children)[worker].pid).children(recursive=True)


def rank_process(rig: FaultRig, worker: str, rank: int) -> psutil.Process:
    """The process of ``rank`` of ``worker``'s engine (vLLM titles it ``VLLM::Worker_TP<rank>``)."""
    [process] = [p for p in engine_processes(rig, worker) if f"VLLM::Worker_TP{rank}" in " ".join(p.cmdline())]
    return process


async def local(rig: FaultRig, prompt: list[int], max_tokens: int) -> list[int]:
    """What one engine generates for ``prompt`` (local: decode computes it and decodes)."""
    outcome = await rig.request({"prompt_token_ids": prompt, "max_tokens": max_tokens, "transfer_mode": "local",
                                 "request_id": f"tp-local-{uuid.uuid4().hex[:8]}"})
    assert isinstance(outcome.final, wire.FinalReply), outcome.final
    return outcome.tokens


async def test_a_decode_rank_killed_mid_stream_ends_its_engine_and_the_stream_continues_elsewhere(rig, router):
    """kill -9 of decode-0's rank 1 while it streams: vLLM stops that engine, its worker exits
    (status 1) without a word to the client, and the stream continues on decode-1 after the
    last token the client had: one stream, contiguous, a single engine's tokens before the
    break and a single engine's continuation after it."""
    await router.only(*PAIRS["P2-D2"])
    engine = engine_processes(rig, "decode-0")
    victim = rank_process(rig, "decode-0", 1)
    request = {"prompt_token_ids": STREAMED, "max_tokens": STREAMED_TOKENS, "transfer_mode": "push",
               "request_id": f"tp-killed-{uuid.uuid4().hex[:8]}"}
    seqs: list[int] = []
    tokens: list[int] = []

    async def on_reply(reply) -> None:
        if isinstance(reply, wire.TokenChunk):
            seqs.append(reply.seq)
            tokens.extend(reply.token_ids)

    streaming = asyncio.create_task(rig.request(request, on_reply=on_reply))
    await wait_until(lambda: len(tokens) >= 4 or streaming.done(), 120, "the first tokens")
    assert not streaming.done() and rig.streaming_on[request["request_id"]] == "decode-0"
    rig.resume("decode-1")  # somewhere to continue: heard again long before decode-0 is found lost
    router.stopped.discard("decode-1")
    victim.kill()
    worker = dict(rig.stack.children)["decode-0"]
    rig.killed.add("decode-0")
    rig.killed_processes.append(worker)
    outcome = await streaming
    final = outcome.final
    assert isinstance(final, wire.FinalReply), final
    assert await asyncio.to_thread(worker.wait, 60) == 1  # the worker saw its engine die, and exited
    await wait_until(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in engine), 30,
                     "every process of decode-0's engine gone")
    assert seqs == list(range(len(seqs))) and final.chunks == len(seqs)  # one stream: nothing lost, nothing twice
    assert len(outcome.tokens) == STREAMED_TOKENS == final.usage.completion_tokens
    path = final.path
    assert (path.migrations, path.decode_worker, path.continuation, path.retries) == (1, "decode-1", "reprefill", 0)
    resumed_after = path.resumed_after[0]
    assert 0 < resumed_after < STREAMED_TOKENS
    assert outcome.tokens[:resumed_after] == await local(rig, STREAMED, resumed_after)  # decode TP 2, before
    assert outcome.tokens[resumed_after:] == await local(rig, STREAMED + outcome.tokens[:resumed_after],
                                                         STREAMED_TOKENS - resumed_after)  # decode-1, after
    ended = [p for p in rig.progress if p.request_id == request["request_id"] and p.stage == "ended"]
    assert [(p.worker_id, p.outcome) for p in ended] == [("decode-1", "ok")]  # the dead one said nothing
    await rig.assert_blocks_back(workers={"prefill-0", "decode-1"})
    rig.assert_nothing_else_died()
