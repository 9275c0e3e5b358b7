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
locally or fails the request. A write prefill reports stuck keeps the blocks with no
timer until prefill answers again or its engine is proven gone (it no longer answers on
its agent subject, or another incarnation does); ``kvpush_kv_stuck_holds`` counts them.

Tensor parallelism. Each rank waits for its own heads (``kvpush.connector.tp_map``), and
vLLM runs the request only once every rank reported its wait ended. Push: the prefill
ranks writing into this rank's blocks each notify, numbered among them; the KV is here
once all of them landed (each checked against its own checksum). One writer's failure
fails the load, but the blocks are kept until every writer answered (its part landed,
or it failed or was revoked: ``kvpush.connector.writer_answers``) or its engine is proven
gone; the others are revoked meanwhile. A writer's failure that is not about this rank's
blocks is left to the ranks it writes to: vLLM unites every rank's failed loads, so the
request never runs on part of its KV. Pull: one READ per prefill rank holding some of
our heads, into our part of each block (``kvpush.connector.fanout``); it arrived once all
landed, and our heads are checked against prefill's per-head checksums.

Trust. A notification counts only with the transfer's tag over the blocks we registered
(``kvpush.connector.completion``), and a ``TransferFailed`` only from the transfer's own prefill.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

from opentelemetry import trace

from kvpush.connector import checksums, kv_layout, tp_map
from kvpush.connector.agents import AgentDirectory
from kvpush.connector.block_ranges import HeadSlice
from kvpush.connector.bridge import NatsBridge
from kvpush.connector.completion import CompletionCounter, Notification, block_tag, notification, tag_matches
from kvpush.connector.fanout import Fanout, PartEnd
from kvpush.connector.kv_wait import KvWaits, Released, Waiting
from kvpush.connector.metadata import KvpushMetadata, PullRead
from kvpush.connector.outcomes import record_transfer, report_failure
from kvpush.connector.transfer_thread import TransferJob, TransferResult, TransferThread
from kvpush.connector.writer_answers import Failure, WriterAnswers
from kvpush.otel import attributes as A
from kvpush.otel.messaging import context_from_traceparent
from kvpush.otel.metrics import instruments
from kvpush.shared import wire
from kvpush.shared.errors import ChecksumMismatch, ReadFailed, TpMismatch, TransferError, WriteStuck, WrongParty, refusal

log = logging.getLogger("kvpush.connector")
_tracer = trace.get_tracer("kvpush.connector")

RESEND_S = 1.0  # a registration goes to prefill again this often until prefill answers (it may be lost)
PROBE_S = 5.0  # how often the prefill behind a stuck write is asked whether it is still there
MAX_EARLY_NOTES = 10_000  # notifications kept until their wait starts

# A checksum to check: (prefill's digest, the regions it covers (None: all), our blocks,
# the heads of each block it covers (None: all)).
Check = tuple[str, tuple[int, int] | None, list[int], HeadSlice | None]


@dataclass(frozen=True, slots=True)
class _WaitContext:
    span: trace.Span | None
    notified: bool  # push: arrival is the producers' notification (else our own READ)
    prefill_engine_id: str
    registration: bytes  # push: as published, to send again
    transfer_key: str = ""
    block_ids: tuple[int, ...] = ()  # push: the blocks we registered, the only ones a notification may name
    prefill_incarnation: str = ""


class Consumer:
    def __init__(self, engine_id: str, rank: int, tp_size: int, bridge: NatsBridge, agents: AgentDirectory,
                 kv_wait_s: float, quarantine_s: float, kv_heads: int = 0):
        self.engine_id = engine_id
        self.rank = rank
        self.tp_size = tp_size
        self.shard = tp_map.Shard(kv_heads, tp_size, rank)  # the KV heads this rank holds (kv_heads 0: not known)
        self.bridge = bridge
        self.agents = agents
        self.transfer: TransferThread | None = None
        self._wake: Callable[[], None] = lambda: None
        self._waits = KvWaits(kv_wait_s=kv_wait_s, quarantine_s=quarantine_s)
        self._counter = CompletionCounter()  # the producers' WRITE notifications
        self._answers = WriterAnswers()  # push: the writers that said their part will not land
        self._lock = threading.Lock()  # protects _released, _given_up, _early_notes, _early_failures, _ended,
        # _digests, _verified, _received, _failures and _stuck_ranks
        self._released: list[Released] = []  # waits ended on the clock, for the next get_finished
        self._given_up: set[str] = set()  # requests whose wait we gave up, for the scheduler side
        self._early_notes: dict[str, list[Notification]] = {}  # notifications before their wait started
        self._early_failures: dict[str, list[wire.TransferFailed]] = {}  # the same for prefill's answers
        self._ended: dict[str, str] = {}  # transfer id -> its prefill engine, for waits that ended
        # transfer id -> its notifications with a checksum, and the part of our blocks each filled
        self._digests: dict[str, list[tuple[Notification, HeadSlice | None]]] = {}
        self._stuck_ranks: dict[str, int] = {}  # transfer id -> the prefill rank whose write is stuck
        self._verified: set[str] = set()  # requests whose KV matched prefill's checksum, for the scheduler side
        self._received: dict[str, wire.RankKv] = {}  # request -> what landed in this rank, for the same
        self._failures: dict[str, tuple[str, str]] = {}  # request -> (code, why) its load failed, for the same
        self._last_probe = 0.0
        for reason in ("checksum_mismatch", "kv_wait_expired"):  # a series at 0 from the start, for alerts
            instruments().load_failures.add(0, {"reason": reason})

    def attach(self, transfer: TransferThread, wake: Callable[[], None]) -> None:
        """The rank's transfer thread, and what to call when a wait ends."""
        self.transfer = transfer
        self._wake = wake

    def subscriptions(self):
        """(subject, message kind, handler) for the worker to subscribe."""
        return [(wire.KV_COMPLETIONS.partly(engine_id=self.engine_id), wire.Completion, self.on_completion)]

    # ---------------------------------------------------------------- vLLM's worker thread

    def start_load_kv(self, meta: KvpushMetadata) -> None:
        for expected in meta.expected:
            self._await_kv(expected.request_id, expected.traceparent, True, _WaitContext(
                None, True, expected.prefill_engine_id, expected.registration, expected.transfer_key,
                tuple(expected.block_ids), expected.prefill_incarnation), expected.transfer_id)
        for read in meta.reads:
            self._await_kv(read.request_id, read.traceparent, False, _WaitContext(
                None, False, read.prefill_engine_id, b"", read.transfer_key, (), read.prefill_incarnation),
                read.transfer_id)
            self._start_read(read)

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
        with self._lock:
            for ended in released:
                self._ended[ended.transfer_id] = ended.context.prefill_engine_id
            while len(self._ended) > MAX_EARLY_NOTES:
                del self._ended[next(iter(self._ended))]
        for ended in released:
            span = ended.context.span
            if ended.context.notified:
                self.transfer.expect(-1)
            self._answers.forget(ended.transfer_id)
            with self._lock:
                self._stuck_ranks.pop(ended.transfer_id, None)
            if not ended.arrived:
                self._counter.forget(ended.transfer_id)  # a late notification for it is then ignored
                span.set_attribute(A.ERROR_CODE, "aborted" if ended.request_finished else "kv_failed")
                log.warning("gave up the KV of %s: %s", ended.transfer_id, ended.reason)
            span.end(end_time=ended.arrived_at)
            receiving.add(ended.request_id)  # finished (aborted) ones too: vLLM frees their blocks now
            if ended.failed:
                failed.add(ended.request_id)
                instruments().load_failures.add(1, {"reason": ended.code})
                with self._lock:
                    self._failures[ended.request_id] = (ended.code, ended.reason)
        return receiving, failed

    def take_failures(self) -> dict[str, tuple[str, str]]:
        """Requests whose load failed since the last call, and why: the scheduler side puts
        it in the report of the request that computes their prompt again."""
        with self._lock:
            failures, self._failures = self._failures, {}
        return failures

    def take_received(self) -> dict[str, wire.RankKv]:
        """What landed in this rank's blocks since the last call, per request whose KV
        arrived (checked, where it had checksums): its path report's part for this rank."""
        with self._lock:
            received, self._received = self._received, {}
        return received

    def take_verified(self) -> set[str]:
        """Requests whose KV matched prefill's checksum since the last call (their path
        report says so)."""
        with self._lock:
            verified, self._verified = self._verified, set()
        return verified

    def take_given_up(self) -> set[str]:
        """Requests whose wait was given up since the last call: their leases at prefill
        must not be renewed any more (the Revoke may be lost; the lease then runs out)."""
        with self._lock:
            given_up, self._given_up = self._given_up, set()
        return given_up

    def stuck_holds(self) -> int:
        """Transfers whose blocks are held for a write prefill reported stuck."""
        return len(self._waits.stuck())

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
                self.bridge.publish(wire.registration_subject(context.prefill_engine_id, self.engine_id),
                                    context.registration)
        self._send_revokes(self._waits.revokes_due(now, RESEND_S))  # until prefill answers: one may be lost
        stuck = self._waits.stuck()
        instruments().stuck_holds.set(len(stuck), {A.WORKER_ID: self.engine_id})
        if stuck and now - self._last_probe >= PROBE_S:
            self._last_probe = now
            for wait in stuck:
                self._probe(wait)
        if released:
            with self._lock:
                self._released.extend(released)
            self._wake()

    # ---------------------------------------------------------------- the transfer thread

    def write_notified(self, note: Notification) -> None:
        """A producer rank's WRITE notification: once every rank's came, the KV is here.
        It counts only with the transfer's tag over the blocks we registered."""
        wait = self._waits.get(note.transfer_id)
        if wait is None:
            if self._ended_prefill(note.transfer_id) is not None:
                return  # late, for a wait that already ended
            with self._lock:  # our wait starts in this step's start_load_kv: keep it till then
                self._early_notes.setdefault(note.transfer_id, []).append(note)
                while len(self._early_notes) > MAX_EARLY_NOTES:
                    del self._early_notes[next(iter(self._early_notes))]
            return
        self._count_note(wait.context, note)

    def _count_note(self, context: "_WaitContext", note: Notification) -> None:
        if not tag_matches(note.tag, context.transfer_key, list(context.block_ids), note.digest):
            self._refuse(note.transfer_id, "a WRITE notification without the transfer's tag over our blocks")
            return
        layers = len(self.transfer.layout.layers) if self.transfer is not None else 0
        if note.parts != 1 and note.parts != layers:
            self._refuse(note.transfer_id, f"a WRITE notification in {note.parts} parts; "
                                           f"a copy comes whole or in our {layers} layers")
            return
        try:
            part = tp_map.partner_slice(note.rank, note.num_ranks, self.transfer.layout.heads if self.transfer else 0)
            if note.digest:  # every copy notified here landed in this rank's blocks: each is checked
                with self._lock:
                    self._digests.setdefault(note.transfer_id, []).append((note, part))
            complete = self._counter.record(note.transfer_id, note.rank, note.num_ranks, note.part, note.parts)
        except ValueError as exc:
            self._refuse(note.transfer_id, f"a WRITE notification that does not add up: {exc}")
            return
        if not complete:
            if self._answers.failing(note.transfer_id):  # this writer's part landed after another's failed
                self._writer_answered(note.transfer_id)
            return
        self._counter.take_done([note.transfer_id])  # leaves a tombstone against late duplicates
        with self._lock:
            notes = self._digests.pop(note.transfer_id, [])
        blocks = list(context.block_ids)
        self._landed(note.transfer_id, blocks, context.span,
                     [(note.digest, self._part_regions(note), blocks, part) for note, part in notes],
                     len(blocks) * self.transfer.layout.block_bytes)  # every writer's heads together: our blocks

    def _part_regions(self, note: Notification) -> tuple[int, int] | None:
        """The regions a notification's copy covers: all, or its layer's."""
        if note.parts == 1:
            return None
        _, first, end = self.transfer.layout.layers[note.part]
        return first, end

    def _landed(self, transfer_id: str, blocks: list[int], span, checks: list[Check], landed_bytes: int) -> None:
        """A transfer's KV is all in ``blocks`` (``landed_bytes`` of them): check it against
        prefill's checksums (``checks``) before the request may run. A mismatch is a failed
        transfer: the load fails (vLLM fails it for every rank), and decode applies the
        request's kv_policy."""
        chaos = self.bridge.chaos
        seed = chaos.flips(transfer_id, self.rank) if chaos is not None and blocks else None
        if seed is not None and checksums.readable(self.transfer.layout):  # the fault suite's corruption
            log.warning("chaos: flipped byte %s of %s", checksums.flip_byte(self.transfer.layout, blocks, seed),
                        transfer_id)
        checked = bool(checks) and checksums.readable(self.transfer.layout)
        if checked:
            with _tracer.start_as_current_span(A.KV_CHECKSUM, context=trace.set_span_in_context(span) if span
                                               else None, attributes={A.TRANSFER_ID: transfer_id}) as check:
                wrong = [i for i, (digest, regions, mine, part) in enumerate(checks)
                         if checksums.digest(self.transfer.layout, mine, regions, part) != digest]
                if wrong:
                    check.set_attribute(A.ERROR_CODE, ChecksumMismatch.code)
            if wrong:
                reason = (f"{ChecksumMismatch.code}: the KV that landed differs from what prefill computed "
                          f"({len(wrong)} of {len(checks)} checksums)")
                log.error("transfer %s: %s", transfer_id, reason)
                instruments().checksum_mismatches.add(1)
                self._waits.prefill_gave_up(transfer_id, reason, code=ChecksumMismatch.code)
                self._wake()
                return
        wait = self._waits.get(transfer_id)
        if wait is not None:  # for the scheduler side: the request's path report
            with self._lock:
                if checked:
                    self._verified.add(wait.request_id)
                self._received[wait.request_id] = wire.RankKv(rank=self.rank, blocks=len(blocks), bytes=landed_bytes)
        self._kv_arrived(transfer_id)

    # ---------------------------------------------------------------- NATS

    def on_completion(self, event: wire.Completion) -> None:
        if event.prefill_engine_id == self.engine_id or isinstance(event, wire.TransferMoved):
            return  # a TransferMoved is for the scheduler: our registration, when it comes, is what counts
        if not isinstance(event, wire.TransferFailed):
            # Our KV's arrival is its notification, not this message; but the message says
            # the notification is due, so the transfer thread polls for it now.
            if self._waits.get(event.transfer_id) is not None and self.transfer is not None:
                self.transfer.poke()
            return
        wait = self._waits.get(event.transfer_id)
        prefill = wait.context.prefill_engine_id if wait is not None else self._ended_prefill(event.transfer_id)
        if prefill is not None and prefill != event.prefill_engine_id:
            self._refuse(event.transfer_id, f"a TransferFailed from {event.prefill_engine_id}, "
                                            f"but the KV comes from {prefill}")
            return
        if wait is None:
            if prefill is None:  # before our wait started (this step's start_load_kv): checked then
                with self._lock:
                    self._early_failures.setdefault(event.transfer_id, []).append(event)
                    while len(self._early_failures) > MAX_EARLY_NOTES:
                        del self._early_failures[next(iter(self._early_failures))]
            return
        if event.code == WriteStuck.code and self.tp_size == 1:  # every prefill rank writes into our one rank
            self._rank_stuck(event)
            return
        # Which of our ranks it writes to depends on its engine's size: its agent says.
        self.agents.with_agent(event.prefill_engine_id, lambda info, why: self._rank_failed(event, info, why),
                               incarnation=wait.context.prefill_incarnation, rank=event.rank)

    def _rank_failed(self, event: wire.TransferFailed, agent: wire.AgentInfo | None, why: str) -> None:
        """A prefill rank said its part will not land. Its ``agent`` says its engine's TP,
        and so whether it writes into our blocks and how many ranks do; without it, its
        engine is gone (nothing of it can land: the wait ends) or did not answer (the load
        is given up, and the blocks held until the rest answer or the quarantine passed)."""
        reason = f"{event.code}: {event.reason}"
        if agent is None:
            if _gone(why):  # none of its ranks can write any more
                self._end_wait(event.transfer_id, self._answers.first(event.transfer_id) or Failure(event.code, reason))
            else:
                self._give_up_load(event.transfer_id, event.code, reason)
            return
        writers = tp_map.answering_ranks(self.tp_size, self.rank, agent.tp_size)
        if event.rank not in writers:
            return  # it writes into other ranks of ours: theirs to count (vLLM fails the load for all)
        if event.code == WriteStuck.code:
            self._rank_stuck(event)
            return
        try:
            self._answers.failed(event.transfer_id, writers.index(event.rank), len(writers), event.code, reason)
        except ValueError as exc:
            self._refuse(event.transfer_id, f"a TransferFailed that does not add up: {exc}")
            return
        self._writer_answered(event.transfer_id)

    def _rank_stuck(self, event: wire.TransferFailed) -> None:
        """A prefill rank writing into our blocks says its write is stuck: they are held
        until it answers again or its engine is proven gone (``_probe``)."""
        with self._lock:
            self._stuck_ranks[event.transfer_id] = event.rank
        if self._waits.write_stuck(event.transfer_id, f"{event.code}: {event.reason}", time.monotonic()):
            log.error("prefill %s reports its write for %s stuck; its blocks stay held until it ends "
                      "or %s is gone", event.prefill_engine_id, event.transfer_id, event.prefill_engine_id)

    def _writer_answered(self, transfer_id: str) -> None:
        """A writer of a transfer another writer failed answered (it failed too, or its part
        landed): the wait ends once every writer answered, with the first failure; until
        then the load is given up and the transfer revoked, so that the others stop."""
        first = self._answers.settled(transfer_id, self._counter.landed(transfer_id))
        if first is not None:
            self._end_wait(transfer_id, first)
            return
        failure = self._answers.first(transfer_id)
        if failure is not None:
            self._give_up_load(transfer_id, failure.code, failure.reason)

    def _end_wait(self, transfer_id: str, failure: Failure) -> None:
        """No write of prefill's can land in our blocks any more: the wait ends, failed."""
        wait = self._waits.get(transfer_id)
        if wait is None:
            return
        if wait.stuck is not None:
            self._waits.write_ended(transfer_id, failure.reason, code=failure.code)
        else:
            self._waits.prefill_gave_up(transfer_id, failure.reason, code=failure.code)
        self._wake()

    def _give_up_load(self, transfer_id: str, code: str, reason: str) -> None:
        """A writer's part will not land and others may still write: the load fails, the
        transfer is revoked (once) so that they stop, and the blocks are held until they
        answered or the quarantine passed."""
        given_up = self._waits.writer_failed(transfer_id, reason, code=code, now=time.monotonic())
        if given_up is not None:
            log.warning("a prefill rank's part of %s will not land (%s); waiting for the others to answer",
                        transfer_id, reason)
            self._revoke([given_up])

    # ---------------------------------------------------------------- waits and reads

    def _await_kv(self, request_id: str, traceparent: str, notified: bool, context: "_WaitContext",
                  transfer_id: str) -> None:
        span = _tracer.start_span(
            A.KV_WAIT,
            context=context_from_traceparent(traceparent),
            attributes={A.TRANSFER_ID: transfer_id, A.WORKER_ID: self.engine_id},
        )
        if notified:
            self.transfer.expect(1)  # poll eagerly for the producers' notifications
        context = dataclasses.replace(context, span=span)
        self._waits.start(request_id, transfer_id, time.monotonic(), context)
        with self._lock:
            early = self._early_notes.pop(transfer_id, [])
            failures = self._early_failures.pop(transfer_id, [])
        for note in early:
            self._count_note(context, note)
        for failure in failures:
            self.on_completion(failure)

    def _ended_prefill(self, transfer_id: str) -> str | None:
        with self._lock:
            return self._ended.get(transfer_id)

    def _start_read(self, read: PullRead) -> None:
        """Pull: READ our heads from every prefill rank holding some of them."""
        try:
            exchanges = tp_map.exchanges(self.shard, read.prefill_tp_size)
        except ValueError as exc:
            self._read_failed(read, str(exc), TpMismatch)
            return
        self.agents.with_agents(
            read.prefill_engine_id, [exchange.peer_rank for exchange in exchanges],
            lambda remotes, why: self._submit_reads(read, list(zip(exchanges, remotes))) if remotes is not None
            else self._read_failed(read, why),
            incarnation=read.prefill_incarnation,
        )

    def _submit_reads(self, read: PullRead, sources: list[tuple[tp_map.Exchange, wire.AgentInfo]]) -> None:
        """One READ per prefill rank, into our part of each block; it arrived once all landed."""
        for exchange, remote in sources:
            problem = kv_layout.copy_problem(self.transfer.layout, remote, read.local_block_ids, read.sources,
                                             exchange.mine, exchange.theirs)
            if problem is None and remote.tp_size != read.prefill_tp_size:
                problem = f"prefill said TP {read.prefill_tp_size}, its agent says {remote.tp_size}"
            if problem is not None:
                self._read_failed(read, problem if len(sources) == 1 else f"prefill rank {exchange.peer_rank}: "
                                                                          f"{problem}")
                return
        ends = Fanout(len(sources))  # touched on the transfer thread only

        def on_done(result: TransferResult) -> None:
            if result.stuck:  # reported failed now, as a READ on its own always was
                if ends.stuck():
                    self._read_failed(read, result.error)
                return
            end = ends.ended(PartEnd(result.ok, result.bytes, result.descriptors, result.error, result.write_ms))
            if end is None:
                return
            if not end.ok:
                self._read_failed(read, end.error)
                return
            record_transfer(TransferResult(read.transfer_id, True, bytes=end.bytes, descriptors=end.descriptors,
                                           write_ms=end.write_ms))
            wait = self._waits.get(read.transfer_id)
            self._landed(read.transfer_id, list(read.local_block_ids), wait.context.span if wait else None,
                         self._pull_checks(read), end.bytes)

        for exchange, remote in sources:
            self.transfer.submit(TransferJob(
                "READ", read.transfer_id, remote, read.local_block_ids, read.sources,
                notification(read.transfer_id, exchange.index, exchange.partners,
                             block_tag(read.transfer_key, read.remote_block_ids)),
                on_done, parent=context_from_traceparent(read.traceparent),
                local_part=exchange.mine, remote_part=exchange.theirs,
            ))

    def _pull_checks(self, read: PullRead) -> list[Check]:
        """Prefill's checksums of what we read: one per block and head of ours (or, from a
        TP-1 prefill that predates them, per block); none if it sent none."""
        local = list(read.local_block_ids)
        heads = self.transfer.layout.heads
        if read.head_digests:
            rows = read.head_digests[read.first_block:]
            first = self.rank * heads
            if not heads or len(rows) != len(local) or any(len(row) < first + heads for row in rows):
                return []
            return [(row[first + head], None, [block], HeadSlice(head, 1, heads))
                    for block, row in zip(local, rows) for head in range(heads)]
        digests = read.block_digests[read.first_block:]
        if len(digests) != len(local) or not read.prefill_tp_size == self.tp_size == 1:
            return []
        return [(digest, None, [block], None) for digest, block in zip(digests, local)]

    def _read_failed(self, read: PullRead, why: str, kind: type[TransferError] = ReadFailed) -> None:
        error = kind(why)
        # nothing of ours is in flight
        self._waits.prefill_gave_up(read.transfer_id, f"{error.code}: {why}", code=error.code)
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
                wire.registration_subject(prefill_engine_id, self.engine_id),
                wire.encode(wire.Revoke(transfer_id=wait.transfer_id, decode_engine_id=self.engine_id,
                                        reason=wait.given_up or "", transfer_key=wait.context.transfer_key)),
            )

    def _probe(self, wait: Waiting) -> None:
        """Is the prefill engine that posted a stuck write still there? It is gone once its
        agent subject has no responder (its process left NATS) or another start answers."""
        context: _WaitContext = wait.context
        with self._lock:
            rank = self._stuck_ranks.get(wait.transfer_id, self.rank)

        def on_agent(info: wire.AgentInfo | None, why: str) -> None:
            if info is not None:
                return  # the same process: the write may still land
            if _gone(why):
                log.warning("prefill %s is gone (%s): releasing the blocks of %s", context.prefill_engine_id, why,
                            wait.transfer_id)
                self._waits.prefill_gone(wait.transfer_id, why)
                self._wake()

        self.agents.with_agent(context.prefill_engine_id, on_agent, incarnation=context.prefill_incarnation,
                               fresh=True, rank=rank)

    def _refuse(self, transfer_id: str, why: str) -> None:
        self.bridge.refuse(refusal(self.engine_id, wire.KV_COMPLETIONS.partly(engine_id=self.engine_id),
                                   ValueError(f"{transfer_id}: {why}"), WrongParty))


def _gone(why: str) -> bool:
    """Asking for a prefill rank's agent proved its engine gone: its process left NATS
    (no responders), or another start of it answers."""
    return "no responders" in why.lower() or "restarted" in why
