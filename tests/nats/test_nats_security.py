"""NATS authentication and TLS enforced by a real nats-server running the sample
deploy/nats-server.conf with the dev certificates: one user per worker, scheduler and
client, and each identity reaches the subjects it needs and nothing else. The option
parsing itself is tested in tests/unit/test_nats_options.py; per-identity rules between
peers of one role (another decode's jobs) in tests/nats/test_identities.py."""

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
from shared import permissions, wire
from shared.nats_security import connect_options

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


# The subjects each identity uses (shared/wire.py).
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
    (C, wire.SCHEDULER_STATUS_SUBJECT, S, wire.SCHEDULER_STATUS_SUBJECT),
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
    (S, wire.GENERATE_SUBJECT, ""),
    (S, wire.GENERATE_SUBJECT, "another-group"),
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
