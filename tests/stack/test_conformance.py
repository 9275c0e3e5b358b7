"""``kvpush conformance`` on the session's stack: every row of the OpenAI table sent to a
single ``vllm serve`` of the small model (which the command starts, with kvpush's engine
arguments) and to kvpush's gateway in push, pull and local. Every row is equal in every
mode (token ids, text, finish reasons exactly, logprobs within 1e-4, usage) except the
fields kvpush does not serve yet, which it refuses with a sentence, ``cached_tokens``,
which it does not report yet, and tools, which both refuse (vLLM without a tool-call
parser: the built models' chat template has no tool format yet). All listed here, so that
serving one changes this test."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvpush.tools.conformance.table import MODES, ROWS

pytestmark = pytest.mark.timeout(900)

NOT_SERVED_YET = {"best_of", "echo", "prompt_logprobs"}
NOT_REPORTED_YET = {"usage.prompt_tokens_details.cached_tokens"}
BOTH_REFUSE = {"tools, tool_choice: auto", "tool_choice: required", "tool_choice: named"}


def test_every_served_field_answers_as_a_single_vllm_serve_in_every_mode(stack, tmp_path):
    out = tmp_path / "conformance"
    run = subprocess.run(
        [sys.executable, "-m", "kvpush.services.cli.main", "conformance", "--model", stack.model,
         "--max-model-len", str(stack.max_model_len), "--kvpush-url", stack.gateway_url, "--out", str(out)],
        capture_output=True, text=True, timeout=850)
    results = json.loads((out / "results.json").read_text())
    assert {(r["field"], r["mode"]) for r in results} == {(row.field, mode) for row in ROWS for mode in MODES}
    for r in results:
        if r["field"] in NOT_SERVED_YET:
            assert r["outcome"] == "kvpush refuses" and "not supported by kvpush" in r["detail"], r
        elif r["field"] in NOT_REPORTED_YET:
            assert r["outcome"] == "differs" and "cached_tokens None" in r["detail"], r
        elif r["field"] in BOTH_REFUSE:
            assert r["outcome"] == "both refuse" and "--tool-call-parser" in r["detail"], r
        else:
            assert r["outcome"] == "equal", r
    assert run.returncode == 1, "cached_tokens differs: the command fails"
    table = (out / "table.md").read_text()
    assert table.count("\n") == len(ROWS) + 2 and "| `top_p` | completions | equal | equal | equal |" in table
