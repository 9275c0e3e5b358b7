"""The connector's worker side: runs in each vLLM worker (one per TP rank).

Push, prefill: a finished prefill (from this step's metadata, after the forward pass)
and a decode registration (from NATS) meet in the rendezvous; the match becomes a WRITE
for the transfer thread. Push, decode: the transfer thread counts producer
notifications; ``get_finished`` reports requests whose KV has fully arrived.

Pull, decode: a READ of the prefill's blocks is posted as soon as vLLM allocated ours;
its completion is the arrival. Pull, prefill: blocks are freed once decode's READ
notification came.

Faults. Prefill holds a finished prompt's blocks, and a registration waiting for its
prompt, under a lease that decode renews (``LeaseRenewal``); expiry frees the blocks and
tells decode and the schedulers (``lease_expired``). Decode watches the blocks it
registered (``KvWaits``): when it gives them up (the request was aborted, the KV is
overdue) it revokes the transfer and keeps them until prefill answers that no write of
its can land. A load that will not come is reported to vLLM as failed, and vLLM's
``kv_load_failure_policy`` recomputes the prompt locally or fails the request.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable

import msgspec
from opentelemetry import trace

from connector import kv_layout
from connector.bridge import NatsBridge
from connector.completion import CompletionCounter, notification, parse_notification
from connector.kv_wait import KvWaits, Released
from connector.metadata import KvpushMetadata, PullRead, ReadyPrefill
from connector.rendezvous import Match, Refused, Rendezvous
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
CLOCK_TICK_S = 0.2  # how often leases and overdue KV are checked
COMPLETION_TEMPLATE = "kvpush.kv.completion.{engine_id}"
RESEND_S = 1.0  # decode sends a registration again this often until prefill answers (it may be lost)


@dataclass(frozen=True, slots=True)
class _WaitContext:
    span: trace.Span
    notified: bool  # push: arrival is the producers' notification (else our own READ)
    prefill_engine_id: str
    registration: bytes  # push: as published, to send again


def pair_problem(registration: wire.Registration, ready: ReadyPrefill) -> str | None:
    """Why this registration must not receive this prefill's KV, or None."""
    if ready.decode_engine_id and registration.decode_engine_id != ready.decode_engine_id:
        return f"registration from {registration.decode_engine_id}, but the scheduler chose {ready.decode_engine_id}"
    if ready.num_tokens and registration.num_tokens != ready.num_tokens:
        return f"registration for {registration.num_tokens} tokens, the prompt has {ready.num_tokens}"
    if len(registration.block_ids) != len(ready.block_ids):
        return f"registration names {len(registration.block_ids)} blocks, the prompt fills {len(ready.block_ids)}"
    return None




class ConnectorWorker:
    def __init__(self, engine_id: str, rank: int, tp_size: int, is_producer: bool, bridge: NatsBridge,
                 lease_s: float = 10.0, kv_wait_s: float = 120.0, quarantine_s: float = 10.0):
        self.engine_id = engine_id
        self.rank = rank
        self.tp_size = tp_size
        self.is_producer = is_producer
        self.bridge = bridge
        self.transfer: TransferThread | None = None
        self._rendezvous: Rendezvous[wire.Registration, ReadyPrefill] = Rendezvous(lease_s, check=pair_problem)
        self._agents: dict[tuple[str, int], wire.AgentInfo] = {}
        self._agents_lock = threading.Lock()  # protects _agents
        self._lock = threading.Lock()  # protects the sets and dicts below
        self._sent: set[str] = set()  # prefill request ids whose blocks may go back (KV left, or given up)
        self._finished: set[str] = set()  # prefill request ids vLLM reported finished
        self._pushing: set[str] = set()  # prefill request ids whose blocks we hold for a transfer
        self._writing: set[str] = set()  # prefill: transfer ids with a WRITE posted and not yet ended
        self._served_reads: dict[str, list] = {}  # prefill, pull: transfer id -> [request id, lease end]
        self._released: list[Released] = []  # decode: waits ended, for the next get_finished
        self.lease_s = lease_s
        self._waits = KvWaits(kv_wait_s=kv_wait_s, quarantine_s=quarantine_s)
        self._counter = CompletionCounter()
        self._progress = threading.Event()  # set whenever a transfer ends; wakes an idle get_finished
        self._stop = threading.Event()
        self._clock = threading.Thread(target=self._run_clock, name="kvpush-lease-clock", daemon=True)

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
                wire.registration_subject(self.engine_id), self._on_kv_control,
                template="kvpush.kv.register.{engine_id}",
            )
        else:
            self.bridge.subscribe(
                wire.completion_subject(self.engine_id), self._on_completion,
                template=COMPLETION_TEMPLATE,
            )
        self.bridge.publish(wire.AGENTS_SUBJECT, info)
        self._clock.start()

    def shutdown(self) -> None:
        self._stop.set()
        if self.transfer is not None:
            self.transfer.stop()

    def _decoded(self, data: bytes, kind, subject: str):
        """The message as ``kind``; None (said on kvpush.invalid) if it is not one."""
        try:
            return wire.decode(data, kind)
        except msgspec.MsgspecError as exc:
            log.warning("refused a malformed message on %s: %s", subject, exc)
            instruments().failures.add(1, {"reason": "bad_message"})
            self.bridge.publish(wire.INVALID_SUBJECT, wire.encode(
                wire.InvalidMessage(service=self.engine_id, subject=subject, code="bad_message", reason=str(exc))))
            return None

    def _on_agent_announced(self, data: bytes) -> None:
        info = self._decoded(data, wire.AgentInfo, wire.AGENTS_SUBJECT)
        if info is None:
            return
        with self._agents_lock:
            self._agents[(info.engine_id, info.rank)] = info  # a restarted peer replaces its old agent

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

    def _run_clock(self) -> None:
        parent = os.getppid()
        while not self._stop.wait(CLOCK_TICK_S):
            if os.getppid() != parent:
                # Our worker died (kill -9) and left this engine process behind: it would
                # hold its memory and answer peers for nobody. Go too.
                log.error("the worker process that started this engine is gone; exiting")
                os._exit(1)
            try:
                self._tick(time.monotonic())
            except Exception:
                log.exception("lease clock tick failed")

    def _tick(self, now: float) -> None:
        if self.is_producer:
            for transfer_id, half in self._rendezvous.expired():
                ready = half.prefill
                decode_engine_id = half.registration.decode_engine_id if half.registration else (
                    ready.decode_engine_id if ready else "")
                if ready is not None:
                    self._give_back(ready.request_id)
                self._fail(transfer_id, decode_engine_id, "lease_expired",
                           f"decode did not renew the lease within {self.lease_s:g} s")
            with self._lock:
                lapsed = [(tid, entry[0]) for tid, entry in self._served_reads.items() if entry[1] <= now]
                for transfer_id, _ in lapsed:
                    del self._served_reads[transfer_id]
            for transfer_id, request_id in lapsed:
                self.transfer.expect(-1)
                self._give_back(request_id)
                self._fail(transfer_id, "", "lease_expired", "decode did not read the KV within its lease")
            return
        to_revoke, released = self._waits.tick(now)
        self._revoke(to_revoke)
        for wait in self._waits.due_for_resend(now, RESEND_S):
            context: _WaitContext = wait.context
            if context.registration:  # prefill refuses a copy it already has; a lost one is replaced
                self.bridge.publish(wire.registration_subject(context.prefill_engine_id), context.registration,
                                    template="kvpush.kv.register.{engine_id}")
        if released:
            with self._lock:
                self._released.extend(released)
            self._progress.set()

    def _give_back(self, request_id: str) -> None:
        """A prefill's blocks hold nothing decode will take: let vLLM free them."""
        with self._lock:
            self._sent.add(request_id)
        self._progress.set()

    # ---------------------------------------------------------------- prefill side

    def _on_kv_control(self, data: bytes) -> None:
        message = self._decoded(data, wire.KvControl, wire.registration_subject(self.engine_id))
        match message:
            case wire.LeaseRenewal():
                for transfer_id in message.transfer_ids:
                    if not self._rendezvous.renew(transfer_id):
                        self._renew_read(transfer_id)
            case wire.Revoke():
                self._on_revoke(message)
            case wire.Registration():
                self._on_registration(message)

    def _on_registration(self, registration: wire.Registration) -> None:
        if registration.decode_tp_size != self.tp_size:
            self._fail(registration.transfer_id, registration.decode_engine_id, "tp_mismatch",
                       f"decode has TP {registration.decode_tp_size}, prefill has TP {self.tp_size}")
            return
        self._settle(self._rendezvous.offer_registration(registration.transfer_id, registration))

    def _settle(self, outcome: Match | Refused | None, ready: ReadyPrefill | None = None) -> None:
        """Act on what the rendezvous said about a half just offered."""
        if isinstance(outcome, Match):
            self._start_write(outcome)
            return
        if not isinstance(outcome, Refused) or outcome.code == "duplicate":
            return
        if outcome.registration is not None:
            code = "bad_registration" if outcome.code == "incompatible" else "transfer_closed"
            self._fail(outcome.transfer_id, outcome.registration.decode_engine_id, code, outcome.reason)
        if ready is not None and outcome.code == "closed":
            self._give_back(ready.request_id)  # decode gave this transfer up before the prompt was done

    def _on_revoke(self, revoke: wire.Revoke) -> None:
        half, matched = self._rendezvous.close(revoke.transfer_id, "revoked")
        if half is not None and half.prefill is not None:
            self._give_back(half.prefill.request_id)
        with self._lock:
            writing = revoke.transfer_id in self._writing
            served = self._served_reads.pop(revoke.transfer_id, None)
        if served is not None:
            self.transfer.expect(-1)
            self._give_back(served[0])
        if writing:
            return  # the write's own completion event answers, once nothing more can land
        self._fail(revoke.transfer_id, revoke.decode_engine_id, "revoked",
                   "decode gave the transfer up" + (" after it was written" if matched else "; nothing was written"))

    def _renew_read(self, transfer_id: str) -> None:
        with self._lock:
            entry = self._served_reads.get(transfer_id)
            if entry is not None:
                entry[1] = time.monotonic() + self.lease_s

    def wait_for_save(self, meta: KvpushMetadata) -> None:
        """After the forward pass: these prefills' KV is now in their blocks."""
        for ready in meta.ready_prefills:
            with self._lock:
                self._pushing.add(ready.request_id)
            if ready.mode == "pull":
                with self._lock:
                    self._served_reads[ready.transfer_id] = [ready.request_id, time.monotonic() + self.lease_s]
                self.transfer.expect(1)
                continue
            self._settle(self._rendezvous.offer_prefill(ready.transfer_id, ready), ready)

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
        with self._lock:
            self._writing.add(match.transfer_id)
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
                self._writing.discard(match.transfer_id)
            self._progress.set()
            if not result.ok:
                self._rendezvous.close(match.transfer_id, "failed")
                self._fail(match.transfer_id, registration.decode_engine_id, "write_failed", result.error)
                return
            _record_transfer(result)
            self.bridge.publish(
                wire.completion_subject(registration.decode_engine_id),
                template=COMPLETION_TEMPLATE,
                data=wire.encode(
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
        self._rendezvous.close(match.transfer_id, "failed")  # a copy of the registration sent again gets the answer
        with self._lock:
            self._writing.discard(match.transfer_id)
        self._give_back(match.prefill.request_id)  # nothing in flight: free the blocks
        self._fail(match.transfer_id, match.registration.decode_engine_id, code, reason)

    def _fail(self, transfer_id: str, decode_engine_id: str, code: str, reason: str) -> None:
        """Tell decode (and the schedulers) that no write of ours will land for this transfer."""
        log.warning("transfer %s failed (%s): %s", transfer_id, code, reason)
        instruments().failures.add(1, {"reason": code})
        self.bridge.publish(
            wire.completion_subject(decode_engine_id or "unknown"),
            template=COMPLETION_TEMPLATE,
            data=wire.encode(
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
            self._await_kv(expected.request_id, expected.transfer_id, expected.traceparent, True,
                           expected.prefill_engine_id, expected.registration)
        for read in meta.reads:
            self._await_kv(read.request_id, read.transfer_id, read.traceparent, False, read.prefill_engine_id, b"")
            self._with_agent(
                read.prefill_engine_id,
                lambda remote, why, read=read: self._submit_read(read, remote) if remote else self._read_failed(
                    read, why),
            )

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
        self._waits.prefill_gave_up(read.transfer_id, f"read_failed: {why}")  # nothing of ours is in flight
        self._progress.set()
        self._fail(read.transfer_id, self.engine_id, "read_failed", why)

    def _on_completion(self, data: bytes) -> None:
        event = self._decoded(data, wire.Completion, wire.completion_subject(self.engine_id))
        if isinstance(event, wire.TransferFailed) and event.prefill_engine_id != self.engine_id:
            self._waits.prefill_gave_up(event.transfer_id, f"{event.code}: {event.reason}")
            self._progress.set()

    def _revoke(self, waits) -> None:
        for wait in waits:
            prefill_engine_id = wait.context.prefill_engine_id
            if not prefill_engine_id:
                continue
            self.bridge.publish(
                wire.registration_subject(prefill_engine_id),
                wire.encode(wire.Revoke(transfer_id=wait.transfer_id, decode_engine_id=self.engine_id,
                                        reason=wait.given_up or "")),
                template="kvpush.kv.register.{engine_id}",
            )

    def _on_notification(self, message: bytes) -> None:
        transfer_id, rank, num_ranks = parse_notification(message)
        if not self._counter.record(transfer_id, rank, num_ranks):
            return
        self._counter.take_done([transfer_id])  # leaves a tombstone against late duplicates
        with self._lock:
            served = self._served_reads.pop(transfer_id, None)
        if served is not None:  # pull: decode has read our blocks
            self.transfer.expect(-1)
            self._give_back(served[0])
        else:
            self._kv_arrived(transfer_id)

    def _kv_arrived(self, transfer_id: str) -> None:
        """All of a transfer's KV is in our blocks (any thread)."""
        self._waits.arrived(transfer_id, time.time_ns())
        self._progress.set()

    # ---------------------------------------------------------------- both

    def get_finished(self, finished_req_ids: set[str], idle: bool = False):
        """(prefill requests whose blocks may be freed, decode requests whose wait ended,
        decode requests whose KV will not come)."""
        self._progress.clear()  # set again by any transfer that ends from here on
        sending, receiving, failed = self._collect_finished(finished_req_ids)
        if idle and not sending and not receiving and self._waiting_on_transfers():
            self._progress.wait(IDLE_WAIT_S)
            more = self._collect_finished(set())
            sending |= more[0]
            receiving |= more[1]
            failed |= more[2]
        return sending, receiving, failed

    def _waiting_on_transfers(self) -> bool:
        with self._lock:
            return bool(self._pushing or self._waits.waiting())

    def _collect_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        sending: set[str] = set()
        if self.is_producer:
            with self._lock:
                self._finished |= finished_req_ids & self._pushing
                sending = self._finished & self._sent
                self._finished -= sending
                self._sent -= sending
                self._pushing -= sending
            return sending, set(), set()
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
        return sending, receiving, failed


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
