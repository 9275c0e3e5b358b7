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

from kvpush.services.scheduler.placement import DecodeLoad, PromptLoad
from kvpush.services.scheduler.prefix_sources import Engine
from kvpush.services.scheduler.prefixes import PrefixIndex, Prompt
from kvpush.shared import settings, wire
from kvpush.shared.errors import NoWorkers


@dataclass
class _Entry:
    beat: wire.WorkerHeartbeat
    seen_at: float
    dispatched: int = 0  # jobs sent since this heartbeat, not yet reflected in it
    dispatched_tokens: int = 0  # their prompt tokens

    def queued_tokens(self) -> int:
        return self.beat.queued_prompt_tokens + self.dispatched_tokens

    def busy(self) -> int:
        return self.beat.running + self.beat.waiting + self.dispatched


class WorkerPool:
    """``prefixes``: what each worker holds in its prefix cache, from its engine's events;
    with a ``prompt``, a pick prefers the workers that hold more of it."""

    def __init__(self, stale_after_s: float = 5.0, forget_after_s: float = 600.0, max_workers: int = 10_000,
                 prefixes: PrefixIndex | None = None, prefix_weight: float = settings.PREFIX_WEIGHT):
        self.prefixes = prefixes if prefixes is not None else PrefixIndex()
        self.prefix_weight = prefix_weight
        self.fetch_credit = 0.0  # with fetching on: a prefix a prefill could fetch counts this much of one it holds
        self.stale_after_s = stale_after_s
        self.forget_after_s = forget_after_s  # a worker silent this long is dropped from the pool
        self.max_workers = max_workers
        self._workers: dict[str, _Entry] = {}
        self._roles_seen: set[str] = set()
        self._evidence_paused = False
        self._evidence_from = float("-inf")  # heartbeats before this could not be heard
        self._avoid_until: dict[str, float] = {}  # worker id -> until when no new request goes to it

    def observe(self, beat: wire.WorkerHeartbeat, now: float) -> None:
        self._workers.pop(beat.worker_id, None)  # re-inserted last: the dict stays ordered by last heartbeat
        self.prefixes.started(beat.worker_id, beat.incarnation)  # a new start has an empty cache
        self._workers[beat.worker_id] = _Entry(beat, now)
        self._roles_seen.add(beat.role)
        self._prune(now)

    def _prune(self, now: float) -> None:
        while self._workers:
            oldest = next(iter(self._workers.values()))
            if len(self._workers) <= self.max_workers and now - oldest.seen_at <= self.forget_after_s:
                return
            del self._workers[oldest.beat.worker_id]
            self.prefixes.forget(oldest.beat.worker_id)

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

    def _pickable(self, role: str, now: float) -> list[_Entry]:
        """The live workers of ``role`` a new request may go to: not one avoided now."""
        return [e for e in self._live_entries(role, now) if self._avoid_until.get(e.beat.worker_id, 0.0) <= now]

    def avoid(self, worker_id: str, until: float) -> None:
        """Send ``worker_id`` nothing new until ``until``: it heartbeats, but its engine stalled."""
        self._avoid_until[worker_id] = until  # one entry a worker: bounded as the pool is

    def _cached_blocks(self, entry: _Entry, prompt: Prompt | None) -> int:
        if prompt is None:
            return 0
        return self.prefixes.cached_blocks(entry.beat.worker_id, prompt.keys(entry.beat.block_size))

    def cache_events(self, event: wire.CacheEvents) -> None:
        """What a worker's engine cached and evicted (its heartbeat's block size keys them).
        Only from the start its heartbeats come from: a dead one's late events are stale,
        and a worker is sent nothing to cache before its first heartbeat."""
        entry = self._workers.get(event.worker_id)
        if entry is None or entry.beat.incarnation != event.incarnation:
            return
        if event.cleared:
            self.prefixes.forget(event.worker_id)
        self.prefixes.removed(event.worker_id, event.incarnation, event.removed)
        self.prefixes.stored(event.worker_id, event.incarnation, event.stored, capacity=entry.beat.total_kv_blocks)

    def cached_tokens(self, worker_id: str, prompt: Prompt) -> int:
        """How much of the prompt ``worker_id`` likely holds in its prefix cache."""
        entry = self._workers.get(worker_id)
        return self._cached_blocks(entry, prompt) * entry.beat.block_size if entry is not None else 0

    def pick(self, num_prompt_tokens: int, now: float,
             prompt: Prompt | None = None) -> tuple[wire.WorkerHeartbeat, wire.WorkerHeartbeat]:
        """(the prefill's heartbeat, the decode's) for a new request: which start of each."""
        prefills = self._live_entries("prefill", now)
        decodes = self._live_entries("decode", now)
        if not prefills or not decodes:
            raise NoWorkers(
                f"no live workers to serve the request: {len(prefills)} prefill, {len(decodes)} decode"
            )
        return (self.pick_prefill(num_prompt_tokens, now, prompt=prompt),
                self.pick_decode(num_prompt_tokens, now, prompt=prompt))

    def require(self, role: str, now: float) -> None:
        """Raise NoWorkers unless a worker of ``role`` is live."""
        if not self._live_entries(role, now):
            raise NoWorkers(f"no live {role} worker to serve the request")

    def pick_prefill(self, num_prompt_tokens: int, now: float,
                     prompt: Prompt | None = None) -> wire.WorkerHeartbeat:
        """The prefill for a prompt of ``num_prompt_tokens``, counted as sent to it."""
        prefill = self._best_prefill(now, prompt)
        if prefill is None:
            raise NoWorkers("no live prefill worker to serve the request")
        prefill.dispatched += 1
        prefill.dispatched_tokens += num_prompt_tokens
        return prefill.beat

    def _best_prefill(self, now: float, prompt: Prompt | None = None) -> _Entry | None:
        """The prefill that would end a new prompt first: the fewest tokens to compute
        before it and of it (its cache holds some of them, or it could fetch them from the
        engine that holds the most: ``fetch_credit`` of those), then the fewest requests."""
        prefills = self._pickable("prefill", now)
        fetchable = 0.0
        if self.fetch_credit > 0 and prompt is not None:
            holder = self.holder(prompt, now)
            fetchable = holder.cached_tokens * self.fetch_credit if holder is not None else 0.0

        def saved(e: _Entry) -> float:
            own = self._cached_blocks(e, prompt) * e.beat.block_size
            return max(own, fetchable) if e.beat.lends else own

        return min(prefills, key=lambda e: (e.queued_tokens() - saved(e), e.busy(), e.beat.worker_id), default=None)

    def engine(self, worker_id: str, prompt: Prompt) -> Engine | None:
        """``worker_id`` as ``prefix_sources`` sees it: its share of the prompt and its load."""
        entry = self._workers.get(worker_id)
        return self._engine(entry, prompt) if entry is not None else None

    def _engine(self, entry: _Entry, prompt: Prompt) -> Engine:
        beat = entry.beat
        return Engine(beat.worker_id, beat.incarnation, self._cached_blocks(entry, prompt) * beat.block_size,
                      beat.block_size, entry.queued_tokens(), beat.prefill_tokens_per_s, beat.kv_bytes_per_block,
                      beat.lends)

    def holders(self, prompt: Prompt, now: float) -> list[Engine]:
        """The live engines, of either role, whose prefix caches likely hold some of the
        prompt, the most first."""
        held = [(self._cached_blocks(e, prompt) * e.beat.block_size, e)
                for role in ("prefill", "decode") for e in self._live_entries(role, now)]
        return [self._engine(e, prompt) for tokens, e in sorted(held, key=lambda t: (-t[0], t[1].beat.worker_id))
                if tokens > 0]

    def holder(self, prompt: Prompt, now: float) -> Engine | None:
        """The live engine holding the most of the prompt (among those that lend theirs,
        first); None if none holds any."""
        holders = self.holders(prompt, now)
        lending = [h for h in holders if h.lends]
        return (lending or holders or [None])[0]

    def prefill_load(self, now: float, prompt: Prompt | None = None) -> PromptLoad | None:
        """The load of the prefill ``pick_prefill`` would choose now, if any is live."""
        prefill = self._best_prefill(now, prompt)
        if prefill is None:
            return None
        return PromptLoad(prefill.queued_tokens(), prefill.beat.prefill_tokens_per_s,
                           self._cached_blocks(prefill, prompt) * prefill.beat.block_size)

    def decode_load(self, num_prompt_tokens: int, now: float, prompt: Prompt | None = None) -> DecodeLoad | None:
        """The load of the decode ``pick_decode`` would choose now, if any is live."""
        decode = self._best_decode(num_prompt_tokens, now, prompt)
        if decode is None:
            return None
        return DecodeLoad(decode.queued_tokens(), decode.beat.prefill_tokens_per_s,
                          self._cached_blocks(decode, prompt) * decode.beat.block_size,
                          running=decode.beat.running + decode.dispatched, waiting=decode.beat.waiting)

    def overloaded(self, decode_id: str, now: float, waiting: int = settings.OVERLOADED_WAITING) -> bool:
        """``decode_id`` has ``waiting`` requests queued in its engine while another live
        decode has none queued."""
        entry = self._workers.get(decode_id)
        if entry is None or entry.beat.waiting < waiting:
            return False
        return any(e.beat.waiting == 0 for e in self._live_entries("decode", now) if e.beat.worker_id != decode_id)

    def pick_decode(self, num_prompt_tokens: int, now: float, prompt: Prompt | None = None,
                    exclude: str | set[str] = "") -> wire.WorkerHeartbeat:
        """The decode for a prompt of ``num_prompt_tokens`` (not ``exclude``: one id or
        several), counted as sent to it."""
        decode = self._best_decode(num_prompt_tokens, now, prompt, exclude)
        if decode is None:
            raise NoWorkers("no live decode worker to serve the request")
        decode.dispatched += 1
        return decode.beat

    def _best_decode(self, num_prompt_tokens: int, now: float, prompt: Prompt | None = None,
                     exclude: str | set[str] = "") -> _Entry | None:
        excluded = {exclude} if isinstance(exclude, str) else exclude
        decodes = [e for e in self._pickable("decode", now) if e.beat.worker_id not in excluded]
        if not decodes:
            return None

        def score(e: _Entry) -> float:
            """Its load, less the share of the prompt its cache likely holds (worth
            ``prefix_weight`` requests when all of it is there)."""
            if prompt is None:
                return e.busy()
            held = self._cached_blocks(e, prompt) / max(prompt.blocks(e.beat.block_size), 1)
            return e.busy() - self.prefix_weight * held

        def free_after(e: _Entry) -> int:
            blocks_needed = -(-num_prompt_tokens // max(e.beat.block_size, 1))
            return e.beat.free_kv_blocks - blocks_needed * (e.dispatched + 1)

        # Among decode workers with room for the prompt, the least busy; else the emptiest.
        with_room = [e for e in decodes if free_after(e) >= 0]
        if with_room:
            return min(with_room, key=lambda e: (score(e), -free_after(e), e.beat.worker_id))
        return max(decodes, key=lambda e: (free_after(e), e.beat.worker_id))

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
        self.prefixes.forget(worker_id)
