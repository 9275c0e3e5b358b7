"""NATS authentication and TLS enforced by a real nats-server running the sample
deploy/nats-server.conf with the dev certificates: each role reaches the subjects it needs
and nothing else. The option parsing itself is tested in tests/unit/test_nats_options.py."""

from __future__ import annotations

import asyncio
import shutil
import ssl
from pathlib import Path

import nats
import nats.errors
import pytest

from tools import dev_certs
from services.launch.natsd import LocalNatsServer
from shared.nats_security import connect_options

ROOT = Path(__file__).resolve().parents[2]
SAMPLE_CONFIG = ROOT / "deploy" / "nats-server.conf"
PASSWORDS = {"scheduler": "sched-pw", "prefill": "prefill-pw", "decode": "decode-pw", "client": "client-pw"}
ROLES = tuple(PASSWORDS)


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
    for role, password in PASSWORDS.items():
        monkeypatch.setenv(f"NATS_{role.upper()}_PASSWORD", password)
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
    """A connection as one role, with the asynchronous errors the server sent it."""

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
    conn.nc = await nats.connect(server.url, name=role, error_cb=conn.on_error,
                                 **options, **connect_options(role_env(role, certs)))
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


ALLOWED_FLOWS = [
    # publisher, subject, [(subscriber, subscription, queue group)]
    ("client", "kvpush.generate", [("scheduler", "kvpush.generate", "kvpush-schedulers")]),
    ("client", "kvpush.cancel", [("scheduler", "kvpush.cancel", "")]),
    ("scheduler", "kvpush.prefill.w1", [("prefill", "kvpush.prefill.*", "")]),
    ("scheduler", "kvpush.decode.w2", [("decode", "kvpush.decode.*", "")]),
    ("scheduler", "_INBOX.c1.error", [("client", "_INBOX.>", "")]),
    ("prefill", "kvpush.worker.heartbeat", [("scheduler", "kvpush.worker.heartbeat", "")]),
    ("decode", "kvpush.worker.heartbeat", [("scheduler", "kvpush.worker.heartbeat", "")]),
    ("prefill", "kvpush.handoff", [("scheduler", "kvpush.handoff", "")]),
    ("prefill", "kvpush.kv.completion.d1",
     [("scheduler", "kvpush.kv.completion.*", ""), ("decode", "kvpush.kv.completion.*", "")]),
    ("prefill", "kvpush.kv.agents", [("decode", "kvpush.kv.agents", "")]),
    ("decode", "kvpush.kv.agents", [("prefill", "kvpush.kv.agents", "")]),
    ("prefill", "kvpush.kv.agent.p1.0", [("decode", "kvpush.kv.agent.*.*", "")]),
    ("decode", "kvpush.kv.agent.d1.0", [("prefill", "kvpush.kv.agent.*.*", "")]),
    ("decode", "kvpush.kv.register.p1", [("prefill", "kvpush.kv.register.*", "")]),
    ("decode", "kvpush.request.progress", [("scheduler", "kvpush.request.progress", "")]),
    ("decode", "_INBOX.c1.tokens", [("client", "_INBOX.>", "")]),
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
    ("client", "kvpush.scheduler.status", "scheduler", "kvpush.scheduler.status"),
    ("scheduler", "kvpush.prefill.w1", "prefill", "kvpush.prefill.*"),
    ("scheduler", "kvpush.decode.w2", "decode", "kvpush.decode.*"),
    ("decode", "kvpush.kv.agent.p1.0", "prefill", "kvpush.kv.agent.*.*"),
    ("prefill", "kvpush.kv.agent.d1.0", "decode", "kvpush.kv.agent.*.*"),
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


@pytest.mark.parametrize("role", ["scheduler", "prefill", "decode"])
async def test_services_may_report_invalid_messages(roles, role):
    await roles[role].nc.publish("kvpush.invalid", b"{}")
    await settle(roles)
    assert roles[role].errors == []


FORBIDDEN_PUBLISH = [
    # publisher, subject, a role that would otherwise receive it and its subscription
    ("client", "kvpush.kv.register.x", "prefill", "kvpush.kv.register.*"),
    ("client", "kvpush.prefill.w1", "prefill", "kvpush.prefill.*"),
    ("client", "kvpush.worker.heartbeat", "scheduler", "kvpush.worker.heartbeat"),
    ("client", "kvpush.kv.completion.d1", "decode", "kvpush.kv.completion.*"),
    ("prefill", "kvpush.decode.w2", "decode", "kvpush.decode.*"),
    ("prefill", "kvpush.kv.register.p1", "prefill", "kvpush.kv.register.*"),
    ("decode", "kvpush.prefill.w1", "prefill", "kvpush.prefill.*"),
    ("decode", "kvpush.handoff", "scheduler", "kvpush.handoff"),
    ("decode", "kvpush.kv.completion.d1", "scheduler", "kvpush.kv.completion.*"),
    ("scheduler", "kvpush.kv.register.p1", "prefill", "kvpush.kv.register.*"),
    ("scheduler", "kvpush.kv.agents", "decode", "kvpush.kv.agents"),
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
    ("decode", "kvpush.generate", ""),
    ("prefill", "kvpush.generate", "kvpush-schedulers"),
    ("client", "kvpush.generate", ""),
    ("client", "kvpush.decode.*", ""),
    ("client", "kvpush.kv.agents", ""),
    ("prefill", "kvpush.decode.*", ""),
    ("decode", "kvpush.prefill.*", ""),
    ("decode", "kvpush.kv.register.*", ""),
    ("scheduler", "kvpush.kv.register.*", ""),
    ("scheduler", "kvpush.generate", ""),
    ("scheduler", "kvpush.generate", "another-group"),
    ("decode", ">", ""),
]


@pytest.mark.parametrize("role,subject,queue", FORBIDDEN_SUBSCRIBE)
async def test_forbidden_subscribe_is_a_permissions_violation(roles, role, subject, queue):
    await roles[role].nc.subscribe(subject, queue=queue)
    await settle(roles)
    expected = f'nats: permissions violation for subscription to "{subject}"'
    if queue:
        expected += f' using queue "{queue}"'
    assert roles[role].violations() == [expected]


async def test_wrong_password_is_refused(server):
    env = role_env("client", server.config.parent / "certs", password="wrong")
    options = connect_options(env)
    with pytest.raises(nats.errors.Error, match="(?i)authorization violation"):
        await nats.connect(server.url, allow_reconnect=False, connect_timeout=2, **options)


async def test_a_role_cannot_log_in_with_another_roles_password(server):
    env = role_env("scheduler", server.config.parent / "certs", password=PASSWORDS["client"])
    options = connect_options(env)
    with pytest.raises(nats.errors.Error, match="(?i)authorization violation"):
        await nats.connect(server.url, allow_reconnect=False, connect_timeout=2, **options)


async def test_plaintext_is_refused(server):
    """The server announces TLS as required and drops a client that talks in the clear."""
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    try:
        info = await asyncio.wait_for(reader.readline(), 2)
        assert info.startswith(b"INFO ") and b'"tls_required":true' in info
        writer.write(b'CONNECT {"user":"client","pass":"client-pw","verbose":false}\r\nPING\r\n')
        await writer.drain()
        rest = await asyncio.wait_for(reader.read(), 5)
        assert b"PONG" not in rest
    finally:
        writer.close()


async def test_untrusted_server_certificate_is_refused(server):
    """Without the CA, the client's default trust store rejects the dev server certificate."""
    env = {"KVPUSH_NATS_USER": "client", "KVPUSH_NATS_PASSWORD": PASSWORDS["client"]}
    options = connect_options(env)
    with pytest.raises(ssl.SSLCertVerificationError):
        await nats.connect(server.url, allow_reconnect=False, connect_timeout=2, **options)


async def test_client_certificate_is_required(server):
    """The server ends the TLS session of a client without a certificate before the
    connection's first PONG; the client sees the socket fail (an SSLError, a reset or a
    broken pipe, by timing: all OSErrors)."""
    env = {"KVPUSH_NATS_USER": "client", "KVPUSH_NATS_PASSWORD": PASSWORDS["client"]} | tls_env(
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

        conn = await connect_as("decode", server, allow_reconnect=True, max_reconnect_attempts=-1,
                                reconnect_time_wait=0.05, reconnected_cb=on_reconnect)
        sub = await conn.nc.subscribe("kvpush.kv.agents")
        await conn.nc.flush(timeout=2)
        url, store = server.url, server._store

        await asyncio.to_thread(server.restart)
        assert (server.url, server._store) == (url, store) and Path(store).is_dir()

        await asyncio.wait_for(reconnected.wait(), 10)
        await conn.nc.publish("kvpush.kv.agents", b"after restart")
        assert (await sub.next_msg(timeout=2)).data == b"after restart"
        await conn.nc.close()
    finally:
        server.stop()
    assert server._store is None and not Path(store).exists()
