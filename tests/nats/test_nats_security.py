"""NATS authentication and TLS enforced by a real nats-server running the sample
deploy/nats-server.conf with the dev certificates: one user per worker, scheduler and
client, and each identity reaches the subjects it needs and nothing else. The option
parsing itself is tested in tests/unit/test_nats_options.py; per-identity rules between
peers of one role (another decode's jobs) in tests/nats/test_identities.py."""

from __future__ import annotations

import asyncio
import re
import shutil
import ssl
import subprocess
import sys
import time
from pathlib import Path

import nats
import nats.errors
import nats.js.api
import nats.js.errors
import pytest

from kvpush.tools import dev_certs
from kvpush.services.launch.natsd import LocalNatsServer, free_port, server_binary, terminate
from kvpush.shared import permissions, wire
from kvpush.shared.nats_security import connect_options

ROOT = Path(__file__).resolve().parents[2]
SAMPLE_CONFIG = ROOT / "deploy" / "nats-server.conf"
PASSWORDS = {identity.name: f"{identity.name}-pw" for identity in permissions.SAMPLE_IDENTITIES}
# One identity of each role, each connected as a kvpush process of that role connects:
# under its NATS user, which is its id (services take replies on _KVPUSH_INBOX.<id>).
S, P, D, C = ROLES = ("scheduler-0", "prefill-0", "decode-0", "client-0")
QUEUE = wire.SCHEDULER_QUEUE_GROUP


def tls_env(certs: Path, client_cert: bool = True) -> dict[str, str]:
    env = {"KVPUSH_NATS_TLS_CA": str(certs / "ca.pem")}
    if client_cert:
        env |= {"KVPUSH_NATS_TLS_CERT": str(certs / "client.pem"), "KVPUSH_NATS_TLS_KEY": str(certs / "client-key.pem")}
    return env


# --------------------------------------------------------------------------- a real nats-server


def secured_config(folder: Path) -> Path:
    """A copy of the sample config with dev certificates beside it, as deploy/README.md describes."""
    dev_certs.generate(folder / "certs")
    config = folder / "nats-server.conf"
    shutil.copy(SAMPLE_CONFIG, config)
    return config


def start_secured(config: Path, monkeypatch: pytest.MonkeyPatch) -> LocalNatsServer:
    for name, password in PASSWORDS.items():  # the sample's $NATS_PASSWORD_<NAME>, for every user in it
        monkeypatch.setenv(permissions.password_variable(name), password)
    return LocalNatsServer(config=config).start()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    config = secured_config(tmp_path_factory.mktemp("nats-conf"))
    with pytest.MonkeyPatch.context() as monkeypatch:
        server = start_secured(config, monkeypatch)
    try:
        yield server
    finally:
        server.stop()


def role_env(role: str, certs: Path, password: str | None = None) -> dict[str, str]:
    return {"KVPUSH_NATS_USER": role, "KVPUSH_NATS_PASSWORD": password or PASSWORDS[role]} | tls_env(certs)


class Conn:
    """A connection as one identity, with the asynchronous errors the server sent it."""

    def __init__(self, role: str):
        self.role = role
        self.errors: list[Exception] = []
        self.nc: nats.NATS | None = None

    async def on_error(self, exc: Exception) -> None:
        self.errors.append(exc)

    def violations(self) -> list[str]:
        return [str(e) for e in self.errors if "permissions violation" in str(e).lower()]


async def connect_as(role: str, server: LocalNatsServer, **kwargs) -> Conn:
    conn = Conn(role)
    certs = server.config.parent / "certs"
    options = {"allow_reconnect": False, "connect_timeout": 2} | kwargs
    service = None if role == C else role  # a service's id is its NATS user's name
    conn.nc = await nats.connect(server.url, name=role, error_cb=conn.on_error,
                                 **options, **connect_options(role_env(role, certs), service=service))
    return conn


@pytest.fixture
async def roles(server):
    conns = {role: await connect_as(role, server) for role in ROLES}
    yield conns
    for conn in conns.values():
        await conn.nc.close()


async def settle(conns) -> None:
    """After a round trip every earlier message and -ERR has reached the client. Two
    flushes: nats-py 2.16 writes flush()'s PING straight to the socket, ahead of commands
    its flusher task has not written yet; the second PING goes after them."""
    for conn in conns.values():
        await conn.nc.flush(timeout=2)
        await conn.nc.flush(timeout=2)


# The subjects each identity uses (shared/wire/subjects.py).
ALLOWED_FLOWS = [
    # publisher, subject, [(subscriber, subscription, queue group)]
    (C, wire.OWNED_GENERATE(client=C), [(S, wire.OWNED_GENERATE.wildcard, QUEUE)]),
    (C, wire.OWNED_CANCEL(client=C), [(S, wire.OWNED_CANCEL.wildcard, "")]),
    (S, wire.prefill_job_subject(P), [(P, wire.prefill_job_subject(P), "")]),
    (S, wire.decode_job_subject(D), [(D, wire.decode_job_subject(D), "")]),
    (S, f"{wire.CLIENT_INBOX_PREFIX}.{C}.error", [(C, f"{wire.CLIENT_INBOX_PREFIX}.{C}.>", "")]),
    (P, wire.HEARTBEATS(sender=P), [(S, wire.HEARTBEATS.wildcard, "")]),
    (D, wire.HEARTBEATS(sender=D), [(S, wire.HEARTBEATS.wildcard, "")]),
    (P, wire.HANDOFFS(sender=P), [(S, wire.HANDOFFS.wildcard, "")]),
    (P, wire.completion_subject(D, P),
     [(S, wire.COMPLETION_SUBJECTS, ""), (D, wire.KV_COMPLETIONS.partly(engine_id=D), "")]),
    (D, wire.completion_subject(D, D),  # decode's own READ failed
     [(S, wire.COMPLETION_SUBJECTS, ""), (D, wire.KV_COMPLETIONS.partly(engine_id=D), "")]),
    (P, wire.KV_AGENTS(sender=P), [(D, wire.KV_AGENTS.wildcard, "")]),
    (D, wire.KV_AGENTS(sender=D), [(P, wire.KV_AGENTS.wildcard, "")]),
    (D, wire.registration_subject(P, D), [(P, wire.KV_CONTROL.partly(engine_id=P), "")]),
    (D, wire.PROGRESS(sender=D), [(S, wire.PROGRESS.wildcard, "")]),
    (D, f"{wire.CLIENT_INBOX_PREFIX}.{C}.tokens", [(C, f"{wire.CLIENT_INBOX_PREFIX}.{C}.>", "")]),
]


@pytest.mark.parametrize("publisher,subject,subscribers", ALLOWED_FLOWS, ids=[f"{p}->{s}" for p, s, _ in ALLOWED_FLOWS])
async def test_allowed_subjects_deliver(roles, publisher, subject, subscribers):
    subs = [await roles[role].nc.subscribe(pattern, queue=queue) for role, pattern, queue in subscribers]
    await settle(roles)
    await roles[publisher].nc.publish(subject, b"payload")
    for sub in subs:
        msg = await sub.next_msg(timeout=2)
        assert (msg.subject, msg.data) == (subject, b"payload")
    await settle(roles)
    assert {role: conn.errors for role, conn in roles.items()} == {role: [] for role in ROLES}


REQUESTS = [
    # requester, subject, responder, its subscription
    (C, wire.OWNED_STATUS(client=C), S, wire.OWNED_STATUS.wildcard),
    (S, wire.prefill_job_subject(P), P, wire.prefill_job_subject(P)),
    (S, wire.decode_job_subject(D), D, wire.decode_job_subject(D)),
    (D, wire.agent_subject(P, 0), P, wire.KV_AGENT.partly(engine_id=P)),
    (P, wire.agent_subject(D, 0), D, wire.KV_AGENT.partly(engine_id=D)),
]


@pytest.mark.parametrize("requester,subject,responder,pattern", REQUESTS)
async def test_requests_are_answered(roles, requester, subject, responder, pattern):
    async def answer(msg):
        await msg.respond(b"ack:" + msg.data)

    await roles[responder].nc.subscribe(pattern, cb=answer)
    await settle(roles)
    reply = await roles[requester].nc.request(subject, b"job", timeout=2)
    assert reply.data == b"ack:job"
    assert {role: conn.errors for role, conn in roles.items()} == {role: [] for role in ROLES}


@pytest.mark.parametrize("role", [S, P, D])
async def test_services_may_report_invalid_messages(roles, role):
    await roles[role].nc.publish(wire.INVALID_SUBJECT, b"{}")
    await settle(roles)
    assert roles[role].errors == []


FORBIDDEN_PUBLISH = [
    # publisher, subject, a role that would otherwise receive it and its subscription
    (C, wire.registration_subject(P, D), P, wire.KV_CONTROL.partly(engine_id=P)),
    (C, wire.prefill_job_subject(P), P, wire.prefill_job_subject(P)),
    (C, wire.HEARTBEATS(sender=D), S, wire.HEARTBEATS.wildcard),
    (C, wire.completion_subject(D, P), D, wire.KV_COMPLETIONS.partly(engine_id=D)),
    (P, wire.decode_job_subject(D), D, wire.decode_job_subject(D)),
    (P, wire.registration_subject(P, D), P, wire.KV_CONTROL.partly(engine_id=P)),
    (D, wire.prefill_job_subject(P), P, wire.prefill_job_subject(P)),
    (D, wire.HANDOFFS(sender=D), S, wire.HANDOFFS.wildcard),
    (D, wire.completion_subject(D, P), S, wire.COMPLETION_SUBJECTS),  # a TransferFailed in prefill's name
    (S, wire.registration_subject(P, D), P, wire.KV_CONTROL.partly(engine_id=P)),
    (S, wire.KV_AGENTS(sender=S), D, wire.KV_AGENTS.wildcard),
]


@pytest.mark.parametrize("publisher,subject,receiver,pattern", FORBIDDEN_PUBLISH)
async def test_forbidden_publish_is_a_permissions_violation(roles, publisher, subject, receiver, pattern):
    sub = await roles[receiver].nc.subscribe(pattern)
    await settle(roles)
    await roles[publisher].nc.publish(subject, b"forged")
    await settle(roles)
    assert roles[publisher].violations() == [f'nats: permissions violation for publish to "{subject}"']
    assert sub.pending_msgs == 0
    assert roles[publisher].nc.is_connected


FORBIDDEN_SUBSCRIBE = [
    # subscriber, subject, queue group
    (D, wire.GENERATE_SUBJECT, ""),
    (P, wire.GENERATE_SUBJECT, QUEUE),
    (C, wire.GENERATE_SUBJECT, ""),
    (C, wire.DECODE_JOBS.wildcard, ""),
    (C, wire.KV_AGENTS.wildcard, ""),
    (C, f"{wire.SERVICE_INBOX_PREFIX}.>", ""),  # the services' replies: job acks, agent info
    (P, wire.DECODE_JOBS.wildcard, ""),
    (D, wire.PREFILL_JOBS.wildcard, ""),
    (D, wire.KV_CONTROL.wildcard, ""),
    (S, wire.KV_CONTROL.wildcard, ""),
    (S, wire.PREFILL_JOBS.wildcard, ""),  # the workers' jobs
    (S, f"{wire.CLIENT_INBOX_PREFIX}.>", ""),  # the clients' streams: a scheduler sends there, never reads
    (S, wire.FINAL_SUBJECT, ""),  # only in the schedulers' queue group
    (S, wire.FINAL_SUBJECT, "another-group"),
    (D, ">", ""),
]


@pytest.mark.parametrize("role,subject,queue", FORBIDDEN_SUBSCRIBE)
async def test_forbidden_subscribe_is_a_permissions_violation(roles, role, subject, queue):
    await roles[role].nc.subscribe(subject, queue=queue)
    await settle(roles)
    expected = f'nats: permissions violation for subscription to "{subject}"'
    if queue:
        expected += f' using queue "{queue}"'
    assert [v.lower() for v in roles[role].violations()] == [expected.lower()]  # nats-py lowercases -ERR


async def test_wrong_password_is_refused(server):
    env = role_env(C, server.config.parent / "certs", password="wrong")
    options = connect_options(env)
    with pytest.raises(nats.errors.Error, match="(?i)authorization violation"):
        await nats.connect(server.url, allow_reconnect=False, connect_timeout=2, **options)


async def test_a_user_cannot_log_in_with_another_users_password(server):
    env = role_env(S, server.config.parent / "certs", password=PASSWORDS[C])
    options = connect_options(env)
    with pytest.raises(nats.errors.Error, match="(?i)authorization violation"):
        await nats.connect(server.url, allow_reconnect=False, connect_timeout=2, **options)


async def test_plaintext_is_refused(server):
    """The server announces TLS as required and drops a client that talks in the clear."""
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    try:
        info = await asyncio.wait_for(reader.readline(), 2)
        assert info.startswith(b"INFO ") and b'"tls_required":true' in info
        writer.write(f'CONNECT {{"user":"{C}","pass":"{PASSWORDS[C]}","verbose":false}}\r\nPING\r\n'.encode())
        await writer.drain()
        rest = await asyncio.wait_for(reader.read(), 5)
        assert b"PONG" not in rest
    finally:
        writer.close()


async def test_untrusted_server_certificate_is_refused(server):
    """Without the CA, the client's default trust store rejects the dev server certificate."""
    env = {"KVPUSH_NATS_USER": C, "KVPUSH_NATS_PASSWORD": PASSWORDS[C]}
    options = connect_options(env)
    with pytest.raises(ssl.SSLCertVerificationError):
        await nats.connect(server.url, allow_reconnect=False, connect_timeout=2, **options)


async def test_client_certificate_is_required(server):
    """The server ends the TLS session of a client without a certificate before the
    connection's first PONG; the client sees the socket fail (an SSLError, a reset or a
    broken pipe, by timing: all OSErrors)."""
    env = {"KVPUSH_NATS_USER": C, "KVPUSH_NATS_PASSWORD": PASSWORDS[C]} | tls_env(
        server.config.parent / "certs", client_cert=False)
    options = connect_options(env)
    with pytest.raises(OSError):
        await nats.connect(server.url, allow_reconnect=False, connect_timeout=2, **options)


async def test_restart_keeps_the_url_and_clients_reconnect(tmp_path, monkeypatch):
    server = start_secured(secured_config(tmp_path), monkeypatch)
    try:
        reconnected = asyncio.Event()

        async def on_reconnect():
            reconnected.set()

        conn = await connect_as(D, server, allow_reconnect=True, max_reconnect_attempts=-1,
                                reconnect_time_wait=0.05, reconnected_cb=on_reconnect)
        sub = await conn.nc.subscribe(wire.KV_AGENTS.wildcard)
        await conn.nc.flush(timeout=2)
        url, store = server.url, server._store

        await asyncio.to_thread(server.restart)
        assert (server.url, server._store) == (url, store) and Path(store).is_dir()

        await asyncio.wait_for(reconnected.wait(), 10)
        await conn.nc.publish(wire.KV_AGENTS(sender=D), b"after restart")
        assert (await sub.next_msg(timeout=2)).data == b"after restart"
        await conn.nc.close()
    finally:
        server.stop()
    assert server._store is None and not Path(store).exists()


# --------------------------------------------------------------------------- kvpush nats-config's defaults
# The config `kvpush nats-config` writes when told nothing but who its users are, started as
# written (no address or port given on the command line): TLS, the loopback address, and
# the users in an account whose JetStream limits the server enforces.

KVPUSH = Path(sys.executable).parent / "kvpush"


def kvpush_nats_config(folder: Path, *args: str) -> str:
    result = subprocess.run([str(KVPUSH), "nats-config", *args], cwd=folder, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout


def start_nats_server(config: Path, store: Path, log: Path) -> subprocess.Popen:
    """nats-server with ``config`` and nothing that overrides its address or port."""
    process = subprocess.Popen([server_binary(), "-c", str(config), "-js", "-sd", str(store)], cwd=config.parent,
                               stdout=subprocess.DEVNULL, stderr=open(log, "wb"))
    deadline = time.monotonic() + 15
    while "Server is ready" not in log.read_text(errors="replace"):
        assert process.poll() is None, f"nats-server exited: {log.read_text(errors='replace')[-800:]}"
        assert time.monotonic() < deadline, "nats-server did not start within 15 s"
        time.sleep(0.05)
    return process


class DefaultServer:
    def __init__(self, folder: Path, port: int, passwords: dict[str, str], config: str, log: Path):
        self.folder, self.port, self.passwords, self.config, self.log = folder, port, passwords, config, log
        self.url = f"nats://127.0.0.1:{port}"

    async def connect(self, name: str) -> nats.NATS:
        env = {"KVPUSH_NATS_USER": name, "KVPUSH_NATS_PASSWORD": self.passwords[name]} | tls_env(self.folder / "certs")
        service = None if name.startswith("client") else name
        return await nats.connect(self.url, allow_reconnect=False, connect_timeout=5,
                                  **connect_options(env, service=service))


@pytest.fixture(scope="module")
def default_server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("default-config")
    dev_certs.generate(folder / "certs")  # where the default --tls-dir (./certs) looks
    port = free_port()
    kvpush_nats_config(folder, "--passwords", "random", "--passwords-out", "passwords", "--port", str(port),
                       "--out", "nats-server.conf")
    passwords = dict(line.split("=", 1) for line in (folder / "passwords").read_text().split())
    process = start_nats_server(folder / "nats-server.conf", folder / "store", folder / "nats.log")
    try:
        yield DefaultServer(folder, port, passwords, (folder / "nats-server.conf").read_text(), folder / "nats.log")
    finally:
        terminate(process)


def test_the_default_config_listens_on_loopback_only_and_requires_tls(default_server):
    config = default_server.config
    assert re.search(r'^host: "127\.0\.0\.1"$', config, re.MULTILINE)
    certs = default_server.folder / "certs"
    for key, file in (("cert_file", "server.pem"), ("key_file", "server-key.pem"), ("ca_file", "ca.pem")):
        assert f'  {key}: "{certs / file}"' in config
    assert re.search(r"^tls \{[^}]*^  verify: true$", config, re.MULTILINE)
    log = default_server.log.read_text()
    assert f"Listening for client connections on 127.0.0.1:{default_server.port}" in log
    assert "TLS required for client connections" in log


async def test_the_default_config_refuses_plaintext_and_anonymous_logins(default_server):
    reader, writer = await asyncio.open_connection("127.0.0.1", default_server.port)
    try:
        info = await asyncio.wait_for(reader.readline(), 2)
        assert b'"tls_required":true' in info and b'"auth_required":true' in info
    finally:
        writer.close()
    options = connect_options(tls_env(default_server.folder / "certs"))  # TLS, but no user
    with pytest.raises(nats.errors.Error, match="(?i)authorization violation"):
        await nats.connect(default_server.url, allow_reconnect=False, connect_timeout=2, **options)


async def test_the_default_config_puts_every_user_in_an_account_with_the_default_jetstream_limits(default_server):
    assert "authorization {" not in default_server.config  # users there would be in $G, which takes no limits
    assert f"accounts {{\n  {permissions.ACCOUNT} {{\n" in default_server.config
    defaults = _default_limits(default_server)
    for name in default_server.passwords:  # every user logs in, and into kvpush's account
        nc = await default_server.connect(name)
        await nc.close()
    nc = await default_server.connect("scheduler-0")
    try:
        limits = (await nc.jetstream().account_info()).limits
    finally:
        await nc.close()
    assert (limits.max_memory, limits.max_storage, limits.max_streams, limits.max_consumers) == (
        0, _bytes(defaults.max_file), defaults.max_streams, defaults.max_consumers)


def _default_limits(server) -> "permissions.JetStreamLimits":
    """What ``kvpush nats-config`` sets by default for the server's identities."""
    return permissions.JetStreamLimits.for_identities(
        [permissions.Identity(name.rsplit("-", 1)[0], name) for name in server.passwords])


def _bytes(size: str) -> int:
    """A nats-server size (``2GiB``, ``1G``, ``0``) in bytes."""
    number, unit, binary = re.fullmatch(r"(\d+)([KMGT]?)(i?)B?", size).groups()
    return int(number) * (1024 if binary else 1000) ** " KMGT".index(unit or " ")


async def _refused(coro) -> str:
    with pytest.raises(nats.js.errors.APIError) as refused:
        await coro
    return refused.value.description or ""


@pytest.fixture
async def scheduler_js(default_server):
    """A scheduler's JetStream context (its user may use the JetStream API); every stream it
    made is deleted afterwards."""
    nc = await default_server.connect("scheduler-0")
    js = nc.jetstream(timeout=5)
    yield js
    for name in await js.streams_info():
        await js.delete_stream(name.config.name)
    await nc.close()


async def test_a_stream_past_max_streams_is_refused(default_server, scheduler_js):
    limit = _default_limits(default_server).max_streams
    for index in range(limit):
        await scheduler_js.add_stream(name=f"probe-{index}", subjects=[f"probe.{index}"])
    why = await _refused(scheduler_js.add_stream(name="one-too-many", subjects=["probe.more"]))
    assert "maximum number of streams reached" in why


async def test_a_memory_stream_is_refused(scheduler_js):
    why = await _refused(scheduler_js.add_stream(name="in-memory", subjects=["probe.memory"],
                                                 storage=nats.js.api.StorageType.MEMORY))
    assert "insufficient memory resources" in why


async def test_a_stream_reserving_more_disk_than_max_file_is_refused(default_server, scheduler_js):
    too_big = _bytes(_default_limits(default_server).max_file) + 1
    why = await _refused(scheduler_js.add_stream(name="too-big", subjects=["probe.big"], max_bytes=too_big))
    assert "insufficient storage resources" in why


async def test_a_consumer_past_max_consumers_on_one_stream_is_refused(default_server, scheduler_js):
    limit = _default_limits(default_server).max_consumers
    await scheduler_js.add_stream(name="watched", subjects=["probe.watched"])
    for index in range(limit):
        await scheduler_js.add_consumer("watched", durable_name=f"c{index}")
    why = await _refused(scheduler_js.add_consumer("watched", durable_name="one-too-many"))
    assert "maximum consumers limit reached" in why


async def test_kvpush_s_own_jetstream_state_fits_the_default_limits_at_three_replicas(tmp_path):
    """The buckets and the claims stream a scheduler makes (services/ledger.py), with
    --jetstream-replicas 3 as deploy/k8s runs them, on a three-server cluster whose account
    has the default limits: nats-server reserves each stream's max_bytes once per replica."""
    from kvpush.services.ledger import Ledger

    dev_certs.generate(tmp_path / "certs")
    tls = {"cert_file": str(tmp_path / "certs" / "server.pem"), "key_file": str(tmp_path / "certs" / "server-key.pem"),
           "ca_file": str(tmp_path / "certs" / "ca.pem")}
    identity = permissions.Identity("scheduler", "scheduler-0", permissions.new_password())
    ports = [(free_port(), free_port()) for _ in range(3)]
    routes = ", ".join(f'"nats://127.0.0.1:{route}"' for _, route in ports)
    processes = []
    try:
        for index, (port, route) in enumerate(ports):
            config = tmp_path / f"n{index}.conf"
            config.write_text(permissions.render_config(
                [identity], permissions.literal_password, tls=tls, port=port,
                extra=f'server_name: "n{index}"\ncluster {{ name: "c", listen: "127.0.0.1:{route}", routes: [{routes}] }}'))
            processes.append(start_nats_server(config, tmp_path / f"store{index}", tmp_path / f"n{index}.log"))
        env = {"KVPUSH_NATS_USER": identity.name, "KVPUSH_NATS_PASSWORD": identity.password} | tls_env(tmp_path / "certs")
        nc = await nats.connect(f"nats://127.0.0.1:{ports[0][0]}", allow_reconnect=False, connect_timeout=5,
                                **connect_options(env, service=identity.name))
        try:
            js = nc.jetstream(timeout=5)
            deadline = time.monotonic() + 30
            while True:  # until the cluster has a JetStream meta leader
                try:
                    await js.account_info()
                    break
                except (nats.errors.TimeoutError, nats.errors.NoRespondersError, nats.js.errors.APIError):
                    assert time.monotonic() < deadline, "the cluster elected no JetStream leader within 30 s"
                    await asyncio.sleep(0.5)
            await Ledger.open(nc, me=wire.Claimant.scheduler(identity.name, "i1"), replicas=3)
            streams = {info.config.name: info.config for info in await js.streams_info()}
        finally:
            await nc.close()
    finally:
        for process in processes:
            terminate(process)
    assert len(streams) == 3 and all(config.num_replicas == 3 for config in streams.values()), streams
