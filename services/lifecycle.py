"""What every service's life shares: ``async with`` that closes what a failed start
opened, and the background tasks it owns (spawned, tracked, ended on close)."""

from __future__ import annotations

import asyncio

import structlog

log = structlog.get_logger("kvpush.lifecycle")


class BackgroundTasks:
    """Tasks a service spawns and owns. A task that fails is logged here, once: never left
    for asyncio to report as "Task exception was never retrieved" (with a traceback) when
    it is collected, as one that fails while the service stops would be."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()
        self._closing = False

    def spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if task.cancelled() or task.exception() is None:
            return
        error = task.exception()
        if self._closing:  # what it needed (NATS, JetStream) is going away with the service
            log.warning("a task ended with an error as the service stopped",
                        task=task.get_coro().__qualname__, error=f"{type(error).__name__}: {error}")
        else:
            log.error("a background task failed", task=task.get_coro().__qualname__, exc_info=error)

    async def close(self, grace_s: float = 0.0) -> None:
        """Let tasks finish for up to ``grace_s`` seconds, then cancel and await the rest."""
        self._closing = True
        if self._tasks and grace_s > 0:
            await asyncio.wait(set(self._tasks), timeout=grace_s)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


class Service:
    """``async with service:`` runs ``_start()``; if it fails part-way, ``close()`` (which
    must be idempotent and cope with a partial start) undoes what was opened."""

    async def _start(self) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError

    async def until_failed(self) -> str:
        """Returns (why) only if the service can serve no more and its process should exit
        with an error (a worker whose engine died); most services never do."""
        await asyncio.Event().wait()
        return ""

    async def __aenter__(self):
        try:
            await self._start()
        except BaseException:
            await self.close()  # what was opened before the failure
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
