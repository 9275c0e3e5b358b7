"""When the KV a step computes is in memory: what a WRITE of it waits for.

On a GPU the forward returns once its kernels are launched, and vLLM calls the connector's
hooks then (``save_kv_layer`` between layers' launches, ``wait_for_save`` after the last),
before the device is done: a WRITE posted at that moment would carry blocks not yet computed.
So the producer takes a mark in the hook (:func:`mark`) and hands it with the WRITE; the
transfer thread posts the WRITE once the mark is done, and meanwhile goes on with the others.

On vLLM's CPU platform the forward is synchronous: a mark is done when taken (:data:`COMPUTED`).
An emulated device (tools/emulation/stand_in.py, whose forward returns at launch and whose
sampling waits for the modeled end) installs its own marks with :func:`install`; a CUDA
build would install marks that record and query a CUDA event.

Pure: no vLLM, no NIXL."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

__all__ = ["ComputeMark", "COMPUTED", "install", "mark"]


class ComputeMark(Protocol):
    def done(self) -> bool:
        """The KV it marks is in memory: a WRITE of it may leave."""


class _Computed:
    def done(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "COMPUTED"


COMPUTED: ComputeMark = _Computed()
"""The mark of a synchronous device: whatever was computed is in memory already."""

MarkSource = Callable[[int | None], ComputeMark]
_source: MarkSource | None = None


def install(source: MarkSource | None) -> None:
    """This process's device: ``source(layer)`` marks the running step's end (``layer`` None) or
    that layer's. None: the synchronous device again."""
    global _source
    _source = source


def mark(layer: int | None = None) -> ComputeMark:
    """Taken in a hook of the running step: done once that step's KV (``layer``'s, if given)
    is in memory."""
    return COMPUTED if _source is None else _source(layer)
