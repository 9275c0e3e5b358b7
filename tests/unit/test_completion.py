"""Decode counts producer-rank notifications; a transfer is done when all ranks said so."""

from __future__ import annotations

import pytest

from kvpush.connector.completion import CompletionCounter, Notification, block_tag, notification, parse_notification, tag_matches


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
    tag = block_tag("k" * 32, [1, 2, 3])
    assert parse_notification(notification(transfer_id, 3, 4, tag)) == Notification(transfer_id, 3, 4, tag)


def test_a_tag_is_accepted_only_with_the_transfers_key_over_the_receivers_own_blocks():
    key = "0123456789abcdef0123456789abcdef"
    tag = block_tag(key, [7, 8, 9])
    assert tag_matches(tag, key, [7, 8, 9])
    assert not tag_matches(tag, key, [7, 8, 10])  # a write into other blocks than we registered
    assert not tag_matches(tag, key, [8, 7, 9])  # the same blocks in another order are other destinations
    assert not tag_matches(tag, "f" * 32, [7, 8, 9])  # made without this transfer's key
    assert not tag_matches(block_tag("", [7, 8, 9]), "", [7, 8, 9])  # no key: never accepted


@pytest.mark.parametrize("message", [b"", b"t:1:2", b"t:x:2:tag", b"\xff\xfe"])
def test_a_malformed_notification_raises_value_error(message):
    with pytest.raises(ValueError):
        parse_notification(message)


def test_a_late_duplicate_after_take_done_is_ignored():
    counter = CompletionCounter()
    assert counter.record("t", 0, 1) is True
    assert counter.take_done(["t"]) == {"t"}
    assert counter.record("t", 0, 1) is False
    assert counter.take_done(["t"]) == set()


# ------------------------------------------------------------------ layer by layer


def test_a_layered_copy_completes_only_when_every_layer_of_every_rank_came():
    counter = CompletionCounter()
    arrivals = [(0, 0), (1, 1), (0, 2), (1, 0), (0, 1), (1, 2)]  # (rank, layer), in any order
    done = [counter.record("t", rank, 2, layer, 3) for rank, layer in arrivals]
    assert done == [False] * 5 + [True]


def test_one_rank_whole_and_another_layered_complete_together():
    """Each rank's producer decides alone (its registration may come before or during the
    step): one rank's copy in one part, the other's in layers, is one transfer."""
    counter = CompletionCounter()
    assert counter.record("t", 0, 2) is False
    assert counter.record("t", 1, 2, 0, 2) is False
    assert counter.record("t", 1, 2, 1, 2) is True


def test_a_repeated_layer_does_not_stand_in_for_a_missing_one():
    counter = CompletionCounter()
    assert counter.record("t", 0, 1, 0, 2) is False
    assert counter.record("t", 0, 1, 0, 2) is False
    assert counter.take_done(["t"]) == set()


def test_a_rank_that_changes_its_part_count_is_refused():
    counter = CompletionCounter()
    counter.record("t", 0, 1, 0, 4)
    with pytest.raises(ValueError, match="said 4 parts"):
        counter.record("t", 0, 1, 0, 1)
    with pytest.raises(ValueError, match="part 4 outside"):
        counter.record("t", 0, 1, 4, 4)


def test_notifications_that_disagree_on_the_number_of_senders_are_refused():
    """A receiver never counts fewer senders than the first notification named: a
    sender saying 1 cannot complete a copy two senders share."""
    counter = CompletionCounter()
    assert counter.record("t", 0, 2) is False
    with pytest.raises(ValueError, match="said 2 senders, now 1"):
        counter.record("t", 0, 1)
    assert counter.record("t", 1, 2) is True


def test_the_senders_whose_parts_all_came_are_known_before_the_copy_completes():
    counter = CompletionCounter()
    counter.record("t", 1, 3, 0, 2)
    counter.record("t", 1, 3, 1, 2)
    counter.record("t", 2, 3, 0, 2)
    assert counter.landed("t") == {1}
    assert counter.landed("other") == set()
