"""The prefill half of a worker rank: where a finished prompt's KV leaves.

Push: a finished prefill (from this step's metadata, after the forward pass) and a
decode registration (from NATS) meet in the rendezvous; the match becomes a WRITE for
the transfer thread, and its end a completion event for decode. Pull: the prompt's
blocks are held (``ServedReads``) until decode's READ notification came.

Faults. A finished prompt's blocks, and a registration waiting for its prompt, are held
under a lease that decode renews (``LeaseRenewal``); expiry frees the blocks and tells
decode and the schedulers (``LeaseExpired``). A ``Revoke`` gives the transfer up: no
write starts, and decode gets its answer once no write of ours can still land. A write
that does not end is reported stuck (``WriteStuck``) and its blocks stay held, on both
sides, until it ends; then its end is reported.

Trust. A registration or revoke comes from the decode its subject names (the bridge
refuses a forged one). It is used only if it carries the transfer's key, which the
scheduler gave only to us and the decode it chose, and (push) comes from that decode.
Decode's READ notifications (pull) count only with a tag made with that key over our blocks.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import OrderedDict
from typing import Callable

from opentelemetry import trace

from connector import chaos, kv_layout
from connector.agents import AgentDirectory
from connector.bridge import NatsBridge
from connector.completion import CompletionCounter, Notification, block_tag, keys_match, notification, tag_matches
from connector.leases import ServedReads
from connector.metadata import KvpushMetadata, ReadyPrefill
from connector.outcomes import record_transfer, report_failure
from connector.rendezvous import Match, Refused, Rendezvous
from connector.transfer_thread import TransferJob, TransferResult, TransferThread
from otel import attributes as A
from otel.messaging import context_from_traceparent
from otel.metrics import instruments
from shared import wire
from shared.errors import (
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
MAX_KEYS = 20_000  # transfer keys of transfers under way (a bound, should many never end)


def pair_problem(registration: wire.Registration, ready: ReadyPrefill) -> str | None:
    """Why this registration must not receive this prefill's KV, or None."""
    if ready.decode_engine_id and registration.decode_engine_id != ready.decode_engine_id:
        return f"registration from {registration.decode_engine_id}, but the scheduler chose {ready.decode_engine_id}"
    if not keys_match(registration.transfer_key, ready.transfer_key):
        return "the registration does not carry the transfer's key"
    if ready.num_tokens and registration.num_tokens != ready.num_tokens:
        return f"registration for {registration.num_tokens} tokens, the prompt has {ready.num_tokens}"
    if not 0 <= registration.first_block < len(ready.block_ids):
        return f"registration starts at block {registration.first_block}, the prompt fills {len(ready.block_ids)}"
    if len(registration.block_ids) != len(ready.block_ids) - registration.first_block:
        return (f"registration names {len(registration.block_ids)} blocks from block {registration.first_block}, "
                f"the prompt fills {len(ready.block_ids)}")
    return None


@dataclasses.dataclass
class _Move:
    """Where a transfer goes now that a scheduler moved it, and the keys it had before
    (each move's proves it is the transfer's): a Revoke from another decode with one of
    them comes from a decode it moved away from, and is answered at once."""

    decode_engine_id: str
    transfer_key: str
    earlier_keys: list[str]


def sources(registration: wire.Registration, ready: ReadyPrefill) -> list[int]:
    """Our blocks to write into the registration's: those decode does not hold already."""
    return ready.block_ids[registration.first_block:]


class Producer:
    def __init__(self, engine_id: str, rank: int, tp_size: int, bridge: NatsBridge, agents: AgentDirectory,
                 lease_s: float):
        self.engine_id = engine_id
        self.rank = rank
        self.tp_size = tp_size
        self.bridge = bridge
        self.agents = agents
        self.lease_s = lease_s
        self.transfer: TransferThread | None = None
        self._wake: Callable[[], None] = lambda: None
        self._rendezvous: Rendezvous[wire.Registration, ReadyPrefill] = Rendezvous(lease_s, check=pair_problem)
        self._counter = CompletionCounter()  # decode's READ notifications
        self._lock = threading.Lock()  # protects the sets and the served reads below
        self._sent: set[str] = set()  # request ids whose blocks may go back (KV left, or given up)
        self._finished: set[str] = set()  # request ids vLLM reported finished
        self._pushing: set[str] = set()  # request ids whose blocks we hold for a transfer
        self._writing: set[str] = set()  # transfer ids matched, whose WRITE has not ended (or was never posted)
        self._served = ServedReads(lease_s)  # pull: blocks held for decode's READ
        # transfer id -> (its key, our blocks for a pull READ's tag); dropped once the transfer ended
        self._keys: OrderedDict[str, tuple[str, list[int]]] = OrderedDict()
        # Revokes that came before either half, so could not be checked: checked when one comes.
        self._unchecked_revokes: OrderedDict[str, wire.Revoke] = OrderedDict()
        self._moves: OrderedDict[str, _Move] = OrderedDict()  # transfer id -> where a scheduler moved it

    def attach(self, transfer: TransferThread, wake: Callable[[], None]) -> None:
        """The rank's transfer thread, and what to call when blocks may go back."""
        self.transfer = transfer
        self._wake = wake

    def subscriptions(self):
        """(subject, message kind, handler) for the worker to subscribe."""
        return [(wire.KV_CONTROL.partly(engine_id=self.engine_id), wire.KvControl, self.on_kv_control),
                (wire.KV_MOVES.partly(engine_id=self.engine_id), wire.MoveTransfer, self.on_move)]

    # ---------------------------------------------------------------- vLLM's worker thread

    def wait_for_save(self, meta: KvpushMetadata) -> None:
        """After the forward pass: these prefills' KV is now in their blocks."""
        for ready in meta.ready_prefills:
            chaos.point("producer.ready")
            with self._lock:
                ready = self._moved(ready)
                self._pushing.add(ready.request_id)
                self._keys[ready.transfer_id] = (ready.transfer_key, ready.block_ids if ready.mode == "pull" else [])
                while len(self._keys) > MAX_KEYS:
                    self._keys.popitem(last=False)
                revoke = self._unchecked_revokes.pop(ready.transfer_id, None)
            if revoke is not None and (not keys_match(revoke.transfer_key, ready.transfer_key) or (
                    ready.decode_engine_id and revoke.decode_engine_id != ready.decode_engine_id)):
                self._forged_early_revoke(revoke)
            if ready.mode == "pull":
                with self._lock:
                    self._served.hold(ready.transfer_id, ready.request_id, time.monotonic())
                self.transfer.expect(1)
                continue
            self._settle(self._offer(lambda: self._rendezvous.offer_prefill(ready.transfer_id, ready)), ready)

    def get_finished(self, finished_req_ids: set[str]) -> set[str]:
        """Requests vLLM finished whose blocks may now be freed (their KV left, or will not)."""
        with self._lock:
            self._finished |= finished_req_ids & self._pushing
            sending = self._finished & self._sent
            self._finished -= sending
            self._sent -= sending
            self._pushing -= sending
        return sending

    def busy(self) -> bool:
        """Blocks are held for a transfer that has not ended."""
        with self._lock:
            return bool(self._pushing)

    # ---------------------------------------------------------------- the clock

    def tick(self, now: float) -> None:
        for transfer_id, half in self._rendezvous.expired():
            ready = half.prefill
            decode_engine_id = half.registration.decode_engine_id if half.registration else (
                ready.decode_engine_id if ready else "")
            if ready is not None:
                self._give_back(ready.request_id)
            self._fail(transfer_id, decode_engine_id,
                       LeaseExpired(f"decode did not renew the lease within {self.lease_s:g} s"))
        with self._lock:
            lapsed = self._served.lapsed(now)
        for transfer_id, request_id in lapsed:
            self.transfer.expect(-1)
            self._give_back(request_id)
            self._fail(transfer_id, "", LeaseExpired("decode did not read the KV within its lease"))

    # ---------------------------------------------------------------- the transfer thread

    def serves(self, transfer_id: str) -> bool:
        """Pull: decode is to READ this transfer's blocks from us."""
        with self._lock:
            return self._served.holds(transfer_id)

    def read_notified(self, note: Notification) -> None:
        """Decode's READ notification: once every rank's came, the blocks may go back."""
        transfer_id = note.transfer_id
        with self._lock:
            key, block_ids = self._keys.get(transfer_id, ("", []))
        if not tag_matches(note.tag, key, block_ids):
            self._refuse(transfer_id, "a READ notification without the transfer's tag over our blocks")
            return
        if not self._counter.record(transfer_id, note.rank, note.num_ranks):
            return
        self._counter.take_done([transfer_id])  # leaves a tombstone against late duplicates
        with self._lock:
            request_id = self._served.release(transfer_id)
            self._keys.pop(transfer_id, None)
        if request_id is not None:
            self.transfer.expect(-1)
            self._give_back(request_id)

    # ---------------------------------------------------------------- NATS

    def on_kv_control(self, message: wire.KvControl) -> None:
        match message:
            case wire.LeaseRenewal():
                for transfer_id in message.transfer_ids:
                    if not self._rendezvous.renew(transfer_id):
                        self._renew_read(transfer_id)
            case wire.Revoke():
                self._on_revoke(message)
            case wire.Registration():
                self._on_registration(message)

    # ---------------------------------------------------------------- moves

    def _moved(self, ready: ReadyPrefill) -> ReadyPrefill:
        """The prefill as the newest move of its transfer says. Called under _lock."""
        move = self._moves.get(ready.transfer_id)
        if move is None or ready.mode != "push":
            return ready
        return dataclasses.replace(ready, decode_engine_id=move.decode_engine_id, transfer_key=move.transfer_key)

    def _current_key(self, transfer_id: str) -> str | None:
        """The transfer's key now, if a half or an earlier move shows it. Called under _lock."""
        move = self._moves.get(transfer_id)
        if move is not None:
            return move.transfer_key
        half = self._rendezvous.peek(transfer_id)
        if half is not None and half.prefill is not None:
            return half.prefill.transfer_key
        if half is not None and half.registration is not None:
            return half.registration.transfer_key
        return None

    def on_move(self, move: wire.MoveTransfer) -> None:
        """A scheduler moves a transfer to another decode: its first decode was lost or
        overloaded. Only before its write: once it began, the KV is that decode's."""
        transfer_id = move.transfer_id
        with self._lock:  # the critical section of a match, its "writing" mark and a Revoke
            key = self._current_key(transfer_id)
            problem = why = dropped = None
            if key is not None and not keys_match(move.transfer_key, key):
                problem = "a MoveTransfer without the transfer's key"
            elif transfer_id in self._writing:
                why = "its write has begun"
            elif self._served.holds(transfer_id):
                why = "a pull transfer: the decode chosen after prefill reads it"
            else:
                why, dropped = self._rendezvous.retarget(transfer_id, lambda ready: dataclasses.replace(
                    ready, decode_engine_id=move.decode_engine_id, transfer_key=move.new_transfer_key))
                if why is None:
                    earlier = self._moves.pop(transfer_id, None)
                    keys = [*(earlier.earlier_keys if earlier is not None else []), move.transfer_key]
                    self._moves[transfer_id] = _Move(move.decode_engine_id, move.new_transfer_key, keys)
                    while len(self._moves) > MAX_KEYS:
                        self._moves.popitem(last=False)
                    if transfer_id in self._keys:
                        self._keys[transfer_id] = (move.new_transfer_key, self._keys[transfer_id][1])
        if problem is not None:
            self._refuse(transfer_id, problem)
            return
        if why is None and dropped is not None:  # its blocks go back through its revoke, answered at once
            log.info("transfer %s moved from %s to %s", transfer_id, dropped.decode_engine_id, move.decode_engine_id)
        self.bridge.publish(
            wire.completion_subject(move.decode_engine_id, self.engine_id),
            wire.encode(wire.TransferMoved(transfer_id=transfer_id, prefill_engine_id=self.engine_id,
                                           decode_engine_id=move.decode_engine_id, moved=why is None,
                                           reason=why or "")),
        )

    def _moved_away(self, revoke: wire.Revoke) -> bool:
        """A Revoke from a decode this transfer was moved away from, with the key it had:
        no write of ours goes to it, so it is answered now. Called under _lock."""
        move = self._moves.get(revoke.transfer_id)
        if move is None or revoke.decode_engine_id == move.decode_engine_id:
            return False
        return any(keys_match(revoke.transfer_key, key) for key in move.earlier_keys)

    def _on_registration(self, registration: wire.Registration) -> None:
        with self._lock:
            move = self._moves.get(registration.transfer_id)
        if move is not None and registration.decode_engine_id != move.decode_engine_id:
            self._fail(registration.transfer_id, registration.decode_engine_id,
                       BadRegistration(f"the transfer moved to {move.decode_engine_id}"))
            return
        with self._lock:
            revoke = self._unchecked_revokes.get(registration.transfer_id)
            if revoke is not None and revoke.decode_engine_id != registration.decode_engine_id:
                del self._unchecked_revokes[registration.transfer_id]
            else:
                revoke = None
        if revoke is not None:
            self._forged_early_revoke(revoke)
        if registration.decode_tp_size != self.tp_size:
            self._fail(registration.transfer_id, registration.decode_engine_id,
                       TpMismatch(f"decode has TP {registration.decode_tp_size}, prefill has TP {self.tp_size}"))
            return
        self._settle(self._offer(lambda: self._rendezvous.offer_registration(registration.transfer_id, registration)))

    def _offer(self, offer: Callable[[], Match | Refused | None]) -> Match | Refused | None:
        """Offer a half. A match is marked "writing" in the same critical section that a
        Revoke reads it in: a Revoke never sees a match without its write, so it is never
        answered while a WRITE can still be posted."""
        with self._lock:
            outcome = offer()
            if isinstance(outcome, Match):
                self._writing.add(outcome.transfer_id)
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

    def _revoke_problem(self, revoke: wire.Revoke) -> str | None:
        """Why this revoke is not from the transfer's decode, or None. Called under _lock."""
        known = self._keys.get(revoke.transfer_id)
        if known is not None:
            if not keys_match(revoke.transfer_key, known[0]):
                return "a Revoke without the transfer's key"
            return None
        half = self._rendezvous.peek(revoke.transfer_id)
        if half is not None and half.registration is not None:
            registration = half.registration
            if (registration.decode_engine_id != revoke.decode_engine_id
                    or not keys_match(revoke.transfer_key, registration.transfer_key)):
                return f"a Revoke from {revoke.decode_engine_id} for a registration of {registration.decode_engine_id}"
        elif half is None:
            # Nothing to check it against yet: it closes the transfer (a registration that
            # comes late must not be written to), and is checked once a half comes.
            self._unchecked_revokes[revoke.transfer_id] = revoke
            while len(self._unchecked_revokes) > MAX_KEYS:
                self._unchecked_revokes.popitem(last=False)
        return None

    def _forged_early_revoke(self, revoke: wire.Revoke) -> None:
        """A revoke that came before either half proved forged once one came: undo it."""
        self._rendezvous.reopen(revoke.transfer_id)
        self._refuse(revoke.transfer_id, f"a Revoke from {revoke.decode_engine_id} without the transfer's key")

    def _on_revoke(self, revoke: wire.Revoke) -> None:
        with self._lock:  # the same critical section as a match and its "writing" mark
            moved_away = self._moved_away(revoke)
            problem = None if moved_away else self._revoke_problem(revoke)
            if not moved_away and problem is None:
                half, matched = self._rendezvous.close(revoke.transfer_id, "revoked")
                writing = revoke.transfer_id in self._writing
                served = self._served.release(revoke.transfer_id)
        if moved_away:
            self._fail(revoke.transfer_id, revoke.decode_engine_id,
                       Revoked("the transfer moved to another decode; nothing was written to yours"))
            return
        if problem is not None:
            self._refuse(revoke.transfer_id, problem)
            return
        if half is not None and half.prefill is not None:
            self._give_back(half.prefill.request_id)
        if served is not None:
            self.transfer.expect(-1)
            self._give_back(served)
        if writing:
            return  # the write's own completion event answers, once nothing more can land
        written = " after it was written" if matched else "; nothing was written"
        self._fail(revoke.transfer_id, revoke.decode_engine_id, Revoked(f"decode gave the transfer up{written}"))

    def _renew_read(self, transfer_id: str) -> None:
        with self._lock:
            self._served.renew(transfer_id, time.monotonic())

    # ---------------------------------------------------------------- writes

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
        self.agents.with_agent(
            match.registration.decode_engine_id,
            lambda remote, why: self._submit_write(match, remote) if remote else self._fail_match(
                match, AgentUnreachable(why)),
            incarnation=match.registration.decode_incarnation,
        )

    def _submit_write(self, match: Match[wire.Registration, ReadyPrefill], remote: wire.AgentInfo) -> None:
        registration, ready = match.registration, match.prefill
        problem = kv_layout.copy_problem(self.transfer.layout, remote, sources(registration, ready),
                                         registration.block_ids)
        if problem is not None:
            self._fail_match(match, BadRegistration(problem))
            return
        started = time.perf_counter()

        def on_done(result: TransferResult) -> None:
            if result.stuck:  # still posted: our blocks and decode's stay held until it ends
                self._fail(match.transfer_id, registration.decode_engine_id, WriteStuck(result.error))
                return
            with self._lock:
                self._sent.add(ready.request_id)
                self._writing.discard(match.transfer_id)
                self._keys.pop(match.transfer_id, None)  # a later Revoke finds the transfer matched: answered
            self._wake()
            if not result.ok:
                self._rendezvous.close(match.transfer_id, "failed")
                self._fail(match.transfer_id, registration.decode_engine_id, WriteFailed(result.error))
                return
            record_transfer(result)
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
                sources(registration, ready),
                registration.block_ids,
                notification(match.transfer_id, self.rank, self.tp_size,
                             block_tag(ready.transfer_key, registration.block_ids)),
                on_done,
                parent=context_from_traceparent(ready.traceparent),
            )
        )

    def _fail_match(self, match: Match[wire.Registration, ReadyPrefill], error: TransferError) -> None:
        self._rendezvous.close(match.transfer_id, "failed")  # a copy of the registration sent again gets the answer
        with self._lock:
            self._writing.discard(match.transfer_id)
        self._give_back(match.prefill.request_id)  # nothing in flight: free the blocks
        self._fail(match.transfer_id, match.registration.decode_engine_id, error)

    def _give_back(self, request_id: str) -> None:
        """A prefill's blocks hold nothing decode will take: let vLLM free them."""
        with self._lock:
            self._sent.add(request_id)
        self._wake()

    def _fail(self, transfer_id: str, decode_engine_id: str, error: TransferError) -> None:
        report_failure(self.bridge, self.engine_id, self.rank, transfer_id, decode_engine_id, error)

    def _refuse(self, transfer_id: str, why: str) -> None:
        """A message about one of our transfers from a peer that has no part in it."""
        self.bridge.refuse(refusal(self.engine_id, wire.KV_CONTROL.partly(engine_id=self.engine_id),
                                   ValueError(f"{transfer_id}: {why}"), WrongParty))
