"""What one huge prompt costs everybody else: the TTFT of small requests while a text prompt
of ``--huge-tokens`` tokens (1M by default) goes through a real ``kvpush scheduler`` and is
refused as too long (issue 24, point 6).

The scheduler tokenizes on one thread. Before prompts were measured in bytes, a 1M-token
prompt held that thread for as long as tokenizing it took, and every small request queued
behind it. Stand-in workers (``kvpush.tools.bench.scheduler_rate``'s) answer at once, so what is
measured is the scheduler's share only. nats-server runs with an 8 MB ``max_payload`` (the
generated config's), so the huge prompt reaches the scheduler.

    python -m kvpush.tools.bench.refusal_stall --out bench-results/refusal-stall.json

Bounded: ``--small`` requests at ``--rate`` per second, each waiting at most 60 s."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvpush.shared import wire

SMALL_PROMPT_TOKENS = 64


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


async def run(model: str, huge_tokens: int, small: int, rate: float, huge_at_s: float) -> dict:
    import nats

    from kvpush.services.launch.natsd import LocalNatsServer
    from kvpush.tools.bench.scheduler_rate import IdleDecode, IdlePrefill

    with tempfile.TemporaryDirectory(prefix="kvpush-refusal-stall-") as tmp:
        config = Path(tmp) / "nats.conf"
        config.write_text("max_payload: 8MB\n")
        with LocalNatsServer(config=config) as server:
            env = {**os.environ, "KVPUSH_TRACE_DIR": str(Path(tmp) / "traces"), "KVPUSH_LOG_LEVEL": "WARNING",
                   "OTEL_SDK_DISABLED": "true"}
            env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
            log = open(Path(tmp) / "scheduler.log", "wb")
            scheduler = subprocess.Popen(
                [sys.executable, "-m", "kvpush.services.cli.main", "scheduler", "--nats-url", server.url, "--model", model,
                 "--scheduler-id", "stall-scheduler"], env=env, stdout=log, stderr=subprocess.STDOUT)
            workers = [IdlePrefill(server.url, "prefill-0", 4096), IdleDecode(server.url, "decode-0", 4096, 1)]
            nc = await nats.connect(server.url, name="stall-client")
            try:
                for worker in workers:
                    await worker.start()
                deadline = time.monotonic() + 90
                while True:
                    try:
                        status = wire.decode_json((await nc.request(wire.SCHEDULER_STATUS_SUBJECT, b"", timeout=2)).data,
                                                  wire.SchedulerStatus)
                        if status.prefill_workers and status.decode_workers:
                            break
                    except Exception:
                        pass
                    if time.monotonic() > deadline:
                        raise RuntimeError("the scheduler did not route to the stand-ins within 90 s")
                    await asyncio.sleep(0.2)
                return await _drive(nc, huge_tokens, small, rate, huge_at_s)
            finally:
                await nc.close()
                for worker in workers:
                    await worker.close()
                scheduler.terminate()
                scheduler.wait(10)
                log.close()


async def _ttft(nc, body: dict) -> tuple[float, wire.LastMessage | None]:
    from kvpush.client import generate

    sent = time.monotonic()
    first = None
    final = None
    async for reply in generate(nc, body, timeout=60):
        if first is None:
            first = time.monotonic() - sent
        if not isinstance(reply, wire.TokenChunk):
            final = reply
    return first, final


def _code(final: wire.LastMessage | None) -> str | None:
    """The error code a request ended with; None if it was answered."""
    match final:
        case wire.ErrorReply(error=error):
            return error.code
    return None


async def _drive(nc, huge_tokens: int, small: int, rate: float, huge_at_s: float) -> dict:
    start = time.monotonic()
    huge_body = {"prompt": "x " * huge_tokens, "max_tokens": 1, "request_id": "huge"}
    huge_task = None
    smalls = []
    for n in range(small):
        await asyncio.sleep(max(0.0, start + n / rate - time.monotonic()))
        if huge_task is None and time.monotonic() - start >= huge_at_s:
            huge_task = asyncio.create_task(_ttft(nc, huge_body))
        body = {"prompt_token_ids": list(range(1, SMALL_PROMPT_TOKENS + 1)), "max_tokens": 1,
                "request_id": f"small-{n}"}
        smalls.append((time.monotonic() - start, asyncio.create_task(_ttft(nc, body))))
    huge_s, huge_final = await huge_task
    results = [(at, *(await task)) for at, task in smalls]
    ttfts = [ttft * 1000 for _, ttft, final in results if _code(final) is None]
    return {
        "huge_tokens": huge_tokens,
        "huge_bytes": len(json.dumps(huge_body)),
        "huge_answer": _code(huge_final),
        "huge_answer_ms": round(huge_s * 1000, 1),
        "small_requests": small,
        "small_errors": sum(1 for _, _, final in results if _code(final) is not None),
        "small_ttft_ms_p50": round(percentile(ttfts, 50), 1),
        "small_ttft_ms_p99": round(percentile(ttfts, 99), 1),
        "small_ttft_ms_max": round(max(ttfts), 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model folder (default: the built-in small model)")
    parser.add_argument("--huge-tokens", type=int, default=1_000_000)
    parser.add_argument("--small", type=int, default=100, help="small requests (64 tokens, 1 output token)")
    parser.add_argument("--rate", type=float, default=10.0, help="small requests per second")
    parser.add_argument("--huge-at-s", type=float, default=2.0, help="when the huge prompt goes out")
    parser.add_argument("--out", help="write the result as JSON here")
    args = parser.parse_args(argv)
    if args.model is None:
        from kvpush.services.launch.model import build_model, default_model_dir

        args.model = str(build_model(default_model_dir("small")))
    result = asyncio.run(run(args.model, args.huge_tokens, args.small, args.rate, args.huge_at_s))
    result["cpu"] = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                         "")
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
