"""What a worker's role sees of the worker: a job under way, and the worker's parts."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Protocol

from kvpush.services.bus import Bus
from kvpush.shared import wire


@dataclass
class RunningJob:
    job: "wire.PrefillJob | wire.DecodeJob"
    task: asyncio.Task | None = None
    started: bool = False  # its task has taken its first step (before that, cancel() would skip its body)
    streaming: bool = False
    ended_by: str | None = None  # "cancelled" | "client_gone": why we stopped it
    cancel_error: "wire.ErrorBody | None" = None  # what the client is told, if this job holds the answer
    claim: Any = None  # decode: its answer's claim (kvpush.services.ledger.Claim), once tried

    @property
    def claimed(self) -> bool:
        """Decode: this job won the claim to answer its client."""
        return self.claim is not None and self.claim.won


class WorkerContext(Protocol):
    worker_id: str
    connector: str
    bus: Bus
    engine: Any  # vLLM's AsyncLLM

    def request_span(self, name: str, job, received_ns: int) -> ContextManager: ...

    cancel: Callable[..., None]  # (transfer id, why, detail="", error=None): stop that job if it runs
