"""Settings that would break an invariant are refused before anything starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvpush.shared import settings
from kvpush.shared.settings import FaultSettings


def test_the_defaults_hold_the_invariant():
    faults = settings.FAULTS
    assert faults.quarantine_s >= faults.lease_s + 2 * settings.HEARTBEAT_INTERVAL_S


@pytest.mark.parametrize("lease_s,quarantine_s", [(10.0, 10.0), (10.0, 11.9), (3.0, 3.0)])
def test_a_quarantine_shorter_than_the_lease_and_two_heartbeats_is_refused(lease_s, quarantine_s):
    with pytest.raises(ValueError, match="quarantine_s .* must be at least lease_s"):
        FaultSettings(lease_s=lease_s, quarantine_s=quarantine_s)


def test_an_unknown_kv_failure_policy_is_refused():
    with pytest.raises(ValueError, match="on_kv_failure must be recompute or fail"):
        FaultSettings(on_kv_failure="retry")


def test_the_worker_command_refuses_them_with_a_sentence_before_starting_anything(tmp_path):
    kvpush = Path(sys.executable).parent / "kvpush"
    result = subprocess.run([str(kvpush), "worker", "--role", "decode", "--lease-s", "10", "--quarantine-s", "5",
                             "--model", str(tmp_path / "unused")], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "refusing to start: quarantine_s (5 s) must be at least lease_s + 2 s (12 s)" in result.stderr
