"""Decode registrations meet finished prefills exactly once, in either order."""

from __future__ import annotations

import threading
import time

from connector.rendezvous import Rendezvous


def test_registration_first_matches_when_the_prefill_arrives():
    rv = Rendezvous()
    first = rv.offer_registration("t", "reg")
    match = rv.offer_prefill("t", "pre")
    assert first is None
    assert (match.transfer_id, match.registration, match.prefill, match.order) == (
        "t", "reg", "pre", "registration_first")


def test_prefill_first_matches_when_the_registration_arrives():
    rv = Rendezvous()
    first = rv.offer_prefill("t", "pre")
    match = rv.offer_registration("t", "reg")
    assert first is None
    assert (match.registration, match.prefill, match.order) == ("reg", "pre", "prefill_first")


def test_a_duplicate_registration_is_ignored_and_keeps_the_first():
    rv = Rendezvous()
    rv.offer_registration("t", "reg-1")
    duplicate = rv.offer_registration("t", "reg-2")
    match = rv.offer_prefill("t", "pre")
    assert duplicate is None
    assert match.registration == "reg-1"


def test_a_duplicate_prefill_is_ignored_and_keeps_the_first():
    rv = Rendezvous()
    rv.offer_prefill("t", "pre-1")
    duplicate = rv.offer_prefill("t", "pre-2")
    match = rv.offer_registration("t", "reg")
    assert duplicate is None
    assert match.prefill == "pre-1"


def test_halves_arriving_after_the_match_are_ignored():
    rv = Rendezvous()
    rv.offer_registration("t", "reg")
    rv.offer_prefill("t", "pre")
    late = [rv.offer_registration("t", "reg"), rv.offer_prefill("t", "pre")]
    assert late == [None, None]
    assert rv.pending() == []


def test_forget_drops_the_pending_half_and_ignores_later_ones():
    rv = Rendezvous()
    rv.offer_registration("t", "reg")
    dropped = rv.forget("t")
    later = [rv.offer_prefill("t", "pre"), rv.offer_registration("t", "reg")]
    assert dropped.registration == "reg"
    assert later == [None, None]
    assert rv.pending() == []


def test_forget_before_any_half_still_ignores_later_ones():
    rv = Rendezvous()
    dropped = rv.forget("t")
    later = rv.offer_prefill("t", "pre")
    assert (dropped, later) == (None, None)
    assert rv.pending() == []


def test_waited_s_is_how_long_the_first_half_waited():
    rv = Rendezvous()
    rv.offer_prefill("t", "pre")
    time.sleep(0.05)
    match = rv.offer_registration("t", "reg")
    assert match.waited_s >= 0.05


def test_other_transfers_are_not_disturbed():
    rv = Rendezvous()
    rv.offer_registration("a", "reg-a")
    rv.offer_prefill("b", "pre-b")
    match = rv.offer_prefill("a", "pre-a")
    assert match.transfer_id == "a"
    assert rv.pending() == ["b"]


def test_concurrent_offers_match_each_transfer_exactly_once():
    rv = Rendezvous()
    ids = [f"t-{i}" for i in range(500)]
    matches = []
    matches_lock = threading.Lock()
    start = threading.Barrier(8)

    def offer(kind: str, offset: int) -> None:
        start.wait()
        for transfer_id in ids[offset:] + ids[:offset]:
            if kind == "reg":
                match = rv.offer_registration(transfer_id, "reg")
            else:
                match = rv.offer_prefill(transfer_id, "pre")
            if match is not None:
                with matches_lock:
                    matches.append(match)

    # two offerers of each half per id, so duplicates race the matches too
    threads = [threading.Thread(target=offer, args=(kind, 60 * n))
               for n in range(4) for kind in ("reg", "pre")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(m.transfer_id for m in matches) == sorted(ids)
    assert all((m.registration, m.prefill) == ("reg", "pre") for m in matches)
    assert rv.pending() == []
