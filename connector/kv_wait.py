"""Decode's watch over blocks it registered for a transfer: when they may go back to vLLM.

Pure Python and thread-safe (the transfer thread reports arrivals, the NATS thread
reports prefill's answers, vLLM's worker thread asks what to release). Time is passed
in, so tests drive it directly.

A wait ends in one of three ways:

- the KV arrived (all producer ranks notified, or our READ completed): hand the
  request to vLLM;
- prefill answered that no write of its will land in the blocks (it failed, or it
  gave the transfer up): release them and report the load as failed, so vLLM
  recomputes the prompt or fails the request, per the deployment's policy;
- decode gave up (the request was aborted, or the KV took longer than ``kv_wait_s``):
  revoke the transfer at prefill and keep the blocks quarantined until prefill
  answers, a write lands, or ``quarantine_s`` passed without a word from prefill
  (a dead peer writes nothing). Blocks are never released while a write may land;
- one of several prefill ranks writing into the blocks (tensor parallelism) said its
  part will not land while the others have not answered (``writer_failed``): the load
  fails with that rank's code, the transfer is revoked so the others stop, and the
  blocks are kept as after decode gave up: until the others answered
  (``prefill_gave_up``) or ``quarantine_s`` passed;
- prefill said its write is stuck (posted, not ended, and NIXL cannot cancel it): no
  timer frees the blocks then. They stay held until prefill answers again (the write
  ended) or its process is proven gone (``prefill_gone``); ``stuck()`` lists them, for
  a metric and an alert.

Each end carries a short code, decided where the end is decided (``Released.code``): the
load-failure metric's label and the path report's ``kv_failure``. Prefill's answers bring
prefill's error code (``kvpush.shared.errors``); decode's own ends have ``OwnCode``s.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Literal

from kvpush.shared import settings

# Decode's own codes for why it stopped waiting for the KV: it waited ``kv_wait_s`` in vain,
# vLLM finished (aborted) the request, or prefill's write is stuck (such a wait ends with
# prefill's later answer, and its code); and for a load that failed with no code of
# prefill's to name it (prefill's process is gone, or its answer named no code).
OwnCode = Literal["kv_wait_expired", "aborted", "write_stuck", "kv_load_failed"]


@dataclass(slots=True)
class Waiting:
    request_id: str
    transfer_id: str
    deadline: float
    context: Any = None  # the caller's (a span, the prefill engine id)
    arrived: bool = False
    arrived_at: float | None = None  # the caller's timestamp of the arrival
    prefill_answered: str | None = None  # prefill said no write will land, and why
    prefill_code: str = ""  # ...and prefill's error code for it
    given_up: str | None = None  # decode revoked the transfer, and why
    given_up_code: str | None = None  # ...and its code: decode's own (OwnCode), or a failed writer's
    revoked_at: float | None = None
    request_finished: bool = False  # vLLM finished (aborted) the request while it waited
    stuck: str | None = None  # prefill's write into the blocks is stuck: held until it answers again
    last_sent: float = 0.0  # when the registration (or, once given up, the Revoke) last went to prefill


@dataclass(frozen=True, slots=True)
class Released:
    request_id: str
    transfer_id: str
    arrived: bool
    reason: str  # "" when arrived
    # Why, as a short code ("" when arrived): the error code prefill (or our own check)
    # answered with, or decode's own (``OwnCode``) when decode gave the wait up first.
    code: str
    request_finished: bool
    context: Any = None
    arrived_at: float | None = None

    @property
    def failed(self) -> bool:
        """A live request whose KV will not come: vLLM must recompute it or fail it."""
        return not self.arrived and not self.request_finished


@dataclass
class KvWaits:
    kv_wait_s: float = settings.FAULTS.kv_wait_s
    quarantine_s: float = settings.FAULTS.quarantine_s
    max_early: int = 10_000
    _waits: dict[str, Waiting] = field(default_factory=dict)
    # tid -> (arrived at, (code, why) it failed): what came before the wait started
    _early: dict[str, tuple[float | None, tuple[str, str] | None]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)  # protects _waits and _early

    def start(self, request_id: str, transfer_id: str, now: float, context: Any = None) -> Waiting:
        with self._lock:
            wait = self._waits[transfer_id] = Waiting(request_id, transfer_id, now + self.kv_wait_s, context,
                                                      last_sent=now)
            if transfer_id in self._early:
                arrived_at, failure = self._early.pop(transfer_id)
                wait.arrived, wait.arrived_at = failure is None, arrived_at
                if failure is not None:
                    wait.prefill_code, wait.prefill_answered = failure
            return wait

    def arrived(self, transfer_id: str, at: float | None = None) -> bool:
        """All the KV is in the blocks (``at``: when, the caller's clock); False if nobody
        waits for it (yet)."""
        with self._lock:
            wait = self._waits.get(transfer_id)
            if wait is None:
                self._remember_early(transfer_id, (at, None))
                return False
            wait.arrived, wait.arrived_at = True, at
            return True

    def prefill_gave_up(self, transfer_id: str, reason: str, *, code: str) -> None:
        """Prefill answered: no write of its will land in the blocks (``code``: prefill's
        error code for why, or our own check's)."""
        code = _prefill_code(code)
        with self._lock:
            wait = self._waits.get(transfer_id)
            if wait is None:
                self._remember_early(transfer_id, (None, (code, reason)))
            elif wait.prefill_answered is None:
                wait.prefill_code, wait.prefill_answered = code, reason

    def writer_failed(self, transfer_id: str, reason: str, *, code: str, now: float) -> Waiting | None:
        """One prefill rank writing into the blocks said its part will not land, and others
        have not answered yet: give the wait up with that rank's ``code`` and ``reason``
        (the wait is returned, to revoke the transfer, the first time), and keep the blocks
        until the others answered (``prefill_gave_up``) or ``quarantine_s`` passed."""
        with self._lock:
            wait = self._waits.get(transfer_id)
            if wait is not None and self._give_up(wait, _prefill_code(code), reason, now):
                return wait
            return None

    def write_stuck(self, transfer_id: str, reason: str, now: float) -> bool:
        """Prefill's write into the blocks is posted and will not end soon: stop waiting
        for the KV, but keep the blocks until prefill's next answer. False if unknown."""
        with self._lock:
            wait = self._waits.get(transfer_id)
            if wait is None or wait.arrived or wait.prefill_answered is not None:
                return False
            wait.stuck = reason
            if wait.given_up is None:
                wait.given_up, wait.revoked_at = f"prefill's write is stuck: {reason}", now
                wait.given_up_code = "write_stuck"
            return True

    def write_ended(self, transfer_id: str, reason: str, *, code: str) -> None:
        """Prefill's stuck write ended after all (it answers for the blocks now, with
        ``code``)."""
        self._stuck_write_answered(transfer_id, _prefill_code(code), reason)

    def prefill_gone(self, transfer_id: str, proof: str) -> None:
        """The process that posted a stuck write is gone: nothing of it can land any more."""
        self._stuck_write_answered(transfer_id, "kv_load_failed", f"prefill is gone ({proof})")

    def stuck(self) -> list[Waiting]:
        with self._lock:
            return [wait for wait in self._waits.values() if wait.stuck is not None and wait.prefill_answered is None]

    def requests_finished(self, request_ids: set[str], now: float) -> list[Waiting]:
        """vLLM finished these requests; those still waiting must be revoked (returned)."""
        to_revoke = []
        with self._lock:
            for wait in self._waits.values():
                if wait.request_id in request_ids and not wait.request_finished:
                    wait.request_finished = True
                    if self._give_up(wait, "aborted", "aborted", now):
                        to_revoke.append(wait)
        return to_revoke

    def tick(self, now: float) -> tuple[list[Waiting], list[Released]]:
        """(waits to revoke now because their KV is overdue, waits that ended)."""
        to_revoke: list[Waiting] = []
        released: list[Released] = []
        with self._lock:
            for transfer_id, wait in list(self._waits.items()):
                if not wait.arrived and wait.prefill_answered is None and now >= wait.deadline:
                    if self._give_up(wait, "kv_wait_expired", f"no KV within {self.kv_wait_s:g} s", now):
                        to_revoke.append(wait)
                ended = self._end(wait, now)
                if ended is None:
                    continue
                code, reason = ended
                del self._waits[transfer_id]
                released.append(
                    Released(wait.request_id, transfer_id, wait.arrived, reason, code, wait.request_finished,
                             wait.context, wait.arrived_at)
                )
        return to_revoke, released

    def due_for_resend(self, now: float, every_s: float) -> list[Waiting]:
        """Waits still open whose registration went out ``every_s`` ago or more (it may
        have been lost); their send time is reset."""
        due = []
        with self._lock:
            for wait in self._waits.values():
                still_open = not wait.arrived and wait.prefill_answered is None and wait.given_up is None
                if still_open and now - wait.last_sent >= every_s:
                    wait.last_sent = now
                    due.append(wait)
        return due

    def revokes_due(self, now: float, every_s: float) -> list[Waiting]:
        """Waits given up that prefill has not answered, whose Revoke went out ``every_s``
        ago or more (it may have been lost); their send time is reset."""
        due = []
        with self._lock:
            for wait in self._waits.values():
                unanswered = wait.given_up is not None and not wait.arrived and wait.prefill_answered is None
                if unanswered and wait.stuck is None and now - wait.last_sent >= every_s:
                    wait.last_sent = now
                    due.append(wait)
        return due

    def get(self, transfer_id: str) -> Waiting | None:
        with self._lock:
            return self._waits.get(transfer_id)

    def waiting(self) -> int:
        with self._lock:
            return len(self._waits)

    def _stuck_write_answered(self, transfer_id: str, code: str, reason: str) -> None:
        with self._lock:
            wait = self._waits.get(transfer_id)
            if wait is not None and wait.stuck is not None and wait.prefill_answered is None:
                wait.prefill_code, wait.prefill_answered = code, reason

    def _give_up(self, wait: Waiting, code: str, why: str, now: float) -> bool:
        if wait.arrived or wait.prefill_answered is not None or wait.given_up is not None:
            return False
        wait.given_up, wait.given_up_code, wait.revoked_at = why, code, now
        wait.last_sent = now  # the Revoke goes out now
        return True

    def _end(self, wait: Waiting, now: float) -> tuple[str, str] | None:
        """(code, why) the wait ends now, or None while it goes on."""
        if wait.arrived:
            return "", ""
        if wait.prefill_answered is not None:
            if wait.stuck or wait.given_up is None:
                return wait.prefill_code, wait.prefill_answered
            return wait.given_up_code, wait.given_up  # decode had given up first: its reason stands
        if wait.stuck is not None:
            return None  # a write may still land: only prefill's answer or its end frees the blocks
        if wait.revoked_at is not None and now >= wait.revoked_at + self.quarantine_s:
            return wait.given_up_code, f"{wait.given_up}; prefill silent for {self.quarantine_s:g} s"
        return None

    def _remember_early(self, transfer_id: str, what: tuple[float | None, tuple[str, str] | None]) -> None:
        self._early[transfer_id] = what
        while len(self._early) > self.max_early:
            del self._early[next(iter(self._early))]


def _prefill_code(code: str) -> str:
    """Prefill's error code as a wait's code: one that is not a code (a peer's bad field)
    counts as ``kv_load_failed``, so the metric's label stays one of a known few."""
    return code if code.isidentifier() else "kv_load_failed"
