"""Decode's connector renews prefill's lease on a prompt's blocks from the moment the
engine receives the request until its KV arrived or it finished: one LeaseRenewal per
prefill engine every heartbeat, over a real NATS server and the connector's own bridge."""

from __future__ import annotations

import queue
import uuid
from types import SimpleNamespace

import pytest

from kvpush.connector.bridge import NatsBridge
from kvpush.connector.scheduler_side import ConnectorScheduler
from kvpush.shared import settings, wire

ARRIVES_WITHIN_S = 2.5 * settings.HEARTBEAT_INTERVAL_S  # a heartbeat, and room to spare


def _id(what: str) -> str:
    return f"{what}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def bridge(nats_server):
    bridge = NatsBridge(nats_server.url, name=_id("renewals-test"))
    bridge.start()
    yield bridge
    bridge.close()


@pytest.fixture
def scheduler(bridge) -> ConnectorScheduler:
    return ConnectorScheduler(_id("decode"), block_size=16, tp_size=1, bridge=bridge)


def _listen(bridge: NatsBridge, prefill_engine_id: str) -> queue.Queue:
    """The LeaseRenewals arriving on a prefill engine's registration subjects, each on the
    subject of the decode it names (``kvpush.kv.register.<prefill>.<decode>``: the prefill
    would refuse any other as forged)."""
    seen: queue.Queue = queue.Queue()

    def on_data(data: bytes, subject: str) -> None:
        message = wire.decode(data, wire.KvControl)
        if (isinstance(message, wire.LeaseRenewal)
                and subject == wire.registration_subject(prefill_engine_id, message.decode_engine_id)):
            seen.put(message)

    bridge.subscribe(wire.KV_CONTROL.partly(engine_id=prefill_engine_id), on_data)
    return seen


def _request(prefill_engine_id: str, **params) -> SimpleNamespace:
    request_id = _id("req")
    kv = wire.DecodeKvParams(transfer_id=_id("transfer"), request_id=request_id,
                             prefill_engine_id=prefill_engine_id, **params)
    return SimpleNamespace(request_id=request_id, prompt_token_ids=[1, 2, 3], num_prompt_tokens=3,
                           num_computed_tokens=0, kv_transfer_params=kv.as_params())


def _transfer(request: SimpleNamespace) -> str:
    return request.kv_transfer_params["transfer_id"]


def _next(renewals: queue.Queue) -> wire.LeaseRenewal:
    return renewals.get(timeout=ARRIVES_WITHIN_S)


def _renewals_until(renewals: queue.Queue, done) -> wire.LeaseRenewal:
    """The first renewal ``done(renewal)`` accepts; the one a tick already sent may come first."""
    for _ in range(3):
        renewal = _next(renewals)
        if done(renewal):
            return renewal
    raise AssertionError("renewals did not change within three heartbeats")


def test_a_new_request_is_renewed_with_its_prefill_engine_before_any_allocation(bridge, scheduler):
    prefill = _id("prefill")
    renewals = _listen(bridge, prefill)
    request = _request(prefill)
    scheduler.on_new_request(request)
    renewal = _next(renewals)
    assert renewal.transfer_ids == [_transfer(request)]
    assert renewal.decode_engine_id == scheduler.engine_id


def test_renewals_stop_once_the_kv_arrived(bridge, scheduler):
    prefill = _id("prefill")
    renewals = _listen(bridge, prefill)
    arrived, waiting = _request(prefill), _request(prefill, mode="pull", remote_block_ids=[0])
    scheduler.on_new_request(arrived)
    scheduler.on_new_request(waiting)
    both = _renewals_until(renewals, lambda r: len(r.transfer_ids) == 2)  # one renewal for the prefill engine
    assert sorted(both.transfer_ids) == sorted([_transfer(arrived), _transfer(waiting)])

    scheduler.update_connector_output(SimpleNamespace(finished_recving={arrived.request_id}, finished_sending=None))
    _renewals_until(renewals, lambda r: r.transfer_ids == [_transfer(waiting)])
    assert _next(renewals).transfer_ids == [_transfer(waiting)]


def test_renewals_stop_when_the_request_finishes(bridge, scheduler):
    prefill = _id("prefill")
    renewals = _listen(bridge, prefill)
    finished, waiting = _request(prefill), _request(prefill)
    scheduler.on_new_request(finished)
    scheduler.on_new_request(waiting)
    _renewals_until(renewals, lambda r: len(r.transfer_ids) == 2)

    assert scheduler.request_finished(finished, []) == (False, None)
    _renewals_until(renewals, lambda r: r.transfer_ids == [_transfer(waiting)])
    assert _next(renewals).transfer_ids == [_transfer(waiting)]


def test_a_request_whose_kv_does_not_come_from_prefill_is_not_renewed(bridge, scheduler):
    quiet, busy = _id("prefill"), _id("prefill")
    quiet_renewals, busy_renewals = _listen(bridge, quiet), _listen(bridge, busy)
    scheduler.on_new_request(_request(quiet, do_remote_prefill=False))
    scheduler.on_new_request(SimpleNamespace(request_id=_id("req"), prompt_token_ids=[1], num_prompt_tokens=1,
                                             kv_transfer_params=None))
    prefill_side = wire.PrefillKvParams(transfer_id=_id("transfer"), decode_engine_id=scheduler.engine_id)
    scheduler.on_new_request(SimpleNamespace(request_id=_id("req"), prompt_token_ids=[1], num_prompt_tokens=1,
                                             kv_transfer_params=prefill_side.as_params()))
    scheduler.on_new_request(_request(busy))  # the heartbeat goes on: two of its ticks pass below
    _next(busy_renewals)
    _next(busy_renewals)
    assert quiet_renewals.empty()


def test_renewals_stop_as_soon_as_decode_gives_the_wait_up(bridge, scheduler):
    """The worker side reports a given-up wait in its step's worker metadata, before the
    blocks come back (they stay quarantined): prefill's lease must run out even if every
    Revoke is lost."""
    from kvpush.connector.metadata import KvpushWorkerMeta

    prefill = _id("prefill")
    renewals = _listen(bridge, prefill)
    given_up, waiting = _request(prefill), _request(prefill)
    scheduler.on_new_request(given_up)
    scheduler.on_new_request(waiting)
    _renewals_until(renewals, lambda r: len(r.transfer_ids) == 2)

    scheduler.update_connector_output(SimpleNamespace(
        finished_recving=None, finished_sending=None, kv_connector_worker_meta=KvpushWorkerMeta({given_up.request_id})))
    _renewals_until(renewals, lambda r: r.transfer_ids == [_transfer(waiting)])
    assert _next(renewals).transfer_ids == [_transfer(waiting)]


def test_worker_metadata_of_several_ranks_is_merged():
    from kvpush.connector.metadata import KvpushWorkerMeta

    assert KvpushWorkerMeta({"a"}).aggregate(KvpushWorkerMeta({"b"})).given_up == {"a", "b"}


def test_renewals_for_many_transfers_are_split_to_stay_under_the_payload_limit(bridge, scheduler):
    from kvpush.connector.scheduler_side import RENEWAL_BATCH

    prefill = _id("prefill")
    renewals = _listen(bridge, prefill)
    requests = [_request(prefill) for _ in range(2 * RENEWAL_BATCH + 5)]
    for request in requests:
        scheduler.on_new_request(request)
    wanted = {_transfer(request) for request in requests}
    seen: set[str] = set()
    sizes = []
    while seen != wanted:  # one heartbeat's renewals; a tick under way may send a partial first round
        renewal = _next(renewals)
        sizes.append(len(renewal.transfer_ids))
        assert len(renewal.transfer_ids) <= RENEWAL_BATCH
        assert len(wire.encode(renewal)) < bridge._nc.max_payload
        seen |= set(renewal.transfer_ids)
    assert max(sizes) == RENEWAL_BATCH
