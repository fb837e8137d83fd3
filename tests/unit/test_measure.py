"""The figures' arithmetic on fixed inputs (no timing is measured here)."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from scipy import stats

from freeride.measure import (
    CostInputs,
    Interval,
    StopRule,
    bootstrap_interval,
    bubble_fraction,
    cost_saving,
    harvest_efficiency,
    median,
    overhead,
    paired_overhead,
    paired_ratio,
    percentile,
    percentiles,
    rank_index,
    stop_decision,
    t_interval,
    t_quantile,
    trials_needed,
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


def test_percentile_is_the_nearest_rank_and_nan_when_empty() -> None:
    # Rank ceil(q/100 * n): p50 of 1..4 is the 2nd value, p75 the 3rd, p76 the 4th.
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 75) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 76) == 4.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 0) == 1.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 100) == 4.0
    assert percentile([5.0], 99) == 5.0
    assert median([1.0, 2.0, 3.0, 4.0]) == 2.0  # the lower middle, an observed value
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_rank_index_is_exact_where_floating_point_is_not() -> None:
    # 0.07 * 100 is 7.000000000000001 in binary floating point; the 7th value is still the p7 of 100.
    assert rank_index(100, 7) == 6
    assert rank_index(20, 95) == 18  # ceil(19.0) = 19th value
    assert rank_index(19, 95) == 18  # ceil(18.05) = 19th value: the maximum
    assert rank_index(1000, 99.9) == 998
    with pytest.raises(ValueError):
        rank_index(0, 50)


@pytest.mark.parametrize("n", [1, 2, 3, 7, 10, 19, 20, 64, 100, 101, 999, 1000, 1003])
def test_percentile_is_the_exact_nearest_rank_and_numpys_inverted_cdf(n: int) -> None:
    values = np.random.default_rng(n).normal(size=n)
    ordered = sorted(values.tolist())
    qs = [0, 0.1, 1, 5, 7, 10, 25, 33.3, 50, 66.7, 75, 90, 95, 99, 99.9, 100]
    ours = percentiles(values.tolist(), qs)
    for q, got in zip(qs, ours, strict=True):
        exact = Fraction(str(q)) * n / 100  # the rank in exact arithmetic
        assert got == ordered[max(1, math.ceil(exact)) - 1]
        if exact.denominator != 1:
            # Where the rank is exact (q * n / 100 an integer) NumPy's floating point can land one
            # rank off (q = 7, n = 100 gives its rank 8); elsewhere the two definitions are one.
            assert got == float(np.percentile(values, q, method="inverted_cdf"))


def test_t_interval_matches_the_hand_computation_and_scipy() -> None:
    # 1, 2, 3, 4: mean 2.5, s = sqrt(5/3), t(0.975, 3) = 3.18245.
    iv = t_interval([1.0, 2.0, 3.0, 4.0])
    half = 3.182446305284263 * math.sqrt(5 / 3) / 2
    assert iv.estimate == pytest.approx(2.5)
    assert iv.half_width == pytest.approx(half)
    assert (iv.low, iv.high) == pytest.approx(stats.t.interval(0.95, 3, loc=2.5, scale=stats.sem([1, 2, 3, 4])))


def test_two_trials_use_the_t_quantile_not_z() -> None:
    # The old bench printed 1.96 * s / sqrt(2); t(0.975, 1) is 12.706, 6.5 times wider.
    assert t_quantile(0.95, 1) == pytest.approx(12.7062, rel=1e-4)
    iv = t_interval([1.0, 3.0])
    assert iv.half_width == pytest.approx(12.7062 * math.sqrt(2) / math.sqrt(2), rel=1e-4)


def test_one_value_gives_an_unbounded_interval_and_identical_values_a_point() -> None:
    one = t_interval([2.0])
    assert one.estimate == 2.0 and one.half_width == math.inf
    assert one.to_json()["half_width"] is None
    same = t_interval([2.0, 2.0, 2.0])
    assert (same.low, same.high) == (2.0, 2.0)
    assert bootstrap_interval([2.0, 2.0, 2.0]).half_width == 0.0
    with pytest.raises(ValueError):
        t_interval([])
    with pytest.raises(ValueError):
        t_interval([1.0, math.nan])


def test_bootstrap_interval_is_scipys_bca_and_reproducible() -> None:
    xs = [0.9, 1.4, 1.1, 2.5, 1.0, 1.8, 1.2, 0.7]
    iv = bootstrap_interval(xs, resamples=2000, seed=3)
    ref = stats.bootstrap((np.asarray(xs),), np.mean, n_resamples=2000, method="BCa",
                          rng=np.random.default_rng(3)).confidence_interval
    assert (iv.low, iv.high) == pytest.approx((ref.low, ref.high))
    assert iv == bootstrap_interval(xs, resamples=2000, seed=3)
    assert iv.low < iv.estimate < iv.high


def test_paired_overhead_is_the_mean_per_trial_ratio_minus_one() -> None:
    # Trial ratios 1.01, 1.03, 0.99: mean 1.01, s = 0.02, t(0.975, 2) = 4.3027.
    iv = paired_overhead([101.0, 206.0, 99.0], [100.0, 200.0, 100.0])
    assert iv.estimate == pytest.approx(0.01)
    assert iv.half_width == pytest.approx(4.302652729911275 * 0.02 / math.sqrt(3))
    assert paired_ratio([2.0, 4.0], [1.0, 2.0]).estimate == pytest.approx(2.0)
    with pytest.raises(ValueError, match="pairs"):
        paired_overhead([1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="denominator"):
        paired_overhead([1.0], [0.0])
    assert paired_overhead([101.0, 103.0, 99.0], [100.0] * 3, method="bootstrap").method == "bootstrap"


def test_trials_needed_inverts_the_t_half_width() -> None:
    # Spread s = 0.03 (from 5 trials): the smallest m with t(0.975, m-1) * 0.03 / sqrt(m) <= 0.01.
    s, n = 0.03, 5
    half = t_quantile(0.95, n - 1) * s / math.sqrt(n)
    iv = Interval(0.0, -half, half, n)
    m = trials_needed(iv, 0.01)
    assert m is not None
    assert t_quantile(0.95, m - 1) * s / math.sqrt(m) <= 0.01 < t_quantile(0.95, m - 2) * s / math.sqrt(m - 1)
    assert trials_needed(Interval(0.0, -math.inf, math.inf, 1), 0.01) is None


def _iv(half: float, n: int = 5) -> Interval:
    return Interval(0.0, -half, half, n)


def test_stop_rule_runs_the_minimum_then_stops_when_every_interval_is_narrow() -> None:
    rule = StopRule(target_half_width=0.01, min_trials=3, max_trials=10, budget_s=1000)
    assert not stop_decision(rule, {"a": _iv(0.001, 2)}, trials=2, elapsed_s=10).stop
    done = stop_decision(rule, {"a": _iv(0.004), "b": _iv(0.009)}, trials=3, elapsed_s=30)
    assert done.stop and done.converged and done.widest == "b"
    assert "converged" in done.reason
    go_on = stop_decision(rule, {"a": _iv(0.004), "b": _iv(0.02)}, trials=3, elapsed_s=30)
    assert not go_on.stop and not go_on.converged and "b +-2.00 pp" in go_on.reason


def test_stop_rule_says_when_the_trial_or_time_budget_ran_out() -> None:
    rule = StopRule(target_half_width=0.01, min_trials=3, max_trials=6, budget_s=100)
    limit = stop_decision(rule, {"a": _iv(0.02, 6)}, trials=6, elapsed_s=60)
    assert limit.stop and not limit.converged and "trial limit (6)" in limit.reason
    assert limit.trials_needed is not None and limit.trials_needed["a"] is not None
    # Three trials took 90 s: a fourth (30 s at the mean) would end at 120 s > 100 s.
    budget = stop_decision(rule, {"a": _iv(0.02, 3)}, trials=3, elapsed_s=90)
    assert budget.stop and not budget.converged and "time budget" in budget.reason
    with pytest.raises(ValueError):
        StopRule(min_trials=1)
