"""deploy/k8s, checked without a cluster: ``kubectl kustomize`` renders the base, every
document is validated against the Kubernetes 1.32 schemas (strict: unknown fields are
errors), and what the manifests tell each process is checked against the code that will
read it: the kvpush CLI parses every container's command and environment, nats-server
parses the NATS configuration, the users in it are what ``kvpush.shared.permissions`` renders,
and the probes and scrape annotations name paths and ports the services really serve.

The containers' shell snippets (pick the password file named after the pod) are run for
real, with /bin/sh and a stand-in ``kvpush`` that records what it was given."""

from __future__ import annotations

import base64
import json
import os
import re
import ssl
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from kvpush.services.cli.main import build_parser
from kvpush.services.cli.settings import ENVIRONMENT, OTEL_ENVIRONMENT
from kvpush.services.launch.natsd import server_binary
from kvpush.shared import nats_security, permissions

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
KUBERNETES_VERSION = "1.32.0"
KVPUSH_IMAGE = "kvpush"
# Environment a kvpush container may carry besides kvpush's own settings: UCX's, read by
# NIXL in the engine, passed through.
PASS_THROUGH = re.compile(r"UCX_[A-Z0-9_]+")
WORKER_ROLES = ("prefill", "decode")


# ------------------------------------------------------------------ rendering


def _kubectl() -> str:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail("kubectl is not installed, and this test renders deploy/k8s with `kubectl kustomize` "
                    "(kubectl 1.27 or newer has kustomize built in): install kubectl")
    return kubectl


@pytest.fixture(scope="module")
def rendered() -> list[dict]:
    result = subprocess.run([_kubectl(), "kustomize", str(K8S)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"kubectl kustomize deploy/k8s failed:\n{result.stderr}"
    documents = [d for d in yaml.safe_load_all(result.stdout) if d]
    assert documents, "kubectl kustomize deploy/k8s rendered nothing"
    return documents


def _kvpush_command() -> str:
    beside_python = Path(sys.executable).parent / "kvpush"
    return str(beside_python) if beside_python.exists() else f"{sys.executable} -m kvpush.services.cli.main"


def _make_secrets(folder: Path = K8S) -> subprocess.CompletedProcess:
    env = {**os.environ, "KVPUSH": _kvpush_command(), "PYTHON": sys.executable}
    return subprocess.run(["/bin/sh", str(folder / "make-secrets.sh")], capture_output=True, text=True,
                          timeout=60, env=env, cwd=ROOT)


@pytest.fixture(scope="module")
def secrets() -> dict[str, dict[str, str]]:
    """The Secrets make-secrets.sh prints (fresh random passwords): name -> data."""
    result = _make_secrets()
    assert result.returncode == 0, f"make-secrets.sh failed:\n{result.stderr}"
    documents = [d for d in yaml.safe_load_all(result.stdout) if d]
    for document in documents:
        _validate(document)
    return {d["metadata"]["name"]: {**{k: base64.b64decode(v).decode() for k, v in (d.get("data") or {}).items()},
                                    **(d.get("stringData") or {})} for d in documents}


def _find(documents: list[dict], kind: str, name: str) -> dict:
    for document in documents:
        if document["kind"] == kind and document["metadata"]["name"] == name:
            return document
    pytest.fail(f"no {kind} {name!r} in the rendered manifests")


def _workloads(documents: list[dict]) -> list[dict]:
    return [d for d in documents if d["kind"] in ("Deployment", "StatefulSet")]


def _containers(workload: dict) -> list[dict]:
    return workload["spec"]["template"]["spec"]["containers"]


def _kvpush_workloads(documents: list[dict]) -> list[dict]:
    return [w for w in _workloads(documents)
            if any(c["image"].split(":")[0].endswith(KVPUSH_IMAGE) for c in _containers(w))]


def _config_map(documents: list[dict], name: str) -> dict[str, str]:
    """A ConfigMap's data by the name a workload refers to (kustomize's hashed name)."""
    return _find(documents, "ConfigMap", name)["data"]


def _volume(workload: dict, name: str) -> dict:
    for volume in workload["spec"]["template"]["spec"].get("volumes", []):
        if volume["name"] == name:
            return volume
    pytest.fail(f"{workload['metadata']['name']} has no volume {name!r}")


def _mount_of(workload: dict, container: dict, predicate) -> tuple[dict, dict] | None:
    for mount in container.get("volumeMounts", []):
        volume = _volume(workload, mount["name"])
        if predicate(volume):
            return mount, volume
    return None


def _validate(document: dict) -> None:
    try:
        kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        where = ".".join(str(p) for p in exc.path)
        pytest.fail(f"{document['kind']}/{document['metadata']['name']} is invalid for Kubernetes "
                    f"{KUBERNETES_VERSION}: {where}: {exc.message}")
    except kubernetes_validate.SchemaNotFoundError as exc:
        pytest.fail(exc.message)


# ------------------------------------------------------------------ the schemas


def test_every_rendered_document_is_valid_for_kubernetes_1_32_strictly(rendered):
    kinds = {d["kind"] for d in rendered}
    assert {"Namespace", "ConfigMap", "Service", "StatefulSet", "Deployment"} <= kinds
    for document in rendered:
        _validate(document)
        assert document["kind"] == "Namespace" or document["metadata"].get("namespace") == "kvpush", \
            f"{document['kind']}/{document['metadata']['name']} is outside the kvpush namespace"


def test_the_strict_schemas_reject_an_unknown_field(rendered):
    """The validation above would be worth nothing if a misspelt field passed."""
    gateway = json.loads(json.dumps(_find(rendered, "Deployment", "gateway")))
    _containers(gateway)[0]["livenessProbe"]["httpGett"] = {"path": "/health", "port": 8000}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(gateway, KUBERNETES_VERSION, strict=True)


def test_the_kustomization_lists_every_manifest():
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    listed = {(K8S / r).resolve() for r in kustomization["resources"]}
    generated = {(K8S / f.split("=")[-1]).resolve() for g in kustomization["configMapGenerator"]
                 for f in g.get("files", [])}
    manifests = {p.resolve() for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml"}
    assert manifests - generated == listed, "deploy/k8s: every manifest file is in kustomization.yaml's resources"
    assert kustomization["namespace"] == "kvpush"


def test_references_between_objects_resolve(rendered, secrets):
    """Selectors find their pods, governing Services exist, every ConfigMap, Secret key,
    volume and named port a pod uses is there."""
    services = {d["metadata"]["name"]: d for d in rendered if d["kind"] == "Service"}
    workloads = _workloads(rendered)
    for workload in workloads:
        name = workload["metadata"]["name"]
        template = workload["spec"]["template"]
        selector = workload["spec"]["selector"]["matchLabels"]
        assert selector.items() <= template["metadata"]["labels"].items(), f"{name}: selector misses its pods"
        if workload["kind"] == "StatefulSet":
            governing = services.get(workload["spec"]["serviceName"])
            assert governing is not None and governing["spec"].get("clusterIP") == "None", \
                f"{name}: its serviceName must be a headless Service"
        pod = template["spec"]
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        claims = {c["metadata"]["name"] for c in workload["spec"].get("volumeClaimTemplates", [])}
        for volume in volumes.values():
            if "configMap" in volume:
                _config_map(rendered, volume["configMap"]["name"])
            if "secret" in volume:
                assert volume["secret"]["secretName"] in secrets, f"{name}: make-secrets.sh makes no " \
                                                                  f"{volume['secret']['secretName']}"
        for container in _containers(workload):
            for mount in container.get("volumeMounts", []):
                assert mount["name"] in volumes or mount["name"] in claims, f"{name}: no volume {mount['name']}"
            for source in container.get("envFrom", []):
                if "configMapRef" in source:
                    _config_map(rendered, source["configMapRef"]["name"])
                if "secretRef" in source:
                    assert source["secretRef"]["name"] in secrets, f"{name}: no Secret {source['secretRef']['name']}"
            for variable in container.get("env", []):
                ref = variable.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["key"] in secrets.get(ref["name"], {}), f"{name}: no key {ref['key']} in {ref['name']}"
            port_names = {p["name"] for p in container.get("ports", [])}
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                port = container.get(probe, {}).get("httpGet", {}).get("port")
                if isinstance(port, str):
                    assert port in port_names, f"{name}: {probe} names no port of the container"
    for service in services.values():
        selected = [w for w in workloads
                    if service["spec"]["selector"].items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert selected, f"Service {service['metadata']['name']} selects no pods"
        ports = {p["name"]: p["containerPort"] for w in selected for c in _containers(w) for p in c.get("ports", [])}
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            assert target in ports or target in ports.values(), \
                f"Service {service['metadata']['name']}: targetPort {target} is no port of its pods"


# ------------------------------------------------------------------ NATS


def _nats(rendered) -> tuple[dict, dict, str, str]:
    """The NATS StatefulSet, its container, and the rendered nats.conf and users.conf."""
    statefulset = _find(rendered, "StatefulSet", "nats")
    container = _containers(statefulset)[0]
    found = _mount_of(statefulset, container, lambda v: "configMap" in v)
    assert found, "the NATS pods mount no ConfigMap"
    mount, volume = found
    data = _config_map(rendered, volume["configMap"]["name"])
    config_path = container["command"][container["command"].index("--config") + 1]
    assert config_path == f"{mount['mountPath']}/nats.conf", "nats-server must be started with the mounted nats.conf"
    return statefulset, container, data["nats.conf"], data["users.conf"]


def _secret_files(volume: dict, data: dict[str, str], folder: Path) -> Path:
    """A Secret volume's files as the kubelet lays them out (``items`` rename keys), in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    items = volume["secret"].get("items") or [{"key": key, "path": key} for key in data]
    for item in items:
        assert item["key"] in data, f"the Secret {volume['secret']['secretName']} has no key {item['key']}"
        (folder / item["path"]).write_text(data[item["key"]])
    return folder


def _nats_folder(rendered, secrets, folder: Path) -> Path:
    """nats.conf and users.conf in ``folder``, with every Secret the NATS pods mount laid out
    beside them and the mount paths in the two files pointing there."""
    statefulset, container, config, users = _nats(rendered)
    for mount in container["volumeMounts"]:
        volume = next((v for v in statefulset["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]), {})
        if "secret" in volume:
            files = _secret_files(volume, secrets[volume["secret"]["secretName"]], folder / mount["name"])
            config = config.replace(mount["mountPath"], str(files))
            users = users.replace(mount["mountPath"], str(files))
    (folder / "nats.conf").write_text(config)
    (folder / "users.conf").write_text(users)
    return folder


def _conf_value(config: str, key: str) -> str:
    match = re.search(rf"^\s*{key}\s*[:=]?\s*(.+?)\s*$", config, re.MULTILINE)
    assert match, f"nats.conf sets no {key}"
    return match.group(1).strip('"')


def _conf_block(config: str, name: str) -> str:
    match = re.search(rf"^{name}\s*\{{(.*?)^\}}", config, re.MULTILINE | re.DOTALL)
    assert match, f"nats.conf has no {name} {{ }} block"
    return match.group(1)


def test_nats_is_a_three_member_cluster_with_jetstream_on_its_own_volumes(rendered):
    statefulset, container, config, _ = _nats(rendered)
    replicas = statefulset["spec"]["replicas"]
    assert replicas == 3
    assert container["image"].startswith("nats:"), "the official nats image"
    service = _find(rendered, "Service", statefulset["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True, \
        "members must find each other by name before they are ready"

    cluster = _conf_block(config, "cluster")
    routes = set(re.findall(r'"(nats://[^"]+)"', cluster))
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    members = {f"nats://{statefulset['metadata']['name']}-{i}.{service['metadata']['name']}:{ports['cluster']}"
               for i in range(replicas)}
    assert routes == members, "the cluster routes name every member, by its stable DNS name"
    assert int(_conf_value(cluster, "port")) == ports["cluster"]
    assert _conf_value(config, "server_name") == "$POD_NAME"
    pod_name = next(e for e in container["env"] if e["name"] == "POD_NAME")
    assert pod_name["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name", "each member needs its own name"

    store_dir = _conf_value(_conf_block(config, "jetstream"), "store_dir")
    claims = {c["metadata"]["name"]: c for c in statefulset["spec"]["volumeClaimTemplates"]}
    data_mount = next(m for m in container["volumeMounts"] if m["name"] in claims)
    assert store_dir.startswith(data_mount["mountPath"].rstrip("/") + "/"), "JetStream stores on the PVC"
    assert claims[data_mount["name"]]["spec"]["resources"]["requests"]["storage"]

    assert int(_conf_value(config, "http_port")) == ports["monitor"]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        get = container[probe]["httpGet"]
        assert get["path"].startswith("/healthz") and get["port"] == "monitor", probe
    assert 'include "users.conf"' in config


def test_nats_server_accepts_its_configuration_with_the_secret_passwords_and_not_without(rendered, secrets, tmp_path):
    """nats-server itself parses the rendered config: syntax, unknown fields, the include,
    and every $VARIABLE (each user's password) must come from the pod's environment."""
    _, container, _, _ = _nats(rendered)
    _nats_folder(rendered, secrets, tmp_path)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "POD_NAME": "nats-0"}
    for source in container.get("envFrom", []):
        env.update(secrets[source["secretRef"]["name"]])
    test = [server_binary(), "-c", "nats.conf", "-t"]
    result = subprocess.run(test, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, f"nats-server rejects the rendered nats.conf:\n{result.stderr}{result.stdout}"
    variable = sorted(k for k in env if k.startswith("NATS_PASSWORD_"))[0]
    without = {k: v for k, v in env.items() if k != variable}
    result = subprocess.run(test, cwd=tmp_path, env=without, capture_output=True, text=True, timeout=30)
    assert result.returncode != 0 and variable in result.stderr + result.stdout


def test_every_password_is_a_plain_string_to_nats_server(rendered, secrets, tmp_path):
    """nats-server parses a $VARIABLE's value as a config token: a password such as
    "-x..." or "12-x..." (about 1 in 50 of kvpush's random ones) is a broken number or
    date, and the server does not start. make-secrets.sh puts a letter in front of each."""
    _nats_folder(rendered, secrets, tmp_path)
    server = secrets["kvpush-nats-server"]
    assert all(re.fullmatch(r"[A-Za-z][-_A-Za-z0-9]+", p) for p in server.values())
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "POD_NAME": "nats-0", **server}
    first = sorted(server)[0]
    result = subprocess.run([server_binary(), "-c", "nats.conf", "-t"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=30, env={**env, first: "-" + "x" * 23})
    assert result.returncode != 0, "nats-server now takes a password starting with '-': the letter can go"


def test_nats_listens_on_the_pod_and_requires_mutual_tls_on_clients_and_routes(rendered):
    """users.conf binds every address of the pod (the probes and the other pods reach it)
    and requires a client certificate; its files, and the routes' own, are the mounted
    Secret's under the names the tls blocks give."""
    statefulset, container, config, users = _nats(rendered)
    assert _conf_value(users, "host") == "0.0.0.0"
    found = _mount_of(statefulset, container, lambda v: v.get("secret", {}).get("secretName") == "kvpush-nats-server-tls")
    assert found, "the NATS pods mount no kvpush-nats-server-tls"
    mount, volume = found
    laid_out = {f"{mount['mountPath']}/{item['path']}": item["key"] for item in volume["secret"]["items"]}
    for where, block in (("users.conf", _conf_block(users, "tls")), ("nats.conf's cluster", _conf_block(config, "cluster"))):
        tls = re.search(r"tls\s*\{(.*?)\}", block, re.DOTALL).group(1) if where != "users.conf" else block
        files = {key: _conf_value(tls, key) for key in ("cert_file", "key_file", "ca_file")}
        assert {laid_out.get(path) for path in files.values()} == {"tls.crt", "tls.key", "ca.crt"}, (where, files)
        assert _conf_value(tls, "verify") == "true", f"{where}: the peer must present a certificate"


async def test_kvpush_pods_log_in_over_mutual_tls_under_each_members_name(rendered, secrets, tmp_path, monkeypatch):
    """A real nats-server with the rendered users.conf and make-secrets.sh's certificates:
    the gateway and a prefill pod, with their own environment and mounted files, log in
    under each member's name (nats-0.nats, ...) and the server's certificate is checked
    against it; a name it does not hold is refused."""
    import nats

    from kvpush.services.launch.natsd import LocalNatsServer

    folder = _nats_folder(rendered, secrets, tmp_path / "nats")
    for variable, password in secrets["kvpush-nats-server"].items():
        monkeypatch.setenv(variable, password)
    members = [urlsplit(u).hostname for u in _config_map(rendered, _kvpush_env_name(rendered))["KVPUSH_NATS_URL"].split(",")]
    with LocalNatsServer(config=folder / "users.conf") as server:
        for workload, pod in ((_find(rendered, "Deployment", "gateway"), "gateway-0"),
                              (_find(rendered, "StatefulSet", "prefill"), "prefill-1")):
            _, launched = _run_container(rendered, secrets, workload, pod, tmp_path / pod)
            env = launched["env"]
            user = nats_security.nats_user(env)
            options = nats_security.connect_options(env, service=None if user == "gateway" else user)
            for member in members:
                nc = await nats.connect(server.url, tls_hostname=member, allow_reconnect=False, connect_timeout=5,
                                        **options)
                assert nc.is_connected and nc.connected_server_version.major >= 2
                await nc.close()
            with pytest.raises(ssl.SSLCertVerificationError):
                await nats.connect(server.url, tls_hostname="nats.example.com", allow_reconnect=False,
                                   connect_timeout=5, **options)


def _kvpush_env_name(rendered) -> str:
    container = _containers(_find(rendered, "Deployment", "gateway"))[0]
    return container["envFrom"][0]["configMapRef"]["name"]


def _identities(users_conf: str) -> list[permissions.Identity]:
    """The users of a rendered config, in order: each is `# <role>` then `user: "<name>"`."""
    pairs = re.findall(r'^\s*#\s*(scheduler|prefill|decode|client)\s*\n\s*user:\s*"([^"]+)"', users_conf, re.MULTILINE)
    return [permissions.Identity(role, name) for role, name in pairs]


def test_nats_users_and_permissions_are_what_shared_permissions_renders(rendered):
    """users.conf is `kvpush nats-config` output, verbatim: the same text
    kvpush.shared.permissions renders today for the same identities, so a changed rule in the code
    fails here until the file is generated again (README.md says how)."""
    _, _, _, users = _nats(rendered)
    identities = _identities(users)
    assert len(identities) == users.count("user:"), "every user has its role comment"
    tls = {key: _conf_value(_conf_block(users, "tls"), key) for key in ("cert_file", "key_file", "ca_file")}
    assert users == permissions.render_config(identities, permissions.env_password, tls=tls,
                                              listen=_conf_value(users, "host")), \
        "deploy/k8s/nats/users.conf differs from what kvpush.shared.permissions renders: regenerate it (deploy/k8s/README.md)"

    by_name = {i.name: i.role for i in identities}
    for workload in _kvpush_workloads(rendered):
        name = workload["metadata"]["name"]
        if workload["kind"] == "StatefulSet":  # a user per pod: <name>-<ordinal>
            for ordinal in range(workload["spec"]["replicas"]):
                pod = f"{name}-{ordinal}"
                assert pod in by_name, f"pod {pod} has no NATS user in users.conf"
                assert by_name[pod] == _role(workload), f"{pod} is a {by_name[pod]} user, not {_role(workload)}"
        else:
            user = _plain_env(_containers(workload)[0])["KVPUSH_NATS_USER"]
            assert by_name.get(user) == "client", f"{name} logs in as {user!r}, which is no client user"


def test_readme_regenerates_users_conf_exactly():
    readme = (K8S / "README.md").read_text()
    commands = re.findall(r"^(kvpush nats-config .*?)\s*>\s*deploy/k8s/nats/users\.conf\s*$", readme, re.MULTILINE)
    assert len(commands) == 1, "README.md gives the one command that writes deploy/k8s/nats/users.conf"
    argv = commands[0].split()[1:]
    result = subprocess.run([*_kvpush_command().split(), *argv], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout == (K8S / "nats" / "users.conf").read_text(), "README.md's command no longer writes users.conf"


def test_make_secrets_gives_every_identity_its_password_once(rendered, secrets):
    _, _, _, users = _nats(rendered)
    identities = _identities(users)
    server = secrets["kvpush-nats-server"]
    assert set(server) == {permissions.password_variable(i.name) for i in identities}
    for role in ("scheduler", "prefill", "decode", "client"):
        names = {i.name for i in identities if i.role == role}
        assert set(secrets[f"kvpush-nats-{role}"]) == names, f"kvpush-nats-{role} holds the {role} passwords only"
        for name in names:
            assert secrets[f"kvpush-nats-{role}"][name] == server[permissions.password_variable(name)]
    passwords = list(server.values())
    assert len(set(passwords)) == len(passwords) and all(len(p) >= 20 for p in passwords)


def test_make_secrets_refuses_a_users_conf_the_code_would_not_write(tmp_path):
    copy = tmp_path / "k8s"
    shutil.copytree(K8S, copy)
    users = copy / "nats" / "users.conf"
    users.write_text(users.read_text().replace('"kvpush.invalid", ', "", 1))
    result = _make_secrets(copy)
    assert result.returncode != 0 and "regenerate" in result.stderr
    assert "Secret" not in result.stdout


# ------------------------------------------------------------------ the kvpush containers


def _role(workload: dict) -> str:
    args = " ".join(_containers(workload)[0].get("command", []) + _containers(workload)[0].get("args", []))
    match = re.search(r"kvpush (scheduler|gateway|worker --role (prefill|decode))", args)
    assert match, f"{workload['metadata']['name']} runs no kvpush service"
    return match.group(2) or match.group(1)


def _plain_env(container: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def _environment(rendered, secrets, container: dict, pod_name: str) -> dict[str, str]:
    """The container's environment as the kubelet would make it, for the pod ``pod_name``."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env.update(_config_map(rendered, source["configMapRef"]["name"]))
        else:
            env.update(secrets[source["secretRef"]["name"]])
    for variable in container.get("env", []):
        if "value" in variable:
            env[variable["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), variable["value"])
            continue
        source = variable["valueFrom"]
        if "fieldRef" in source:
            assert source["fieldRef"]["fieldPath"] == "metadata.name", variable
            env[variable["name"]] = pod_name
        elif "secretKeyRef" in source:
            env[variable["name"]] = secrets[source["secretKeyRef"]["name"]][source["secretKeyRef"]["key"]]
        else:
            pytest.fail(f"unexpected env source {source}")
    return env


def _run_container(rendered, secrets, workload: dict, pod_name: str, tmp_path: Path,
                   drop_password: bool = False) -> tuple[subprocess.CompletedProcess, dict | None]:
    """Run the container's command as its pod ``pod_name`` would, with each Secret volume's
    files in a folder here (the mount paths in its command and environment pointing there)
    and a stand-in ``kvpush`` that records its argv and environment."""
    container = _containers(workload)[0]
    argv = container.get("command", []) + container.get("args", [])
    env = _environment(rendered, secrets, container, pod_name)
    for mount in container.get("volumeMounts", []):
        volume = _volume(workload, mount["name"])
        if "secret" not in volume:
            continue
        data = {key: value for key, value in secrets[volume["secret"]["secretName"]].items()
                if not (drop_password and key == pod_name)}
        files = _secret_files(volume, data, tmp_path / "secret" / mount["name"])
        assert any(mount["mountPath"] in part for part in [*argv, *env.values()]), \
            f"{workload['metadata']['name']}: neither the command nor the environment uses the mounted Secret " \
            f"{mount['mountPath']}"
        argv = [part.replace(mount["mountPath"], str(files)) for part in argv]
        env = {key: value.replace(mount["mountPath"], str(files)) for key, value in env.items()}
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "record.json"
    stand_in = bin_dir / "kvpush"
    stand_in.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                        f"json.dump({{'argv': sys.argv[1:], 'env': dict(os.environ)}}, open({str(record)!r}, 'w'))\n")
    stand_in.chmod(0o755)
    env = {**env, "PATH": f"{bin_dir}:/usr/bin:/bin"}
    if argv[0] == "kvpush":
        argv = [str(stand_in), *argv[1:]]
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30)
    return result, (json.loads(record.read_text()) if record.exists() else None)


def _pods(workload: dict) -> list[str]:
    name = workload["metadata"]["name"]
    if workload["kind"] == "StatefulSet":
        return [f"{name}-{ordinal}" for ordinal in range(workload["spec"]["replicas"])]
    return [f"{name}-5d8c7b9f4-x2x7q"]  # a Deployment's pods have no stable names


def _parse_as_kvpush(monkeypatch, launched: dict):
    """What the real kvpush CLI makes of the argv and environment the container gave it."""
    for key in list(os.environ):
        if key.startswith(("KVPUSH_", "OTEL_")):
            monkeypatch.delenv(key)
    for key, value in launched["env"].items():
        if key.startswith(("KVPUSH_", "OTEL_")):
            monkeypatch.setenv(key, value)
    assert launched["argv"] and launched["argv"][0] in ("scheduler", "gateway", "worker")
    try:
        return build_parser().parse_args(launched["argv"])
    except SystemExit:
        pytest.fail(f"kvpush rejects: {launched['argv']} with {launched['env']}")


KVPUSH_WORKLOADS = ("scheduler", "gateway", "prefill", "decode")


@pytest.mark.parametrize("name", KVPUSH_WORKLOADS)
def test_each_kvpush_pod_starts_as_its_own_nats_identity_on_every_nats_member(rendered, secrets, tmp_path,
                                                                             monkeypatch, name):
    from kvpush.services.worker.service import worker_id_for

    workload = next(w for w in _kvpush_workloads(rendered) if w["metadata"]["name"] == name)
    container = _containers(workload)[0]
    for key in [e["name"] for e in container.get("env", [])] + list(
            _config_map(rendered, container["envFrom"][0]["configMapRef"]["name"])):
        assert key in ENVIRONMENT or key in OTEL_ENVIRONMENT or key in nats_security.ENV_VARS.values() \
               or PASS_THROUGH.fullmatch(key), f"{name}: kvpush reads no {key}"

    nats_statefulset = _find(rendered, "StatefulSet", "nats")
    nats_service = nats_statefulset["spec"]["serviceName"]
    members = {f"nats-{i}.{nats_service}:4222" for i in range(nats_statefulset["spec"]["replicas"])}
    for pod in _pods(workload):
        run = tmp_path / pod
        run.mkdir()
        result, launched = _run_container(rendered, secrets, workload, pod, run)
        assert result.returncode == 0 and launched, f"{pod}: the container did not start kvpush: {result.stderr}"
        args = _parse_as_kvpush(monkeypatch, launched)
        env = launched["env"]

        urls = args.nats_url.split(",")
        assert {urlsplit(u).netloc for u in urls} == members and all(u.startswith("tls://") for u in urls), \
            f"{pod}: KVPUSH_NATS_URL must list every NATS member, as tls://, not {args.nats_url}"
        if hasattr(nats_security, "server_urls"):
            assert len(nats_security.server_urls(args.nats_url)) == len(members)

        user = nats_security.nats_user(env)
        options = nats_security.connect_options(env, service=user)
        assert isinstance(options.get("tls"), ssl.SSLContext) and options["tls"].verify_mode == ssl.CERT_REQUIRED, \
            f"{pod}: no TLS settings for NATS"
        if workload["kind"] == "StatefulSet":
            assert user == pod, f"{pod} logs in as {user!r}"
            secret = _mount_of(workload, container, lambda v: "secret" in v)[1]["secret"]["secretName"]
            assert options["password"] == secrets[secret][pod], f"{pod} got another identity's password"
        else:
            assert options["password"] == secrets["kvpush-nats-client"][user]

        role = _role(workload)
        if role in WORKER_ROLES:
            assert args.role == role
            assert args.worker_id == pod and worker_id_for(args.role, args.worker_id, user) == pod, \
                f"{pod}: the worker id must be the pod's name and NATS user"
        elif role == "scheduler":
            assert args.scheduler_id == pod == user
            assert args.jetstream_replicas == nats_statefulset["spec"]["replicas"] == 3, \
                "on a three-member NATS cluster the buckets need 3 replicas"

        collector = urlsplit(env["OTEL_EXPORTER_OTLP_ENDPOINT"])
        service = _find(rendered, "Service", collector.hostname)
        http_port = next(p for p in service["spec"]["ports"] if p["port"] == collector.port)
        assert collector.scheme == "http" and collector.port == 4318 and http_port["name"] == "otlp-http", \
            "otel/setup.py exports OTLP/HTTP: the collector's 4318"


@pytest.mark.parametrize("role", WORKER_ROLES)
def test_a_worker_without_its_password_file_does_not_start(rendered, secrets, tmp_path, role):
    workload = _find(rendered, "StatefulSet", role)
    result, launched = _run_container(rendered, secrets, workload, f"{role}-0", tmp_path, drop_password=True)
    assert result.returncode != 0 and launched is None
    assert f"no NATS password for {role}-0" in result.stderr


def test_the_collector_receives_otlp_on_4317_and_4318(rendered):
    deployment = _find(rendered, "Deployment", "otel-collector")
    container = _containers(deployment)[0]
    mount, volume = _mount_of(deployment, container, lambda v: "configMap" in v)
    config_file = next(a.split("=", 1)[1] for a in container["args"] if a.startswith("--config="))
    key = Path(config_file).name
    assert config_file == f"{mount['mountPath']}/{key}"
    config = yaml.safe_load(_config_map(rendered, volume["configMap"]["name"])[key])
    protocols = config["receivers"]["otlp"]["protocols"]
    assert protocols["grpc"]["endpoint"] == "0.0.0.0:4317" and protocols["http"]["endpoint"] == "0.0.0.0:4318"
    assert {p["containerPort"] for p in container["ports"]} >= {4317, 4318}
    service = _find(rendered, "Service", "otel-collector")
    assert {p["port"] for p in service["spec"]["ports"]} == {4317, 4318}
    for pipeline in config["service"]["pipelines"].values():
        assert "otlp" in pipeline["receivers"]
        assert set(pipeline["exporters"]) <= set(config["exporters"])
        assert set(pipeline["processors"]) <= set(config["processors"])
    health = int(config["extensions"]["health_check"]["endpoint"].rsplit(":", 1)[1])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    for probe in ("livenessProbe", "readinessProbe"):
        assert ports[container[probe]["httpGet"]["port"]] == health


# ------------------------------------------------------------------ probes and metrics


def _served_paths() -> dict[str, set[str]]:
    """The GET paths the code serves: the gateway's FastAPI routes, and the metrics
    endpoint (otel/endpoint.py) of the scheduler and the workers."""
    gateway = set(re.findall(r'@app\.get\("([^"]+)"\)', (ROOT / "services" / "gateway" / "app.py").read_text()))
    endpoint = set(re.findall(r'path == "([^"]+)"', (ROOT / "otel" / "endpoint.py").read_text()))
    assert {"/health", "/ready", "/metrics"} <= gateway and {"/health", "/ready", "/metrics"} <= endpoint, \
        "the served paths could not be read from the code"
    return {"gateway": gateway, "endpoint": endpoint}


def _served_port(workload: dict) -> tuple[int, str]:
    """Where the kvpush process in this pod serves HTTP (its port and which server)."""
    container = _containers(workload)[0]
    argv = container.get("command", []) + container.get("args", [])
    if _role(workload) == "gateway":
        assert argv[argv.index("--host") + 1] == "0.0.0.0", "the gateway must listen on every address in a pod"
        return int(argv[argv.index("--port") + 1]), "gateway"
    env = _plain_env(container)
    assert env.get("KVPUSH_METRICS_HOST") == "0.0.0.0", \
        f"{workload['metadata']['name']}: KVPUSH_METRICS_HOST must be 0.0.0.0 (the default 127.0.0.1 is unreachable)"
    return int(env["KVPUSH_METRICS_PORT"]), "endpoint"


def _container_port(container: dict, port) -> int:
    if isinstance(port, int):
        assert port in {p["containerPort"] for p in container["ports"]}
        return port
    return next(p["containerPort"] for p in container["ports"] if p["name"] == port)


@pytest.mark.parametrize("name", KVPUSH_WORKLOADS)
def test_probes_ask_paths_the_service_serves_on_the_port_it_serves_them(rendered, name):
    served = _served_paths()
    workload = next(w for w in _kvpush_workloads(rendered) if w["metadata"]["name"] == name)
    container = _containers(workload)[0]
    port, server = _served_port(workload)
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert probe in container, f"{name} has no {probe}"
        get = container[probe]["httpGet"]
        assert get["path"] in served[server], f"{name}: {probe} asks {get['path']}, which {server} does not serve"
        assert _container_port(container, get["port"]) == port, f"{name}: {probe} asks another port"
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"  # serving, not only running
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"


def test_every_pod_serving_metrics_is_annotated_for_prometheus_on_that_port(rendered):
    served = _served_paths()
    annotated = set()
    for workload in _workloads(rendered):
        annotations = workload["spec"]["template"]["metadata"].get("annotations", {})
        if annotations.get("prometheus.io/scrape") != "true":
            continue
        annotated.add(workload["metadata"]["name"])
        port, server = _served_port(workload)
        assert int(annotations["prometheus.io/port"]) == port
        assert port in {p["containerPort"] for c in _containers(workload) for p in c.get("ports", [])}
        assert annotations["prometheus.io/path"] == "/metrics" and "/metrics" in served[server]
    assert annotated == set(KVPUSH_WORKLOADS), "every kvpush service serves /metrics and is scraped"
    for role in WORKER_ROLES:
        container = _containers(_find(rendered, "StatefulSet", role))[0]
        port, _ = _served_port(_find(rendered, "StatefulSet", role))
        assert port + 1 in {p["containerPort"] for p in container["ports"]}, \
            f"{role}: its engine core serves /metrics on the next port (otel/setup.py engine_metrics_port)"


# ------------------------------------------------------------------ GPUs and RDMA


@pytest.mark.parametrize("role", WORKER_ROLES)
def test_workers_are_gpu_statefulsets_with_rdma(rendered, role):
    workload = _find(rendered, "StatefulSet", role)
    assert workload["metadata"]["name"] == role and workload["spec"]["replicas"] >= 1
    container = _containers(workload)[0]
    resources = container["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == 1
    rdma = [r for r in resources["limits"] if r.startswith("rdma/")]
    assert rdma and all(resources["requests"].get(r) == resources["limits"][r] for r in rdma)
    assert "IPC_LOCK" in container["securityContext"]["capabilities"]["add"]
    env = _plain_env(container)
    transports = env["UCX_TLS"].split(",")
    assert {"rc", "cuda_copy", "tcp"} <= set(transports)
    assert env["UCX_NET_DEVICES"] and env["UCX_IB_GID_INDEX"].isdigit()
    shm = _mount_of(workload, container, lambda v: v.get("emptyDir", {}).get("medium") == "Memory")
    assert shm and shm[0]["mountPath"] == "/dev/shm"


@pytest.mark.parametrize("role", WORKER_ROLES)
def test_a_workers_tensor_parallelism_is_the_gpus_it_asks_for_and_kvpush_reads_it(rendered, secrets, tmp_path,
                                                                                  monkeypatch, role):
    """vLLM runs one process per rank, one GPU each: the pod's GPUs are its engine's TP,
    which the worker's command, run as the pod runs it, parses from the environment."""
    workload = _find(rendered, "StatefulSet", role)
    container = _containers(workload)[0]
    tensor_parallel = int(_plain_env(container)["KVPUSH_TENSOR_PARALLEL_SIZE"])
    resources = container["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == tensor_parallel
    result, launched = _run_container(rendered, secrets, workload, f"{role}-0", tmp_path)
    assert result.returncode == 0 and launched, result.stderr
    assert launched["env"]["KVPUSH_TENSOR_PARALLEL_SIZE"] == str(tensor_parallel)  # the pod hands it to kvpush
    assert _parse_as_kvpush(monkeypatch, launched).tensor_parallel_size == tensor_parallel
    launched["env"]["KVPUSH_TENSOR_PARALLEL_SIZE"] = "4"  # as an operator sets it, with 4 GPUs
    assert _parse_as_kvpush(monkeypatch, launched).tensor_parallel_size == 4


def test_readme_says_no_cluster_was_started():
    readme = (K8S / "README.md").read_text()
    assert "no cluster was started" in readme.lower()
    for topic in ("kubectl kustomize", "make-secrets.sh", "`gpu` extra", "storageClassName", "UCX_NET_DEVICES"):
        assert topic in readme, f"deploy/k8s/README.md does not mention {topic}"
