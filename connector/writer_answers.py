"""A decode rank's record of what the prefill ranks writing into its blocks said, per
transfer (push, tensor parallelism: ``kvpush.connector.tp_map``).

Several prefill ranks may write into one decode rank's blocks (prefill TP 2, decode TP
1). One of them failing means the request's KV will not be whole, so its load fails;
but the others may still be writing into the same blocks, so the blocks are kept until
every writer answered: its part landed (all its notifications came) or it said that
none of its part can land any more (failed, revoked). Writers are numbered by their
place among this rank's writers, as their notifications number them.

Pure Python and thread-safe (the NATS thread records failures, the transfer thread
asks after notifications). Bounded: past ``max_transfers`` the oldest is forgotten.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Failure:
    code: str
    reason: str


@dataclass(slots=True)
class _Answers:
    writers: int
    first: Failure
    failed: set[int] = field(default_factory=set)


class WriterAnswers:
    def __init__(self, max_transfers: int = 10_000):
        self._lock = threading.Lock()  # protects _answers
        self._answers: dict[str, _Answers] = {}
        self._max_transfers = max_transfers

    def failed(self, transfer_id: str, writer: int, writers: int, code: str, reason: str) -> bool:
        """Writer ``writer`` of ``writers`` said its part will not land; True if it is the
        transfer's first failure. Raises ValueError for a writer outside the count, or a
        count other than an earlier failure's."""
        if not 0 <= writer < writers:
            raise ValueError(f"writer {writer} outside 0..{writers - 1}")
        with self._lock:
            answers = self._answers.get(transfer_id)
            if answers is None:
                answers = self._answers[transfer_id] = _Answers(writers, Failure(code, reason))
                while len(self._answers) > self._max_transfers:
                    del self._answers[next(iter(self._answers))]
            elif answers.writers != writers:
                raise ValueError(f"a failure said {answers.writers} writers, now {writers}")
            first = not answers.failed
            answers.failed.add(writer)
            return first

    def settled(self, transfer_id: str, landed: set[int]) -> Failure | None:
        """The transfer's first failure once every writer answered, failed or ``landed``
        (all its notifications came); None while one has not, or if none failed."""
        with self._lock:
            answers = self._answers.get(transfer_id)
            if answers is None or len(answers.failed | landed) < answers.writers:
                return None
            return answers.first

    def first(self, transfer_id: str) -> Failure | None:
        """The transfer's first failure, if a writer failed."""
        with self._lock:
            answers = self._answers.get(transfer_id)
            return answers.first if answers is not None else None

    def failing(self, transfer_id: str) -> bool:
        """A writer of this transfer failed."""
        with self._lock:
            return transfer_id in self._answers

    def forget(self, transfer_id: str) -> None:
        with self._lock:
            self._answers.pop(transfer_id, None)
