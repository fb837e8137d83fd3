"""The whole-run latency histogram: percentiles within its stated error, in constant memory."""

from __future__ import annotations

import random

from freeride._manager.histogram import LatencyHistogram
from freeride.messages import Percentiles


def exact(values: list[int], q: float) -> int:
    ordered = sorted(values)
    rank = max(1, -(-int(q * len(ordered) * 1_000_000) // 1_000_000))
    return ordered[min(len(ordered), rank) - 1]


def test_empty_histogram_reports_zeros() -> None:
    assert LatencyHistogram().percentiles() == Percentiles()


def test_small_values_are_exact_and_max_is_exact() -> None:
    h = LatencyHistogram()
    for v in range(1, 11):
        h.record(v)
    assert h.quantile(0.5) == 5.0
    assert h.quantile(1.0) == 10.0
    h.record(123_456_789)
    assert h.max == 123_456_789
    assert h.percentiles(scale=1.0).max == 123_456_789.0


def test_percentiles_are_within_one_thirty_second_of_the_exact_ones() -> None:
    rng = random.Random(3)
    values = [int(rng.lognormvariate(12, 1.5)) for _ in range(50_000)]  # ~160 us median, long tail
    h = LatencyHistogram()
    for v in values:
        h.record(v)
    for q in (0.5, 0.9, 0.99, 0.999):
        truth = exact(values, q)
        assert abs(h.quantile(q) - truth) <= truth / 32 + 1, q
    p = h.percentiles()
    assert p.count == 50_000 and p.p50 <= p.p90 <= p.p99 <= p.p999 <= p.max


def test_memory_does_not_grow_with_the_number_of_records() -> None:
    h = LatencyHistogram()
    for v in range(0, 10**9, 997):
        h.record(v)
    size = len(h._counts)
    for _ in range(100_000):
        h.record(5_000_000)
    assert len(h._counts) == size
    assert h.count == len(range(0, 10**9, 997)) + 100_000


def test_negative_delays_count_as_zero_and_are_counted_apart() -> None:
    h = LatencyHistogram()
    h.record(-5)
    h.record(10)
    assert h.negative == 1 and h.count == 2
    assert h.quantile(0.5) == 0.0
