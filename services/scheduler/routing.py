"""The live worker set, from heartbeats, and the choice of workers for a request.

Pure: no NATS. Time is passed in, so tests drive it directly.

Verdicts (``is_live``: is that start of a worker gone?) rest on fresh evidence only. While
the scheduler cannot hear heartbeats (NATS is down: ``pause_evidence``) no worker is
declared lost. After an outage or a stall of the scheduler's own loop
(``resume_evidence``) a worker counts as heard at that moment: it is lost only if a whole
timeout then passes without its heartbeat. Routing still picks only workers heard
within the timeout.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared import wire
from shared.errors import NoWorkers


@dataclass
class _Entry:
    beat: wire.WorkerHeartbeat
    seen_at: float
    dispatched: int = 0  # jobs sent since this heartbeat, not yet reflected in it


class WorkerPool:
    def __init__(self, stale_after_s: float = 5.0, forget_after_s: float = 600.0, max_workers: int = 10_000):
        self.stale_after_s = stale_after_s
        self.forget_after_s = forget_after_s  # a worker silent this long is dropped from the pool
        self.max_workers = max_workers
        self._workers: dict[str, _Entry] = {}
        self._roles_seen: set[str] = set()
        self._evidence_paused = False
        self._evidence_from = float("-inf")  # heartbeats before this could not be heard

    def observe(self, beat: wire.WorkerHeartbeat, now: float) -> None:
        self._workers.pop(beat.worker_id, None)  # re-inserted last: the dict stays ordered by last heartbeat
        self._workers[beat.worker_id] = _Entry(beat, now)
        self._roles_seen.add(beat.role)
        self._prune(now)

    def _prune(self, now: float) -> None:
        while self._workers:
            oldest = next(iter(self._workers.values()))
            if len(self._workers) <= self.max_workers and now - oldest.seen_at <= self.forget_after_s:
                return
            del self._workers[oldest.beat.worker_id]

    def pause_evidence(self) -> None:
        """Heartbeats cannot arrive now (NATS is down): declare no worker lost."""
        self._evidence_paused = True

    def resume_evidence(self, now: float) -> None:
        """Heartbeats can be heard again from ``now`` (NATS is back, or our loop stalled)."""
        self._evidence_paused = False
        self._evidence_from = now

    def __len__(self) -> int:
        return len(self._workers)

    def has_served(self) -> bool:
        """Workers of both roles have heartbeated at some point: if none is live now, they
        are down (crashed, restarting), not absent from this deployment."""
        return {"prefill", "decode"} <= self._roles_seen

    def live(self, role: str, now: float) -> list[wire.WorkerHeartbeat]:
        return [e.beat for e in self._live_entries(role, now)]

    def _live_entries(self, role: str, now: float) -> list[_Entry]:
        return [
            e
            for e in self._workers.values()
            if e.beat.role == role and now - e.seen_at <= self.stale_after_s
        ]

    def pick(self, num_prompt_tokens: int, now: float) -> tuple[str, str]:
        """(prefill worker id, decode worker id) for a new request."""
        prefills = self._live_entries("prefill", now)
        decodes = self._live_entries("decode", now)
        if not prefills or not decodes:
            raise NoWorkers(
                f"no live workers to serve the request: {len(prefills)} prefill, {len(decodes)} decode"
            )
        return self.pick_prefill(now), self.pick_decode(num_prompt_tokens, now)

    def require(self, role: str, now: float) -> None:
        """Raise NoWorkers unless a worker of ``role`` is live."""
        if not self._live_entries(role, now):
            raise NoWorkers(f"no live {role} worker to serve the request")

    def pick_prefill(self, now: float) -> str:
        prefills = self._live_entries("prefill", now)
        if not prefills:
            raise NoWorkers("no live prefill worker to serve the request")
        prefill = min(prefills, key=lambda e: (e.beat.running + e.beat.waiting + e.dispatched, e.beat.worker_id))
        prefill.dispatched += 1
        return prefill.beat.worker_id

    def pick_decode(self, num_prompt_tokens: int, now: float) -> str:
        decodes = self._live_entries("decode", now)
        if not decodes:
            raise NoWorkers("no live decode worker to serve the request")

        def free_after(e: _Entry) -> int:
            blocks_needed = -(-num_prompt_tokens // max(e.beat.block_size, 1))
            return e.beat.free_kv_blocks - blocks_needed * (e.dispatched + 1)

        # Among decode workers with room for the prompt, the least busy; else the emptiest.
        with_room = [e for e in decodes if free_after(e) >= 0]
        if with_room:
            decode = min(with_room, key=lambda e: (e.beat.running + e.beat.waiting + e.dispatched, -free_after(e), e.beat.worker_id))
        else:
            decode = max(decodes, key=lambda e: (free_after(e), e.beat.worker_id))
        decode.dispatched += 1
        return decode.beat.worker_id

    def is_live(self, worker_id: str, incarnation: str, now: float) -> bool:
        """That start of the worker heartbeats still (a restart under the same id is a new start)."""
        entry = self._workers.get(worker_id)
        if entry is None or entry.beat.incarnation != incarnation:
            return False  # forgotten, or restarted: that start is gone
        if self._evidence_paused:
            return True
        return now - max(entry.seen_at, self._evidence_from) <= self.stale_after_s

    def beat(self, worker_id: str) -> wire.WorkerHeartbeat | None:
        entry = self._workers.get(worker_id)
        return entry.beat if entry else None

    def connector(self, now: float) -> str:
        """The KV connector the live prefill workers run ("kvpush" when none is known)."""
        prefills = self._live_entries("prefill", now)
        return prefills[0].beat.connector if prefills else "kvpush"

    def forget(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)
