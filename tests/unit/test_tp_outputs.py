"""The judgement of kvpush's outputs against single engines at each tensor-parallel size
(kvpush.tools.tp_outputs): equal to a reference, a departure at a near tie of the
reference's two most likely tokens, or a difference; and the counts per combination."""

from __future__ import annotations

from kvpush.tools.tp_outputs.compare import Reference, Verdict, count, first_difference, judge, top_two_gap
from kvpush.tools.tp_outputs.run import as_asked, judged, prompts, requests, LENGTHS


def candidates(*positions: tuple[tuple[int, float], ...]) -> list[list[list]]:
    return [[[token, logprob] for token, logprob in position] for position in positions]


def test_first_difference_finds_the_first_position_or_none():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2  # a prefix departs where it ends


def test_top_two_gap_is_between_two_distinct_tokens():
    # the sampled token (first) is also among the two most likely: counted once
    assert top_two_gap([[7, -0.5], [7, -0.5], [9, -0.75]]) == 0.25
    assert top_two_gap([[3, -2.0], [7, -0.5], [9, -0.75]]) == 0.25  # a sampled unlikely token is not the top
    assert top_two_gap([[7, -0.5]]) is None


def test_an_output_equal_to_either_reference_is_equal_and_says_which():
    tp1 = Reference(1, [5, 6, 7], candidates(((5, -0.1), (8, -3.0)),) * 3)
    tp2 = Reference(2, [5, 6, 9], candidates(((5, -0.1), (8, -3.0)),) * 3)
    assert judge([5, 6, 9], [tp1, tp2]) == Verdict("equal", equals_tp=[2])
    assert judge([5, 6, 7], [tp1]).equals_tp == [1]


def test_a_departure_at_a_near_tie_of_the_reference_is_a_tie_and_elsewhere_a_difference():
    near_tie = candidates(((5, -0.1), (8, -3.0)), ((6, -0.69310), (4, -0.69315)), ((7, -0.1), (1, -4.0)))
    reference = Reference(2, [5, 6, 7], near_tie)
    verdict = judge([5, 4, 3], [reference])
    assert verdict.outcome == "tie"
    assert verdict.departures[0].position == 1
    assert abs(verdict.departures[0].top_two_gap - 5e-5) < 1e-9
    far = judge([8, 6, 7], [reference])  # departs at position 0, where the reference was sure
    assert far.outcome == "differs" and far.departures[0].position == 0


def test_a_tie_with_one_reference_is_enough_when_it_equals_neither():
    sure = Reference(1, [5, 6], candidates(((5, -0.1), (8, -3.0)), ((6, -0.1), (4, -3.0))))
    tied = Reference(2, [5, 4], candidates(((5, -0.1), (8, -3.0)), ((4, -0.69310), (3, -0.69312))))
    verdict = judge([5, 3], [sure, tied])
    assert verdict.outcome == "tie"
    assert [d.is_tie for d in verdict.departures] == [False, True]


def test_counts_per_combination_count_each_outcome_and_the_paths_not_as_asked():
    rows = [{"verdict": Verdict("equal", equals_tp=[2, 1]), "as_asked": True, "kv_checksum": "verified"},
            {"verdict": Verdict("equal", equals_tp=[1]), "as_asked": True},
            {"verdict": Verdict("tie"), "as_asked": True},
            {"verdict": Verdict("differs"), "as_asked": False},
            {"verdict": Verdict("failed"), "as_asked": False}]
    counts = count(rows, prefill_tp=2, decode_tp=1)
    assert counts == {"requests": 5, "equal_prefill_tp": 1, "equal_decode_tp": 2, "equal_either": 2, "ties": 1,
                      "differs": 1, "failed": 1, "not_as_asked": 2, "checksum_verified": 1}


def test_a_row_is_judged_against_the_references_at_both_its_tps():
    refs = {1: [Reference(1, [1, 2], candidates(((1, 0.0), (2, -1.0)),) * 2)],
            2: [Reference(2, [1, 3], candidates(((1, 0.0), (2, -1.0)),) * 2)]}
    row = {"prefill_tp": 2, "decode_tp": 1, "index": 0, "tokens": [1, 3], "mode": "push", "served_mode": "push",
           "received_tokens": 5, "recomputed_tokens": 0}
    [row] = judged([row], refs)
    assert row["verdict"].equals_tp == [2] and row["as_asked"]


def test_a_request_served_otherwise_than_asked_is_flagged():
    served = {"tokens": [1], "mode": "pull", "served_mode": "pull", "received_tokens": 10, "recomputed_tokens": 0}
    assert as_asked(served)
    assert not as_asked({**served, "served_mode": "push"})
    assert not as_asked({**served, "recomputed_tokens": 10})  # its KV failed and decode computed it
    assert as_asked({**served, "mode": "local", "served_mode": "local", "received_tokens": None})
    assert not as_asked({**served, "tokens": None})


def test_twenty_prompts_from_one_to_1800_tokens_each_greedy_and_seeded():
    ids = prompts(4096)
    assert [len(p) for p in ids] == list(LENGTHS) and len(ids) == 20
    assert min(LENGTHS) == 1 and max(LENGTHS) == 1800
    reqs = requests(ids, 24)
    assert len(reqs) == 40
    assert {r["temperature"] for r in reqs} == {0.0, 0.8}
    assert all(r["seed"] == 7 for r in reqs if r["temperature"] > 0)
    assert prompts(4096) == ids  # the same prompts every run
