"""The emulated device's compute marks (tools/emulation/device.py), on a fake clock, and the
connector's marks without one (connector/compute_marks.py)."""

from __future__ import annotations

import pytest

from kvpush.connector import compute_marks
from kvpush.tools.emulation.device import EmulatedDevice


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def test_a_layers_mark_is_done_at_its_share_of_the_step_and_the_steps_at_its_end():
    clock = Clock()
    device = EmulatedDevice(layers=4, clock=clock)
    device.begin(50.0, 0.040)
    clock.now = 50.001
    layer_0, layer_2, step = device.mark(0), device.mark(2), device.mark()
    assert device.marks == [(0, pytest.approx(0.001)), (2, pytest.approx(0.001)), (None, pytest.approx(0.001))]
    clock.now = 50.0099
    assert not layer_0.done()
    clock.now = 50.010
    assert layer_0.done() and not layer_2.done()
    clock.now = 50.030
    assert layer_2.done() and not step.done()
    clock.now = 50.040
    assert step.done()


def test_between_steps_a_mark_is_done_when_taken():
    device = EmulatedDevice(layers=4, clock=Clock())
    assert device.mark().done()
    device.begin(50.0, 1.0)
    device.end()
    assert device.mark(3).done() and device.marks == []


def test_the_connector_asks_the_installed_device_and_else_takes_its_kv_as_computed():
    clock = Clock()
    device = EmulatedDevice(layers=2, clock=clock)
    assert compute_marks.mark() is compute_marks.COMPUTED
    compute_marks.install(device.mark)
    try:
        device.begin(50.0, 0.5)
        assert not compute_marks.mark(1).done()
        clock.now = 50.5
        assert compute_marks.mark(1).done()
    finally:
        compute_marks.install(None)
    assert compute_marks.mark() is compute_marks.COMPUTED
