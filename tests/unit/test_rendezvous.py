"""Decode registrations meet finished prefills exactly once, in either order; waiting
halves hold a lease; a transfer given up refuses its later halves."""

from __future__ import annotations

import threading

from kvpush.connector.rendezvous import Match, Refused, Rendezvous


class FakeClock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def _rv(**kwargs) -> tuple[Rendezvous, FakeClock]:
    clock = FakeClock()
    return Rendezvous(clock=clock, **kwargs), clock


# ------------------------------------------------------------------ matching


def test_registration_first_matches_when_the_prefill_arrives():
    rv, _ = _rv()
    first = rv.offer_registration("t", "reg")
    match = rv.offer_prefill("t", "pre")
    assert first is None
    assert isinstance(match, Match)
    assert (match.transfer_id, match.registration, match.prefill, match.order) == (
        "t", "reg", "pre", "registration_first")


def test_prefill_first_matches_when_the_registration_arrives():
    rv, _ = _rv()
    first = rv.offer_prefill("t", "pre")
    match = rv.offer_registration("t", "reg")
    assert first is None
    assert isinstance(match, Match)
    assert (match.registration, match.prefill, match.order) == ("reg", "pre", "prefill_first")


def test_waited_s_is_how_long_the_first_half_waited():
    rv, clock = _rv()
    rv.offer_prefill("t", "pre")
    clock.now += 2.5
    match = rv.offer_registration("t", "reg")
    assert match.waited_s == 2.5


def test_other_transfers_are_not_disturbed():
    rv, _ = _rv()
    rv.offer_registration("a", "reg-a")
    rv.offer_prefill("b", "pre-b")
    match = rv.offer_prefill("a", "pre-a")
    assert match.transfer_id == "a"
    assert rv.pending() == ["b"]


# ------------------------------------------------------------------ duplicates


def test_a_duplicate_registration_is_refused_and_the_first_kept():
    rv, _ = _rv()
    rv.offer_registration("t", "reg-1")
    duplicate = rv.offer_registration("t", "reg-2")
    match = rv.offer_prefill("t", "pre")
    assert isinstance(duplicate, Refused)
    assert (duplicate.code, duplicate.registration) == ("duplicate", "reg-2")
    assert match.registration == "reg-1"


def test_a_duplicate_prefill_is_refused_and_the_first_kept():
    rv, _ = _rv()
    rv.offer_prefill("t", "pre-1")
    duplicate = rv.offer_prefill("t", "pre-2")
    match = rv.offer_registration("t", "reg")
    assert isinstance(duplicate, Refused)
    assert (duplicate.code, duplicate.registration) == ("duplicate", None)
    assert match.prefill == "pre-1"


def test_halves_arriving_after_the_match_are_refused_as_duplicates():
    rv, _ = _rv()
    rv.offer_registration("t", "reg")
    rv.offer_prefill("t", "pre")
    late = [rv.offer_registration("t", "reg"), rv.offer_prefill("t", "pre")]
    assert [(type(r), r.code) for r in late] == [(Refused, "duplicate"), (Refused, "duplicate")]
    assert rv.pending() == []


# ------------------------------------------------------------------ leases


def test_a_waiting_half_expires_after_lease_s():
    rv, clock = _rv(lease_s=10.0)
    rv.offer_prefill("t", "pre")
    clock.now += 9.9
    assert rv.expired() == []
    clock.now += 0.1
    gone = rv.expired()
    assert [(tid, half.prefill) for tid, half in gone] == [("t", "pre")]
    assert rv.pending() == []


def test_expired_hands_each_half_back_once():
    rv, clock = _rv(lease_s=1.0)
    rv.offer_registration("t", "reg")
    clock.now += 5
    assert len(rv.expired()) == 1
    assert rv.expired() == []


def test_renew_extends_the_lease():
    rv, clock = _rv(lease_s=10.0)
    rv.offer_registration("t", "reg")
    clock.now += 8
    assert rv.renew("t") is True
    clock.now += 8  # 16 s after arrival, 8 s after the renewal
    assert rv.expired() == []
    clock.now += 2
    assert [tid for tid, _ in rv.expired()] == ["t"]


def test_renew_of_an_unknown_or_matched_transfer_is_false():
    rv, _ = _rv()
    rv.offer_registration("t", "reg")
    rv.offer_prefill("t", "pre")
    assert (rv.renew("t"), rv.renew("nobody")) == (False, False)


def test_halves_after_expiry_are_refused_as_closed():
    rv, clock = _rv(lease_s=1.0)
    rv.offer_registration("t", "reg-1")
    clock.now += 1
    rv.expired()
    late = [rv.offer_prefill("t", "pre"), rv.offer_registration("t", "reg-2")]
    assert [(type(r), r.code) for r in late] == [(Refused, "closed"), (Refused, "closed")]
    assert "expired" in late[0].reason
    assert late[1].registration == "reg-2"
    assert rv.pending() == []


def test_a_matched_transfer_does_not_expire():
    rv, clock = _rv(lease_s=1.0)
    rv.offer_registration("t", "reg")
    rv.offer_prefill("t", "pre")
    clock.now += 100
    assert rv.expired() == []


# ------------------------------------------------------------------ close


def test_close_returns_the_pending_half_and_later_halves_are_closed():
    rv, _ = _rv()
    rv.offer_registration("t", "reg")
    half, matched = rv.close("t")
    later = [rv.offer_prefill("t", "pre"), rv.offer_registration("t", "reg")]
    assert (half.registration, half.prefill, matched) == ("reg", None, False)
    assert [r.code for r in later] == ["closed", "closed"]
    assert "revoked" in later[0].reason
    assert rv.pending() == []


def test_close_before_any_half_still_closes_the_transfer():
    rv, _ = _rv()
    assert rv.close("t") == (None, False)
    later = rv.offer_prefill("t", "pre")
    assert (type(later), later.code) == (Refused, "closed")


def test_close_of_a_matched_transfer_keeps_it_matched():
    rv, _ = _rv()
    rv.offer_registration("t", "reg")
    rv.offer_prefill("t", "pre")
    assert rv.close("t") == (None, True)
    late = rv.offer_registration("t", "reg")
    assert late.code == "duplicate"


# ------------------------------------------------------------------ check


def _same_decode(registration: str, prefill: str) -> str | None:
    """Registrations look like "decode-a"; a prefill like "for-decode-a"."""
    return None if prefill == f"for-{registration}" else f"{registration} is not the chosen decode"


def test_an_incompatible_registration_is_refused_and_the_prefill_keeps_waiting():
    rv, _ = _rv(check=_same_decode)
    rv.offer_prefill("t", "for-decode-a")
    refused = rv.offer_registration("t", "decode-b")
    assert isinstance(refused, Refused)
    assert (refused.code, refused.registration) == ("incompatible", "decode-b")
    assert "decode-b" in refused.reason
    assert rv.pending() == ["t"]
    match = rv.offer_registration("t", "decode-a")
    assert isinstance(match, Match)
    assert (match.registration, match.prefill) == ("decode-a", "for-decode-a")


def test_an_incompatible_pending_registration_is_dropped_when_the_prefill_arrives():
    rv, _ = _rv(check=_same_decode)
    rv.offer_registration("t", "decode-b")
    refused = rv.offer_prefill("t", "for-decode-a")
    assert isinstance(refused, Refused)
    assert (refused.code, refused.registration) == ("incompatible", "decode-b")
    assert rv.pending() == ["t"]
    match = rv.offer_registration("t", "decode-a")
    assert (match.registration, match.prefill) == ("decode-a", "for-decode-a")


def test_a_second_prefill_after_an_incompatible_drop_is_a_duplicate():
    rv, _ = _rv(check=_same_decode)
    rv.offer_registration("t", "decode-b")
    rv.offer_prefill("t", "for-decode-a")
    duplicate = rv.offer_prefill("t", "for-decode-a")
    assert duplicate.code == "duplicate"


def test_check_sees_the_registration_and_the_prefill():
    seen = []
    rv, _ = _rv(check=lambda reg, pre: seen.append((reg, pre)))
    rv.offer_prefill("t", "pre")
    rv.offer_registration("t", "reg")
    assert seen == [("reg", "pre")]


# ------------------------------------------------------------------ tombstones


def test_tombstones_are_bounded_oldest_first():
    rv, _ = _rv(max_tombstones=2)
    for tid in ("a", "b", "c"):
        rv.close(tid)
    # "a" was forgotten: a new half for it waits; "b" and "c" are still closed
    assert rv.offer_prefill("a", "pre") is None
    assert [rv.offer_prefill(t, "pre").code for t in ("b", "c")] == ["closed", "closed"]


def test_a_retombstoned_transfer_counts_as_newest():
    rv, clock = _rv(lease_s=1.0, max_tombstones=2)
    rv.close("a")
    rv.offer_registration("b", "reg")
    clock.now += 1
    rv.expired()  # "b" tombstoned after "a"
    rv.close("a")  # "a" again: now the newest
    rv.close("c")  # evicts the oldest, "b"
    assert rv.offer_prefill("b", "pre") is None
    assert rv.offer_prefill("a", "pre").code == "closed"


# ------------------------------------------------------------------ threads


def test_concurrent_offers_match_each_transfer_exactly_once():
    rv = Rendezvous()
    ids = [f"t-{i}" for i in range(500)]
    outcomes: list = []
    outcomes_lock = threading.Lock()
    start = threading.Barrier(8)

    def offer(kind: str, offset: int) -> None:
        start.wait()
        for transfer_id in ids[offset:] + ids[:offset]:
            if kind == "reg":
                result = rv.offer_registration(transfer_id, "reg")
            else:
                result = rv.offer_prefill(transfer_id, "pre")
            if result is not None:
                with outcomes_lock:
                    outcomes.append(result)

    # four offerers of each half per id, so duplicates race the matches too
    threads = [threading.Thread(target=offer, args=(kind, 60 * n))
               for n in range(4) for kind in ("reg", "pre")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    matches = [o for o in outcomes if isinstance(o, Match)]
    refused = [o for o in outcomes if isinstance(o, Refused)]
    assert sorted(m.transfer_id for m in matches) == sorted(ids)
    assert all((m.registration, m.prefill) == ("reg", "pre") for m in matches)
    assert {r.code for r in refused} == {"duplicate"}
    # 8 offers per id: one waits, one matches, the other six are refused
    assert len(refused) == 6 * len(ids)
    assert rv.pending() == []


def test_past_max_pending_a_registration_is_refused_and_its_sender_told_but_a_prefill_gets_in():
    rv, _ = _rv(max_pending=3)
    for n in range(3):
        assert rv.offer_registration(f"t{n}", f"reg{n}") is None
    refused = rv.offer_registration("t3", "reg3")
    assert isinstance(refused, Refused) and refused.code == "closed" and refused.registration == "reg3"
    assert rv.offer_prefill("t4", "own-prefill") is None  # this engine's own work always waits
    assert sorted(rv.pending()) == ["t0", "t1", "t2", "t4"]
    assert isinstance(rv.offer_prefill("t0", "p0"), Match)
    assert isinstance(rv.offer_prefill("t1", "p1"), Match)
    assert rv.offer_registration("t3", "reg3") is None  # not tombstoned: once there is room, it waits


def test_renewals_keep_a_half_no_longer_than_max_life_s():
    rv, clock = _rv(lease_s=10.0, max_life_s=25.0)
    rv.offer_registration("t1", "reg")
    for _ in range(4):  # a renewal every 5 s, as if for ever
        clock.now += 5.0
        rv.renew("t1")
    clock.now = 1000.0 + 24.9
    assert rv.expired() == []
    clock.now = 1000.0 + 25.0
    assert [tid for tid, _ in rv.expired()] == ["t1"]


# ------------------------------------------------------------------ retarget


def test_retarget_drops_the_waiting_registration_and_the_next_one_pairs():
    rv, _ = _rv(check=lambda reg, pre: None if reg.startswith(pre) else f"{reg} is not {pre}'s")
    assert rv.offer_registration("t", "d1") is None
    assert rv.retarget("t", lambda pre: pre) == (None, "d1")
    assert rv.offer_registration("t", "d2") is None  # waits: nothing of d1 is left
    match = rv.offer_prefill("t", "d2")
    assert isinstance(match, Match) and match.registration == "d2"


def test_retarget_updates_a_waiting_prefill_and_renews_its_lease():
    rv, clock = _rv(lease_s=5.0, check=lambda reg, pre: None if reg == pre else f"{reg} is not {pre}")
    rv.offer_prefill("t", "d1")
    clock.now += 4.0
    assert rv.retarget("t", lambda pre: "d2") == (None, None)
    clock.now += 4.0
    assert rv.expired() == []  # the move gave it a whole lease again
    refused = rv.offer_registration("t", "d1")
    assert isinstance(refused, Refused) and refused.code == "incompatible"
    assert isinstance(rv.offer_registration("t", "d2"), Match)


def test_retarget_is_refused_once_matched_or_closed():
    rv, _ = _rv()
    rv.offer_registration("t", "reg")
    rv.offer_prefill("t", "pre")
    assert rv.retarget("t", lambda pre: pre) == ("its write has begun", None)
    rv.offer_prefill("u", "pre")
    rv.close("u", "revoked")
    assert rv.retarget("u", lambda pre: pre) == ("the transfer is revoked", None)
