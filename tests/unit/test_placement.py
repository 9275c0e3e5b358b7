"""Per-request placement from live load (services/scheduler/placement.py), and the
prefill worker's meter its heartbeat reports (kvpush.services.worker.prompt_meter.py)."""

from __future__ import annotations

import pytest

from kvpush.services.scheduler.placement import DecodeLoad, PlacementSettings, PromptLoad, place
from kvpush.services.scheduler.routing import WorkerPool
from kvpush.services.worker.prompt_meter import PromptMeter
from kvpush.shared import wire

AUTO = PlacementSettings(policy="auto", local_below_tokens=256, push_within_s=1.0, handoff_s=0.03, decode_room=4)
BOTH = ("push", "pull")
IDLE_PREFILL = PromptLoad(queued_tokens=0, tokens_per_s=5000.0)
IDLE_DECODE = DecodeLoad(running=0, waiting=0)


def test_a_request_that_names_its_mode_gets_it_where_the_connector_does_it():
    for mode in ("push", "pull", "local"):
        assert place(2000, mode, AUTO, BOTH, IDLE_PREFILL, IDLE_DECODE).mode == mode
    assert place(2000, "push", PlacementSettings(policy="pull"), ("pull",), IDLE_PREFILL, IDLE_DECODE).mode == "pull"


def test_a_request_may_ask_for_auto_from_a_static_scheduler():
    placement = place(100, "auto", PlacementSettings(policy="push", local_below_tokens=256), BOTH, IDLE_PREFILL, IDLE_DECODE)
    assert placement.mode == "local" and "256" in placement.reason


def test_static_push_and_pull_stay_static():
    for policy in ("push", "pull"):
        for tokens in (10, 5000):
            placement = place(tokens, None, PlacementSettings(policy=policy), BOTH, IDLE_PREFILL, IDLE_DECODE)
            assert (placement.mode, placement.reason) == (policy, f"the scheduler runs {policy}")


def test_auto_computes_a_short_prompt_on_its_decode():
    placement = place(255, None, AUTO, BOTH, IDLE_PREFILL, IDLE_DECODE)
    assert placement.mode == "local" and "256" in placement.reason
    assert place(256, None, AUTO, BOTH, IDLE_PREFILL, IDLE_DECODE).mode == "push"


def test_auto_pushes_when_prefill_ends_soon_and_pulls_when_it_ends_late():
    soon = place(2000, None, AUTO, BOTH, PromptLoad(2000, 5000.0), IDLE_DECODE)  # 0.8 s
    assert soon.mode == "push" and soon.numbers["prefill_finish_s"] == pytest.approx(0.8)
    late = place(2000, None, AUTO, BOTH, PromptLoad(4000, 5000.0), DecodeLoad(running=8, waiting=0))  # 1.2 s
    assert late.mode == "pull" and late.numbers["prefill_finish_s"] == pytest.approx(1.2)
    assert late.numbers["decode_running"] == 8


def test_auto_computes_a_prompt_on_decode_when_decode_would_finish_it_first_and_has_room():
    prefill = PromptLoad(queued_tokens=3000, tokens_per_s=5000.0)  # 1000 more tokens: done in 0.8 s
    fast_decode = DecodeLoad(queued_tokens=0, tokens_per_s=2000.0, running=1)  # 0.5 s
    placement = place(1000, None, AUTO, BOTH, prefill, fast_decode)
    assert placement.mode == "local" and placement.numbers["local_finish_s"] == pytest.approx(0.5)
    busy = DecodeLoad(queued_tokens=0, tokens_per_s=2000.0, running=3, waiting=1)  # no room
    assert place(1000, None, AUTO, BOTH, prefill, busy).mode == "push"
    slow_decode = DecodeLoad(queued_tokens=0, tokens_per_s=1000.0, running=0)  # 1.0 s > 0.8 s + 0.03 s
    assert place(1000, None, AUTO, BOTH, prefill, slow_decode).mode == "push"
    cached = DecodeLoad(queued_tokens=0, tokens_per_s=1000.0, cached_tokens=600, running=0)  # 0.4 s: it holds most
    assert place(1000, None, AUTO, BOTH, prefill, cached).mode == "local"


def test_auto_pushes_until_a_prefill_rate_is_measured():
    placement = place(2000, None, AUTO, BOTH, PromptLoad(10**6, 0.0), IDLE_DECODE)
    assert placement.mode == "push" and placement.reason == "no prefill rate measured yet"


def test_auto_keeps_to_what_the_connector_does():
    assert place(2000, None, AUTO, ("pull",), IDLE_PREFILL, IDLE_DECODE).mode == "pull"
    assert place(2000, None, AUTO, ("push",), PromptLoad(10**6, 100.0), DecodeLoad(running=9, waiting=9)).mode == "push"


def test_placement_settings_refuse_what_cannot_work():
    with pytest.raises(ValueError, match="push, pull or auto"):
        PlacementSettings(policy="local")
    with pytest.raises(ValueError, match="0 or more"):
        PlacementSettings(policy="auto", push_within_s=-1)


def _beat(worker_id: str, role: str, **fields) -> wire.WorkerHeartbeat:
    return wire.WorkerHeartbeat(worker_id=worker_id, role=role, free_kv_blocks=1000, total_kv_blocks=1000,
                                running=0, waiting=0, block_size=16, max_model_len=4096, **fields)


def test_the_pool_reports_the_load_of_the_workers_it_would_pick_and_counts_prompts_sent_since():
    pool = WorkerPool(stale_after_s=5.0)
    pool.observe(_beat("p-busy", "prefill", queued_prompt_tokens=9000, prefill_tokens_per_s=3000.0), now=0.0)
    pool.observe(_beat("p-idle", "prefill", queued_prompt_tokens=1000, prefill_tokens_per_s=2000.0), now=0.0)
    pool.observe(_beat("d-0", "decode"), now=0.0)
    assert pool.prefill_load(now=0.1) == PromptLoad(1000, 2000.0)
    assert pool.pick_prefill(9000, now=0.1).worker_id == "p-idle"
    assert pool.prefill_load(now=0.1) == PromptLoad(9000, 3000.0)  # p-idle now holds 10000
    assert pool.decode_load(16, now=0.1) == DecodeLoad(running=0, waiting=0)
    pool.pick_decode(16, now=0.1)
    assert pool.decode_load(16, now=0.1) == DecodeLoad(running=1, waiting=0)
    assert pool.prefill_load(now=6.0) is None  # every prefill is stale


def test_the_meter_counts_queued_prompt_tokens_and_measures_busy_throughput():
    meter = PromptMeter(half_life_s=10.0)
    assert (meter.queued_tokens, meter.tokens_per_s) == (0, 0.0)
    meter.started(1000, now=0.0)
    meter.started(1000, now=0.0)
    assert meter.queued_tokens == 2000
    meter.finished(1000, now=0.5)
    meter.finished(1000, now=1.0)
    assert meter.queued_tokens == 0
    assert meter.tokens_per_s == pytest.approx(2000.0, rel=0.05)
    meter.started(500, now=100.0)  # idle time between is not busy time
    meter.finished(500, now=101.0)
    assert 500 < meter.tokens_per_s < 2000
    meter.started(800, now=200.0)
    meter.finished(800, now=200.1, computed=False)  # failed: no throughput from it
    assert meter.queued_tokens == 0
    assert meter.tokens_per_s < 2000


def test_the_meter_follows_a_slower_prefill_within_seconds():
    meter = PromptMeter(half_life_s=10.0)
    now = 0.0
    for _ in range(20):  # fast: 4000 tokens/s
        meter.started(1000, now)
        now += 0.25
        meter.finished(1000, now)
    for _ in range(40):  # then slow: 1000 tokens/s, for 40 s of busy time
        meter.started(1000, now)
        now += 1.0
        meter.finished(1000, now)
    assert meter.tokens_per_s == pytest.approx(1000.0, rel=0.15)
