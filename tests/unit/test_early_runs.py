"""The background lane of tests/early.py: its runs go one at a time in the order queued, and
each runs in the session's environment as it was when queued (tests change the session's
own meanwhile: a TLS file, a NATS user; a bench that picked those up failed in CI)."""

from __future__ import annotations

import os
import sys

from tests import early
from tests.early import EarlyRun, EarlyRuns


def _printing(tmp_path, name: str, code: str, timeout_s: float = 30) -> EarlyRun:
    return EarlyRun([sys.executable, "-c", code], log=tmp_path / f"{name}.log", timeout_s=timeout_s)


def test_a_run_keeps_the_environment_it_was_queued_with(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPUSH_EARLY_PROBE", "queued")
    lane = EarlyRuns()
    lane.queue("probe", _printing(tmp_path, "probe", "import os; print(os.environ['KVPUSH_EARLY_PROBE'])"))
    monkeypatch.setenv("KVPUSH_EARLY_PROBE", "changed by a test meanwhile")
    lane.begin()
    run = lane.result("probe", lambda: None)
    assert run.returncode == 0 and run.output().strip() == "queued"


def test_runs_go_one_at_a_time_in_the_order_queued(tmp_path):
    order = tmp_path / "order"
    lane = EarlyRuns()
    for name in ("first", "second"):
        code = f"import time; open({str(order)!r}, 'a').write('{name} in\\n'); time.sleep(0.3); " \
               f"open({str(order)!r}, 'a').write('{name} out\\n')"
        lane.queue(name, _printing(tmp_path, name, code))
    lane.begin()
    lane.wait_all()
    assert order.read_text().split("\n")[:-1] == ["first in", "first out", "second in", "second out"]


def test_a_run_past_its_timeout_is_stopped_and_the_lane_goes_on(tmp_path):
    lane = EarlyRuns()
    lane.queue("stuck", _printing(tmp_path, "stuck", "import time; time.sleep(60)", timeout_s=0.5))
    lane.queue("next", _printing(tmp_path, "next", "print('ran')"))
    lane.begin()
    stuck, after = lane.result("stuck", lambda: None), lane.result("next", lambda: None)
    assert stuck.timed_out and stuck.returncode is None
    assert after.returncode == 0 and after.output().strip() == "ran"


def test_a_run_nothing_queued_is_made_and_run_when_asked(tmp_path):
    lane = EarlyRuns()
    run = lane.result("late", lambda: _printing(tmp_path, "late", f"import os; print({os.getpid()})"))
    assert run.returncode == 0 and run.output().strip() == str(os.getpid())


def test_the_lanes_bench_paces_the_nixl_progress_threads_of_vllms_own_pairs():
    """Beside the tests, vLLM's NIXL agents must not spin a core each (they took both of CI's)."""
    run = early.bench("/no/model")
    assert run.env["KVPUSH_NIXL_PROGRESS_THREAD"] == "paced"
    assert any(system.startswith("vllm-nixl") for system in early.BENCH_VARIANTS)
