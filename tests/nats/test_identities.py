"""A real nats-server running the config ``kvpush nats-config`` writes (kvpush.shared.permissions):
each worker, scheduler and client may publish and subscribe only on its own subjects, so
the sender token of every subject (``wire.forged_sender``) is one that only that sender
can publish, and no peer can read another's jobs, inbox or agent requests."""

from __future__ import annotations

import asyncio
import signal

import nats
import pytest

from kvpush.services.launch.natsd import LocalNatsServer
from kvpush.shared import wire
from kvpush.shared.nats_security import connect_options
from kvpush.shared.permissions import Identity, literal_password, render_config

IDENTITIES = [
    Identity("scheduler", "scheduler-0", "pw-s0"),
    Identity("prefill", "prefill-0", "pw-p0"),
    Identity("prefill", "prefill-9", "pw-p9"),
    Identity("decode", "decode-0", "pw-d0"),
    Identity("decode", "decode-9", "pw-d9"),
    Identity("client", "client-0", "pw-c0"),
    Identity("client", "client-9", "pw-c9"),
]
PASSWORDS = {identity.name: identity.password for identity in IDENTITIES}
REGISTER_AS_VICTIM = wire.registration_subject("prefill-0", "decode-0")

# (sender, subject, who may read it, may the sender publish there)
PUBLISH = [
    ("decode-0", REGISTER_AS_VICTIM, "prefill-0", True),
    ("decode-9", REGISTER_AS_VICTIM, "prefill-0", False),  # impersonation: a registration under the victim's name
    ("decode-9", wire.registration_subject("prefill-0", "decode-9"), "prefill-0", True),  # its own name only
    ("decode-9", wire.HEARTBEATS(sender="decode-0"), "scheduler-0", False),
    ("decode-9", wire.PROGRESS(sender="decode-0"), "scheduler-0", False),
    ("decode-9", wire.CACHE_EVENTS(sender="decode-0"), "scheduler-0", False),  # steer routing as the victim
    ("prefill-9", wire.CACHE_EVENTS(sender="prefill-0"), "scheduler-0", False),
    ("prefill-0", wire.CACHE_EVENTS(sender="prefill-0"), "scheduler-0", True),
    ("decode-9", wire.KV_AGENTS(sender="decode-0"), "prefill-0", False),
    ("decode-9", wire.decode_job_subject("decode-0"), "decode-0", False),  # jobs come from schedulers only
    ("decode-9", wire.completion_subject("decode-0", "prefill-0"), "decode-0", False),
    ("prefill-9", wire.completion_subject("decode-0", "prefill-0"), "decode-0", False),  # a TransferFailed as prefill-0
    ("prefill-9", wire.completion_subject("decode-0", "prefill-9"), "decode-0", True),
    ("prefill-9", wire.HANDOFFS(sender="prefill-0"), "scheduler-0", False),
    ("prefill-9", wire.prefill_job_subject("prefill-0"), "prefill-0", False),
    ("prefill-0", wire.HANDOFFS(sender="prefill-0"), "scheduler-0", True),
    ("client-9", wire.OWNED_CANCEL(client="client-0"), "scheduler-0", False),  # cancel another's requests
    ("client-9", wire.OWNED_GENERATE(client="client-0"), "scheduler-0", False),
    ("client-9", wire.CANCEL_SUBJECT, "scheduler-0", False),  # named clients use their own subjects
    ("client-9", wire.OWNED_CANCEL(client="client-9"), "scheduler-0", True),
    ("client-9", wire.prefill_job_subject("prefill-0"), "prefill-0", False),
    ("client-0", wire.OWNED_STATUS(client="client-0"), "scheduler-0", True),
    ("client-0", wire.SCHEDULER_STATUS_SUBJECT, "scheduler-0", False),  # status only on its own subject...
    ("client-9", wire.OWNED_STATUS(client="client-0"), "scheduler-0", False),  # ...so replies go to its own inbox
    ("scheduler-0", wire.INTAKE(sender="scheduler-0"), "scheduler-0", True),
    ("scheduler-0", wire.INTAKE(sender="scheduler-1"), "scheduler-0", False),  # settling another's requests
    ("scheduler-0", wire.prefill_job_subject("prefill-0"), "prefill-0", True),
    ("scheduler-0", wire.registration_subject("prefill-0", "decode-0"), "prefill-0", False),
    ("scheduler-0", wire.LEND_JOBS(worker_id="decode-0"), "decode-0", True),  # a lend of a cached prefix...
    ("prefill-9", wire.LEND_JOBS(worker_id="decode-0"), "decode-0", False),  # ...only from a scheduler
    ("decode-9", wire.LEND_JOBS(worker_id="prefill-0"), "prefill-0", False),
    ("prefill-0", wire.registration_subject("decode-0", "prefill-0"), "decode-0", True),  # renew a lent prefix
    ("prefill-9", wire.registration_subject("decode-0", "prefill-0"), "decode-0", False),  # ...as another reader
]

# (identity, subscription, may it subscribe)
SUBSCRIBE = [
    ("decode-0", wire.decode_job_subject("decode-0"), True),
    ("decode-9", wire.decode_job_subject("decode-0"), False),  # another decode's jobs
    ("decode-9", wire.DECODE_JOBS.wildcard, False),
    ("decode-9", wire.KV_AGENT.partly(engine_id="decode-0"), False),  # answering as the victim's agent
    ("decode-9", wire.KV_COMPLETIONS.partly(engine_id="decode-0"), False),
    ("prefill-9", wire.KV_CONTROL.partly(engine_id="prefill-0"), False),  # another prefill's registrations
    ("prefill-9", wire.prefill_job_subject("prefill-0"), False),
    ("prefill-0", wire.KV_CONTROL.partly(engine_id="prefill-0"), True),
    ("client-9", "_INBOX.>", False),  # every stream
    ("client-9", "_INBOX.client-0.>", False),
    ("client-9", "_INBOX.client-9.x", True),
    ("client-9", "_KVPUSH_INBOX.>", False),  # job acks, agent metadata
    ("decode-9", "_KVPUSH_INBOX.prefill-0.>", False),
    ("decode-9", "_INBOX.client-0.>", False),
    ("scheduler-0", wire.HEARTBEATS.wildcard, True),
    ("decode-0", wire.LEND_JOBS(worker_id="decode-0"), True),
    ("decode-9", wire.LEND_JOBS(worker_id="decode-0"), False),  # another engine's lends
    ("prefill-9", wire.LEND_JOBS.wildcard, False),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    config = tmp_path_factory.mktemp("identities") / "nats-server.conf"
    config.write_text(render_config(IDENTITIES, literal_password))
    with LocalNatsServer(config=config) as server:
        yield server


async def connect(server: LocalNatsServer, name: str, errors: list | None = None):
    async def on_error(exc):
        if errors is not None:
            errors.append(str(exc))

    env = {"KVPUSH_NATS_USER": name, "KVPUSH_NATS_PASSWORD": PASSWORDS[name]}
    service = None if name.startswith("client") else name
    return await nats.connect(server.url, error_cb=on_error, max_reconnect_attempts=0,
                              **connect_options(env, service=service))


async def _violations(errors: list, kind: str, subject: str, timeout: float = 2.0) -> bool:
    wanted = f'permissions violation for {kind} to "{subject}"'
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        if any(wanted.lower() in error.lower() for error in errors):
            return True
        await asyncio.sleep(0.02)
    return False


@pytest.mark.parametrize("name,subject,reader_name,allowed", PUBLISH, ids=lambda v: str(v))
async def test_each_identity_may_publish_only_on_its_own_subjects(server, name, subject, reader_name, allowed):
    errors: list = []
    sender = await connect(server, name, errors)
    reader = await connect(server, reader_name)
    try:
        received: list = []

        async def on_msg(msg):
            received.append(msg)

        await reader.subscribe(subject, cb=on_msg)
        await reader.flush()
        await sender.publish(subject, b"probe")
        await sender.flush()
        for _ in range(40 if allowed else 0):
            # nats-py's flush is no barrier for the reader's SUB: publish again until it lands
            if received:
                break
            await asyncio.sleep(0.05)
            await sender.publish(subject, b"probe")
        denied = await _violations(errors, "publish", subject, timeout=0.1 if allowed else 2.0)
        await reader.flush()  # a refused publish is dropped before the server says so: nothing can follow
    finally:
        await sender.close()
        await reader.close()
    assert denied is not allowed, errors
    assert bool(received) is allowed  # a refused publish reaches nobody


@pytest.mark.parametrize("name,subject,allowed", SUBSCRIBE, ids=lambda v: str(v))
async def test_each_identity_may_subscribe_only_to_its_own_subjects(server, name, subject, allowed):
    errors: list = []
    conn = await connect(server, name, errors)
    try:
        await conn.subscribe(subject)
        await conn.flush()
        denied = await _violations(errors, "subscription", subject, timeout=0.5 if allowed else 2.0)
    finally:
        await conn.close()
    assert denied is not allowed, errors


async def test_only_the_agent_asked_can_answer_an_agent_request(server):
    """decode-9 cannot subscribe to decode-0's agent subject, so the reply prefill-0 gets
    is decode-0's own; and prefill-0's inbox is its own, out of decode-9's reach."""
    victim = await connect(server, "decode-0")
    asker = await connect(server, "prefill-0")
    try:
        async def answer(msg):
            await victim.publish(msg.reply, b"decode-0")

        await victim.subscribe(wire.agent_subject("decode-0", 0), cb=answer)
        await victim.flush()
        reply = None
        for _ in range(40):
            # as above, the victim's flush is no barrier for its SUB: ask again until it has landed
            try:
                reply = await asker.request(wire.agent_subject("decode-0", 0), b"", timeout=2)
                break
            except nats.errors.NoRespondersError:
                await asyncio.sleep(0.05)
        assert reply is not None, "decode-0's agent subscription never reached the server"
        assert reply.data == b"decode-0"
        assert reply.subject.startswith("_KVPUSH_INBOX.prefill-0.")
    finally:
        await victim.close()
        await asker.close()


async def test_a_worker_added_by_a_config_reload_can_log_in_and_nobody_is_disconnected(tmp_path):
    config = tmp_path / "nats-server.conf"
    config.write_text(render_config(IDENTITIES[:2], literal_password))
    with LocalNatsServer(config=config) as server:
        present = await connect(server, "prefill-0")
        with pytest.raises(Exception):  # not a user yet: nats-py raises its authorization error
            await asyncio.wait_for(connect(server, "decode-0"), 5)
        config.write_text(render_config(IDENTITIES[:4], literal_password))
        server.process.send_signal(signal.SIGHUP)  # nats-server --signal reload
        newcomer = None
        for _ in range(50):
            try:
                newcomer = await asyncio.wait_for(connect(server, "decode-0"), 5)
                break
            except Exception:
                await asyncio.sleep(0.1)
        assert newcomer is not None, "decode-0 could not log in after the reload"
        assert present.is_connected
        got = asyncio.get_running_loop().create_future()
        async def on_job(msg):
            got.set_result(msg.data)

        sub = await newcomer.subscribe(wire.decode_job_subject("decode-0"), cb=on_job)
        await newcomer.flush()
        scheduler = await connect(server, "scheduler-0")
        await scheduler.publish(wire.decode_job_subject("decode-0"), b"job")
        await scheduler.flush()  # the server has it; delivery is the newcomer's read loop, on a loaded machine
        assert await asyncio.wait_for(got, 10) == b"job"
        await sub.unsubscribe()
        for conn in (present, newcomer, scheduler):
            await conn.close()


async def test_random_passwords_given_through_the_environment_all_start_the_server(tmp_path, monkeypatch):
    """nats-server parses a ``$VARIABLE``'s value as a config token: a password that began
    with a digit or ``-`` could read as a broken number and stop the server. Sixty fresh
    ones at once (about one bad in fifty before ``new_password`` began with a letter)."""
    from kvpush.shared.permissions import env_password, new_password, password_variable

    identities = [Identity("client", f"client-{i}", new_password()) for i in range(60)]
    for identity in identities:
        monkeypatch.setenv(password_variable(identity.name), identity.password)
    config = tmp_path / "nats-server.conf"
    config.write_text(render_config(identities, env_password))
    with LocalNatsServer(config=config) as server:
        last = identities[-1]
        nc = await nats.connect(server.url, user=last.name, password=last.password, max_reconnect_attempts=0)
        assert nc.is_connected
        await nc.close()
