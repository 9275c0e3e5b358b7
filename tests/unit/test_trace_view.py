"""A request's TTFT split from its spans (otel/trace_view.py): with layer-wise push the
transfer is done when its last layer's WRITE is, and only what is left of it after the
prompt is computed counts as transfer."""

from __future__ import annotations

from kvpush.otel import attributes as A
from kvpush.otel.trace_view import critical_path, split, ttft_ms

MS = 1_000_000


def _span(name: str, start_ms: float, end_ms: float) -> dict:
    return {"trace_id": "t", "span_id": f"{name}-{start_ms}", "parent_id": None, "name": name,
            "start_ns": int(start_ms * MS), "end_ns": int(end_ms * MS), "attributes": {}}


def _request(*writes: tuple[float, float]) -> list[dict]:
    return [_span(A.SCHEDULER_QUEUE, 0, 1), _span(A.PREFILL_QUEUE, 2, 10), _span(A.PREFILL_COMPUTE, 10, 100),
            *(_span(A.KV_WRITE, start, end) for start, end in writes), _span(A.DECODE_FIRST_TOKEN, 130, 150)]


def test_a_whole_write_after_the_prompt_is_all_exposed():
    segments = critical_path(_request((104, 120)))
    by_name = {s.name: s.ms for s in segments}
    assert (by_name["handoff"], by_name["transfer"], by_name["kv notice"]) == (4, 16, 10)
    assert ttft_ms(segments) == 150


def test_layer_by_layer_only_the_transfer_left_after_the_prompt_counts_and_it_ends_with_the_last_layer():
    # four layers: three leave while the prompt computes, the last one after it
    segments = critical_path(_request((30, 40), (55, 65), (80, 90), (101, 108)))
    by_name = {s.name: s.ms for s in segments}
    assert (by_name["handoff"], by_name["transfer"], by_name["kv notice"]) == (0, 8, 22)
    assert split(segments)["transfer"] == 8
    assert ttft_ms(segments) == 150
