"""Long runs a test session starts as soon as it knows a selected test needs them, one after
another in the background, while the tests before those run (they keep one core of two
busy): a second lane beside pytest's own.

- ``reference``: the plain vLLM reference run, for the ``reference_run`` fixture of
  tests/stack/conftest.py;
- ``bench``: `kvpush bench` in CI size, for tests/bench/test_bench.py;
- ``multiturn``: `kvpush bench-multiturn` in CI size, for tests/bench/test_multiturn.py;
- ``compose``: the compose check, for tests/stack/test_compose_up.py;
- ``emulation``: CI's tiny point of `kvpush bench --emulate`, for tests/bench/test_emulation.py.

They run in that order, one at a time, so the lane never holds more than one stack. The
benchmarks' tests assert complete and correct results, not speed, so another lane beside
them changes nothing they check; a test that measures time waits for the lane to be done
(``EarlyRuns.wait_all``). The compose check's tests, early in tests/stack, wait for it; the
emulated point comes after it, beside the first tests of tests/stack (at k = 25 it mostly
waits on its modeled time), so its two minutes leave CI's serial part. It puts its hosts
on the 198.18.0.0/24 switch (tools/hosts/network.py), which only one run may hold at a time:
tests/stack/test_multi_host.py waits for it (``EarlyRuns.wait_for``).

``tests/conftest.py`` queues them after collection; a fixture asks for its run's result
(``EarlyRuns.result``), waiting for it, or runs it then if nothing queued it. Each run is a
process group of its own, stopped with the session."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
FOLDER = ROOT / "test-artifacts" / "early"  # each run's output and logs, kept after a failure


@dataclass
class EarlyRun:
    command: list[str]
    log: Path  # its stdout and stderr
    timeout_s: float
    cwd: Path | None = None
    # Its environment, as the session's was when it was queued: tests change the session's
    # own meanwhile (a NATS user, TLS files, a cache folder), which a run must not pick up.
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    out: Path | None = None  # where it writes its results
    stop_signal: int = signal.SIGKILL  # SIGTERM for a run that cleans up after itself
    before: Callable[[], Any] | None = None  # called just before it starts: what the host was like
    seen_before: Any = None  # what ``before`` said
    returncode: int | None = None  # None: not ended, or stopped at its timeout
    timed_out: bool = False
    started_at: float | None = None  # time.time() when it started and ended: the session's timeline
    ended_at: float | None = None
    finished: threading.Event = field(default_factory=threading.Event)
    _process: subprocess.Popen | None = None

    def run_to_end(self) -> None:
        """Start it, wait for it (at most ``timeout_s``: then it is stopped), and say it ended."""
        self.started_at = time.time()
        try:
            self.seen_before = self.before() if self.before is not None else None
            self.log.parent.mkdir(parents=True, exist_ok=True)
            with open(self.log, "wb") as out:
                self._process = subprocess.Popen(self.command, cwd=self.cwd, env=self.env, stdout=out,
                                                 stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                 start_new_session=True)
            try:
                self.returncode = self._process.wait(timeout=self.timeout_s)
            except subprocess.TimeoutExpired:
                self.timed_out = True
                self.stop()
        finally:
            self.ended_at = time.time()
            self.finished.set()

    def stop(self) -> None:
        process = self._process
        if process is None or process.poll() is not None:
            return
        try:
            os.killpg(process.pid, self.stop_signal)
            process.wait(timeout=300)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


@dataclass
class EarlyRuns:
    """The lane: runs queued in order, started one after another by a thread of its own."""

    runs: dict[str, EarlyRun] = field(default_factory=dict)
    _queue: list[str] = field(default_factory=list)
    _stopping: threading.Event = field(default_factory=threading.Event)
    _lane: threading.Thread | None = None

    def queue(self, name: str, run: EarlyRun) -> None:
        if name not in self.runs:
            self.runs[name] = run
            self._queue.append(name)

    def begin(self) -> None:
        if self._queue and self._lane is None:
            self._lane = threading.Thread(target=self._run_queue, name="early-runs", daemon=True)
            self._lane.start()

    def _run_queue(self) -> None:
        for name in self._queue:
            if self._stopping.is_set():
                self.runs[name].finished.set()
                continue
            self.runs[name].run_to_end()

    def result(self, name: str, make: Callable[[], EarlyRun]) -> EarlyRun:
        """Run ``name`` once it ended: the lane's, or made and run now if nothing queued it."""
        run = self.runs.get(name)
        if run is None:
            run = self.runs[name] = make()
            run.run_to_end()
        run.finished.wait(self._patience())
        return run

    def wait_for(self, name: str) -> None:
        """Until ``name`` ended, if the lane has it (a test that needs what it holds)."""
        run = self.runs.get(name)
        if run is not None:
            run.finished.wait(self._patience())

    def wait_all(self) -> None:
        """Until the lane is done (a test that measures time wants the machine to itself)."""
        for run in self.runs.values():
            run.finished.wait(self._patience())

    def _patience(self) -> float:
        return sum(run.timeout_s for run in self.runs.values()) + 60

    def stop_all(self) -> None:
        self._stopping.set()
        for run in self.runs.values():
            run.stop()


EARLY = EarlyRuns()

# ------------------------------------------------------------------ the runs

COMPOSE_ARTIFACTS = ROOT / "test-artifacts" / "compose-check"
COMPOSE_TIMEOUT_S = 1800
# The bench's hook: NixlConnector's first try at its point gets 1 s, so it fails on purpose
# (the client is killed: a system that stopped answering), and the bench starts it again.
BENCH_FIRST_ATTEMPT_TIMEOUT = "vllm-nixl:1"
BENCH_VARIANTS = ("kvpush-push", "kvpush-pull", "kvpush-auto", "kvpush-local", "vllm-nixl", "vllm-nixl-push")
BENCH_REQUESTS = 3
# vLLM's NIXL agents in the lane's `vllm serve` pairs wait 1 ms between progress rounds (the
# plugin's switch, tools/emulation/plugin.py): unpaced, each spins a core (1.0 CPU-s/s) for
# as long as its pair is up, and CI's run of 2026-12-07 had both cores taken by them while
# the NATS tests beside the lane ran (a test's own loop stalled 24 s; five scheduler
# processes did not start in 60 s). The lane checks results, not speed.
BENCH_NIXL_PROGRESS_THREAD = "paced"


def reference_generation(model_dir: str) -> EarlyRun:
    """What a single plain vLLM instance generates for prompts.reference_requests() and the
    chat reference (``kvpush.tools.reference``): token ids in ``out.json``, and each
    position's candidates where a request asked in ``out.json.logprobs.json``."""
    from tests import prompts

    folder = FOLDER / "reference"
    folder.mkdir(parents=True, exist_ok=True)
    requests = folder / "requests.json"
    requests.write_text(json.dumps(prompts.reference_requests() + [prompts.chat_reference_request(model_dir)]))
    return EarlyRun([sys.executable, "-m", "kvpush.tools.reference", "--model", model_dir, "--requests", str(requests),
                     "--out", str(folder / "out.json"), "--max-model-len", str(prompts.MAX_MODEL_LEN)],
                    log=folder / "reference.log", timeout_s=400, out=folder)


def bench(model_dir: str) -> EarlyRun:
    """`kvpush bench` in CI size: every system, one tiny point each, driven by `vllm bench serve`."""
    out = FOLDER / "bench"
    return EarlyRun(
        [sys.executable, "-m", "kvpush.services.cli.main", "bench", "--model", model_dir, "--systems",
         ",".join(BENCH_VARIANTS), "--input-lens", "128", "--rates", "2", "--requests", str(BENCH_REQUESTS),
         "--warmup", "1", "--output-len", "8", "--binding", "kvpush=auto,vllm-nixl=split,vllm-nixl-push=split",
         "--out", str(out), "--point-timeout", "240"],
        log=FOLDER / "bench.log", timeout_s=1150, out=out,
        env={**os.environ, "KVPUSH_BENCH_FIRST_ATTEMPT_TIMEOUT": BENCH_FIRST_ATTEMPT_TIMEOUT,
             "KVPUSH_NIXL_PROGRESS_THREAD": BENCH_NIXL_PROGRESS_THREAD})


def multiturn(model_dir: str) -> EarlyRun:
    """`kvpush bench-multiturn` in CI size: closed-loop conversations, prefix caching on and off."""
    out = FOLDER / "multiturn"
    return EarlyRun(
        [sys.executable, "-m", "kvpush.services.cli.main", "bench-multiturn", "--model", model_dir,
         "--conversations", "2", "--turns", "3", "--first-len", "200", "--turn-len", "40", "--output-len", "6",
         "--concurrency", "2", "--max-model-len", "1024", "--fetch", "on", "--out", str(out)],
        log=FOLDER / "multiturn.log", timeout_s=850, out=out)


def compose_check(model_dir: str = "") -> EarlyRun:
    """scripts/compose-check.sh, as CI and a newcomer run it (its report and logs under
    test-artifacts/compose-check/); SIGTERM stops the stack and removes its engine."""
    from kvpush.tools.compose_check import engine as private_engine

    COMPOSE_ARTIFACTS.mkdir(parents=True, exist_ok=True)
    report = COMPOSE_ARTIFACTS / "report.json"
    report.unlink(missing_ok=True)
    return EarlyRun(["bash", "scripts/compose-check.sh", "--report", str(report), "--logs", str(COMPOSE_ARTIFACTS / "logs")],
                    log=COMPOSE_ARTIFACTS / "output.log", timeout_s=COMPOSE_TIMEOUT_S, cwd=ROOT,
                    stop_signal=signal.SIGTERM, before=private_engine.links, out=COMPOSE_ARTIFACTS)


EMULATED_DILATION = 25


def emulated_point(model_dir: str = "") -> EarlyRun:
    """CI's tiny point of `kvpush bench --emulate`: kvpush push and vLLM's NixlConnector on the
    stand-in forward (an asynchronous device), each engine on a host of its own, the KV through
    the shaped link (its model is the emulated profile's own, not the session's)."""
    out = FOLDER / "emulation"
    return EarlyRun(
        [sys.executable, "-m", "kvpush.services.cli.main", "bench", "--emulate", "qwen3-32b@p5en", "--forward",
         "stand-in", "--dilation", str(EMULATED_DILATION), "--systems", "kvpush-push,vllm-nixl", "--input-lens", "512", "--rates", "8",
         "--requests", "2", "--warmup", "1", "--output-len", "8", "--binding", "kvpush=split,vllm-nixl=split",
         "--no-raw-nixl", "--out", str(out)],
        log=FOLDER / "emulation.log", timeout_s=580, out=out)  # killed, its hosts are swept by the next run's


# The lane's order, and the fixture that asks for each run's result.
LANE: tuple[tuple[str, str, Callable[[str], EarlyRun]], ...] = (
    ("reference", "reference_run", reference_generation),
    ("bench", "bench_run", bench),
    ("multiturn", "multiturn_run", multiturn),
    ("compose", "compose_run", compose_check),
    ("emulation", "emulated_point_run", emulated_point),
)


def queue_for(fixtures: set[str], model_dir: Callable[[], str]) -> None:
    """Queue, in the lane's order, the runs these fixtures ask for, and start the lane."""
    if any(fixture in fixtures for _, fixture, _ in LANE):
        shutil.rmtree(FOLDER, ignore_errors=True)  # the last session's
    for name, fixture, make in LANE:
        if fixture in fixtures:
            EARLY.queue(name, make(model_dir()))
    EARLY.begin()
