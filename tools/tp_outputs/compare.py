"""One kvpush output against the single-engine references, and the counts of many. Pure:
token ids and logprobs in, verdicts and counts out.

An output *equals* a reference when every token id is the same. Where it equals none, it
departs from each reference at a first differing position; the departure is a *tie* when,
at that position, the reference's two most likely tokens lie within ``TIE_GAP`` of each
other in logprob (so in logit: a position's logprobs are its logits less one constant), as
the reference itself reported them (``logprobs=2``): which of the two a run picks is then a
matter of float rounding, here of the order in which ranks sum their parts. Any other
departure is a *difference*, which the issue's check does not allow.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

TIE_GAP = 1e-4

Outcome = Literal["equal", "tie", "differs", "failed"]


@dataclass(frozen=True)
class Reference:
    """A single engine's answer to one request: its token ids, and at each position its
    candidates as [token id, logprob] (the sampled token and the two most likely)."""

    tp: int
    token_ids: list[int]
    candidates: list[list[list]]


@dataclass
class Departure:
    """Where an output leaves one reference: the position, and there the gap between the
    reference's two most likely tokens (None when the reference has no such position)."""

    tp: int
    position: int
    top_two_gap: float | None

    @property
    def is_tie(self) -> bool:
        return self.top_two_gap is not None and self.top_two_gap <= TIE_GAP


@dataclass
class Verdict:
    outcome: Outcome
    equals_tp: list[int] = field(default_factory=list)  # the TPs whose reference it equals
    departures: list[Departure] = field(default_factory=list)  # where it equals none: one per reference


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where ``a`` and ``b`` differ (the shorter one's length when one
    is a prefix of the other), or None when they are equal."""
    for position, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return position
    return None if len(a) == len(b) else min(len(a), len(b))


def top_two_gap(candidates: list[list]) -> float | None:
    """The logprob of the most likely candidate less that of the second (two distinct
    tokens), or None when fewer than two are known."""
    best: dict[int, float] = {}
    for token_id, logprob in candidates:
        best[token_id] = max(logprob, best.get(token_id, float("-inf")))
    top = sorted(best.values(), reverse=True)
    return top[0] - top[1] if len(top) >= 2 else None


def judge(output: list[int], references: list[Reference]) -> Verdict:
    """``output`` against every reference: equal to some, or else a tie (a departure from at
    least one reference at a near tie of that reference's), or else a difference."""
    equals = [ref.tp for ref in references if ref.token_ids == output]
    if equals:
        return Verdict("equal", equals_tp=equals)
    departures = []
    for ref in references:
        position = first_difference(output, ref.token_ids)
        gap = top_two_gap(ref.candidates[position]) if position < len(ref.candidates) else None
        departures.append(Departure(ref.tp, position, gap))
    return Verdict("tie" if any(d.is_tie for d in departures) else "differs", departures=departures)


COLUMNS = ("requests", "equal_prefill_tp", "equal_decode_tp", "equal_either", "ties", "differs", "failed",
           "not_as_asked", "checksum_verified")


def count(rows: list[dict], prefill_tp: int, decode_tp: int) -> dict[str, int]:
    """The outputs of one (TP pair, mode, sampling), by ``COLUMNS``: how many were asked,
    how many equal the reference at the prefill's TP, at the decode's TP, and either; how
    many departed at a tie, how many differ, how many failed, how many were served otherwise
    than asked (a different mode, or their KV recomputed), and how many decode checked
    against prefill's checksums (the path report's ``kv_checksum``: verified).

    ``rows``: one per output, each with its ``verdict`` (a Verdict), ``as_asked`` and (when
    served) its ``kv_checksum``."""
    tally = Counter(requests=len(rows))
    for row in rows:
        verdict: Verdict = row["verdict"]
        tally.update({"equal_prefill_tp": prefill_tp in verdict.equals_tp,
                      "equal_decode_tp": decode_tp in verdict.equals_tp,
                      "equal_either": verdict.outcome == "equal", "ties": verdict.outcome == "tie",
                      "differs": verdict.outcome == "differs", "failed": verdict.outcome == "failed",
                      "not_as_asked": not row["as_asked"],
                      "checksum_verified": row.get("kv_checksum") == "verified"})
    return {column: int(tally[column]) for column in COLUMNS}
