"""Decode keeps the blocks it registered until the KV arrived, prefill answered, or a
revoked transfer's quarantine passed; it never releases blocks a write may still land in."""

from __future__ import annotations

import pytest

from kvpush.connector.kv_wait import KvWaits


def _waits() -> KvWaits:
    return KvWaits(kv_wait_s=120.0, quarantine_s=10.0)


def test_arrival_releases_the_request_as_arrived():
    waits = _waits()
    waits.start("r", "t", now=0.0, context="span")
    assert waits.tick(1.0) == ([], [])
    assert waits.arrived("t", at=2.0) is True
    to_revoke, released = waits.tick(3.0)
    assert to_revoke == []
    [done] = released
    assert (done.request_id, done.transfer_id, done.arrived, done.failed, done.reason) == ("r", "t", True, False, "")
    assert (done.context, done.arrived_at) == ("span", 2.0)
    assert waits.waiting() == 0


def test_an_arrival_before_start_counts():
    waits = _waits()
    assert waits.arrived("t", at=5.0) is False
    wait = waits.start("r", "t", now=6.0)
    assert wait.arrived is True
    [done] = waits.tick(6.0)[1]
    assert (done.arrived, done.arrived_at) == (True, 5.0)


def test_prefill_giving_up_releases_the_request_as_failed():
    waits = _waits()
    waits.start("r", "t", now=0.0)
    waits.prefill_gave_up("t", "lease_expired", code="lease_expired")
    to_revoke, [done] = waits.tick(1.0)
    assert to_revoke == []
    assert (done.arrived, done.failed, done.request_finished, done.reason) == (False, True, False, "lease_expired")


def test_prefill_giving_up_before_start_counts():
    waits = _waits()
    waits.prefill_gave_up("t", "prefill failed", code="engine_failed")
    waits.start("r", "t", now=0.0)
    [done] = waits.tick(0.0)[1]
    assert (done.failed, done.reason) == (True, "prefill failed")


def test_the_first_answer_of_prefill_is_kept():
    waits = _waits()
    waits.start("r", "t", now=0.0)
    waits.prefill_gave_up("t", "first", code="write_failed")
    waits.prefill_gave_up("t", "second", code="revoked")
    [done] = waits.tick(0.0)[1]
    assert done.reason == "first"


def test_overdue_kv_is_revoked_once_then_quarantined():
    waits = _waits()
    waits.start("r", "t", now=0.0)
    assert waits.tick(119.9) == ([], [])
    to_revoke, released = waits.tick(120.0)
    assert [w.transfer_id for w in to_revoke] == ["t"]
    assert "120" in to_revoke[0].given_up
    assert released == []
    # quarantined: not revoked again, not released while a write may still land
    assert waits.tick(125.0) == ([], [])
    assert waits.tick(129.9) == ([], [])
    assert waits.waiting() == 1


def test_a_silent_prefill_releases_the_quarantined_blocks_after_quarantine_s():
    waits = _waits()
    waits.start("r", "t", now=0.0)
    waits.tick(120.0)
    to_revoke, [done] = waits.tick(130.0)
    assert to_revoke == []
    assert (done.arrived, done.failed, done.request_finished) == (False, True, False)
    assert "silent" in done.reason
    assert waits.waiting() == 0


def test_prefill_answering_a_revoke_releases_at_once():
    waits = _waits()
    waits.start("r", "t", now=0.0)
    waits.tick(120.0)
    waits.prefill_gave_up("t", "revoked", code="revoked")
    [done] = waits.tick(121.0)[1]
    assert done.failed is True
    assert "120" in done.reason  # decode's own reason for giving up


def test_kv_arriving_during_quarantine_releases_at_once_as_arrived():
    waits = _waits()
    waits.start("r", "t", now=0.0)
    waits.tick(120.0)
    waits.arrived("t", at=121.0)
    [done] = waits.tick(121.5)[1]
    assert (done.arrived, done.failed) == (True, False)


def test_a_finished_waiting_request_is_revoked_and_quarantined():
    waits = _waits()
    waits.start("r", "t", now=0.0)
    [revoke] = waits.requests_finished({"r"}, now=5.0)
    assert (revoke.transfer_id, revoke.given_up) == ("t", "aborted")
    assert waits.tick(14.9) == ([], [])
    _, [done] = waits.tick(15.0)
    assert (done.request_finished, done.failed, done.arrived) == (True, False, False)
    assert "aborted" in done.reason


def test_a_finished_request_is_released_when_prefill_answers():
    waits = _waits()
    waits.start("r", "t", now=0.0)
    waits.requests_finished({"r"}, now=5.0)
    waits.prefill_gave_up("t", "revoked", code="revoked")
    [done] = waits.tick(5.1)[1]
    assert (done.request_finished, done.failed, done.reason) == (True, False, "aborted")


def test_a_finished_request_is_released_when_its_kv_arrives():
    waits = _waits()
    waits.start("r", "t", now=0.0)
    waits.requests_finished({"r"}, now=5.0)
    waits.arrived("t", at=6.0)
    [done] = waits.tick(6.0)[1]
    assert (done.request_finished, done.arrived, done.failed) == (True, True, False)


def test_a_request_finished_twice_is_revoked_once():
    waits = _waits()
    waits.start("r", "t", now=0.0)
    assert len(waits.requests_finished({"r"}, now=1.0)) == 1
    assert waits.requests_finished({"r"}, now=2.0) == []


def test_a_request_finished_after_its_kv_arrived_is_not_revoked():
    waits = _waits()
    waits.start("r", "t", now=0.0)
    waits.arrived("t", at=1.0)
    assert waits.requests_finished({"r"}, now=2.0) == []
    [done] = waits.tick(2.0)[1]
    assert (done.arrived, done.request_finished, done.failed) == (True, True, False)


def test_overdue_kv_of_a_finished_request_is_not_revoked_again():
    waits = _waits()
    waits.start("r", "t", now=0.0)
    waits.requests_finished({"r"}, now=119.0)
    to_revoke, released = waits.tick(120.0)
    assert (to_revoke, released) == ([], [])


def test_other_requests_are_not_touched():
    waits = _waits()
    waits.start("r1", "t1", now=0.0)
    waits.start("r2", "t2", now=0.0)
    assert [w.request_id for w in waits.requests_finished({"r2"}, now=1.0)] == ["r2"]
    waits.arrived("t1", at=2.0)
    [done] = waits.tick(2.0)[1]
    assert done.transfer_id == "t1"
    assert waits.waiting() == 1


def test_nothing_is_released_twice():
    waits = _waits()
    waits.start("r1", "t1", now=0.0)
    waits.start("r2", "t2", now=0.0)
    waits.start("r3", "t3", now=0.0)
    waits.arrived("t1", at=1.0)
    waits.prefill_gave_up("t2", "failed", code="write_failed")
    released = []
    for now in (1.0, 2.0, 120.0, 121.0, 130.0, 200.0, 500.0):
        _, ended = waits.tick(now)
        # late answers for waits already ended start nothing new
        waits.arrived("t1", at=now)
        waits.prefill_gave_up("t2", "again", code="write_failed")
        released += ended
    assert sorted(r.transfer_id for r in released) == ["t1", "t2", "t3"]
    assert waits.waiting() == 0


def test_early_answers_are_bounded_by_max_early():
    waits = KvWaits(max_early=2)
    for tid in ("a", "b", "c"):
        waits.arrived(tid, at=0.0)
    assert waits.start("r", "a", now=0.0).arrived is False  # forgotten, the oldest
    assert waits.start("r", "c", now=0.0).arrived is True


def test_a_revoke_is_sent_again_until_prefill_answers():
    waits = _waits()
    waits.start("r", "t", now=0.0)
    [revoked], _ = waits.tick(120.0)  # sent now
    assert waits.revokes_due(120.5, every_s=1.0) == []
    assert [w.transfer_id for w in waits.revokes_due(121.0, every_s=1.0)] == ["t"]  # it may have been lost
    assert waits.revokes_due(121.5, every_s=1.0) == []
    assert [w.transfer_id for w in waits.revokes_due(122.0, every_s=1.0)] == ["t"]
    waits.prefill_gave_up("t", "revoked: decode gave the transfer up", code="revoked")  # the answer
    assert waits.revokes_due(130.0, every_s=1.0) == []


def test_an_open_wait_or_an_arrived_one_is_never_revoked_again():
    waits = _waits()
    waits.start("open", "t-open", now=0.0)
    waits.start("done", "t-done", now=0.0)
    waits.requests_finished({"done"}, now=1.0)
    waits.arrived("t-done")  # the write landed during the quarantine
    assert waits.revokes_due(50.0, every_s=1.0) == []


def test_a_stuck_write_keeps_the_blocks_past_every_timer_until_prefill_answers():
    waits = _waits()
    waits.start("r", "t", now=0.0)
    assert waits.write_stuck("t", "WRITE still running after 30 s", now=30.0) is True
    # Neither the KV wait (120 s) nor the quarantine (10 s) frees blocks a posted write may land in.
    assert waits.tick(10_000.0) == ([], [])
    assert [w.transfer_id for w in waits.stuck()] == ["t"]
    assert waits.revokes_due(10_000.0, 1.0) == []  # prefill knows: its answer is the write's end
    waits.write_ended("t", "write_failed: it ended after all", code="write_failed")
    [done] = waits.tick(10_001.0)[1]
    assert (done.arrived, done.failed) == (False, True)
    assert waits.stuck() == []


def test_a_stuck_write_that_lands_after_all_delivers_the_kv():
    waits = _waits()
    waits.start("r", "t", now=0.0)
    waits.write_stuck("t", "slow", now=30.0)
    waits.arrived("t", at=40.0)
    [done] = waits.tick(41.0)[1]
    assert (done.arrived, done.failed) == (True, False)


def test_blocks_held_for_a_stuck_write_go_back_once_prefill_is_proven_gone():
    waits = _waits()
    waits.start("r", "t", now=0.0)
    waits.write_stuck("t", "slow", now=30.0)
    waits.prefill_gone("t", "no responders on its agent subject")
    [done] = waits.tick(31.0)[1]
    assert "prefill is gone" in done.reason and done.failed


def test_a_stuck_report_for_a_wait_that_already_ended_changes_nothing():
    waits = _waits()
    waits.start("r", "t", now=0.0)
    waits.arrived("t", at=1.0)
    assert waits.write_stuck("t", "late", now=2.0) is False
    assert waits.write_stuck("unknown", "late", now=2.0) is False
    [done] = waits.tick(3.0)[1]
    assert done.arrived


REVOKED = "revoked: decode gave the transfer up"
STUCK = "write_stuck: WRITE still running after 30 s"


# Each way a wait ends: what happens before the wait starts (at 0 s) and after, and when it ends.
@pytest.mark.parametrize("before,after,ends_at,code", [
    pytest.param(None, lambda w: w.arrived("t", at=1.0), 1.0, "", id="kv arrived"),
    pytest.param(None, lambda w: w.prefill_gave_up("t", "checksum_mismatch: it differs", code="checksum_mismatch"),
                 1.0, "checksum_mismatch", id="prefill answered"),
    pytest.param(lambda w: w.prefill_gave_up("t", "lease_expired: prefill freed them", code="lease_expired"), None,
                 0.0, "lease_expired", id="prefill answered before the wait started"),
    pytest.param(None, lambda w: w.prefill_gave_up("t", "a peer's answer", code="not a code: at all"),
                 1.0, "kv_load_failed", id="prefill answered with no code"),
    pytest.param(None, lambda w: w.tick(120.0), 130.0, "kv_wait_expired", id="kv overdue, prefill silent"),
    pytest.param(None, lambda w: (w.tick(120.0), w.prefill_gave_up("t", REVOKED, code="revoked")),
                 121.0, "kv_wait_expired", id="kv overdue, prefill answered"),  # decode gave up first: its code
    pytest.param(None, lambda w: w.requests_finished({"r"}, now=5.0), 15.0, "aborted", id="aborted, prefill silent"),
    pytest.param(None, lambda w: (w.requests_finished({"r"}, now=5.0), w.prefill_gave_up("t", REVOKED, code="revoked")),
                 6.0, "aborted", id="aborted, prefill answered"),
    pytest.param(None, lambda w: (w.write_stuck("t", STUCK, now=30.0),
                                  w.write_ended("t", "write_failed: it ended after all", code="write_failed")),
                 31.0, "write_failed", id="stuck write ended"),
    pytest.param(None, lambda w: (w.write_stuck("t", STUCK, now=30.0), w.prefill_gone("t", "no responders")),
                 31.0, "kv_load_failed", id="stuck write, prefill gone"),
])
def test_each_way_a_wait_ends_carries_its_code(before, after, ends_at, code):
    waits = _waits()
    if before is not None:
        before(waits)
    waits.start("r", "t", now=0.0)
    if after is not None:
        after(waits)
    [done] = waits.tick(ends_at)[1]
    assert done.code == code


def test_a_failed_writer_among_several_fails_the_load_but_keeps_the_blocks_until_the_others_answered():
    """Tensor parallelism: one of two prefill ranks writing into the blocks failed. The wait
    is given up at once (to revoke the transfer, so the other stops), with that rank's
    code, and released only once the other answered."""
    waits = _waits()
    waits.start("r", "t", now=0.0)
    wait = waits.writer_failed("t", "write_failed: lost", code="write_failed", now=1.0)
    assert wait is not None and wait.transfer_id == "t"
    assert waits.writer_failed("t", "again", code="write_failed", now=1.5) is None  # revoked once
    assert waits.tick(5.0) == ([], [])  # the other rank may still be writing
    waits.prefill_gave_up("t", "revoked: after it was written", code="revoked")
    [done] = waits.tick(6.0)[1]
    assert (done.failed, done.code, done.reason) == (True, "write_failed", "write_failed: lost")


def test_a_failed_writer_whose_peers_stay_silent_is_released_after_quarantine():
    waits = _waits()
    waits.start("r", "t", now=0.0)
    waits.writer_failed("t", "lost", code="write_failed", now=1.0)
    assert waits.tick(10.5) == ([], [])
    [done] = waits.tick(11.0)[1]
    assert (done.failed, done.code) == (True, "write_failed")
