"""The multi-turn benchmark (``kvpush bench-multiturn``): the same conversations
(``kvpush.tools.bench.multiturn``) against each system (kvpush in a transfer mode, or a
``vllm serve`` pair behind its proxy) with prefix caching on and then off, each on a fresh
stack; every answer checked against one plain vLLM instance given the same prompts
(prefix caching on there too). Writes ``multiturn.json`` (per turn) and ``multiturn.md``.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from kvpush.services.launch.model import build_model, default_model_dir
from kvpush.tools.bench import multiturn
from kvpush.tools.bench.systems import KvpushSystem, Topology, VllmServeSystem
from kvpush.tools.otlp_receiver import OtlpReceiver

# vLLM's pair at its best binding here (docs/benchmarks.md); kvpush at its default.
VLLM_BINDING = "split"


async def _run_system(system_name: str, model: str, max_model_len: int, topology: Topology, prefix_caching: str,
                      load: multiturn.Conversations, log_dir: Path, otlp: str) -> list[multiturn.Turn]:
    name = Path(model).name
    if system_name.startswith("kvpush-"):
        system = KvpushSystem(model, max_model_len, topology, "auto", log_dir, otlp, prefix_caching=prefix_caching)
        extra = {"transfer_mode": system_name.removeprefix("kvpush-")}
    else:
        system = VllmServeSystem(system_name, model, name, max_model_len, topology, VLLM_BINDING, log_dir,
                                 prefix_caching=prefix_caching)
        extra = {}
    await system.start()
    try:
        return await multiturn.run(system.base_url, name, load, extra, request_prefix=f"mt-{prefix_caching}")
    finally:
        system.stop()


def _reference(model: str, max_model_len: int, turns: list[multiturn.Turn], output_len: int) -> list[list[int]]:
    with tempfile.TemporaryDirectory() as folder:
        requests, out = Path(folder) / "requests.json", Path(folder) / "out.json"
        requests.write_text(json.dumps([{"prompt_token_ids": t.prompt, "max_tokens": output_len, "ignore_eos": True}
                                        for t in turns]))
        subprocess.run([sys.executable, "-m", "kvpush.tools.reference", "--model", model, "--requests", str(requests),
                        "--out", str(out), "--max-model-len", str(max_model_len)], check=True,
                       stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


def bench(model: str, out: Path, load: multiturn.Conversations, max_model_len: int, topology: Topology,
          systems: tuple[str, ...] = ("kvpush-push",), progress=print) -> dict:
    """``systems``: kvpush-<mode> (push, pull, auto, local) and vllm-nixl / vllm-nixl-push."""
    out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[multiturn.Turn]] = {}
    with OtlpReceiver() as receiver:
        for system in systems:
            for caching in ("on", "off"):
                label = f"{system} prefix caching {caching}"
                progress(f"{label}: {load.count} conversations x {load.turns} turns")
                runs[label] = asyncio.run(_run_system(system, model, max_model_len, topology, caching, load,
                                                      out / "logs" / label.replace(" ", "-"), receiver.endpoint))
    results = {"load": asdict(load), "topology": topology.label, "runs": {}}
    for label, turns in runs.items():
        ok = [t for t in turns if not t.error]
        expected = _reference(model, max_model_len, ok, load.output_len) if ok else []
        wrong = [f"{t.conversation}/{t.turn}" for t, ref in zip(ok, expected) if t.tokens != ref]
        results["runs"][label] = {**multiturn.summary(turns), "wrong_outputs": wrong,
                                  "turns_detail": multiturn.records(turns)}
        progress(f"{label}: {json.dumps(multiturn.summary(turns))}; {len(wrong)} outputs unlike the reference")
    (out / "multiturn.json").write_text(json.dumps(results, indent=1))
    (out / "multiturn.md").write_text(markdown(results))
    return results


def markdown(results: dict) -> str:
    load = results["load"]
    lines = [f"{load['count']} conversations x {load['turns']} turns, {load['first_len']}-token opening, "
             f"{load['turn_len']} new tokens and {load['output_len']} answer tokens a turn, "
             f"{load['concurrency']} at a time ({results['topology']})", "",
             "| system | turn 1 TTFT p50 | turns 2+ TTFT p50 | turns 2+ TTFT p99 | turns | failed | outputs unlike the reference |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for label, run in results["runs"].items():
        first, later = run["first_turn_ttft_ms"], run["later_turns_ttft_ms"]
        lines.append(f"| {label} | {first.get('p50', 0):.0f} ms | {later.get('p50', 0):.0f} ms | "
                     f"{later.get('p99', 0):.0f} ms | {run['turns']} | {run['failed']} | {len(run['wrong_outputs'])} |")
    return "\n".join(lines) + "\n"


def cmd(args) -> int:
    """``kvpush bench-multiturn``."""
    systems = tuple(args.systems.split(","))
    known = {"kvpush-push", "kvpush-pull", "kvpush-auto", "kvpush-local", "vllm-nixl", "vllm-nixl-push"}
    if unknown := [s for s in systems if s not in known]:
        print(f"unknown systems {unknown}; choose from {', '.join(sorted(known))}", file=sys.stderr)
        return 2
    model = args.model or str(build_model(default_model_dir(args.profile), profile=args.profile))
    load = multiturn.Conversations(count=args.conversations, turns=args.turns, first_len=args.first_len,
                                   turn_len=args.turn_len, output_len=args.output_len,
                                   concurrency=args.concurrency, seed=args.seed)
    results = bench(model, Path(args.out), load, args.max_model_len, Topology(args.prefill, args.decode), systems,
                    progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(markdown(results))
    wrong = sum(len(run["wrong_outputs"]) + run["failed"] for run in results["runs"].values())
    return 1 if wrong else 0
