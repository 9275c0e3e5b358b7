"""Push binds its decode at arrival. When that decode stalls before the KV is written, the
scheduler moves the transfer to another decode: prefill writes into the new decode's
registration, the first decode's blocks come back through its revoke, and the prompt is
not computed again.

A real 1P2D rig (tools/reliability/fault_rig.py). Prefill is held where its KV is ready
(``producer.ready``, through the rig's hold file) until the move is done, so the order is
certain; the stalled decode is SIGSTOPped, and let go at the end.
"""

from __future__ import annotations

import asyncio

import pytest

from kvpush.shared import wire
from tests import prompts
from kvpush.tools.reliability.fault_rig import running_rig, wait_until

pytestmark = pytest.mark.timeout(600)

LONG = 6  # prompts.CORRECTNESS index


@pytest.fixture(scope="module")
async def rig(model_dir, tmp_path_factory):
    # Leases outlast the worker timeout (3 s): the KV waits while the scheduler notices.
    env = {"KVPUSH_LEASE_S": "20", "KVPUSH_QUARANTINE_S": "25"}
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
