"""A request's n answers as one stream of engine outputs (services/worker/fanout.py). The
engine is a stand-in: each engine request yields its outputs, one event loop step apart."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from kvpush.services.worker.fanout import fan_out


class Engine:
    """vLLM's ``AsyncLLM.generate``, as the fan-out calls it: each request's outputs are
    its ``steps`` (token lists); a request named in ``failing`` raises after its outputs."""

    def __init__(self, steps: dict[str, list[list[int]]], failing: tuple[str, ...] = ()):
        self.steps, self.failing = steps, failing
        self.started: list[str] = []
        self.aborted: list[str] = []  # cancelled before its end (vLLM aborts such a request)

    async def generate(self, prompt, params, request_id: str):
        self.started.append(request_id)
        try:
            for token_ids in self.steps[request_id]:
                await asyncio.sleep(0)
                yield SimpleNamespace(outputs=[SimpleNamespace(token_ids=token_ids)])
        except (asyncio.CancelledError, GeneratorExit):
            self.aborted.append(request_id)
            raise
        if request_id in self.failing:
            raise RuntimeError(f"{request_id} failed")


async def _all(engine: Engine, others: list[str], others_wait: bool) -> list[tuple[int, list[int]]]:
    outputs = fan_out(engine.generate, {"prompt_token_ids": [1]}, ("a0", None), [(o, None) for o in others],
                      others_wait)
    return [(index, output.outputs[0].token_ids) async for index, output in outputs]


async def test_one_answer_is_its_engine_requests_outputs():
    engine = Engine({"a0": [[1], [2]]})
    assert await _all(engine, [], others_wait=True) == [(0, [1]), (0, [2])]


async def test_the_others_wait_for_answer_0s_first_token():
    engine = Engine({"a0": [[], [1], [2]], "a1": [[5]], "a2": [[6]]})  # a0's first output has no token (KV wait)
    got = await _all(engine, ["a1", "a2"], others_wait=True)
    first_token = got.index((0, [1]))
    assert all(index == 0 for index, _ in got[:first_token + 1])
    assert sorted(got) == [(0, []), (0, [1]), (0, [2]), (1, [5]), (2, [6])]
    assert engine.started[0] == "a0"


async def test_without_waiting_every_answer_starts_at_once():
    engine = Engine({"a0": [[1], [2], [3]], "a1": [[5]]})
    got = await _all(engine, ["a1"], others_wait=False)
    assert got.index((1, [5])) < got.index((0, [3]))  # interleaved, not after answer 0
    assert engine.started == ["a0", "a1"]


async def test_an_engine_requests_failure_ends_the_stream_and_cancels_the_others():
    engine = Engine({"a0": [[1], [2]], "a1": [[5]] * 100}, failing=("a0",))
    with pytest.raises(RuntimeError, match="a0 failed"):
        await _all(engine, ["a1"], others_wait=False)
    assert engine.aborted == ["a1"]


async def test_closing_the_stream_cancels_every_engine_request():
    engine = Engine({"a0": [[1]] * 100, "a1": [[5]] * 100})
    outputs = fan_out(engine.generate, {"prompt_token_ids": [1]}, ("a0", None), [("a1", None)], others_wait=False)
    await anext(outputs)
    await outputs.aclose()
    assert sorted(engine.aborted) == ["a0", "a1"]
