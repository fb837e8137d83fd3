"""StepEstimator: a high percentile over a bounded window, a hint before samples."""

from __future__ import annotations

import pytest

from freeride._estimator import StepEstimator, percentiles


def test_no_samples_and_no_hint_gives_no_estimate() -> None:
    est = StepEstimator()
    assert est.estimate_ns() is None
    assert est.median_ns() is None
    assert est.count == 0


def test_hint_is_the_estimate_before_any_sample() -> None:
    est = StepEstimator(hint_ns=5_000)
    assert est.estimate_ns() == 5_000
    assert est.median_ns() is None


def test_first_sample_replaces_the_hint() -> None:
    est = StepEstimator(hint_ns=5_000)
    est.add(1_000)
    assert est.estimate_ns() == 1_000


def test_estimate_is_the_p95_of_the_window_not_the_mean() -> None:
    est = StepEstimator(window=100)
    est.extend(list(range(1, 101)))  # 1..100
    assert est.estimate_ns() == 95  # nearest rank: the 95th of 100 (freeride.measure)
    assert est.median_ns() == 50


def test_a_rare_slow_step_raises_the_estimate_once_it_is_more_than_five_percent_of_the_window() -> None:
    est = StepEstimator(window=20)
    est.extend([10] * 19 + [1_000])
    assert est.estimate_ns() == 10  # 1 in 20 is exactly 5%: at least 95% of the steps took 10
    est = StepEstimator(window=19)
    est.extend([10] * 18 + [1_000])
    assert est.estimate_ns() == 1_000


def test_window_bounds_the_samples_so_the_estimate_follows_a_change() -> None:
    est = StepEstimator(window=4)
    est.extend([1_000, 1_000, 1_000, 1_000])
    assert est.estimate_ns() == 1_000
    est.extend([10, 10, 10, 10])
    assert est.count == 4
    assert est.estimate_ns() == 10


def test_estimate_cache_is_invalidated_by_a_new_sample() -> None:
    est = StepEstimator(window=8)
    est.add(10)
    assert est.estimate_ns() == 10
    est.add(50)
    assert est.estimate_ns() == 50


def test_negative_durations_are_clamped_to_zero() -> None:
    est = StepEstimator()
    est.add(-5)
    assert est.estimate_ns() == 0


def test_quantile_one_is_the_maximum() -> None:
    est = StepEstimator(quantile=1.0)
    est.extend([3, 9, 1])
    assert est.estimate_ns() == 9


@pytest.mark.parametrize("kwargs", [{"window": 0}, {"quantile": 0.0}, {"quantile": 1.5}])
def test_invalid_window_or_quantile_is_rejected(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        StepEstimator(**kwargs)  # type: ignore[arg-type]


def test_percentiles_of_an_empty_sample_are_zeros() -> None:
    assert percentiles([]) == (0, 0.0, 0.0, 0.0, 0.0)


def test_percentiles_report_count_p50_p90_p99_and_max() -> None:
    count, p50, p90, p99, top = percentiles([float(v) for v in range(100)])
    assert (count, p50, p90, p99, top) == (100, 49.0, 89.0, 98.0, 99.0)  # ranks 50, 90, 99 of 0..99
