"""`kvpush bench`'s statistics (tools.bench.stats): percentiles and a point's summary."""

from __future__ import annotations

import math

import pytest

from tools.bench.stats import RequestResult, percentile, summarize


def test_percentiles_interpolate_and_ignore_nan():
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == pytest.approx(2.5)
    assert percentile([5.0, float("nan"), 1.0], 0.99) == pytest.approx(4.96)  # of 1 and 5
    assert math.isnan(percentile([], 0.5))
    assert math.isnan(percentile([float("nan")], 0.5))


def test_summary_counts_failures_and_throughput():
    results = [RequestResult("kvpush-push", 8, 1.0, str(i), ok=i != 2, ttft_ms=10.0 * (i + 1), tpot_ms=5.0,
                             e2e_ms=100.0, split={"queueing": 1.0, "compute": 5.0, "coordination": 2.0,
                                                  "transfer": 0.5} if i != 2 else {})
               for i in range(4)]
    point = summarize(results, wall_s=2.0)
    assert point.failures == 1 and point.requests == 4
    assert point.throughput_rps == pytest.approx(1.5)  # 3 completed in 2 s
    assert point.ttft.p50 == pytest.approx(20.0)  # of 10, 20, 40: the failed request's 30 is left out
    assert point.ttft.mean == pytest.approx(70.0 / 3)
    assert point.split_mean == pytest.approx({"queueing": 1.0, "compute": 5.0, "coordination": 2.0,
                                              "transfer": 0.5})
