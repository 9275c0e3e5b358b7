"""Run a benchmark command as a process group of its own, and on a timeout kill all of it:
``subprocess.run``'s timeout kills only the child, and a bench's engines (its grandchildren)
would go on spinning the cores under every test after it."""

from __future__ import annotations

import os
import signal
import subprocess


def run_whole(command: list[str], timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                               start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
