"""One percentile definition (nearest rank, ``freeride.measure``) wherever a figure is computed.

The same samples go through every place that reports or acts on a percentile: the manager's
statistics windows, the step-time estimator (admission), the fixed-memory histogram, the bubble
predictor and its error summary, standalone step times, the single-stage trainer's cost learner and
the benches' helpers. They must all give the figure ``freeride.measure.percentile`` gives, so that
two numbers in one report (a manager's p99 beside the bench's own) never disagree by definition.
"""

from __future__ import annotations

import random

import pytest

from bench.bench_load import pct as load_pct
from freeride import measure
from freeride._estimator import StepEstimator, percentiles
from freeride._manager.histogram import LatencyHistogram, _bucket
from freeride.standalone import percentile as standalone_percentile
from freeride.training.predictor import BubblePredictor, summarize
from freeride.workload.stage_clocks import CostLearner

SAMPLES = [random.Random(7).randrange(1_000, 5_000_000) for _ in range(257)]
EVEN = SAMPLES[:64]


def test_the_managers_windows_give_the_measure_percentiles() -> None:
    count, p50, p90, p99, top = percentiles([float(v) for v in SAMPLES])
    assert count == len(SAMPLES)
    assert (p50, p90, p99, top) == measure.percentiles(SAMPLES, (50, 90, 99, 100))


def test_the_step_estimator_admits_on_the_measure_p95_and_median() -> None:
    est = StepEstimator(window=len(EVEN))
    est.extend(EVEN)
    assert est.estimate_ns() == measure.percentile(EVEN, 95)
    assert est.median_ns() == measure.median(EVEN)
    paper = StepEstimator(window=len(EVEN), quantile=0.5)  # the reference policy admits on the median
    paper.extend(EVEN)
    assert paper.estimate_ns() == measure.median(EVEN)


def test_the_histogram_finds_the_same_rank_within_its_bucket_error() -> None:
    hist = LatencyHistogram()
    for v in SAMPLES:
        hist.record(v)
    for q in (0.5, 0.9, 0.99, 0.999):
        exact = measure.percentile(SAMPLES, 100 * q)
        assert hist.quantile(q) == pytest.approx(exact, rel=1 / 32)
        # The same rank, not a neighbour: the reported value is the midpoint of the exact sample's bucket.
        assert _bucket(int(hist.quantile(q))) == _bucket(int(exact))


def test_predictor_summaries_and_slot_medians_use_the_same_definition() -> None:
    errors = [v / 1e6 for v in SAMPLES]
    s = summarize(errors)
    assert (s.p50, s.p90, s.p99) == measure.percentiles(errors, (50, 90, 99))
    pred = BubblePredictor(window=len(EVEN), warmup=1)
    for v in EVEN:
        pred.observe(0, 0, v)
    assert pred.predict_ns(0, 0) == int(measure.median(EVEN))


def test_standalone_learner_and_bench_helpers_agree() -> None:
    ms = [v / 1e6 for v in SAMPLES]
    assert standalone_percentile(ms, 90) == measure.percentile(ms, 90)
    learner = CostLearner()
    for i, v in enumerate(EVEN):
        learner.observe("F", i + 1, float(v))
    assert learner.estimate("F") == measure.median(EVEN)
    figures = load_pct(ms)
    assert figures["p99"] == round(measure.percentile(ms, 99), 3)


def test_empty_samples_are_zero_where_a_report_needs_a_number() -> None:
    assert percentiles([]) == (0, 0.0, 0.0, 0.0, 0.0)
    assert standalone_percentile([], 50) == 0.0
    assert LatencyHistogram().quantile(0.99) == 0.0
