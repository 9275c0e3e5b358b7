"""Where a prompt's cached prefix comes from (services/scheduler/prefix_sources.py), the
pool's view of who holds it and the fetch-aware prefill pick (routing.py), and what the
path report makes of the choice (services/worker/path_report.py)."""

from __future__ import annotations

import pytest

from kvpush.services.scheduler.prefix_sources import Engine, FetchSettings, fetchable_tokens, plan
from kvpush.services.scheduler.prefixes import Prompt
from kvpush.services.scheduler.routing import WorkerPool
from kvpush.services.worker.path_report import prefix_source
from kvpush.shared import wire
from kvpush.shared.block_keys import block_keys

BLOCK = 16
ON = FetchSettings(enabled=True, min_tokens=64, link_bytes_per_s=1e9, fixed_s=0.02, step_tokens=2048)


def _engine(name: str, cached: int, *, rate: float = 10_000.0, queued: int = 0, lends: bool = True,
            bytes_per_block: int = 16 * 1024) -> Engine:
    return Engine(name, f"{name}-start", cached, BLOCK, queued_tokens=queued, tokens_per_s=rate,
                  kv_bytes_per_block=bytes_per_block, lends=lends)


def test_only_whole_blocks_are_fetched_and_the_last_prompt_token_is_always_computed():
    assert fetchable_tokens(1000, 2000, BLOCK) == 992  # (1000 - 1) // 16 blocks
    assert fetchable_tokens(1024, 2000, BLOCK) == 1008  # not all 64 blocks: the last token is computed
    assert fetchable_tokens(1025, 1024, BLOCK) == 1024
    assert fetchable_tokens(1000, 100, BLOCK) == 96  # the holder's whole blocks only


def test_nothing_held_or_held_by_the_engine_computing_it():
    assert plan(1000, _engine("p0", 0), None, ON).choice == "none"
    held = plan(1000, _engine("p0", 512), _engine("p0", 512), ON)
    assert (held.choice, held.source().choice, held.source().holder) == ("held", "held", "p0")
    assert plan(1000, _engine("p0", 512), _engine("d0", 256), ON).choice == "held"  # it holds more itself


def test_a_longer_prefix_elsewhere_is_fetched_when_reading_it_is_faster_than_computing_it():
    fetched = plan(1200, _engine("p1", 128), _engine("d0", 1024), ON)
    assert fetched.choice == "fetch" and fetched.tokens == 1024 and fetched.holder.worker_id == "d0"
    # 896 tokens at 10k/s: 90 ms; 56 blocks of 16 KiB over 1 GB/s and 20 ms fixed: 21 ms
    assert fetched.numbers["recompute_s"] == pytest.approx(0.0896)
    assert fetched.numbers["fetch_s"] == pytest.approx(0.02 + 56 * 16 * 1024 / 1e9, abs=1e-4)
    source = fetched.source()
    assert (source.choice, source.holder, source.held_tokens) == ("fetch", "d0", 1024)


def test_computing_wins_on_a_slow_link_a_busy_holder_or_a_fast_engine():
    slow = FetchSettings(enabled=True, min_tokens=64, link_bytes_per_s=1e6, fixed_s=0.02)
    assert plan(1200, _engine("p1", 0), _engine("d0", 1024), slow).choice == "recompute"
    busy = plan(1200, _engine("p1", 0), _engine("p0", 1024, queued=4000, rate=10_000.0), ON)
    assert busy.choice == "recompute" and busy.numbers["holder_step_s"] == pytest.approx(0.2048)
    fast = plan(1200, _engine("p1", 0, rate=1e6), _engine("d0", 1024), ON)
    assert fast.choice == "recompute" and "computing 1024 tokens" in fast.reason


def test_fetching_off_too_little_or_a_holder_that_does_not_lend_means_recompute():
    off = FetchSettings(enabled=False)
    assert plan(1200, _engine("p1", 0), _engine("d0", 1024), off).reason == "fetching is off"
    little = plan(1200, _engine("p1", 992), _engine("d0", 1024), ON)
    assert (little.choice, little.reason) == ("recompute", "32 tokens more: under 64 to fetch")
    assert plan(1200, _engine("p1", 0), _engine("d0", 1024, lends=False), ON).choice == "recompute"
    assert plan(1200, _engine("p1", 0, lends=False), _engine("d0", 1024), ON).choice == "recompute"


def test_of_two_holders_holding_as_much_the_idle_one_lends():
    """A busy prefill and an idle decode hold the same history: waiting for the prefill's
    step would cost more than computing, the decode's does not."""
    busy = _engine("p0", 1024, queued=4000, rate=10_000.0)
    idle = _engine("d0", 1024, queued=0)
    fetched = plan(1200, _engine("p1", 0), [busy, idle], ON)
    assert (fetched.choice, fetched.holder.worker_id) == ("fetch", "d0")
    assert plan(1200, _engine("p1", 0), [busy], ON).choice == "recompute"
    longer = plan(1200, _engine("p1", 0), [_engine("d0", 512), _engine("d1", 1024)], ON)
    assert (longer.holder.worker_id, longer.tokens) == ("d1", 1024)  # the larger saving


def test_an_unmeasured_engine_fetches_what_is_worth_fetching():
    assert plan(1200, _engine("p1", 0, rate=0.0), _engine("d0", 1024), ON).choice == "fetch"


def test_a_refused_fetch_is_reported_as_a_recompute_with_its_reason():
    fetched = plan(1200, _engine("p1", 0), _engine("d0", 1024), ON)
    refused = fetched.source("recompute", "the holder refused the lend: gone")
    assert (refused.choice, refused.reason, refused.holder) == ("recompute", "the holder refused the lend: gone", "d0")
    got = wire.PromptReport(cached_tokens=0, fetched_tokens=1024, fetched_from="d0")
    assert prefix_source(fetched.source(), got) == "fetched"
    assert prefix_source(fetched.source(), wire.PromptReport(cached_tokens=0)) == "recomputed"  # its READ failed
    assert prefix_source(refused, None) == "recomputed"


# ------------------------------------------------------------------ the pool


def _beat(worker_id: str, role: str, *, queued: int = 0, lends: bool = True) -> wire.WorkerHeartbeat:
    return wire.WorkerHeartbeat(worker_id=worker_id, role=role, free_kv_blocks=100, total_kv_blocks=100, running=0,
                                waiting=0, block_size=BLOCK, max_model_len=4096, incarnation=f"{worker_id}-1",
                                queued_prompt_tokens=queued, prefill_tokens_per_s=10_000.0, lends=lends,
                                kv_bytes_per_block=16 * 1024)


def _pool(*beats: wire.WorkerHeartbeat) -> WorkerPool:
    pool = WorkerPool(stale_after_s=5.0)
    for beat in beats:
        pool.observe(beat, 0.0)
    return pool


def _cache(pool: WorkerPool, worker_id: str, tokens: list[int]) -> None:
    pool.cache_events(wire.CacheEvents(worker_id=worker_id, incarnation=f"{worker_id}-1",
                                       stored=block_keys(tokens, BLOCK)))


def test_the_holder_is_the_live_engine_of_either_role_holding_the_most():
    prompt = list(range(1, 1001))
    pool = _pool(_beat("p0", "prefill"), _beat("p1", "prefill"), _beat("d0", "decode"))
    assert pool.holder(Prompt(prompt), 0.0) is None
    _cache(pool, "p0", prompt[:320])
    _cache(pool, "d0", prompt[:800])
    holder = pool.holder(Prompt(prompt), 0.0)
    assert (holder.worker_id, holder.cached_tokens, holder.lends) == ("d0", 800, True)
    assert pool.holder(Prompt(prompt), 10.0) is None  # nobody live


def test_with_fetching_on_a_prefill_that_could_fetch_the_prefix_competes_with_the_one_holding_it():
    """p0 holds 800 tokens of the prompt but has 600 queued; p1 is idle and holds none.
    Without fetching p0 still wins (600 - 800 < 0); with it p1 counts what it could fetch
    (0.8 of 800) and wins (0 - 640 < 600 - 800)."""
    prompt = list(range(1, 1001))
    pool = _pool(_beat("p0", "prefill", queued=600), _beat("p1", "prefill"), _beat("d0", "decode"))
    _cache(pool, "p0", prompt[:800])
    assert pool.pick_prefill(1000, 0.0, prompt=Prompt(prompt)).worker_id == "p0"
    pool = _pool(_beat("p0", "prefill", queued=600), _beat("p1", "prefill"), _beat("d0", "decode"))
    _cache(pool, "p0", prompt[:800])
    pool.fetch_credit = 0.8
    assert pool.pick_prefill(1000, 0.0, prompt=Prompt(prompt)).worker_id == "p1"
    pool = _pool(_beat("p0", "prefill", queued=600), _beat("p1", "prefill", lends=False), _beat("d0", "decode"))
    _cache(pool, "p0", prompt[:800])
    pool.fetch_credit = 0.8
    assert pool.pick_prefill(1000, 0.0, prompt=Prompt(prompt)).worker_id == "p0"  # p1 cannot fetch
