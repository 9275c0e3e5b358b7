"""What every service's life shares: ``async with`` that closes what a failed start
opened, and the background tasks it owns (spawned, tracked, ended on close)."""

from __future__ import annotations

import asyncio


class BackgroundTasks:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def close(self, grace_s: float = 0.0) -> None:
        """Let tasks finish for up to ``grace_s`` seconds, then cancel and await the rest."""
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

    async def __aenter__(self):
        try:
            await self._start()
        except BaseException:
            await self.close()  # what was opened before the failure
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
