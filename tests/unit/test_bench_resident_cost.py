"""The resident-cost bench's arithmetic: the managers' CPU cut to the measured iterations, and its report."""

from __future__ import annotations

import pytest

from bench.bench_resident_cost import CpuSampler, report


def test_the_managers_cpu_is_read_from_the_last_sample_before_the_window_to_the_first_after() -> None:
    sampler = CpuSampler()
    sampler.samples = [(100, {"cpu:0": 1.0}), (200, {"cpu:0": 1.5, "cpu:1": 0.2}), (300, {"cpu:0": 2.0, "cpu:1": 0.4}),
                       (400, {"cpu:0": 3.0, "cpu:1": 0.9})]
    assert sampler.between(250, 300) == pytest.approx({"cpu:0": 0.5, "cpu:1": 0.2})
    assert sampler.between(150, 350) == pytest.approx({"cpu:0": 2.0, "cpu:1": 0.9})  # cpu:1 from 0: not seen at 100
    assert sampler.between(0, 10_000) == pytest.approx({"cpu:0": 2.0, "cpu:1": 0.9})  # the run's ends: its ends


def test_the_report_compares_each_task_with_the_run_without_one_of_the_same_round() -> None:
    run = {"devices": {"cpu:0": {"cpu_s": 0.1, "steps": 3, "harvested_s": 0.01}, "cpu:1": {"cpu_s": 0.1}},
           "managers_cpu_ms_per_iteration": 2.0}
    doc = {"command": "python -m bench.bench_resident_cost", "machine": {"cpu": "X"},
           "config": {"schedule": "zbv", "iterations": 20, "warmup": 5, "microbatches": 4, "slow_ms": 3.0},
           "rounds": [{"round": 1, "runs": [dict(run, condition="none", iteration_ms_p50=50.0),
                                            dict(run, condition="spin:900", iteration_ms_p50=55.0)]}]}
    lines = report(doc).splitlines()
    assert "| 1 | none | 50.0 |  | 2.00 |  |  |" in lines
    assert "| 1 | spin:900 | 55.0 | +10.0% | 2.00 | 3 /  | 0.010 / 0.000 |" in lines
