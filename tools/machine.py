"""What the machine a tool ran on is, for its results: shared by the benchmarks and the
GPU transfer check."""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name, from ``/proc/cpuinfo`` (Linux); elsewhere what ``platform``
    says, which may be empty."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()
