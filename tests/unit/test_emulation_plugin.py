"""The emulation plugin's guard for the forward thread's cores (tools/emulation/plugin.py): vLLM's
NIXL worker pins the thread that builds it to the last core; an emulated GPU server has no
such pin, so the plugin sets the thread's cores back after the worker is built. And its
pacing of the shared-memory queue's spin (``KVPUSH_SHM_SPIN``), on a module shaped as vLLM's
``shm_broadcast``: it imports ``sched_yield`` by name and calls it between polls. That the
patch reaches vLLM's own module in a vLLM process: tests/bench/test_emulation.py."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest

from kvpush.tools.emulation import plugin
from kvpush.tools.emulation.plugin import keeping_thread_cores, patch_on_import

def _in_a_thread(function):
    """Run ``function`` on a thread of its own (a thread's cores are its own on Linux), so the
    test process's cores are never touched."""
    seen = {}

    def run():
        try:
            seen["value"] = function()
        except Exception as exc:  # noqa: BLE001 - handed to the test
            seen["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return seen


def test_a_function_that_pins_its_thread_leaves_it_where_it_was():
    cores = sorted(os.sched_getaffinity(0))

    def pin_to_the_last_core():  # what vLLM's NIXL worker does on CPUs
        os.sched_setaffinity(0, {cores[-1]})
        return sorted(os.sched_getaffinity(0))

    def failing_pin():
        os.sched_setaffinity(0, {cores[-1]})
        raise RuntimeError("built half")

    unguarded = _in_a_thread(lambda: (pin_to_the_last_core(), sorted(os.sched_getaffinity(0))))
    assert unguarded["value"] == ([cores[-1]], [cores[-1]])  # the pin sticks without the guard
    guarded = _in_a_thread(lambda: (keeping_thread_cores(pin_to_the_last_core)(), sorted(os.sched_getaffinity(0))))
    assert guarded["value"] == ([cores[-1]], cores)  # pinned inside, set back after
    failed = _in_a_thread(lambda: (_swallow(keeping_thread_cores(failing_pin)), sorted(os.sched_getaffinity(0))))
    assert failed["value"] == ("built half", cores)
    assert sorted(os.sched_getaffinity(0)) == cores


def _swallow(function):
    try:
        function()
    except RuntimeError as exc:
        return str(exc)
    return None


def test_a_module_is_patched_when_it_is_imported_and_at_once_when_it_already_was(tmp_path, monkeypatch):
    (tmp_path / "kvpush_probe_worker.py").write_text("class Worker:\n    def __init__(self):\n        self.built = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    patched = []
    patch_on_import("kvpush_probe_worker", lambda module: patched.append(module.__name__))
    assert patched == []  # not imported by asking
    try:
        import kvpush_probe_worker  # noqa: F401

        assert patched == ["kvpush_probe_worker"]
        assert not any(type(f).__name__ == "_PatchOnImport" for f in sys.meta_path)  # the hook is gone
        patch_on_import("kvpush_probe_worker", lambda module: patched.append("again"))
        assert patched == ["kvpush_probe_worker", "again"]
    finally:
        sys.modules.pop("kvpush_probe_worker", None)


SPINNING_QUEUE = """
import os
sched_yield = os.sched_yield


def poll(times):
    for _ in range(times):
        sched_yield()
"""


def test_the_queue_s_spin_is_paced_once_its_module_is_imported(tmp_path, monkeypatch):
    (tmp_path / "kvpush_probe_queue.py").write_text(SPINNING_QUEUE)
    monkeypatch.syspath_prepend(str(tmp_path))
    patch_on_import("kvpush_probe_queue", lambda module: plugin._pace_shm_spin(module, plugin.paced_yield(200e-6)))
    try:
        import kvpush_probe_queue as queue

        paced = queue.sched_yield
        assert paced is not os.sched_yield and paced.kvpush_paced
        plugin._pace_shm_spin(queue, plugin.paced_yield(1.0))
        assert queue.sched_yield is paced  # once: a second load of the plugin changes nothing
        started, cpu = time.monotonic(), time.thread_time()
        queue.poll(100)
        wall, used = time.monotonic() - started, time.thread_time() - cpu
        assert wall >= 100 * 200e-6  # each poll gave the core up for the pause
        assert used < 0.5 * wall, (used, wall)  # asleep, not spinning
    finally:
        sys.modules.pop("kvpush_probe_queue", None)


def test_the_spin_backs_off_by_default_and_the_switch_takes_paced_backoff_or_on_only():
    default = plugin.shm_spin_pause({}).backoff
    assert (default.spin_s, default.first_sleep_s, default.longest_sleep_s) == pytest.approx((1e-3, 50e-6, 1e-3))
    assert plugin.shm_spin_pause({"KVPUSH_SHM_SPIN": "paced"}).sleep_s == pytest.approx(100e-6)
    assert plugin.shm_spin_pause({"KVPUSH_SHM_SPIN": "paced", "KVPUSH_SHM_SPIN_SLEEP_US": "500"}).sleep_s == pytest.approx(500e-6)
    assert plugin.shm_spin_pause({"KVPUSH_SHM_SPIN": "backoff"}).backoff.longest_sleep_s == pytest.approx(1e-3)
    assert plugin.shm_spin_pause({"KVPUSH_SHM_SPIN": "backoff", "KVPUSH_SHM_SPIN_SLEEP_US": "2000"}).backoff.longest_sleep_s \
        == pytest.approx(2e-3)
    assert plugin.shm_spin_pause({"KVPUSH_SHM_SPIN": "backoff", "KVPUSH_SHM_SPIN_YIELD_US": "20000"}).backoff.spin_s \
        == pytest.approx(20e-3)
    assert plugin.shm_spin_pause({"KVPUSH_SHM_SPIN": "on", "KVPUSH_SHM_SPIN_SLEEP_US": "500"}) is None
    with pytest.raises(ValueError, match="'paced', 'backoff' or 'on'"):
        plugin.shm_spin_pause({"KVPUSH_SHM_SPIN": "off"})


def test_a_backoff_yields_for_the_first_millisecond_then_sleeps_doubling_up_to_its_longest():
    backoff, state = plugin.Backoff(spin_s=1e-3, first_sleep_s=50e-6, longest_sleep_s=400e-6, new_wait_after_s=1e-3), {}
    now, pauses = 0.0, []
    for _ in range(12):
        pause = backoff.next_pause(now, state)
        pauses.append(pause)
        now += pause + 100e-6  # the poll's own work, and a yield's return, between calls
        state["ended"] = now
    yields = pauses[:pauses.index(next(p for p in pauses if p))]
    assert len(yields) == 10 and set(yields) == {0.0}  # 1 ms of sched_yield at 100 us a poll
    assert pauses[10:] == pytest.approx([50e-6, 100e-6])
    for _ in range(4):
        pauses.append(backoff.next_pause(now, state))
        now += pauses[-1]
        state["ended"] = now
    assert pauses[12:] == pytest.approx([200e-6, 400e-6, 400e-6, 400e-6])  # never past the longest


def test_a_backoff_begins_again_after_the_thread_did_something_else():
    backoff, state = plugin.Backoff(spin_s=1e-3, first_sleep_s=50e-6, longest_sleep_s=1e-3, new_wait_after_s=1e-3), {}
    assert backoff.next_pause(0.0, state) == 0.0
    state["ended"] = 0.0
    assert backoff.next_pause(0.0015, state) == 0.0  # 1.5 ms since the last poll: a new wait, spun again
    state["ended"] = 0.0015
    assert backoff.next_pause(0.0020, state) == 0.0  # 0.5 ms into this wait
    state["ended"] = 0.0020
    assert backoff.next_pause(0.0026, state) == pytest.approx(50e-6)  # 1.1 ms into it: sleeps begin


def test_a_backoff_pause_sleeps_in_a_long_wait_instead_of_spinning():
    pause = plugin.backoff_yield(plugin.Backoff(spin_s=1e-3, longest_sleep_s=1e-3))
    started, cpu = time.monotonic(), time.thread_time()
    while time.monotonic() - started < 0.2:
        pause()
    wall, used = time.monotonic() - started, time.thread_time() - cpu
    assert used < 0.3 * wall, (used, wall)  # after the first millisecond, asleep
