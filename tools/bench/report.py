"""``kvpush bench``'s tables and plots, from its points (``results.Point``).

One table per workload: each variant at each rate, with its ratio to vLLM's NixlConnector
at the same point (TTFT p50 / p99, TPOT p50); kvpush rows add the TTFT split and the
handoff overhead from the spans. Then the per-process CPU, the binding probe, the decode's
CPU while it waits for KV, and the raw NIXL bandwidth.
"""

from __future__ import annotations

from dataclasses import replace

import math
from pathlib import Path

from kvpush.tools.bench import transfer
from kvpush.tools.bench.results import BASELINE, within_capacity


def _ms(value) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value / 1000:.2f} s" if value >= 1000 else f"{value:.0f} ms" if value >= 10 else f"{value:.1f} ms"


def _ratio(value, base) -> str:
    if not value or not base:
        return "–"
    return f"{value / base:.2f}"


def workload_table(points: list) -> str:
    base = {p.rate: p.summary for p in points if p.variant == BASELINE and p.summary}
    out = ["| system | rate (req/s) | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | throughput (req/s) | failed | "
           "TTFT p50 / vLLM | TTFT p99 / vLLM | TPOT p50 / vLLM | within capacity | TTFT split p50 "
           "(queue / compute / coordination / transfer) | handoff overhead p99 |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---:|"]
    for p in sorted(points, key=lambda p: (p.rate, p.variant)):
        s = p.summary
        if not s:
            out.append(f"| {p.variant} | {p.rate:g} | failed: {p.error[:80]} |" + " |" * 11)
            continue
        b = base.get(p.rate, {})
        split = _split(p.segments_ms)
        overhead = p.handoff_overhead_ms.get("p99")
        out.append(
            f"| {p.variant} | {p.rate:g} | {_ms(s['p50_ttft_ms'])} | {_ms(s['p99_ttft_ms'])} | {_ms(s['p50_tpot_ms'])} "
            f"| {_ms(s['p99_tpot_ms'])} | {s['request_throughput']:.2f} | {s['failed']}/{p.requests} "
            f"| {_ratio(s['p50_ttft_ms'], b.get('p50_ttft_ms'))} | {_ratio(s['p99_ttft_ms'], b.get('p99_ttft_ms'))} "
            f"| {_ratio(s['p50_tpot_ms'], b.get('p50_tpot_ms'))} | {'yes' if within_capacity(p, points) else 'no'} "
            f"| {split} | {_ms(overhead) if overhead is not None else '–'} |")
    return "\n".join(out) + "\n"


CATEGORY_OF = {"dispatch": "coordination", "prefill queue": "queue", "prefill compute": "compute",
               "handoff": "coordination", "transfer": "transfer", "kv notice": "coordination",
               "decode first token": "compute", "decode queue": "queue", "decode prompt and first token": "compute"}


def _split(segments: dict) -> str:
    if not segments:
        return "–"
    totals = {"queue": 0.0, "compute": 0.0, "coordination": 0.0, "transfer": 0.0}
    for name, stats in segments.items():
        totals[CATEGORY_OF.get(name, "coordination")] += stats["p50"]
    return " / ".join(f"{totals[k]:.0f}" for k in ("queue", "compute", "coordination", "transfer")) + " ms"


def cpu_table(points: list) -> str:
    emulated = any(p.cpu_share for p in points)
    out = ["| workload | system | rate | CPU s/s by process |" + (" k | CPU share of the forwards (all; by engine pid) | late forwards | late transfers | host gap between steps, ms (by engine pid) |"
                                                              if emulated else ""),
           "|---|---|---:|---|" + ("---:|---|---:|---:|---|" if emulated else "")]
    for p in points:
        if p.cpu_s_per_s:
            cpu = ", ".join(f"{name} {value:.2f}" for name, value in sorted(p.cpu_s_per_s.items()))
            share = ""
            if emulated:
                by_pid = ", ".join(f"{pid} {value:.2f}" for pid, value in p.cpu_share.get("by_pid", {}).items())
                late = f"{p.cpu_share['late']} of {p.cpu_share['forwards']}" if "late" in p.cpu_share else "–"
                moved = p.late_transfers
                late_moves = f"{moved['late']} of {moved['transfers']}" if moved else "–"
                gaps = ", ".join(f"{pid} {gap:.1f}" for pid, gap in p.cpu_share.get("step_gap_ms", {}).items()) or "–"
                share = (f" {p.summary.get('dilation', '–')} | {p.cpu_share.get('all')}; {by_pid} | {late} | {late_moves}"
                         f" | {gaps} |")
            out.append(f"| {p.workload} | {p.variant} | {p.rate:g} | {cpu} |{share}")
    return "\n".join(out) + "\n"


def tables(bench) -> str:
    parts = []
    machine_cores = bench.config.bindings
    parts.append("Bindings kept: " + ", ".join(f"{system} **{binding}**" for system, binding in machine_cores.items())
                 + "\n")
    if "kvpush" in bench.config.systems:
        parts.append(f"kvpush's layer-wise push: **{bench.config.push_by_layer}**\n")
    emulation = getattr(bench.config, "emulation", None)
    if emulation is not None:
        ks = sorted({p.summary["dilation"] for p in bench.points if p.summary.get("dilation")})
        link = ("loopback" if emulation.link == "loopback" else
                "shaped to " + ", ".join(f"{replace(emulation, dilation=k).link_bits_per_s / 1e6:.0f}"
                                         f" Mbit/s at k = {k:g}" for k in ks))
        parts.append(f"**Emulated GPUs**: {emulation.target}, k = {', '.join(f'{k:g}' for k in ks) or emulation.dilation}"
                     + (" (chosen per workload: its longest prompt)" if emulation.dilation == "auto" else "")
                     + " (every time below is the client's divided by k, every rate multiplied by it), link "
                     + link + f", NIXL progress thread {emulation.progress_thread}, pacing {emulation.pacing}. A point whose "
                     "CPU share is above 0.2 measured the CPU more than the emulated GPUs.\n")
    if bench.probes:
        parts.append("### Binding probe\n")
        parts.append(workload_table(bench.probes).replace("| system |", "| system (binding in the next column) |", 1))
        parts.append("\n| system | binding | TTFT p50 | TPOT p50 |\n|---|---|---:|---:|\n" + "".join(
            f"| {p.variant} | {p.binding} | {_ms(p.summary.get('p50_ttft_ms'))} | {_ms(p.summary.get('p50_tpot_ms'))} |\n"
            for p in bench.probes))
    for workload in dict.fromkeys(p.workload for p in bench.points):
        at = [p for p in bench.points if p.workload == workload]
        parts.append(f"### {workload} ({at[0].topology}, {at[0].input_len}-token prompts)\n")
        parts.append(workload_table(at))
    push_pull = push_against_pull(bench.points)
    if push_pull:
        parts.append("### kvpush push against kvpush pull (the same engines, the same point)\n")
        parts.append(push_pull)
    headline = seed_headline(bench.points)
    if headline:
        parts.append("### The seed's claim: push against vLLM's NixlConnector at each point\n")
        parts.append(headline)
    parts.append("### CPU per process (CPU-seconds per second over the point)\n")
    parts.append(cpu_table(bench.points))
    if bench.at_rest:
        parts.append("### CPU at rest: no request, right after each system's start (CPU-seconds per second)\n")
        parts.append(at_rest_table(bench.at_rest))
    if bench.idle_cpu:
        parts.append("### kvpush decode worker CPU while idle, and while one request waits for KV\n")
        parts.append("| idle (s/s) | waiting for KV (s/s) | waiting, by process |\n|---:|---:|---|\n" + "".join(
            f"| {r['idle_cpu_s_per_s']:.3f} | {r['waiting_cpu_s_per_s']:.3f} | {r['waiting_by_process']} |\n"
            for r in bench.idle_cpu))
    if bench.raw_nixl:
        parts.append("### Our writer against a raw NIXL WRITE (same run)\n")
        parts.append(transfer.markdown(bench.raw_nixl))
    if getattr(bench, "retried", None):
        parts.append("### Points measured again on a fresh start (the first try failed)\n" + "".join(
            f"- {r['variant']}, {r['workload']} at {r['rate']:g} req/s: {(r['first_error'] or 'failed requests')[:200]}\n"
            for r in bench.retried))
    if bench.errors:
        parts.append("### Errors\n" + "".join(f"- {e}\n" for e in bench.errors))
    return "\n".join(parts)


def push_against_pull(points: list) -> str:
    """Push's TTFT and TPOT over pull's at each point where both ran: a ratio below 1 is push
    ahead. Repeats of a point (the same workload and rate, run again) each get a row."""
    pulls: dict[tuple, list] = {}
    for p in points:
        if p.variant == "kvpush-pull" and p.summary:
            pulls.setdefault((p.workload, p.rate), []).append(p)
    rows = []
    for p in points:
        if p.variant != "kvpush-push" or not p.summary or not pulls.get((p.workload, p.rate)):
            continue
        pull = pulls[(p.workload, p.rate)].pop(0)
        s, q = p.summary, pull.summary
        rows.append(f"| {p.workload} | {p.rate:g} | {_ms(s['p50_ttft_ms'])} / {_ms(q['p50_ttft_ms'])} "
                    f"| {_ratio(s['p50_ttft_ms'], q['p50_ttft_ms'])} | {_ratio(s['p99_ttft_ms'], q['p99_ttft_ms'])} "
                    f"| {_ms(s['p50_tpot_ms'])} / {_ms(q['p50_tpot_ms'])} | {_ratio(s['p50_tpot_ms'], q['p50_tpot_ms'])} |")
    if not rows:
        return ""
    return ("| workload | rate | TTFT p50 push / pull | TTFT p50 ratio | TTFT p99 ratio | TPOT p50 push / pull "
            "| TPOT p50 ratio |\n|---|---:|---:|---:|---:|---:|---:|\n" + "\n".join(rows) + "\n")


# vLLM's NixlPushConnector against its NixlConnector, as reported (vLLM PR #35264; the seed):
# TTFT up to 3x lower, TPOT about 30% lower, Qwen3-32B 1P1D on P5en, 1k-16k inputs, 1-8 req/s.
SEED_TTFT_SPEEDUP = 3.0
SEED_TPOT_CUT = 0.30
AGAINST_NIXL = ("kvpush-push", "vllm-nixl-push")


def seed_headline(points: list) -> str:
    """The seed's claim at each point where vLLM's NixlConnector ran: how many times lower
    kvpush push's and vLLM NixlPushConnector's TTFT p50 (and p99) are than NixlConnector's,
    and how much lower their TPOT p50 is, beside the reported 3x and 30%. Above 1x and
    above 0% is better than NixlConnector. Repeats of a point are set against the
    NixlConnector run of the same repeat."""
    base = {(p.workload, p.rate, p.repeat): p.summary for p in points if p.variant == BASELINE and p.summary}
    rows = []
    for p in sorted(points, key=lambda p: (p.input_len, p.workload, p.rate, p.repeat, p.variant)):
        b = base.get((p.workload, p.rate, p.repeat))
        if p.variant not in AGAINST_NIXL or not p.summary or not b:
            continue
        s = p.summary
        rows.append(f"| {p.workload} | {p.rate:g} | {p.variant} | {_times(b['p50_ttft_ms'], s['p50_ttft_ms'])} "
                    f"| {_times(b['p99_ttft_ms'], s['p99_ttft_ms'])} | {_cut(b['p50_tpot_ms'], s['p50_tpot_ms'])} |")
    if not rows:
        return ""
    return (f"| workload | rate | system | TTFT p50: NixlConnector's / its own (seed: up to "
            f"{SEED_TTFT_SPEEDUP:g}x) | TTFT p99, likewise | TPOT p50 lower than NixlConnector's by (seed: about "
            f"{SEED_TPOT_CUT:.0%}) |\n|---|---:|---|---:|---:|---:|\n" + "\n".join(rows) + "\n")


def _times(base, value) -> str:
    return f"{base / value:.2f}x" if base and value else "–"


def _cut(base, value) -> str:
    return f"{(base - value) / base:+.0%}" if base and value else "–"


def at_rest_table(rows: list[dict]) -> str:
    """One row per system started: its CPU at rest in total, per process (with its busiest
    thread), and per vLLM engine process (EngineCore and each Worker_TP rank) of each."""
    out = ("| system | topology | binding | total | by process (busiest thread) | engine processes |\n"
           "|---|---|---|---:|---|---|\n")
    for row in rows:
        by = ", ".join(f"{name} {rate:.2f} ({row['busiest_thread_s_per_s'].get(name, 0.0):.2f})"
                       for name, rate in sorted(row["cpu_s_per_s"].items()))
        engines = "; ".join(f"{name}: " + ", ".join(f"{title} {rate:.3f}" for title, rate in sorted(titles.items()))
                            for name, titles in sorted(row.get("engine_processes", {}).items())) or "–"
        out += (f"| {row['system']} | {row.get('topology', '–')} | {row['binding']} "
                f"| {sum(row['cpu_s_per_s'].values()):.2f} | {by} | {engines} |\n")
    return out


def plots(points: list, folder: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for workload in dict.fromkeys(p.workload for p in points):
        at = [p for p in points if p.workload == workload and p.summary]
        if not at or len({p.rate for p in at}) < 1:
            continue
        fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
        for variant in sorted({p.variant for p in at}):
            series = sorted((p for p in at if p.variant == variant), key=lambda p: p.rate)
            rates = [p.rate for p in series]
            axes[0].plot(rates, [p.summary["p50_ttft_ms"] / 1000 for p in series], marker="o", label=variant)
            axes[1].plot(rates, [p.summary["p99_ttft_ms"] / 1000 for p in series], marker="o", label=variant)
            axes[2].plot(rates, [p.summary["p50_tpot_ms"] for p in series], marker="o", label=variant)
        for ax, title, unit in zip(axes, ("TTFT p50", "TTFT p99", "TPOT p50"), ("s", "s", "ms")):
            ax.set_title(f"{title}, {workload}")
            ax.set_xlabel("arrival rate (req/s)")
            ax.set_ylabel(unit)
            ax.set_yscale("log")
            ax.grid(alpha=0.3)
        axes[0].legend()
        fig.tight_layout()
        path = folder / f"latency-{workload.replace(' ', '_')}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    return written
