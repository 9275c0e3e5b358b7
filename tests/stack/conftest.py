"""Session fixtures that need vLLM: one kvpush stack (scheduler, prefill and decode
workers on real vLLM engines), one plain vLLM reference run, and the OTLP receiver the
stack exports to; each started once for the whole session."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kvpush.services.launch.stack import Stack
from tests import prompts
from tests.early import EARLY, reference_generation
from kvpush.tools.otlp_receiver import OtlpReceiver


@pytest.fixture(scope="session")
def stack_logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("stack-logs")


@pytest.fixture(scope="session")
def otlp():
    """Every service of the session's stack exports its spans and metrics here."""
    with OtlpReceiver() as receiver:
        yield receiver


@pytest.fixture(scope="package")  # stopped before tests/bench starts engines of its own
async def stack(model_dir, nats_server, stack_logs, otlp):
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": otlp.endpoint, "OTEL_METRIC_EXPORT_INTERVAL": "1000",
           # compact JSON answers: a random-weight model would otherwise spin in free whitespace
           "KVPUSH_JSON_WHITESPACE": "none"}
    stack = Stack(model_dir, nats_url=nats_server.url, prefill=1, decode=1,
                  max_model_len=prompts.MAX_MODEL_LEN, log_dir=stack_logs, extra_env=env, gateway_port=0,
                  metrics=True)
    stack.start()
    try:
        await stack.wait_ready(timeout=400)
        yield stack
    except BaseException:
        for log in sorted(stack_logs.glob("*.log")):
            sys.stderr.write(f"----- {log.name}\n{log.read_text()[-4000:]}\n")
        raise
    finally:
        stack.stop()


@pytest.fixture(scope="session")
def reference_run(model_dir) -> tuple[list[list[int]], list]:
    """What a single plain vLLM instance generates for prompts.reference_requests(): token
    ids, and each position's [token id, logprob] candidates where a request asked. Started
    in the background as soon as the session knew a test needs it (tests/early.py)."""
    run = EARLY.result("reference", lambda: reference_generation(model_dir))
    assert run.returncode == 0, run.output()[-4000:]
    return json.loads((run.out / "out.json").read_text()), json.loads((run.out / "out.json.logprobs.json").read_text())


@pytest.fixture(scope="session")
def reference(reference_run) -> list[list[int]]:
    return reference_run[0]


@pytest.fixture(scope="session")
def reference_logprobs(reference_run) -> list:
    return reference_run[1]
