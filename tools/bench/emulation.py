"""``kvpush bench --emulate <model>@<gpu>``: the same systems and client on emulated GPUs.

Every engine of every system loads the timed model of the named deployment
(tools/emulation): the tiny network computes for real, and each forward waits out what the
deployment would take for its batch, times the dilation ``k``. Arrivals are dilated too (the
client sends at rate / k), so what the client measures is the emulated run slowed down k
times; every time in the results is divided by k and every rate multiplied by it, and k is
stated beside them. vLLM's NIXL agents' progress thread is paced (the plugin's switch): it
spins a core at rest otherwise, and a GPU server has a spare core for it, two cores do not.

Per point, each engine's forward log gives the CPU share: the real work inside its forwards
against their dilated targets (the target is at most 20%).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

from kvpush.services.launch.model import PROFILES
from kvpush.shared import settings
from kvpush.tools.bench.systems import Topology
from kvpush.tools.emulation import catalog
from kvpush.tools.emulation.time_model import decode_step_seconds, prefill_seconds, shaped_link_rate, \
    transfer_seconds

TIME_METRICS = ("ttft", "tpot", "itl", "e2el")
AUTO = "auto"
# What an emulated engine computes (--forward): the architecture its model folder names.
FORWARDS = {"network": "KvpushTimedForCausalLM", "stand-in": "KvpushStandInForCausalLM"}

# Waits that stand for the emulated GPU's time, so an emulated run takes them k times longer
# in real seconds: kvpush's settings (their environment names) and vLLM's NIXL connectors'
# (kv_connector_extra_config keys, their defaults in vLLM 0.32). Heartbeats and the liveness
# timeouts that read them (a worker or scheduler lost) stay real: they measure the host.
KVPUSH_MODELED_WAITS = {
    "KVPUSH_KV_WAIT_S": settings.FAULTS.kv_wait_s,  # decode gives registered blocks up
    "KVPUSH_LEASE_S": settings.FAULTS.lease_s,  # prefill keeps an unclaimed prompt's blocks
    "KVPUSH_QUARANTINE_S": settings.FAULTS.quarantine_s,  # decode keeps revoked blocks (≥ lease + 2 s)
    "KVPUSH_STALL_S": settings.STALL_S,  # a stream without a token
    "KVPUSH_DEADLINE_S": settings.DEADLINE_S,  # a request's final
    "KVPUSH_PUSH_WITHIN_S": settings.PUSH_WITHIN_S,  # auto: a prefill's end close enough to push
}
VLLM_MODELED_WAITS = {
    "kv_lease_duration": 30,  # prefill holds blocks for a reader this long per renewal (nixl/base_scheduler.py)
    "decoder_kv_blocks_ttl": 480,  # decode's registered blocks (and push_registration_timeout, its default)
}


@dataclass(frozen=True)
class TinyNetworkCost:
    """The real work of the timed model's forwards (64 layers) in a bench, fitted to the forward
    logs of docs/bench/emulated/k100-4k-4rps (AMD EPYC, 2 cores, kvpush and vLLM's pair under
    load): a prompt token costs ``per_token_s`` plus ``per_token_context_s`` for each token
    before it (the tiny network's attention, quadratic in the prompt), a decode step
    ``decode_step_s``. Another machine has other costs: the share each point measures is the
    check, this only picks k so that it is likely to pass."""

    per_token_s: float = 0.24e-3
    per_token_context_s: float = 5.9e-8
    decode_step_s: float = 0.035

    def prefill_s(self, prompt_tokens: int) -> float:
        return self.per_token_s * prompt_tokens + self.per_token_context_s * prompt_tokens ** 2 / 2


TINY_NETWORK_COST = TinyNetworkCost()
SHARE_AIM = 0.15  # k is chosen for this share, under the 0.2 that a valid point must keep
K_STEP = 25


def auto_dilation(target: str, longest_input: int, cost: TinyNetworkCost = TINY_NETWORK_COST,
                  share: float = SHARE_AIM) -> float:
    """The smallest k (a multiple of 25) at which both the longest prompt's prefill and a
    decode step at its context keep the forwards' real work to ``share`` of their dilated
    time. Longer prompts need a larger k: the tiny network's attention grows with the square
    of the prompt, the emulated GPU's prefill nearly linearly."""
    deployment = catalog.deployment(target)
    for_prefill = cost.prefill_s(longest_input) / (share * prefill_seconds(deployment, longest_input))
    for_decode = cost.decode_step_s / (share * decode_step_seconds(deployment, [longest_input]))
    return float(K_STEP * math.ceil(max(for_prefill, for_decode) / K_STEP))


def real_seconds(target: str, input_len: int, output_len: int, rate: float, requests: int, warmups: int,
                 dilation: float) -> float:
    """About how long one point takes in real time: its arrivals, then the last request's
    prefill and decode, and each warm-up request alone, all k times their emulated time."""
    deployment = catalog.deployment(target)
    one = prefill_seconds(deployment, input_len) + output_len * decode_step_seconds(deployment, [input_len])
    return dilation * (requests / rate + one * (1 + warmups))


@dataclass(frozen=True)
class Emulation:
    target: str  # a catalog deployment: qwen3-32b@p5en
    dilation: float | str  # k, or "auto": each workload's own (``for_workload``)
    progress_thread: str = "paced"  # vLLM's NIXL agents' progress thread: "on" or "paced"
    pacing: str = "layers"
    link: str = "shaped"  # engines on hosts of their own behind a shaped link, or "loopback"
    forward: str = "network"  # the timed network, or the stand-in that computes nothing (FORWARDS)

    def __post_init__(self) -> None:
        catalog.deployment(self.target)  # a clear error for an unknown name
        if self.dilation != AUTO and (not isinstance(self.dilation, (int, float)) or self.dilation <= 0):
            raise ValueError(f"the dilation k must be a positive number or {AUTO!r}, got {self.dilation!r}")
        if self.link not in ("shaped", "loopback"):
            raise ValueError(f"link {self.link!r}: use 'shaped' or 'loopback'")
        if self.forward not in FORWARDS:
            raise ValueError(f"forward {self.forward!r}: use one of {', '.join(FORWARDS)}")

    @property
    def k(self) -> float:
        if self.dilation == AUTO:
            raise ValueError("k is chosen per workload: use for_workload(longest input) first")
        return float(self.dilation)

    def for_workload(self, longest_input: int) -> "Emulation":
        """This emulation at the k of a workload whose longest prompt is ``longest_input``."""
        if self.dilation != AUTO:
            return self
        return replace(self, dilation=auto_dilation(self.target, longest_input))

    @property
    def link_bits_per_s(self) -> float | None:
        """The rate of the shaped link (bits/s): the deployment's link, scaled by the timed
        model's KV bytes per token against the named model's, and slowed by k; None on
        loopback."""
        if self.link == "loopback":
            return None
        tiny = PROFILES[self.profile].kv_bytes_per_token_fp32
        return 8 * shaped_link_rate(catalog.deployment(self.target), tiny, self.k)

    @property
    def profile(self) -> str:
        """The ``kvpush model build`` profile that emulates the target with this forward."""
        for name, profile in PROFILES.items():
            if profile.emulates == self.target and profile.architecture == FORWARDS[self.forward]:
                return name
        raise ValueError(f"no {self.forward} profile emulates {self.target!r}")

    def engine_env(self, log_path: Path) -> dict[str, str]:
        """What every engine process of every system gets; its forwards are logged to ``log_path``."""
        return {"KVPUSH_EMULATION_TARGET": self.target, "KVPUSH_EMULATION_DILATION": f"{self.k:g}",
                "KVPUSH_EMULATION_PACING": self.pacing, "KVPUSH_NIXL_PROGRESS_THREAD": self.progress_thread,
                "KVPUSH_EMULATION_LOG": str(log_path),
                # A CUDA engine's KV is in device memory, where kvpush computes no checksum
                # (connector/checksums.py); a CPU digest of the stand-in KV is time a GPU would not spend.
                "KVPUSH_KV_CHECKSUMS": "off",
                **self.modeled_waits()}

    def modeled_waits(self) -> dict[str, str]:
        """kvpush's waits that stand for device time, k times their defaults."""
        return {name: f"{seconds * self.k:g}" for name, seconds in KVPUSH_MODELED_WAITS.items()}

    def vllm_extra_config(self) -> dict[str, int]:
        """vLLM's NIXL connectors' waits, k times their defaults (whole seconds, as vLLM reads them)."""
        return {key: math.ceil(seconds * self.k) for key, seconds in VLLM_MODELED_WAITS.items()}

    def client_rate(self, rate: float) -> float:
        return rate / self.k

    def summary(self, measured: dict) -> dict:
        """A client summary in emulated time: times / k, rates × k; ``measured`` kept beside it."""
        out = dict(measured)
        for key, value in measured.items():
            if value is None:
                continue
            if key.endswith("_ms") and any(f"_{metric}_" in f"_{key}" for metric in TIME_METRICS):
                out[key] = value / self.k
            elif key in ("request_throughput", "output_throughput"):
                out[key] = value * self.k
            elif key == "duration_s":
                out[key] = value / self.k
        out["dilation"] = self.k
        return out

    def segments(self, segments_ms: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
        return {name: {stat: (value / self.k if stat != "n" else value) for stat, value in stats.items()}
                for name, stats in segments_ms.items()}


def late_transfers(transfers: list[tuple[int, float]], target: str, k: float) -> dict:
    """Of ``(prompt tokens, real seconds from the first WRITE or READ's start to the last's
    end)`` per request, those that took longer than the deployment's link would, times k."""
    deployment = catalog.deployment(target)
    late = sum(real_s > k * transfer_seconds(deployment, tokens) for tokens, real_s in transfers)
    return {"late": late, "transfers": len(transfers)}


def cpu_share(log_path: Path, since: float, until: float) -> dict:
    """The forwards' real work against their targets between two moments, per engine process
    and in all: ``{"all": share, "by_pid": {pid: share}, "forwards": n, "late": m}``. The work
    is the forward thread's own CPU time where the log has it (``cpu_s``), else its wall time
    less its sleeps, which also counts the time other processes held the core. ``late``: the
    forwards that ended more than 10% (and 2 ms) after their target: the host, not the
    model, set their time. ``step_gap_ms``: per engine, the median real time between one
    forward's end and the next one's start while it keeps stepping (gaps under a second): vLLM's
    step loop and the connector's bookkeeping, which a GPU's asynchronous scheduling would
    overlap with the device's step, and which vLLM's CPU platform cannot (it turns that off)."""
    busy: dict[int, float] = {}
    target: dict[int, float] = {}
    spans: dict[int, list[tuple[float, float]]] = {}
    count = late = 0
    try:
        lines = log_path.read_text().splitlines()
    except OSError:
        return {"all": None, "by_pid": {}, "forwards": 0, "late": 0}
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut by a process that was killed
        if not since <= record.get("at", 0) <= until:
            continue
        pid = record["pid"]
        busy[pid] = busy.get(pid, 0.0) + record.get("cpu_s", record["busy_s"])
        target[pid] = target.get(pid, 0.0) + record["target_s"]
        count += 1
        late += record["wall_s"] > 1.10 * record["target_s"] + 0.002
        spans.setdefault(pid, []).append((record["at"] - record["wall_s"], record["at"]))
    total_target = sum(target.values())
    return {"all": round(sum(busy.values()) / total_target, 3) if total_target else None,
            "by_pid": {str(pid): round(busy[pid] / target[pid], 3) for pid in busy if target[pid]},
            "forwards": count, "late": late,
            "step_gap_ms": {str(pid): gap for pid, gap in ((pid, step_gap_ms(s)) for pid, s in spans.items())
                            if gap is not None}}


def step_gap_ms(spans: list[tuple[float, float]], idle_s: float = 1.0) -> float | None:
    """The median gap between consecutive forwards (start, end), leaving out idle ones."""
    ordered = sorted(spans)
    gaps = sorted(later[0] - earlier[1] for earlier, later in zip(ordered, ordered[1:])
                  if 0 <= later[0] - earlier[1] < idle_s)
    if not gaps:
        return None
    middle = len(gaps) // 2
    median = gaps[middle] if len(gaps) % 2 else (gaps[middle - 1] + gaps[middle]) / 2
    return round(median * 1000, 3)


SEED_LENGTHS = (1024, 4096, 8192, 16384)
SEED_RATES = (1.0, 2.0, 4.0, 8.0)


def rates_it_holds(target: str, input_len: int, rates=SEED_RATES) -> tuple[float, ...]:
    """The seed's rates that one emulated prefill instance can hold at this length: those at
    which a second of arrivals brings less than a second of prefill (prefill time × rate < 1).
    Past that the queue grows for as long as the run lasts, and TTFT measures the run's
    length, not the system."""
    seconds = prefill_seconds(catalog.deployment(target), input_len)
    return tuple(rate for rate in rates if seconds * rate < 1.0)


def grid(workload_type, target: str, requests: int = 16):
    """The seed's 1P1D grid (1k-16k inputs, 128 outputs, 1-8 req/s cut to what the emulated
    prefill holds), 1P2D and 2P1D at 4k, and a mixed workload of 200-16k tokens."""
    workloads = [workload_type(f"{n // 1024}k", n, rates_it_holds(target, n), requests) for n in SEED_LENGTHS]
    workloads += [workload_type("4k 1P2D", 4096, (4.0,), requests, topology=Topology(1, 2)),
                  workload_type("4k 2P1D", 4096, (4.0,), requests, topology=Topology(2, 1)),
                  workload_type("mixed 200-16k", 8292, (1.0,), requests, range_ratio=0.976)]
    return tuple(w for w in workloads if w.rates)


def select(workloads, spec: str):
    """The part of the grid that ``--workloads`` names, so that the grid can be measured a
    piece at a time into one folder (``--resume`` keeps what earlier pieces measured).
    ``spec`` is comma-separated: ``8k`` keeps a workload with all its rates, ``8k@4`` only
    that rate. A name or rate the grid does not have is refused with a sentence."""
    by_name = {w.name: w for w in workloads}
    chosen: dict[str, list[float]] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, rate = item.partition("@")
        if name not in by_name:
            raise ValueError(f"no workload {name!r} in the grid; it has {', '.join(by_name)}")
        rates = chosen.setdefault(name, [])
        if not rate:
            rates.extend(by_name[name].rates)
            continue
        try:
            wanted = float(rate)
        except ValueError:
            raise ValueError(f"{item!r}: the rate after @ is a number of requests per second") from None
        if wanted not in by_name[name].rates:
            raise ValueError(f"{name} runs at {', '.join(f'{r:g}' for r in by_name[name].rates)} req/s, "
                             f"not {wanted:g} (past them one emulated prefill cannot keep up)")
        rates.append(wanted)
    return [replace(w, rates=tuple(sorted(set(chosen[w.name])))) for w in workloads if w.name in chosen]


def log_dir_of(out: Path, system: str, topology_label: str) -> Path:
    folder = out / "emulation" / f"{system}-{topology_label}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder
