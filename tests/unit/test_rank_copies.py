"""A copy made of one transfer per peer rank ends once every part ended (connector/fanout.py),
and a decode rank keeps its blocks until every prefill rank writing into them answered
(connector/writer_answers.py): the per-rank rules of tensor parallelism, driven directly."""

from __future__ import annotations

import pytest

from kvpush.connector.fanout import Fanout, PartEnd
from kvpush.connector.writer_answers import Failure, WriterAnswers


def test_a_copy_in_two_parts_ends_only_when_both_ended_and_is_whole_only_if_both_landed():
    fan = Fanout(2)
    assert fan.ended(PartEnd(True, bytes=100, descriptors=2, write_ms=3.0)) is None
    assert fan.ended(PartEnd(True, bytes=50, descriptors=1, write_ms=5.0)) == PartEnd(True, 150, 3, "", 5.0)

    fan = Fanout(2)
    assert fan.ended(PartEnd(False, error="WRITE failed")) is None
    end = fan.ended(PartEnd(True, bytes=50, descriptors=1))
    assert (end.ok, end.error, end.bytes) == (False, "WRITE failed", 50)
    with pytest.raises(ValueError, match="all 2 parts have ended"):
        fan.ended(PartEnd(True))


def test_a_stuck_part_is_reported_once_and_the_copy_still_ends_when_it_does():
    fan = Fanout(2)
    assert fan.stuck() is True
    assert fan.stuck() is False
    assert fan.ended(PartEnd(True)) is None
    assert fan.ended(PartEnd(False, error="late")).ok is False


def test_a_decode_rank_keeps_its_blocks_until_every_writer_answered():
    """Two prefill ranks write into this decode rank: the first's failure fails the load,
    but the blocks are kept until the second's part landed or it failed too."""
    answers = WriterAnswers()
    assert answers.failed("t", 0, 2, "write_failed", "lost") is True
    assert answers.failing("t")
    assert answers.settled("t", landed=set()) is None  # writer 1 may still be writing
    assert answers.settled("t", landed={1}) == Failure("write_failed", "lost")
    assert answers.failed("t", 1, 2, "revoked", "decode gave it up") is False
    assert answers.settled("t", landed=set()) == Failure("write_failed", "lost")  # the first failure stands
    answers.forget("t")
    assert not answers.failing("t") and answers.settled("t", {0, 1}) is None


def test_one_writer_settles_at_its_own_failure():
    answers = WriterAnswers()
    answers.failed("t", 0, 1, "lease_expired", "no renewal")
    assert answers.settled("t", set()) == Failure("lease_expired", "no renewal")


def test_failures_that_do_not_add_up_are_refused():
    answers = WriterAnswers()
    with pytest.raises(ValueError, match="writer 2 outside 0..1"):
        answers.failed("t", 2, 2, "x", "")
    answers.failed("t", 0, 2, "x", "")
    with pytest.raises(ValueError, match="said 2 writers, now 4"):
        answers.failed("t", 1, 4, "x", "")
