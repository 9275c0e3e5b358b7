"""The worker side's halves over a real NATS server and real NIXL agents: a producer in
this process, a decode engine in another (driven through its scheduler side, as vLLM
would; it holds both halves, as vLLM's kv_both, so notifications must find the right one).
Push and pull move the prompt's blocks and free them at prefill; a pull-held prompt
stays held while decode renews its lease, and is given up once decode stops."""

from __future__ import annotations

import multiprocessing as mp
import queue
import threading
import time
import uuid
from types import SimpleNamespace

import pytest
import torch

from connector.agents import AgentDirectory
from connector.bridge import NatsBridge
from connector.consumer import Consumer
from connector.metadata import KvpushMetadata, ReadyPrefill
from connector.producer import Producer
from connector.scheduler_side import ConnectorScheduler
from connector.worker_side import ConnectorWorker
from shared import wire
from shared.errors import AgentUnreachable, BadMessage, LeaseExpired

NUM_BLOCKS = 16
SHAPE = (NUM_BLOCKS, 2, 4, 8)  # per layer: [num_blocks, kv_heads, block_size, 2*head], fp32
BLOCK_SIZE = 4  # tokens per block
WAIT_S = 30.0


def _id(what: str) -> str:
    return f"{what}-{uuid.uuid4().hex[:8]}"


def _kv_caches(fill: float) -> dict[str, torch.Tensor]:
    pool = torch.full((2, *SHAPE), fill, dtype=torch.float32)
    return {f"model.layers.{i}.attn": pool[i] for i in range(2)}


def _numbered_caches() -> dict[str, torch.Tensor]:
    caches = _kv_caches(0.0)
    for layer, tensor in enumerate(caches.values()):
        for block in range(NUM_BLOCKS):
            tensor[block] = 1000 * layer + block
    return caches


def _producer(bridge: NatsBridge, engine_id: str, lease_s: float) -> ConnectorWorker:
    agents = AgentDirectory(bridge, 0, engine_id)
    producer = Producer(engine_id, 0, 1, bridge, agents, lease_s=lease_s)
    worker = ConnectorWorker(engine_id, 0, bridge, agents, producer=producer)
    worker.caches = _numbered_caches()  # registered memory: kept alive as long as the worker, as vLLM does
    worker.register_kv_caches(worker.caches, NUM_BLOCKS)
    return worker


def _until(poll, what: str, within_s: float = WAIT_S):
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        found = poll()
        if found:
            return found
    raise AssertionError(f"no {what} within {within_s:g} s")


def _sent(worker: ConnectorWorker, request_id: str) -> set[str]:
    """Wait until the worker lets vLLM free ``request_id``'s blocks."""
    return _until(lambda: worker.get_finished({request_id}, idle=True)[0], f"blocks of {request_id} freed")


# ------------------------------------------------------------------ decode, in its own process


def _decode_side(conn, url: str, engine_id: str) -> None:
    bridge = NatsBridge(url, name=engine_id)
    bridge.start()
    caches = _kv_caches(0.0)
    agents = AgentDirectory(bridge, 0, engine_id)
    consumer = Consumer(engine_id, 0, 1, bridge, agents, kv_wait_s=WAIT_S, quarantine_s=5.0)
    producer = Producer(engine_id, 0, 1, bridge, agents, lease_s=WAIT_S)
    worker = ConnectorWorker(engine_id, 0, bridge, agents, producer=producer, consumer=consumer)
    worker.register_kv_caches(caches, NUM_BLOCKS)
    scheduler = ConnectorScheduler(engine_id, BLOCK_SIZE, 1, bridge)
    conn.send("ready")
    while (command := conn.recv()) is not None:
        params, block_ids = command
        request = SimpleNamespace(request_id=_id("decode"), prompt_token_ids=list(range(len(block_ids) * BLOCK_SIZE)),
                                  kv_transfer_params=params)
        scheduler.on_new_request(request)
        assert scheduler.get_num_new_matched_tokens(request, 0) == (len(request.prompt_token_ids), True)
        scheduler.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: (block_ids,)),
                                           len(request.prompt_token_ids))
        worker.start_load_kv(scheduler.build_connector_meta(
            SimpleNamespace(total_num_scheduled_tokens=0, num_scheduled_tokens={})))
        received: set[str] = set()
        failed: set[str] = set()
        deadline = time.monotonic() + WAIT_S
        while request.request_id not in received and time.monotonic() < deadline:
            _, more, lost = worker.get_finished(set(), idle=True)
            received |= more
            failed |= lost
        conn.send((request.request_id in received, sorted(failed),
                   {name: t[block_ids].clone().numpy().tolist() for name, t in caches.items()}))
    worker.shutdown()
    bridge.close()


@pytest.fixture
def decode(nats_server):
    engine_id = _id("decode")
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_decode_side, args=(child, nats_server.url, engine_id))
    proc.start()
    try:
        assert parent.poll(120), "the decode process did not start"
        assert parent.recv() == "ready"
        yield SimpleNamespace(engine_id=engine_id, conn=parent)
        parent.send(None)
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()


def _load(decode, params: wire.DecodeKvParams, block_ids: list[int]):
    """Have decode receive a request with ``params`` into ``block_ids``: (arrived, failed, blocks)."""
    decode.conn.send((params.as_params(), block_ids))
    assert decode.conn.poll(WAIT_S + 10), "decode did not answer"
    return decode.conn.recv()


def _assert_copied(blocks: dict[str, list], src: list[int]) -> None:
    for layer, name in enumerate(sorted(blocks)):
        got = torch.tensor(blocks[name])
        for i, s in enumerate(src):
            assert torch.all(got[i] == 1000 * layer + s), (name, i, s)


def test_push_and_pull_move_the_prompt_and_free_prefills_blocks(nats_server, decode):
    prefill_id = _id("prefill")
    bridge = NatsBridge(nats_server.url, name=prefill_id)
    bridge.start()
    worker = _producer(bridge, prefill_id, lease_s=WAIT_S)
    try:
        # push: the finished prefill and decode's registration meet, whichever comes first
        transfer = _id("push")
        src, dst = [0, 1, 2, 7], [5, 6, 7, 12]
        worker.wait_for_save(KvpushMetadata(ready_prefills=[
            ReadyPrefill("prefill-push", transfer, src, mode="push", num_tokens=len(src) * BLOCK_SIZE,
                         decode_engine_id=decode.engine_id)]))
        arrived, failed, blocks = _load(decode, wire.DecodeKvParams(
            transfer_id=transfer, request_id="push", prefill_engine_id=prefill_id), dst)
        assert (arrived, failed) == (True, [])
        _assert_copied(blocks, src)
        assert _sent(worker, "prefill-push") == {"prefill-push"}

        # pull: decode READs the blocks prefill holds for it; its notification frees them
        transfer = _id("pull")
        src, dst = [3, 4], [9, 10]
        worker.wait_for_save(KvpushMetadata(ready_prefills=[
            ReadyPrefill("prefill-pull", transfer, src, mode="pull", num_tokens=len(src) * BLOCK_SIZE)]))
        arrived, failed, blocks = _load(decode, wire.DecodeKvParams(
            transfer_id=transfer, request_id="pull", prefill_engine_id=prefill_id, mode="pull",
            remote_block_ids=src), dst)
        assert (arrived, failed) == (True, [])
        _assert_copied(blocks, src)
        assert _sent(worker, "prefill-pull") == {"prefill-pull"}
    finally:
        worker.shutdown()
        bridge.close()


# ------------------------------------------------------------------ leases, one process


def test_a_pulled_prompt_is_held_while_decode_renews_and_given_up_when_it_stops(nats_server):
    prefill_id, decode_id = _id("prefill"), _id("decode")
    bridge = NatsBridge(nats_server.url, name=prefill_id)
    bridge.start()
    renewals: queue.Queue = queue.Queue()
    failures: queue.Queue = queue.Queue()
    bridge.subscribe_typed(wire.registration_subject(prefill_id), wire.KvControl, renewals.put, "test")
    bridge.subscribe_typed(wire.completion_subject("unknown"), wire.Completion, failures.put, "test")
    worker = _producer(bridge, prefill_id, lease_s=1.0)
    scheduler = ConnectorScheduler(decode_id, BLOCK_SIZE, 1, bridge, renew_every_s=0.2)
    try:
        transfer = _id("pull")
        worker.wait_for_save(KvpushMetadata(ready_prefills=[
            ReadyPrefill("prefill-held", transfer, [0], mode="pull", num_tokens=BLOCK_SIZE)]))
        request = SimpleNamespace(request_id=_id("decode"), prompt_token_ids=[1] * BLOCK_SIZE,
                                  kv_transfer_params=wire.DecodeKvParams(
                                      transfer_id=transfer, request_id="held", prefill_engine_id=prefill_id,
                                      mode="pull", remote_block_ids=[0]).as_params())
        scheduler.on_new_request(request)
        for _ in range(10):  # two seconds of renewals: twice the lease
            assert renewals.get(timeout=2).transfer_ids == [transfer]
        assert failures.empty()
        assert worker.get_finished({"prefill-held"}) == (set(), set(), set())

        scheduler.update_connector_output(SimpleNamespace(finished_recving={request.request_id}, finished_sending=None))
        failure = failures.get(timeout=5)
        assert (type(failure), failure.transfer_id, failure.code) == (wire.TransferFailed, transfer, LeaseExpired.code)
        assert _sent(worker, "prefill-held") == {"prefill-held"}
    finally:
        worker.shutdown()
        bridge.close()


def test_a_bad_message_on_the_producers_subject_is_refused_on_kvpush_invalid(nats_server):
    prefill_id = _id("prefill")
    bridge = NatsBridge(nats_server.url, name=prefill_id)
    bridge.start()
    refusals: queue.Queue = queue.Queue()
    bridge.subscribe_typed(wire.INVALID_SUBJECT, wire.InvalidMessage, refusals.put, "test")
    worker = _producer(bridge, prefill_id, lease_s=WAIT_S)
    try:
        bridge.publish(wire.registration_subject(prefill_id), b"\xc1 not msgpack")
        refusal = _until(lambda: _refusal_on(refusals, wire.registration_subject(prefill_id)), "refusal", 5)
        assert (refusal.service, refusal.code) == (prefill_id, BadMessage.code)
        assert refusal.reason
    finally:
        worker.shutdown()
        bridge.close()


def _refusal_on(refusals: queue.Queue, subject: str) -> wire.InvalidMessage | None:
    try:
        refusal = refusals.get(timeout=0.5)
    except queue.Empty:
        return None
    return refusal if refusal.subject == subject else None


# ------------------------------------------------------------------ races, held at a point


class _Completions:
    """Every completion event the bridge delivers, kept in arrival order."""

    def __init__(self) -> None:
        self.events: list = []
        self._lock = threading.Lock()

    def put(self, event) -> None:
        with self._lock:
            self.events.append(event)

    def of(self, transfer_id: str) -> list:
        with self._lock:
            return [e for e in self.events if e.transfer_id == transfer_id]


def test_a_revoke_between_a_match_and_its_write_is_answered_only_once_no_write_can_land(nats_server):
    """The prefill thread matches a waiting registration and is held right after the match,
    before any write is posted; the Revoke arrives then. Answering it at once would let
    decode free the blocks while the WRITE is still to be posted into them. The answer
    must wait until the write is given up (here: decode's agent cannot be reached)."""
    from connector import chaos

    prefill_id, decode_id = _id("prefill"), _id("decode")
    bridge = NatsBridge(nats_server.url, name=prefill_id)
    bridge.start()
    completions = _Completions()
    bridge.subscribe_typed(wire.completion_subject(decode_id), wire.Completion, completions.put, "test")
    worker = _producer(bridge, prefill_id, lease_s=WAIT_S)
    control = wire.registration_subject(prefill_id)
    transfer, marker = _id("raced"), _id("marker")

    def registration(transfer_id: str, tp_size: int = 1) -> bytes:
        return wire.encode(wire.Registration(
            transfer_id=transfer_id, request_id="raced", decode_engine_id=decode_id, decode_request_id="d",
            decode_tp_size=tp_size, block_ids=[5, 6], num_tokens=2 * BLOCK_SIZE, registered_at=time.time()))

    try:
        bridge.publish(control, registration(transfer))
        _until(lambda: transfer in worker.producer._rendezvous.pending(), "the registration waiting", 10)
        with chaos.hold("producer.matched") as gate:
            prefill = threading.Thread(target=worker.wait_for_save, args=(KvpushMetadata(ready_prefills=[
                ReadyPrefill("prefill-raced", transfer, [0, 1], mode="push", num_tokens=2 * BLOCK_SIZE,
                             decode_engine_id=decode_id)]),))
            prefill.start()
            assert gate.reached.wait(10), "the prefill thread did not reach the match"
            bridge.publish(control, wire.encode(wire.Revoke(transfer_id=transfer, decode_engine_id=decode_id,
                                                            reason="test")))
            # Handled in order on the same subject: once the marker's answer is back, so is the revoke's.
            bridge.publish(control, registration(marker, tp_size=2))
            _until(lambda: completions.of(marker), "the marker's answer", 10)
            assert completions.of(transfer) == [], "answered while a write could still be posted"
            gate.open()
            prefill.join(10)
        [answer] = _until(lambda: completions.of(transfer), "the answer", 10)
        assert isinstance(answer, wire.TransferFailed) and answer.code == AgentUnreachable.code
        assert _sent(worker, "prefill-raced") == {"prefill-raced"}
    finally:
        worker.shutdown()
        bridge.close()
