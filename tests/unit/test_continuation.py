"""How a migrated request resumes (shared/continuation.py): which requests replay, which
cannot move, and what the new attempt computes."""

from __future__ import annotations

import pytest

from kvpush.shared import continuation, wire


def _sampling(**fields) -> wire.SamplingSpec:
    return wire.SamplingSpec(**{"max_tokens": 50, "temperature": 0.0, "ignore_eos": False, **fields})


@pytest.mark.parametrize("fields,kind", [
    ({}, "reprefill"),  # greedy
    ({"temperature": 0.8}, "reprefill"),  # sampled without a seed: any sample is a continuation
    ({"temperature": 0.8, "seed": 3}, "replay"),
    ({"seed": 3}, "reprefill"),  # greedy ignores its seed
    ({"stop": ["\n\n"]}, "replay"),
    ({"structured_outputs": wire.StructuredOutput(json={"type": "object"})}, "replay"),
    ({"presence_penalty": 0.5}, "replay"),
    ({"frequency_penalty": 0.5}, "replay"),
    ({"bad_words": ["x"]}, "replay"),
    ({"repetition_penalty": 1.2}, "reprefill"),  # counts prompt and output alike
])
def test_what_a_request_needs_to_continue_exactly(fields, kind):
    assert continuation.continuation_of(_sampling(**fields))[0] == kind


def test_why_a_request_cannot_move():
    assert continuation.why_not_migrate(_sampling(), 0, 2, sent_known=True) is None
    assert "--max-migrations 2" in continuation.why_not_migrate(_sampling(), 2, 2, sent_known=True)
    assert "n > 1" in continuation.why_not_migrate(_sampling(n=2), 0, 2, sent_known=True)
    assert "does not know every token" in continuation.why_not_migrate(_sampling(), 0, 2, sent_known=False)


def test_a_reprefill_computes_the_tokens_sent_as_prompt_and_shrinks_the_budget():
    resume = wire.Resume(token_ids=[7, 8, 9], chunks=2, first_token_at=1.0, continuation="reprefill")
    assert continuation.resumed_prompt([1, 2], resume) == [1, 2, 7, 8, 9]
    assert continuation.resumed_sampling({"max_tokens": 10, "min_tokens": 5}, resume) == \
        {"max_tokens": 7, "min_tokens": 2}
    assert continuation.replayed_tokens(resume) == []


def test_a_replay_keeps_the_prompt_and_budget_and_replays_the_tokens_sent():
    resume = wire.Resume(token_ids=[7, 8, 9], chunks=3, first_token_at=1.0, continuation="replay")
    assert continuation.resumed_prompt([1, 2], resume) == [1, 2]
    assert continuation.resumed_sampling({"max_tokens": 10}, resume) == {"max_tokens": 10}
    assert continuation.replayed_tokens(resume) == [7, 8, 9]
    assert continuation.resumed_prompt([1, 2], None) == [1, 2] and continuation.replayed_tokens(None) == []
