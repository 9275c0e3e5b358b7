"""Closed-loop multi-turn conversations: one driver for every system, since
``vllm bench serve`` has no closed-loop multi-turn mode.

Each conversation opens with a ``first_len``-token prompt. Each next turn's prompt is the
last turn's prompt, its answer and ``turn_len`` new tokens (the user's next message), sent
the moment the answer ends. ``concurrency`` conversations run at once. Every turn is a
streamed ``/v1/completions`` request through the real ``openai`` client, with its token
ids (``return_token_ids``, vLLM's extension), so the next turn appends exactly what the
model said. Per turn: TTFT, end-to-end time, the prompt and the answer's token ids.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import asdict, dataclass, field

from kvpush.tools.bench.stats import percentile


@dataclass(frozen=True)
class Conversations:
    count: int = 6
    turns: int = 4
    first_len: int = 1024
    turn_len: int = 128
    output_len: int = 32
    concurrency: int = 2
    seed: int = 0
    vocab: int = 4096  # token ids are drawn from 1 .. vocab - 1
    think_s: float = 0.0  # the user's pause before each next turn: exponential with this mean (at most 4x it)


@dataclass
class Turn:
    conversation: int
    turn: int  # 1, 2, ...
    prompt: list[int] = field(repr=False)
    tokens: list[int] = field(repr=False)
    ttft_ms: float
    e2e_ms: float
    error: str = ""
    path: dict | None = field(default=None, repr=False)  # kvpush's path report (the stream's last event), if any

    @property
    def prefix_source(self) -> str:
        """Where its cached prefix came from (kvpush only): held, fetched, recomputed, or ""."""
        return (self.path or {}).get("prefix_source", "")


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(1, vocab) for _ in range(n)]


async def run(base_url: str, model: str, load: Conversations, extra_body: dict | None = None,
              request_prefix: str = "mt", timeout_s: float = 900.0) -> list[Turn]:
    """Every turn of every conversation, in the order they ended."""
    import openai

    client = openai.AsyncOpenAI(base_url=base_url.rstrip("/") + "/v1", api_key="unused", max_retries=0,
                                timeout=timeout_s)
    turns: list[Turn] = []
    gate = asyncio.Semaphore(load.concurrency)

    async def conversation(index: int) -> None:
        rng = random.Random(f"{load.seed}-{index}")
        prompt = _tokens(rng, load.first_len, load.vocab)
        async with gate:
            for number in range(1, load.turns + 1):
                turn = await _turn(client, model, index, number, prompt, load, extra_body or {}, request_prefix)
                turns.append(turn)
                if turn.error:
                    return
                prompt = prompt + turn.tokens + _tokens(rng, load.turn_len, load.vocab)
                if load.think_s > 0:  # the conversations drift apart: the next turn meets other load
                    await asyncio.sleep(min(rng.expovariate(1 / load.think_s), 4 * load.think_s))

    try:
        await asyncio.gather(*(conversation(i) for i in range(load.count)))
    finally:
        await client.close()
    return turns


async def _turn(client, model: str, conversation: int, number: int, prompt: list[int], load: Conversations,
                extra_body: dict, request_prefix: str) -> Turn:
    started = time.perf_counter()
    first = None
    tokens: list[int] = []
    path = None
    try:
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=load.output_len, temperature=0, stream=True,
            extra_body={"ignore_eos": True, "return_token_ids": True, **extra_body},
            extra_headers={"X-Request-Id": f"{request_prefix}-{conversation}-{number}"})
        async for event in stream:
            path = (getattr(event, "model_extra", None) or {}).get("kvpush", path)
            for choice in event.choices:
                ids = getattr(choice, "token_ids", None) or []
                if ids and first is None:
                    first = time.perf_counter()
                tokens.extend(ids)
    except Exception as exc:
        return Turn(conversation, number, prompt, tokens, 0.0, (time.perf_counter() - started) * 1000,
                    f"{type(exc).__name__}: {exc}")
    done = time.perf_counter()
    if len(tokens) != load.output_len:
        return Turn(conversation, number, prompt, tokens, 0.0, (done - started) * 1000,
                    f"{len(tokens)} tokens, not {load.output_len}")
    return Turn(conversation, number, prompt, tokens, ((first or done) - started) * 1000, (done - started) * 1000,
                path=path)


def summary(turns: list[Turn]) -> dict:
    """TTFT of first turns and of the turns after, and the failures."""
    ok = [t for t in turns if not t.error]

    def stats(values: list[float]) -> dict:
        return {"p50": percentile(values, 0.5), "p99": percentile(values, 0.99), "n": len(values)} if values else {}

    later = [t for t in ok if t.turn > 1]
    # Turns whose history another engine held (more of it than the one computing them):
    # fetched, or computed again. The rest found it where they were computed (held).
    moved = [t for t in later if t.prefix_source in ("fetched", "recomputed")]
    sources = {source: sum(1 for t in later if t.prefix_source == source) / len(later)
               for source in ("held", "fetched", "recomputed", "")} if later else {}
    return {"first_turn_ttft_ms": stats([t.ttft_ms for t in ok if t.turn == 1]),
            "later_turns_ttft_ms": stats([t.ttft_ms for t in later]),
            "moved_history_ttft_ms": stats([t.ttft_ms for t in moved]),
            "prefix_sources": {k or "none": round(v, 3) for k, v in sources.items()},
            "fetched_tokens": sum((t.path or {}).get("fetched_tokens", 0) for t in later),
            "e2e_ms": stats([t.e2e_ms for t in ok]),
            "turns": len(turns), "failed": len(turns) - len(ok),
            "errors": sorted({t.error for t in turns if t.error})[:5]}


def records(turns: list[Turn]) -> list[dict]:
    return [asdict(t) for t in sorted(turns, key=lambda t: (t.conversation, t.turn))]
