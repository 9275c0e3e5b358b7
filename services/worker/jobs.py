"""What a worker's role sees of the worker: a job under way, and the worker's parts."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Protocol

from services.bus import Bus
from shared import wire


@dataclass
class RunningJob:
    job: "wire.PrefillJob | wire.DecodeJob"
    task: asyncio.Task | None = None
    started: bool = False  # its task has taken its first step (before that, cancel() would skip its body)
    streaming: bool = False
    ended_by: str | None = None  # "cancelled" | "client_gone": why we stopped it


class WorkerContext(Protocol):
    worker_id: str
    connector: str
    bus: Bus
    engine: Any  # vLLM's AsyncLLM

    def request_span(self, name: str, job, received_ns: int) -> ContextManager: ...

    cancel: Callable[[str, str], None]  # (transfer id, why): stop that job if it runs
