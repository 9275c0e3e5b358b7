"""A worker's jobs by transfer id, the cancels that came before their job, and prefill's
prompt reports that came before their decode job. Pure: the worker service starts and
stops the jobs' tasks."""

from __future__ import annotations

from kvpush.services.worker.jobs import RunningJob
from kvpush.shared import wire

CANCEL_MEMORY = 10_000  # cancellations remembered, for jobs that arrive after their cancel
EARLY_PROMPT_MEMORY = 1_000  # prompt reports kept for decode jobs not here yet


class JobBook:
    """A worker's jobs by transfer id: those under way, the transfers cancelled (a cancel
    may come before its job, which is then dropped), and prefill's prompt reports that came
    before their decode job (the scheduler sends the job and, later, the report, and the
    two are separate messages). Pure: the worker service starts and stops the tasks."""

    def __init__(self, cancel_memory: int = CANCEL_MEMORY, early_memory: int = EARLY_PROMPT_MEMORY):
        self.running: dict[str, RunningJob] = {}
        self._cancelled: dict[str, None] = {}  # insertion-ordered: the oldest forgotten first
        self._early_prompts: dict[str, wire.PromptReport] = {}
        self._cancel_memory = cancel_memory
        self._early_memory = early_memory

    def arrived(self, job) -> RunningJob | None:
        """The job's entry, with its prompt report if one came first (or, in pull, its
        own); None if its transfer was cancelled before it came."""
        if job.transfer_id in self._cancelled:
            return None
        running = self.running[job.transfer_id] = RunningJob(job)
        early = self._early_prompts.pop(job.transfer_id, None)
        if early is not None:
            running.prompt_arrived(early)
        elif getattr(job, "prompt", None) is not None:
            running.prompt_arrived(job.prompt)
        return running

    def prompt_ready(self, ready: wire.PromptReady) -> None:
        running = self.running.get(ready.transfer_id)
        if running is not None:
            running.prompt_arrived(ready.prompt)
        elif ready.transfer_id not in self._cancelled:
            _remember(self._early_prompts, ready.transfer_id, ready.prompt, self._early_memory)

    def cancelled(self, transfer_id: str) -> RunningJob | None:
        """Remember the cancel; the job under way, if any."""
        _remember(self._cancelled, transfer_id, None, self._cancel_memory)
        self._early_prompts.pop(transfer_id, None)
        return self.running.get(transfer_id)

    def ended(self, transfer_id: str) -> None:
        self.running.pop(transfer_id, None)


def _remember(memory: dict, key: str, value, limit: int) -> None:
    memory[key] = value
    while len(memory) > limit:
        del memory[next(iter(memory))]
