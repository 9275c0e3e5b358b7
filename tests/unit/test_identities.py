"""Who a message says it is from must be who its subject proves it is from; clients' replies
go only to their own inboxes; ids are single subject tokens. The server-side half (who may
publish where) is tested against a real nats-server in tests/nats/test_identities.py."""

from __future__ import annotations

import pytest

from kvpush.services.worker.service import worker_id_for
from kvpush.shared import permissions, wire

HEARTBEAT = wire.WorkerHeartbeat(worker_id="decode-0", role="decode", free_kv_blocks=1, total_kv_blocks=1,
                                 running=0, waiting=0, block_size=16, max_model_len=64)
REGISTRATION = wire.Registration(transfer_id="t", request_id="r", decode_engine_id="decode-0",
                                 decode_request_id="e", decode_tp_size=1, block_ids=[1], num_tokens=3,
                                 registered_at=0.0)
REVOKE = wire.Revoke(transfer_id="t", decode_engine_id="decode-0", reason="aborted")
RENEWAL = wire.LeaseRenewal(decode_engine_id="decode-0", transfer_ids=["t"])
PROGRESS = wire.RequestProgress(request_id="r", transfer_id="t", worker_id="decode-0", stage="ended")
HANDOFF = wire.Handoff(request_id="r", transfer_id="t", prefill_engine_id="prefill-0", first_token_id=1,
                       prefill_started_at=0.0, prefill_finished_at=1.0)
DONE = wire.TransferDone(transfer_id="t", prefill_engine_id="prefill-0", decode_engine_id="decode-0", rank=0,
                         order="prefill_first", waited_ms=0, bytes=1, descriptors=1, write_ms=1, finished_at=0)
FAILED = wire.TransferFailed(transfer_id="t", prefill_engine_id="prefill-0", decode_engine_id="decode-0", rank=0,
                             code="write_failed", reason="x")
CACHED = wire.CacheEvents(worker_id="decode-0", incarnation="i", stored=[b"k" * 16])
AGENT = wire.AgentInfo(engine_id="prefill-0", rank=0, agent_name="a", agent_metadata=b"", mem_type="DRAM",
                       device_id=0, num_blocks=1, regions=[])

# (message, the subject its true sender publishes it on, the subject a forger publishes it on)
CASES = [
    (HEARTBEAT, wire.HEARTBEATS(sender="decode-0"), wire.HEARTBEATS(sender="decode-1")),
    (REGISTRATION, wire.registration_subject("prefill-0", "decode-0"), wire.registration_subject("prefill-0", "decode-1")),
    (REVOKE, wire.registration_subject("prefill-0", "decode-0"), wire.registration_subject("prefill-0", "decode-1")),
    (RENEWAL, wire.registration_subject("prefill-0", "decode-0"), wire.registration_subject("prefill-0", "decode-1")),
    (PROGRESS, wire.PROGRESS(sender="decode-0"), wire.PROGRESS(sender="decode-1")),
    (HANDOFF, wire.HANDOFFS(sender="prefill-0"), wire.HANDOFFS(sender="prefill-1")),
    (DONE, wire.completion_subject("decode-0", "prefill-0"), wire.completion_subject("decode-0", "prefill-1")),
    (FAILED, wire.completion_subject("decode-0", "prefill-0"), wire.completion_subject("decode-0", "prefill-1")),
    (AGENT, wire.KV_AGENTS(sender="prefill-0"), wire.KV_AGENTS(sender="prefill-1")),
    (CACHED, wire.CACHE_EVENTS(sender="decode-0"), wire.CACHE_EVENTS(sender="decode-1")),
]


@pytest.mark.parametrize("message,true_subject,forged_subject", CASES, ids=lambda c: type(c).__name__)
def test_a_message_that_names_its_sender_is_refused_on_another_senders_subject(message, true_subject,
                                                                            forged_subject):
    assert wire.forged_sender(true_subject, message) is None
    problem = wire.forged_sender(forged_subject, message)
    assert problem is not None and forged_subject in problem


def test_every_subject_a_self_naming_message_travels_on_ends_in_its_sender():
    for template in (wire.HEARTBEATS, wire.PROGRESS, wire.HANDOFFS, wire.KV_CONTROL, wire.KV_COMPLETIONS,
                     wire.KV_AGENTS, wire.CACHE_EVENTS):
        assert template.endswith("{sender}"), template


def test_a_job_names_no_sender_and_is_never_refused_as_forged():
    job = wire.CancelJob(request_id="r", transfer_id="t", reason="x")
    assert wire.forged_sender("kvpush.decode.decode-0", job) is None


@pytest.mark.parametrize("subject,owner", [
    ("kvpush.generate", ""), ("kvpush.generate.app-1", "app-1"), ("kvpush.cancel.app-1", "app-1"),
    ("kvpush.cancel", ""),
])
def test_the_owner_of_a_request_is_the_client_its_subject_names(subject, owner):
    assert wire.owner_of(subject) == owner


@pytest.mark.parametrize("reply,owner,ok", [
    ("_INBOX.abc.1", "", True),
    ("_INBOX.app-1.abc.1", "app-1", True),
    ("_INBOX.app-2.abc.1", "app-1", False),  # another client's inbox
    ("kvpush.kv.register.prefill-0.decode-0", "", False),  # an internal subject
    ("_KVPUSH_INBOX.scheduler-0.x", "", False),  # a service's inbox
    ("_INBOX.>", "", False),
])
def test_a_client_reply_subject_must_be_its_own_inbox(reply, owner, ok):
    assert (wire.reply_problem(reply, owner) is None) is ok


@pytest.mark.parametrize("name,ok", [("prefill-0", True), ("decode_7", True), ("a.b", False), ("*", False),
                                     (">", False), ("", False), ("x y", False), ("x" * 65, False)])
def test_an_identity_is_one_safe_subject_token(name, ok):
    assert (wire.identity_problem(name) is None) is ok


def test_a_worker_id_is_its_nats_user_and_a_different_one_is_refused():
    assert worker_id_for("prefill", None, "prefill-3") == "prefill-3"
    assert worker_id_for("prefill", "prefill-3", "prefill-3") == "prefill-3"
    assert worker_id_for("decode", None, None).startswith("decode-")
    with pytest.raises(ValueError, match="differs from its NATS user"):
        worker_id_for("prefill", "prefill-4", "prefill-3")
    with pytest.raises(ValueError, match="not a valid id"):
        worker_id_for("prefill", "a.b", None)


def test_the_rendered_config_names_each_identity_once_with_only_its_own_subjects():
    identities = [permissions.Identity("prefill", "prefill-0"), permissions.Identity("decode", "decode-0"),
                  permissions.Identity("client", "app")]
    config = permissions.render_config(identities)
    assert config.count("user:") == 3
    assert "$NATS_PASSWORD_PREFILL_0" in config
    prefill = permissions.permissions("prefill", "prefill-0")
    assert prefill.subscribe[0] == "kvpush.prefill.prefill-0"  # its own jobs, not kvpush.prefill.*
    assert "kvpush.kv.register.prefill-0.*" in prefill.subscribe
    assert not any(s.startswith("_INBOX") for s in prefill.subscribe)
    with pytest.raises(ValueError, match="repeated: app"):
        permissions.render_config([*identities, permissions.Identity("client", "app")])
    with pytest.raises(ValueError, match="not a valid id"):
        permissions.Identity("decode", "decode.0")


def test_the_sample_config_in_deploy_is_the_one_kvpush_nats_config_writes():
    from pathlib import Path

    sample = Path(__file__).resolve().parents[2] / "deploy" / "nats-server.conf"
    assert sample.read_text() == permissions.sample_config(), "regenerate: kvpush nats-config --sample"
