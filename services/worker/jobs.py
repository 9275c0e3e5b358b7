"""What a worker's role sees of the worker: a job under way, and the worker's parts (the
jobs' book is ``kvpush.services.worker.job_book``)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Protocol

from kvpush.services.bus import Bus
from kvpush.shared import wire


class EngineLost(Exception):
    """The worker's engine died under a job (``WorkerContext.engine_lost``): the job ends
    without a word, to its client or to the schedulers, as it would in a crash of the worker."""


@dataclass
class RunningJob:
    job: "wire.PrefillJob | wire.DecodeJob"
    task: asyncio.Task | None = None
    started: bool = False  # its task has taken its first step (before that, cancel() would skip its body)
    streaming: bool = False
    ended_by: str | None = None  # "cancelled" | "client_gone": why we stopped it
    cancel_error: "wire.ErrorBody | None" = None  # what the client is told, if this job holds the answer
    claim: Any = None  # decode: its answer's claim (kvpush.services.ledger.Claim), once tried
    # Decode: what the engine that computed the prompt said of it (prefill's, passed on by
    # the scheduler in push, in the job in pull), once here.
    prompt: "wire.PromptReport | None" = None
    prompt_here: asyncio.Event = field(default_factory=asyncio.Event)

    def prompt_arrived(self, report: "wire.PromptReport") -> None:
        if self.prompt is None:
            self.prompt = report
            self.prompt_here.set()

    async def prompt_report(self, wait_s: float) -> "wire.PromptReport | None":
        """The prompt's report, waiting at most ``wait_s`` for it; None if it did not come."""
        if self.prompt is None and wait_s > 0:
            try:
                await asyncio.wait_for(self.prompt_here.wait(), wait_s)
            except asyncio.TimeoutError:
                pass
        return self.prompt

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
    engine_dead: bool  # the engine died: the worker says nothing more of its jobs, and ends
    engine_lost: Callable[[BaseException], bool]  # did this failure come from the engine's death?
