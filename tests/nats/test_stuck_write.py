"""A write NIXL cannot cancel: when prefill reports its write stuck (still posted after
STUCK_AFTER_S), decode keeps the blocks with no timer at all, until prefill answers that
the write ended, or prefill's engine is proven gone. Real NATS, a real decode connector
worker (its NIXL agent included); prefill is this test, publishing as prefill would."""

from __future__ import annotations

import contextlib
import secrets
import time
import uuid
from dataclasses import dataclass

import torch

from kvpush.connector.agents import AgentDirectory
from kvpush.connector.bridge import NatsBridge
from kvpush.connector.consumer import Consumer
from kvpush.connector.metadata import ExpectedKv, KvpushMetadata
from kvpush.connector.worker_side import ConnectorWorker
from kvpush.shared import wire

NUM_BLOCKS = 8
SHAPE = (NUM_BLOCKS, 2, 4, 8)
FAR = 10_000.0  # seconds: past every KV wait and quarantine


def _decode(bridge: NatsBridge, engine_id: str) -> ConnectorWorker:
    agents = AgentDirectory(bridge, 0, engine_id)
    consumer = Consumer(engine_id, 0, 1, bridge, agents, kv_wait_s=0.5, quarantine_s=0.5)
    worker = ConnectorWorker(engine_id, 0, bridge, agents, consumer=consumer)
    pool = torch.zeros((2, *SHAPE), dtype=torch.float32)
    worker.caches = {f"model.layers.{i}.attn": pool[i] for i in range(2)}
    worker.register_kv_caches(worker.caches, NUM_BLOCKS)
    return worker


def _until(poll, what: str, within_s: float = 10.0):
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        found = poll()
        if found:
            return found
        time.sleep(0.01)
    raise AssertionError(f"no {what} within {within_s:g} s")


def _failed(transfer_id: str, prefill_id: str, decode_id: str, code: str) -> bytes:
    return wire.encode(wire.TransferFailed(transfer_id=transfer_id, prefill_engine_id=prefill_id,
                                           decode_engine_id=decode_id, rank=0, code=code, reason="test"))


def _waiting(worker: ConnectorWorker, prefill_id: str, incarnation: str = "") -> tuple[str, str]:
    request_id, transfer_id = f"r-{uuid.uuid4().hex[:6]}", uuid.uuid4().hex
    worker.start_load_kv(KvpushMetadata(expected=[ExpectedKv(
        request_id, transfer_id, 1, "", prefill_id, b"", secrets.token_hex(16), [1, 2], incarnation)]))
    return request_id, transfer_id


def _released(worker: ConnectorWorker, now: float) -> tuple[set[str], set[str]]:
    """Run the clock to ``now`` twice (a give-up, then the quarantine after it), then ask."""
    worker.consumer.tick(now)
    worker.consumer.tick(now + FAR)
    _, receiving, failed = worker.get_finished(set())
    return receiving, failed


def _some_released(worker: ConnectorWorker):
    released = _released(worker, time.monotonic())
    return released if released[0] else None


@dataclass
class Pair:
    """A decode connector worker, and a NATS connection that speaks as its prefill engine."""

    worker: ConnectorWorker
    prefill: NatsBridge
    decode_id: str
    prefill_id: str

    def report(self, transfer_id: str, code: str, sender: str | None = None) -> None:
        sender = sender or self.prefill_id
        self.prefill.publish(wire.completion_subject(self.decode_id, sender),
                             _failed(transfer_id, sender, self.decode_id, code))


@contextlib.contextmanager
def decode_with_prefill(url: str, prefill_name: str | None = None):
    decode_id = f"decode-{uuid.uuid4().hex[:6]}"
    prefill_id = prefill_name or f"prefill-{uuid.uuid4().hex[:6]}"
    bridge = NatsBridge(url, name=decode_id)
    bridge.start()
    prefill = NatsBridge(url, name=prefill_id)
    prefill.start()
    worker = _decode(bridge, decode_id)
    try:
        yield Pair(worker, prefill, decode_id, prefill_id)
    finally:
        worker.shutdown()
        bridge.close()
        prefill.close()


def test_blocks_under_a_stuck_write_outlive_every_timer_and_go_back_when_prefill_answers(nats_server):
    with decode_with_prefill(nats_server.url) as pair:
        worker = pair.worker
        answering = AgentAnswer(pair.prefill, pair.prefill_id, "incarnation-1")
        # Control: without a stuck report, the timers give the blocks back (recompute).
        control_request, _ = _waiting(worker, pair.prefill_id, "incarnation-1")
        assert _released(worker, time.monotonic() + FAR) == ({control_request}, {control_request})

        request_id, transfer_id = _waiting(worker, pair.prefill_id, "incarnation-1")
        pair.report(transfer_id, "write_stuck")
        _until(lambda: worker.consumer.stuck_holds() == 1, "the stuck write held")
        assert _released(worker, time.monotonic() + FAR) == (set(), set())  # no timer frees them
        assert _released(worker, time.monotonic() + 100 * FAR) == (set(), set())
        _until(lambda: answering.asked, "decode asking whether prefill is still there")
        assert worker.consumer.stuck_holds() == 1  # it is: the same incarnation answered

        pair.report(transfer_id, "write_failed")  # the write ended after all
        assert _until(lambda: _some_released(worker), "the blocks back") == ({request_id}, {request_id})
        assert worker.consumer.stuck_holds() == 0


def test_blocks_under_a_stuck_write_go_back_once_the_prefill_engine_is_gone(nats_server):
    """No responder on the prefill's agent subject: its engine left NATS (died); nothing it
    posted can land any more."""
    with decode_with_prefill(nats_server.url) as pair:
        request_id, transfer_id = _waiting(pair.worker, pair.prefill_id, "incarnation-1")
        pair.report(transfer_id, "write_stuck")
        _until(lambda: pair.worker.consumer.stuck_holds() == 1, "the stuck write held")
        assert _until(lambda: _some_released(pair.worker), "the blocks back") == ({request_id}, {request_id})


def test_blocks_under_a_stuck_write_go_back_once_another_start_of_the_prefill_answers(nats_server):
    """The prefill engine restarted under its id: the process that posted the write is gone."""
    with decode_with_prefill(nats_server.url) as pair:
        restarted = AgentAnswer(pair.prefill, pair.prefill_id, "incarnation-2")
        request_id, transfer_id = _waiting(pair.worker, pair.prefill_id, "incarnation-1")
        pair.report(transfer_id, "write_stuck")
        _until(lambda: pair.worker.consumer.stuck_holds() == 1, "the stuck write held")
        assert _until(lambda: _some_released(pair.worker), "the blocks back") == ({request_id}, {request_id})
        assert restarted.asked


def test_a_stuck_report_from_another_prefill_holds_nothing(nats_server):
    with decode_with_prefill(nats_server.url, "prefill-other") as pair:
        refusals: list = []
        pair.prefill.subscribe_typed(wire.INVALID_SUBJECT, wire.InvalidMessage, refusals.append, "test")
        _, transfer_id = _waiting(pair.worker, f"prefill-{uuid.uuid4().hex[:6]}")  # its KV comes from elsewhere
        pair.report(transfer_id, "write_stuck")
        pair.report(transfer_id, "write_failed")
        # Both are refused (the wait's KV comes from another prefill): their refusals say they arrived.
        _until(lambda: len([r for r in refusals if r.code == "wrong_party"]) == 2, "both refused")
        assert pair.worker.consumer.stuck_holds() == 0
        assert pair.worker.get_finished(set())[1] == set()  # the forged failure released nothing


class AgentAnswer:
    """The prefill engine's agent subject, answered as a live engine of ``incarnation`` would."""

    def __init__(self, bridge: NatsBridge, engine_id: str, incarnation: str):
        self.asked = 0
        info = wire.encode(wire.AgentInfo(engine_id=engine_id, rank=0, agent_name=f"{engine_id}-agent",
                                          agent_metadata=b"", mem_type="DRAM", device_id=0, num_blocks=1,
                                          regions=[], incarnation=incarnation))

        def answer(data: bytes, subject: str) -> bytes:
            self.asked += 1
            return info

        bridge.subscribe(wire.agent_subject(engine_id, 0), answer)
