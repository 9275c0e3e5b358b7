"""A prefix fetched from the engine that holds it in its prefix cache (``wire.Fetch``), over
a real NATS server and real NIXL agents: the holder lends its blocks as a pull-held
prompt (``kvpush.services.worker.lending``); the reader, in a process of its own, READs
them through its scheduler side (as vLLM drives it) into the blocks after its own cached
prefix, and renews the holder's lease meanwhile.

The races are made certain with a hold point on the reader's transfer thread, before its
READ is posted (``transfer.posting.READ``): while the READ waits there, the holder is
asked every step to free the lend's blocks (vLLM's ``get_finished``, which is what lets
it evict and reuse them) and must not; a reader killed there stops renewing, and the
holder's blocks come back within its lease.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import signal
import time
from pathlib import Path
from types import SimpleNamespace

from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock

from kvpush.connector.agents import AgentDirectory
from kvpush.connector.bridge import NatsBridge
from kvpush.connector.consumer import Consumer
from kvpush.connector.metadata import KvpushMetadata, ReadyPrefill
from kvpush.connector.producer import Producer
from kvpush.connector.scheduler_side import ConnectorScheduler
from kvpush.connector.worker_side import ConnectorWorker
from kvpush.shared import chaos, wire
from kvpush.shared.errors import LeaseExpired
from tests.nats.test_connector_worker import (BLOCK_SIZE, NUM_BLOCKS, WAIT_S, _assert_copied, _id, _key, _kv_caches,
                                              _producer, _until)

READ_POINT = "transfer.posting.READ"
LEASE_S = 1.0


def _reader_side(conn, url: str, engine_id: str) -> None:
    """A prefill (or any engine) that fetches a prefix: its scheduler side asks for the
    prefix's tokens beyond its own cache, and its worker side READs them."""
    bridge = NatsBridge(url, name=engine_id)
    bridge.start()
    caches = _kv_caches(0.0)
    agents = AgentDirectory(bridge, 0, engine_id)
    consumer = Consumer(engine_id, 0, 1, bridge, agents, kv_wait_s=WAIT_S, quarantine_s=5.0)
    producer = Producer(engine_id, 0, 1, bridge, agents, lease_s=WAIT_S)
    worker = ConnectorWorker(engine_id, 0, bridge, agents, producer=producer, consumer=consumer)
    worker.register_kv_caches(caches, NUM_BLOCKS)
    scheduler = ConnectorScheduler(engine_id, BLOCK_SIZE, 1, bridge, renew_every_s=0.2)
    conn.send("ready")
    while (command := conn.recv()) is not None:
        fetch, prompt_tokens, block_ids, cached_ids = command
        num_cached = len(cached_ids) * BLOCK_SIZE
        request = SimpleNamespace(request_id=_id("fetching"), prompt_token_ids=list(range(prompt_tokens)),
                                  kv_transfer_params={wire.FETCH_KEY: fetch})
        scheduler.on_new_request(request)
        external = fetch["tokens"] - num_cached
        assert scheduler.get_num_new_matched_tokens(request, num_cached) == (external, True)
        blocks = KVCacheBlocks(([KVCacheBlock(b, ref_cnt=2, _block_hash=b"cached%d" % b) for b in cached_ids]
                                + [KVCacheBlock(b, ref_cnt=1) for b in block_ids],))
        scheduler.update_state_after_alloc(request, blocks, external)
        worker.start_load_kv(scheduler.build_connector_meta(
            SimpleNamespace(total_num_scheduled_tokens=0, num_scheduled_tokens={})))
        received: set[str] = set()
        deadline = time.monotonic() + WAIT_S
        while request.request_id not in received and time.monotonic() < deadline:
            received |= worker.get_finished(set(), idle=True)[1]
        scheduler.update_connector_output(SimpleNamespace(finished_recving=received, finished_sending=None))
        _, said = scheduler.request_finished(request, block_ids)
        conn.send((request.request_id in received, said,
                   {name: t[block_ids].clone().numpy().tolist() for name, t in caches.items()}))
    worker.shutdown()
    bridge.close()


@contextlib.contextmanager
def _reader(url: str, hold_file: Path):
    engine_id = _id("reader")
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    os.environ["KVPUSH_HOLD_FILE"] = str(hold_file)  # the child reads it at import
    try:
        proc = ctx.Process(target=_reader_side, args=(child, url, engine_id))
        proc.start()
    finally:
        del os.environ["KVPUSH_HOLD_FILE"]
    try:
        assert parent.poll(120), "the reader did not start"
        assert parent.recv() == "ready"
        yield SimpleNamespace(engine_id=engine_id, conn=parent, proc=proc)
        if proc.is_alive():
            parent.send(None)
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()


def _lend(worker: ConnectorWorker, lend_request: str, prefix_blocks: list[int], extra_block: int, key: str) -> str:
    """The holder's engine ran the lend (the prefix and one token more) and its connector
    holds the blocks for a READ, as for a pull-mode prefill."""
    transfer = _id("lend")
    blocks = prefix_blocks + [extra_block]
    worker.wait_for_save(KvpushMetadata(ready_prefills=[
        ReadyPrefill(lend_request, transfer, blocks, mode="pull", num_tokens=len(prefix_blocks) * BLOCK_SIZE + 1,
                     transfer_key=key)]))
    return transfer


def _fetch(transfer: str, holder_id: str, key: str, prefix_blocks: list[int], extra_block: int) -> dict:
    """The reader's request params, as the worker makes them from the scheduler's Fetch."""
    read = wire.DecodeKvParams(transfer_id=transfer, request_id="conversation", prefill_engine_id=holder_id,
                               mode="pull", remote_block_ids=prefix_blocks + [extra_block], transfer_key=key)
    return {**read.as_params(), "tokens": len(prefix_blocks) * BLOCK_SIZE}


def _reached(hold_file: Path, point: str) -> bool:
    try:
        return point in Path(chaos.reached_file(str(hold_file))).read_text().split()
    except OSError:
        return False


def test_a_fetched_prefix_lands_after_the_readers_own_blocks_and_frees_the_lenders_after_the_read(
        nats_server, tmp_path):
    """The holder lent 5 blocks (and the lend's extra one); the reader holds the first 2
    itself and READs the other 3, no more; the holder's blocks are free once read."""
    holder_id = _id("holder")
    bridge = NatsBridge(nats_server.url, name=holder_id)
    bridge.start()
    holder = _producer(bridge, holder_id, lease_s=LEASE_S)
    try:
        with _reader(nats_server.url, tmp_path / "holds") as reader:
            key = _key()
            prefix, extra = [0, 1, 2, 7, 8], 9
            transfer = _lend(holder, "lend-ok", prefix, extra, key)
            reader.conn.send((_fetch(transfer, holder_id, key, prefix, extra), 8 * BLOCK_SIZE, [5, 6, 11], [13, 14]))
            assert reader.conn.poll(WAIT_S + 10)
            arrived, said, blocks = reader.conn.recv()
            assert arrived
            _assert_copied(blocks, prefix[2:])  # the reader's own 2 blocks were not read again
            fetched = wire.FetchedKv.of(said[wire.FETCHED_KEY])
            assert (fetched.tokens, fetched.blocks, fetched.holder_engine_id, fetched.failure) == (
                3 * BLOCK_SIZE, 3, holder_id, "")
            assert _until(lambda: holder.get_finished({"lend-ok"}, idle=True)[0], "the lend's blocks freed") == {
                "lend-ok"}
    finally:
        holder.shutdown()
        bridge.close()


def test_eviction_racing_the_read_the_lenders_blocks_stay_held_until_the_read_lands(nats_server, tmp_path):
    """The reader's READ is held before it is posted for three leases' time: every step the
    holder's engine asks to free the lend's blocks (to evict or reuse them), and the
    connector keeps them, since the reader renews its lease. Let go, the READ copies the
    holder's blocks as they were, and only then are they freed."""
    holder_id = _id("holder")
    bridge = NatsBridge(nats_server.url, name=holder_id)
    bridge.start()
    failures: queue.Queue = queue.Queue()
    holder = _producer(bridge, holder_id, lease_s=LEASE_S)
    hold_file = tmp_path / "holds"
    hold_file.write_text(f"{READ_POINT}\n")
    try:
        with _reader(nats_server.url, hold_file) as reader:
            for reader_id in (reader.engine_id, "unknown"):  # a pull-held prompt does not know its reader
                bridge.subscribe_typed(wire.completion_subject(reader_id, holder_id), wire.Completion,
                                       failures.put, "test")
            key = _key()
            prefix, extra = [3, 4, 10], 12
            transfer = _lend(holder, "lend-held", prefix, extra, key)
            reader.conn.send((_fetch(transfer, holder_id, key, prefix, extra), 4 * BLOCK_SIZE, [1, 2, 3], []))
            _until(lambda: _reached(hold_file, READ_POINT), "the reader's READ held")
            held_until = time.monotonic() + 3 * LEASE_S
            while time.monotonic() < held_until:  # vLLM asks each step: may the lend's blocks go back?
                assert holder.get_finished({"lend-held"}, idle=True)[0] == set(), "freed under a held READ"
                time.sleep(0.05)
            assert failures.empty(), "the holder gave the lend up while its reader renewed it"
            hold_file.write_text("")
            assert reader.conn.poll(WAIT_S + 10)
            arrived, said, blocks = reader.conn.recv()
            assert arrived and wire.FetchedKv.of(said[wire.FETCHED_KEY]).tokens == 3 * BLOCK_SIZE
            _assert_copied(blocks, prefix)
            assert _until(lambda: holder.get_finished({"lend-held"}, idle=True)[0], "the lend's blocks freed") == {
                "lend-held"}
    finally:
        holder.shutdown()
        bridge.close()


def test_a_reader_that_dies_before_its_read_lets_the_lenders_lease_run_out(nats_server, tmp_path):
    """Killed (SIGKILL) with its READ held before posting: it renews no more, so within a
    lease the holder frees the lend's blocks and says why (lease_expired)."""
    holder_id = _id("holder")
    bridge = NatsBridge(nats_server.url, name=holder_id)
    bridge.start()
    failures: queue.Queue = queue.Queue()
    holder = _producer(bridge, holder_id, lease_s=LEASE_S)
    hold_file = tmp_path / "holds"
    hold_file.write_text(f"{READ_POINT}\n")
    try:
        with _reader(nats_server.url, hold_file) as reader:
            for reader_id in (reader.engine_id, "unknown"):  # a pull-held prompt does not know its reader
                bridge.subscribe_typed(wire.completion_subject(reader_id, holder_id), wire.Completion,
                                       failures.put, "test")
            key = _key()
            prefix, extra = [5, 6], 7
            transfer = _lend(holder, "lend-orphaned", prefix, extra, key)
            reader.conn.send((_fetch(transfer, holder_id, key, prefix, extra), 3 * BLOCK_SIZE, [1, 2], []))
            _until(lambda: _reached(hold_file, READ_POINT), "the reader's READ held")
            assert holder.get_finished({"lend-orphaned"}, idle=True)[0] == set()  # renewed so far
            os.kill(reader.proc.pid, signal.SIGKILL)
            killed_at = time.monotonic()
            freed = _until(lambda: holder.get_finished({"lend-orphaned"}, idle=True)[0], "the lend's blocks freed")
            assert freed == {"lend-orphaned"}
            assert time.monotonic() - killed_at <= LEASE_S + 2.0
            failure = failures.get(timeout=5)
            assert (type(failure), failure.transfer_id, failure.code) == (wire.TransferFailed, transfer,
                                                                         LeaseExpired.code)
    finally:
        holder.shutdown()
        bridge.close()
