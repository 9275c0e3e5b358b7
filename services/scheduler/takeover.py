"""Which flights no live scheduler holds, so that this one takes them over.

A flight record names the start of the scheduler that holds it (``holder``,
``holder_incarnation``). That scheduler is gone when a whole timeout passes without its
heartbeat, or when it heartbeats under another incarnation (it restarted). A record this
scheduler wrote in an earlier life (same id, other incarnation) is an orphan at once.
As with workers, silence proves nothing while NATS is down or this scheduler's own loop
stalled: evidence is paused, then counted from the moment it can be heard again.

Pure: no NATS. Time is passed in.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Holding:
    """What the flights bucket says of one request: who holds it, at which revision."""

    holder: str
    incarnation: str
    revision: int


@dataclass
class SchedulerLiveness:
    me: str
    incarnation: str
    stale_after_s: float
    started_at: float  # monotonic: schedulers unheard of since then are gone only after a timeout
    max_schedulers: int = 1024
    _heard: dict[str, tuple[str, float]] = field(default_factory=dict)  # id -> (incarnation, seen at)
    _evidence_paused: bool = False
    _evidence_from: float = float("-inf")

    def __post_init__(self) -> None:
        self._evidence_from = self.started_at

    def observe(self, scheduler_id: str, incarnation: str, now: float) -> None:
        self._heard.pop(scheduler_id, None)
        self._heard[scheduler_id] = (incarnation, now)
        while len(self._heard) > self.max_schedulers:  # the longest unheard go first
            del self._heard[next(iter(self._heard))]

    def pause_evidence(self) -> None:
        self._evidence_paused = True

    def resume_evidence(self, now: float) -> None:
        self._evidence_paused = False
        self._evidence_from = now

    def is_gone(self, scheduler_id: str, incarnation: str, now: float) -> bool:
        """That start of that scheduler no longer holds its flights."""
        if scheduler_id == self.me:
            return incarnation != self.incarnation  # an earlier life of this very scheduler
        heard = self._heard.get(scheduler_id)
        if heard is not None and heard[0] != incarnation:
            return True  # it restarted: that start is gone
        if self._evidence_paused:
            return False
        seen_at = heard[1] if heard is not None else float("-inf")
        return now - max(seen_at, self._evidence_from) > self.stale_after_s

    def live(self, now: float) -> list[str]:
        return [s for s, (inc, _) in self._heard.items() if not self.is_gone(s, inc, now)]

    def live_incarnations(self, now: float) -> dict[str, str]:
        """Each live scheduler's current start."""
        return {s: inc for s, (inc, _) in self._heard.items() if not self.is_gone(s, inc, now)}


def orphans(holdings: dict[str, Holding], liveness: SchedulerLiveness, now: float,
            held_here: set[str]) -> list[tuple[str, Holding]]:
    """The flights to take over now: (request id, its holding). ``held_here``: the
    request ids this scheduler holds in memory (a record of ours it is not holding would
    be an orphan of our own earlier life, which ``is_gone`` tells by incarnation)."""
    return [(request_id, holding) for request_id, holding in holdings.items()
            if request_id not in held_here and liveness.is_gone(holding.holder, holding.incarnation, now)]
