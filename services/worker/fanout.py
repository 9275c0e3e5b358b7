"""A request's n answers as one stream of engine outputs, each with its answer's index.

vLLM fans a request with n > 1 out inside its engine (``ParentRequest``). Decode cannot
let it: only the first answer's engine request carries the connector's KV transfer. So
the others are engine requests of their own (``decode`` seeds them as vLLM's fan-out
does), started once the first has produced a token: the prompt's KV is then in the
engine's prefix cache, and they find it there instead of computing the prompt again.
A request that computes its prompt here (local) may start them at once, as vLLM's own
fan-out does (``others_wait=False``).

Whatever ends the stream (done, an engine request's failure, the consumer cancelled or
closing it), every engine request still running is cancelled, so vLLM aborts it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

EngineRequest = tuple[str, Any]  # (its request id, vLLM's SamplingParams)


async def fan_out(generate: Callable[..., AsyncIterator[Any]], prompt: dict, first: EngineRequest,
                  others: list[EngineRequest], others_wait: bool) -> AsyncIterator[tuple[int, Any]]:
    """(answer index, engine output) as the engine makes them: answer 0 is ``first``,
    answers 1.. are ``others``; with ``others_wait`` those start once answer 0 has produced
    a token (or ended). ``generate``: the engine's (vLLM's ``AsyncLLM.generate``). An
    engine request's failure is raised here."""
    if not others:
        async for output in generate(prompt, first[1], request_id=first[0]):
            yield 0, output
        return
    outputs: asyncio.Queue = asyncio.Queue()
    tasks: list[asyncio.Task] = []

    async def feed(index: int, request: EngineRequest) -> None:
        request_id, params = request
        try:
            async for output in generate(prompt, params, request_id=request_id):
                outputs.put_nowait((index, output))
        except Exception as exc:  # to the consumer, which raises it
            outputs.put_nowait((index, exc))
            return
        outputs.put_nowait((index, None))

    def start_others() -> None:
        for index, request in enumerate(others, start=1):
            tasks.append(asyncio.create_task(feed(index, request)))

    tasks.append(asyncio.create_task(feed(0, first)))
    if not others_wait:
        start_others()
    running = len(tasks)
    try:
        while running:
            index, item = await outputs.get()
            if isinstance(item, Exception):
                raise item
            if others_wait and index == 0 and (item is None or item.outputs[0].token_ids):
                others_wait = False
                start_others()
                running += len(others)
            if item is None:
                running -= 1
            else:
                yield index, item
    finally:  # cancelled, failed or done: vLLM aborts what still runs
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
