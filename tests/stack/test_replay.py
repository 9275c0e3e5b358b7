"""Replaying a migrated request's sent tokens (services/worker/replay.py) on one plain
vLLM engine: a seed's stream goes on exactly, and a stop string spanning the break is
found (kvpush.tools.reliability.replay_check, in a child process: one engine of its own)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(600)


def test_a_replay_keeps_the_seed_and_finds_a_stop_string_across_the_break(model_dir):
    done = subprocess.run([sys.executable, "-m", "kvpush.tools.reliability.replay_check"], capture_output=True,
                          text=True, timeout=540)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["forced"] == 6, result  # replayed tokens are the outputs, likely or not
    assert result["seeded"] == 24 and result["seeded_exact"] == 24, result
    assert result["stop_strings_across_the_break"] >= 10, result  # the model's text has enough of them
    assert result["stop_strings_found"] == result["stop_strings_across_the_break"], result
