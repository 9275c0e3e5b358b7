"""Decode counts producer-rank notifications; a transfer is done when all ranks said so."""

from __future__ import annotations

import pytest

from connector.completion import CompletionCounter, notification, parse_notification


def test_a_single_rank_completes_at_once():
    counter = CompletionCounter()
    assert counter.record("t", 0, 1) is True
    assert counter.take_done(["t"]) == {"t"}


def test_two_ranks_complete_only_after_both():
    counter = CompletionCounter()
    after_first = counter.record("t", 1, 2)
    done_early = counter.take_done(["t"])
    after_second = counter.record("t", 0, 2)
    assert (after_first, done_early, after_second) == (False, set(), True)
    assert counter.take_done(["t"]) == {"t"}


def test_a_repeated_rank_does_not_complete_the_transfer():
    counter = CompletionCounter()
    counter.record("t", 0, 2)
    assert counter.record("t", 0, 2) is False
    assert counter.take_done(["t"]) == set()


def test_a_notification_after_completion_does_not_complete_it_again():
    counter = CompletionCounter()
    counter.record("t", 0, 1)
    assert counter.record("t", 0, 1) is False


def test_completion_is_kept_until_decode_asks_for_the_transfer():
    counter = CompletionCounter()
    counter.record("early", 0, 1)
    not_asked = counter.take_done(["other"])
    assert not_asked == set()
    assert counter.take_done(["early"]) == {"early"}


def test_take_done_returns_only_the_requested_ids_and_clears_them():
    counter = CompletionCounter()
    for transfer_id in ("a", "b", "c"):
        counter.record(transfer_id, 0, 1)
    first = counter.take_done(["a", "c", "never"])
    second = counter.take_done(["a", "b", "c"])
    assert (first, second) == ({"a", "c"}, {"b"})


def test_forget_drops_partial_and_finished_transfers():
    counter = CompletionCounter()
    counter.record("partial", 0, 2)
    counter.record("done", 0, 1)
    counter.forget("partial")
    counter.forget("done")
    assert counter.record("partial", 1, 2) is False
    assert counter.take_done(["partial", "done"]) == set()


@pytest.mark.parametrize("rank,num_ranks", [(2, 2), (-1, 2), (0, 0)])
def test_a_rank_outside_the_producer_group_is_refused(rank, num_ranks):
    counter = CompletionCounter()
    with pytest.raises(ValueError, match=f"rank {rank} outside"):
        counter.record("t", rank, num_ranks)


@pytest.mark.parametrize("transfer_id", ["t-1", "req:abc:7", "a:b", ":", "x:1:2"])
def test_a_notification_round_trips(transfer_id):
    assert parse_notification(notification(transfer_id, 3, 4)) == (transfer_id, 3, 4)


def test_a_late_duplicate_after_take_done_is_ignored():
    counter = CompletionCounter()
    assert counter.record("t", 0, 1) is True
    assert counter.take_done(["t"]) == {"t"}
    assert counter.record("t", 0, 1) is False
    assert counter.take_done(["t"]) == set()
