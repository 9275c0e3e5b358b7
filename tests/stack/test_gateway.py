"""The gateway on the session's stack (real NATS, vLLM engines, NIXL), as users reach it:
the real ``openai`` client and ``vllm bench serve``. Greedy outputs equal the single
instance reference token for token; a client gone mid-stream gives both engines' blocks
back."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from kvpush.shared import wire
from tests import prompts

pytestmark = pytest.mark.timeout(600)

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
INDEXES = [0, 3, 4]  # shorter than a block, a block and a token, many blocks


def api(stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.gateway_url + "/v1", api_key="unused", max_retries=0)


def model_name(stack) -> str:
    return Path(stack.model).name


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
async def test_completions_from_the_openai_client_equal_a_single_instance(stack, reference, streamed):
    oai = api(stack)

    async def one(index: int) -> tuple[list[int], str]:
        _, prompt, max_tokens = prompts.CORRECTNESS[index]
        extra = {"ignore_eos": True, "return_token_ids": True}
        if not streamed:
            reply = await oai.completions.create(model=model_name(stack), prompt=prompt, max_tokens=max_tokens,
                                                 temperature=0, extra_body=extra)
            assert reply.usage.completion_tokens == max_tokens and reply.usage.prompt_tokens == len(prompt)
            return reply.choices[0].token_ids, reply.choices[0].text
        ids, text = [], []
        async for event in await oai.completions.create(model=model_name(stack), prompt=prompt,
                                                        max_tokens=max_tokens, temperature=0, stream=True,
                                                        stream_options={"include_usage": True}, extra_body=extra):
            for choice in event.choices:
                ids.extend(choice.token_ids)
                text.append(choice.text)
        assert event.usage.completion_tokens == max_tokens
        return ids, "".join(text)

    results = await asyncio.gather(*(one(i) for i in INDEXES))
    for index, (ids, text) in zip(INDEXES, results):
        assert ids == reference[index]
        assert text  # the detokenized text came along


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
async def test_a_chat_from_the_openai_client_equals_its_template_run_on_a_single_instance(stack, reference,
                                                                                          streamed):
    oai = api(stack)
    kwargs = dict(model=model_name(stack), messages=prompts.CHAT_MESSAGES, max_completion_tokens=prompts.CHAT_MAX_TOKENS,
                  temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})
    if streamed:
        ids = []
        async for event in await oai.chat.completions.create(**kwargs, stream=True):
            for choice in event.choices:
                ids.extend(choice.token_ids)
    else:
        reply = await oai.chat.completions.create(**kwargs)
        ids = reply.choices[0].token_ids
        assert reply.choices[0].message.role == "assistant" and reply.choices[0].message.content
    assert ids == reference[prompts.CHAT]


@pytest.mark.parametrize("sampling", [[], ["--temperature", "0.7", "--top-p", "0.9"]],
                         ids=["its-defaults", "temperature-0.7-top-p-0.9"])
async def test_vllm_bench_serve_against_the_gateway_completes_every_request(stack, tmp_path, sampling):
    """vLLM's own benchmark client, as the benchmark issue will run it for every system:
    with its default sampling flags, and sampling as a chat front end does."""
    name = "vllm-bench-gateway.json" if not sampling else "vllm-bench-gateway-sampled.json"
    command = [sys.executable, "-m", "kvpush.tools.bench.vllm_cli", "bench", "serve", "--backend", "openai",
               "--base-url", stack.gateway_url, "--model", model_name(stack), "--tokenizer", stack.model,
               "--dataset-name", "random", "--random-input-len", "128", "--random-output-len", "16",
               "--num-prompts", "16", "--request-rate", "4", "--seed", "0", "--ignore-eos", *sampling,
               "--save-result", "--save-detailed", "--result-dir", str(tmp_path), "--result-filename", name]
    run = subprocess.run(command, capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads((tmp_path / name).read_text())
    ARTIFACTS.mkdir(exist_ok=True)
    shutil.copy(tmp_path / name, ARTIFACTS / name)
    assert result["completed"] == 16 and result.get("failed", 0) == 0, {k: result.get(k) for k in
                                                                         ("completed", "failed", "errors")}
    assert result["total_output_tokens"] == 16 * 16
    assert result["mean_ttft_ms"] > 0


async def _free_blocks(nc, seconds: float = 2.5) -> dict[str, int]:
    """Each worker's free KV blocks, from its heartbeats over ``seconds``."""
    free: dict[str, int] = {}

    async def on_beat(msg) -> None:
        beat = wire.decode(msg.data, wire.WorkerHeartbeat)
        free[beat.worker_id] = beat.free_kv_blocks

    sub = await nc.subscribe(wire.HEARTBEATS.wildcard, cb=on_beat)
    await asyncio.sleep(seconds)
    await sub.unsubscribe()
    return free


async def test_a_client_that_disconnects_mid_stream_ends_its_request_and_both_engines_blocks_return(stack, nc):
    idle = await _free_blocks(nc)
    assert len(idle) == 2
    progress: list[wire.RequestProgress] = []

    async def on_progress(msg) -> None:
        progress.append(wire.decode(msg.data, wire.RequestProgress))

    sub = await nc.subscribe(wire.PROGRESS.wildcard, cb=on_progress)
    _, prompt, _ = prompts.CORRECTNESS[4]
    body = {"model": model_name(stack), "prompt": prompt, "max_tokens": 400, "temperature": 0, "ignore_eos": True,
            "stream": True}
    async with httpx.AsyncClient(timeout=120) as http:
        async with http.stream("POST", stack.gateway_url + "/v1/completions", json=body,
                               headers={"X-Request-Id": "gateway-gone"}) as reply:
            async for line in reply.aiter_lines():
                if line.startswith("data: "):
                    break  # the first token came: go away
    deadline = time.monotonic() + 30
    while not any(p.request_id == "gateway-gone" and p.stage == "ended" for p in progress):
        assert time.monotonic() < deadline, "the request did not end"
        await asyncio.sleep(0.1)
    await sub.unsubscribe()
    ended = next(p for p in progress if p.request_id == "gateway-gone" and p.stage == "ended")
    assert ended.outcome in ("cancelled", "client_gone")
    deadline = time.monotonic() + 45
    while (now := await _free_blocks(nc, 1.5)) != idle:
        assert time.monotonic() < deadline, f"blocks not back: {now} vs idle {idle}"


async def test_a_stop_string_ends_the_answer_before_it(stack):
    oai = api(stack)
    _, prompt, max_tokens = prompts.CORRECTNESS[0]
    common = dict(model=model_name(stack), prompt=prompt, max_tokens=max_tokens, temperature=0)
    whole = (await oai.completions.create(**common, extra_body={"ignore_eos": True})).choices[0].text
    middle = len(whole) // 2
    stop = whole[middle:middle + 3]
    assert stop.strip(), whole  # the gibberish of the built-in model has text in its middle
    stopped = (await oai.completions.create(**common, stop=[stop], extra_body={"ignore_eos": True})).choices[0]
    assert stopped.text == whole[:whole.index(stop)]
    assert stopped.finish_reason == "stop"
