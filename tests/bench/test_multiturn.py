"""`kvpush bench-multiturn` in CI size: closed-loop conversations through the real openai
client against kvpush with prefix caching on and off, every answer checked against a
single vLLM instance. It asserts complete, correct results, not speed."""

from __future__ import annotations

import json

import pytest

from tests.early import EARLY, multiturn

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def multiturn_run(model_dir):
    """The run, in the session's background lane (tests/early.py): two conversations of
    three turns (200-token openings, 40 tokens a turn, 6 out), two at a time, kvpush push
    with prefix caching and fetching on, and with caching off."""
    return EARLY.result("multiturn", lambda: multiturn(model_dir))


def test_conversations_run_closed_loop_and_every_answer_equals_the_reference(multiturn_run):
    out = multiturn_run.out
    assert multiturn_run.returncode == 0, multiturn_run.output()[-4000:]
    results = json.loads((out / "multiturn.json").read_text())
    assert set(results["runs"]) == {"kvpush-push prefix caching on, fetching on", "kvpush-push prefix caching off"}
    for label, result in results["runs"].items():
        assert (result["turns"], result["failed"], result["wrong_outputs"]) == (6, 0, []), (label, result)
        turns = {(t["conversation"], t["turn"]): t for t in result["turns_detail"]}
        for (conversation, number), turn in turns.items():
            assert len(turn["tokens"]) == 6 and turn["ttft_ms"] > 0
            if number > 1:  # each turn appends the last turn's answer and a new message to its prompt
                last = turns[(conversation, number - 1)]
                assert turn["prompt"][:len(last["prompt"]) + 6] == last["prompt"] + last["tokens"]
                assert len(turn["prompt"]) == len(last["prompt"]) + 6 + 40
                # where its history was: found in the cache of the engine computing it, or
                # fetched from another's, or recomputed; no cache to find it in when caching is off
                caching = label.endswith("fetching on")
                assert (turn["path"]["prefix_source"] in ("held", "fetched", "recomputed")) == caching, turn["path"]
    assert "| kvpush-push prefix caching on, fetching on |" in (out / "multiturn.md").read_text()
