"""The connector's worker side: runs in each vLLM worker (one per TP rank).

Prefill: a finished prefill (from this step's metadata, after the forward pass)
and a decode registration (from NATS) meet in the rendezvous; the match becomes a
WRITE job for the transfer thread. Decode: the transfer thread counts producer
notifications; ``get_finished`` reports requests whose KV has fully arrived.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import msgspec
from opentelemetry import trace

from connector import kv_layout
from connector.bridge import NatsBridge
from connector.completion import CompletionCounter, notification, parse_notification
from connector.metadata import KvpushMetadata, ReadyPrefill
from connector.rendezvous import Match, Rendezvous
from connector.transfer_thread import TransferThread, WriteJob, WriteResult
from otel import attributes as A
from otel.messaging import context_from_traceparent
from otel.metrics import instruments
from shared import wire

log = logging.getLogger("kvpush.connector")
_tracer = trace.get_tracer("kvpush.connector")


@dataclass(slots=True)
class _AwaitedKv:
    request_id: str
    span: trace.Span
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
        self._lock = threading.Lock()  # protects the sets below
        self._writes_done: set[str] = set()  # prefill request ids whose WRITE ended
        self._finished: set[str] = set()  # prefill request ids vLLM reported finished
        self._pushing: set[str] = set()  # prefill request ids handed to the rendezvous
        self._counter = CompletionCounter()
        self._awaiting_kv: dict[str, _AwaitedKv] = {}  # decode: transfer id -> request awaiting it

    # ---------------------------------------------------------------- setup

    def register_kv_caches(self, kv_caches, num_blocks: int) -> None:
        layout = kv_layout.describe(kv_caches, num_blocks)
        self.transfer = TransferThread(
            self.engine_id,
            self.rank,
            layout,
            on_notification=None if self.is_producer else self._on_notification,
        )
        self.transfer.start()
        info = wire.encode(self.transfer.agent_info())
        self.bridge.subscribe(
            wire.agent_subject(self.engine_id, self.rank), lambda _: info, template="kvpush.kv.agent.{engine_id}.{rank}"
        )
        if self.is_producer:
            self.bridge.subscribe(wire.AGENTS_SUBJECT, self._on_agent_announced)
            self.bridge.subscribe(
                wire.registration_subject(self.engine_id), self._on_registration,
                template="kvpush.kv.register.{engine_id}",
            )
        self.bridge.publish(wire.AGENTS_SUBJECT, info)

    def shutdown(self) -> None:
        if self.transfer is not None:
            self.transfer.stop()

    # ---------------------------------------------------------------- prefill side

    def _on_agent_announced(self, data: bytes) -> None:
        try:
            info = wire.decode(data, wire.AgentInfo)
        except msgspec.MsgspecError as exc:
            log.warning("ignored a malformed agent announcement: %s", exc)
            return
        with self._agents_lock:
            self._agents[(info.engine_id, info.rank)] = info

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
            match = self._rendezvous.offer_prefill(ready.transfer_id, ready)
            if match is not None:
                self._start_write(match)

    def _start_write(self, match: Match[wire.Registration, ReadyPrefill]) -> None:
        parent = context_from_traceparent(match.prefill.traceparent)
        now_ns = time.time_ns()
        wait_ms = match.waited_s * 1000
        second = "registration" if match.order == "prefill_first" else "prefill"
        span = _tracer.start_span(
            A.KV_RENDEZVOUS,
            context=parent,
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
        registration = match.registration
        key = (registration.decode_engine_id, self.rank)
        with self._agents_lock:
            remote = self._agents.get(key)
        if remote is not None:
            self._submit(match, remote)
            return
        # First contact with this decode rank: ask for its agent, then write.
        def on_reply(data: bytes | None, error: str | None) -> None:
            if error is not None:
                self._fail_match(match, "agent_unreachable", error)
                return
            try:
                info = wire.decode(data, wire.AgentInfo)
            except msgspec.MsgspecError as exc:
                self._fail_match(match, "bad_agent_info", str(exc))
                return
            with self._agents_lock:
                self._agents[key] = info
            self._submit(match, info)

        self.bridge.request_async(
            wire.agent_subject(*key), b"", 5.0, on_reply, template="kvpush.kv.agent.{engine_id}.{rank}"
        )

    def _submit(self, match: Match[wire.Registration, ReadyPrefill], remote: wire.AgentInfo) -> None:
        registration, ready = match.registration, match.prefill
        problem = kv_layout.compatible(self.transfer.layout.regions, remote.regions)
        if problem is None and len(registration.block_ids) != len(ready.block_ids):
            problem = (f"decode registered {len(registration.block_ids)} blocks, "
                       f"the prompt has {len(ready.block_ids)}")
        if problem is None and any(not 0 <= b < remote.num_blocks for b in registration.block_ids):
            problem = f"block ids outside 0..{remote.num_blocks - 1}"
        if problem is not None:
            self._fail_match(match, "bad_registration", problem)
            return
        started = time.perf_counter()

        def on_done(result: WriteResult) -> None:
            with self._lock:
                self._writes_done.add(ready.request_id)
            if not result.ok:
                self._fail(match.transfer_id, registration.decode_engine_id, "write_failed", result.error)
                return
            metrics = instruments()
            metrics.transfer_bytes.record(result.bytes)
            metrics.transfer_duration.record(result.write_ms)
            metrics.descriptors.record(result.descriptors)
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
            WriteJob(
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
            self._writes_done.add(match.prefill.request_id)  # nothing in flight: free the blocks
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
            span = _tracer.start_span(
                A.KV_WAIT,
                context=context_from_traceparent(expected.traceparent),
                attributes={A.TRANSFER_ID: expected.transfer_id, A.WORKER_ID: self.engine_id},
            )
            self._awaiting_kv[expected.transfer_id] = _AwaitedKv(expected.request_id, span)
            self.transfer.expect(1)

    def _on_notification(self, message: bytes) -> None:
        transfer_id, rank, num_ranks = parse_notification(message)
        if self._counter.record(transfer_id, rank, num_ranks):
            awaited = self._awaiting_kv.get(transfer_id)
            if awaited is not None:
                awaited.arrived_ns = time.time_ns()

    # ---------------------------------------------------------------- both

    def get_finished(self, finished_req_ids: set[str]):
        sending: set[str] = set()
        if self.is_producer:
            with self._lock:
                self._finished |= finished_req_ids & self._pushing
                sending = self._finished & self._writes_done
                self._finished -= sending
                self._writes_done -= sending
                self._pushing -= sending
        receiving: set[str] = set()
        if self._awaiting_kv:
            for transfer_id in self._counter.take_done(list(self._awaiting_kv)):
                awaited = self._awaiting_kv.pop(transfer_id)
                awaited.span.end(end_time=awaited.arrived_ns)
                receiving.add(awaited.request_id)
                self.transfer.expect(-1)
            # Requests that ended while waiting (aborted): stop waiting for their KV.
            for transfer_id, awaited in list(self._awaiting_kv.items()):
                if awaited.request_id in finished_req_ids:
                    del self._awaiting_kv[transfer_id]
                    awaited.span.set_attribute(A.ERROR_CODE, "aborted")
                    awaited.span.end()
                    self._counter.forget(transfer_id)
                    self.transfer.expect(-1)
        return sending or None, receiving or None
