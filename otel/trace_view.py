"""Where a request's time to first token went: one trace as a terminal waterfall, and the
split across many traces.

The critical path to the first token runs through these milestones, in order:

    received by the scheduler -> prefill job received -> prefill scheduled -> prompt computed
    -> transfer started -> transfer done -> decode scheduled with the KV -> first token

(the transfer is prefill's WRITE in push mode, decode's READ in pull mode; layer by layer,
it starts with the first layer's WRITE, often before the prompt is computed, and is done
with the last layer's: what is left after the prompt is the transfer time exposed)

Each segment between two milestones belongs to one category: queueing (waiting for an
engine), compute (an engine working on this request), transfer (the KV WRITE) or
coordination (everything that is messaging and matching: dispatch, waiting for the
other half of the rendezvous, noticing the KV arrived). Milestones are chained with max()
so overlapping stages never count twice; the segments add up to the TTFT the trace shows.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpush.otel import attributes as A

_TRANSFER = "kv.write or kv.read"  # push writes from prefill, pull reads from decode

# (segment name, category, span name, which end of that span is the milestone)
_MILESTONES = [
    ("dispatch", "coordination", A.PREFILL_QUEUE, "start"),
    ("prefill queue", "queueing", A.PREFILL_QUEUE, "end"),
    ("prefill compute", "compute", A.PREFILL_COMPUTE, "end"),
    ("handoff", "coordination", _TRANSFER, "start"),
    ("transfer", "transfer", _TRANSFER, "end"),
    ("kv notice", "coordination", A.DECODE_FIRST_TOKEN, "start"),
    ("decode first token", "compute", A.DECODE_FIRST_TOKEN, "end"),
]
# A local request (its decode computed the prompt): no prefill, no transfer.
_LOCAL_MILESTONES = [
    ("dispatch", "coordination", A.DECODE_QUEUE, "start"),
    ("decode queue", "queueing", A.DECODE_QUEUE, "end"),
    ("decode prompt and first token", "compute", A.DECODE_FIRST_TOKEN, "end"),
]
CATEGORIES = ("queueing", "compute", "coordination", "transfer")


@dataclass
class Segment:
    name: str
    category: str
    start_ns: int
    end_ns: int

    @property
    def ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


def group_traces(spans: list[dict]) -> dict[str, list[dict]]:
    traces: dict[str, list[dict]] = {}
    for span in spans:
        traces.setdefault(span["trace_id"], []).append(span)
    return traces


def find_trace(spans: list[dict], request_id: str) -> list[dict] | None:
    """The newest trace that has a span for ``request_id``."""
    candidates = [
        trace for trace in group_traces(spans).values()
        if any(s["attributes"].get(A.REQUEST_ID) == request_id for s in trace)
    ]
    if not candidates:
        return None
    return max(candidates, key=lambda t: min(s["start_ns"] for s in t))


def _first(trace: list[dict], name: str) -> dict | None:
    names = (A.KV_WRITE, A.KV_READ) if name == _TRANSFER else (name,)
    matching = [s for s in trace if s["name"] in names]
    return min(matching, key=lambda s: s["start_ns"]) if matching else None


def _last_to_end(trace: list[dict], name: str) -> dict:
    names = (A.KV_WRITE, A.KV_READ) if name == _TRANSFER else (name,)
    return max((s for s in trace if s["name"] in names), key=lambda s: s["end_ns"])


def critical_path(trace: list[dict]) -> list[Segment] | None:
    """The TTFT segments of one request's trace, or None if a stage is missing.

    Without a transfer span (vLLM's own connectors record none of ours), handoff, transfer
    and KV notice cannot be told apart and become one "handoff + transfer" segment.
    """
    root = _first(trace, "process kvpush.generate") or _first(trace, A.SCHEDULER_QUEUE)
    if root is None:
        return None
    milestones = _MILESTONES
    if _first(trace, A.DECODE_QUEUE) is not None:
        milestones = _LOCAL_MILESTONES
    elif _first(trace, _TRANSFER) is None:
        milestones = [m for m in _MILESTONES if m[2] != _TRANSFER]
        milestones = [("handoff + transfer", "coordination", *m[2:]) if m[0] == "kv notice" else m
                      for m in milestones]
    previous = root["start_ns"]
    segments: list[Segment] = []
    for name, category, span_name, end in milestones:
        span = _first(trace, span_name)
        if span is None:
            return None
        if span_name == _TRANSFER and end == "end":
            span = _last_to_end(trace, span_name)  # layer by layer: the KV is there when its last layer is
        at = max(previous, span["start_ns"] if end == "start" else span["end_ns"])
        segments.append(Segment(name, category, previous, at))
        previous = at
    return segments


def ttft_ms(segments: list[Segment]) -> float:
    return (segments[-1].end_ns - segments[0].start_ns) / 1e6


def split(segments: list[Segment]) -> dict[str, float]:
    out = {c: 0.0 for c in CATEGORIES}
    for segment in segments:
        out[segment.category] += segment.ms
    return out


# ------------------------------------------------------------------------------ rendering

def _tree(trace: list[dict]) -> list[tuple[int, dict]]:
    by_id = {s["span_id"]: s for s in trace}
    children: dict[str | None, list[dict]] = {}
    for span in trace:
        parent = span["parent_id"] if span["parent_id"] in by_id else None
        children.setdefault(parent, []).append(span)
    ordered: list[tuple[int, dict]] = []

    def walk(parent: str | None, depth: int) -> None:
        for span in sorted(children.get(parent, []), key=lambda s: (s["start_ns"], s["end_ns"])):
            ordered.append((depth, span))
            walk(span["span_id"], depth + 1)

    walk(None, 0)
    return ordered


def waterfall(trace: list[dict], width: int = 48) -> str:
    origin = min(s["start_ns"] for s in trace)
    total = max(max(s["end_ns"] for s in trace) - origin, 1)
    request_id = next((s["attributes"][A.REQUEST_ID] for s in trace if A.REQUEST_ID in s["attributes"]), "?")
    lines = [f"request {request_id}  trace {trace[0]['trace_id']}  {total / 1e6:.1f} ms, {len(trace)} spans", ""]
    name_width = 50
    for depth, span in _tree(trace):
        start = (span["start_ns"] - origin) / total
        end = (span["end_ns"] - origin) / total
        lo = min(int(start * width), width - 1)
        hi = max(lo + 1, int(round(end * width)))
        bar = " " * lo + "█" * (hi - lo)
        label = ("  " * depth + span["name"])[:name_width]
        service = span["service"].removeprefix("kvpush-")
        lines.append(
            f"{label:<{name_width}} {service:<18} {(span['start_ns'] - origin) / 1e6:8.1f} "
            f"{(span['end_ns'] - span['start_ns']) / 1e6:8.1f} ms |{bar:<{width}}|"
        )
    lines.append("")
    lines.extend(critical_path_lines(trace))
    return "\n".join(lines)


def critical_path_lines(trace: list[dict]) -> list[str]:
    """The critical path to the first token, segment by segment, and its split."""
    segments = critical_path(trace)
    if segments is None:
        return ["critical path: incomplete trace (a stage is missing)"]
    lines = [f"critical path to the first token: {ttft_ms(segments):.1f} ms"]
    for segment in segments:
        lines.append(f"  {segment.name:<20} {segment.category:<13} {segment.ms:8.1f} ms")
    shares = split(segments)
    total_ms = ttft_ms(segments) or 1.0
    lines.append("  " + "  ".join(f"{c} {shares[c]:.1f} ms ({100 * shares[c] / total_ms:.0f}%)" for c in CATEGORIES))
    return lines


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, int(round(q * (len(ordered) - 1)))))
    return ordered[index]


def summary(spans: list[dict]) -> str:
    rows = [critical_path(t) for t in group_traces(spans).values()]
    rows = [r for r in rows if r is not None]
    if not rows:
        return "no complete request traces recorded yet"
    ttfts = [ttft_ms(r) for r in rows]
    lines = [f"{len(rows)} requests; TTFT p50 {_percentile(ttfts, 0.5):.1f} ms, p99 {_percentile(ttfts, 0.99):.1f} ms", ""]
    lines.append(f"{'':<14}{'p50 ms':>9}{'p99 ms':>9}{'p50 share':>11}{'p99 share':>11}")
    for category in CATEGORIES:
        values = [split(r)[category] for r in rows]
        shares = [100 * split(r)[category] / max(ttft_ms(r), 1e-9) for r in rows]
        lines.append(
            f"{category:<14}{_percentile(values, 0.5):9.1f}{_percentile(values, 0.99):9.1f}"
            f"{_percentile(shares, 0.5):10.0f}%{_percentile(shares, 0.99):10.0f}%"
        )
    return "\n".join(lines)
