"""Statistics and tables for ``kvpush bench``. Pure: no NATS, no engines."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

SPLIT_CATEGORIES = ("queueing", "compute", "coordination", "transfer")


@dataclass
class RequestResult:
    connector: str
    input_len: int
    rate: float
    request_id: str
    ok: bool
    ttft_ms: float = math.nan
    tpot_ms: float = math.nan
    e2e_ms: float = math.nan
    completion_tokens: int = 0
    error: str = ""
    split: dict[str, float] = field(default_factory=dict)  # TTFT by category, from the trace
    segments: dict[str, float] = field(default_factory=dict)  # TTFT by critical-path segment


@dataclass
class Stat:
    mean: float
    p50: float
    p90: float
    p99: float


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..1); NaN for no values."""
    ordered = sorted(v for v in values if not math.isnan(v))
    if not ordered:
        return math.nan
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def stat(values: list[float]) -> Stat:
    clean = [v for v in values if not math.isnan(v)]
    mean = sum(clean) / len(clean) if clean else math.nan
    return Stat(mean, percentile(clean, 0.5), percentile(clean, 0.9), percentile(clean, 0.99))


@dataclass
class PointSummary:
    connector: str
    input_len: int
    rate: float
    requests: int
    failures: int
    throughput_rps: float  # completed requests per second of the point's wall time
    ttft: Stat
    tpot: Stat
    e2e: Stat
    split_mean: dict[str, float]


def summarize(results: list[RequestResult], wall_s: float) -> PointSummary:
    ok = [r for r in results if r.ok]
    first = results[0]
    split_mean = {
        c: (sum(r.split.get(c, 0.0) for r in ok if r.split) / max(1, sum(1 for r in ok if r.split)))
        for c in SPLIT_CATEGORIES
    }
    return PointSummary(
        connector=first.connector,
        input_len=first.input_len,
        rate=first.rate,
        requests=len(results),
        failures=len(results) - len(ok),
        throughput_rps=len(ok) / wall_s if wall_s > 0 else math.nan,
        ttft=stat([r.ttft_ms for r in ok]),
        tpot=stat([r.tpot_ms for r in ok]),
        e2e=stat([r.e2e_ms for r in ok]),
        split_mean=split_mean,
    )


def markdown_table(points: list[PointSummary]) -> str:
    header = (
        "| connector | input | rate (req/s) | TTFT p50 | TTFT p90 | TTFT p99 | TPOT p50 | TPOT p99 | "
        "E2E p50 | throughput | failures | queue / compute / coord / transfer (mean ms) |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|\n"
    )
    rows = []
    for p in sorted(points, key=lambda p: (p.input_len, p.rate, p.connector)):
        split = " / ".join(f"{p.split_mean[c]:.0f}" for c in SPLIT_CATEGORIES)
        rows.append(
            f"| {p.connector} | {p.input_len} | {p.rate:.2f} | {_ms(p.ttft.p50)} | {_ms(p.ttft.p90)} | "
            f"{_ms(p.ttft.p99)} | {_ms(p.tpot.p50)} | {_ms(p.tpot.p99)} | {_ms(p.e2e.p50)} | "
            f"{p.throughput_rps:.2f} | {p.failures}/{p.requests} | {split} |"
        )
    return header + "\n".join(rows) + "\n"


def _ms(value: float) -> str:
    return "-" if math.isnan(value) else (f"{value / 1000:.2f} s" if value >= 1000 else f"{value:.0f} ms")


def as_dict(point: PointSummary) -> dict:
    return asdict(point)
