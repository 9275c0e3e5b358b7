"""The prefill half of a worker rank: where a finished prompt's KV leaves.

Push: a finished prefill (from this step's metadata, after the forward pass) and a
decode registration (from NATS) meet in the rendezvous; the match becomes a WRITE for
the transfer thread, and its end a completion event for decode. Pull: the prompt's
blocks are held (``ServedReads``) until decode's READ notification came.

Layer by layer (``push_by_layer``). A prompt whose decode registered before the step
that finishes it is matched when that step's forward saves its first layer, and each layer's blocks
are written as soon as the forward has written that layer (``layer_saved``), so later
layers compute while earlier ones travel. Its transfer ends once every layer landed; a
Revoke between two layers stops the rest and is answered once the posted ones ended.
A registration that comes later gets one WRITE after the forward, as without the setting.

Faults. A finished prompt's blocks, and a registration waiting for its prompt, are held
under a lease that decode renews (``LeaseRenewal``); expiry frees the blocks and tells
decode and the schedulers (``LeaseExpired``). A ``Revoke`` gives the transfer up: no
write starts, and decode gets its answer once no write of ours can still land. A write
that does not end is reported stuck (``WriteStuck``) and its blocks stay held, on both
sides, until it ends; then its end is reported.

Tensor parallelism. Every rank of the engine gets the same steps and the same NATS
messages, and moves its own KV heads: push, it writes them into every decode rank that
holds some of them (``kvpush.connector.tp_map``), one WRITE per decode rank (per layer,
layer by layer), each notification numbered among that decode rank's writers; the rank's
write has ended once all of them ended (``kvpush.connector.fanout``), and only then does it
answer decode (done or failed) and let vLLM free its blocks. vLLM frees them once every
rank said so. Pull, it holds its blocks until the decode ranks that read its heads all
notified (each notification names how many they are). A registration from a decode
whose size cannot split the heads with ours is refused (``TpMismatch``) before anything
moves.

Trust. A registration or revoke comes from the decode its subject names (the bridge
refuses a forged one). It is used only if it carries the transfer's key, which the
scheduler gave only to us and the decode it chose, and (push) comes from that decode.
Decode's READ notifications (pull) count only with a tag made with that key over our blocks.
These decisions are ``kvpush.connector.transfer_book``'s; the producer acts on them.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Callable

from opentelemetry import trace

from kvpush.connector import kv_layout, tp_map
from kvpush.connector.agents import AgentDirectory
from kvpush.connector.bridge import NatsBridge
from kvpush.connector import checksums
from kvpush.connector.block_ranges import HeadSlice
from kvpush.connector.compute_marks import COMPUTED, ComputeMark
from kvpush.connector import compute_marks
from kvpush.connector.completion import Notification, block_tag, notification
from kvpush.connector.fanout import Fanout, PartEnd
from kvpush.connector.layer_writes import LayerWrites, NotWritten, Written
from kvpush.connector.metadata import KvpushMetadata, ReadyPrefill
from kvpush.connector.outcomes import record_transfer, report_failure
from kvpush.connector.rendezvous import Match, Refused
from kvpush.connector.transfer_book import Refuse, Release, TransferBook
from kvpush.connector.transfer_thread import TransferJob, TransferResult, TransferThread
from kvpush.otel import attributes as A
from kvpush.otel.messaging import context_from_traceparent
from kvpush.otel.metrics import instruments
from kvpush.shared import chaos, wire
from kvpush.shared.errors import (
    AgentUnreachable,
    BadRegistration,
    LeaseExpired,
    Revoked,
    TpMismatch,
    TransferClosed,
    TransferError,
    WriteFailed,
    WriteStuck,
    WrongParty,
    refusal,
)

log = logging.getLogger("kvpush.connector")
_tracer = trace.get_tracer("kvpush.connector")
MAX_PULL_DIGESTS = 10_000  # transfers whose pull digests wait for the worker meta (bounded)
MAX_MARKS = 4_096  # prompts' compute marks kept for their WRITEs (far more than one step finishes)

Target = tuple[tp_map.Exchange, wire.AgentInfo]  # a decode rank our heads go to, and its agent


def sources(registration: wire.Registration, ready: ReadyPrefill) -> list[int]:
    """Our blocks to write into the registration's: those decode does not hold already."""
    return ready.block_ids[registration.first_block:]


@dataclasses.dataclass
class _LayeredPush:
    """A match being written layer by layer (under the producer's lock)."""

    match: Match
    writes: LayerWrites
    targets: list[Target] = dataclasses.field(default_factory=list)  # once their agents are known
    ends: dict[int, Fanout] = dataclasses.field(default_factory=dict)  # layer -> its WRITEs to every target
    computed: dict[int, ComputeMark] = dataclasses.field(default_factory=dict)  # layer -> its mark (compute_marks.py)
    started: float = dataclasses.field(default_factory=time.perf_counter)


class Producer:
    def __init__(self, engine_id: str, rank: int, tp_size: int, bridge: NatsBridge, agents: AgentDirectory,
                 lease_s: float, push_by_layer: bool = False, kv_heads: int = 0):
        self.engine_id = engine_id
        self.rank = rank
        self.tp_size = tp_size
        self.bridge = bridge
        self.agents = agents
        self.lease_s = lease_s
        self.shard = tp_map.Shard(kv_heads, tp_size, rank)  # the KV heads this rank holds (kv_heads 0: not known)
        self.transfer: TransferThread | None = None
        self._wake: Callable[[], None] = lambda: None
        self._lock = threading.Lock()  # protects the book: every call to it is made under this lock
        self._book = TransferBook(lease_s)
        self.push_by_layer = push_by_layer
        self._layered: dict[str, _LayeredPush] = {}  # transfer id -> its layer-wise write, until it ended
        self._this_step: list[str] = []  # transfers matched in this step's forward (vLLM's worker thread only)
        self._step_meta: KvpushMetadata | None = None  # the step whose forward is under way, once it saved a layer
        self._layer_of: dict[str, int] = {}  # vLLM's layer name -> its position in our KV layout
        # Prompts a step finished -> its mark: their WRITEs leave once the step's KV is in memory.
        self._computed: dict[str, ComputeMark] = {}
        self._pull_digests: dict[str, list[list[str]]] = {}  # transfer -> our heads' digests, for the worker meta

    def attach(self, transfer: TransferThread, wake: Callable[[], None]) -> None:
        """The rank's transfer thread, and what to call when blocks may go back."""
        self.transfer = transfer
        self._wake = wake

    def subscriptions(self):
        """(subject, message kind, handler) for the worker to subscribe."""
        return [(wire.KV_CONTROL.partly(engine_id=self.engine_id), wire.KvControl, self.on_kv_control),
                (wire.KV_MOVES.partly(engine_id=self.engine_id), wire.MoveTransfer, self.on_move)]

    def waiting(self, transfer_id: str) -> bool:
        """Push: a half of this transfer (decode's registration, or the prompt) waits for the other."""
        with self._lock:
            return self._book.waiting(transfer_id)

    # ---------------------------------------------------------------- vLLM's worker thread

    def _begin_step(self, meta: KvpushMetadata) -> None:
        """The forward pass has written its first layer. Layer by layer: a prompt this step
        finishes whose decode has registered is matched now, and written as its layers are
        computed. (vLLM binds the step's metadata before the forward but calls
        ``start_load_kv`` after it unless a load must come first: the first layer is the
        first moment inside the forward we are called.)"""
        self._this_step = []
        if not self.push_by_layer or self.transfer is None or not self.transfer.layout.layers:
            return
        chaos.point("producer.first_layer")  # a test holds a layer-wise forward here, prompts matched after it
        if not self._layer_of:
            self._layer_of = {name: i for i, (name, _, _) in enumerate(self.transfer.layout.layers)}
        for ready in meta.ready_prefills:
            if ready.mode != "push":
                continue
            with self._lock:  # a registration seen waiting is offered this prompt in the same section
                if not self._book.registration_waiting(ready.transfer_id):
                    continue
                arrival = self._book.prefill_ready(ready)
                outcome = self._book.offer_prefill(arrival.prefill)
                if isinstance(outcome, Match):
                    self._layered[ready.transfer_id] = _LayeredPush(outcome, LayerWrites(len(self._layer_of)))
            self._this_step.append(ready.transfer_id)  # wait_for_save leaves it alone
            if arrival.forged is not None:
                self._refuse(arrival.forged)
            chaos.point("producer.matched")
            if isinstance(outcome, Match):
                self._rendezvous_span(outcome)
                self._with_targets(outcome, lambda targets, match=outcome: self._layered_peer(match, targets),
                                   layered=True)
            else:
                self._settle(outcome, arrival.prefill)

    def layer_saved(self, layer_name: str, meta: KvpushMetadata) -> None:
        """Inside the forward pass: ``layer_name``'s KV is written; send it where it is awaited."""
        if meta is not self._step_meta:
            self._step_meta = meta
            self._begin_step(meta)
        if not self._this_step:
            return
        index = self._layer_of.get(layer_name)
        if index is not None:
            computed = compute_marks.mark(index)
            if computed is not COMPUTED:  # a synchronous device's layers need no mark kept
                with self._lock:
                    for transfer_id in self._this_step:
                        push = self._layered.get(transfer_id)
                        if push is not None:
                            push.computed[index] = computed
            self._post_layers(lambda writes: writes.layer_computed(index))

    def wait_for_save(self, meta: KvpushMetadata) -> None:
        """After the forward pass: these prefills' KV is now in their blocks."""
        early = self._this_step if meta is self._step_meta else []
        self._this_step, self._step_meta = [], None
        if meta.ready_prefills:
            self._mark_computed([ready.transfer_id for ready in meta.ready_prefills], compute_marks.mark())
        if early:
            self._post_layers(lambda writes: writes.all_computed(), early)
        for ready in meta.ready_prefills:
            if ready.transfer_id in early:
                continue
            chaos.point("producer.ready")
            with self._lock:
                arrival = self._book.prefill_ready(ready)
            ready = arrival.prefill
            if arrival.forged is not None:
                self._refuse(arrival.forged)
            if ready.mode == "pull":
                if ready.checksum and checksums.readable(self.transfer.layout):  # for the handoff (checksums.py)
                    self._keep_pull_digests(ready)
                with self._lock:
                    self._book.serve(ready)
                self.transfer.expect(1)
                continue
            self._settle(self._offer(lambda: self._book.offer_prefill(ready)), ready)

    def _mark_computed(self, transfer_ids: list[str], computed: ComputeMark) -> None:
        """These prompts' KV is in memory once ``computed`` is done. Marks of steps long ended
        are done: past MAX_MARKS the oldest go (a WRITE with none leaves at once)."""
        if computed is COMPUTED:
            return
        with self._lock:
            for transfer_id in transfer_ids:
                self._computed[transfer_id] = computed
            while len(self._computed) > MAX_MARKS:
                del self._computed[next(iter(self._computed))]

    def _keep_pull_digests(self, ready: ReadyPrefill) -> None:
        """Pull: our heads' digests of the prompt's blocks, for the scheduler side's handoff
        (it runs in another process at TP > 1: they go in the step's worker meta)."""
        rows = checksums.head_digests(self.transfer.layout, ready.block_ids)
        if not rows:
            return
        with self._lock:
            self._pull_digests[ready.transfer_id] = rows
            while len(self._pull_digests) > MAX_PULL_DIGESTS:
                del self._pull_digests[next(iter(self._pull_digests))]

    def take_pull_digests(self) -> dict[str, list[list[str]]]:
        """Pull digests computed since the last call: transfer -> [block][our head]."""
        with self._lock:
            digests, self._pull_digests = self._pull_digests, {}
        return digests

    def get_finished(self, finished_req_ids: set[str]) -> set[str]:
        """Requests vLLM finished whose blocks may now be freed (their KV left, or will not)."""
        with self._lock:
            return self._book.finished(finished_req_ids)

    def busy(self) -> bool:
        """Blocks are held for a transfer that has not ended."""
        with self._lock:
            return self._book.busy()

    # ---------------------------------------------------------------- the clock

    def tick(self, now: float) -> None:
        with self._lock:
            expired = self._book.expired()
        for gone in expired:
            if gone.request_id is not None:
                self._give_back(gone.request_id)
            self._fail(gone.transfer_id, gone.decode_engine_id,
                       LeaseExpired(f"decode did not renew the lease within {self.lease_s:g} s"))
        with self._lock:
            lapsed = self._book.lapsed_reads(now)
        for transfer_id, request_id in lapsed:
            self.transfer.expect(-1)
            self._give_back(request_id)
            self._fail(transfer_id, "", LeaseExpired("decode did not read the KV within its lease"))

    # ---------------------------------------------------------------- the transfer thread

    def serves(self, transfer_id: str) -> bool:
        """Pull: decode is to READ this transfer's blocks from us."""
        with self._lock:
            return self._book.serves(transfer_id)

    def read_notified(self, note: Notification) -> None:
        """Decode's READ notification: once every rank's came, the blocks may go back."""
        with self._lock:
            outcome = self._book.read_notified(note)
        if isinstance(outcome, Refuse):
            self._refuse(outcome)
        elif isinstance(outcome, Release):
            self.transfer.expect(-1)
            self._give_back(outcome.request_id)

    # ---------------------------------------------------------------- NATS

    def on_kv_control(self, message: wire.KvControl) -> None:
        match message:
            case wire.LeaseRenewal():
                with self._lock:
                    for transfer_id in message.transfer_ids:
                        self._book.renew(transfer_id)
            case wire.Revoke():
                self._on_revoke(message)
            case wire.Registration():
                self._on_registration(message)

    def on_move(self, move: wire.MoveTransfer) -> None:
        """A scheduler moves a transfer to another decode: its first decode was lost or
        overloaded. Only before its write: once it began, the KV is that decode's."""
        transfer_id = move.transfer_id
        with self._lock:  # the critical section of a match, its "writing" mark and a Revoke
            answer = self._book.move(move)
        if isinstance(answer, Refuse):
            self._refuse(answer)
            return
        if answer.moved and answer.dropped is not None:  # its blocks go back through its revoke, answered at once
            log.info("transfer %s moved from %s to %s", transfer_id, answer.dropped.decode_engine_id,
                     move.decode_engine_id)
        self.bridge.publish(
            wire.completion_subject(move.decode_engine_id, self.engine_id),
            wire.encode(wire.TransferMoved(transfer_id=transfer_id, prefill_engine_id=self.engine_id,
                                           decode_engine_id=move.decode_engine_id, moved=answer.moved,
                                           reason=answer.why_not or "")),
        )

    def _on_registration(self, registration: wire.Registration) -> None:
        with self._lock:
            arrival = self._book.registration_arrived(registration)
        if arrival.moved_to is not None:
            self._fail(registration.transfer_id, registration.decode_engine_id,
                       BadRegistration(f"the transfer moved to {arrival.moved_to}"))
            return
        if arrival.forged is not None:
            self._refuse(arrival.forged)
        mismatch = tp_map.problem(self.shard, tp_map.Shard(registration.kv_heads, registration.decode_tp_size))
        if mismatch is not None:
            self._fail(registration.transfer_id, registration.decode_engine_id, TpMismatch(mismatch))
            return
        self._settle(self._offer(lambda: self._book.offer_registration(registration)))

    def _offer(self, offer: Callable[[], Match | Refused | None]) -> Match | Refused | None:
        """Offer a half. The book marks a match "writing" in the same critical section that
        a Revoke reads it in: a Revoke never sees a match without its write, so it is never
        answered while a WRITE can still be posted."""
        with self._lock:
            outcome = offer()
        chaos.point("producer.matched")
        return outcome

    def _settle(self, outcome: Match | Refused | None, ready: ReadyPrefill | None = None) -> None:
        """Act on what the rendezvous said about a half just offered."""
        if isinstance(outcome, Match):
            self._start_write(outcome)
            return
        if not isinstance(outcome, Refused) or outcome.code == "duplicate":
            return
        if outcome.registration is not None:
            error = BadRegistration if outcome.code == "incompatible" else TransferClosed
            self._fail(outcome.transfer_id, outcome.registration.decode_engine_id, error(outcome.reason))
        if ready is not None and outcome.code == "closed":
            self._give_back(ready.request_id)  # decode gave this transfer up before the prompt was done

    def _on_revoke(self, revoke: wire.Revoke) -> None:
        with self._lock:  # the same critical section as a match and its "writing" mark
            taken = self._book.revoke(revoke)
        if isinstance(taken, Refuse):
            self._refuse(taken)
            return
        if taken.prompt is not None:
            self._give_back(taken.prompt)
        if taken.served is not None:
            self.transfer.expect(-1)
            self._give_back(taken.served)
        if taken.answer is not None:  # else the write's own completion event answers, once nothing more can land
            self._fail(revoke.transfer_id, revoke.decode_engine_id, Revoked(taken.answer))
            return
        with self._lock:  # layer by layer: no further layer starts; answered once the posted ones ended
            push = self._layered.get(revoke.transfer_id)
            end = None
            if push is not None:
                push.writes.stop("decode gave the transfer up while its layers were being written")
                end = self._layered_end(push, push.writes.outcome())
        if end is not None:
            self._layered_ended(push, end)

    # ---------------------------------------------------------------- writes

    def _start_write(self, match: Match[wire.Registration, ReadyPrefill]) -> None:
        self._rendezvous_span(match)
        self._with_targets(match, lambda targets: self._submit_write(match, targets))

    def _with_targets(self, match: Match[wire.Registration, ReadyPrefill], then: Callable[[list[Target]], None],
                      layered: bool = False) -> None:
        """``then(targets)``: every decode rank our heads go to, with its agent; the match
        fails instead if one cannot be had."""
        registration = match.registration
        try:
            exchanges = tp_map.exchanges(self.shard, registration.decode_tp_size)
        except ValueError as exc:  # checked as the registration came; a guard all the same
            self._fail_match(match, TpMismatch(str(exc)), layered=layered)
            return
        self.agents.with_agents(
            registration.decode_engine_id, [exchange.peer_rank for exchange in exchanges],
            lambda remotes, why: then(list(zip(exchanges, remotes))) if remotes is not None else self._fail_match(
                match, AgentUnreachable(why), layered=layered),
            incarnation=registration.decode_incarnation,
        )

    def _targets_problem(self, match: Match[wire.Registration, ReadyPrefill], targets: list[Target]) -> str | None:
        """Why our blocks cannot go into the registration's on some decode rank, or None."""
        registration = match.registration
        for exchange, remote in targets:
            problem = kv_layout.copy_problem(self.transfer.layout, remote, sources(registration, match.prefill),
                                             registration.block_ids, exchange.mine, exchange.theirs)
            if problem is None and remote.tp_size != registration.decode_tp_size:
                problem = f"decode registered at TP {registration.decode_tp_size}, its agent says {remote.tp_size}"
            if problem is not None:
                return problem if len(targets) == 1 else f"decode rank {exchange.peer_rank}: {problem}"
        return None

    def _rendezvous_span(self, match: Match[wire.Registration, ReadyPrefill]) -> None:
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

    def _submit_write(self, match: Match[wire.Registration, ReadyPrefill], targets: list[Target]) -> None:
        """One WRITE per decode rank; the rank's write ends once all of them ended."""
        problem = self._targets_problem(match, targets)
        if problem is not None:
            self._fail_match(match, BadRegistration(problem))
            return
        registration, ready = match.registration, match.prefill
        started = time.perf_counter()
        ends = Fanout(len(targets))  # touched on the transfer thread only

        def on_done(result: TransferResult) -> None:
            if result.stuck:  # still posted: our blocks and decode's stay held until it ends
                if ends.stuck():
                    self._fail(match.transfer_id, registration.decode_engine_id, WriteStuck(result.error))
                return
            end = ends.ended(_part_end(result))
            if end is None:
                return
            with self._lock:  # a later Revoke finds the transfer matched: answered
                self._book.write_ended(match.transfer_id, ready.request_id, end.ok)
            self._wake()
            if not end.ok:
                self._fail(match.transfer_id, registration.decode_engine_id, WriteFailed(end.error))
                return
            record_transfer(TransferResult(match.transfer_id, True, bytes=end.bytes, descriptors=end.descriptors,
                                           write_ms=end.write_ms))
            self._done(match, end.bytes, end.descriptors, started)

        with self._lock:
            computed = self._computed.get(match.transfer_id, COMPUTED)
        for exchange, remote in targets:
            self.transfer.submit(self._write_job(match, exchange, remote, on_done, computed))

    def _write_job(self, match: Match[wire.Registration, ReadyPrefill], exchange: tp_map.Exchange,
                   remote: wire.AgentInfo, on_done: Callable[[TransferResult], None], computed: ComputeMark,
                   part: int = 0, parts: int = 1, regions: tuple[int, int] | None = None) -> TransferJob:
        """The WRITE of our heads ``exchange.mine`` into one decode rank's (``regions``: a
        layer's, layer by layer), its notification numbered among that rank's writers; it
        leaves once ``computed`` is done."""
        registration, ready = match.registration, match.prefill
        blocks = sources(registration, ready)
        digest = self._digest(ready, blocks, regions, exchange.mine)
        return TransferJob(
            "WRITE",
            match.transfer_id,
            remote,
            blocks,
            registration.block_ids,
            notification(match.transfer_id, exchange.index, exchange.partners,
                         block_tag(ready.transfer_key, registration.block_ids, digest), part=part, parts=parts,
                         digest=digest),
            on_done,
            parent=context_from_traceparent(ready.traceparent),
            regions=regions,
            local_part=exchange.mine,
            remote_part=exchange.theirs,
            computed=computed,
        )

    def _done(self, match: Match[wire.Registration, ReadyPrefill], nbytes: int, descriptors: int,
              started: float) -> None:
        """Tell decode (and the schedulers) that this rank's copy landed."""
        registration = match.registration
        self.bridge.publish(
            wire.completion_subject(registration.decode_engine_id, self.engine_id),
            wire.encode(
                wire.TransferDone(
                    transfer_id=match.transfer_id,
                    prefill_engine_id=self.engine_id,
                    decode_engine_id=registration.decode_engine_id,
                    rank=self.rank,
                    order=match.order,
                    waited_ms=match.waited_s * 1000,
                    bytes=nbytes,
                    descriptors=descriptors,
                    write_ms=(time.perf_counter() - started) * 1000,
                    finished_at=time.time(),
                )
            ),
        )

    # ---------------------------------------------------------------- layer by layer

    def _layered_peer(self, match: Match[wire.Registration, ReadyPrefill], targets: list[Target]) -> None:
        """The decode ranks' agents are known: post the layers computed so far."""
        problem = self._targets_problem(match, targets)
        if problem is not None:
            self._fail_match(match, BadRegistration(problem), layered=True)
            return
        with self._lock:
            push = self._layered.get(match.transfer_id)
            if push is not None:
                push.targets = targets
        self._post_layers(lambda writes: writes.peer_found(), [match.transfer_id])

    def _post_layers(self, advance: Callable[[LayerWrites], list[int]], transfer_ids: list[str] | None = None) -> None:
        """Advance each layer-wise write (``advance``), and post the layers it says may go."""
        jobs: list[TransferJob] = []
        with self._lock:
            for transfer_id in self._this_step if transfer_ids is None else transfer_ids:
                push = self._layered.get(transfer_id)
                if push is None:
                    continue
                for index in advance(push.writes):
                    jobs.extend(self._layer_jobs(push, index))
        for job in jobs:
            self.transfer.submit(job)
        if jobs:
            chaos.point("producer.layers_posted")

    def _layer_jobs(self, push: _LayeredPush, index: int) -> list[TransferJob]:
        """Under the lock: layer ``index``'s WRITE into every decode rank; the layer has
        ended once all of them ended."""
        _, first, end = self.transfer.layout.layers[index]
        push.ends[index] = Fanout(len(push.targets))
        transfer_id = push.match.transfer_id
        return [self._write_job(push.match, exchange, remote,
                                lambda result: self._layer_done(transfer_id, index, result),
                                push.computed.get(index, COMPUTED), part=index, parts=push.writes.layers,
                                regions=(first, end))
                for exchange, remote in push.targets]

    def _digest(self, ready: ReadyPrefill, blocks: list[int], regions: tuple[int, int] | None = None,
                part: HeadSlice | None = None) -> str:
        """The checksum of what a WRITE sends (``part``: those heads of each block), if the
        scheduler asked for one ("" if not)."""
        if not ready.checksum or not checksums.readable(self.transfer.layout):
            return ""
        with _tracer.start_as_current_span(A.KV_CHECKSUM, context=context_from_traceparent(ready.traceparent),
                                           attributes={A.TRANSFER_ID: ready.transfer_id, A.BLOCKS: len(blocks)}):
            return checksums.digest(self.transfer.layout, blocks, regions, part)

    def _layer_done(self, transfer_id: str, index: int, result: TransferResult) -> None:
        """The transfer thread: one layer's WRITE ended (or is stuck)."""
        with self._lock:
            push = self._layered.get(transfer_id)
            if push is None:
                return
            if result.stuck:
                first = not push.writes.stuck_reported
                push.writes.stuck_reported = True
            else:
                layer = push.ends[index].ended(_part_end(result))  # None while a decode rank's WRITE runs
                end = None if layer is None else self._layered_end(push, push.writes.layer_ended(
                    index, layer.ok, layer.bytes, layer.descriptors, layer.error))
        if result.stuck:  # still posted: our blocks and decode's stay held until it ends
            if first:
                self._fail(transfer_id, push.match.registration.decode_engine_id, WriteStuck(result.error))
            return
        if end is not None:
            self._layered_ended(push, end)

    def _layered_end(self, push: _LayeredPush, end: Written | NotWritten | None) -> Written | NotWritten | None:
        """Under the lock: the write's ``end``, once decided (given once): it is then forgotten."""
        if end is not None:
            self._layered.pop(push.match.transfer_id, None)
            self._book.write_ended(push.match.transfer_id, push.match.prefill.request_id,
                                   isinstance(end, Written))
        return end

    def _layered_ended(self, push: _LayeredPush, end: Written | NotWritten) -> None:
        match = push.match
        decode_engine_id = match.registration.decode_engine_id
        self._wake()  # the prompt's blocks may go back
        if isinstance(end, NotWritten):
            landed = f"{end.layers_landed} of {push.writes.layers} layers landed"
            error = Revoked(f"{end.reason}; {landed}") if end.stopped else WriteFailed(f"{end.reason}; {landed}")
            self._fail(match.transfer_id, decode_engine_id, error)
            return
        record_transfer(TransferResult(match.transfer_id, True, bytes=end.bytes, descriptors=end.descriptors,
                                       write_ms=(time.perf_counter() - push.started) * 1000))
        self._done(match, end.bytes, end.descriptors, push.started)

    # ---------------------------------------------------------------- failures

    def _fail_match(self, match: Match[wire.Registration, ReadyPrefill], error: TransferError,
                    layered: bool = False) -> None:
        with self._lock:  # closed: a copy of the registration sent again gets the answer; nothing in flight
            if layered:
                self._layered.pop(match.transfer_id, None)
            self._book.write_not_posted(match.transfer_id, match.prefill.request_id)
        self._wake()  # its blocks may go back
        self._fail(match.transfer_id, match.registration.decode_engine_id, error)

    def _give_back(self, request_id: str) -> None:
        """A prefill's blocks hold nothing decode will take: let vLLM free them."""
        with self._lock:
            self._book.give_back(request_id)
        self._wake()

    def _fail(self, transfer_id: str, decode_engine_id: str, error: TransferError) -> None:
        report_failure(self.bridge, self.engine_id, self.rank, transfer_id, decode_engine_id, error)

    def _refuse(self, refused: Refuse) -> None:
        """A message about one of our transfers from a peer that has no part in it."""
        self.bridge.refuse(refusal(self.engine_id, wire.KV_CONTROL.partly(engine_id=self.engine_id),
                                   ValueError(f"{refused.transfer_id}: {refused.reason}"), WrongParty))


def _part_end(result: TransferResult) -> PartEnd:
    return PartEnd(result.ok, result.bytes, result.descriptors, result.error, result.write_ms)
