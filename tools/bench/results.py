"""What ``kvpush bench`` measures at each load point, and how a point reads against its
system's capacity: the run (``run``) makes the points, the report (``report``) reads them."""

from __future__ import annotations

from dataclasses import dataclass, field

BASELINE = "vllm-nixl"  # what a user would otherwise pick: every ratio is to it
KNEE = 3.0


@dataclass
class Point:
    workload: str
    topology: str
    system: str
    variant: str
    binding: str
    input_len: int
    rate: float
    requests: int
    result_file: str
    summary: dict = field(default_factory=dict)
    cpu_s_per_s: dict[str, float] = field(default_factory=dict)
    segments_ms: dict[str, dict[str, float]] = field(default_factory=dict)  # kvpush: segment -> p50/p99/mean
    handoff_overhead_ms: dict[str, float] = field(default_factory=dict)  # kvpush: p50/p99
    error: str = ""
    # Emulated GPUs: the client's own figures (summary holds them in emulated time), and the
    # forwards' real work against their dilated targets.
    measured_summary: dict = field(default_factory=dict)
    cpu_share: dict = field(default_factory=dict)
    # Emulated GPUs, kvpush: its transfers that took longer than the deployment's link would
    # ({"late": n, "transfers": m}; a point with any is invalid: the link, not the model, set them)
    late_transfers: dict = field(default_factory=dict)
    repeat: int = 0  # 0 the first measurement of the point, 1, 2, ... its repeats (--repeats)
    # kvpush: each request's TTFT split (segment -> ms, and its request id), in arrival order
    segments_by_request: list[dict] = field(default_factory=list)


def within_capacity(point: Point, points: list[Point]) -> bool:
    """Whether the system kept up at this point: its TTFT p50 is at most KNEE times its own
    TTFT p50 at the workload's lightest rate (past capacity the queue, and TTFT with it,
    grows with the length of the run). The targets apply only at such points."""
    if point.error or not point.summary:
        return False
    mine = [p for p in points if p.variant == point.variant and p.workload == point.workload and p.summary]
    lightest = min(mine, key=lambda p: p.rate)
    return point.summary["p50_ttft_ms"] <= KNEE * lightest.summary["p50_ttft_ms"]

