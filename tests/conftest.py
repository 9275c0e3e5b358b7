"""Session fixtures every folder may use: a real nats-server and the built model, each
made once for the whole session. The vLLM stack lives in tests/stack/conftest.py.

Each test is marked by its folder: ``unit`` (pure, seconds), ``nats`` (a real
nats-server, no vLLM), ``stack`` (real NATS, vLLM engines and NIXL); ``-m unit`` is the
fast loop."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import time
from pathlib import Path

import nats
import pytest

from kvpush.services.launch.natsd import LocalNatsServer
from kvpush.services.launch.model import build_model, default_model_dir
from tests import early

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Services with no OTLP endpoint write their spans as JSON lines (otel/files.py): the
# session's go to a folder of their own, removed at exit, not into the user's
# ~/.cache/kvpush/traces (tens of MB a run). Every child process inherits it.
if "KVPUSH_TRACE_DIR" not in os.environ:
    os.environ["KVPUSH_TRACE_DIR"] = tempfile.mkdtemp(prefix="kvpush-test-traces-")
    atexit.register(shutil.rmtree, os.environ["KVPUSH_TRACE_DIR"], ignore_errors=True)

TESTS = Path(__file__).resolve().parent
FOLDER_MARKERS = ("unit", "nats", "stack", "bench")


def pytest_collection_modifyitems(config, items):
    for item in items:
        try:
            folder = item.path.resolve().relative_to(TESTS).parts[0]
        except ValueError:
            continue  # collected from outside tests/: not ours to mark
        if folder not in FOLDER_MARKERS:
            raise pytest.UsageError(f"{item.nodeid}: tests live in tests/unit, tests/nats, tests/stack or tests/bench")
        item.add_marker(getattr(pytest.mark, folder))


def pytest_collection_finish(session):
    """Queue the long runs selected tests will ask for, in the background lane (tests/early.py)."""
    if session.config.option.collectonly:
        return
    needed = {name for item in session.items for name in getattr(item, "fixturenames", ())}
    early.queue_for(needed, lambda: str(build_model(default_model_dir("small"))))


FOLDER_STARTED: dict[str, float] = {}  # when each folder's first test started (time.time())


def pytest_runtest_logstart(nodeid, location):
    parts = nodeid.split("/")
    if len(parts) > 2 and parts[0] == "tests":
        FOLDER_STARTED.setdefault(parts[1], time.time())


def pytest_sessionfinish(session):
    early.EARLY.stop_all()


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter):
    """Where the session's minutes went: when each folder began, and each lane run's span,
    in minutes from the first test. CI has a time budget; this says what to move."""
    if not FOLDER_STARTED:
        return
    zero = min(FOLDER_STARTED.values())
    minutes = lambda t: f"{(t - zero) / 60:.1f}"  # noqa: E731
    folders = ", ".join(f"{name} {minutes(t)}" for name, t in sorted(FOLDER_STARTED.items(), key=lambda kv: kv[1]))
    terminalreporter.write_line(f"timeline (min): {folders}, end {minutes(time.time())}")
    lane = [f"{name} {minutes(run.started_at)}-{minutes(run.ended_at)}" for name, run in early.EARLY.runs.items()
            if run.started_at is not None and run.ended_at is not None]
    if lane:
        terminalreporter.write_line(f"lane (min): {', '.join(lane)}")


@pytest.fixture(scope="session")
def model_dir() -> str:
    return str(build_model(default_model_dir("small")))


@pytest.fixture(scope="session")
def nats_server():
    with LocalNatsServer() as server:
        yield server


@pytest.fixture(scope="session")
async def nc(nats_server):
    conn = await nats.connect(nats_server.url)
    yield conn
    await conn.close()
