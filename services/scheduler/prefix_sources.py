"""Where a prompt's cached prefix comes from, when the engine that will compute the
prompt (the prefill, or a decode computing it locally) holds less of it than another
engine does: compute the difference again there, or READ it from the engine holding it
(``wire.Fetch``: the holder lends its blocks, ``kvpush.services.worker.lending``).

The third choice, moving the turn to the holder, is the pick's (``routing.WorkerPool``):
it weighs each engine's queue against the share of the prompt it holds, and, with
fetching on, credits an engine that lacks the prefix with what it could fetch.

Costs, from what the workers measure and say in their heartbeats:

- recompute: the tokens the engine lacks, at its measured prompt rate;
- fetch: a lend's fixed cost (a NATS round trip and a step of the holder's engine), the
  holder's own step (its queued prompt tokens, up to a step's worth, at its rate), and the
  blocks' bytes over the link.

Fetching is chosen when it is predicted faster; while the engine's rate is unmeasured,
whenever at least ``min_tokens`` would come. Pure: no NATS. The numbers go on the trace.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from kvpush.shared import settings, wire

Choice = Literal["none", "held", "fetch", "recompute"]


@dataclass(frozen=True)
class FetchSettings:
    enabled: bool = settings.PREFIX_FETCH == "on"
    min_tokens: int = settings.FETCH_MIN_TOKENS  # a smaller difference is computed again
    link_bytes_per_s: float = settings.FETCH_LINK_BYTES_PER_S  # the engines' link, as NIXL moves blocks on it
    fixed_s: float = settings.FETCH_FIXED_S  # a lend's round trip and its engine step, beyond the bytes
    step_tokens: int = settings.FETCH_STEP_TOKENS  # the most prompt tokens a holder's step computes before the lend's

    def __post_init__(self) -> None:
        if self.min_tokens < 0 or self.link_bytes_per_s <= 0 or self.fixed_s < 0 or self.step_tokens < 0:
            raise ValueError("fetch settings: min_tokens, fixed_s and step_tokens 0 or more; the link's rate above 0")


@dataclass(frozen=True)
class Engine:
    """An engine as the decision sees it: its share of the prompt and its load."""

    worker_id: str
    incarnation: str
    cached_tokens: int  # of this prompt, what its prefix cache likely holds
    block_size: int
    queued_tokens: int = 0
    tokens_per_s: float = 0.0  # its measured prompt rate (0: unmeasured)
    kv_bytes_per_block: int = 0
    lends: bool = False  # it lends its cached prefixes (and fetches others')


@dataclass(frozen=True)
class PrefixPlan:
    choice: Choice
    reason: str
    holder: Engine | None = None
    tokens: int = 0  # fetch: the prefix's tokens (whole blocks) the holder lends
    numbers: dict[str, float] = field(default_factory=dict)

    def source(self, choice: Choice | None = None, reason: str | None = None) -> wire.PrefixSource | None:
        """The plan for the path report (``choice``/``reason``: what came of it instead)."""
        if self.choice == "none":
            return None
        return wire.PrefixSource(choice=choice or self.choice, holder=self.holder.worker_id if self.holder else "",
                                 held_tokens=self.holder.cached_tokens if self.holder else 0,
                                 reason=reason or self.reason)


def fetchable_tokens(prompt_tokens: int, held_tokens: int, block_size: int) -> int:
    """Whole blocks of the holder's prefix, leaving at least the prompt's last token to
    compute (the engine computes one, to sample from)."""
    block_size = max(block_size, 1)
    return min(held_tokens, (prompt_tokens - 1) // block_size * block_size) // block_size * block_size


def plan(prompt_tokens: int, target: Engine, holders: Engine | list[Engine] | None,
         config: FetchSettings) -> PrefixPlan:
    """Where the prefix of a prompt of ``prompt_tokens`` comes from, for ``target`` (the
    engine computing it) given ``holders`` (the live engines holding some of it; one, or
    none). Among the holders that hold more than ``target``, the fetch that saves the most
    time; a holder busy with a long step saves less than an idle one holding as much."""
    candidates = [holders] if isinstance(holders, Engine) else list(holders or [])
    candidates = [h for h in candidates if h.worker_id != target.worker_id]
    own = target.cached_tokens
    richer = sorted((h for h in candidates if h.cached_tokens > own), key=lambda h: -h.cached_tokens)
    if not richer:
        if own == 0:
            return PrefixPlan("none", "no engine holds a prefix of it")
        return PrefixPlan("held", "the engine computing it holds the longest cached prefix", target,
                          numbers={"own_tokens": own, "held_tokens": own})
    top = richer[0]
    numbers: dict[str, float] = {"own_tokens": own, "held_tokens": top.cached_tokens}
    if not config.enabled:
        return PrefixPlan("recompute", "fetching is off", top, numbers=numbers)
    lenders = [h for h in richer if h.lends and h.block_size == target.block_size] if target.lends else []
    if not lenders:
        return PrefixPlan("recompute", "no engine holding more of it can lend it to this engine", top,
                          numbers=numbers)
    options = [_fetch_option(prompt_tokens, own, target, holder, config) for holder in lenders]
    worth = [o for o in options if o.gain >= max(config.min_tokens, 1)]
    if not worth:
        best = max(options, key=lambda o: o.gain)
        return PrefixPlan("recompute", f"{max(best.gain, 0)} tokens more: under {config.min_tokens} to fetch",
                          best.holder, numbers={**numbers, "fetch_tokens": best.gain})
    if target.tokens_per_s <= 0:  # the most tokens, then the quickest fetch
        best = max(worth, key=lambda o: (o.gain, -o.fetch_s))
        return PrefixPlan("fetch", f"{best.gain} tokens held by {best.holder.worker_id}; this engine's rate is "
                                   f"not measured yet", best.holder, best.tokens, {**numbers, **best.numbers})
    best = max(worth, key=lambda o: o.gain / target.tokens_per_s - o.fetch_s)
    recompute_s = best.gain / target.tokens_per_s
    numbers = {**numbers, **best.numbers, "held_tokens": best.holder.cached_tokens, "recompute_s": round(recompute_s, 4)}
    if best.fetch_s < recompute_s:
        return PrefixPlan("fetch", f"fetching {best.gain} tokens from {best.holder.worker_id} should take "
                                   f"{best.fetch_s:.3f} s, computing them {recompute_s:.3f} s", best.holder, best.tokens,
                          numbers)
    return PrefixPlan("recompute", f"computing {best.gain} tokens should take {recompute_s:.3f} s, fetching them "
                                   f"from {best.holder.worker_id} {best.fetch_s:.3f} s", best.holder, numbers=numbers)


@dataclass(frozen=True)
class _Option:
    holder: Engine
    tokens: int  # the holder's prefix, whole blocks, to lend
    gain: int  # of those, the tokens the target lacks
    fetch_s: float
    numbers: dict[str, float]


def _fetch_option(prompt_tokens: int, own: int, target: Engine, holder: Engine, config: FetchSettings) -> _Option:
    tokens = fetchable_tokens(prompt_tokens, holder.cached_tokens, holder.block_size)
    gain = tokens - own
    holder_step_s = min(holder.queued_tokens, config.step_tokens) / holder.tokens_per_s \
        if holder.tokens_per_s > 0 else 0.0
    blocks = max(gain, 0) // holder.block_size
    fetch_s = config.fixed_s + holder_step_s + blocks * holder.kv_bytes_per_block / config.link_bytes_per_s
    return _Option(holder, tokens, gain, fetch_s, {"fetch_tokens": gain, "fetch_s": round(fetch_s, 4),
                                                   "holder_step_s": round(holder_step_s, 4)})
