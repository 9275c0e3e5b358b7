"""The multi-turn benchmark (``kvpush bench-multiturn``): the same conversations
(``kvpush.tools.bench.multiturn``) against each system (kvpush in a transfer mode, or a
``vllm serve`` pair behind its proxy) with prefix caching on and then off, each on a fresh
stack; every answer checked against one plain vLLM instance given the same prompts
(prefix caching on there too). Writes ``multiturn.json`` (per turn) and ``multiturn.md``.

With ``--emulate <model>@<gpu>`` every engine runs that deployment's timed model
(``kvpush.tools.bench.emulation``): forwards and the think time between turns take k times
their emulated time, each engine sits on a host of its own behind a link shaped to the
deployment's (every pair of engines, both ways), and every time reported is divided by k.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tempfile
from dataclasses import asdict, replace
from pathlib import Path

from kvpush.services.launch.model import build_model, default_model_dir
from kvpush.tools.bench import emulation, multiturn
from kvpush.tools.bench.systems import KvpushSystem, Topology, VllmServeSystem
from kvpush.tools.emulation.link import EngineHosts
from kvpush.tools.otlp_receiver import OtlpReceiver

# vLLM's pair at its best binding here (docs/benchmarks.md); kvpush at its default.
VLLM_BINDING = "split"


async def _run_system(system_name: str, model: str, max_model_len: int, topology: Topology, prefix_caching: str,
                      load: multiturn.Conversations, log_dir: Path, otlp: str, prefix_fetch: str = "on",
                      emulated: emulation.Emulation | None = None) -> list[multiturn.Turn]:
    name = Path(model).name
    env = emulated.engine_env(log_dir / "forwards.jsonl") if emulated is not None else {}
    hosts = receiver = None
    if emulated is not None and emulated.link == "shaped":
        hosts = EngineHosts(topology.prefill, topology.decode, emulated.link_bits_per_s).start()
        receiver = OtlpReceiver(host=EngineHosts.root_address).__enter__()  # the hosts' spans reach it
        otlp = receiver.endpoint
    try:
        if system_name.startswith("kvpush-"):
            system = KvpushSystem(model, max_model_len, topology, "auto", log_dir, otlp,
                                  prefix_caching=prefix_caching,
                                  engine_env={**env, "KVPUSH_PREFIX_FETCH": prefix_fetch}, hosts=hosts)
            extra = {"transfer_mode": system_name.removeprefix("kvpush-")}
        else:
            system = VllmServeSystem(system_name, model, name, max_model_len, topology, VLLM_BINDING, log_dir,
                                     prefix_caching=prefix_caching, engine_env=env or None, hosts=hosts)
            extra = {}
        await system.start()
        try:
            timeout_s = 900.0 * (emulated.k if emulated is not None else 1.0)
            turns = await multiturn.run(system.base_url, name, load, extra, request_prefix=f"mt-{prefix_caching}",
                                        timeout_s=timeout_s)
        finally:
            system.stop()
    finally:
        if receiver is not None:
            receiver.__exit__(None, None, None)
        if hosts is not None:
            hosts.stop()
    if emulated is not None:  # emulated time: every time k times shorter than measured
        for turn in turns:
            turn.ttft_ms /= emulated.k
            turn.e2e_ms /= emulated.k
    return turns


def _references(model: str, max_model_len: int, prompts: list[list[int]], output_len: int) -> dict[tuple, list[int]]:
    """What a single plain vLLM instance answers each distinct prompt, by prompt: one
    engine start for every run's turns (runs that answered alike ask the same prompts)."""
    distinct = list(dict.fromkeys(tuple(prompt) for prompt in prompts))
    if not distinct:
        return {}
    with tempfile.TemporaryDirectory() as folder:
        requests, out = Path(folder) / "requests.json", Path(folder) / "out.json"
        requests.write_text(json.dumps([{"prompt_token_ids": list(prompt), "max_tokens": output_len, "ignore_eos": True}
                                        for prompt in distinct]))
        subprocess.run([sys.executable, "-m", "kvpush.tools.reference", "--model", model, "--requests", str(requests),
                        "--out", str(out), "--max-model-len", str(max_model_len)], check=True,
                       stdout=subprocess.DEVNULL)
        return dict(zip(distinct, json.loads(out.read_text())))


def configurations(system: str, fetch: str) -> list[tuple[str, str, str]]:
    """(label, prefix caching, prefix fetching) of each run of ``system``: kvpush with
    caching on, fetching on and/or off (``fetch``: on, off, both), then caching off; a
    system of vLLM's with caching on and off."""
    if not system.startswith("kvpush-"):
        return [(f"{system} prefix caching {caching}", caching, "off") for caching in ("on", "off")]
    fetching = ("on", "off") if fetch == "both" else (fetch,)
    return [*((f"{system} prefix caching on, fetching {f}", "on", f) for f in fetching),
            (f"{system} prefix caching off", "off", "off")]


def bench(model: str, out: Path, load: multiturn.Conversations, max_model_len: int, topology: Topology,
          systems: tuple[str, ...] = ("kvpush-push",), progress=print, fetch: str = "both",
          emulated: emulation.Emulation | None = None) -> dict:
    """``systems``: kvpush-<mode> (push, pull, auto, local) and vllm-nixl / vllm-nixl-push;
    ``fetch``: kvpush's prefix fetching in the runs with prefix caching on (on, off, both)."""
    out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[multiturn.Turn]] = {}
    with OtlpReceiver() as receiver:
        for system in systems:
            for label, caching, fetching in configurations(system, fetch):
                progress(f"{label}: {load.count} conversations x {load.turns} turns")
                driven = load if emulated is None else replace(load, think_s=load.think_s * emulated.k)
                runs[label] = asyncio.run(_run_system(system, model, max_model_len, topology, caching, driven,
                                                      out / "logs" / label.replace(" ", "-").replace(",", ""),
                                                      receiver.endpoint, prefix_fetch=fetching, emulated=emulated))
    results = {"load": asdict(load), "topology": topology.label, "runs": {},
               "emulated": None if emulated is None else {"target": emulated.target, "dilation": emulated.k,
                                                          "link": emulated.link,
                                                          "link_bits_per_s": emulated.link_bits_per_s}}
    answered = {label: [t for t in turns if not t.error] for label, turns in runs.items()}
    references = _references(model, max_model_len, [t.prompt for ok in answered.values() for t in ok],
                             load.output_len)
    for label, turns in runs.items():
        ok = answered[label]
        expected = [references[tuple(t.prompt)] for t in ok]
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
             f"{load['concurrency']} at a time, think time {load.get('think_s', 0):g} s ({results['topology']})"
             + (f"; emulated {results['emulated']['target']}, k = {results['emulated']['dilation']:g}, "
                f"link {results['emulated']['link']}, times in emulated time" if results.get("emulated") else ""), "",
             "| system | turn 1 TTFT p50 | turns 2+ TTFT p50 | turns 2+ TTFT p99 | history elsewhere: TTFT p50 | p99 "
             "| turns 2+: held / fetched / recomputed | turns | failed | outputs unlike the reference |",
             "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|"]
    for label, run in results["runs"].items():
        first, later, moved = run["first_turn_ttft_ms"], run["later_turns_ttft_ms"], run["moved_history_ttft_ms"]
        sources = run["prefix_sources"]
        shares = " / ".join(f"{sources.get(k, 0):.0%}" for k in ("held", "fetched", "recomputed")) \
            if any(sources.get(k) for k in ("held", "fetched", "recomputed")) else "-"
        lines.append(f"| {label} | {first.get('p50', 0):.0f} ms | {later.get('p50', 0):.0f} ms | "
                     f"{later.get('p99', 0):.0f} ms | {_ms(moved, 'p50')} (n={moved.get('n', 0)}) | "
                     f"{_ms(moved, 'p99')} | {shares} | {run['turns']} | {run['failed']} | "
                     f"{len(run['wrong_outputs'])} |")
    return "\n".join(lines) + "\n"


def _ms(stats: dict, key: str) -> str:
    return f"{stats[key]:.0f} ms" if key in stats else "-"


def cmd(args) -> int:
    """``kvpush bench-multiturn``."""
    systems = tuple(args.systems.split(","))
    known = {"kvpush-push", "kvpush-pull", "kvpush-auto", "kvpush-local", "vllm-nixl", "vllm-nixl-push"}
    if unknown := [s for s in systems if s not in known]:
        print(f"unknown systems {unknown}; choose from {', '.join(sorted(known))}", file=sys.stderr)
        return 2
    emulated = None
    if args.emulate:
        try:
            emulated = emulation.Emulation(args.emulate, args.dilation, link=args.link)
        except ValueError as exc:
            print(f"--emulate {args.emulate}: {exc}", file=sys.stderr)
            return 2
        args.profile = emulated.profile
        longest = args.first_len + (args.turns - 1) * (args.output_len + args.turn_len)
        emulated = emulated.for_workload(longest)
    model = args.model or str(build_model(default_model_dir(args.profile), profile=args.profile))
    load = multiturn.Conversations(count=args.conversations, turns=args.turns, first_len=args.first_len,
                                   turn_len=args.turn_len, output_len=args.output_len,
                                   concurrency=args.concurrency, seed=args.seed, think_s=args.think_s)
    results = bench(model, Path(args.out), load, args.max_model_len, Topology(args.prefill, args.decode), systems,
                    progress=lambda line: print(line, file=sys.stderr, flush=True), fetch=args.fetch,
                    emulated=emulated)
    print(markdown(results))
    wrong = sum(len(run["wrong_outputs"]) + run["failed"] for run in results["runs"].values())
    return 1 if wrong else 0
