"""``kvpush bench``: kvpush push, kvpush pull, vLLM's NixlConnector and NixlPushConnector,
side by side, through the same stack and client path.

Per connector stack: start NATS + scheduler + one prefill + one decode worker, measure
nothing twice. kvpush push and pull share one stack (the mode is per request) and
alternate point by point, so drift hits both alike; vLLM's connectors need their own
engines and run one stack after the other. Per point: warm-up, then open-loop Poisson
arrivals of token-id prompts of an exact length, ``ignore_eos`` outputs of a fixed
length; per request the client measures TTFT, TPOT and end-to-end latency, and the
services' spans (sent to an in-process OTLP receiver) give the TTFT split.
"""

from __future__ import annotations

import asyncio
import csv
import json
import math
import os
import platform
import random
import time
import uuid
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tools import trace_view as view
from tools.otlp_receiver import OtlpReceiver
from tools.bench.stats import PointSummary, RequestResult, markdown_table, summarize
from services.launch.natsd import LocalNatsServer
from services.launch.stack import Stack
from shared import wire

CONNECTORS = ("kvpush-push", "kvpush-pull", "vllm-nixl", "vllm-nixl-push")
VOCAB = 4096


@dataclass
class BenchConfig:
    model: str
    profile: str
    connectors: list[str]
    input_lens: list[int]
    rates: list[float] | None  # None: fractions of the measured prefill capacity
    load_fractions: list[float]
    requests: int
    warmup: int
    output_len: int
    seed: int
    out: Path
    max_model_len: int = 0
    capacity_rps: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.max_model_len:
            self.max_model_len = max(self.input_lens) + self.output_len + 16


def _stack_groups(connectors: list[str]) -> list[tuple[str, list[str]]]:
    """(engine connector, bench connectors it serves), in a stable order."""
    groups: list[tuple[str, list[str]]] = []
    ours = [c for c in connectors if c.startswith("kvpush-")]
    if ours:
        groups.append(("kvpush", ours))
    groups += [(c, [c]) for c in connectors if not c.startswith("kvpush-")]
    return groups


def _prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, VOCAB) for _ in range(length)]


async def _one_request(nc, body: dict) -> dict:
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    sent = time.perf_counter()
    first = last = None
    tokens = 0
    try:
        await nc.publish(wire.GENERATE_SUBJECT, json.dumps(body).encode(), reply=inbox)
        while True:
            reply = json.loads((await sub.next_msg(timeout=600)).data)
            now = time.perf_counter()
            if reply.get("finished"):
                if "error" in reply:
                    return {"ok": False, "error": reply["error"]["code"]}
                break
            first = first or now
            last = now
            tokens += len(reply["token_ids"])
    except Exception as exc:
        return {"ok": False, "error": type(exc).__name__}
    finally:
        await sub.unsubscribe()
    ttft = (first - sent) * 1000
    return {
        "ok": True,
        "ttft_ms": ttft,
        "tpot_ms": (last - first) * 1000 / (tokens - 1) if tokens > 1 else math.nan,
        "e2e_ms": (last - sent) * 1000,
        "completion_tokens": tokens,
    }


class Bench:
    def __init__(self, config: BenchConfig, progress=None):
        self.config = config
        self.progress = progress
        self.results: list[RequestResult] = []
        self.points: list[PointSummary] = []
        self.idle_cpu: list[dict] = []  # decode worker CPU while idle vs while a request waits for KV
        self.errors: list[str] = []  # stacks that could not run

    async def run(self) -> None:
        c = self.config
        with OtlpReceiver() as receiver:
            self.receiver = receiver
            for engine_connector, bench_connectors in _stack_groups(c.connectors):
                try:
                    await self._with_stack(engine_connector, bench_connectors)
                except (RuntimeError, TimeoutError) as exc:  # one stack failing must not lose the others
                    self.errors.append(f"{engine_connector}: {exc}")
                    self._say(f"{engine_connector} stack failed: {exc} (logs in {c.out / 'logs'})")

    async def _with_stack(self, engine_connector: str, bench_connectors: list[str]) -> None:
        import nats

        c = self.config
        env = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": self.receiver.endpoint,
            "OTEL_METRICS_EXPORTER": "none",
            "KVPUSH_LOG_LEVEL": "WARNING",
        }
        with LocalNatsServer() as server:
            stack = Stack(c.model, nats_url=server.url, max_model_len=c.max_model_len, connector=engine_connector,
                          log_dir=c.out / "logs" / engine_connector, extra_env=env)
            self._say(f"starting the {engine_connector} stack")
            stack.start()
            try:
                await stack.wait_ready(timeout=600)
                nc = await nats.connect(server.url)
                try:
                    for input_len in c.input_lens:
                        await self._warm_up(nc, bench_connectors, input_len)
                        if input_len not in c.capacity_rps:
                            c.capacity_rps[input_len] = await self._measure_capacity(nc, bench_connectors[0], input_len)
                            self._say(f"prefill capacity at {input_len} tokens: {c.capacity_rps[input_len]:.2f} req/s")
                        for rate in self._rates(input_len):
                            for connector in bench_connectors:  # alternate push and pull on one stack
                                await self._point(nc, connector, input_len, rate)
                    if engine_connector in ("kvpush", "vllm-nixl-push"):
                        self.idle_cpu.append(await self._idle_wait_cpu(nc, stack, engine_connector))
                finally:
                    await nc.close()
            finally:
                stack.stop()

    async def _idle_wait_cpu(self, nc, stack: Stack, engine_connector: str, seconds: float = 5.0) -> dict:
        """CPU seconds per second the decode worker (with its engine processes) burns when
        idle, and while one request waits for KV that never comes (push connectors only)."""
        import nats
        import psutil

        decode = next(p for name, p in stack.children if name.startswith("decode"))
        root = psutil.Process(decode.pid)
        processes = [root, *root.children(recursive=True)]

        def cpu() -> float:
            total = 0.0
            for process in processes:
                try:
                    times = process.cpu_times()
                    total += times.user + times.system
                except psutil.NoSuchProcess:
                    pass
            return total

        beats: dict[str, wire.WorkerHeartbeat] = {}

        async def on_beat(msg):
            beat = wire.decode(msg.data, wire.WorkerHeartbeat)
            beats[beat.role] = beat

        sub = await nc.subscribe(wire.HEARTBEATS.wildcard, cb=on_beat)
        while len(beats) < 2:
            await asyncio.sleep(0.2)
        await sub.unsubscribe()
        start = cpu()
        await asyncio.sleep(seconds)
        idle = (cpu() - start) / seconds
        transfer_id = f"idle-probe-{uuid.uuid4().hex}"
        job = wire.DecodeJob(
            request_id=transfer_id, transfer_id=transfer_id,
            prompt_token_ids=_prompt(min(512, self.config.max_model_len // 2), 1),
            sampling=wire.SamplingSpec(8, 0.0, True), prefill_engine_id=beats["prefill"].worker_id,
            reply_to=nc.new_inbox(), received_at=time.time(),
        )
        job.kv_transfer_params = dict(beats["prefill"].kv_params)  # as the scheduler sends it
        replies = await nc.subscribe(job.reply_to)
        await nc.request(wire.decode_job_subject(beats["decode"].worker_id), wire.encode(job), timeout=5)
        await asyncio.sleep(1.0)  # let it allocate and register
        try:
            early = await replies.next_msg(timeout=0.01)
            raise RuntimeError(f"the idle probe request did not wait for KV: {early.data[:200]!r}")
        except nats.errors.TimeoutError:
            pass  # nothing yet: it is waiting, as intended
        finally:
            await replies.unsubscribe()
        start = cpu()
        await asyncio.sleep(seconds)
        waiting = (cpu() - start) / seconds
        self._say(f"{engine_connector} decode worker CPU: idle {idle:.2f} s/s, waiting for KV {waiting:.2f} s/s")
        return {"connector": engine_connector, "idle_cpu_s_per_s": idle, "waiting_cpu_s_per_s": waiting}

    def _rates(self, input_len: int) -> list[float]:
        c = self.config
        if c.rates:
            return c.rates
        return [round(f * c.capacity_rps[input_len], 3) for f in c.load_fractions]

    def _body(self, connector: str, input_len: int, seed: int, request_id: str, max_tokens: int) -> dict:
        body = {"prompt_token_ids": _prompt(input_len, seed), "max_tokens": max_tokens, "ignore_eos": True,
                "request_id": request_id}
        if connector.startswith("kvpush-"):
            body["transfer_mode"] = connector.removeprefix("kvpush-")
        return body

    async def _warm_up(self, nc, connectors: list[str], input_len: int) -> None:
        for connector in connectors:
            for i in range(self.config.warmup):
                await _one_request(nc, self._body(connector, input_len, 10_000 + i, f"warm-{connector}-{input_len}-{i}",
                                                  self.config.output_len))

    async def _measure_capacity(self, nc, connector: str, input_len: int) -> float:
        """Requests per second one prefill worker completes back to back (1 output token)."""
        ids = []
        started = time.perf_counter()
        for i in range(3):
            request_id = f"capacity-{input_len}-{i}-{time.time_ns()}"
            ids.append(request_id)
            await _one_request(nc, self._body(connector, input_len, 20_000 + i, request_id, 1))
        wall = time.perf_counter() - started
        await asyncio.sleep(1.0)
        computes = []
        for request_id in ids:
            trace = view.find_trace(list(self.receiver.spans), request_id)
            span = next((s for s in trace or [] if s["name"] == "prefill.compute"), None)
            if span is not None:
                computes.append((span["end_ns"] - span["start_ns"]) / 1e9)
        per_request = sorted(computes)[len(computes) // 2] if computes else wall / 3
        return 1.0 / per_request

    async def _point(self, nc, connector: str, input_len: int, rate: float) -> None:
        c = self.config
        # The same arrivals and prompts for every connector at this point.
        rng = random.Random(zlib.crc32(f"{c.seed}-{input_len}-{rate}".encode()))
        label = f"{connector}-{input_len}-{rate}"
        arrivals, at = [], 0.0
        for _ in range(c.requests):
            at += rng.expovariate(rate)
            arrivals.append(at)
        self._say(f"{connector}: {input_len} tokens at {rate:.2f} req/s, {c.requests} requests")
        loop = asyncio.get_running_loop()
        start = loop.time()
        tasks = []
        for i, offset in enumerate(arrivals):
            await asyncio.sleep(max(0.0, start + offset - loop.time()))
            request_id = f"bench-{label}-{i}-{time.time_ns()}"
            body = self._body(connector, input_len, c.seed * 100_000 + input_len + i, request_id, c.output_len)
            tasks.append((request_id, loop.create_task(_one_request(nc, body))))
        outcomes = []
        for request_id, task in tasks:
            outcomes.append((request_id, await task))
            if self.progress is not None:
                self.progress.update(1)
        wall = loop.time() - start
        await asyncio.sleep(1.5)  # let the last spans arrive
        spans = list(self.receiver.spans)
        point_results = []
        for request_id, outcome in outcomes:
            result = RequestResult(connector=connector, input_len=input_len, rate=rate, request_id=request_id,
                                   ok=outcome["ok"], error=outcome.get("error", ""))
            if outcome["ok"]:
                result.ttft_ms = outcome["ttft_ms"]
                result.tpot_ms = outcome["tpot_ms"]
                result.e2e_ms = outcome["e2e_ms"]
                result.completion_tokens = outcome["completion_tokens"]
                trace = view.find_trace(spans, request_id)
                segments = view.critical_path(trace) if trace else None
                if segments:
                    result.split = view.split(segments)
                    result.segments = {s.name: s.ms for s in segments}
            point_results.append(result)
        self.results += point_results
        self.points.append(summarize(point_results, wall))

    def _say(self, message: str) -> None:
        if self.progress is not None:
            self.progress.write(f"[bench] {message}")

    # ------------------------------------------------------------------ output

    def write(self) -> None:
        c = self.config
        c.out.mkdir(parents=True, exist_ok=True)
        machine = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                   "processor": platform.processor()}
        config = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(c).items()}
        (c.out / "results.json").write_text(json.dumps(
            {"machine": machine, "config": config, "errors": self.errors, "idle_cpu": self.idle_cpu, "points": [asdict(p) for p in self.points],
             "requests": [asdict(r) for r in self.results]}, indent=1))
        with open(c.out / "requests.csv", "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["connector", "input_len", "rate", "request_id", "ok", "ttft_ms", "tpot_ms", "e2e_ms",
                             "completion_tokens", "error", "queueing_ms", "compute_ms", "coordination_ms",
                             "transfer_ms"])
            for r in self.results:
                writer.writerow([r.connector, r.input_len, r.rate, r.request_id, r.ok, _f(r.ttft_ms), _f(r.tpot_ms),
                                 _f(r.e2e_ms), r.completion_tokens, r.error,
                                 *(_f(r.split.get(k, math.nan)) for k in
                                   ("queueing", "compute", "coordination", "transfer"))])
        with open(c.out / "points.csv", "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["connector", "input_len", "rate", "requests", "failures", "throughput_rps",
                             *(f"{m}_{s}" for m in ("ttft", "tpot", "e2e") for s in ("mean", "p50", "p90", "p99"))])
            for p in self.points:
                writer.writerow([p.connector, p.input_len, p.rate, p.requests, p.failures, _f(p.throughput_rps),
                                 *(_f(getattr(getattr(p, m), s)) for m in ("ttft", "tpot", "e2e")
                                   for s in ("mean", "p50", "p90", "p99"))])
        table = markdown_table(self.points)
        if self.idle_cpu:
            table += "\n| decode worker CPU (s per s) | idle | one request waiting for KV |\n|---|---:|---:|\n"
            table += "".join(f"| {r['connector']} | {r['idle_cpu_s_per_s']:.2f} | {r['waiting_cpu_s_per_s']:.2f} |\n"
                             for r in self.idle_cpu)
        (c.out / "table.md").write_text(table)
        plot(self.points, c.out / "plots")


def _f(value: float) -> str:
    return "" if isinstance(value, float) and math.isnan(value) else f"{value:.3f}" if isinstance(value, float) else str(value)


def plot(points: list[PointSummary], folder: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for input_len in sorted({p.input_len for p in points}):
        at_len = [p for p in points if p.input_len == input_len]
        fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
        for connector in sorted({p.connector for p in at_len}):
            series = sorted((p for p in at_len if p.connector == connector), key=lambda p: p.rate)
            rates = [p.rate for p in series]
            axes[0].plot(rates, [p.ttft.p50 / 1000 for p in series], marker="o", label=connector)
            axes[1].plot(rates, [p.ttft.p99 / 1000 for p in series], marker="o", label=connector)
            axes[2].plot(rates, [p.tpot.p50 for p in series], marker="o", label=connector)
        for ax, title, unit in zip(axes, ("TTFT p50", "TTFT p99", "TPOT p50"), ("s", "s", "ms")):
            ax.set_title(f"{title}, {input_len}-token prompts")
            ax.set_xlabel("arrival rate (req/s)")
            ax.set_ylabel(unit)
            ax.grid(alpha=0.3)
        axes[0].legend()
        fig.tight_layout()
        path = folder / f"latency-{input_len}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)

        top_rate = max(p.rate for p in at_len)
        top = sorted((p for p in at_len if p.rate == top_rate), key=lambda p: p.connector)
        fig, ax = plt.subplots(figsize=(7, 4.2))
        bottom = [0.0] * len(top)
        for category in ("queueing", "compute", "coordination", "transfer"):
            values = [p.split_mean.get(category, 0.0) for p in top]
            ax.bar([p.connector for p in top], values, bottom=bottom, label=category)
            bottom = [b + v for b, v in zip(bottom, values)]
        ax.set_title(f"Mean TTFT split, {input_len}-token prompts at {top_rate:.2f} req/s")
        ax.set_ylabel("ms")
        ax.legend()
        fig.tight_layout()
        path = folder / f"ttft-split-{input_len}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    return written
