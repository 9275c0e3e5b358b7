"""Tensor parallelism across the split, over a real NATS server and real NIXL agents: each
rank of an engine in a process of its own, with its own agent and memory, as vLLM's
multiprocess executor runs them; the engine's scheduler side (vLLM's engine core) in this
process. Push and pull at prefill TP 2 -> decode TP 2, 2 -> 1 and 1 -> 2: every head of
every block lands in the decode rank that holds it, a decode rank starts only once every
prefill rank writing into it landed, and a prefill rank frees its blocks only once every
decode rank reading it did. One rank's WRITE failing, or one rank's bytes flipped with
checksums on, fails the request's load (vLLM's ``KVOutputAggregator`` unites the ranks'
failures) and every rank's blocks go back. What landed in each decode rank, as that rank
says, reaches the engine core and the request's path report (``ReceivedKv.by_rank``).

The model has 4 KV heads. A rank's KV per layer is ``[blocks, 4 / TP heads, block size,
2 * head size]``, numbered so that each value names its layer, block and global head.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import secrets
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

from kvpush.connector import checksums
from kvpush.connector.agents import AgentDirectory
from kvpush.connector.bridge import NatsBridge
from kvpush.connector.consumer import Consumer
from kvpush.connector.metadata import KvpushMetadata, ReadyPrefill
from kvpush.connector.producer import Producer
from kvpush.connector.scheduler_side import ConnectorScheduler
from kvpush.connector.worker_side import ConnectorWorker
from kvpush.shared import wire
from kvpush.shared.errors import ChecksumMismatch, WriteFailed

KV_HEADS = 4
NUM_BLOCKS = 12
BLOCK_SIZE = 4  # tokens per block
HEAD = 8  # per layer and head: [block size, 2 * HEAD]
LAYERS = 2
WAIT_S = 30.0


def _id(what: str) -> str:
    return f"{what}-{uuid.uuid4().hex[:8]}"


def _value(layer: int, block: int, head: int) -> float:
    """What prefill's KV holds for this layer, block and global KV head."""
    return 10_000 * layer + 100 * block + head + 1


def _caches(tp: int, rank: int, numbered: bool) -> dict[str, torch.Tensor]:
    heads = KV_HEADS // tp
    pool = torch.zeros((LAYERS, NUM_BLOCKS, heads, BLOCK_SIZE, 2 * HEAD), dtype=torch.float32)
    if numbered:
        for layer in range(LAYERS):
            for block in range(NUM_BLOCKS):
                for head in range(heads):
                    pool[layer, block, head] = _value(layer, block, rank * heads + head)
    return {f"model.layers.{i}.attn": pool[i] for i in range(LAYERS)}


def _worker(bridge: NatsBridge, engine_id: str, tp: int, rank: int) -> ConnectorWorker:
    """One rank of a kvpush engine (kv_both, as every kvpush engine runs)."""
    agents = AgentDirectory(bridge, rank, engine_id)
    producer = Producer(engine_id, rank, tp, bridge, agents, lease_s=WAIT_S, kv_heads=KV_HEADS)
    consumer = Consumer(engine_id, rank, tp, bridge, agents, kv_wait_s=WAIT_S, quarantine_s=5.0, kv_heads=KV_HEADS)
    return ConnectorWorker(engine_id, rank, bridge, agents, producer=producer, consumer=consumer)


# ------------------------------------------------------------------ a rank, in its own process


def _rank_side(conn, url: str, engine_id: str, tp: int, rank: int, numbered: bool, chaos_file: str) -> None:
    os.environ["KVPUSH_CHAOS_FILE"] = chaos_file  # a test turns this rank's faults on by writing it
    bridge = NatsBridge(url, name=f"{engine_id}-r{rank}")
    bridge.start()
    caches = _caches(tp, rank, numbered)
    worker = _worker(bridge, engine_id, tp, rank)
    worker.register_kv_caches(caches, NUM_BLOCKS)
    conn.send("ready")
    received: set[str] = set()
    failed: set[str] = set()
    while (command := conn.recv()) is not None:
        match command:
            case ("save", meta):  # prefill: the forward pass finished these prompts
                worker.wait_for_save(meta)
                conn.send("saved")
            case ("sent", request_id):  # prefill: wait until vLLM may free the prompt's blocks
                deadline = time.monotonic() + WAIT_S
                sent = False
                while not sent and time.monotonic() < deadline:
                    sent = request_id in worker.get_finished({request_id}, idle=True)[0]
                conn.send(sent)
            case ("held", request_id):  # prefill: one step, are the prompt's blocks still held?
                conn.send(request_id not in worker.get_finished({request_id}, idle=True)[0])
            case ("load", meta):  # decode: a step whose metadata starts the wait (or the READ)
                for tensor in caches.values():
                    tensor.zero_()
                received, failed = set(), set()
                worker.start_load_kv(meta)
                conn.send("loading")
            case ("poll", request_id, within_s):  # decode: step until the wait ended, or for within_s
                deadline = time.monotonic() + within_s
                while request_id not in received and time.monotonic() < deadline:
                    _, more, lost = worker.get_finished(set(), idle=True)
                    received |= more
                    failed |= lost
                conn.send((request_id in received, request_id in failed, worker.build_worker_meta()))
            case ("blocks", block_ids):
                conn.send({name: t[block_ids].clone() for name, t in caches.items()})
            case ("meta",):
                conn.send(worker.build_worker_meta())
    worker.shutdown()
    bridge.close()


class _Rank:
    def __init__(self, conn, engine_id: str, tp: int, rank: int, chaos_file: Path):
        self.conn, self.engine_id, self.tp, self.rank, self.chaos_file = conn, engine_id, tp, rank, chaos_file

    def ask(self, *command, within_s: float = WAIT_S + 10):
        self.conn.send(command)
        assert self.conn.poll(within_s), f"{self.engine_id} rank {self.rank} did not answer {command[0]}"
        return self.conn.recv()

    def send(self, *command) -> None:
        self.conn.send(command)

    def answer(self, within_s: float = WAIT_S + 10):
        assert self.conn.poll(within_s), f"{self.engine_id} rank {self.rank} did not answer"
        return self.conn.recv()

    @contextlib.contextmanager
    def faults(self, spec: dict):
        """This rank's faults (shared/chaos.py) while the block runs."""
        self.chaos_file.write_text(json.dumps(spec))
        time.sleep(1.2)  # the chaos file is read again every 0.5 s
        try:
            yield
        finally:
            self.chaos_file.unlink()
            time.sleep(1.2)


@pytest.fixture(scope="module")
def engines(nats_server, tmp_path_factory):
    """Prefill at TP 2 and TP 1, decode at TP 2 and TP 1: one process per rank (starting
    one takes ~20 s: they start together, once for the module)."""
    folder = tmp_path_factory.mktemp("tp")
    ctx = mp.get_context("spawn")
    plan = [("prefill2", 2, True), ("prefill1", 1, True), ("decode2", 2, False), ("decode1", 1, False)]
    engines, processes = {}, []
    for name, tp, numbered in plan:
        engine_id = _id(name)
        ranks = []
        for rank in range(tp):
            parent, child = ctx.Pipe()
            chaos_file = folder / f"{engine_id}-r{rank}.json"
            proc = ctx.Process(target=_rank_side, args=(child, nats_server.url, engine_id, tp, rank, numbered,
                                                         str(chaos_file)))
            proc.start()
            processes.append(proc)
            ranks.append(_Rank(parent, engine_id, tp, rank, chaos_file))
        engines[name] = SimpleNamespace(engine_id=engine_id, tp=tp, ranks=ranks)
    bridge = NatsBridge(nats_server.url, name=_id("engine-core"))
    bridge.start()
    for engine in engines.values():  # decode's engine core: its scheduler side, one for all its ranks
        engine.scheduler = ConnectorScheduler(engine.engine_id, BLOCK_SIZE, engine.tp, bridge, kv_heads=KV_HEADS,
                                              bytes_per_block=LAYERS * KV_HEADS * BLOCK_SIZE * 2 * HEAD * 4)
    try:
        for engine in engines.values():
            for rank in engine.ranks:
                assert rank.answer(180) == "ready"
        yield SimpleNamespace(bridge=bridge, **engines)
    finally:
        for engine in engines.values():
            for rank in engine.ranks:
                with contextlib.suppress(OSError):
                    rank.conn.send(None)
        for proc in processes:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
        bridge.close()


# ------------------------------------------------------------------ one request across the split


def _ready(request_id: str, transfer: str, key: str, src: list[int], mode: str, decode_engine_id: str,
           checksum: bool = True) -> KvpushMetadata:
    return KvpushMetadata(ready_prefills=[ReadyPrefill(
        request_id, transfer, src, mode=mode, num_tokens=len(src) * BLOCK_SIZE,
        decode_engine_id=decode_engine_id if mode == "push" else "", transfer_key=key, checksum=checksum)])


def _decode_step(rig, decode, params: wire.DecodeKvParams, dst: list[int]) -> tuple[str, KvpushMetadata]:
    """Decode's engine core (its scheduler side, here) takes the request: push, it registers
    its blocks once for the engine; the step's metadata goes to every rank."""
    scheduler = decode.scheduler
    request = SimpleNamespace(request_id=_id("decode"), prompt_token_ids=list(range(len(dst) * BLOCK_SIZE)),
                              kv_transfer_params=params.as_params())
    scheduler.on_new_request(request)
    assert scheduler.get_num_new_matched_tokens(request, 0) == (len(dst) * BLOCK_SIZE, True)
    scheduler.update_state_after_alloc(request, KVCacheBlocks(([KVCacheBlock(b, ref_cnt=1) for b in dst],)),
                                       len(dst) * BLOCK_SIZE)
    meta = scheduler.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=0, num_scheduled_tokens={}))
    return request.request_id, meta


def _pull_params(rig, prefill, transfer: str, key: str, src: list[int]) -> wire.DecodeKvParams:
    """What prefill's engine core hands on for a pulled prompt: its blocks, and every rank's
    digests of its heads (from the ranks' worker metas, as vLLM merges them)."""
    metas = [rank.ask("meta") for rank in prefill.ranks]
    merged = metas[0]
    for meta in metas[1:]:
        merged = merged.aggregate(meta)
    handoff = wire.PrefilledKv(transfer_id=transfer, prefill_engine_id=prefill.engine_id, prefill_tp_size=prefill.tp,
                               remote_block_ids=src, kv_heads=KV_HEADS).as_params()
    digests = checksums.HandoffDigests(prefill.tp)
    digests.handed(transfer, handoff)
    digests.arrived(transfer, merged.pull_digests[transfer])
    prefilled = wire.PrefilledKv.of(handoff)
    assert len(prefilled.head_digests) == len(src) and all(len(row) == KV_HEADS for row in prefilled.head_digests)
    return wire.DecodeKvParams(transfer_id=transfer, request_id="r", prefill_engine_id=prefill.engine_id,
                               prefill_tp_size=prefill.tp, mode="pull", remote_block_ids=src, transfer_key=key,
                               head_digests=prefilled.head_digests)


def _assert_heads_landed(decode, src: list[int], dst: list[int]) -> None:
    """Every head of every block is in the decode rank that holds it, where it belongs."""
    heads = KV_HEADS // decode.tp
    for rank in decode.ranks:
        blocks = rank.ask("blocks", dst)
        for layer, name in enumerate(sorted(blocks)):
            for i, block in enumerate(src):
                for head in range(heads):
                    want = _value(layer, block, rank.rank * heads + head)
                    assert torch.all(blocks[name][i, head] == want), (rank.rank, name, block, head)


def _outcomes(decode, request_id: str, within_s: float = WAIT_S):
    """Each decode rank's end of the wait: (received, failed, its worker meta)."""
    for rank in decode.ranks:
        rank.send("poll", request_id, within_s)
    outcomes = [rank.answer() for rank in decode.ranks]
    decode.scheduler.update_connector_output(SimpleNamespace(  # its lease at prefill is not renewed any more
        finished_recving={request_id}, finished_sending=None, kv_connector_worker_meta=None))
    return outcomes


def _united(request_id: str, outcomes) -> KVConnectorOutput:
    """What vLLM's engine core sees: the ranks' outputs through its own aggregator."""
    aggregator = KVOutputAggregator(expected_finished_count=len(outcomes))
    outputs = []
    for received, failed, meta in outcomes:
        output = ModelRunnerOutput(req_ids=[], req_id_to_index={})
        output.kv_connector_output = KVConnectorOutput(finished_recving={request_id} if received else None,
                                                       failed_recving={request_id} if failed else set(),
                                                       kv_connector_worker_meta=meta)
        outputs.append(output)
    return aggregator.aggregate(outputs).kv_connector_output


def _move(rig, prefill, decode, mode: str, src: list[int], dst: list[int]):
    """One request's KV from ``prefill`` to ``decode``, checksums on: (request, outcomes)."""
    transfer, key = _id(mode), secrets.token_hex(16)
    prefill_request = _id("prefill")
    ready = _ready(prefill_request, transfer, key, src, mode, decode.engine_id)
    if mode == "pull":
        for rank in prefill.ranks:
            assert rank.ask("save", ready) == "saved"
        params = _pull_params(rig, prefill, transfer, key, src)
    else:
        params = wire.DecodeKvParams(transfer_id=transfer, request_id="r", prefill_engine_id=prefill.engine_id,
                                     transfer_key=key)
    request_id, meta = _decode_step(rig, decode, params, dst)
    for rank in decode.ranks:
        assert rank.ask("load", meta) == "loading"
    if mode == "push":
        for rank in prefill.ranks:
            assert rank.ask("save", ready) == "saved"
    outcomes = _outcomes(decode, request_id)
    for rank in prefill.ranks:  # every prefill rank's blocks go back, its copy ended
        assert rank.ask("sent", prefill_request) is True
    return request_id, outcomes


PAIRS = [("prefill2", "decode2"), ("prefill2", "decode1"), ("prefill1", "decode2")]


@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize("pair", PAIRS, ids=["p2-d2", "p2-d1", "p1-d2"])
def test_every_head_lands_in_the_decode_rank_that_holds_it_and_is_verified_there(engines, pair, mode):
    prefill, decode = (getattr(engines, name) for name in pair)
    src, dst = [0, 1, 2, 7], [5, 6, 7, 11]
    request_id, outcomes = _move(engines, prefill, decode, mode, src, dst)
    assert [(received, failed) for received, failed, _ in outcomes] == [(True, False)] * decode.tp
    assert all(meta.verified == {request_id: 1} for _, _, meta in outcomes)  # each rank checked its heads
    united = _united(request_id, outcomes)
    assert (united.finished_recving, united.failed_recving) == ({request_id}, set())
    assert united.kv_connector_worker_meta.verified == {request_id: decode.tp}
    _assert_heads_landed(decode, src, dst)
    # What landed in each rank, as each rank said it, reaches the request's path report.
    per_rank = len(dst) * LAYERS * (KV_HEADS // decode.tp) * BLOCK_SIZE * 2 * HEAD * 4
    parts = [wire.RankKv(rank=rank, blocks=len(dst), bytes=per_rank) for rank in range(decode.tp)]
    assert [meta.received for _, _, meta in outcomes] == [{request_id: {part.rank: part}} for part in parts]
    decode.scheduler.update_connector_output(united)
    _, params = decode.scheduler.request_finished(SimpleNamespace(request_id=request_id, kv_transfer_params={}), [])
    received = wire.ReceivedKv.of(params[wire.RECEIVED_KEY])
    assert (received.by_rank, received.checksum) == (parts, "verified")
    assert sum(part.bytes for part in received.by_rank) == received.bytes


def test_a_decode_rank_starts_only_once_every_prefill_rank_writing_into_it_landed(engines):
    """Prefill TP 2 -> decode TP 1: rank 0's write lands, and decode's one rank waits on
    for rank 1's half of every block."""
    prefill, decode = engines.prefill2, engines.decode1
    transfer, key = _id("halves"), secrets.token_hex(16)
    src, dst = [3, 4], [8, 9]
    params = wire.DecodeKvParams(transfer_id=transfer, request_id="r", prefill_engine_id=prefill.engine_id,
                                 transfer_key=key)
    request_id, meta = _decode_step(engines, decode, params, dst)
    [only] = decode.ranks
    assert only.ask("load", meta) == "loading"
    ready = _ready("prefill-first-half", transfer, key, src, "push", decode.engine_id)
    assert prefill.ranks[0].ask("save", ready) == "saved"
    assert prefill.ranks[0].ask("sent", "prefill-first-half") is True  # rank 0's WRITE ended: it landed
    received, failed, _ = only.ask("poll", request_id, 1.0)
    assert (received, failed) == (False, False), "decode started on half of its KV"
    assert prefill.ranks[1].ask("save", ready) == "saved"
    received, failed, _ = only.ask("poll", request_id, WAIT_S)
    assert (received, failed) == (True, False)
    _assert_heads_landed(decode, src, dst)


def test_a_prefill_rank_frees_its_blocks_only_once_every_decode_rank_reading_it_read(engines):
    """Prefill TP 1 -> decode TP 2, pull: each decode rank reads its half of prefill's
    blocks; prefill holds them until both READs notified."""
    prefill, decode = engines.prefill1, engines.decode2
    transfer, key = _id("readers"), secrets.token_hex(16)
    src, dst = [5, 6], [1, 2]
    [holder] = prefill.ranks
    assert holder.ask("save", _ready("prefill-read-twice", transfer, key, src, "pull", "")) == "saved"
    request_id, meta = _decode_step(engines, decode, _pull_params(engines, prefill, transfer, key, src), dst)
    first, second = decode.ranks
    assert first.ask("load", meta) == "loading"
    assert first.ask("poll", request_id, WAIT_S)[:2] == (True, False)
    assert holder.ask("held", "prefill-read-twice") is True, "freed with one of two readers' READ"
    assert second.ask("load", meta) == "loading"
    assert second.ask("poll", request_id, WAIT_S)[:2] == (True, False)
    assert holder.ask("sent", "prefill-read-twice") is True
    _assert_heads_landed(decode, src, dst)


def test_one_prefill_ranks_write_failing_fails_the_requests_load_and_every_rank_frees_its_blocks(engines):
    """Prefill TP 2 -> decode TP 2, rank 1's WRITE fails (chaos): decode rank 0 has its
    heads, rank 1 does not; vLLM sees the load failed, with rank 1's reason."""
    prefill, decode = engines.prefill2, engines.decode2
    with prefill.ranks[1].faults({"kv.write.1": {"drop": 1.0}}):
        request_id, outcomes = _move(engines, prefill, decode, "push", [0, 1], [3, 4])
    assert [(received, failed) for received, failed, _ in outcomes] == [(True, False), (True, True)]
    united = _united(request_id, outcomes)
    assert (united.finished_recving, united.failed_recving) == ({request_id}, {request_id})
    [(code, _)] = united.kv_connector_worker_meta.load_failures.values()
    assert code == WriteFailed.code


def test_a_write_failing_into_a_decode_rank_with_two_writers_fails_its_load_once_the_other_answered(engines):
    """Prefill TP 2 -> decode TP 1, rank 1's WRITE fails: decode's one rank gives the load
    up with rank 1's reason, revokes, and releases its blocks only once rank 0 answered
    too (here: the revoke's answer, or its landed write)."""
    prefill, decode = engines.prefill2, engines.decode1
    with prefill.ranks[1].faults({"kv.write.1": {"drop": 1.0}}):
        request_id, outcomes = _move(engines, prefill, decode, "push", [0, 1], [3, 4])
    [(received, failed, meta)] = outcomes
    assert (received, failed) == (True, True)
    [(code, _)] = meta.load_failures.values()
    assert code == WriteFailed.code


@pytest.mark.parametrize("mode,pair", [("push", ("prefill2", "decode2")), ("pull", ("prefill1", "decode2"))])
def test_one_decode_ranks_flipped_bytes_are_caught_and_fail_the_requests_load(engines, mode, pair):
    prefill, decode = (getattr(engines, name) for name in pair)
    with decode.ranks[1].faults({"kv.flip": {"flip": 1.0}}):
        request_id, outcomes = _move(engines, prefill, decode, mode, [2, 3], [6, 7])
    assert [(received, failed) for received, failed, _ in outcomes] == [(True, False), (True, True)]
    assert outcomes[0][2].verified == {request_id: 1} and not outcomes[1][2].verified
    assert request_id in outcomes[0][2].received and not outcomes[1][2].received  # rank 1's did not count
    united = _united(request_id, outcomes)
    assert (united.finished_recving, united.failed_recving) == ({request_id}, {request_id})
    assert united.kv_connector_worker_meta.verified == {request_id: 1}  # not every rank: unchecked
    [(code, _)] = united.kv_connector_worker_meta.load_failures.values()
    assert code == ChecksumMismatch.code
