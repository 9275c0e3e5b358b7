"""Layer-wise push: one transfer's WRITE sent as one WRITE per layer, each posted as soon
as the forward pass has written that layer's KV, so later layers compute while earlier
ones travel. Pure bookkeeping: no NIXL, NATS or vLLM; its owner (the producer) holds one
lock around every call.

A transfer's layers may be posted only while nothing stopped it (a Revoke between two
layers stops the rest), and only once the peer's agent is known and the layer computed.
The transfer ends, as a whole WRITE would, once no layer can still be posted and every
posted layer ended: ``Written`` when all of them were and all landed, else
``NotWritten`` with why. Decode counts each layer of each rank (``completion``) and
starts only when all arrived, as with a whole WRITE.
"""

from __future__ import annotations

import dataclasses
import enum


class LayerState(enum.Enum):
    WAITING = "waiting"  # not computed, or the peer's agent not known yet
    POSTED = "posted"
    LANDED = "landed"
    FAILED = "failed"


@dataclasses.dataclass(frozen=True, slots=True)
class Written:
    """Every layer landed."""

    bytes: int
    descriptors: int


@dataclasses.dataclass(frozen=True, slots=True)
class NotWritten:
    """The transfer ended without all its layers: a layer failed, or it was stopped."""

    stopped: bool  # a Revoke stopped it (else a layer's WRITE failed)
    reason: str
    layers_landed: int


class LayerWrites:
    def __init__(self, layers: int):
        if layers < 1:
            raise ValueError("a layer-wise write needs at least one layer")
        self.layers = layers
        self.states = [LayerState.WAITING] * layers
        self.computed = 0  # layers 0..computed-1 hold their KV
        self.peer_known = False
        self.stopped: str | None = None  # why no further layer may start
        self.stuck_reported = False
        self._bytes = 0
        self._descriptors = 0
        self._errors: list[str] = []
        self._answered = False

    # ---------------------------------------------------------------- what may go now

    def layer_computed(self, index: int) -> list[int]:
        """The forward wrote layer ``index``'s KV (layers come in order); the layers to post now."""
        self.computed = max(self.computed, index + 1)
        return self._postable()

    def all_computed(self) -> list[int]:
        """The forward pass ended: every layer holds its KV; the layers to post now."""
        self.computed = self.layers
        return self._postable()

    def peer_found(self) -> list[int]:
        """The peer's agent is known; the layers to post now."""
        self.peer_known = True
        return self._postable()

    def stop(self, why: str) -> None:
        """No further layer starts (those posted still land, or fail)."""
        if self.stopped is None:
            self.stopped = why

    def _postable(self) -> list[int]:
        if self.stopped is not None or not self.peer_known:
            return []
        ready = [i for i in range(self.computed) if self.states[i] is LayerState.WAITING]
        for index in ready:
            self.states[index] = LayerState.POSTED
        return ready

    # ---------------------------------------------------------------- how it ends

    def layer_ended(self, index: int, ok: bool, nbytes: int = 0, descriptors: int = 0,
                    error: str = "") -> Written | NotWritten | None:
        """A posted layer's WRITE ended; the transfer's end, the first time it is decided."""
        if self.states[index] is not LayerState.POSTED:
            raise ValueError(f"layer {index} is {self.states[index].value}, not posted")
        self.states[index] = LayerState.LANDED if ok else LayerState.FAILED
        if ok:
            self._bytes += nbytes
            self._descriptors += descriptors
        else:
            self._errors.append(f"layer {index}: {error}")
            self.stop("a layer's WRITE failed")
        return self.outcome()

    def outcome(self) -> Written | NotWritten | None:
        """The transfer's end once no layer is in flight or can still be posted; None
        before, and after it was given once."""
        if self._answered or LayerState.POSTED in self.states:
            return None
        landed = self.states.count(LayerState.LANDED)
        if landed == self.layers:
            self._answered = True
            return Written(self._bytes, self._descriptors)
        if self.stopped is None:
            return None  # layers still to compute, or the peer to find
        self._answered = True
        reason = "; ".join(self._errors) if self._errors else self.stopped
        return NotWritten(stopped=not self._errors, reason=reason, layers_landed=landed)

    def in_flight(self) -> bool:
        return LayerState.POSTED in self.states
