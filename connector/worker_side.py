"""The connector's worker side: runs in each vLLM worker (one per TP rank).

Push, prefill: a finished prefill (from this step's metadata, after the forward pass)
and a decode registration (from NATS) meet in the rendezvous; the match becomes a WRITE
for the transfer thread. Push, decode: the transfer thread counts producer
notifications; ``get_finished`` reports requests whose KV has fully arrived.

Pull, decode: a READ of the prefill's blocks is posted as soon as vLLM allocated ours;
its completion is the arrival. Pull, prefill: blocks are freed once decode's READ
notification came.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

import msgspec
from opentelemetry import trace

from connector import kv_layout
from connector.bridge import NatsBridge
from connector.completion import CompletionCounter, notification, parse_notification
from connector.metadata import KvpushMetadata, PullRead, ReadyPrefill
from connector.rendezvous import Match, Rendezvous
from connector.transfer_thread import TransferJob, TransferResult, TransferThread
from otel import attributes as A
from otel.messaging import context_from_traceparent
from otel.metrics import instruments
from shared import wire

log = logging.getLogger("kvpush.connector")
_tracer = trace.get_tracer("kvpush.connector")

# On a step with nothing to compute, vLLM's engine loop would spin (stepping every ~1 ms)
# while requests wait for KV or blocks wait to be sent, taking a core from the other
# engine. get_finished waits up to this long for a transfer to end instead; an arrival
# wakes it at once. A new request reaching an idle engine waits at most this long.
IDLE_WAIT_S = 0.01


@dataclass(slots=True)
class _AwaitedKv:
    request_id: str
    span: trace.Span
    notified: bool  # push: arrival is a peer notification the transfer thread polls for
    arrived_ns: int | None = None


class ConnectorWorker:
    def __init__(self, engine_id: str, rank: int, tp_size: int, is_producer: bool, bridge: NatsBridge):
        self.engine_id = engine_id
        self.rank = rank
        self.tp_size = tp_size
        self.is_producer = is_producer
        self.bridge = bridge
        self.transfer: TransferThread | None = None
        self._rendezvous: Rendezvous[wire.Registration, ReadyPrefill] = Rendezvous()
        self._agents: dict[tuple[str, int], wire.AgentInfo] = {}
        self._agents_lock = threading.Lock()  # protects _agents
        self._lock = threading.Lock()  # protects the sets and dicts below
        self._sent: set[str] = set()  # prefill request ids whose KV left (pushed, or read by decode)
        self._finished: set[str] = set()  # prefill request ids vLLM reported finished
        self._pushing: set[str] = set()  # prefill request ids whose blocks we hold for a transfer
        self._served_reads: dict[str, str] = {}  # prefill, pull: transfer id -> request id
        self._awaiting_kv: dict[str, _AwaitedKv] = {}  # decode: transfer id -> request awaiting it
        self._early_arrivals: dict[str, int] = {}  # decode: KV that arrived before we awaited it
        self._counter = CompletionCounter()
        self._progress = threading.Event()  # set whenever a transfer ends; wakes an idle get_finished

    # ---------------------------------------------------------------- setup

    def register_kv_caches(self, kv_caches, num_blocks: int) -> None:
        layout = kv_layout.describe(kv_caches, num_blocks)
        self.transfer = TransferThread(self.engine_id, self.rank, layout, on_notification=self._on_notification)
        self.transfer.start()
        info = wire.encode(self.transfer.agent_info())
        self.bridge.subscribe(
            wire.agent_subject(self.engine_id, self.rank), lambda _: info, template="kvpush.kv.agent.{engine_id}.{rank}"
        )
        self.bridge.subscribe(wire.AGENTS_SUBJECT, self._on_agent_announced)
        if self.is_producer:
            self.bridge.subscribe(
                wire.registration_subject(self.engine_id), self._on_registration,
                template="kvpush.kv.register.{engine_id}",
            )
        self.bridge.publish(wire.AGENTS_SUBJECT, info)

    def shutdown(self) -> None:
        if self.transfer is not None:
            self.transfer.stop()

    def _on_agent_announced(self, data: bytes) -> None:
        try:
            info = wire.decode(data, wire.AgentInfo)
        except msgspec.MsgspecError as exc:
            log.warning("ignored a malformed agent announcement: %s", exc)
            return
        with self._agents_lock:
            self._agents[(info.engine_id, info.rank)] = info

    def _with_agent(self, engine_id: str, then: Callable[[wire.AgentInfo | None, str], None]) -> None:
        """Call ``then(info, "")`` with the peer rank's agent, asking for it over NATS on
        first contact; ``then(None, why)`` if it cannot be had."""
        key = (engine_id, self.rank)
        with self._agents_lock:
            known = self._agents.get(key)
        if known is not None:
            then(known, "")
            return

        def on_reply(data: bytes | None, error: str | None) -> None:
            if error is not None:
                then(None, error)
                return
            try:
                info = wire.decode(data, wire.AgentInfo)
            except msgspec.MsgspecError as exc:
                then(None, f"bad agent info: {exc}")
                return
            with self._agents_lock:
                self._agents[key] = info
            then(info, "")

        self.bridge.request_async(
            wire.agent_subject(*key), b"", 5.0, on_reply, template="kvpush.kv.agent.{engine_id}.{rank}"
        )

    # ---------------------------------------------------------------- prefill side

    def _on_registration(self, data: bytes) -> None:
        try:
            registration = wire.decode(data, wire.Registration)
        except msgspec.MsgspecError as exc:
            log.warning("ignored a malformed registration: %s", exc)
            return
        if registration.decode_tp_size != self.tp_size:
            self._fail(registration.transfer_id, registration.decode_engine_id, "tp_mismatch",
                       f"decode has TP {registration.decode_tp_size}, prefill has TP {self.tp_size}")
            return
        match = self._rendezvous.offer_registration(registration.transfer_id, registration)
        if match is not None:
            self._start_write(match)

    def wait_for_save(self, meta: KvpushMetadata) -> None:
        """After the forward pass: these prefills' KV is now in their blocks."""
        for ready in meta.ready_prefills:
            with self._lock:
                self._pushing.add(ready.request_id)
            if ready.mode == "pull":
                with self._lock:
                    self._served_reads[ready.transfer_id] = ready.request_id
                self.transfer.expect(1)
                continue
            match = self._rendezvous.offer_prefill(ready.transfer_id, ready)
            if match is not None:
                self._start_write(match)

    def _start_write(self, match: Match[wire.Registration, ReadyPrefill]) -> None:
        now_ns = time.time_ns()
        wait_ms = match.waited_s * 1000
        second = "registration" if match.order == "prefill_first" else "prefill"
        span = _tracer.start_span(
            A.KV_RENDEZVOUS,
            context=context_from_traceparent(match.prefill.traceparent),
            start_time=now_ns - int(match.waited_s * 1e9),
            attributes={
                A.TRANSFER_ID: match.transfer_id,
                A.REQUEST_ID: match.registration.request_id,
                A.WORKER_ID: self.engine_id,
                A.RENDEZVOUS_SECOND: second,
                A.RENDEZVOUS_WAIT_MS: wait_ms,
            },
        )
        span.end(end_time=now_ns)
        instruments().rendezvous_wait.record(wait_ms, {"second": second})
        self._with_agent(
            match.registration.decode_engine_id,
            lambda remote, why: self._submit_write(match, remote) if remote else self._fail_match(
                match, "agent_unreachable", why),
        )

    def _submit_write(self, match: Match[wire.Registration, ReadyPrefill], remote: wire.AgentInfo) -> None:
        registration, ready = match.registration, match.prefill
        problem = _block_problem(self.transfer.layout, remote, ready.block_ids, registration.block_ids)
        if problem is not None:
            self._fail_match(match, "bad_registration", problem)
            return
        started = time.perf_counter()

        def on_done(result: TransferResult) -> None:
            with self._lock:
                self._sent.add(ready.request_id)
            self._progress.set()
            if not result.ok:
                self._fail(match.transfer_id, registration.decode_engine_id, "write_failed", result.error)
                return
            _record_transfer(result)
            self.bridge.publish(
                wire.COMPLETION_SUBJECT,
                wire.encode(
                    wire.TransferDone(
                        transfer_id=match.transfer_id,
                        prefill_engine_id=self.engine_id,
                        decode_engine_id=registration.decode_engine_id,
                        rank=self.rank,
                        order=match.order,
                        waited_ms=match.waited_s * 1000,
                        bytes=result.bytes,
                        descriptors=result.descriptors,
                        write_ms=(time.perf_counter() - started) * 1000,
                        finished_at=time.time(),
                    )
                ),
            )

        self.transfer.submit(
            TransferJob(
                "WRITE",
                match.transfer_id,
                remote,
                ready.block_ids,
                registration.block_ids,
                notification(match.transfer_id, self.rank, self.tp_size),
                on_done,
                parent=context_from_traceparent(ready.traceparent),
            )
        )

    def _fail_match(self, match, code: str, reason: str) -> None:
        with self._lock:
            self._sent.add(match.prefill.request_id)  # nothing in flight: free the blocks
        self._progress.set()
        self._fail(match.transfer_id, match.registration.decode_engine_id, code, reason)

    def _fail(self, transfer_id: str, decode_engine_id: str, code: str, reason: str) -> None:
        log.warning("transfer %s failed (%s): %s", transfer_id, code, reason)
        instruments().failures.add(1, {"reason": code})
        self.bridge.publish(
            wire.COMPLETION_SUBJECT,
            wire.encode(
                wire.TransferFailed(
                    transfer_id=transfer_id,
                    prefill_engine_id=self.engine_id,
                    decode_engine_id=decode_engine_id,
                    rank=self.rank,
                    code=code,
                    reason=reason,
                )
            ),
        )

    # ---------------------------------------------------------------- decode side

    def start_load_kv(self, meta: KvpushMetadata) -> None:
        for expected in meta.expected:
            self._await_kv(expected.request_id, expected.transfer_id, expected.traceparent, notified=True)
        for read in meta.reads:
            self._await_kv(read.request_id, read.transfer_id, read.traceparent, notified=False)
            self._with_agent(
                read.prefill_engine_id,
                lambda remote, why, read=read: self._submit_read(read, remote) if remote else self._read_failed(
                    read, why),
            )

    def _await_kv(self, request_id: str, transfer_id: str, traceparent: str, notified: bool) -> None:
        span = _tracer.start_span(
            A.KV_WAIT,
            context=context_from_traceparent(traceparent),
            attributes={A.TRANSFER_ID: transfer_id, A.WORKER_ID: self.engine_id},
        )
        with self._lock:
            awaited = self._awaiting_kv[transfer_id] = _AwaitedKv(request_id, span, notified)
            awaited.arrived_ns = self._early_arrivals.pop(transfer_id, None)
        if notified and awaited.arrived_ns is None:
            self.transfer.expect(1)

    def _submit_read(self, read: PullRead, remote: wire.AgentInfo) -> None:
        problem = _block_problem(self.transfer.layout, remote, read.remote_block_ids, read.local_block_ids)
        if problem is not None:
            self._read_failed(read, problem)
            return

        def on_done(result: TransferResult) -> None:
            if not result.ok:
                self._read_failed(read, result.error)
                return
            _record_transfer(result)
            self._kv_arrived(read.transfer_id)

        self.transfer.submit(
            TransferJob(
                "READ",
                read.transfer_id,
                remote,
                read.local_block_ids,
                read.remote_block_ids,
                notification(read.transfer_id, self.rank, self.tp_size),
                on_done,
                parent=context_from_traceparent(read.traceparent),
            )
        )

    def _read_failed(self, read: PullRead, why: str) -> None:
        # Surfacing load failures to vLLM (recompute or fail the request) is the fault-handling
        # issue's work; until then the request keeps waiting and the failure is reported.
        self._fail(read.transfer_id, self.engine_id, "read_failed", why)

    def _on_notification(self, message: bytes) -> None:
        transfer_id, rank, num_ranks = parse_notification(message)
        if not self._counter.record(transfer_id, rank, num_ranks):
            return
        self._counter.take_done([transfer_id])  # leaves a tombstone against late duplicates
        with self._lock:
            request_id = self._served_reads.pop(transfer_id, None)
            if request_id is not None:  # pull: decode has read our blocks
                self._sent.add(request_id)
        if request_id is not None:
            self.transfer.expect(-1)
            self._progress.set()
        else:
            self._kv_arrived(transfer_id)

    def _kv_arrived(self, transfer_id: str) -> None:
        """All of a transfer's KV is in our blocks (any thread)."""
        with self._lock:
            awaited = self._awaiting_kv.get(transfer_id)
            if awaited is None:
                self._early_arrivals[transfer_id] = time.time_ns()
                return
            awaited.arrived_ns = time.time_ns()
        self._progress.set()
        if awaited.notified:
            self.transfer.expect(-1)

    # ---------------------------------------------------------------- both

    def get_finished(self, finished_req_ids: set[str], idle: bool = False):
        self._progress.clear()  # set again by any transfer that ends from here on
        sending, receiving = self._collect_finished(finished_req_ids)
        if idle and not sending and not receiving and self._waiting_on_transfers():
            self._progress.wait(IDLE_WAIT_S)
            more_sending, more_receiving = self._collect_finished(set())
            sending |= more_sending
            receiving |= more_receiving
        return sending or None, receiving or None

    def _waiting_on_transfers(self) -> bool:
        with self._lock:
            return bool(self._awaiting_kv or self._pushing)

    def _collect_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        sending: set[str] = set()
        if self.is_producer:
            with self._lock:
                self._finished |= finished_req_ids & self._pushing
                sending = self._finished & self._sent
                self._finished -= sending
                self._sent -= sending
                self._pushing -= sending
        receiving: set[str] = set()
        ended: list[tuple[str, _AwaitedKv]] = []
        with self._lock:
            for transfer_id, awaited in list(self._awaiting_kv.items()):
                if awaited.arrived_ns is not None:
                    del self._awaiting_kv[transfer_id]
                    awaited.span.end(end_time=awaited.arrived_ns)
                    receiving.add(awaited.request_id)
                elif awaited.request_id in finished_req_ids:
                    del self._awaiting_kv[transfer_id]
                    ended.append((transfer_id, awaited))
        for transfer_id, awaited in ended:  # ended while waiting (aborted): stop waiting for its KV
            self._counter.forget(transfer_id)  # a late notification for it is then ignored
            awaited.span.set_attribute(A.ERROR_CODE, "aborted")
            awaited.span.end()
            if awaited.notified:
                self.transfer.expect(-1)
        return sending, receiving


def _block_problem(layout, remote: wire.AgentInfo, local_blocks: list[int], remote_blocks: list[int]) -> str | None:
    """Why these blocks cannot be copied between us and ``remote``, or None."""
    problem = kv_layout.compatible(layout.regions, remote.regions)
    if problem is None and len(local_blocks) != len(remote_blocks):
        problem = f"{len(remote_blocks)} remote blocks for {len(local_blocks)} local ones"
    if problem is None and any(not 0 <= b < remote.num_blocks for b in remote_blocks):
        problem = f"remote block ids outside 0..{remote.num_blocks - 1}"
    if problem is None and any(not 0 <= b < layout.num_blocks for b in local_blocks):
        problem = f"local block ids outside 0..{layout.num_blocks - 1}"
    return problem


def _record_transfer(result: TransferResult) -> None:
    metrics = instruments()
    metrics.transfer_bytes.record(result.bytes)
    metrics.transfer_duration.record(result.write_ms)
    metrics.descriptors.record(result.descriptors)
