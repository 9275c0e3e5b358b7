"""Hostile peers on a real stack (real NATS with one user per worker, scheduler and client,
real vLLM engines, real NIXL): authenticated identities that take no part in a request
(prefill-9, decode-9, client-9) forge every message kind they could try, racing the
victims' own. The victims' outputs must equal the single-instance reference, their KV must
be the one prefill pushed (not recomputed), nothing may leak, and every forgery must be
refused: by the NATS server (a permission violation) or by its receiver (an event on
``kvpush.invalid``, logged and counted in ``kvpush.failures``).

The forgers are given every transfer id and block id as it goes by (the rig reads them as
prefill-0): the worst case, since NATS keeps a worker's jobs and registrations private.
Schedulers are trusted to send jobs; a hostile scheduler identity is out of scope.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from kvpush.tools.reliability.fault_rig import FaultRig, running_rig, wait_until
from kvpush.client import generate_all
from kvpush.shared import wire
from tests import prompts

pytestmark = pytest.mark.timeout(900)

VICTIMS = [6, 4, 5, 1]  # indexes into prompts.CORRECTNESS (and the reference)


@pytest.fixture(scope="module")
async def rig(model_dir, tmp_path_factory):
    async with running_rig(tmp_path_factory.mktemp("hostile"), model_dir, prompts.MAX_MODEL_LEN) as rig:
        yield rig


class Forgers:
    """The hostile identities' connections, and what the server refused each."""

    def __init__(self, rig: FaultRig):
        self.rig = rig
        self.refused: dict[str, list[str]] = {name: [] for name in ("prefill-9", "decode-9", "client-9")}
        self.conns: dict = {}

    async def __aenter__(self) -> "Forgers":
        for name, errors in self.refused.items():
            self.conns[name] = await self.rig.connect(name, errors)
        return self

    async def __aexit__(self, *exc) -> None:
        for conn in self.conns.values():
            await conn.close()

    async def send(self, name: str, subject: str, message) -> None:
        data = message if isinstance(message, bytes) else wire.encode(message)
        await self.conns[name].publish(subject, data)

    def denied(self, name: str, subject: str) -> bool:
        return any(f'permissions violation for publish to "{subject}"'.lower() in e.lower()
                   for e in self.refused[name])


def _blocks(prompt: list[int]) -> list[int]:
    return list(range(-(-len(prompt) // prompts.BLOCK_SIZE)))  # the victim's lowest block ids


async def forge_on_job(forgers: Forgers, job: wire.PrefillJob) -> None:
    """Everything a hostile peer can send the moment it learns a transfer's id and decode."""
    tid, victim = job.transfer_id, job.decode_engine_id or "decode-0"
    prompt = job.prompt_token_ids
    as_victim = wire.Registration(transfer_id=tid, request_id=job.request_id, decode_engine_id=victim,
                                  decode_request_id="forged", decode_tp_size=1, block_ids=_blocks(prompt),
                                  num_tokens=len(prompt), registered_at=time.time(), transfer_key=uuid.uuid4().hex)
    honest = wire.Registration(**{**_fields(as_victim), "decode_engine_id": "decode-9"})
    beat = wire.WorkerHeartbeat(worker_id=victim, role="decode", free_kv_blocks=1, total_kv_blocks=1, running=0,
                                waiting=0, block_size=prompts.BLOCK_SIZE, max_model_len=prompts.MAX_MODEL_LEN,
                                incarnation=uuid.uuid4().hex)  # a "restart" would retry every flight on it
    ended = wire.RequestProgress(request_id=job.request_id, transfer_id=tid, worker_id="decode-9", stage="ended",
                                 outcome="client_gone")  # would cancel the request's jobs
    handoff = wire.Handoff(request_id=job.request_id, transfer_id=tid, prefill_engine_id="prefill-9",
                           first_token_id=None, prefill_started_at=0.0, prefill_finished_at=0.0,
                           error=wire.ErrorBody("engine_failed", "forged"))  # would end the request
    done = wire.TransferDone(transfer_id=tid, prefill_engine_id="prefill-9", decode_engine_id=victim, rank=0,
                             order="prefill_first", waited_ms=0, bytes=1, descriptors=1, write_ms=1, finished_at=0)
    agent = wire.AgentInfo(engine_id=victim, rank=0, agent_name="forged", agent_metadata=b"forged", mem_type="DRAM",
                           device_id=0, num_blocks=10**6, regions=[wire.KvRegion(0, 1, 1)])
    await asyncio.gather(
        # the impersonation of the issue: the victim's engine id, the victim's top blocks
        forgers.send("decode-9", wire.registration_subject("prefill-0", "decode-9"), as_victim),
        forgers.send("decode-9", wire.registration_subject("prefill-0", victim), as_victim),
        forgers.send("decode-9", wire.registration_subject("prefill-0", "decode-9"), honest),
        forgers.send("decode-9", wire.HEARTBEATS(sender="decode-9"), beat),
        forgers.send("decode-9", wire.HEARTBEATS(sender=victim), beat),
        forgers.send("decode-9", wire.PROGRESS(sender="decode-9"), ended),
        forgers.send("decode-9", wire.PROGRESS(sender=victim), ended),
        forgers.send("decode-9", wire.KV_AGENTS(sender="decode-9"), agent),
        forgers.send("prefill-9", wire.HANDOFFS(sender="prefill-9"), handoff),
        forgers.send("prefill-9", wire.HANDOFFS(sender="prefill-0"), handoff),
        forgers.send("prefill-9", wire.completion_subject(victim, "prefill-9"), done),
        forgers.send("client-9", wire.OWNED_CANCEL(client="client-9"),
                     wire.encode_json(wire.CancelRequest(job.request_id))),
        forgers.send("client-9", wire.OWNED_CANCEL(client="client-0"),
                     wire.encode_json(wire.CancelRequest(job.request_id))),
    )


async def forge_on_registration(forgers: Forgers, registration: wire.Registration) -> None:
    """What a hostile peer sends once the victim's blocks are registered (its KV on the way)."""
    tid, victim = registration.transfer_id, registration.decode_engine_id
    revoke = wire.Revoke(transfer_id=tid, decode_engine_id="decode-9", reason="forged")
    revoke_as_victim = wire.Revoke(transfer_id=tid, decode_engine_id=victim, reason="forged")
    failed = wire.TransferFailed(transfer_id=tid, prefill_engine_id="prefill-9", decode_engine_id=victim, rank=0,
                                 code="write_failed", reason="forged")  # would free blocks a write is landing in
    failed_as_prefill = wire.TransferFailed(**{**_fields(failed), "prefill_engine_id": "prefill-0"})
    await asyncio.gather(
        forgers.send("decode-9", wire.registration_subject("prefill-0", "decode-9"), revoke),
        forgers.send("decode-9", wire.registration_subject("prefill-0", "decode-9"), revoke_as_victim),
        forgers.send("prefill-9", wire.completion_subject(victim, "prefill-9"), failed),
        forgers.send("prefill-9", wire.completion_subject(victim, "prefill-9"), failed_as_prefill),
        forgers.send("prefill-9", wire.completion_subject(victim, "prefill-0"), failed_as_prefill),
    )


def _fields(message) -> dict:
    return {name: getattr(message, name) for name in message.__struct_fields__}


async def test_every_forgery_by_every_hostile_role_leaves_the_victims_outputs_right(rig, reference):
    rig.invalid.clear()
    jobs: list[wire.PrefillJob] = []
    registrations: list[wire.Registration] = []
    forged: list[asyncio.Task] = []
    async with Forgers(rig) as forgers:
        async def on_job(msg):
            job = wire.decode(msg.data, wire.PrefillMessage)
            if isinstance(job, wire.PrefillJob):
                jobs.append(job)
                forged.append(asyncio.create_task(forge_on_job(forgers, job)))

        async def on_registration(msg):
            message = wire.decode(msg.data, wire.KvControl)
            if isinstance(message, wire.Registration) and message.decode_engine_id == "decode-0":
                if not any(r.transfer_id == message.transfer_id for r in registrations):
                    registrations.append(message)
                    forged.append(asyncio.create_task(forge_on_registration(forgers, message)))

        watch = rig.conns["prefill"]  # logged in as prefill-0: it sees prefill-0's jobs and registrations
        subs = [await watch.subscribe(wire.prefill_job_subject("prefill-0"), cb=on_job),
                await watch.subscribe(wire.KV_CONTROL.partly(engine_id="prefill-0"), cb=on_registration)]
        await watch.flush()
        try:
            outcomes = await asyncio.gather(*(rig.request(_body(i)) for i in VICTIMS))
            await asyncio.gather(*forged)
            for conn in forgers.conns.values():
                await conn.flush()
        finally:
            for sub in subs:
                await sub.unsubscribe()

        # a hostile client: others' streams are out of reach, and output cannot be pointed
        # at another client's inbox or at an internal subject
        client = forgers.conns["client-9"]
        await client.subscribe("_INBOX.>")
        await client.flush()
        for reply in ("_INBOX.client-0.stolen", wire.registration_subject("prefill-0", "decode-0")):
            await client.publish(wire.OWNED_GENERATE(client="client-9"), b'{"prompt": "x", "max_tokens": 2}',
                                 reply=reply)
        await client.flush()

        for index, outcome in zip(VICTIMS, outcomes):
            assert isinstance(outcome.final, wire.FinalReply), outcome.final
            assert outcome.tokens == reference[index]  # 0 wrong outputs
            await rig.assert_pushed(outcome)  # the KV prefill pushed, not recomputed after a forged failure
        for outcome in outcomes:  # one attempt each: no forged heartbeat or progress made it retry
            attempts = {j.transfer_id for j in jobs if j.request_id == outcome.request_id}
            assert len(attempts) == 1, attempts

        await wait_until(lambda: forgers.refused["client-9"], 10, "the client's subscription refused")
        for name, subject in [
            ("decode-9", wire.registration_subject("prefill-0", "decode-0")),
            ("decode-9", wire.HEARTBEATS(sender="decode-0")),
            ("decode-9", wire.PROGRESS(sender="decode-0")),
            ("prefill-9", wire.HANDOFFS(sender="prefill-0")),
            ("prefill-9", wire.completion_subject("decode-0", "prefill-0")),
            ("client-9", wire.OWNED_CANCEL(client="client-0")),
        ]:
            await wait_until(lambda: forgers.denied(name, subject), 10, f"the server refusing {name} on {subject}")
        assert any("subscription to \"_inbox.>\"" in e.lower() for e in forgers.refused["client-9"])

    def refusals(service: str, code: str, subject_start: str) -> int:
        services = rig.SCHEDULER_PROCESSES if service == "a scheduler" else {service}
        return sum(1 for e in rig.invalid if e.service in services and e.code == code
                   and e.subject.startswith(subject_start))

    expected = [
        ("prefill-0", "forged_sender", "kvpush.kv.register.prefill-0.decode-9", "a registration as decode-0"),
        ("prefill-0", "forged_sender", "kvpush.kv.agents.decode-9", "an agent announced as decode-0"),
        ("decode-0", "forged_sender", "kvpush.kv.agents.decode-9", "an agent announced as decode-0"),
        ("prefill-0", "wrong_party", "kvpush.kv.register.prefill-0", "a Revoke without the key"),
        ("decode-0", "wrong_party", "kvpush.kv.completion.decode-0", "a TransferFailed from prefill-9"),
        ("decode-0", "forged_sender", "kvpush.kv.completion.decode-0.prefill-9", "a TransferFailed as prefill-0"),
        ("scheduler-0", "forged_sender", "kvpush.worker.heartbeat.decode-9", "a heartbeat as decode-0"),
        ("a scheduler", "wrong_party", "kvpush.request.progress.decode-9", "progress from decode-9"),
        ("a scheduler", "wrong_party", "kvpush.handoff.prefill-9", "a Handoff from prefill-9"),
        ("a scheduler", "wrong_party", "kvpush.kv.completion.decode-0.prefill-9", "a TransferDone from prefill-9"),
        # client-9's cancel naming client-0's request id is no refusal: request ids are keyed
        # per client, so it names client-9's own (unknown) request and cannot reach client-0's
        # flight; the victims' outputs above show it did not
        # a request goes to one scheduler of the queue group; a flight's events are acted on
        # (and refused) by the scheduler holding it
        ("a scheduler", "invalid_reply", "kvpush.generate.client-9", "a reply into another inbox"),
    ]
    for service, code, subject, what in expected:
        await wait_until(lambda: refusals(service, code, subject) > 0, 15, f"{service} refusing {what} ({code})")
    await rig.assert_blocks_back()
    rig.assert_nothing_else_died()
    served = await rig.request(_body(0))
    assert served.tokens == reference[0]


async def test_pull_blocks_are_not_freed_by_a_revoke_without_the_transfers_key(rig, reference):
    """Pull: prefill holds the prompt's blocks for decode's READ, and does not know which
    decode that is. A Revoke from another decode must not free them under the READ."""
    rig.invalid.clear()
    async with Forgers(rig) as forgers:
        async def on_handoff(msg):
            handoff = wire.decode(msg.data, wire.Handoff)
            revoke = wire.Revoke(transfer_id=handoff.transfer_id, decode_engine_id="decode-9", reason="forged",
                                 transfer_key=uuid.uuid4().hex)
            await forgers.send("decode-9", wire.registration_subject("prefill-0", "decode-9"), revoke)

        sub = await rig.conns["scheduler"].subscribe(wire.HANDOFFS(sender="prefill-0"), cb=on_handoff)
        await rig.conns["scheduler"].flush()
        try:
            outcomes = await asyncio.gather(*(rig.request(_body(i, transfer_mode="pull")) for i in VICTIMS[:2]))
        finally:
            await sub.unsubscribe()
    for index, outcome in zip(VICTIMS, outcomes):
        assert isinstance(outcome.final, wire.FinalReply), outcome.final
        assert outcome.tokens == reference[index]
    await wait_until(lambda: sum(1 for e in rig.invalid if e.service == "prefill-0" and e.code == "wrong_party")
                     > 0, 15, "prefill refusing the keyless Revoke")
    await rig.assert_blocks_back()


async def test_a_client_can_read_and_cancel_only_its_own_requests(rig, reference):
    """client-0's request runs to the end although client-9 cancels it; client-0's own
    cancel ends its next one."""
    async with Forgers(rig) as forgers:
        stream = {**_body(4), "max_tokens": 200, "ignore_eos": True, "request_id": f"mine-{uuid.uuid4().hex[:6]}"}
        task = asyncio.create_task(generate_all(rig.conns["client"], stream, timeout=120))
        await wait_until(lambda: stream["request_id"] in rig.streaming_on, 60, "the request streaming")
        await forgers.send("client-9", wire.OWNED_CANCEL(client="client-9"),
                           wire.encode_json(wire.CancelRequest(stream["request_id"])))
        tokens, _, final = await task
        assert isinstance(final, wire.FinalReply) and len(tokens) == 200
    await rig.assert_blocks_back()


def _body(index: int, **extra) -> dict:
    _, prompt, max_tokens = prompts.CORRECTNESS[index]
    return {"prompt_token_ids": prompt, "max_tokens": max_tokens, **extra}
