"""`kvpush bench-multiturn` in CI size: closed-loop conversations through the real openai
client against kvpush with prefix caching on and off, every answer checked against a
single vLLM instance. It asserts complete, correct results, not speed."""

from __future__ import annotations

import json
import sys

import pytest

from tests.bench.whole_group import run_whole

pytestmark = pytest.mark.timeout(900)


def test_conversations_run_closed_loop_and_every_answer_equals_the_reference(model_dir, tmp_path):
    out = tmp_path / "multiturn"
    run = run_whole(
        [sys.executable, "-m", "kvpush.services.cli.main", "bench-multiturn", "--model", model_dir, "--conversations", "2",
         "--turns", "3", "--first-len", "200", "--turn-len", "40", "--output-len", "6", "--concurrency", "2",
         "--max-model-len", "1024", "--fetch", "on", "--out", str(out)],
        timeout=850,
    )
    assert run.returncode == 0, run.stderr[-4000:]
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
