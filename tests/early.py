"""Long runs a test session starts as soon as it knows a selected test needs them, in the
background, so that they overlap the tests before those (which use one core of two):

- the plain vLLM reference run (``reference_generation``), for the ``reference_run``
  fixture of tests/stack/conftest.py;
- the compose check (``compose_check``), for the ``compose_run`` fixture of
  tests/stack/test_compose_up.py.

``tests/conftest.py`` starts them after collection; the fixture that needs one waits for it
(``EarlyRun.wait``), or starts it then if nothing did. Each is a process group of its own,
stopped with the session."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import sys
import tempfile
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class EarlyRun:
    command: list[str]
    log: Path  # its stdout and stderr
    cwd: Path | None = None
    stop_signal: int = signal.SIGKILL  # SIGTERM for a run that cleans up after itself
    before: Callable[[], Any] | None = None  # called just before it starts: what the host was like
    process: subprocess.Popen | None = None
    started_at: float = 0.0
    seen_before: Any = None  # what ``before`` said

    def start(self) -> None:
        if self.process is not None:
            return
        self.seen_before = self.before() if self.before is not None else None
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "wb") as out:
            self.process = subprocess.Popen(self.command, cwd=self.cwd, stdout=out, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
        self.started_at = time.monotonic()

    def wait(self, timeout: float) -> int:
        """Its exit code; on ``timeout`` it is stopped and TimeoutError raised."""
        if self.process is None:
            self.start()
        try:
            return self.process.wait(timeout=max(timeout - (time.monotonic() - self.started_at), 1.0))
        except subprocess.TimeoutExpired:
            self.stop()
            raise TimeoutError(f"{self.command[:4]} did not end within {timeout:g} s") from None

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, self.stop_signal)
            self.process.wait(timeout=300)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


@dataclass
class EarlyRuns:
    runs: dict[str, EarlyRun] = field(default_factory=dict)

    def plan(self, name: str, run: EarlyRun) -> EarlyRun:
        """The run ``name``, made once: the first plan of it stands."""
        return self.runs.setdefault(name, run)

    def start(self, name: str, run: EarlyRun) -> None:
        self.plan(name, run).start()

    def get(self, name: str, make: Callable[[], EarlyRun]) -> EarlyRun:
        """The run ``name``, as planned early, or made now (a session that did not start it)."""
        return self.runs[name] if name in self.runs else self.plan(name, make())

    def stop_all(self) -> None:
        for run in self.runs.values():
            run.stop()


EARLY = EarlyRuns()

ROOT = Path(__file__).resolve().parents[1]
REFERENCE_FOLDER = Path(tempfile.mkdtemp(prefix="kvpush-test-reference-"))
atexit.register(shutil.rmtree, REFERENCE_FOLDER, ignore_errors=True)
COMPOSE_ARTIFACTS = ROOT / "test-artifacts" / "compose-check"
COMPOSE_TIMEOUT_S = 1800


def reference_generation(model_dir: str) -> EarlyRun:
    """What a single plain vLLM instance generates for prompts.reference_requests() and the
    chat reference (``kvpush.tools.reference``): token ids in ``out.json``, and each
    position's candidates where a request asked in ``out.json.logprobs.json``."""
    from tests import prompts

    requests = REFERENCE_FOLDER / "requests.json"
    requests.write_text(json.dumps(prompts.reference_requests() + [prompts.chat_reference_request(model_dir)]))
    return EarlyRun([sys.executable, "-m", "kvpush.tools.reference", "--model", model_dir, "--requests", str(requests),
                     "--out", str(REFERENCE_FOLDER / "out.json"), "--max-model-len", str(prompts.MAX_MODEL_LEN)],
                    log=REFERENCE_FOLDER / "reference.log")


def compose_check() -> EarlyRun:
    """scripts/compose-check.sh, as CI and a newcomer run it (its report and logs under
    test-artifacts/compose-check/); SIGTERM stops the stack and removes its engine."""
    from kvpush.tools.compose_check import engine as private_engine

    COMPOSE_ARTIFACTS.mkdir(parents=True, exist_ok=True)
    report = COMPOSE_ARTIFACTS / "report.json"
    report.unlink(missing_ok=True)
    return EarlyRun(["bash", "scripts/compose-check.sh", "--report", str(report), "--logs", str(COMPOSE_ARTIFACTS / "logs")],
                    log=COMPOSE_ARTIFACTS / "output.log", cwd=ROOT, stop_signal=signal.SIGTERM,
                    before=private_engine.links)
