"""The emulated device, asynchronous as a GPU is: pure, with the clock passed in.

On a GPU a forward returns once its kernels are launched; the connector's hooks run then,
milliseconds into the step, and only sampling waits for the device. The stand-in
(:mod:`kvpush.tools.emulation.stand_in`) does the same: its forward does its host work and
returns (``launch``), vLLM runs the connector's ``wait_for_save`` and ``get_finished``, and its
``compute_logits`` waits for the modeled end (:class:`kvpush.tools.emulation.pacing.LayerPacer`).

Meanwhile a WRITE of the step's KV must not leave before that KV would be computed: the
connector takes a mark in its hook (``kvpush.connector.compute_marks``), which this device
answers. Layer ``i`` of ``L`` is computed at ``start + (i + 1) / L × target``, the step at
``start + target``. Each mark's moment in the step is kept (``marks``), so a run can show
that the hooks ran inside the modeled step, not after it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvpush.connector.compute_marks import COMPUTED, ComputeMark

__all__ = ["EmulatedDevice", "Until"]


@dataclass(frozen=True)
class Until:
    """Done once ``clock()`` reaches ``ready_at``."""

    ready_at: float
    clock: Callable[[], float]

    def done(self) -> bool:
        return self.clock() >= self.ready_at


@dataclass
class EmulatedDevice:
    layers: int
    clock: Callable[[], float]
    _start: float | None = None
    _target_s: float = 0.0
    marks: list[tuple[int | None, float]] = field(default_factory=list)  # this step's: (layer, seconds in)

    def begin(self, start: float, target_s: float) -> None:
        """A step was launched at ``start`` that runs ``target_s`` on the device."""
        self._start, self._target_s, self.marks = start, target_s, []

    def end(self) -> None:
        """The step is done (sampling waited for it): marks taken from now on are done at once."""
        self._start = None

    def mark(self, layer: int | None = None) -> ComputeMark:
        start = self._start
        if start is None:
            return COMPUTED  # no step runs: whatever was computed is in memory
        self.marks.append((layer, self.clock() - start))
        share = 1.0 if layer is None else (min(max(layer, 0), self.layers - 1) + 1) / self.layers
        return Until(start + self._target_s * share, self.clock)
