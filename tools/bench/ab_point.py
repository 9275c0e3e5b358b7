"""One load point against any checkout of kvpush, old or new: the A/B harness that bisected
push's regression between rounds (issue 27, docs/benchmarks.md "Push's regression").

The same client for every commit: raw NATS, JSON requests on ``kvpush.generate`` with a
reply inbox (the wire both layouts accept), open-loop Poisson arrivals from a fixed seed,
token-id prompts of an exact length with ``ignore_eos``. Each commit runs its own stack
(``Stack``: nats-server, scheduler, one prefill and one decode worker, real vLLM engines)
from its own source: the checkout's folders go first on ``PYTHONPATH`` (commits before the
one-package move have top-level ``services``/``shared``; later ones are overlaid as
``kvpush.*`` in a temporary folder, so the editable install's mapping does not win).

    git worktree add /tmp/old 4695ba7
    .venv/bin/python -m kvpush.tools.bench.ab_point --repo /tmp/old --model MODEL_DIR --out old.json
    .venv/bin/python -m kvpush.tools.bench.ab_point --repo . --model MODEL_DIR --out new.json

Prints and writes one JSON object: the commit, the point, TTFT/TPOT percentiles, failures.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvpush.tools.bench.stats import percentile  # imported before the checkout's own kvpush replaces ours

VOCAB = 4096
PARTS = ("connector", "otel", "services", "shared", "tools")


def _source_path(repo: Path) -> Path:
    """The folder to put first on PYTHONPATH so that ``repo``'s code is what runs."""
    if not (repo / "kvpush" / "__init__.py").exists():
        return repo  # the old layout: top-level packages
    overlay = Path(tempfile.mkdtemp(prefix="kvpush-ab-"))
    (overlay / "kvpush").mkdir()
    for item in (repo / "kvpush").iterdir():
        if item.suffix == ".py":
            (overlay / "kvpush" / item.name).symlink_to(item)
    for part in PARTS:
        if (repo / part).is_dir():
            (overlay / "kvpush" / part).symlink_to(repo / part)
    return overlay


def _prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, VOCAB) for _ in range(length)]


async def _one(nc, subject: str, body: dict, timeout: float) -> dict:
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    sent = time.perf_counter()
    first = last = None
    tokens = 0
    try:
        await nc.publish(subject, json.dumps(body).encode(), reply=inbox)
        while True:
            reply = json.loads((await sub.next_msg(timeout=timeout)).data)
            now = time.perf_counter()
            if reply.get("finished"):
                if "error" in reply:
                    return {"ok": False, "error": reply["error"].get("code", "?")}
                tokens += len(reply.get("token_ids") or [])
                break
            first = first or now
            last = now
            tokens += len(reply.get("token_ids") or [])
    except Exception as exc:
        return {"ok": False, "error": type(exc).__name__}
    finally:
        await sub.unsubscribe()
    return {"ok": True, "ttft_ms": (first - sent) * 1000,
            "tpot_ms": (last - first) * 1000 / (tokens - 1) if tokens > 1 else math.nan, "tokens": tokens}


def _p(values: list[float], q: float) -> float:
    return round(percentile(values, q), 1)


def _cpu_by_process() -> dict[str, float]:
    """CPU seconds so far of every process this one started, and of theirs, by a short name
    (nats-server, scheduler, the prefill and decode workers, their engine cores)."""
    import psutil

    totals: dict[str, float] = {}
    for process in psutil.Process().children(recursive=True):
        try:
            times = process.cpu_times()
            name = process.name()
            cmdline = " ".join(process.cmdline())
        except psutil.Error:
            continue
        for role in ("scheduler", "prefill", "decode", "gateway"):
            if f" {role}" in cmdline:
                name = role
                break
        if name.startswith("VLLM"):  # an engine core, or its worker: named after the kvpush worker above it
            lines = [" ".join(p.cmdline()) for p in process.parents()]
            role = next((r for line in lines for r in ("prefill", "decode") if f" {r}" in line), "?")
            name = f"engine:{role}"
        totals[name] = totals.get(name, 0.0) + times.user + times.system + times.children_user + times.children_system
    return totals


async def _run(args, Stack, LocalNatsServer, subject: str, prefix_off: bool) -> dict:
    import nats

    out = Path(args.out).resolve()
    env = {"KVPUSH_LOG_LEVEL": "WARNING", "OTEL_SDK_DISABLED": "true", "OTEL_METRICS_EXPORTER": "none",
           "OTEL_TRACES_EXPORTER": "none"}
    with LocalNatsServer() as server:
        kwargs = dict(nats_url=server.url, max_model_len=args.input_len + args.output_len + 16,
                      connector="kvpush", log_dir=out.parent / (out.stem + "-logs"), extra_env=env)
        if prefix_off:
            kwargs["prefix_caching"] = "off"
        if args.binding == "split":  # each engine's OpenMP threads on a core of its own
            kwargs["role_env"] = {"prefill": {"VLLM_CPU_OMP_THREADS_BIND": "0"},
                                  "decode": {"VLLM_CPU_OMP_THREADS_BIND": "1"}}
        stack = Stack(args.model, **kwargs)
        stack.start()
        try:
            await stack.wait_ready(timeout=600)
            nc = await nats.connect(server.url)
            try:
                def body(seed: int, request_id: str) -> dict:
                    return {"prompt_token_ids": _prompt(args.input_len, seed), "max_tokens": args.output_len,
                            "ignore_eos": True, "request_id": request_id, "transfer_mode": args.mode}

                for i in range(args.warmup):
                    await _one(nc, subject, body(10_000 + i, f"warm-{i}-{time.time_ns()}"), args.timeout)
                before = _cpu_by_process()
                Path(args.out + ".load").write_text(f"{time.time()}\n")  # for a profiler to start on
                rng = random.Random(args.seed)
                tasks = []
                started = time.perf_counter()
                for i in range(args.requests):
                    request_id = f"ab-{i}-{time.time_ns()}"
                    tasks.append(asyncio.create_task(_one(nc, subject, body(args.seed * 1000 + i, request_id),
                                                          args.timeout)))
                    await asyncio.sleep(rng.expovariate(args.rate))
                    if time.perf_counter() - started > args.time_limit_s:
                        break
                results = await asyncio.gather(*tasks)
                after = _cpu_by_process()
            finally:
                await nc.close()
        finally:
            stack.stop()
    ok = [r for r in results if r["ok"]]
    return {
        "input_len": args.input_len, "rate": args.rate, "binding": args.binding, "output_len": args.output_len, "mode": args.mode,
        "requests": len(results), "failed": [r["error"] for r in results if not r["ok"]],
        "ttft_p50_ms": _p([r["ttft_ms"] for r in ok], 0.5), "ttft_p99_ms": _p([r["ttft_ms"] for r in ok], 0.99),
        "tpot_p50_ms": _p([r["tpot_ms"] for r in ok], 0.5), "tpot_p99_ms": _p([r["tpot_ms"] for r in ok], 0.99),
        "cpu_s": {name: round(after[name] - before.get(name, 0.0), 2) for name in sorted(after)},
        "ttft_ms": [round(r["ttft_ms"], 1) for r in ok],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", type=Path, required=True, help="the checkout whose stack runs")
    parser.add_argument("--model", required=True, help="a model folder (the same for every commit)")
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--rate", type=float, default=1.5)
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--mode", default="push", choices=["push", "pull"])
    parser.add_argument("--binding", default="default", choices=["default", "split"],
                        help="default: vLLM's own; split: prefill's engine on core 0, decode's on core 1")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds without a reply that fail a request")
    parser.add_argument("--time-limit-s", type=float, default=120.0, help="no request starts after this")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    repo = args.repo.resolve()
    args.out = str(Path(args.out).resolve())
    source = _source_path(repo)
    os.environ["PYTHONPATH"] = os.pathsep.join([str(source), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    for name in [m for m in sys.modules if m == "kvpush" or m.startswith("kvpush.")]:
        del sys.modules[name]  # this module's own package, from the editable install
    # Not the current folder: ``python -m`` puts it first on the path, in this process and in
    # every child the stack starts, and a checkout there would win over ``source``.
    os.chdir(tempfile.mkdtemp(prefix="kvpush-ab-cwd-"))
    sys.path[:] = [str(source)] + [p for p in sys.path if p not in ("", str(Path.cwd()), str(repo))]
    # The checkout's own modules, by name: an old commit has no kvpush package.
    if (source / "kvpush").exists():
        prefix, launch = "kvpush.", "services.launch."
    elif (source / "services" / "launch").is_dir():  # top-level packages, the launcher in its own folder
        prefix, launch = "", "services.launch."
    else:  # the first layout: top-level packages, the launcher beside the services
        prefix, launch = "", "services."
    LocalNatsServer = importlib.import_module(f"{prefix}{launch}natsd").LocalNatsServer
    Stack = importlib.import_module(f"{prefix}{launch}stack").Stack
    wire = importlib.import_module(f"{prefix}shared.wire")
    prefix_off = True
    if not (source / "kvpush").exists():
        prefix_off = "prefix_caching" in Stack.__init__.__code__.co_varnames
    commit = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True).stdout.strip())
    result = {"repo": str(repo), "commit": commit + ("+dirty" if dirty else ""), "model": args.model,
              **asyncio.run(_run(args, Stack, LocalNatsServer, wire.GENERATE_SUBJECT, prefix_off))}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "ttft_ms"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
