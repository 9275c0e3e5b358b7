"""What a client has of a request's stream (shared/stream.py): the seq of the next chunk,
answer 0's tokens, the first token's time; and what an arriving chunk is to it."""

from __future__ import annotations

from kvpush.shared import wire
from kvpush.shared.stream import Arrival, StreamSoFar


def test_chunks_in_order_are_next_and_count_answer_0s_tokens_only():
    stream = StreamSoFar()
    assert stream.add(0, 0, [1, 2], now_wall=5.0) is Arrival.NEXT
    assert stream.add(1, 1, [9], now_wall=6.0) is Arrival.NEXT  # another answer's
    assert (stream.chunks, stream.tokens, stream.first_token_at) == (2, [1, 2], 5.0)


def test_a_place_that_came_already_is_a_repeat_and_changes_nothing():
    stream = StreamSoFar()
    stream.add(0, 0, [1], now_wall=5.0)
    assert stream.arrival(0) is Arrival.REPEAT
    assert stream.add(0, 0, [7], now_wall=6.0) is Arrival.REPEAT
    assert (stream.chunks, stream.tokens) == (1, [1])


def test_after_a_gap_the_stream_goes_on_from_the_chunk_that_came():
    stream = StreamSoFar()
    assert stream.arrival(2) is Arrival.GAP
    assert stream.add(2, 0, [3], now_wall=5.0) is Arrival.GAP
    assert (stream.chunks, stream.tokens) == (3, [3])
    assert stream.arrival(3) is Arrival.NEXT


def test_a_migrated_stream_resumes_where_its_client_is_and_says_so_again():
    resume = wire.Resume(token_ids=[1, 2, 3], chunks=2, first_token_at=4.0, continuation="replay", migrations=1)
    stream = StreamSoFar.resuming(resume)
    assert (stream.chunks, stream.tokens, stream.first_token_at) == (2, [1, 2, 3], 4.0)
    stream.add(2, 0, [4], now_wall=9.0)
    assert stream.first_token_at == 4.0  # the first token went out from the first decode
    again = stream.resume("reprefill", migrations=2)
    assert (again.token_ids, again.chunks, again.first_token_at, again.continuation, again.migrations) == (
        [1, 2, 3, 4], 3, 4.0, "reprefill", 2)
    assert StreamSoFar.resuming(None) == StreamSoFar()
