"""One copy sent as several transfers, one per rank of the peer engine (tensor
parallelism, ``kvpush.connector.tp_map``): a prefill rank writing its heads into two decode
ranks, a decode rank reading its heads from two prefill ranks. The copy ends once every
part ended, and it is whole only if every part landed. Pure bookkeeping; the parts end
on the transfer thread, one at a time.

A part reported stuck (posted and not ending, ``TransferResult.stuck``) does not end the
copy: it ends later, like any part. ``stuck()`` says whether this is the copy's first
stuck part, so that the copy is reported stuck once.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PartEnd:
    """How one part, or the whole copy, ended."""

    ok: bool
    bytes: int = 0
    descriptors: int = 0
    error: str = ""
    write_ms: float = 0.0


class Fanout:
    def __init__(self, parts: int):
        if parts < 1:
            raise ValueError("a copy needs at least one part")
        self.parts = parts
        self._ended: list[PartEnd] = []
        self._stuck = False

    def stuck(self) -> bool:
        """A part is stuck; True the first time for this copy."""
        first, self._stuck = not self._stuck, True
        return first

    def ended(self, part: PartEnd) -> PartEnd | None:
        """One part ended; the copy's end once every part ended (given once), else None."""
        if len(self._ended) == self.parts:
            raise ValueError(f"all {self.parts} parts have ended already")
        self._ended.append(part)
        if len(self._ended) < self.parts:
            return None
        return PartEnd(
            ok=all(end.ok for end in self._ended),
            bytes=sum(end.bytes for end in self._ended if end.ok),
            descriptors=sum(end.descriptors for end in self._ended if end.ok),
            error="; ".join(end.error for end in self._ended if not end.ok and end.error),
            write_ms=max(end.write_ms for end in self._ended),
        )
