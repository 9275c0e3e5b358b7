"""The layer pacer of the timed model (tools/emulation/pacing.py), on a fake clock."""

from __future__ import annotations

import pytest

from kvpush.tools.emulation.pacing import LayerPacer


class FakeClock:
    def __init__(self):
        self.now = 100.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds

    def work(self, seconds: float) -> None:
        self.now += seconds


def run_forward(pacer: LayerPacer, clock: FakeClock, target: float, work_per_layer: float):
    ends = []
    pacer.begin(target)
    for index in range(pacer.layers):
        clock.work(work_per_layer)
        pacer.after_layer(index)
        ends.append(clock.now - 100.0)
    return ends, pacer.end()


def test_each_layer_ends_at_its_share_of_the_step():
    clock = FakeClock()
    pacer = LayerPacer(4, clock, clock.sleep, min_sleep_s=0.0)
    ends, record = run_forward(pacer, clock, target=0.4, work_per_layer=0.01)
    assert ends == pytest.approx([0.1, 0.2, 0.3, 0.4])
    assert record.wall_s == pytest.approx(0.4)
    assert record.busy_s == pytest.approx(0.04)
    assert record.busy_share == pytest.approx(0.1)


def test_a_slow_layer_is_not_waited_for_and_the_next_catch_up():
    clock = FakeClock()
    pacer = LayerPacer(4, clock, clock.sleep, min_sleep_s=0.0)
    pacer.begin(0.4)
    clock.work(0.25)  # layer 0 overruns its 0.1 and layer 1's 0.2
    pacer.after_layer(0)
    assert clock.sleeps == []
    pacer.after_layer(1)
    assert clock.sleeps == []
    pacer.after_layer(2)
    assert clock.now - 100.0 == pytest.approx(0.3)
    pacer.after_layer(3)
    assert pacer.end().wall_s == pytest.approx(0.4)


def test_short_waits_are_gathered_and_the_last_layer_always_waits():
    clock = FakeClock()
    pacer = LayerPacer(8, clock, clock.sleep, min_sleep_s=0.0015)
    ends, record = run_forward(pacer, clock, target=0.008, work_per_layer=0.0)  # 1 ms per layer
    assert len(clock.sleeps) == 4  # every second layer
    assert ends[-1] == pytest.approx(0.008)
    assert record.wall_s == pytest.approx(0.008)


def test_a_pacer_whose_short_waits_span_the_step_waits_once_at_the_end():
    clock = FakeClock()
    pacer = LayerPacer(64, clock, clock.sleep, min_sleep_s=float("inf"))
    ends, record = run_forward(pacer, clock, target=1.0, work_per_layer=0.001)
    assert len(clock.sleeps) == 1
    assert ends[-1] == pytest.approx(1.0)
    assert ends[-2] == pytest.approx(0.063)


def test_a_step_that_takes_longer_than_its_target_is_recorded_as_such():
    clock = FakeClock()
    pacer = LayerPacer(2, clock, clock.sleep)
    _, record = run_forward(pacer, clock, target=0.01, work_per_layer=0.02)
    assert clock.sleeps == []
    assert record.wall_s == pytest.approx(0.04)
    assert record.busy_share == pytest.approx(4.0)


def test_an_unpaced_forward_never_sleeps_and_a_negative_target_is_refused():
    clock = FakeClock()
    pacer = LayerPacer(4, clock, clock.sleep)
    _, record = run_forward(pacer, clock, target=0.0, work_per_layer=0.01)
    assert clock.sleeps == [] and record.busy_share == 0.0
    assert pacer.end() is None
    with pytest.raises(ValueError):
        pacer.begin(-1.0)


def test_a_forward_begun_whole_waits_once_even_on_a_per_layer_pacer():
    clock = FakeClock()
    pacer = LayerPacer(4, clock, clock.sleep, min_sleep_s=0.0)
    pacer.begin(0.4, by_layer=False)
    for index in range(4):
        clock.work(0.01)
        pacer.after_layer(index)
    assert clock.sleeps == [pytest.approx(0.36)]
    pacer.begin(0.4)  # the next forward is paced by layer again
    for index in range(4):
        pacer.after_layer(index)
    assert len(clock.sleeps) == 5


def test_steps_with_prompt_tokens_are_paced_by_layer_and_decode_only_steps_once():
    from kvpush.tools.emulation.pacing import paced_by_layer
    from kvpush.tools.emulation.time_model import Request

    prefill, decode, mixed = [Request(512, 512)], [Request(1, 600)] * 4, [Request(1, 600), Request(64, 64)]
    assert [paced_by_layer("layers", b) for b in (prefill, decode, mixed)] == [True, False, True]
    assert [paced_by_layer("every-layer", b) for b in (prefill, decode)] == [True, True]
    assert [paced_by_layer("step", b) for b in (prefill, decode)] == [False, False]
    with pytest.raises(ValueError):
        paced_by_layer("sometimes", prefill)


def test_a_forwards_record_counts_its_threads_own_cpu_time():
    clock = FakeClock()
    cpu = iter([5.0, 5.25])
    pacer = LayerPacer(2, clock, clock.sleep, min_sleep_s=0.0, cpu_clock=lambda: next(cpu))
    pacer.begin(1.0)
    pacer.after_layer(0)
    pacer.after_layer(1)
    record = pacer.end()
    assert record.cpu_s == 0.25 and record.wall_s == pytest.approx(1.0)


def test_an_asynchronous_forward_returns_at_launch_and_sampling_waits_for_the_modeled_end():
    """The stand-in's device: host work, launch, the connector's hooks, then the wait."""
    clock = FakeClock()
    cpu = FakeClock()
    pacer = LayerPacer(layers=80, clock=clock, sleep=clock.sleep, cpu_clock=cpu)
    pacer.begin(0.050, by_layer=False)
    clock.work(0.004), cpu.work(0.004)  # the forward's host work
    pacer.launched()
    clock.work(0.003), cpu.work(0.003)  # the connector's wait_for_save and get_finished: not the forward's
    pacer.wait_for_device()
    record = pacer.end()
    assert clock.now - 100.0 == pytest.approx(0.050)  # sampling saw the modeled end
    assert record.launch_s == pytest.approx(0.004) and record.cpu_s == pytest.approx(0.004)
    assert record.slept_s == pytest.approx(0.043) and record.wall_s == pytest.approx(0.050)


def test_a_forward_whose_host_work_outlasts_the_step_is_not_waited_for():
    clock = FakeClock()
    pacer = LayerPacer(layers=4, clock=clock, sleep=clock.sleep)
    pacer.begin(0.010, by_layer=False)
    clock.work(0.015)
    pacer.launched()
    pacer.wait_for_device()
    record = pacer.end()
    assert clock.sleeps == [] and record.wall_s == pytest.approx(0.015) and record.launch_s == pytest.approx(0.015)
