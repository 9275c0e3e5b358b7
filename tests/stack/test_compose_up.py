"""`docker compose up` for real (scripts/compose-check.sh, run once for the module): a
private Docker engine, kvpush's image built from the Dockerfile, compose.yaml brought up by
the real Compose binary, outputs through the gateway's OpenAI API and the kvpush.generate
subject equal to a plain vLLM run, one trace per request in the OTLP receiver that stands in
for Jaeger, and nothing left once it is over. No engine is a failure, never a skip."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from kvpush.tools.compose_check import engine as private_engine
from kvpush.tools.compose_check import prepare
from kvpush.tools.compose_check.check import GATEWAY_SERVICE, HELPERS, SERVICES, WORKER_SERVICES
from tests.early import COMPOSE_ARTIFACTS, COMPOSE_TIMEOUT_S, EARLY, compose_check

pytestmark = pytest.mark.timeout(2400)

ROOT = Path(__file__).resolve().parents[2]


def test_no_engine_is_a_failure_with_a_clear_message(tmp_path, compose_run):
    # after the lane's compose check (compose_run): two checks in one checkout refuse each other
    result = subprocess.run([sys.executable, "-m", "kvpush.tools.compose_check", "--dockerd", str(tmp_path / "no-dockerd"),
                             "--work-parent", str(tmp_path), "--report", str(tmp_path / "report.json")],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "no Docker engine" in result.stdout and "apt-get install docker.io" in result.stdout
    report = json.loads((tmp_path / "report.json").read_text())
    assert not report["ok"] and report["no_engine"]
    assert list(tmp_path.iterdir()) == [tmp_path / "report.json"]  # its folder went too


@pytest.fixture(scope="module")
def compose_run():
    """scripts/compose-check.sh, as CI and a newcomer run it, run in the background lane as
    soon as the session knew this module would run (tests/early.py); its report, output and
    what the host looked like before."""
    check = EARLY.result("compose", compose_check)
    rc = check.returncode  # None: stopped at its timeout (SIGTERM: it stops the stack and removes its engine)
    output = check.output()
    sys.stderr.write(output[-6000:])
    report_path = COMPOSE_ARTIFACTS / "report.json"
    report = json.loads(report_path.read_text()) if report_path.exists() else {}
    return {"rc": rc, "output": output, "report": report, "links_before": check.seen_before}


def _report(compose_run) -> dict:
    report = compose_run["report"]
    if not report:
        pytest.fail(f"the compose check wrote no report (exit {compose_run['rc']}):\n{compose_run['output'][-3000:]}")
    if report.get("no_engine"):
        pytest.fail(report["no_engine"])  # no engine: a failure, with what to do
    return report


def test_the_image_builds_from_the_dockerfile(compose_run):
    report = _report(compose_run)
    assert "image build" in report["times_s"], report["failures"]
    assert {"kvpush:latest", "kvpush-check/nats:local", "kvpush-check/prometheus:local",
            "kvpush-check/otlp-receiver:local"} <= set(report["images"])
    assert report["kvpush_image_built_from_dockerfile"]
    same = report["model"]["same"]  # `kvpush model build` in the image: the host's default small model
    assert same["weights_sha256"] and same["profile_params"] and same["seed"], same
    if not same["tokenizer_sha256"]:  # only where the interpreters' standard libraries differ (see findings)
        assert report["model"]["image_corpus"]["sha256"] != report["model"]["host_corpus"]["sha256"]


def test_compose_up_brings_up_nats_the_scheduler_one_prefill_one_decode_and_the_gateway(compose_run):
    report = _report(compose_run)
    containers = report.get("containers")
    assert containers, report["failures"]
    for service in SERVICES + HELPERS:
        mine = [c for c in containers if c["service"] == service]
        assert len(mine) == 1 and mine[0]["state"] == "running", (service, mine)
        if service in SERVICES:
            assert mine[0]["health"] == "healthy", mine
    assert {c["image"] for c in containers if c["service"] in SERVICES[1:]} == {"kvpush:latest"}
    assert not [c for c in containers if c["service"] == "grafana"]
    assert all(report["start_order"]["rules"].values()), report["start_order"]


def test_every_kvpush_process_is_on_nats_as_its_own_user_over_tls_and_nobody_else_gets_in(compose_run):
    """nats-init wrote the users, certificates and config; nats-server's /connz lists each
    kvpush process (the workers' engine cores too) under its own user, over TLS, in
    kvpush's account; from the host, NATS requires TLS and a user, and refuses none."""
    report = _report(compose_run)
    seen = report.get("nats_security")
    assert seen, report["failures"]
    assert seen["nats_init_exit_codes"] == [0]
    users = {c["user"] for c in seen["connections"]}
    assert {"scheduler-0", "prefill-0", "decode-0", "gateway"} <= users, seen["connections"]
    assert all(c["tls"] and c["account"] == "KVPUSH" for c in seen["connections"]), seen["connections"]
    outside = seen["from_the_host"]
    assert outside["tls_required"] and outside["auth_required"], outside
    assert "authorization" in outside["anonymous_refused"].lower(), outside


def test_outputs_through_the_gateway_and_nats_equal_a_single_instance(compose_run):
    report = _report(compose_run)
    rows = report.get("requests")
    assert rows, report["failures"]
    assert {row["via"] for row in rows} == {"gateway (openai)", "nats kvpush.generate"}
    for row in rows:
        assert row.get("token_ids") == row["reference"], row


def test_the_otlp_receiver_got_one_trace_per_request_with_spans_from_every_service(compose_run):
    report = _report(compose_run)
    traces = report.get("traces")
    assert traces and len(traces) == len(report["requests"]), report["failures"]
    via = {row["request_id"]: row["via"] for row in report["requests"]}
    for request_id, trace in traces.items():
        assert len(trace["trace_ids"]) == 1, (request_id, trace)
        wanted = WORKER_SERVICES | ({GATEWAY_SERVICE} if via[request_id].startswith("gateway") else set())
        assert wanted <= set(trace["services"]), (request_id, trace)


def test_prometheus_scrapes_every_kvpush_service_by_its_compose_name(compose_run):
    targets = _report(compose_run).get("prometheus_targets")
    assert targets and set(targets.values()) == {"up"}, targets
    hosts = {url.split("//")[1].split("/")[0] for url in targets}
    assert {"scheduler:9100", "prefill:9100", "prefill:9101", "decode:9100", "decode:9101", "gateway:8000"} <= hosts


def test_compose_down_and_the_engines_removal_leave_nothing_behind(compose_run):
    report = _report(compose_run)
    assert report.get("after_down") == {"containers": [], "networks": [], "volumes": []}, report["failures"]
    left = report["leftovers"]
    assert left["processes"] == [] and left["links"] == [] and left["mounts"] == [] and left["work_folder"] is None
    # and seen from here, after the script ended
    work = report["work"]
    assert not Path(work).exists()
    assert private_engine._processes_mentioning(work) == []
    pid = left["engine_pid"]
    assert pid is None or not os.path.exists(f"/proc/{pid}") or not private_engine._alive(pid)
    assert not {n for n in private_engine.links() - compose_run["links_before"] if n == "docker0" or n.startswith("br-")}
    with open("/proc/self/mounts") as f:
        assert work not in f.read()
    assert sorted(p.name for p in prepare.WHEELS.iterdir()) == [".gitignore", "README.md"]


def test_the_compose_check_passed_and_says_what_it_took(compose_run):
    report = _report(compose_run)
    assert compose_run["rc"] == 0 and report["ok"], report["failures"]
    for step in ("engine start", "base image and wheels", "image build", "compose up", "requests", "compose down",
                 "engine stop"):
        assert report["times_s"][step] >= 0, step
    assert report["times_s"]["total"] < COMPOSE_TIMEOUT_S


def test_an_engine_that_refuses_a_storage_driver_falls_back_and_is_removed_by_its_pid(monkeypatch):
    monkeypatch.setattr(private_engine, "STORAGE_DRIVERS", ("no-such-driver", "vfs"))
    folder = Path(tempfile.mkdtemp(prefix="kvpush-engine."))  # short: its sockets' paths must fit
    engine = private_engine.PrivateEngine(folder / "engine", start_timeout=30)
    before = private_engine.links()
    try:
        try:
            engine.start()
            assert engine.storage_driver == "vfs" and "no-such-driver" in engine.attempts[0]
            assert engine.version()["ApiVersion"]
            pid = int(engine.pidfile.read_text())
            assert private_engine._alive(pid)
        finally:
            left = engine.stop()
        assert left == {"processes": [], "links": [], "mounts": []}
        assert not private_engine._alive(pid) and not (folder / "engine").exists()
    finally:
        private_engine.remove_folder(folder)
    assert not {n for n in private_engine.links() - before if n == "docker0" or n.startswith("br-")}
