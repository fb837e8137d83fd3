"""The figures' arithmetic on fixed inputs (no timing is measured here)."""

from __future__ import annotations

import math

import pytest

from freeride.measure import (
    CostInputs,
    bubble_fraction,
    cost_saving,
    harvest_efficiency,
    mean_ci95,
    overhead,
    percentile,
    work_seconds,
)


def test_overhead_is_the_ratio_minus_one() -> None:
    assert overhead(101.0, 100.0) == pytest.approx(0.01)
    assert overhead(99.0, 100.0) == pytest.approx(-0.01)


def test_overhead_refuses_a_zero_baseline_and_negative_times() -> None:
    with pytest.raises(ValueError, match="baseline"):
        overhead(1.0, 0.0)
    with pytest.raises(ValueError, match="t_mode_s"):
        overhead(-1.0, 1.0)
    with pytest.raises(ValueError, match="t_base_s"):
        overhead(1.0, math.nan)


def test_bubble_fraction_is_bubble_time_over_wall_time() -> None:
    assert bubble_fraction(3.0, 10.0) == pytest.approx(0.3)
    with pytest.raises(ValueError):
        bubble_fraction(1.0, 0.0)


def test_harvest_efficiency_converts_progress_to_standalone_seconds() -> None:
    # 500 steps at 100 steps/s standalone = 5 s of work, in 10 s of bubbles: 50%.
    assert work_seconds(500, 100.0) == pytest.approx(5.0)
    assert harvest_efficiency(500, 100.0, 10.0) == pytest.approx(0.5)


def test_harvest_efficiency_is_zero_without_bubbles_and_refuses_a_zero_throughput() -> None:
    assert harvest_efficiency(0, 100.0, 0.0) == 0.0
    with pytest.raises(ValueError, match="throughput"):
        harvest_efficiency(10, 0.0, 1.0)


def test_cost_saving_at_the_same_price_is_harvested_share_less_overhead() -> None:
    # Two devices, 100 s baseline each; 60 s of side work in all; training took 1 s longer.
    inputs = CostInputs(work_device_s=60.0, t_mode_s=101.0, t_base_s=100.0, devices=2)
    assert cost_saving(inputs, 1.0) == pytest.approx((60.0 - 2.0) / 200.0)


def test_cost_saving_scales_the_value_by_the_price_ratio_but_not_the_overhead() -> None:
    inputs = CostInputs(work_device_s=44.0, t_mode_s=100.0, t_base_s=100.0, devices=1)
    assert cost_saving(inputs, 22.0) == pytest.approx(2.0 / 100.0)
    slow = CostInputs(work_device_s=44.0, t_mode_s=110.0, t_base_s=100.0, devices=1)
    assert cost_saving(slow, 22.0) == pytest.approx((2.0 - 10.0) / 100.0)


def test_cost_saving_refuses_meaningless_inputs() -> None:
    with pytest.raises(ValueError, match="price ratio"):
        cost_saving(CostInputs(1.0, 1.0, 1.0, 1), 0.0)
    with pytest.raises(ValueError, match="devices"):
        cost_saving(CostInputs(1.0, 1.0, 1.0, 0), 1.0)
    with pytest.raises(ValueError, match="baseline"):
        cost_saving(CostInputs(1.0, 1.0, 0.0, 1), 1.0)


def test_percentile_interpolates_and_is_nan_when_empty() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile([5.0], 99) == 5.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_mean_ci95_of_identical_values_has_zero_width() -> None:
    assert mean_ci95([2.0, 2.0, 2.0]) == (2.0, 0.0)
    mean, half = mean_ci95([1.0, 3.0])
    assert mean == 2.0 and half > 0
