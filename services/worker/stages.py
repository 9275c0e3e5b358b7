"""A request's stage times in vLLM's engine (scheduled, first token, last token), from its
engine-core timestamps, recorded as child spans of the request's span. Pure: vLLM's output
is read by attribute and the tracer is given."""

from __future__ import annotations

import time


class EngineStages:
    """Wall-clock times of vLLM's per-request stages, from its engine-core timestamps
    (monotonic, same host), recorded as child spans of the current span."""

    def __init__(self, output, tracer) -> None:
        stats = getattr(output, "metrics", None) if output is not None else None
        offset_ns = time.time_ns() - time.monotonic_ns()
        self._tracer = tracer

        def wall(ts: float) -> int | None:
            return int(ts * 1e9) + offset_ns if ts else None

        self.scheduled_ns = wall(stats.scheduled_ts) if stats else None
        self.first_token_ns = wall(stats.first_token_ts) if stats else None
        self.last_token_ns = wall(stats.last_token_ts) if stats else None

    def record(self, name: str, start_ns: int | None, end_ns: int | None) -> None:
        if start_ns is None or end_ns is None:
            return
        self._tracer.start_span(name, start_time=start_ns).end(end_time=max(start_ns, end_ns))
