"""``kvpush bench``: kvpush (push and pull) against vLLM's own disaggregated serving
(``NixlConnector`` and ``NixlPushConnector`` behind their example proxies), with one
client, ``vllm bench serve``, for every system.

The run, in order:

1. **Binding** (unless given): each system at one probe point under each OpenMP binding
   (``systems.BINDINGS``); each keeps the binding with the lower TTFT p50 for the rest.
2. **Raw NIXL bandwidth** between two processes, for the handoff overhead.
3. **The grid**: workloads grouped by topology. Per group, each system in turn gets a
   fresh stack (the others stopped: an idle vLLM engine spins) and runs every load point
   of the group's workloads; kvpush's push and pull share its stack and alternate point
   by point. The order of systems rotates from group to group.

Per point: vLLM's raw result file, CPU seconds per second of every process of the system,
and for kvpush the TTFT split from the services' spans (an in-process OTLP receiver) and
the handoff overhead (prefill finished to decode holding the KV, less the bytes' time at
the raw bandwidth).
"""

from __future__ import annotations

import asyncio
import csv
import json
import math
import os
import platform
import re
import shlex
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from kvpush.otel import attributes as A
from kvpush.otel import trace_view as view
from kvpush.services.launch.model import PROFILES, build_model, default_model_dir
from kvpush.services.worker.engine_settings import block_size_problem
from kvpush.shared import settings, wire
from kvpush.tools.bench import client, emulation, report, transfer
from kvpush.tools.bench.results import Point
from kvpush.tools.bench.stats import percentile
from kvpush.tools.bench.systems import BINDINGS, KvpushSystem, Topology, VllmServeSystem
from kvpush.tools.emulation.link import EngineHosts
from kvpush.tools.machine import cpu_model
from kvpush.tools.otlp_receiver import OtlpReceiver

VARIANTS = ("kvpush-push", "kvpush-pull", "kvpush-auto", "kvpush-local", "vllm-nixl", "vllm-nixl-push")
SYSTEM_OF = {"kvpush-push": "kvpush", "kvpush-pull": "kvpush", "kvpush-auto": "kvpush", "kvpush-local": "kvpush",
             "vllm-nixl": "vllm-nixl", "vllm-nixl-push": "vllm-nixl-push"}
CLIENT_TIMEOUT_S = 1800


@dataclass(frozen=True)
class Workload:
    name: str
    input_len: int
    rates: tuple[float, ...]
    requests: int
    topology: Topology = Topology()
    range_ratio: float = 0.0  # mixed lengths: uniform in input_len * [1 - r, 1 + r]
    burstiness: float = 1.0  # 1: Poisson arrivals; lower: bursts
    background: int = 0  # long generations sent at the point's start, all at once, beside its requests
    background_output_len: int = 1024
    prefix_len: int = 0  # tokens every prompt shares at its start, within input_len

    @property
    def longest(self) -> int:
        return int(self.input_len * (1 + self.range_ratio)) + 1


# The grid of docs/benchmarks.md (kv-heavy model, 2 cores): the shape of vLLM's published
# push-vs-pull benchmark (1P1D, prefix caching off, 128 output tokens, 1k and 4k inputs,
# light load to beyond saturation), mixed lengths, and 1P2D / 2P1D as functional
# comparisons. 8k inputs did not fit the hour here (docs/benchmarks.md).
GRID = (
    Workload("1k", 1024, (0.5, 2.0, 5.0), 12),
    Workload("4k", 4096, (0.25, 0.75), 6),
    Workload("mixed 200-3900", 2048, (0.5,), 8, range_ratio=0.9),
    Workload("1k 1P2D", 1024, (2.0,), 6, topology=Topology(1, 2)),
    Workload("1k 2P1D", 1024, (2.0,), 6, topology=Topology(2, 1)),
)
# The seed's longer inputs, outside the hour's grid (``--workloads 8k,16k``): one light rate
# each, below what one CPU prefill keeps up with (docs/benchmarks.md, "8k and 16k on CPUs").
LONG = (
    Workload("8k", 8192, (0.1,), 4),
    Workload("16k", 16384, (0.03,), 3),
)
BINDING_PROBE = Workload("binding probe, 1k", 1024, (1.0,), 4)


@dataclass
class BenchConfig:
    model: str
    profile: str
    variants: list[str]
    workloads: list[Workload]
    output_len: int = 128
    seed: int = 0
    warmups: int = 2
    sampling_flags: tuple[str, ...] = ()  # vllm bench serve's (--temperature, --top-p, ...); none: its defaults
    out: Path = Path("bench-results")
    bindings: dict[str, str] = field(default_factory=dict)  # system -> binding; missing ones are measured
    probe: Workload = BINDING_PROBE
    raw_bandwidth: bool = True
    try_bindings: tuple[str, ...] = BINDINGS
    emulation: emulation.Emulation | None = None  # emulated GPUs: the timed model, time dilated by k
    resume: bool = False  # keep the points of an earlier run in ``out`` and measure only the others
    repeats: int = 1  # each point measured this many times in a row (fresh prompts each time): its noise
    point_timeout_s: float = CLIENT_TIMEOUT_S  # a point whose client has no result by then failed
    # A test hook: the first attempt of each point of this system gets this timeout instead,
    # so that the retry below runs on purpose (KVPUSH_BENCH_FIRST_ATTEMPT_TIMEOUT=system:seconds).
    first_attempt_timeout: tuple[str, float] | None = None
    push_by_layer: str = settings.PUSH_BY_LAYER  # kvpush's prefill workers: layer-wise push on or off
    block_size: int | None = None  # every engine's tokens per KV block, kvpush's and vLLM's; None: vLLM's default
    max_num_seqs: int | None = None  # every engine's requests at once; None: each system's own default
    at_rest_s: float = 5.0  # how long each system's CPU at rest is measured, after its start

    @property
    def systems(self) -> list[str]:
        return list(dict.fromkeys(SYSTEM_OF[v] for v in self.variants))


class Bench:
    def __init__(self, config: BenchConfig, say=print):
        self.config = config
        self.say = say
        self.points: list[Point] = []
        self.probes: list[Point] = []
        self.idle_cpu: list[dict] = []
        self.at_rest: list[dict] = []  # every system's CPU with no request, right after its start
        self.raw_nixl: list[dict] = []
        self.errors: list[str] = []
        self.run_id = uuid.uuid4().hex[:6]
        self.engine_hosts: EngineHosts | None = None  # emulated GPUs: each engine on a host of its own
        self.links: list[dict] = []  # the shaped link of each system started, and what crossed it
        self.retried: list[dict] = []  # points that failed once, and were measured again on a fresh start
        self.emulation: emulation.Emulation | None = None  # the system running now: its k
        if config.resume:
            self._resume()

    # ------------------------------------------------------------------ the run

    async def run(self) -> None:
        c = self.config
        with OtlpReceiver() as receiver:
            self.receiver = receiver
            for system in c.systems:
                if system not in c.bindings:
                    c.bindings[system] = await self._pick_binding(system)
            if c.raw_bandwidth:
                self.raw_nixl = await asyncio.to_thread(self._raw_bandwidth)
            # One start of each system per topology (and, emulated, per k: an engine's k is fixed).
            groups: dict[tuple[Topology, emulation.Emulation | None], list[Workload]] = {}
            for workload in c.workloads:
                emulated = c.emulation.for_workload(workload.longest) if c.emulation else None
                groups.setdefault((workload.topology, emulated), []).append(workload)
            if c.emulation is not None:
                self._say_plan(groups)
            for turn, ((topology, emulated), workloads) in enumerate(groups.items()):
                systems = c.systems[turn % len(c.systems):] + c.systems[:turn % len(c.systems)]
                for system in systems:
                    if all(self._done(variant, workload, rate, emulated, c.repeats - 1) for workload in workloads
                           for rate in workload.rates for variant in c.variants if SYSTEM_OF[variant] == system):
                        self.say(f"{system} {topology.label}: every point already measured (--resume)")
                        continue
                    await self._with_system(system, c.bindings[system], topology, workloads, self.points,
                                            idle_probe=(topology.prefill, topology.decode) == (1, 1) and not c.resume,
                                            emulated=emulated)

    def _resume(self) -> None:
        """The points of an earlier run into the same folder, the failed ones left out (they run again)."""
        earlier = self.config.out / "results.json"
        if not earlier.exists():
            return
        kept = json.loads(earlier.read_text())
        self.points = [Point(**p) for p in kept.get("points", []) if not p.get("error")]
        self.links = kept.get("links", [])
        self.at_rest = kept.get("at_rest", [])
        self.say(f"resuming: {len(self.points)} points kept from {earlier}")

    def _say_plan(self, groups) -> None:
        c = self.config
        total = 0.0
        for (topology, emulated), workloads in groups.items():
            for workload in workloads:
                variants = len(c.variants)
                seconds = sum(emulation.real_seconds(emulated.target, workload.input_len, c.output_len, rate,
                                                     workload.requests, c.warmups, emulated.k)
                              for rate in workload.rates) * variants * c.repeats
                total += seconds
                self.say(f"{workload.name} ({topology.label}): k = {emulated.k:g}, rates "
                         f"{', '.join(f'{r:g}' for r in workload.rates)}: about {seconds / 60:.0f} min for "
                         f"{variants} systems" + (f", each point {c.repeats} times" if c.repeats > 1 else ""))
        self.say(f"the whole run: about {total / 3600:.1f} h of real time, plus each system's starts "
                 "(--resume goes on from the last point measured)")

    def _done(self, variant: str, workload: Workload, rate: float, emulated, repeat: int = 0) -> bool:
        """Whether a point's ``repeat``-th measurement was made before (``--resume``) and
        kept: it is not made again."""
        k = emulated.k if emulated else None
        return any(p.variant == variant and p.workload == workload.name and p.topology == workload.topology.label
                   and p.rate == rate and p.summary.get("dilation") == k and not p.error and p.repeat == repeat
                   for p in self.points)

    async def _pick_binding(self, system: str) -> str:
        scores = {}
        for binding in self.config.try_bindings:
            before = len(self.probes)
            await self._with_system(system, binding, self.config.probe.topology, [self.config.probe], self.probes)
            probes = self.probes[before:]
            if probes and all(not p.error and p.summary.get("completed") == p.requests for p in probes):
                scores[binding] = sum(p.summary["p50_ttft_ms"] for p in probes) / len(probes)
        if not scores:
            self.errors.append(f"{system}: no binding worked; using auto")
            return "auto"
        best = min(scores, key=scores.get)
        self.say(f"{system}: binding {best} (TTFT p50 by binding: "
                 + ", ".join(f"{b} {s:.0f} ms" for b, s in scores.items()) + ")")
        return best

    def _system(self, system: str, binding: str, topology: Topology, max_model_len: int):
        c = self.config
        log_dir = c.out / "logs" / f"{system}-{topology.label}-{binding}"
        env = self.emulation.engine_env(self._forward_log(system, topology)) if self.emulation else None
        if system == "kvpush":
            return KvpushSystem(c.model, max_model_len, topology, binding, log_dir, self.receiver.endpoint,
                                engine_env={**(env or {}), "KVPUSH_PUSH_BY_LAYER": c.push_by_layer},
                                hosts=self.engine_hosts, block_size=c.block_size, max_num_seqs=c.max_num_seqs)
        return VllmServeSystem(system, c.model, self.model_name, max_model_len, topology, binding, log_dir,
                               engine_env=env, hosts=self.engine_hosts, block_size=c.block_size,
                               max_num_seqs=c.max_num_seqs,
                               kv_extra_config=self.emulation.vllm_extra_config() if self.emulation else None)

    def _forward_log(self, system: str, topology: Topology) -> Path:
        folder = emulation.log_dir_of(self.config.out, system, topology.label)
        return folder / (f"forwards-k{self.emulation.k:g}.jsonl" if self.config.emulation.dilation == emulation.AUTO
                         else "forwards.jsonl")

    @property
    def model_name(self) -> str:
        return self.config.model.rstrip("/").rsplit("/", 1)[-1]  # what both gateways serve it as

    async def _with_system(self, system: str, binding: str, topology: Topology, workloads: list[Workload],
                           into: list[Point], idle_probe: bool = False,
                           emulated: emulation.Emulation | None = None) -> None:
        c = self.config
        self.emulation = emulated or (c.emulation.for_workload(max(w.longest for w in workloads))
                                      if c.emulation else None)
        max_model_len = max(max(w.longest + c.output_len, 128 + w.background_output_len if w.background else 0)
                            for w in workloads) + 16
        outer_receiver = self.receiver
        if self.emulation is not None and self.emulation.link == "shaped":
            self.engine_hosts = EngineHosts(topology.prefill, topology.decode, self.emulation.link_bits_per_s).start()
            self.say(f"engines on hosts of their own, the link between them shaped to "
                     f"{self.emulation.link_bits_per_s / 1e6:.0f} Mbit/s (k = {self.emulation.k:g})")
            # The workers' spans come from their hosts: a receiver where those reach the root namespace.
            self.receiver = OtlpReceiver(host=EngineHosts.root_address).__enter__()
        stack = self._system(system, binding, topology, max_model_len)
        self.say(f"starting {system} ({topology.label}, binding {binding})")
        started = time.monotonic()
        try:
            await stack.start()
            self.say(f"{system} ready in {time.monotonic() - started:.0f} s")
            if idle_probe:
                self.at_rest.append(await self._at_rest(system, binding, stack))
            for workload in workloads:
                for rate in workload.rates:
                    for variant, repeat in ((v, r) for r in range(c.repeats if into is self.points else 1)
                                            for v in c.variants if SYSTEM_OF[v] == system):
                        if into is self.points and self._done(variant, workload, rate, self.emulation, repeat):
                            continue
                        point = await self._point(stack, variant, workload, rate, binding, repeat, first=True)
                        if into is self.points and (point.error or point.summary.get("failed")):
                            # vLLM's push pair here sometimes loses its first handshake (5 s, starved
                            # cores) and its request then waits out a 480 s lease: one fresh start
                            # and one more try, both kept in the results.
                            self.say(f"{variant}: the point failed ({(point.error or 'failed requests')[:160]}); "
                                     f"starting {system} again and measuring it once more")
                            self.retried.append({"variant": variant, "workload": workload.name, "rate": rate,
                                                 "repeat": repeat, "first_error": point.error,
                                                 "first_summary": point.summary})
                            stack.stop()
                            stack = self._system(system, binding, topology, max_model_len)
                            await stack.start()
                            point = await self._point(stack, variant, workload, rate, binding, repeat)
                        into.append(point)
                        if into is self.points and c.emulation is not None:
                            self.write()  # each point kept as it ends: --resume goes on from here
            if idle_probe and system == "kvpush":
                self.idle_cpu.append(await self._idle_wait_cpu(stack))
        except (RuntimeError, TimeoutError, OSError) as exc:  # one system failing must not lose the others
            self.errors.append(f"{system} {topology.label} {binding}: {exc}")
            self.say(f"{system} failed: {exc} (logs in {c.out / 'logs'})")
        finally:
            stack.stop()
            if self.engine_hosts is not None:
                self.links.append({"system": system, "topology": topology.label,
                                   "rate_bits_per_s": self.engine_hosts.rate_bits,
                                   "bytes_sent": self.engine_hosts.kv_bytes()})
                self.engine_hosts.stop()
                self.engine_hosts = None
            if self.receiver is not outer_receiver:
                self.receiver.__exit__(None, None, None)
                self.receiver = outer_receiver

    async def _point(self, stack, variant: str, workload: Workload, rate: float, binding: str,
                     repeat: int = 0, first: bool = False) -> Point:
        c = self.config
        emulated = self.emulation
        client_rate = emulated.client_rate(rate) if emulated else rate
        timeout = c.point_timeout_s
        if first and c.first_attempt_timeout and c.first_attempt_timeout[0] == SYSTEM_OF[variant]:
            timeout = c.first_attempt_timeout[1]
        load = client.Load(workload.input_len, c.output_len, client_rate, workload.requests, workload.range_ratio,
                           seed=c.seed + repeat, warmups=c.warmups, burstiness=workload.burstiness,
                           sampling_flags=c.sampling_flags, prefix_len=workload.prefix_len)
        again = f"-repeat{repeat}" if repeat else ""
        slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{workload.name}-{variant}-{rate:g}-{binding}{again}")  # ids and names
        result_file = c.out / "raw" / f"{slug}.json"
        prefix = f"bench-{self.run_id}-{slug}-"
        point = Point(workload.name, workload.topology.label, SYSTEM_OF[variant], variant, binding,
                      workload.input_len, rate, workload.requests, str(result_file.relative_to(c.out)), repeat=repeat)
        self.say(f"{variant}: {workload.name} at {rate:g} req/s, {workload.requests} requests"
                 + (f" (sent at {client_rate:g} req/s: k = {emulated.k:g})" if emulated else ""))
        cpu_before, wall_before, started_at = _cpu_by_process(stack.processes()), time.monotonic(), time.time()
        try:
            background = None
            if workload.background:  # decodes kept busy by long generations (their own client, unmeasured)
                busy = client.Load(128, workload.background_output_len, float("inf"), workload.background,
                                   seed=c.seed + 1, warmups=0)
                background = asyncio.create_task(asyncio.to_thread(
                    client.run, stack.base_url, self.model_name, c.model, busy,
                    result_file.with_name(f"{slug}-background.json"), f"{prefix}bg-", stack.variants[variant],
                    timeout))
                await asyncio.sleep(2.0)  # they are decoding when the measured requests come
            result = await asyncio.to_thread(client.run, stack.base_url, self.model_name, c.model, load, result_file,
                                             prefix, stack.variants[variant], timeout)
            point.summary = client.summary(result)
            if background is not None:
                await background
        except (RuntimeError, OSError, TimeoutError) as exc:
            point.error = str(exc)[-500:]
            self.say(f"{variant}: the point failed: {point.error}")
        wall = time.monotonic() - wall_before
        cpu_after = _cpu_by_process(stack.processes())
        point.cpu_s_per_s = _cpu_rates(cpu_before, cpu_after, wall)
        if SYSTEM_OF[variant] == "kvpush" and not point.error:
            await asyncio.sleep(1.5)  # the last spans
            self._spans_of(point, prefix, workload)
        if emulated is not None:
            point.cpu_share = emulation.cpu_share(self._forward_log(SYSTEM_OF[variant], workload.topology),
                                                  started_at, time.time())
            point.measured_summary = point.summary
            point.summary = emulated.summary(point.summary) if point.summary else {}
            point.segments_ms = emulated.segments(point.segments_ms)
            point.segments_by_request = [{name: (value / emulated.k if name not in ("request_id", "start_ns")
                                                 else value) for name, value in row.items()}
                                         for row in point.segments_by_request]
            if point.handoff_overhead_ms:
                point.handoff_overhead_ms = {k: v / emulated.k for k, v in point.handoff_overhead_ms.items()}
        s = point.summary
        if s:
            self.say(f"{variant}: TTFT p50 {s['p50_ttft_ms']:.0f} ms p99 {s['p99_ttft_ms']:.0f} ms, "
                     f"TPOT p50 {s['p50_tpot_ms']:.1f} ms, {s['completed']}/{workload.requests} ok")
        return point

    def _spans_of(self, point: Point, prefix: str, workload: Workload) -> None:
        traces = view.group_traces(list(self.receiver.spans))
        by_request: dict[str, list[dict]] = {}
        for trace in traces.values():
            for span in trace:
                request_id = span["attributes"].get(A.REQUEST_ID, "")
                if isinstance(request_id, str) and request_id.startswith(prefix):
                    newest = by_request.get(request_id)
                    if newest is None or min(s["start_ns"] for s in trace) > min(s["start_ns"] for s in newest):
                        by_request[request_id] = trace
                    break
        segments: dict[str, list[float]] = {}
        overheads = []
        transfers: list[tuple[int, float]] = []  # per request: prompt tokens, its KV's real crossing
        bandwidth = self._raw_bytes_per_ms()
        profile = PROFILES.get(self.config.profile)  # "custom" (--model): unknown, no overhead figure
        kv_bytes_per_token = profile.kv_bytes_per_token_fp32 if profile else 0
        for request_id, trace in by_request.items():
            path = view.critical_path(trace)
            if not path:
                continue
            ms = {s.name: s.ms for s in path}
            for name, value in ms.items():
                segments.setdefault(name, []).append(value)
            point.segments_by_request.append({"request_id": request_id, "start_ns": path[0].start_ns,
                                              **{name: round(value, 3) for name, value in ms.items()}})
            moves = [s for s in trace if s["name"] in (A.KV_WRITE, A.KV_READ)]
            if moves:
                crossing_s = (max(s["end_ns"] for s in moves) - min(s["start_ns"] for s in moves)) / 1e9
                transfers.append((_prompt_tokens(trace) or workload.input_len, crossing_s))
            if bandwidth:
                handoff = sum(ms.get(k, 0.0) for k in ("handoff", "transfer", "kv notice"))
                prompt = _prompt_tokens(trace) or workload.input_len
                overheads.append(handoff - prompt * kv_bytes_per_token / bandwidth)
        point.segments_by_request.sort(key=lambda row: row["start_ns"])
        if self.emulation is not None and transfers:
            point.late_transfers = emulation.late_transfers(transfers, self.emulation.target, self.emulation.k)
        point.segments_ms = {name: {"p50": percentile(v, 0.5), "p99": percentile(v, 0.99), "mean": sum(v) / len(v),
                                    "n": len(v)} for name, v in segments.items()}
        if overheads:
            point.handoff_overhead_ms = {"p50": percentile(overheads, 0.5), "p99": percentile(overheads, 0.99)}

    # ------------------------------------------------------------------ extra measurements

    def _raw_bandwidth(self) -> list[dict]:
        self.say("raw NIXL WRITE bandwidth between two processes")
        return transfer.run(progress=lambda line: self.say(line))

    def _raw_bytes_per_ms(self) -> float:
        """The best raw NIXL WRITE bandwidth of this run (bytes per ms), 0 if not measured."""
        return max((r["raw_gib_s"] * 2**30 / 1000 for r in self.raw_nixl), default=0.0)

    async def _at_rest(self, system: str, binding: str, stack, settle_s: float = 5.0,
                       seconds: float | None = None) -> dict:
        """CPU seconds per second of each process (with its children) while the system serves
        nothing, of its busiest thread, and of each of vLLM's engine processes by its title
        (``EngineCore``, one ``Worker_TP<rank>`` per rank above TP 1): what it takes from the
        cores its engines compute on before any request comes. ``settle_s`` first: vLLM's
        readers spin a second after the last message (the health checks); then over
        ``seconds`` (``--at-rest-s``)."""
        await asyncio.sleep(settle_s)
        seconds = self.config.at_rest_s if seconds is None else seconds
        before, threads_before = _cpu_by_process_and_thread(stack.processes())
        await asyncio.sleep(seconds)
        after, threads_after = _cpu_by_process_and_thread(stack.processes())
        busiest = {name: round(max((used - threads_before.get(name, {}).get(tid, 0.0)
                                    for tid, used in tids.items()), default=0.0) / seconds, 3)
                   for name, tids in threads_after.items()}
        result = {"system": system, "binding": binding, "topology": stack.topology.label,
                  "seconds": seconds, "cpu_s_per_s": _cpu_rates(before, after, seconds),
                  "busiest_thread_s_per_s": busiest, "engine_processes": _engine_rates(before, after, seconds)}
        self.say(f"{system} at rest: {result['cpu_s_per_s']} CPU-s/s (busiest thread: {busiest}; "
                 f"engine processes: {result['engine_processes']})")
        return result

    async def _idle_wait_cpu(self, system: KvpushSystem, seconds: float = 5.0) -> dict:
        """CPU seconds per second of the decode worker (with its engine core) idle, and while
        one request waits for pushed KV that never comes."""
        import nats
        import psutil

        stack = system.stack
        decode = next(p for name, p in stack.children if name.startswith("decode"))
        root = psutil.Process(decode.pid)
        processes = [root, *root.children(recursive=True)]

        def per_process() -> dict[str, float]:
            seconds_used = {}
            for process in processes:
                try:
                    times = process.cpu_times()
                    name = "decode worker" if process is root else f"{process.name()} ({process.pid})"
                    seconds_used[name] = times.user + times.system
                except psutil.NoSuchProcess:
                    pass
            return seconds_used

        nc = await nats.connect(stack.nats_url)
        try:
            beats: dict[str, wire.WorkerHeartbeat] = {}

            async def on_beat(msg):
                beat = wire.decode(msg.data, wire.WorkerHeartbeat)
                beats[beat.role] = beat

            sub = await nc.subscribe(wire.HEARTBEATS.wildcard, cb=on_beat)
            while len(beats) < 2:
                await asyncio.sleep(0.2)
            await sub.unsubscribe()
            start = per_process()
            await asyncio.sleep(seconds)
            idle = sum(per_process().values()) - sum(start.values())
            transfer_id = f"idle-probe-{uuid.uuid4().hex}"
            job = wire.DecodeJob(
                request_id=transfer_id, transfer_id=transfer_id,
                prompt_token_ids=list(range(1, 1 + min(512, stack.max_model_len // 2))),
                sampling=wire.SamplingSpec(8, 0.0, True), prefill_engine_id=beats["prefill"].worker_id,
                reply_to=nc.new_inbox(), received_at=time.time(),
            )
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
            start = per_process()
            await asyncio.sleep(seconds)
            end = per_process()
        finally:
            await nc.close()
        waiting = {name: round((end[name] - used) / seconds, 3) for name, used in start.items() if name in end}
        result = {"idle_cpu_s_per_s": round(idle / seconds, 3),
                  "waiting_cpu_s_per_s": round(sum(waiting.values()), 3), "waiting_by_process": waiting}
        self.say(f"kvpush decode worker CPU: idle {result['idle_cpu_s_per_s']:.3f} s/s, "
                 f"waiting for KV {result['waiting_cpu_s_per_s']:.3f} s/s {waiting}")
        return result

    # ------------------------------------------------------------------ output

    def write(self) -> None:
        c = self.config
        c.out.mkdir(parents=True, exist_ok=True)
        machine = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                   "processor": cpu_model()}
        config = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(c).items()}
        (c.out / "results.json").write_text(json.dumps(
            {"machine": machine, "config": config, "errors": self.errors, "bindings": c.bindings,
             "binding_probes": [asdict(p) for p in self.probes], "idle_cpu": self.idle_cpu,
             "at_rest": self.at_rest, "links": self.links, "retried": self.retried,
             "raw_nixl": self.raw_nixl, "points": [asdict(p) for p in self.points]}, indent=1, default=str))
        with open(c.out / "points.csv", "w", newline="") as f:
            writer = csv.writer(f)
            columns = ["completed", "failed", "request_throughput", *(f"p{p}_{m}_ms" for m in ("ttft", "tpot", "e2el")
                                                                      for p in client.PERCENTILES)]
            writer.writerow(["workload", "topology", "variant", "binding", "input_len", "rate", "requests",
                             *columns, "handoff_overhead_p99_ms", "error", "result_file"])
            for p in self.points:
                writer.writerow([p.workload, p.topology, p.variant, p.binding, p.input_len, p.rate, p.requests,
                                 *(_f(p.summary.get(k)) for k in columns),
                                 _f(p.handoff_overhead_ms.get("p99")), p.error[:200], p.result_file])
        (c.out / "tables.md").write_text(report.tables(self))
        report.plots(self.points, c.out / "plots")


def cmd(args) -> int:
    """``kvpush bench``."""
    variants = args.systems.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        print(f"unknown systems {unknown}; choose from {', '.join(VARIANTS)}", file=sys.stderr)
        return 2
    bindings = {}
    for pair in filter(None, (args.binding or "").split(",")):
        system, _, binding = pair.partition("=")
        if binding not in BINDINGS:
            print(f"--binding {pair!r}: give system=binding, binding one of {', '.join(BINDINGS)}", file=sys.stderr)
            return 2
        bindings[system] = binding
    if problem := block_size_problem(args.block_size or None, on_cpu=True):  # every bench engine runs on CPUs
        print(problem, file=sys.stderr)
        return 2
    emulated = None
    if args.emulate:
        try:
            emulated = emulation.Emulation(args.emulate, args.dilation, progress_thread=args.nixl_progress_thread,
                                           pacing=args.pacing, link=args.link, forward=args.forward)
            args.profile = emulated.profile
        except ValueError as exc:
            print(f"--emulate {args.emulate}: {exc}", file=sys.stderr)
            return 2
    if args.input_lens:
        topology = Topology(args.prefill, args.decode)
        if any(args.prefix_len >= int(n) for n in args.input_lens.split(",")):
            print(f"--prefix-len {args.prefix_len}: must be shorter than every input length", file=sys.stderr)
            return 2
        shape = "".join([f" mixed ±{args.range_ratio:g}" if args.range_ratio else "",
                         f" prefix {args.prefix_len}" if args.prefix_len else "",
                         f" burstiness {args.burstiness:g}" if args.burstiness != 1.0 else "",
                         f" with {args.background} long generations" if args.background else ""])
        workloads = [Workload(f"{n} tokens{shape}" if topology == Topology() else f"{n} tokens {topology.label}{shape}",
                              n, tuple(float(r) for r in args.rates.split(",")), args.requests, topology,
                              range_ratio=args.range_ratio, burstiness=args.burstiness, background=args.background,
                              background_output_len=args.background_output_len, prefix_len=args.prefix_len)
                     for n in (int(x) for x in args.input_lens.split(","))]
    elif emulated is not None:
        workloads = list(emulation.grid(Workload, emulated.target, requests=args.requests))
        if args.workloads:
            try:
                workloads = emulation.select(workloads, args.workloads)
            except ValueError as exc:
                print(f"--workloads: {exc}", file=sys.stderr)
                return 2
    else:
        workloads = list(GRID)
        if args.workloads:
            try:
                workloads = emulation.select([*GRID, *LONG], args.workloads)
            except ValueError as exc:
                print(f"--workloads: {exc}", file=sys.stderr)
                return 2
    model = args.model or str(build_model(default_model_dir(args.profile), profile=args.profile))
    probe = BINDING_PROBE if args.probe_requests is None else \
        Workload(BINDING_PROBE.name, BINDING_PROBE.input_len, BINDING_PROBE.rates, args.probe_requests)
    workloads, probe = ([at_tensor_parallel(w, args.prefill_tp, args.decode_tp) for w in workloads],
                        at_tensor_parallel(probe, args.prefill_tp, args.decode_tp))
    config = BenchConfig(model=model, profile=args.profile if not args.model else "custom", variants=variants,
                         workloads=workloads, output_len=args.output_len, seed=args.seed, warmups=args.warmup,
                         sampling_flags=tuple(shlex.split(args.sampling_flags)), out=Path(args.out), bindings=bindings, probe=probe, raw_bandwidth=not args.no_raw_nixl,
                         try_bindings=tuple(args.try_bindings.split(",")), emulation=emulated,
                         resume=getattr(args, "resume", False), repeats=args.repeats,
                         point_timeout_s=args.point_timeout, first_attempt_timeout=_first_attempt_timeout(),
                         push_by_layer=args.push_by_layer, at_rest_s=args.at_rest_s,
                         block_size=args.block_size or None, max_num_seqs=args.max_num_seqs or None)
    bench = Bench(config, say=lambda line: print(f"[bench] {line}", file=sys.stderr, flush=True))
    asyncio.run(bench.run())
    bench.write()
    print((Path(args.out) / "tables.md").read_text())
    failed = [p for p in bench.points if p.error or p.summary.get("failed")]
    return 1 if bench.errors or failed else 0


def at_tensor_parallel(workload: Workload, prefill_tp: int, decode_tp: int) -> Workload:
    """``workload`` with every prefill engine at ``prefill_tp`` and every decode engine at
    ``decode_tp`` (``--prefill-tp``, ``--decode-tp``); its name says so above TP 1."""
    topology = replace(workload.topology, prefill_tp=prefill_tp, decode_tp=decode_tp)
    if topology == workload.topology:
        return workload
    return replace(workload, name=f"{workload.name} tp{prefill_tp}x{decode_tp}", topology=topology)


def _first_attempt_timeout() -> tuple[str, float] | None:
    """The test hook ``KVPUSH_BENCH_FIRST_ATTEMPT_TIMEOUT=system:seconds`` (tests/bench)."""
    raw = os.environ.get("KVPUSH_BENCH_FIRST_ATTEMPT_TIMEOUT")
    if not raw:
        return None
    system, _, seconds = raw.partition(":")
    return system, float(seconds)


def _trees(roots: dict[str, int]):
    """(name, process) for each named process and each of its descendants alive now."""
    import psutil

    for name, pid in roots.items():
        try:
            root = psutil.Process(pid)
            yield from ((name, process) for process in (root, *root.children(recursive=True)))
        except psutil.NoSuchProcess:
            continue


def _cpu_by_process(roots: dict[str, int]) -> dict[str, dict[int, float]]:
    """CPU seconds so far of each named process and each of its descendants, by pid."""
    import psutil

    used: dict[str, dict[int, float]] = {name: {} for name in roots}
    for name, process in _trees(roots):
        try:
            times = process.cpu_times()
            used[name][process.pid] = times.user + times.system
        except psutil.NoSuchProcess:
            pass
    return used


def _cpu_by_process_and_thread(roots: dict[str, int]) -> tuple[dict[str, dict[int, float]], dict[str, dict[int, float]]]:
    """CPU seconds so far of each named process and its descendants, by pid, and of each of
    their threads, by thread id: both read back to back for each process, so that a busy
    thread cannot show more CPU than its process (one walk of all processes, then another,
    had put up to a walk's time between them)."""
    import psutil

    by_process: dict[str, dict[int, float]] = {name: {} for name in roots}
    by_thread: dict[str, dict[int, float]] = {name: {} for name in roots}
    for name, process in _trees(roots):
        try:
            threads = process.threads()
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        by_thread[name].update({t.id: t.user_time + t.system_time for t in threads})
        by_process[name][process.pid] = times.user + times.system
    return by_process, by_thread


def _engine_rates(before: dict[str, dict[int, float]], after: dict[str, dict[int, float]], wall: float) -> dict:
    """CPU seconds per second over ``wall`` of each process vLLM titled in each named tree,
    by that title (``VLLM::EngineCore`` as ``EngineCore``, ``VLLM::Worker_TP1`` as
    ``Worker_TP1``, a ``vllm serve``'s ``APIServer_0``); the processes it did not title (a
    kvpush worker itself) are left out. {tree name: {title: rate}}, only trees that have
    such processes."""
    rates: dict[str, dict[str, float]] = {}
    for name, pids in after.items():
        for pid, used in pids.items():
            title = _vllm_title(pid)
            if title is not None:
                rates.setdefault(name, {})[title] = round((used - before.get(name, {}).get(pid, 0.0)) / wall, 3)
    return rates


def _vllm_title(pid: int) -> str | None:
    """The title vLLM set on process ``pid`` (``setproctitle``: ``VLLM::<title>``), or None."""
    import psutil

    try:
        words = " ".join(psutil.Process(pid).cmdline()).split()
    except psutil.Error:
        return None
    return words[0].removeprefix("VLLM::") if words and words[0].startswith("VLLM::") else None


def _cpu_rates(before: dict[str, dict[int, float]], after: dict[str, dict[int, float]], wall: float) -> dict:
    """CPU seconds per second of each named tree over ``wall``: what each process alive at
    the end used since the start (or since it was born)."""
    rates = {}
    for name, pids in after.items():
        earlier = before.get(name, {})
        rates[name] = round(sum(used - earlier.get(pid, 0.0) for pid, used in pids.items()) / wall, 3)
    return rates


def _prompt_tokens(trace: list[dict]) -> int:
    for span in trace:
        tokens = span["attributes"].get(A.PROMPT_TOKENS)
        if tokens:
            return int(tokens)
    return 0


def _f(value) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return f"{value:.3f}" if isinstance(value, float) else str(value)
