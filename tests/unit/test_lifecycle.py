"""kvpush.services.lifecycle.BackgroundTasks: a task that fails, above all while its service stops
(say, a JetStream write meeting a closed connection), is reported once by the service, and
never left to asyncio's "Task exception was never retrieved" traceback (issue 24, point 9:
the demo's stop printed one, from Scheduler._ended)."""

from __future__ import annotations

import asyncio
import gc

from kvpush.services.lifecycle import BackgroundTasks


async def test_a_task_failing_while_the_service_stops_leaves_no_unretrieved_exception():
    loop = asyncio.get_running_loop()
    reported: list[dict] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    try:
        tasks = BackgroundTasks()
        started = asyncio.Event()

        async def write_down() -> None:  # what Scheduler._ended did as NATS went away
            started.set()
            await asyncio.sleep(0)
            raise TimeoutError("nats: timeout")

        task = tasks.spawn(write_down())
        await started.wait()
        await tasks.close(grace_s=1.0)
        assert task.done()
        del task
        gc.collect()
        await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(previous)
    assert [c.get("message") for c in reported] == []
