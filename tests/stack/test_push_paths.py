"""Drive the workers' internal subjects the way the scheduler does, to prove the KV
really crosses from prefill to decode and that both rendezvous orders work for real."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import pytest

from kvpush.client import scheduler_status
from kvpush.shared import wire
from tests import prompts

pytestmark = pytest.mark.timeout(600)

REF_TARGET = len(prompts.CORRECTNESS)
REF_PUSHED = REF_TARGET + 1
REF_ORDER = REF_TARGET + 2


async def _workers(nc) -> tuple[str, str]:
    status = await scheduler_status(nc, timeout=5)
    return status.prefill_workers[0], status.decode_workers[0]


class _Events:
    """Collects messages on a subject, to wait for one that matches."""

    def __init__(self, nc, subject: str, kind):
        self.nc, self.subject, self.kind = nc, subject, kind
        self.items: list = []
        self._changed = asyncio.Event()

    async def __aenter__(self):
        async def on_msg(msg):
            self.items.append(wire.decode(msg.data, self.kind) if self.kind else msg.data)
            self._changed.set()

        self.sub = await self.nc.subscribe(self.subject, cb=on_msg)
        await self.nc.flush()
        return self

    async def __aexit__(self, *exc):
        await self.sub.unsubscribe()

    async def wait_for(self, predicate, timeout: float = 60.0):
        deadline = time.monotonic() + timeout
        while True:
            for item in self.items:
                if predicate(item):
                    return item
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"nothing matching on {self.subject} within {timeout} s")
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except asyncio.TimeoutError:
                pass


def _jobs(transfer_id, decode_prompt, prefill_prompt, prefill_id, decode_id, reply_to):
    now = time.time()
    request_id = f"test-{transfer_id[:8]}"
    key = uuid.uuid4().hex  # the transfer's secret, as the scheduler gives both workers
    prefill = wire.PrefillJob(request_id=request_id, transfer_id=transfer_id, prompt_token_ids=prefill_prompt,
                              decode_engine_id=decode_id, received_at=now, transfer_key=key)
    decode = wire.DecodeJob(request_id=request_id, transfer_id=transfer_id, prompt_token_ids=decode_prompt,
                            sampling=wire.SamplingSpec(prompts.CROSS_MAX_TOKENS, 0.0, True),
                            prefill_engine_id=prefill_id, reply_to=reply_to, received_at=now, transfer_key=key)
    return prefill, decode


async def _send(nc, subject, job):
    ack = wire.decode((await nc.request(subject, wire.encode(job), timeout=5)).data, wire.JobAck)
    assert ack.accepted


async def _collect_tokens(replies: _Events) -> tuple[list[int], dict]:
    final = await replies.wait_for(lambda r: json.loads(r).get("finished"), timeout=120)
    tokens = []
    for raw in replies.items:
        reply = json.loads(raw)
        if not reply.get("finished"):
            tokens.extend(reply["token_ids"])
    return tokens, json.loads(final)


async def test_decode_continues_from_the_pushed_kv_not_its_own_prompt(stack, nc, reference):
    """Decode gets prompt TARGET but prefill computes PUSHED into its blocks: if the KV
    really crossed, decode's output is PUSHED's, which differs from TARGET's."""
    assert reference[REF_TARGET] != reference[REF_PUSHED], "the test needs prompts with different outputs"
    prefill_id, decode_id = await _workers(nc)
    transfer_id = uuid.uuid4().hex
    inbox = nc.new_inbox()
    prefill, decode = _jobs(transfer_id, prompts.CROSS_TARGET, prompts.CROSS_PUSHED, prefill_id, decode_id, inbox)
    async with _Events(nc, inbox, None) as replies, _Events(nc, wire.COMPLETION_SUBJECTS, wire.Completion) as done:
        await asyncio.gather(
            _send(nc, wire.decode_job_subject(decode_id), decode),
            _send(nc, wire.prefill_job_subject(prefill_id), prefill),
        )
        tokens, final = await _collect_tokens(replies)
        event = await done.wait_for(lambda e: e.transfer_id == transfer_id)
    assert "error" not in final
    assert isinstance(event, wire.TransferDone)
    assert event.bytes > 0 and event.descriptors >= 1
    assert tokens == reference[REF_PUSHED]
    assert tokens != reference[REF_TARGET]


@pytest.mark.parametrize("order", ["registration_first", "prefill_first"])
async def test_both_rendezvous_orders_deliver_the_right_kv(stack, nc, reference, order):
    prefill_id, decode_id = await _workers(nc)
    transfer_id = uuid.uuid4().hex
    inbox = nc.new_inbox()
    prefill, decode = _jobs(transfer_id, prompts.ORDER_PROMPT, prompts.ORDER_PROMPT, prefill_id, decode_id, inbox)
    async with (
        _Events(nc, inbox, None) as replies,
        _Events(nc, wire.COMPLETION_SUBJECTS, wire.Completion) as done,
        _Events(nc, wire.registration_subject(prefill_id, decode_id), wire.Registration) as registrations,
        _Events(nc, wire.HANDOFFS(sender=prefill_id), wire.Handoff) as handoffs,
    ):
        if order == "registration_first":
            await _send(nc, wire.decode_job_subject(decode_id), decode)
            await registrations.wait_for(lambda r: r.transfer_id == transfer_id)
            await asyncio.sleep(0.2)  # the registration is at prefill before its prefill starts
            await _send(nc, wire.prefill_job_subject(prefill_id), prefill)
        else:
            await _send(nc, wire.prefill_job_subject(prefill_id), prefill)
            await handoffs.wait_for(lambda h: h.transfer_id == transfer_id)
            assert not any(r.transfer_id == transfer_id for r in registrations.items)
            await _send(nc, wire.decode_job_subject(decode_id), decode)
        tokens, final = await _collect_tokens(replies)
        event = await done.wait_for(lambda e: e.transfer_id == transfer_id)
    assert "error" not in final
    assert isinstance(event, wire.TransferDone)
    assert event.order == order
    assert tokens == reference[REF_ORDER]


async def test_malformed_messages_are_refused_and_the_workers_keep_serving(stack, nc, reference):
    prefill_id, decode_id = await _workers(nc)
    for subject in (wire.prefill_job_subject(prefill_id), wire.decode_job_subject(decode_id)):
        ack = wire.decode((await nc.request(subject, b"\xc1garbage", timeout=5)).data, wire.JobAck)
        assert ack.accepted is False
        assert ack.error.code == "bad_job" and "malformed" in ack.error.message
    for subject in (wire.registration_subject(prefill_id, decode_id), wire.HEARTBEATS(sender=prefill_id),
                    wire.completion_subject(decode_id, prefill_id), wire.HANDOFFS(sender=prefill_id),
                    wire.KV_AGENTS(sender=prefill_id)):
        await nc.publish(subject, b"\xc1garbage")
    # a registration that parses but names blocks decode never allocated
    bogus = wire.Registration(transfer_id="nobody", request_id="nobody", decode_engine_id=decode_id,
                              decode_request_id="nobody", decode_tp_size=1, block_ids=[10**9], num_tokens=5,
                              registered_at=time.time())
    await nc.publish(wire.registration_subject(prefill_id, decode_id), wire.encode(bogus))
    await nc.flush()
    # and a real request still goes through both workers
    from kvpush.client import generate_all

    name, prompt, max_tokens = prompts.CORRECTNESS[0]
    tokens, _, final = await generate_all(nc, {"prompt_token_ids": prompt, "max_tokens": max_tokens, "ignore_eos": True})
    assert tokens == reference[0]


async def test_pull_decode_reads_the_kv_prefill_computed(stack, nc, reference):
    """Pull mode with the same trick: prefill computes PUSHED, decode (given TARGET) READs
    the prefill's blocks named in the handoff, and follows PUSHED."""
    prefill_id, decode_id = await _workers(nc)
    transfer_id = uuid.uuid4().hex
    inbox = nc.new_inbox()
    prefill, decode = _jobs(transfer_id, prompts.CROSS_TARGET, prompts.CROSS_PUSHED, prefill_id, decode_id, inbox)
    prefill.mode = decode.mode = "pull"
    async with _Events(nc, inbox, None) as replies, _Events(nc, wire.HANDOFFS.wildcard, wire.Handoff) as handoffs:
        await _send(nc, wire.prefill_job_subject(prefill_id), prefill)
        handoff = await handoffs.wait_for(lambda h: h.transfer_id == transfer_id)
        decode.kv_transfer_params = handoff.kv_transfer_params
        assert len(handoff.kv_transfer_params["remote_block_ids"]) == -(-prompts.CROSS_LENGTH // prompts.BLOCK_SIZE)
        await _send(nc, wire.decode_job_subject(decode_id), decode)
        tokens, final = await _collect_tokens(replies)
    assert "error" not in final
    assert tokens == reference[REF_PUSHED]
    assert tokens != reference[REF_TARGET]


async def test_a_job_cancelled_right_behind_its_arrival_ends_and_reports_it(stack, nc, reference):
    """The cancel lands before the job's task has taken its first step (the scheduler does
    this when a retry follows a missed ack). The job must still end: decode reports
    'ended', sends the client nothing, and the next request is served."""
    prefill_id, decode_id = await _workers(nc)
    transfer_id = uuid.uuid4().hex
    inbox = nc.new_inbox()
    _, decode = _jobs(transfer_id, prompts.ORDER_PROMPT, prompts.ORDER_PROMPT, prefill_id, decode_id, inbox)
    cancel = wire.CancelJob(request_id=decode.request_id, transfer_id=transfer_id, reason="test: cancel behind")
    subject = wire.decode_job_subject(decode_id)
    async with _Events(nc, inbox, None) as replies, _Events(nc, wire.PROGRESS.wildcard, wire.RequestProgress) as progress, \
            _Events(nc, wire.TOKENS_SENT.wildcard, wire.TokensSent) as chunks_recorded:
        # One write: the worker's subscription has both before it returns to the event loop.
        ack_inbox = nc.new_inbox()
        await nc.publish(subject, wire.encode(decode), reply=ack_inbox)
        await nc.publish(subject, wire.encode(cancel))
        await nc.flush()
        ended = await progress.wait_for(lambda p: p.transfer_id == transfer_id and p.stage == "ended", timeout=30)
        assert ended.outcome == "cancelled"
        assert not any(t.transfer_id == transfer_id for t in chunks_recorded.items)  # no chunk went out
        assert replies.items == []

    from kvpush.client import generate_all

    tokens, _, final = await generate_all(nc, {"prompt_token_ids": prompts.ORDER_PROMPT,
                                               "max_tokens": prompts.CROSS_MAX_TOKENS, "ignore_eos": True})
    assert isinstance(final, wire.FinalReply), final
    assert tokens == reference[REF_ORDER]
