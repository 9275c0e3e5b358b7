"""Prefill holds blocks for decode's READ under a lease that renewals extend; decode
renews, per prefill engine, the transfers it still waits for."""

from __future__ import annotations

from kvpush.connector.leases import Renewals, ServedReads

NOW = 1000.0


# ------------------------------------------------------------------ served reads


def test_a_held_read_lapses_after_lease_s():
    reads = ServedReads(lease_s=10.0)
    reads.hold("t", "req", NOW)
    assert reads.lapsed(NOW + 9.9) == []
    assert reads.lapsed(NOW + 10.0) == [("t", "req")]
    assert not reads.holds("t")
    assert reads.lapsed(NOW + 100) == []  # handed back once


def test_renew_extends_the_lease_from_now():
    reads = ServedReads(lease_s=10.0)
    reads.hold("t", "req", NOW)
    assert reads.renew("t", NOW + 8)
    assert reads.lapsed(NOW + 17.9) == []
    assert reads.lapsed(NOW + 18) == [("t", "req")]


def test_renewing_a_read_not_held_says_so():
    reads = ServedReads(lease_s=10.0)
    assert not reads.renew("t", NOW)
    assert len(reads) == 0


def test_release_hands_the_request_back_once():
    reads = ServedReads(lease_s=10.0)
    reads.hold("t", "req", NOW)
    assert reads.holds("t")
    assert reads.release("t") == "req"
    assert reads.release("t") is None
    assert reads.lapsed(NOW + 100) == []


def test_only_the_lapsed_leases_are_taken_out():
    reads = ServedReads(lease_s=10.0)
    reads.hold("old", "a", NOW)
    reads.hold("new", "b", NOW + 5)
    assert reads.lapsed(NOW + 12) == [("old", "a")]
    assert reads.holds("new") and len(reads) == 1


# ------------------------------------------------------------------ renewals


def test_renewals_are_grouped_by_prefill_engine():
    renewals = Renewals()
    renewals.start("r1", "t1", "prefill-a")
    renewals.start("r2", "t2", "prefill-b")
    renewals.start("r3", "t3", "prefill-a")
    assert renewals.by_prefill() == {"prefill-a": ["t1", "t3"], "prefill-b": ["t2"]}


def test_a_stopped_request_is_no_longer_renewed():
    renewals = Renewals()
    renewals.start("r1", "t1", "prefill-a")
    renewals.start("r2", "t2", "prefill-a")
    renewals.stop(["r1", "unknown"])
    assert renewals.by_prefill() == {"prefill-a": ["t2"]}
    renewals.stop(["r2"])
    assert renewals.by_prefill() == {}
    assert len(renewals) == 0
