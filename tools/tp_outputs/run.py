"""The run: the prompts, one single-engine reference per TP (``kvpush.tools.reference``, with
``logprobs=2``), then one kvpush stack per TP pair (one prefill, one decode, prefix caching
off, so that every prompt is computed where its mode says), every request sent in every
mode through it (the mode is the request's ``transfer_mode``), and each output judged
(``compare``). Writes ``results.json`` (every output, its verdict and the counts) and
``summary.md`` into ``--out``; a reference already in ``--out`` for the same requests is
used again."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
import uuid
from dataclasses import asdict
from pathlib import Path

from kvpush.tools.tp_outputs.compare import Reference, Verdict, count, judge

# 20 prompt lengths from 1 to 1800 tokens: below, at and across the CPU block (128), up to
# most of the context.
LENGTHS = (1, 3, 17, 64, 127, 128, 129, 200, 255, 256, 300, 384, 500, 640, 700, 900, 1024, 1100, 1300, 1800)
SAMPLINGS = {"greedy": {"temperature": 0.0}, "seeded": {"temperature": 0.8, "top_p": 0.9, "seed": 7}}
COMBOS = ((2, 2), (2, 1), (1, 2))
MAX_MODEL_LEN = 2048
REQUEST_TIMEOUT_S = 600.0


def prompts(vocab_size: int, seed: int = 44) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab_size) for _ in range(n)] for n in LENGTHS]


def requests(prompt_ids: list[list[int]], max_tokens: int) -> list[dict]:
    """Every (prompt, sampling) pair, as both the reference and kvpush take it; the
    reference also asks for each position's two most likely tokens."""
    return [{"prompt_token_ids": p, "max_tokens": max_tokens, "ignore_eos": True, **params}
            for params in SAMPLINGS.values() for p in prompt_ids]


def reference(model: str, tp: int, reqs: list[dict], out: Path, say) -> list[Reference]:
    """The single engine's answers at ``tp``, run once (kept in ``out``) for these requests."""
    tokens_file, asked = out / f"reference-tp{tp}.json", out / f"reference-tp{tp}.requests.json"
    body = [{**r, "logprobs": 2} for r in reqs]
    if not (tokens_file.exists() and asked.exists() and json.loads(asked.read_text()) == body):
        asked.write_text(json.dumps(body))
        say(f"single vLLM engine at TP {tp}: {len(body)} requests")
        started = time.monotonic()
        with open(out / f"reference-tp{tp}.log", "w") as log:
            subprocess.run([sys.executable, "-m", "kvpush.tools.reference", "--model", model, "--requests", str(asked),
                            "--out", str(tokens_file), "--max-model-len", str(MAX_MODEL_LEN),
                            "--tensor-parallel-size", str(tp)], stdout=log, stderr=subprocess.STDOUT, check=True,
                           timeout=1800)
        say(f"  done in {time.monotonic() - started:.0f} s")
    tokens = json.loads(tokens_file.read_text())
    logprobs = json.loads(Path(f"{tokens_file}.logprobs.json").read_text())
    return [Reference(tp, t, lp) for t, lp in zip(tokens, logprobs)]


async def through_kvpush(model: str, prefill_tp: int, decode_tp: int, modes: list[str], reqs: list[dict],
                         out: Path, concurrency: int, say) -> list[dict]:
    """Every request in every mode through one stack at this TP pair: per request, its
    tokens, the path it took, or its error."""
    import nats

    from kvpush.client import generate_all
    from kvpush.services.launch.stack import Stack
    from kvpush.shared import wire

    label = f"tp{prefill_tp}x{decode_tp}"
    stack = Stack(model, max_model_len=MAX_MODEL_LEN, prefix_caching="off", prefill_tp=prefill_tp,
                  decode_tp=decode_tp, log_dir=out / "logs" / label, extra_env={"KVPUSH_LOG_LEVEL": "WARNING"})
    started = time.monotonic()
    say(f"kvpush P TP{prefill_tp} -> D TP{decode_tp}: starting")
    stack.start()
    rows = []
    try:
        await stack.wait_ready(timeout=900)
        say(f"  ready in {time.monotonic() - started:.0f} s")
        nc = await nats.connect(stack.nats_url)
        gate = asyncio.Semaphore(concurrency)

        async def one(mode: str, index: int, body: dict) -> dict:
            row = {"combo": label, "prefill_tp": prefill_tp, "decode_tp": decode_tp, "mode": mode, "index": index,
                   "sampling": "greedy" if body["temperature"] == 0.0 else "seeded",
                   "prompt_tokens": len(body["prompt_token_ids"])}
            request = {**body, "transfer_mode": mode, "request_id": f"{label}-{mode}-{index}-{uuid.uuid4().hex[:8]}"}
            async with gate:
                try:
                    tokens, _, final = await generate_all(nc, request, timeout=REQUEST_TIMEOUT_S)
                except (TimeoutError, RuntimeError, OSError) as exc:
                    return {**row, "tokens": None, "error": f"{type(exc).__name__}: {exc}"}
            if not isinstance(final, wire.FinalReply):
                return {**row, "tokens": None, "error": f"{final.error.code}: {final.error.message}"}
            path = final.path
            return {**row, "tokens": tokens, "served_mode": path.mode if path else None,
                    "received_tokens": path.received_tokens if path else None,
                    "recomputed_tokens": path.recomputed_tokens if path else None,
                    "kv_checksum": path.kv_checksum if path else None,
                    "kv_failure": path.kv_failure if path else ""}

        try:
            for mode in modes:
                mode_started = time.monotonic()
                rows += await asyncio.gather(*(one(mode, i, body) for i, body in enumerate(reqs)))
                say(f"  {mode}: {len(reqs)} requests in {time.monotonic() - mode_started:.0f} s")
        finally:
            await nc.close()
    finally:
        stack.stop()
    return rows


def as_asked(row: dict) -> bool:
    """Served in the mode asked, every prompt token received (push, pull) or computed on
    decode (local), none recomputed after a failed transfer."""
    if row.get("tokens") is None or row.get("served_mode") != row["mode"] or row.get("recomputed_tokens"):
        return False
    return row["mode"] == "local" or row.get("received_tokens") is not None


def judged(rows: list[dict], references: dict[int, list[Reference]]) -> list[dict]:
    for row in rows:
        refs = [references[tp][row["index"]] for tp in dict.fromkeys((row["prefill_tp"], row["decode_tp"]))]
        row["verdict"] = Verdict("failed") if row.get("tokens") is None else judge(row["tokens"], refs)
        row["as_asked"] = as_asked(row)
    return rows


def summary(rows: list[dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["combo"], row["prefill_tp"], row["decode_tp"], row["mode"], row["sampling"]),
                          []).append(row)
    return [{"combo": combo, "mode": mode, "sampling": sampling, **count(group, p, d)}
            for (combo, p, d, mode, sampling), group in groups.items()]


def table(counts: list[dict]) -> str:
    lines = ["| P TP -> D TP | mode | sampling | outputs | = prefill's TP | = decode's TP | = either "
             "| ties | differ | failed | not as asked | KV checksum verified |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for c in counts:
        p, d = c["combo"][2:].split("x")
        lines.append(f"| {p} -> {d} | {c['mode']} | {c['sampling']} | {c['requests']} | {c['equal_prefill_tp']} "
                     f"| {c['equal_decode_tp']} | {c['equal_either']} | {c['ties']} | {c['differs']} "
                     f"| {c['failed']} | {c['not_as_asked']} | {c['checksum_verified']} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    from kvpush.services.launch.model import build_model, default_model_dir
    from kvpush.tools.machine import cpu_model

    parser = argparse.ArgumentParser(prog="python -m kvpush.tools.tp_outputs", description=__doc__)
    parser.add_argument("--model", help="a local model folder (default: the built-in small model, 2 KV heads)")
    parser.add_argument("--combos", default=",".join(f"{p}x{d}" for p, d in COMBOS),
                        help="prefill TP x decode TP pairs, comma-separated")
    parser.add_argument("--modes", default="push,pull,local")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight at once")
    parser.add_argument("--out", default="tp-outputs")
    args = parser.parse_args()

    def say(line: str) -> None:
        print(f"[tp-outputs] {line}", file=sys.stderr, flush=True)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = args.model or str(build_model(default_model_dir("small"), profile="small"))
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    combos = [tuple(int(x) for x in pair.split("x")) for pair in args.combos.split(",")]
    modes = args.modes.split(",")
    reqs = requests(prompts(vocab), args.max_tokens)
    references = {tp: reference(model, tp, reqs, out, say) for tp in sorted({tp for pair in combos for tp in pair})}
    rows = []
    for prefill_tp, decode_tp in combos:
        rows += asyncio.run(through_kvpush(model, prefill_tp, decode_tp, modes, reqs, out, args.concurrency, say))
        judged(rows, references)
        (out / "results.json").write_text(json.dumps(
            {"machine": {"processor": cpu_model(), "cpus": os.cpu_count()}, "model": model, "lengths": LENGTHS,
             "max_tokens": args.max_tokens, "samplings": SAMPLINGS, "tie_gap": 1e-4, "counts": summary(rows),
             "reference_pairs_equal": {f"tp{a}=tp{b}": sum(x.token_ids == y.token_ids
                                                           for x, y in zip(references[a], references[b]))
                                       for a in references for b in references if a < b},
             "outputs": [{**{k: v for k, v in row.items() if k != "verdict"}, "verdict": asdict(row["verdict"])}
                         for row in rows]}, indent=1))
    (out / "summary.md").write_text(table(summary(rows)))
    print(table(summary(rows)))
    bad = sum(row["verdict"].outcome in ("differs", "failed") or not row["as_asked"] for row in rows)
    return 1 if bad else 0
