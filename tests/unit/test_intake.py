"""services/scheduler/intake.py, the pure core of durable intake: who takes a request, and
when a held copy of it is an orphan to take."""

from __future__ import annotations

import json

from kvpush.services.scheduler.intake import HeldRequest, IntakeBook, designated, intake_key

LIVE = {"scheduler-a": "a1", "scheduler-b": "b1", "scheduler-c": "c1"}


def held(key: str, chosen: str, incarnation: str, at: float = 0.0) -> HeldRequest:
    return HeldRequest(key, key, "kvpush.generate.client-0", "_INBOX.client-0.x", b"{}", None, 0, at, chosen,
                       incarnation)


def key_for(me: str, live: dict[str, str], not_by: str) -> str:
    """A key that ``me`` is designated for among ``live`` but ``not_by`` was among ``live`` + ``not_by``."""
    for n in range(10_000):
        key = f"o.client-0.r-{n}"
        if designated(key, list(live)) == me and designated(key, [*live, not_by]) == not_by:
            return key
    raise AssertionError("no such key")


def test_the_same_request_gets_the_same_key_and_taker_on_every_scheduler():
    body = json.dumps({"prompt": "hi"}).encode()
    first, second = intake_key("client-0", "_INBOX.client-0.a", body), intake_key("client-0", "_INBOX.client-0.a", body)
    assert first == second and first[1].startswith("gen-")  # no id given: one derived, the same everywhere
    assert intake_key("client-0", "_INBOX.client-0.b", body) != first  # another inbox, another request
    assert intake_key("client-0", "_INBOX.x", json.dumps({"request_id": "r-1"}).encode()) == ("o.client-0.r-1", "r-1")
    assert intake_key("", "_INBOX.x", b"{not json")[0].startswith("p.gen-")
    takers = {designated(f"o.client-0.r-{n}", list(LIVE)) for n in range(200)}
    assert takers == set(LIVE)  # spread over every scheduler
    assert designated("o.client-0.r-1", []) is None


def test_a_copy_is_taken_only_once_its_taker_is_gone_and_this_scheduler_is_designated():
    live_after = {"scheduler-a": "a1", "scheduler-c": "c1"}
    key = key_for("scheduler-a", live_after, not_by="scheduler-b")
    book = IntakeBook("scheduler-a", keep_s=300, grace_s=2)
    book.hold(held(key, "scheduler-b", "b1"))
    assert book.orphaned(LIVE, now=10.0) == []  # b is live: it takes it, however long it takes
    assert key in book
    [taken] = book.orphaned(live_after, now=10.0)  # b gone: a is designated now
    assert taken.key == key and key not in book


def test_a_copy_whose_taker_restarted_is_an_orphan():
    """Its new start is live under the same id but never had the request: another takes it."""
    key = key_for("scheduler-a", {"scheduler-a": "a1", "scheduler-c": "c1"}, not_by="scheduler-b")
    book = IntakeBook("scheduler-a", keep_s=300, grace_s=2)
    book.hold(held(key, "scheduler-b", "b1"))
    assert book.orphaned(LIVE, now=1.0) == []  # b's first start is still live
    [taken] = book.orphaned({**LIVE, "scheduler-b": "b2"}, now=1.0)
    assert taken.key == key


def test_a_settled_copy_is_never_taken_and_an_old_one_goes():
    live_after = {"scheduler-a": "a1", "scheduler-c": "c1"}
    key = key_for("scheduler-a", live_after, not_by="scheduler-b")
    book = IntakeBook("scheduler-a", keep_s=300, grace_s=2)
    book.hold(held(key, "scheduler-b", "b1"))
    book.settle(key)
    assert book.orphaned(live_after, now=10.0) == []
    book.hold(held(key, "scheduler-b", "b1", at=0.0))
    assert book.orphaned(LIVE, now=301.0) == [] and len(book) == 0  # past its keep time: dropped


def test_a_copy_nobody_took_because_views_differed_is_taken_after_the_grace():
    """b had just started and did not count itself yet: it saw a designated and held the
    copy, while a, which saw b live, saw b designated and held it too. Now b counts itself,
    and is designated; a is live, so only the grace lets b take it."""
    now_live = {"scheduler-a": "a1", "scheduler-b": "b1"}
    key = next(k for k in (f"o.client-0.r-{n}" for n in range(10_000))
               if designated(k, list(now_live)) == "scheduler-b")
    book = IntakeBook("scheduler-b", keep_s=300, grace_s=2)
    book.hold(held(key, "scheduler-a", "a1", at=0.0))
    assert book.orphaned(now_live, now=1.0) == []  # within the grace: a may still be taking it
    assert [c.key for c in book.orphaned(now_live, now=3.0)] == [key]


def test_copies_are_bounded():
    book = IntakeBook("scheduler-a", keep_s=300, grace_s=2, max_held=3)
    for n in range(5):
        book.hold(held(f"o.c.r-{n}", "scheduler-b", "b1"))
    assert len(book) == 3 and "o.c.r-0" not in book and "o.c.r-4" in book
