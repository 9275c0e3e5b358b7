"""The wake a worker sends its engine's connector when it hands the engine a request
(connector/engine_wake.py, services/worker/engine.py), over a real datagram socket."""

from __future__ import annotations

import os
import threading
import uuid

import pytest

from kvpush.connector.engine_wake import WOKEN_FOR_S, WOKEN_WAIT_S, WakeClock, WakeListener
from kvpush.services.worker.kinds import wake_engine
from kvpush.services.worker.engine_settings import EngineSettings
from kvpush.shared import wire


def test_the_clock_waits_long_until_a_wake_then_briefly_for_a_moment():
    clock = WakeClock(long_s=0.2)
    assert clock.wait_s(now=100.0) == 0.2
    clock.woken(now=100.0)
    assert clock.wait_s(now=100.0 + WOKEN_FOR_S / 2) == WOKEN_WAIT_S
    assert clock.wait_s(now=100.0 + WOKEN_FOR_S * 1.01) == 0.2


def test_a_worker_wakes_every_rank_of_its_own_engine_start_and_no_other():
    incarnation = uuid.uuid4().hex
    engine = EngineSettings(model="m", role="decode", engine_id="decode-w", nats_url=None, tensor_parallel_size=2,
                            incarnation=incarnation)
    woken = {rank: threading.Event() for rank in range(2)}
    listeners = [WakeListener(wire.engine_wake_address("decode-w", incarnation, rank), woken[rank].set)
                 for rank in range(2)]
    other = threading.Event()
    earlier_start = WakeListener(wire.engine_wake_address("decode-w", uuid.uuid4().hex, 0), other.set)
    try:
        wake_engine(engine)
        assert all(event.wait(2) for event in woken.values())
        assert not other.wait(0.2), "another start of the same worker id is not woken"
    finally:
        for listener in (*listeners, earlier_start):
            listener.close()


def test_an_engine_without_our_connector_gets_no_wake_and_a_missing_listener_is_no_error():
    engine = EngineSettings(model="m", role="decode", engine_id="decode-x", nats_url=None, connector="vllm-nixl",
                            incarnation="i")
    woken = threading.Event()
    listener = WakeListener(wire.engine_wake_address("decode-x", "i", 0), woken.set)
    try:
        wake_engine(engine)
        assert not woken.wait(0.2)
    finally:
        listener.close()
    wake_engine(EngineSettings(model="m", role="decode", engine_id="decode-y", nats_url=None, incarnation="gone"))


def test_one_address_has_one_listener_and_closing_frees_it():
    address = wire.engine_wake_address("prefill-z", uuid.uuid4().hex, 0)
    first = WakeListener(address, lambda: None)
    with pytest.raises(OSError):
        WakeListener(address, lambda: None)
    first.close()
    assert not first._thread.is_alive()
    WakeListener(address, lambda: None).close()


def test_vllms_side_channel_is_announced_where_other_hosts_reach_the_worker(monkeypatch):
    """--connector vllm-nixl: peers connect to the side channel at the address the heartbeat
    names; on several hosts that is KVPUSH_ADVERTISE_HOST, not loopback."""
    from kvpush.services.worker.kinds import strategy

    monkeypatch.delenv("KVPUSH_ADVERTISE_HOST", raising=False)
    for variable in ("VLLM_NIXL_SIDE_CHANNEL_HOST", "VLLM_NIXL_SIDE_CHANNEL_PORT"):
        monkeypatch.delenv(variable, raising=False)
    assert strategy("kvpush").side_channel("decode-0") == {}  # ours speaks NATS
    assert strategy("vllm-nixl").side_channel("decode-0")["remote_host"] == "127.0.0.1"
    monkeypatch.setenv("KVPUSH_ADVERTISE_HOST", "198.18.0.3")
    params = strategy("vllm-nixl-push").side_channel("decode-0")
    assert params["remote_host"] == "198.18.0.3"
    assert os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "198.18.0.3"
    assert os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(params["remote_port"])
    # Below the range bind(0) draws from: no port vLLM or its peer picks can take it meanwhile.
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    assert all(strategy("vllm-nixl").side_channel("decode-0")["remote_port"] < low for _ in range(20))
