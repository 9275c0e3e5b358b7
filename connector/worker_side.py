"""The connector's worker side: runs in each vLLM worker (one per TP rank).

``ConnectorWorker`` owns what a rank has once, whatever its role: the transfer thread
(the NIXL agent), the NATS subscriptions, the clock that checks leases and overdue KV,
and the idle wait. It holds a ``Producer`` (prefill: ``kvpush.connector.producer``), a
``Consumer`` (decode: ``kvpush.connector.consumer``), or both (vLLM's kv_both), and merges what
they report to vLLM. Peer agents are looked up in ``kvpush.connector.agents``.

At tensor-parallel size N there are N of them, one per rank process, each with its own
agent, registered memory and subscriptions; vLLM's ``KVOutputAggregator`` counts a
request finished (sent or received) only once every rank reported it, and merges what
each rank tells the scheduler side (``KvpushWorkerMeta``).
"""

from __future__ import annotations

import logging
import os
import threading
import time

from kvpush.connector import kv_layout
from kvpush.connector.agents import AgentDirectory
from kvpush.connector.bridge import NatsBridge
from kvpush.connector.completion import parse_notification
from kvpush.connector.consumer import Consumer
from kvpush.connector.engine_wake import WakeClock, WakeListener
from kvpush.connector.metadata import KvpushMetadata, KvpushWorkerMeta
from kvpush.connector.producer import Producer
from kvpush.connector.transfer_thread import TransferThread
from kvpush.shared import chaos, wire

log = logging.getLogger("kvpush.connector")

# On a step with nothing to compute, vLLM's engine loop would spin (stepping every ~1 ms)
# while requests wait for KV or blocks wait to be sent, taking a core from the other
# engine. get_finished waits for a transfer to end instead: a transfer ending, or the
# worker handing the engine a new request (``engine_wake``), cuts the wait short. Without
# the wake (its address taken), a new request would wait up to the whole wait, so the wait
# is then short.
IDLE_WAIT_S = 0.2
IDLE_WAIT_WITHOUT_WAKE_S = 0.01
CLOCK_TICK_S = 0.2  # how often leases and overdue KV are checked
# At a step's end, while KV is expected, the transfer thread reads peers' notifications
# before the step reports what arrived, waiting this long at most: KV that landed during a
# step makes its request runnable at the next step, not at the next timed poll.
NOTICE_AT_STEP_END_S = 0.005


class ConnectorWorker:
    def __init__(self, engine_id: str, rank: int, bridge: NatsBridge, agents: AgentDirectory,
                 producer: Producer | None = None, consumer: Consumer | None = None, incarnation: str = ""):
        if producer is None and consumer is None:
            raise ValueError("a connector worker needs a producer half, a consumer half, or both")
        self.engine_id = engine_id
        self.incarnation = incarnation
        self.rank = rank
        self.bridge = bridge
        self.agents = agents
        self.producer = producer
        self.consumer = consumer
        self._halves: list[Producer | Consumer] = [half for half in (producer, consumer) if half is not None]
        self.shard = self._halves[0].shard  # the KV heads this rank holds
        self.transfer: TransferThread | None = None
        self._progress = threading.Event()  # set whenever a transfer ends; wakes an idle get_finished
        self._stop = threading.Event()
        self._clock = threading.Thread(target=self._run_clock, name="kvpush-lease-clock", daemon=True)
        self._wake_clock = WakeClock(IDLE_WAIT_WITHOUT_WAKE_S)
        self._wake: WakeListener | None = None

    # ---------------------------------------------------------------- setup

    def register_kv_caches(self, kv_caches, num_blocks: int) -> None:
        layout = kv_layout.describe(kv_caches, num_blocks, heads=self.shard.heads)
        self.transfer = TransferThread(self.engine_id, self.rank, layout, on_notification=self.on_notification,
                                       incarnation=self.incarnation, shard=self.shard)
        self.transfer.start()
        for half in self._halves:
            half.attach(self.transfer, self._progress.set)
        info = wire.encode(self.transfer.agent_info())
        self.bridge.subscribe(wire.agent_subject(self.engine_id, self.rank), lambda data, subject: info)
        self.bridge.subscribe_typed(wire.KV_AGENTS.wildcard, wire.AgentInfo, self.agents.on_announced, self.engine_id)
        for half in self._halves:
            for subject, kind, handler in half.subscriptions():
                self.bridge.subscribe_typed(subject, kind, handler, self.engine_id)
        self.bridge.publish(wire.KV_AGENTS(sender=self.engine_id), info)
        self._clock.start()
        address = wire.engine_wake_address(self.engine_id, self.incarnation, self.rank)
        try:
            self._wake = WakeListener(address, self._on_wake)
            self._wake_clock.long_s = IDLE_WAIT_S
        except OSError as exc:
            log.warning("no engine wake socket (%s): idle steps wait at most %.0f ms", exc,
                        IDLE_WAIT_WITHOUT_WAKE_S * 1000)

    def shutdown(self) -> None:
        self._stop.set()
        if self._wake is not None:
            self._wake.close()
        if self.transfer is not None:
            self.transfer.stop()

    # ---------------------------------------------------------------- each step

    def start_load_kv(self, meta: KvpushMetadata) -> None:
        if self.consumer is not None:
            self.consumer.start_load_kv(meta)

    def save_kv_layer(self, layer_name: str, meta: KvpushMetadata) -> None:
        """Inside the forward (vLLM's worker thread): ``layer_name``'s KV is written."""
        if self.producer is not None:
            self.producer.layer_saved(layer_name, meta)

    def wait_for_save(self, meta: KvpushMetadata) -> None:
        if self.producer is not None:
            self.producer.wait_for_save(meta)

    def get_finished(self, finished_req_ids: set[str], idle: bool = False):
        """(prefill requests whose blocks may be freed, decode requests whose wait ended,
        decode requests whose KV will not come)."""
        self._progress.clear()  # set again by any transfer that ends from here on
        if self.transfer is not None and self.transfer.expecting():
            self.transfer.poll_notifications_now(NOTICE_AT_STEP_END_S)
        sending, receiving, failed = self._collect_finished(finished_req_ids)
        if idle and not sending and not receiving and any(half.busy() for half in self._halves):
            chaos.point("worker.idle_wait")  # a test delivers KV only once the step waits
            self._progress.wait(self._wake_clock.wait_s(time.monotonic()))
            more = self._collect_finished(set())
            sending |= more[0]
            receiving |= more[1]
            failed |= more[2]
        return sending, receiving, failed

    def _collect_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        sending: set[str] = set()
        receiving: set[str] = set()
        failed: set[str] = set()
        if self.producer is not None:
            sending = self.producer.get_finished(finished_req_ids)
        if self.consumer is not None:
            receiving, failed = self.consumer.get_finished(finished_req_ids)
        return sending, receiving, failed

    def _on_wake(self) -> None:
        self._wake_clock.woken(time.monotonic())
        self._progress.set()

    def build_worker_meta(self) -> KvpushWorkerMeta | None:
        """What this rank tells the scheduler side after the step (None: nothing)."""
        meta = KvpushWorkerMeta()
        if self.consumer is not None:
            meta.given_up = self.consumer.take_given_up()
            meta.verified = dict.fromkeys(self.consumer.take_verified(), 1)
            meta.load_failures = self.consumer.take_failures()
            meta.received = {request_id: {self.rank: part}
                             for request_id, part in self.consumer.take_received().items()}
        if self.producer is not None:
            meta.pull_digests = {transfer_id: {self.rank: rows}
                                 for transfer_id, rows in self.producer.take_pull_digests().items()}
        return meta if meta.given_up or meta.verified or meta.load_failures or meta.pull_digests or meta.received \
            else None

    # ---------------------------------------------------------------- the transfer thread

    def on_notification(self, message: bytes) -> None:
        """A peer's notification: decode's READ of blocks our producer serves, or else a
        producer's WRITE into blocks our consumer waits on."""
        note = parse_notification(message)
        if self.producer is not None and self.producer.serves(note.transfer_id):
            self.producer.read_notified(note)
        elif self.consumer is not None:
            self.consumer.write_notified(note)

    # ---------------------------------------------------------------- the clock

    def _run_clock(self) -> None:
        parent = os.getppid()
        while not self._stop.wait(CLOCK_TICK_S):
            if os.getppid() != parent:
                # Our worker died (kill -9) and left this engine process behind: it would
                # hold its memory and answer peers for nobody. Go too.
                log.error("the worker process that started this engine is gone; exiting")
                os._exit(1)
            now = time.monotonic()
            for half in self._halves:
                try:
                    half.tick(now)
                except Exception:
                    log.exception("lease clock tick failed")
