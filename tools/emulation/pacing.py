"""Spread a step's modeled time over the layers of a forward: pure, with the clock passed in.

The timed model computes each layer for real (fast: the network is tiny) and then waits until
that layer's share of the step's target time has passed since the forward began, as a CPU
thread waits on a GPU. So layer ``i`` of ``L`` ends at ``start + (i + 1) / L × target`` and
vLLM's per-layer hooks (a connector's ``save_kv_layer``) fire at emulated times. A layer that
computes past its deadline is not waited for; the later layers catch up if they can.

Waits shorter than ``min_sleep_s`` are skipped (the last layer's never is), so a layer's hooks
fire within ``min_sleep_s`` (real time; ``min_sleep_s / k`` emulated) of their emulated moment:
layer by layer in a long prefill, a few layers at a time in a short decode step.

Sleeping inside a forward costs real work: measured on a 2-core AMD EPYC (Qwen3-32B's 64
layers, one decode step, k = 20), the forward's real work was 13-14 ms with one sleep at its
end and about 25 ms with a sleep every few layers (the CPU comes back cold). ``min_sleep_s``
of a whole step, or ``begin(..., by_layer=False)`` for one forward, paces the step only at
its end: the timed model does so for steps that only decode
(no per-layer hook there needs its moment: a decode step saves no KV for another engine).
"""

from __future__ import annotations

import time

from dataclasses import dataclass, field
from typing import Callable

from kvpush.tools.emulation.time_model import Request

__all__ = ["LayerPacer", "ForwardRecord", "PACINGS", "paced_by_layer"]

PACINGS = ("layers", "every-layer", "step")


def paced_by_layer(pacing: str, batch: list[Request]) -> bool:
    """Whether a step's layers each wait for their share (else one wait at its end): under
    ``layers``, the steps that compute prompt tokens (their per-layer KV saves are what a
    layer-wise push rides on); under ``every-layer`` all; under ``step`` none."""
    if pacing not in PACINGS:
        raise ValueError(f"pacing {pacing!r}: use one of {', '.join(PACINGS)}")
    if pacing == "step":
        return False
    return pacing == "every-layer" or any(request.new > 1 for request in batch)


@dataclass
class ForwardRecord:
    """What one paced forward did, in real seconds."""

    target_s: float
    wall_s: float = 0.0
    slept_s: float = 0.0
    cpu_s: float = 0.0  # the forward thread's own CPU time: its work, without the time others had the core
    launch_s: float | None = None  # asynchronous (``launched``): when its host work was done, from its start

    @property
    def busy_s(self) -> float:
        """Real work inside the forward: its wall time less the time spent asleep."""
        return self.wall_s - self.slept_s

    @property
    def busy_share(self) -> float:
        return self.busy_s / self.target_s if self.target_s > 0 else 0.0


@dataclass
class LayerPacer:
    layers: int
    clock: Callable[[], float]
    sleep: Callable[[float], None]
    min_sleep_s: float = 0.002
    cpu_clock: Callable[[], float] = time.thread_time
    _start: float | None = None
    _cpu_start: float = 0.0
    _by_layer: bool = True


    _record: ForwardRecord | None = field(default=None, repr=False)

    def begin(self, target_s: float, by_layer: bool = True) -> None:
        """A forward starts that should take ``target_s`` (0: do not pace it); ``by_layer``
        False waits once, after the last layer, whatever ``min_sleep_s`` says."""
        if target_s < 0:
            raise ValueError("a forward's target time cannot be negative")
        self._by_layer = by_layer
        self._start = self.clock()
        self._cpu_start = self.cpu_clock()
        self._record = ForwardRecord(target_s)

    def after_layer(self, index: int) -> None:
        """Layer ``index`` (0-based) has computed: wait out the rest of its share."""
        record = self._record
        if record is None or record.target_s == 0 or self._start is None:
            return
        deadline = self._start + record.target_s * (index + 1) / self.layers
        now = self.clock()
        last = index == self.layers - 1
        if (self._by_layer and deadline - now >= self.min_sleep_s) or (last and deadline > now):
            self.sleep(deadline - now)
            record.slept_s += self.clock() - now  # what the sleep took, overshoot included

    @property
    def started_at(self) -> float | None:
        """When the running forward began (``clock()``), None between forwards."""
        return self._start

    def launched(self) -> None:
        """Asynchronous, as on a GPU: the forward's host work is done and it returns; the
        device runs on until ``wait_for_device``. Its CPU share counts the work until now."""
        record = self._record
        if record is None or self._start is None:
            return
        record.launch_s = self.clock() - self._start
        record.cpu_s = self.cpu_clock() - self._cpu_start

    def wait_for_device(self) -> None:
        """Sampling: wait until the step's modeled end."""
        self.after_layer(self.layers - 1)

    def end(self) -> ForwardRecord | None:
        """The forward is done: its record (``None`` if it was never begun)."""
        record, start = self._record, self._start
        self._record = self._start = None
        if record is None or start is None:
            return None
        record.wall_s = self.clock() - start
        if record.launch_s is None:
            record.cpu_s = self.cpu_clock() - self._cpu_start
        return record
