"""Heartbeats make the live worker set; pick chooses a prefill and a decode worker."""

from __future__ import annotations

import pytest

from kvpush.services.scheduler.routing import WorkerPool
from kvpush.shared.errors import NoWorkers
from kvpush.shared.wire import WorkerHeartbeat

BLOCK_SIZE = 16


def _beat(worker_id: str, role: str, *, free: int = 100, running: int = 0, waiting: int = 0):
    return WorkerHeartbeat(
        worker_id=worker_id, role=role, free_kv_blocks=free, total_kv_blocks=100,
        running=running, waiting=waiting, block_size=BLOCK_SIZE, max_model_len=1024,
    )


def _picked(pool: WorkerPool, num_prompt_tokens: int, now: float) -> tuple[str, str]:
    """The ids of the (prefill, decode) heartbeats ``pick`` chose."""
    prefill, decode = pool.pick(num_prompt_tokens, now)
    return prefill.worker_id, decode.worker_id


def _pool(*beats: WorkerHeartbeat, now: float = 0.0) -> WorkerPool:
    pool = WorkerPool(stale_after_s=5.0)
    for beat in beats:
        pool.observe(beat, now)
    return pool


def test_stale_workers_are_not_picked():
    pool = _pool(_beat("p-old", "prefill"), _beat("d-old", "decode"), now=0.0)
    pool.observe(_beat("p-new", "prefill", running=9), 4.0)
    pool.observe(_beat("d-new", "decode", running=9), 4.0)
    assert pool.live("prefill", 6.0) == [_beat("p-new", "prefill", running=9)]
    assert _picked(pool, 10, now=6.0) == ("p-new", "d-new")


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_missing_role_raises_no_workers(role):
    pool = _pool(_beat("w", role))
    with pytest.raises(NoWorkers) as caught:
        pool.pick(10, now=0.0)
    assert caught.value.code == "no_workers"


def test_only_stale_workers_raise_no_workers():
    pool = _pool(_beat("p", "prefill"), _beat("d", "decode"), now=0.0)
    with pytest.raises(NoWorkers):
        pool.pick(10, now=5.1)
    assert pool.live("decode", 5.1) == []


def test_prefill_goes_to_the_least_loaded_worker():
    pool = _pool(
        _beat("p-busy", "prefill", running=3),
        _beat("p-queued", "prefill", running=0, waiting=2),
        _beat("p-light", "prefill", running=1),
        _beat("d", "decode"),
    )
    assert _picked(pool, 10, now=0.0)[0] == "p-light"


def test_decode_goes_to_the_least_busy_worker_with_room():
    pool = _pool(
        _beat("p", "prefill"),
        _beat("d-busy", "decode", running=5, free=90),
        _beat("d-light", "decode", running=1, free=10),
    )
    assert _picked(pool, 10 * BLOCK_SIZE, now=0.0)[1] == "d-light"


def test_an_idle_decode_worker_without_room_loses_to_a_busy_one_with_room():
    pool = _pool(
        _beat("p", "prefill"),
        _beat("d-idle-full", "decode", running=0, free=2),
        _beat("d-busy", "decode", running=7, free=50),
    )
    assert _picked(pool, 3 * BLOCK_SIZE, now=0.0)[1] == "d-busy"


def test_when_no_decode_worker_has_room_the_emptiest_is_picked():
    pool = _pool(
        _beat("p", "prefill"),
        _beat("d-a", "decode", free=1),
        _beat("d-b", "decode", free=3),
    )
    assert _picked(pool, 10 * BLOCK_SIZE, now=0.0)[1] == "d-b"


def test_successive_picks_spread_over_idle_workers():
    pool = _pool(_beat("p-1", "prefill"), _beat("p-2", "prefill"),
                 _beat("d-1", "decode"), _beat("d-2", "decode"))
    picks = [_picked(pool, 10, now=0.0) for _ in range(4)]
    assert sorted(p for p, _ in picks) == ["p-1", "p-1", "p-2", "p-2"]
    assert sorted(d for _, d in picks) == ["d-1", "d-1", "d-2", "d-2"]


def test_dispatched_jobs_count_against_a_decode_workers_room():
    pool = _pool(_beat("p", "prefill"),
                 _beat("d-small", "decode", free=4), _beat("d-busy", "decode", running=3, free=40))
    picks = [_picked(pool, 4 * BLOCK_SIZE, now=0.0)[1] for _ in range(2)]
    assert picks == ["d-small", "d-busy"]


def test_a_new_heartbeat_resets_the_dispatched_count():
    pool = _pool(_beat("p", "prefill"), _beat("d-1", "decode"), _beat("d-2", "decode"))
    first = _picked(pool, 10, now=0.0)[1]
    pool.observe(_beat(first, "decode"), 1.0)
    second = _picked(pool, 10, now=1.0)[1]
    assert first == second == "d-1"


def test_a_pick_is_the_chosen_workers_heartbeats_and_either_role_is_picked_alone_in_one_order():
    beats = (_beat("p", "prefill"), _beat("d", "decode"))
    pool = _pool(*beats)
    assert pool.pick(10, now=0.0) == beats  # which start of each: its incarnation, its kv_params
    assert pool.pick_prefill(10, 0.0) == beats[0]
    assert pool.pick_decode(10, 0.0) == beats[1]


def test_a_forgotten_worker_is_not_picked():
    pool = _pool(_beat("p", "prefill"), _beat("d-1", "decode"), _beat("d-2", "decode"))
    pool.forget("d-1")
    assert _picked(pool, 10, now=0.0) == ("p", "d-2")


def test_has_served_once_both_roles_have_heartbeated_even_after_they_go_stale():
    pool = WorkerPool(stale_after_s=5.0)
    assert not pool.has_served()
    pool.observe(_beat("p-1", "prefill"), now=0.0)
    assert not pool.has_served()
    pool.observe(_beat("d-1", "decode"), now=0.0)
    pool.forget("d-1")
    assert pool.has_served()  # down, not absent: requests wait for them


def test_while_heartbeats_cannot_arrive_no_worker_is_declared_lost():
    pool = _pool(_beat("d", "decode"), now=0.0)
    pool.pause_evidence()  # NATS went down at 1 s
    assert pool.is_live("d", "", now=60.0)  # a minute of silence proves nothing
    pool.resume_evidence(now=60.0)  # back: a full timeout to be heard again
    assert pool.is_live("d", "", now=64.9)
    assert not pool.is_live("d", "", now=65.1)  # and no heartbeat came: lost


def test_after_a_stall_a_worker_gets_a_full_timeout_from_the_end_of_the_stall():
    pool = _pool(_beat("d", "decode"), now=0.0)
    pool.resume_evidence(now=30.0)  # the scheduler's loop stalled until 30 s; beats may be queued
    assert pool.is_live("d", "", now=34.0)
    pool.observe(_beat("d", "decode"), now=34.5)  # the queued heartbeat, read at last
    assert pool.is_live("d", "", now=39.0)


def test_fresh_evidence_does_not_revive_a_restarted_or_forgotten_worker():
    pool = _pool(_beat("d", "decode"), now=0.0)
    pool.pause_evidence()
    assert not pool.is_live("d", "an-older-start", now=1.0)
    assert not pool.is_live("gone", "", now=1.0)


def test_routing_still_picks_only_workers_heard_within_the_timeout():
    pool = _pool(_beat("p", "prefill"), _beat("d", "decode"), now=0.0)
    pool.resume_evidence(now=30.0)
    with pytest.raises(NoWorkers):
        pool.pick(10, now=31.0)


def test_the_pool_forgets_workers_silent_for_long_and_stays_bounded():
    pool = WorkerPool(stale_after_s=5.0, forget_after_s=100.0, max_workers=3)
    pool.observe(_beat("old", "decode"), now=0.0)
    pool.observe(_beat("fresh", "decode"), now=150.0)
    assert pool.beat("old") is None and pool.beat("fresh") is not None
    for i in range(10):  # a flood of ids
        pool.observe(_beat(f"w{i}", "decode"), now=151.0 + i)
    assert len(pool) == 3
    assert pool.beat("w9") is not None  # the latest heard are kept
