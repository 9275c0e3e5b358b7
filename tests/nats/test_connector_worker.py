"""The worker side's halves over a real NATS server and real NIXL agents: a producer in
this process, a decode engine in another (driven through its scheduler side, as vLLM
would; it holds both halves, as vLLM's kv_both, so notifications must find the right one).
Push and pull move the prompt's blocks and free them at prefill; a pull-held prompt
stays held while decode renews its lease, and is given up once decode stops. Only the
transfer's own parties, with its key, can register for it, revoke it, fail it, or
notify its arrival."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import queue
import secrets
import threading
import time
import uuid
from types import SimpleNamespace

import pytest
import torch
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock

from kvpush.connector.agents import AgentDirectory
from kvpush.connector.bridge import NatsBridge
from kvpush.connector import compute_marks
from kvpush.connector.completion import block_tag, notification
from kvpush.connector.consumer import Consumer
from kvpush.connector.metadata import ExpectedKv, KvpushMetadata, ReadyPrefill
from kvpush.connector.producer import Producer
from kvpush.connector.scheduler_side import ConnectorScheduler
from kvpush.connector.worker_side import ConnectorWorker
from kvpush.shared import wire
from kvpush.shared.errors import (AgentUnreachable, BadMessage, BadRegistration, LeaseExpired, Revoked, WriteFailed,
                           WrongParty)

NUM_BLOCKS = 16
SHAPE = (NUM_BLOCKS, 2, 4, 8)  # per layer: [num_blocks, kv_heads, block_size, 2*head], fp32
BLOCK_SIZE = 4  # tokens per block
WAIT_S = 30.0


def _id(what: str) -> str:
    return f"{what}-{uuid.uuid4().hex[:8]}"


def _key() -> str:
    """A transfer's secret, as the scheduler makes one for each attempt."""
    return secrets.token_hex(16)


def _kv_caches(fill: float) -> dict[str, torch.Tensor]:
    pool = torch.full((2, *SHAPE), fill, dtype=torch.float32)
    return {f"model.layers.{i}.attn": pool[i] for i in range(2)}


def _numbered_caches() -> dict[str, torch.Tensor]:
    caches = _kv_caches(0.0)
    for layer, tensor in enumerate(caches.values()):
        for block in range(NUM_BLOCKS):
            tensor[block] = 1000 * layer + block
    return caches


def _producer(bridge: NatsBridge, engine_id: str, lease_s: float, push_by_layer: bool = False) -> ConnectorWorker:
    agents = AgentDirectory(bridge, 0, engine_id)
    producer = Producer(engine_id, 0, 1, bridge, agents, lease_s=lease_s, push_by_layer=push_by_layer)
    worker = ConnectorWorker(engine_id, 0, bridge, agents, producer=producer)
    worker.caches = _numbered_caches()  # registered memory: kept alive as long as the worker, as vLLM does
    worker.register_kv_caches(worker.caches, NUM_BLOCKS)
    return worker


def _consumer(bridge: NatsBridge, engine_id: str) -> ConnectorWorker:
    agents = AgentDirectory(bridge, 0, engine_id)
    consumer = Consumer(engine_id, 0, 1, bridge, agents, kv_wait_s=WAIT_S, quarantine_s=5.0)
    worker = ConnectorWorker(engine_id, 0, bridge, agents, consumer=consumer)
    worker.caches = _kv_caches(0.0)
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


def _decode_side(conn, url: str, engine_id: str, kv_wait_s: float = WAIT_S) -> None:
    bridge = NatsBridge(url, name=engine_id)
    bridge.start()
    caches = _kv_caches(0.0)
    agents = AgentDirectory(bridge, 0, engine_id)
    consumer = Consumer(engine_id, 0, 1, bridge, agents, kv_wait_s=kv_wait_s, quarantine_s=5.0)
    producer = Producer(engine_id, 0, 1, bridge, agents, lease_s=WAIT_S)
    worker = ConnectorWorker(engine_id, 0, bridge, agents, producer=producer, consumer=consumer)
    worker.register_kv_caches(caches, NUM_BLOCKS)
    scheduler = ConnectorScheduler(engine_id, BLOCK_SIZE, 1, bridge)
    conn.send("ready")
    while (command := conn.recv()) is not None:
        serial, params, block_ids, cached_ids = command
        for tensor in caches.values():  # each request finds the blocks as a fresh engine would
            tensor.zero_()
        num_cached = len(cached_ids) * BLOCK_SIZE
        request = SimpleNamespace(request_id=_id("decode"),
                                  prompt_token_ids=list(range(num_cached + len(block_ids) * BLOCK_SIZE)),
                                  kv_transfer_params=params)
        scheduler.on_new_request(request)
        external = len(block_ids) * BLOCK_SIZE
        assert scheduler.get_num_new_matched_tokens(request, num_cached) == (external, True)
        # What vLLM's KV cache manager allocates: the prefix its cache holds (hashed,
        # shared), then fresh blocks.
        blocks = KVCacheBlocks(([KVCacheBlock(b, ref_cnt=2, _block_hash=b"cached%d" % b) for b in cached_ids]
                                + [KVCacheBlock(b, ref_cnt=1) for b in block_ids],))
        scheduler.update_state_after_alloc(request, blocks, external)
        worker.start_load_kv(scheduler.build_connector_meta(
            SimpleNamespace(total_num_scheduled_tokens=0, num_scheduled_tokens={})))
        received: set[str] = set()
        failed: set[str] = set()
        deadline = time.monotonic() + WAIT_S
        while request.request_id not in received and time.monotonic() < deadline:
            _, more, lost = worker.get_finished(set(), idle=True)
            received |= more
            failed |= lost
        conn.send((serial, request.request_id in received, sorted(failed),
                   {name: t[block_ids].clone().numpy().tolist() for name, t in caches.items()},
                   all(bool(torch.all(t[cached_ids] == 0)) for t in caches.values())))
    worker.shutdown()
    bridge.close()


@contextlib.contextmanager
def _decode_process(url: str, kv_wait_s: float = WAIT_S):
    engine_id = _id("decode")
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_decode_side, args=(child, url, engine_id, kv_wait_s))
    proc.start()
    try:
        assert parent.poll(120), "the decode process did not start"
        assert parent.recv() == "ready"
        yield SimpleNamespace(engine_id=engine_id, conn=parent, serial=0)
        parent.send(None)
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()


@pytest.fixture(scope="module")
def decode(nats_server):
    """One decode process for the module's tests (starting one takes ~20 s): each request
    gets its own id and transfer, and finds decode's blocks zeroed, as a fresh engine's."""
    with _decode_process(nats_server.url) as decode:
        yield decode


def _load(decode, params: wire.DecodeKvParams, block_ids: list[int], cached_ids: list[int] = ()):
    """Have decode receive a request with ``params`` into ``block_ids``: (arrived, failed, blocks)."""
    _start_load(decode, params, block_ids, cached_ids)
    return _loaded(decode)


def _start_load(decode, params: wire.DecodeKvParams, block_ids: list[int], cached_ids: list[int] = ()) -> None:
    """Decode receives the request (push: it registers its blocks) and waits for the KV;
    with ``cached_ids``, its prefix cache holds the prompt's first blocks."""
    decode.serial += 1
    decode.conn.send((decode.serial, params.as_params(), block_ids, list(cached_ids)))


def _loaded(decode):
    """How decode's wait for the KV ended: (arrived, failed, blocks)."""
    return _loaded_with_cache(decode)[:3]


def _loaded_with_cache(decode):
    """(arrived, failed, blocks, whether decode's cached blocks were left untouched)."""
    deadline = time.monotonic() + WAIT_S + 10
    while decode.conn.poll(max(deadline - time.monotonic(), 0)):
        serial, *answer = decode.conn.recv()
        if serial == decode.serial:  # not the answer to an earlier test's request it never read
            return tuple(answer)
    raise AssertionError("decode did not answer")


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
        transfer, key = _id("push"), _key()
        src, dst = [0, 1, 2, 7], [5, 6, 7, 12]
        worker.wait_for_save(KvpushMetadata(ready_prefills=[
            ReadyPrefill("prefill-push", transfer, src, mode="push", num_tokens=len(src) * BLOCK_SIZE,
                         decode_engine_id=decode.engine_id, transfer_key=key)]))
        arrived, failed, blocks = _load(decode, wire.DecodeKvParams(
            transfer_id=transfer, request_id="push", prefill_engine_id=prefill_id, transfer_key=key), dst)
        assert (arrived, failed) == (True, [])
        _assert_copied(blocks, src)
        assert _sent(worker, "prefill-push") == {"prefill-push"}

        # pull: decode READs the blocks prefill holds for it; its notification frees them
        transfer, key = _id("pull"), _key()
        src, dst = [3, 4], [9, 10]
        worker.wait_for_save(KvpushMetadata(ready_prefills=[
            ReadyPrefill("prefill-pull", transfer, src, mode="pull", num_tokens=len(src) * BLOCK_SIZE,
                         transfer_key=key)]))
        arrived, failed, blocks = _load(decode, wire.DecodeKvParams(
            transfer_id=transfer, request_id="pull", prefill_engine_id=prefill_id, mode="pull",
            remote_block_ids=src, transfer_key=key), dst)
        assert (arrived, failed) == (True, [])
        _assert_copied(blocks, src)
        assert _sent(worker, "prefill-pull") == {"prefill-pull"}
    finally:
        worker.shutdown()
        bridge.close()


class StepStillComputing:
    """The device's mark for a step that has not ended (connector/compute_marks.py): done
    once the test says so; counts how often the transfer thread asked."""

    def __init__(self) -> None:
        self.ended = threading.Event()
        self.asked = 0

    def done(self) -> bool:
        self.asked += 1
        return self.ended.is_set()


def test_a_push_matched_while_its_step_still_computes_leaves_once_the_step_ended(nats_server, decode):
    """On a GPU vLLM calls wait_for_save after the forward's launch: the prompt's last blocks
    are not computed yet. The WRITE waits for the step's mark (the emulated device's, here the
    test's) and lands once it is done."""
    prefill_id = _id("prefill")
    bridge = NatsBridge(nats_server.url, name=prefill_id)
    bridge.start()
    worker = _producer(bridge, prefill_id, lease_s=WAIT_S)
    step = StepStillComputing()
    compute_marks.install(lambda layer: step)
    try:
        transfer, key = _id("push"), _key()
        src, dst = [0, 1, 2, 7], [5, 6, 7, 12]
        worker.wait_for_save(KvpushMetadata(ready_prefills=[
            ReadyPrefill("prefill-held", transfer, src, mode="push", num_tokens=len(src) * BLOCK_SIZE,
                         decode_engine_id=decode.engine_id, transfer_key=key)]))
        compute_marks.install(None)  # the step's mark was taken; the next steps are computed at once
        _start_load(decode, wire.DecodeKvParams(
            transfer_id=transfer, request_id="held", prefill_engine_id=prefill_id, transfer_key=key), dst)
        _until(lambda: step.asked > 0, "the transfer thread holding the WRITE for its step")
        assert worker.producer.transfer.posted == 0
        step.ended.set()
        arrived, failed, blocks = _loaded(decode)
        assert (arrived, failed) == (True, [])
        _assert_copied(blocks, src)
        assert worker.producer.transfer.posted == 1
    finally:
        compute_marks.install(None)
        worker.shutdown()
        bridge.close()


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_with_a_prefix_cached_on_decode_only_the_blocks_it_lacks_move(nats_server, decode, mode):
    """Decode's cache holds the prompt's first two blocks: prefill's blocks from the third
    on land in decode's fresh blocks, and decode's cached blocks are left as they were."""
    prefill_id = _id("prefill")
    bridge = NatsBridge(nats_server.url, name=prefill_id)
    bridge.start()
    worker = _producer(bridge, prefill_id, lease_s=WAIT_S)
    try:
        transfer, key = _id(mode), _key()
        src, cached, dst = [0, 1, 2, 7, 8], [13, 14], [5, 6, 11]
        worker.wait_for_save(KvpushMetadata(ready_prefills=[
            ReadyPrefill(f"prefill-{mode}", transfer, src, mode=mode, num_tokens=len(src) * BLOCK_SIZE,
                         decode_engine_id=decode.engine_id if mode == "push" else "", transfer_key=key)]))
        _start_load(decode, wire.DecodeKvParams(
            transfer_id=transfer, request_id=mode, prefill_engine_id=prefill_id, mode=mode,
            remote_block_ids=src if mode == "pull" else [], transfer_key=key), dst, cached)
        arrived, failed, blocks, cache_untouched = _loaded_with_cache(decode)
        assert (arrived, failed) == (True, [])
        _assert_copied(blocks, src[len(cached):])
        assert cache_untouched, "a write landed in decode's cached prefix"
        assert _sent(worker, f"prefill-{mode}") == {f"prefill-{mode}"}
    finally:
        worker.shutdown()
        bridge.close()


def test_a_transfer_moved_before_its_write_lands_in_the_new_decode_and_the_first_gets_its_blocks_back(
        nats_server, decode):
    """A scheduler moves a push transfer whose first decode has registered: prefill drops
    that registration, writes into the second decode's (which carries the new key), and
    tells the first decode, without closing the transfer. The second is the module's
    decode; the first, which gives its wait up after 2 s, a process of its own."""
    prefill_id, scheduler_id = _id("prefill"), _id("scheduler")
    bridge = NatsBridge(nats_server.url, name=prefill_id)
    bridge.start()
    worker = _producer(bridge, prefill_id, lease_s=WAIT_S)
    events: queue.Queue = queue.Queue()
    try:
        with _decode_process(nats_server.url, kv_wait_s=2.0) as first:
            second = decode
            for decode in (first, second):
                bridge.subscribe(wire.completion_subject(decode.engine_id, prefill_id),
                                 lambda data, subject: events.put(wire.decode(data, wire.Completion)))
            transfer, key, new_key = _id("moved"), _key(), _key()
            src = [0, 1, 2]
            params = dict(transfer_id=transfer, request_id="moved", prefill_engine_id=prefill_id)
            _start_load(first, wire.DecodeKvParams(**params, transfer_key=key), [4, 5, 6])
            _until(lambda: worker.producer.waiting(transfer),  # taken in, not just sent
                   "the first decode's registration")
            move = wire.MoveTransfer(transfer_id=transfer, scheduler_id=scheduler_id, transfer_key=key,
                                     decode_engine_id=second.engine_id, new_transfer_key=new_key)
            bridge.publish(wire.move_subject(prefill_id, scheduler_id), wire.encode(move))
            moved = _until(lambda: _next(events, wire.TransferMoved), "the move's answer")
            assert (moved.moved, moved.decode_engine_id) == (True, second.engine_id)

            _start_load(second, wire.DecodeKvParams(**params, transfer_key=new_key), [9, 10, 11])
            worker.wait_for_save(KvpushMetadata(ready_prefills=[  # the prefill, as its engine knew it
                ReadyPrefill("prefill-moved", transfer, src, mode="push", num_tokens=len(src) * BLOCK_SIZE,
                             decode_engine_id=first.engine_id, transfer_key=key)]))
            arrived, failed, blocks = _loaded(second)
            assert (arrived, failed) == (True, [])
            _assert_copied(blocks, src)

            # The first decode's wait ends without the KV: prefill refused its registration
            # (sent again while it waited) or answered its Revoke, both saying the transfer moved.
            arrived, failed, _ = _loaded(first)
            assert (arrived, len(failed)) == (True, 1)
            answer = _until(lambda: _next(events, wire.TransferFailed), "the first decode's answer")
            assert answer.decode_engine_id == first.engine_id and answer.code in (Revoked.code, BadRegistration.code)
            assert "moved" in answer.reason
            assert _sent(worker, "prefill-moved") == {"prefill-moved"}
    finally:
        worker.shutdown()
        bridge.close()


def _next(events: queue.Queue, kind):
    while True:
        try:
            event = events.get_nowait()
        except queue.Empty:
            return None
        if isinstance(event, kind):
            return event


# ------------------------------------------------------------------ leases, one process


def test_a_pulled_prompt_is_held_while_decode_renews_and_given_up_when_it_stops(nats_server):
    prefill_id, decode_id = _id("prefill"), _id("decode")
    bridge = NatsBridge(nats_server.url, name=prefill_id)
    bridge.start()
    renewals: queue.Queue = queue.Queue()
    failures: queue.Queue = queue.Queue()
    bridge.subscribe_typed(wire.registration_subject(prefill_id, decode_id), wire.KvControl, renewals.put, "test")
    bridge.subscribe_typed(wire.completion_subject("unknown", prefill_id), wire.Completion, failures.put, "test")
    worker = _producer(bridge, prefill_id, lease_s=1.0)
    scheduler = ConnectorScheduler(decode_id, BLOCK_SIZE, 1, bridge, renew_every_s=0.2)
    try:
        transfer, key = _id("pull"), _key()
        worker.wait_for_save(KvpushMetadata(ready_prefills=[
            ReadyPrefill("prefill-held", transfer, [0], mode="pull", num_tokens=BLOCK_SIZE, transfer_key=key)]))
        request = SimpleNamespace(request_id=_id("decode"), prompt_token_ids=[1] * BLOCK_SIZE,
                                  kv_transfer_params=wire.DecodeKvParams(
                                      transfer_id=transfer, request_id="held", prefill_engine_id=prefill_id,
                                      mode="pull", remote_block_ids=[0], transfer_key=key).as_params())
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
        subject = wire.registration_subject(prefill_id, _id("decode"))
        bridge.publish(subject, b"\xc1 not msgpack")
        refusal = _until(lambda: _refusal_on(refusals, subject), "refusal", 5)
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


class _Refusals:
    """Every InvalidMessage said on kvpush.invalid, kept in arrival order."""

    def __init__(self, bridge: NatsBridge) -> None:
        self.events: list[wire.InvalidMessage] = []
        self._lock = threading.Lock()
        bridge.subscribe_typed(wire.INVALID_SUBJECT, wire.InvalidMessage, self.put, "test")

    def put(self, refusal: wire.InvalidMessage) -> None:
        with self._lock:
            self.events.append(refusal)

    def by(self, service: str) -> list[wire.InvalidMessage]:
        with self._lock:
            return [r for r in self.events if r.service == service]


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
    from kvpush.shared import chaos

    prefill_id, decode_id = _id("prefill"), _id("decode")
    bridge = NatsBridge(nats_server.url, name=prefill_id)
    bridge.start()
    completions = _Completions()
    bridge.subscribe_typed(wire.completion_subject(decode_id, prefill_id), wire.Completion, completions.put, "test")
    worker = _producer(bridge, prefill_id, lease_s=WAIT_S)
    control = wire.registration_subject(prefill_id, decode_id)
    transfer, marker, key = _id("raced"), _id("marker"), _key()

    def registration(transfer_id: str, tp_size: int = 1) -> bytes:
        return wire.encode(wire.Registration(
            transfer_id=transfer_id, request_id="raced", decode_engine_id=decode_id, decode_request_id="d",
            decode_tp_size=tp_size, block_ids=[5, 6], num_tokens=2 * BLOCK_SIZE, registered_at=time.time(),
            transfer_key=key))

    try:
        bridge.publish(control, registration(transfer))
        _until(lambda: worker.producer.waiting(transfer), "the registration waiting", 10)
        with chaos.hold("producer.matched") as gate:
            prefill = threading.Thread(target=worker.wait_for_save, args=(KvpushMetadata(ready_prefills=[
                ReadyPrefill("prefill-raced", transfer, [0, 1], mode="push", num_tokens=2 * BLOCK_SIZE,
                             decode_engine_id=decode_id, transfer_key=key)]),))
            prefill.start()
            assert gate.reached.wait(10), "the prefill thread did not reach the match"
            bridge.publish(control, wire.encode(wire.Revoke(transfer_id=transfer, decode_engine_id=decode_id,
                                                            reason="test", transfer_key=key)))
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


# ------------------------------------------------------------------ layer by layer

LAYERS = ("model.layers.0.attn", "model.layers.1.attn")


def _layered_step(worker: ConnectorWorker, decode, name: str, src: list[int], dst: list[int]):
    """Decode registers; the step that finishes the prompt starts, and its forward computes
    layer 0 only: (transfer id, key, the step's metadata). As vLLM does it: the step's
    metadata bound, then the forward (``save_kv_layer`` after each layer), and
    ``start_load_kv`` only after the forward (unless a load must come first)."""
    transfer, key = _id(name), _key()
    _start_load(decode, wire.DecodeKvParams(transfer_id=transfer, request_id=name,
                                            prefill_engine_id=worker.producer.engine_id, transfer_key=key), dst)
    _until(lambda: worker.producer.waiting(transfer), "decode's registration")
    meta = KvpushMetadata(ready_prefills=[
        ReadyPrefill(f"prefill-{name}", transfer, src, mode="push", num_tokens=len(src) * BLOCK_SIZE,
                     decode_engine_id=decode.engine_id, transfer_key=key)])
    worker.save_kv_layer(LAYERS[0], meta)
    thread = worker.producer.transfer
    _until(lambda: thread.posted == 1, "layer 0's WRITE posted while layer 1 is still to compute", 10)
    return transfer, key, meta


def test_layer_by_layer_each_layer_leaves_as_the_forward_computes_it_and_decode_starts_when_all_landed(
        nats_server, decode):
    prefill_id = _id("prefill")
    bridge = NatsBridge(nats_server.url, name=prefill_id)
    bridge.start()
    worker = _producer(bridge, prefill_id, lease_s=WAIT_S, push_by_layer=True)
    try:
        src, dst = [0, 1, 2, 7], [5, 6, 7, 12]
        _, _, meta = _layered_step(worker, decode, "layered", src, dst)
        worker.save_kv_layer(LAYERS[1], meta)
        worker.start_load_kv(meta)
        worker.wait_for_save(meta)
        arrived, failed, blocks = _loaded(decode)  # it counts both layers' notifications before it says so
        assert (arrived, failed) == (True, [])
        _assert_copied(blocks, src)
        assert worker.producer.transfer.posted == 2  # one WRITE per layer, none after the forward
        assert _sent(worker, "prefill-layered") == {"prefill-layered"}
    finally:
        worker.shutdown()
        bridge.close()


def test_a_revoke_between_two_layers_stops_the_rest_and_is_answered_once_the_posted_layer_landed(
        nats_server, decode):
    """Layer 0 is on its way when decode gives the transfer up: layer 1 must not be
    written, even though the forward computes it after; decode hears the answer once no
    write of ours can land (its blocks may then go to another request), and the prompt's
    blocks go back."""
    prefill_id = _id("prefill")
    bridge = NatsBridge(nats_server.url, name=prefill_id)
    bridge.start()
    completions = _Completions()
    bridge.subscribe_typed(wire.completion_subject(decode.engine_id, prefill_id), wire.Completion, completions.put,
                           "test")
    worker = _producer(bridge, prefill_id, lease_s=WAIT_S, push_by_layer=True)
    try:
        src, dst = [0, 1, 2], [5, 6, 7]
        transfer, key, meta = _layered_step(worker, decode, "revoked", src, dst)
        bridge.publish(wire.registration_subject(prefill_id, decode.engine_id), _revoke(transfer, decode.engine_id, key))
        [answer] = _until(lambda: completions.of(transfer), "the revoke's answer", 10)
        assert isinstance(answer, wire.TransferFailed) and answer.code == Revoked.code, answer
        assert "1 of 2 layers landed" in answer.reason
        worker.save_kv_layer(LAYERS[1], meta)  # the forward goes on
        worker.start_load_kv(meta)
        worker.wait_for_save(meta)
        thread = worker.producer.transfer
        assert thread.poll_notifications_now(10)  # the thread has taken every job queued before
        assert thread.posted == 1, "a layer was written after the revoke was answered"
        arrived, failed, blocks = _loaded(decode)
        assert len(failed) == 1, "decode's wait ended without the KV"
        layer0, layer1 = (torch.tensor(blocks[name]) for name in LAYERS)
        assert all(torch.all(layer0[i] == s) for i, s in enumerate(src))  # it had landed
        assert torch.all(layer1 == 0)
        assert _sent(worker, "prefill-revoked") == {"prefill-revoked"}
    finally:
        worker.shutdown()
        bridge.close()


# ------------------------------------------------------------------ trust: the transfer's key and its parties


def _revoke(transfer_id: str, decode_engine_id: str, transfer_key: str) -> bytes:
    return wire.encode(wire.Revoke(transfer_id=transfer_id, decode_engine_id=decode_engine_id, reason="test",
                                   transfer_key=transfer_key))


def test_a_revoke_without_the_transfers_key_is_refused_and_the_write_still_lands(nats_server, decode):
    """Only the decode the scheduler chose holds the key: a Revoke without it (on the
    decode's own subject, so not forged) must not close the transfer decode waits for."""
    prefill_id = _id("prefill")
    bridge = NatsBridge(nats_server.url, name=prefill_id)
    bridge.start()
    refusals = _Refusals(bridge)
    completions = _Completions()
    bridge.subscribe_typed(wire.completion_subject(decode.engine_id, prefill_id), wire.Completion, completions.put,
                           "test")
    worker = _producer(bridge, prefill_id, lease_s=WAIT_S)
    control = wire.registration_subject(prefill_id, decode.engine_id)
    transfer, key = _id("kept"), _key()
    src, dst = [1, 2], [8, 9]
    try:
        _start_load(decode, wire.DecodeKvParams(transfer_id=transfer, request_id="kept", prefill_engine_id=prefill_id,
                                                transfer_key=key), dst)
        _until(lambda: worker.producer.waiting(transfer), "decode's registration waiting", 10)
        for wrong_key in ("", _key()):
            bridge.publish(control, _revoke(transfer, decode.engine_id, wrong_key))
        refused = _until(lambda: refusals.by(prefill_id)[1:] and refusals.by(prefill_id), "both refusals", 10)
        assert [(r.code, transfer in r.reason) for r in refused] == [(WrongParty.code, True)] * 2
        assert worker.producer.waiting(transfer)  # not closed
        assert completions.of(transfer) == []  # and not answered revoked

        worker.wait_for_save(KvpushMetadata(ready_prefills=[
            ReadyPrefill("prefill-kept", transfer, src, mode="push", num_tokens=len(src) * BLOCK_SIZE,
                         decode_engine_id=decode.engine_id, transfer_key=key)]))
        arrived, failed, blocks = _loaded(decode)
        assert (arrived, failed) == (True, [])
        _assert_copied(blocks, src)
        assert _sent(worker, "prefill-kept") == {"prefill-kept"}
        [done] = _until(lambda: completions.of(transfer), "the write's answer", 10)
        assert isinstance(done, wire.TransferDone)
    finally:
        worker.shutdown()
        bridge.close()


def test_a_revoke_without_the_transfers_key_keeps_a_pulled_prompts_blocks_held(nats_server):
    prefill_id, decode_id = _id("prefill"), _id("decode")
    bridge = NatsBridge(nats_server.url, name=prefill_id)
    bridge.start()
    refusals = _Refusals(bridge)
    completions = _Completions()
    bridge.subscribe_typed(wire.completion_subject(decode_id, prefill_id), wire.Completion, completions.put, "test")
    worker = _producer(bridge, prefill_id, lease_s=WAIT_S)
    control = wire.registration_subject(prefill_id, decode_id)
    transfer, key = _id("pull"), _key()
    try:
        worker.wait_for_save(KvpushMetadata(ready_prefills=[
            ReadyPrefill("prefill-pulled", transfer, [3, 4], mode="pull", num_tokens=2 * BLOCK_SIZE,
                         transfer_key=key)]))
        for wrong_key in ("", _key()):
            bridge.publish(control, _revoke(transfer, decode_id, wrong_key))
        refused = _until(lambda: refusals.by(prefill_id)[1:] and refusals.by(prefill_id), "both refusals", 10)
        assert [(r.code, transfer in r.reason) for r in refused] == [(WrongParty.code, True)] * 2
        assert worker.producer.serves(transfer)  # decode may still READ them
        assert worker.get_finished({"prefill-pulled"}) == (set(), set(), set())
        assert completions.of(transfer) == []

        bridge.publish(control, _revoke(transfer, decode_id, key))  # decode's own: it gives the read up
        [answer] = _until(lambda: completions.of(transfer), "the revoke's answer", 10)
        assert isinstance(answer, wire.TransferFailed) and answer.code == Revoked.code
        assert _sent(worker, "prefill-pulled") == {"prefill-pulled"}
    finally:
        worker.shutdown()
        bridge.close()


@pytest.mark.parametrize("order", ["prefill_first", "registration_first"])
def test_a_registration_without_the_transfers_key_is_not_matched(nats_server, order):
    """The prompt waits on for a registration with the key; the one without it is
    answered as a bad registration, and no write goes into its blocks."""
    prefill_id, decode_id = _id("prefill"), _id("decode")
    bridge = NatsBridge(nats_server.url, name=prefill_id)
    bridge.start()
    completions = _Completions()
    bridge.subscribe_typed(wire.completion_subject(decode_id, prefill_id), wire.Completion, completions.put, "test")
    worker = _producer(bridge, prefill_id, lease_s=WAIT_S)
    control = wire.registration_subject(prefill_id, decode_id)
    transfer, key = _id("keyed"), _key()
    ready = KvpushMetadata(ready_prefills=[
        ReadyPrefill("prefill-keyed", transfer, [0, 1], mode="push", num_tokens=2 * BLOCK_SIZE,
                     decode_engine_id=decode_id, transfer_key=key)])

    def registration(transfer_key: str) -> bytes:
        return wire.encode(wire.Registration(
            transfer_id=transfer, request_id="keyed", decode_engine_id=decode_id, decode_request_id="d",
            decode_tp_size=1, block_ids=[5, 6], num_tokens=2 * BLOCK_SIZE, registered_at=time.time(),
            transfer_key=transfer_key))

    try:
        if order == "prefill_first":
            worker.wait_for_save(ready)
            bridge.publish(control, registration(_key()))
        else:
            bridge.publish(control, registration(_key()))
            _until(lambda: worker.producer.waiting(transfer), "the registration waiting", 10)
            worker.wait_for_save(ready)
        [refused] = _until(lambda: completions.of(transfer), "the answer to the keyless registration", 10)
        assert isinstance(refused, wire.TransferFailed) and refused.code == BadRegistration.code
        assert "key" in refused.reason
        assert worker.producer.waiting(transfer)  # the prompt waits on
        assert worker.get_finished({"prefill-keyed"}) == (set(), set(), set())

        bridge.publish(control, registration(key))
        answers = _until(lambda: completions.of(transfer)[1:], "the answer to the keyed registration", 10)
        # Matched: the write was set up (and failed, for this decode has no agent here).
        assert [a.code for a in answers] == [AgentUnreachable.code]
        assert _sent(worker, "prefill-keyed") == {"prefill-keyed"}
    finally:
        worker.shutdown()
        bridge.close()


def _failed(transfer_id: str, prefill_engine_id: str, decode_engine_id: str) -> bytes:
    return wire.encode(wire.TransferFailed(transfer_id=transfer_id, prefill_engine_id=prefill_engine_id,
                                           decode_engine_id=decode_engine_id, rank=0, code=WriteFailed.code,
                                           reason="test"))


def test_a_transfer_failed_from_a_prefill_that_is_not_the_waits_is_refused_and_the_wait_goes_on(nats_server):
    decode_id, prefill_id, other_id = _id("decode"), _id("prefill"), _id("prefill")
    bridge = NatsBridge(nats_server.url, name=decode_id)
    bridge.start()
    refusals = _Refusals(bridge)
    worker = _consumer(bridge, decode_id)
    transfer, key = _id("waited"), _key()
    try:
        worker.start_load_kv(KvpushMetadata(expected=[ExpectedKv(
            "waiting", transfer, 1, prefill_engine_id=prefill_id, transfer_key=key, block_ids=[5, 6])]))
        # On the other prefill's own subject (not forged), about a transfer it has no part in.
        bridge.publish(wire.completion_subject(decode_id, other_id), _failed(transfer, other_id, decode_id))
        [refusal] = _until(lambda: refusals.by(decode_id), "the refusal", 10)
        assert refusal.code == WrongParty.code and transfer in refusal.reason and other_id in refusal.reason
        assert worker.get_finished(set(), idle=True) == (set(), set(), set())  # the blocks wait on

        bridge.publish(wire.completion_subject(decode_id, prefill_id), _failed(transfer, prefill_id, decode_id))
        _, receiving, failed = _until(lambda: (r := worker.get_finished(set(), idle=True))[1] and r,
                                      "the wait's own prefill ending it", 10)
        assert receiving == failed == {"waiting"}
    finally:
        worker.shutdown()
        bridge.close()


def _wrong_notes(transfer_id: str, transfer_key: str, block_ids: list[int]) -> list[bytes]:
    """Notifications for the transfer that its parties would never send."""
    return [
        notification(transfer_id, 0, 1, block_tag(_key(), block_ids)),  # made with another key
        notification(transfer_id, 0, 1, block_tag(transfer_key, [b + 1 for b in block_ids])),  # other blocks
        notification(transfer_id, 0, 1, ""),  # untagged
    ]


@pytest.mark.parametrize("when", ["before_the_wait", "during_the_wait"])
def test_a_write_notification_without_the_transfers_tag_over_our_blocks_is_no_arrival(nats_server, when):
    """Fed to the worker side as NIXL's notifications are (``before_the_wait``: they came
    before vLLM's step started the wait, and are kept until then)."""
    decode_id, prefill_id = _id("decode"), _id("prefill")
    bridge = NatsBridge(nats_server.url, name=decode_id)
    bridge.start()
    refusals = _Refusals(bridge)
    worker = _consumer(bridge, decode_id)
    transfer, key, blocks = _id("tagged"), _key(), [5, 6]
    meta = KvpushMetadata(expected=[ExpectedKv(
        "tagged", transfer, 1, prefill_engine_id=prefill_id, transfer_key=key, block_ids=blocks)])
    try:
        if when == "during_the_wait":
            worker.start_load_kv(meta)
        tag = block_tag(key, blocks)
        for note in [*_wrong_notes(transfer, key, blocks),
                     notification(transfer, 0, 1, tag, part=0, parts=3)]:  # our KV has 2 layers, not 3
            worker.on_notification(note)
        if when == "before_the_wait":
            worker.start_load_kv(meta)
        refused = _until(lambda: refusals.by(decode_id)[3:] and refusals.by(decode_id), "four refusals", 10)
        assert [(r.code, transfer in r.reason) for r in refused] == [(WrongParty.code, True)] * 4
        assert "in 3 parts" in refused[3].reason
        worker.on_notification(notification(transfer, 0, 1, tag, part=0, parts=2))  # layer by layer: one of two
        assert worker.get_finished(set(), idle=True) == (set(), set(), set())

        worker.on_notification(notification(transfer, 0, 1, tag, part=1, parts=2))
        _, receiving, failed = _until(lambda: (r := worker.get_finished(set(), idle=True))[1] and r, "the arrival", 10)
        assert (receiving, failed) == ({"tagged"}, set())
    finally:
        worker.shutdown()
        bridge.close()


def test_a_read_notification_without_the_transfers_tag_over_our_blocks_keeps_them_held(nats_server):
    prefill_id = _id("prefill")
    bridge = NatsBridge(nats_server.url, name=prefill_id)
    bridge.start()
    refusals = _Refusals(bridge)
    worker = _producer(bridge, prefill_id, lease_s=WAIT_S)
    transfer, key, blocks = _id("read"), _key(), [3, 4]
    try:
        worker.wait_for_save(KvpushMetadata(ready_prefills=[
            ReadyPrefill("prefill-read", transfer, blocks, mode="pull", num_tokens=2 * BLOCK_SIZE, transfer_key=key)]))
        for note in _wrong_notes(transfer, key, blocks):
            worker.on_notification(note)
        refused = _until(lambda: refusals.by(prefill_id)[2:] and refusals.by(prefill_id), "three refusals", 10)
        assert [(r.code, transfer in r.reason) for r in refused] == [(WrongParty.code, True)] * 3
        assert worker.producer.serves(transfer)
        assert worker.get_finished({"prefill-read"}) == (set(), set(), set())

        worker.on_notification(notification(transfer, 0, 1, block_tag(key, blocks)))  # decode's READ
        assert _sent(worker, "prefill-read") == {"prefill-read"}
    finally:
        worker.shutdown()
        bridge.close()


# ------------------------------------------------------------------ the KV noticed at once

def _noticing_decode_side(conn, url: str, engine_id: str, idle: bool) -> None:
    """Busy (``idle`` False): a decode whose transfer thread has no timed poll that could
    read a notification (EXPECT_POLL_S and IDLE_POLL_S an hour) and ignores the producer's
    TransferDone, stepping as fast as it can: only the poll each step's end asks for can
    notice the KV (and, on UCX's TCP and shared-memory transports, its polls are also what
    lets the connection and the notification through). Idle: one idle step, whose wait is
    an hour long; the KV's arrival must end it."""
    from kvpush.connector import transfer_thread
    from kvpush.shared import chaos

    if not idle:
        transfer_thread.EXPECT_POLL_S = transfer_thread.IDLE_POLL_S = 3600.0
        transfer_thread.TransferThread.poke = lambda self: None
    bridge = NatsBridge(url, name=engine_id)
    bridge.start()
    caches = _kv_caches(0.0)
    agents = AgentDirectory(bridge, 0, engine_id)
    consumer = Consumer(engine_id, 0, 1, bridge, agents, kv_wait_s=WAIT_S, quarantine_s=5.0)
    worker = ConnectorWorker(engine_id, 0, bridge, agents, consumer=consumer)
    worker.register_kv_caches(caches, NUM_BLOCKS)
    worker._wake_clock.long_s = 3600.0  # the idle step's wait: only a wake or the arrival ends it
    scheduler = ConnectorScheduler(engine_id, BLOCK_SIZE, 1, bridge)
    conn.send("ready")
    params, block_ids = conn.recv()
    request = SimpleNamespace(request_id=_id("decode"), prompt_token_ids=list(range(len(block_ids) * BLOCK_SIZE)),
                              kv_transfer_params=params)
    scheduler.on_new_request(request)
    external = len(block_ids) * BLOCK_SIZE
    assert scheduler.get_num_new_matched_tokens(request, 0) == (external, True)
    scheduler.update_state_after_alloc(request, KVCacheBlocks(([KVCacheBlock(b, ref_cnt=1) for b in block_ids],)),
                                       external)
    worker.start_load_kv(scheduler.build_connector_meta(
        SimpleNamespace(total_num_scheduled_tokens=0, num_scheduled_tokens={})))
    if idle:
        outcome: list = []
        with chaos.hold("worker.idle_wait") as gate:
            step = threading.Thread(target=lambda: outcome.append(worker.get_finished(set(), idle=True)))
            step.start()
            assert gate.reached.wait(WAIT_S), "the idle step did not wait"
            gate.open()
            conn.send("waiting")  # the step is in its wait (or about to be): now the KV may come
            step.join(WAIT_S)
        conn.send((bool(outcome) and request.request_id in outcome[0][1], 1))
    else:
        conn.send("waiting")
        steps, received = 0, set()
        deadline = time.monotonic() + WAIT_S
        while request.request_id not in received and time.monotonic() < deadline:
            steps += 1
            received |= worker.get_finished(set())[1]
        conn.send((request.request_id in received, steps))
    conn.send({name: t[block_ids].clone().numpy().tolist() for name, t in caches.items()})
    assert conn.recv() is None
    worker.shutdown()
    bridge.close()


@pytest.mark.parametrize("idle", [False, True], ids=["at_the_step_end", "waking_the_idle_step"])
def test_pushed_kv_is_noticed_at_once_not_at_a_timed_poll(nats_server, idle):
    """Busy: decode's steps report the request as received through the poll each step's
    end asks for, with no timer and no TransferDone to help. Idle: the one idle step, in
    an hour-long wait, returns with the request once the KV lands."""
    prefill_id, decode_id = _id("prefill"), _id("decode")
    bridge = NatsBridge(nats_server.url, name=prefill_id)
    bridge.start()
    worker = _producer(bridge, prefill_id, lease_s=WAIT_S)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_noticing_decode_side, args=(child, nats_server.url, decode_id, idle))
    proc.start()
    try:
        assert parent.poll(120) and parent.recv() == "ready"
        transfer, key = _id("notice"), _key()
        src, dst = [1, 2, 3], [8, 9, 10]
        parent.send((wire.DecodeKvParams(transfer_id=transfer, request_id="notice", prefill_engine_id=prefill_id,
                                         transfer_key=key).as_params(), dst))
        assert parent.poll(WAIT_S) and parent.recv() == "waiting"
        worker.wait_for_save(KvpushMetadata(ready_prefills=[
            ReadyPrefill("prefill-notice", transfer, src, mode="push", num_tokens=len(src) * BLOCK_SIZE,
                         decode_engine_id=decode_id, transfer_key=key)]))
        assert parent.poll(WAIT_S + 10), "decode did not answer"
        received, steps = parent.recv()
        assert received, "decode never noticed its KV"
        assert _sent(worker, "prefill-notice") == {"prefill-notice"}  # and prefill's WRITE ended
        assert parent.poll(10)
        _assert_copied(parent.recv(), src)
        parent.send(None)
    finally:
        worker.shutdown()
        bridge.close()
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
