"""The decode half of a worker rank: where a request waits for its prompt's KV.

Push: the transfer thread counts the producers' notifications; the registration is
sent again until prefill answers (it may have been lost). Pull: a READ of the
prefill's blocks is posted as soon as vLLM allocated ours; its completion is the
arrival. ``get_finished`` reports the requests whose wait ended.

Faults. Decode watches the blocks it registered (``KvWaits``): when it gives them up
(the request was aborted, the KV is overdue) it revokes the transfer, sends the Revoke
again until prefill answers that no write of its can land, keeps the blocks until then,
and has the scheduler side stop renewing prefill's lease. A load that will not come is
reported to vLLM as failed, and vLLM's ``kv_load_failure_policy`` recomputes the prompt
locally or fails the request.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

from opentelemetry import trace

from connector import kv_layout
from connector.agents import AgentDirectory
from connector.bridge import NatsBridge
from connector.completion import CompletionCounter, notification
from connector.kv_wait import KvWaits, Released, Waiting
from connector.metadata import KvpushMetadata, PullRead
from connector.outcomes import record_transfer, report_failure
from connector.transfer_thread import TransferJob, TransferResult, TransferThread
from otel import attributes as A
from otel.messaging import context_from_traceparent
from shared import wire
from shared.errors import ReadFailed

log = logging.getLogger("kvpush.connector")
_tracer = trace.get_tracer("kvpush.connector")

RESEND_S = 1.0  # a registration goes to prefill again this often until prefill answers (it may be lost)


@dataclass(frozen=True, slots=True)
class _WaitContext:
    span: trace.Span
    notified: bool  # push: arrival is the producers' notification (else our own READ)
    prefill_engine_id: str
    registration: bytes  # push: as published, to send again


class Consumer:
    def __init__(self, engine_id: str, rank: int, tp_size: int, bridge: NatsBridge, agents: AgentDirectory,
                 kv_wait_s: float, quarantine_s: float):
        self.engine_id = engine_id
        self.rank = rank
        self.tp_size = tp_size
        self.bridge = bridge
        self.agents = agents
        self.transfer: TransferThread | None = None
        self._wake: Callable[[], None] = lambda: None
        self._waits = KvWaits(kv_wait_s=kv_wait_s, quarantine_s=quarantine_s)
        self._counter = CompletionCounter()  # the producers' WRITE notifications
        self._lock = threading.Lock()  # protects _released and _given_up
        self._released: list[Released] = []  # waits ended on the clock, for the next get_finished
        self._given_up: set[str] = set()  # requests whose wait we gave up, for the scheduler side

    def attach(self, transfer: TransferThread, wake: Callable[[], None]) -> None:
        """The rank's transfer thread, and what to call when a wait ends."""
        self.transfer = transfer
        self._wake = wake

    def subscriptions(self):
        """(subject, message kind, handler) for the worker to subscribe."""
        return [(wire.completion_subject(self.engine_id), wire.Completion, self.on_completion)]

    # ---------------------------------------------------------------- vLLM's worker thread

    def start_load_kv(self, meta: KvpushMetadata) -> None:
        for expected in meta.expected:
            self._await_kv(expected.request_id, expected.transfer_id, expected.traceparent, True,
                           expected.prefill_engine_id, expected.registration)
        for read in meta.reads:
            self._await_kv(read.request_id, read.transfer_id, read.traceparent, False, read.prefill_engine_id, b"")
            self.agents.with_agent(
                read.prefill_engine_id,
                lambda remote, why, read=read: self._submit_read(read, remote) if remote else self._read_failed(
                    read, why),
            )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """(requests whose wait ended, those of them whose KV will not come)."""
        now = time.monotonic()
        if finished_req_ids:
            self._revoke(self._waits.requests_finished(finished_req_ids, now))
        to_revoke, released = self._waits.tick(now)
        self._revoke(to_revoke)
        with self._lock:
            released += self._released
            self._released = []
        receiving: set[str] = set()
        failed: set[str] = set()
        for ended in released:
            span = ended.context.span
            if ended.context.notified:
                self.transfer.expect(-1)
            if not ended.arrived:
                self._counter.forget(ended.transfer_id)  # a late notification for it is then ignored
                span.set_attribute(A.ERROR_CODE, "aborted" if ended.request_finished else "kv_failed")
                log.warning("gave up the KV of %s: %s", ended.transfer_id, ended.reason)
            span.end(end_time=ended.arrived_at)
            receiving.add(ended.request_id)  # finished (aborted) ones too: vLLM frees their blocks now
            if ended.failed:
                failed.add(ended.request_id)
        return receiving, failed

    def take_given_up(self) -> set[str]:
        """Requests whose wait was given up since the last call: their leases at prefill
        must not be renewed any more (the Revoke may be lost; the lease then runs out)."""
        with self._lock:
            given_up, self._given_up = self._given_up, set()
        return given_up

    def busy(self) -> bool:
        """A request waits for its KV."""
        return bool(self._waits.waiting())

    # ---------------------------------------------------------------- the clock

    def tick(self, now: float) -> None:
        to_revoke, released = self._waits.tick(now)
        self._revoke(to_revoke)
        for wait in self._waits.due_for_resend(now, RESEND_S):
            context: _WaitContext = wait.context
            if context.registration:  # prefill refuses a copy it already has; a lost one is replaced
                self.bridge.publish(wire.registration_subject(context.prefill_engine_id), context.registration)
        self._send_revokes(self._waits.revokes_due(now, RESEND_S))  # until prefill answers: one may be lost
        if released:
            with self._lock:
                self._released.extend(released)
            self._wake()

    # ---------------------------------------------------------------- the transfer thread

    def write_notified(self, transfer_id: str, rank: int, num_ranks: int) -> None:
        """A producer rank's WRITE notification: once every rank's came, the KV is here."""
        if not self._counter.record(transfer_id, rank, num_ranks):
            return
        self._counter.take_done([transfer_id])  # leaves a tombstone against late duplicates
        self._kv_arrived(transfer_id)

    # ---------------------------------------------------------------- NATS

    def on_completion(self, event: wire.Completion) -> None:
        if isinstance(event, wire.TransferFailed) and event.prefill_engine_id != self.engine_id:
            self._waits.prefill_gave_up(event.transfer_id, f"{event.code}: {event.reason}")
            self._wake()

    # ---------------------------------------------------------------- waits and reads

    def _await_kv(self, request_id: str, transfer_id: str, traceparent: str, notified: bool,
                  prefill_engine_id: str, registration: bytes) -> None:
        span = _tracer.start_span(
            A.KV_WAIT,
            context=context_from_traceparent(traceparent),
            attributes={A.TRANSFER_ID: transfer_id, A.WORKER_ID: self.engine_id},
        )
        if notified:
            self.transfer.expect(1)  # poll eagerly for the producers' notifications
        self._waits.start(request_id, transfer_id, time.monotonic(),
                          _WaitContext(span, notified, prefill_engine_id, registration))

    def _submit_read(self, read: PullRead, remote: wire.AgentInfo) -> None:
        problem = kv_layout.copy_problem(self.transfer.layout, remote, read.local_block_ids, read.remote_block_ids)
        if problem is not None:
            self._read_failed(read, problem)
            return

        def on_done(result: TransferResult) -> None:
            if not result.ok:
                self._read_failed(read, result.error)
                return
            record_transfer(result)
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
        error = ReadFailed(why)
        self._waits.prefill_gave_up(read.transfer_id, f"{error.code}: {why}")  # nothing of ours is in flight
        self._wake()
        report_failure(self.bridge, self.engine_id, self.rank, read.transfer_id, self.engine_id, error)

    def _kv_arrived(self, transfer_id: str) -> None:
        """All of a transfer's KV is in our blocks (any thread)."""
        self._waits.arrived(transfer_id, time.time_ns())
        self._wake()

    def _revoke(self, waits: list[Waiting]) -> None:
        if waits:
            with self._lock:
                self._given_up.update(wait.request_id for wait in waits)
        self._send_revokes(waits)

    def _send_revokes(self, waits: list[Waiting]) -> None:
        for wait in waits:
            prefill_engine_id = wait.context.prefill_engine_id
            if not prefill_engine_id:
                continue
            self.bridge.publish(
                wire.registration_subject(prefill_engine_id),
                wire.encode(wire.Revoke(transfer_id=wait.transfer_id, decode_engine_id=self.engine_id,
                                        reason=wait.given_up or "")),
            )
