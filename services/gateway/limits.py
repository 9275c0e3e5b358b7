"""Per-key limits: how many requests a key may have in progress, and how fast it may start
new ones (a token bucket). Pure: the caller passes the clock's time.

    limiter = Limiter(Limits(max_concurrent=4, rate_per_s=2.0, burst=4))
    limiter.admit(now)      # raises TooManyConcurrent or RateLimited; else one slot is taken
    ...                     # the request, streamed to its end
    limiter.release()

A refusal costs nothing: a request refused for concurrency takes no token from the bucket.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvpush.services.gateway.errors import RateLimited, TooManyConcurrent


@dataclass(frozen=True)
class Limits:
    """``0`` is no limit. ``burst``: requests a key may start at once after a quiet spell
    (the bucket's size); ``0`` with a rate means the rate rounded up, at least 1."""

    max_concurrent: int = 0
    rate_per_s: float = 0.0
    burst: int = 0

    def __post_init__(self) -> None:
        for name in ("max_concurrent", "rate_per_s", "burst"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or math.isnan(value):
                raise ValueError(f"{name} must be a number >= 0 (0: no limit), not {value!r}")
        if self.max_concurrent != int(self.max_concurrent) or self.burst != int(self.burst):
            raise ValueError("max_concurrent and burst must be whole numbers")

    @property
    def bucket_size(self) -> float:
        return float(self.burst) if self.burst else max(1.0, math.ceil(self.rate_per_s))


class TokenBucket:
    """``rate_per_s`` tokens a second, up to ``size``; full at the start."""

    def __init__(self, rate_per_s: float, size: float, now: float):
        self.rate_per_s = rate_per_s
        self.size = size
        self.tokens = size
        self.updated = now

    def take(self, now: float) -> float:
        """Take one token: 0.0 if taken, else the seconds until one will be there."""
        self.tokens = min(self.size, self.tokens + (now - self.updated) * self.rate_per_s)
        self.updated = max(self.updated, now)
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate_per_s


class Limiter:
    """One key's limits and what it uses of them now. Used from the event loop only."""

    def __init__(self, limits: Limits, now: float = 0.0):
        self.limits = limits
        self.in_progress = 0
        self._bucket = TokenBucket(limits.rate_per_s, limits.bucket_size, now) if limits.rate_per_s else None

    def admit(self, now: float) -> None:
        most = self.limits.max_concurrent
        if most and self.in_progress >= most:
            raise TooManyConcurrent(f"this API key has {self.in_progress} requests in progress, its limit "
                                    f"(max_concurrent {most}); wait for one to end, then retry")
        if self._bucket is not None:
            wait_s = self._bucket.take(now)
            if wait_s > 0:
                raise RateLimited(f"this API key may start {self.limits.rate_per_s:g} requests a second "
                                  f"(burst {self._bucket.size:g}); retry in {wait_s:.2f} s", retry_after_s=wait_s)
        self.in_progress += 1

    def release(self) -> None:
        self.in_progress -= 1
