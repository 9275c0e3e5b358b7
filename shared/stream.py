"""What a client has of one request's answer stream, counted the same way wherever it is
counted: by the decode that sends it (``kvpush.services.worker.answer``), by the scheduler
from decode's token records (its flight), and by the client as the chunks arrive
(``kvpush.client``).

Every token chunk carries a ``seq``: the chunks of all the request's answers, numbered in
the order they went out. A stream that moved to another decode mid-way (a migration) goes
on from the chunks sent, and what its client has of answer 0 travels as ``wire.Resume``
(``StreamSoFar.resuming`` and ``StreamSoFar.resume``).

An arriving chunk is one of three (``Arrival``): the next one; a repeat of a place that
came already (an old decode's, sent while it was being stopped: the first one stands); or
one after a gap (a chunk before it never came). What a gap means is the counter's to say:
the client ends the request, the scheduler no longer knows what its client has.

Pure: no NATS, no vLLM.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvpush.shared import wire


class Arrival(enum.Enum):
    NEXT = "next"  # the chunk the stream expects
    REPEAT = "repeat"  # its place in the stream came already
    GAP = "gap"  # a chunk before it never came


@dataclass
class StreamSoFar:
    """The chunks a client has of one request (of every answer), answer 0's tokens in
    order, and when the first token went out."""

    chunks: int = 0  # of every answer: the next one's seq
    tokens: list[int] = field(default_factory=list)  # answer 0's
    first_token_at: float | None = None  # wall clock; None until a token went out

    @classmethod
    def resuming(cls, resume: wire.Resume | None) -> "StreamSoFar":
        """Nothing yet, or where a migrated request's client is."""
        if resume is None:
            return cls()
        return cls(chunks=resume.chunks, tokens=list(resume.token_ids), first_token_at=resume.first_token_at)

    def arrival(self, seq: int) -> Arrival:
        """What chunk ``seq`` is to this stream."""
        if seq < self.chunks:
            return Arrival.REPEAT
        return Arrival.NEXT if seq == self.chunks else Arrival.GAP

    def add(self, seq: int, index: int, token_ids: list[int], now_wall: float) -> Arrival:
        """Count chunk ``seq`` (of answer ``index``) in, and say what it was. A repeat
        changes nothing; after a gap the stream goes on from ``seq``, the missing chunks'
        tokens unknown (the caller says what that means)."""
        arrival = self.arrival(seq)
        if arrival is Arrival.REPEAT:
            return arrival
        self.chunks = seq + 1
        if index == 0:
            self.tokens.extend(token_ids)
        if self.first_token_at is None:
            self.first_token_at = now_wall
        return arrival

    def resume(self, continuation: wire.Continuation, migrations: int) -> wire.Resume:
        """Where the next decode resumes (``migrations``: this is the request's n-th)."""
        return wire.Resume(token_ids=list(self.tokens), chunks=self.chunks,
                           first_token_at=self.first_token_at or 0.0, continuation=continuation,
                           migrations=migrations)
