"""The demo's figures and consistency checks on fixed data (nothing is run or timed here)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from demo_data import ITERATION_MS, iterations, run, run_traces, stats, task

from freeride._demo.summary import (
    DemoError,
    DemoSummary,
    read_iteration_log,
    render_summary,
    stage_figures,
    summarize,
    training_time_s,
)
from freeride.messages import FailureRecord, ManagerStats, TaskInfo

DEVICES = ("cpu:0", "cpu:1")


def _summary(
    manager_stats: dict[str, ManagerStats] | None = None,
    tasks: dict[str, list[TaskInfo]] | None = None,
    rates: dict[str, float | None] | None = None,
    baseline_ms: float = ITERATION_MS,
    run_ms: float = ITERATION_MS,
    count: int = 10,
    iterations_expected: int = 10,
) -> DemoSummary:
    if manager_stats is None:
        manager_stats = {"cpu:0": stats("cpu:0", 0.3, 0.2), "cpu:1": stats("cpu:1", 0.25, 0.2)}
    if tasks is None:
        tasks = {"cpu:0": [task("lstm-1", "lstm", 400.0, unit="samples")],
                 "cpu:1": [task("pagerank-1", "pagerank", 30.0), task("watermark-2", "watermark", 10.0)]}  # fmt: skip
    if rates is None:
        rates = {"lstm": 2000.0, "pagerank": 200.0, "watermark": 100.0}
    with_tasks = run(count, iteration_ms=run_ms)
    traces = run_traces(with_tasks, {d: [t.task_id for t in ts] for d, ts in tasks.items()})
    return summarize(
        device_kind="cpu", devices=DEVICES, iterations=iterations_expected, warmup_iterations=2,
        baseline=run(count, iteration_ms=baseline_ms), run=with_tasks, manager_stats=manager_stats,
        tasks=tasks, standalone_per_s=rates, traces=traces,
    )  # fmt: skip


def test_stage_figures_leave_the_warmup_out_of_the_bubble_fraction() -> None:
    its = iterations(0, count=10, warmup=2, bubble_ms=(20.0, 10.0))
    fig = stage_figures(its)
    assert fig.measured_iterations == 8 and fig.iterations == 10
    assert fig.train_s == pytest.approx(0.8)
    assert fig.bubble_s == pytest.approx(8 * 0.030)
    assert fig.bubble_fraction == pytest.approx(0.3)
    assert fig.bubbles_per_iteration == 2
    # Side tasks harvest from the first iteration: the run's bubble time includes the warm-up.
    assert fig.run_bubble_s == pytest.approx(10 * 0.030)


def test_stage_figures_show_the_learned_slots_apart() -> None:
    import dataclasses

    its = iterations(0, count=10, warmup=2, bubble_ms=(20.0, 10.0))
    its = [dataclasses.replace(it, bubbles=(it.bubbles[0], dataclasses.replace(it.bubbles[1], kind="learned")))
           for it in its]
    fig = stage_figures(its)
    assert fig.bubble_fraction == pytest.approx(0.3)  # learned slots are bubbles too
    assert fig.learned_fraction == pytest.approx(0.1)


def test_training_time_is_the_slowest_stage_after_the_warmup() -> None:
    by_stage = {0: iterations(0, iteration_ms=100.0), 1: iterations(1, iteration_ms=110.0)}
    assert training_time_s(by_stage) == pytest.approx(8 * 0.110)


def test_overhead_compares_the_run_with_side_tasks_to_the_baseline() -> None:
    summary = _summary(baseline_ms=100.0, run_ms=102.0)
    assert summary.baseline_s == pytest.approx(0.8)
    assert summary.with_tasks_s == pytest.approx(0.816)
    assert summary.overhead == pytest.approx(0.02)


def test_harvest_efficiency_is_the_harvest_of_the_traces_after_the_warmup() -> None:
    summary = _summary()
    by_name = {t.name: t for t in summary.tasks}
    # cpu:0 after the 2 warm-up iterations: 8 x (20 + 10) ms of bubbles, each granted to the LSTM for two
    # steps; a step is 400 samples / 400 steps = 1 sample, 0.5 ms of standalone work at 2000 samples/s.
    cpu0 = next(d for d in summary.device_figures if d.device == "cpu:0")
    assert cpu0.bubble_s == pytest.approx(0.24)
    lstm = by_name["lstm"]
    assert lstm.work_s == pytest.approx(16 * 2 * 0.0005)
    assert lstm.efficiency == pytest.approx(0.016 / 0.24)
    assert cpu0.efficiency == pytest.approx(lstm.efficiency)
    # cpu:1: 8 x 25 ms, its bubbles granted in turn to PageRank (5 ms a step alone) and the watermark (10 ms).
    cpu1 = next(d for d in summary.device_figures if d.device == "cpu:1")
    assert cpu1.bubble_s == pytest.approx(0.2)
    assert cpu1.work_s == pytest.approx(8 * 0.005 + 8 * 0.010)
    assert cpu1.efficiency == pytest.approx(0.12 / 0.2)
    shares = [by_name[n].efficiency for n in ("pagerank", "watermark")]
    assert cpu1.efficiency == pytest.approx(sum(s for s in shares if s is not None))
    assert cpu1.harvested_share == pytest.approx(0.2 / 0.25)
    assert cpu1.breakdown is not None and sum(cpu1.breakdown.values()) == pytest.approx(1.0)


def test_the_demo_and_the_bench_compute_harvest_efficiency_with_one_function() -> None:
    # The bench's H for the same trace, window and yardstick is the demo's, by construction.
    from freeride._demo.summary import measurement_window
    from freeride.harvest import harvest, standalone_step_s

    with_tasks = run()
    traces = run_traces(with_tasks, {"cpu:0": ["lstm-1"]})
    summary = _summary()
    cpu0 = next(d for d in summary.device_figures if d.device == "cpu:0")
    bench = harvest([traces["cpu:0"]], {"lstm-1": standalone_step_s(400.0, 400, 2000.0)},
                    measurement_window(with_tasks))
    assert cpu0.efficiency == pytest.approx(bench.efficiency)


def test_a_device_without_a_trace_has_no_efficiency() -> None:
    with_tasks = run()
    tasks = {"cpu:0": [task("lstm-1", "lstm", 400.0)], "cpu:1": [task("pagerank-1", "pagerank", 30.0)]}
    summary = summarize(device_kind="cpu", devices=DEVICES, iterations=10, warmup_iterations=2, baseline=run(),
                        run=with_tasks, manager_stats={"cpu:0": stats("cpu:0", 0.3, 0.2),
                                                       "cpu:1": stats("cpu:1", 0.25, 0.2)},
                        tasks=tasks, standalone_per_s={"lstm": 2000.0, "pagerank": 200.0}, traces={})
    assert all(d.efficiency is None and d.breakdown is None for d in summary.device_figures)
    assert all(t.efficiency is None for t in summary.tasks)


def test_a_consistent_run_reports_no_problem() -> None:
    summary = _summary()
    assert summary.problems == ()
    assert summary.consistent


def test_harvesting_more_than_the_bubble_time_is_inconsistent() -> None:
    summary = _summary(manager_stats={"cpu:0": stats("cpu:0", 0.3, 0.31), "cpu:1": stats("cpu:1", 0.25, 0.1)})
    assert not summary.consistent
    assert any("cpu:0" in p and "more than" in p for p in summary.problems)


def test_a_task_without_progress_is_inconsistent() -> None:
    tasks = {"cpu:0": [task("lstm-1", "lstm", 0.0)], "cpu:1": [task("pagerank-1", "pagerank", 3.0)]}
    summary = _summary(tasks=tasks)
    assert summary.problems == ("lstm (lstm-1) made no progress",)


def test_a_failed_task_is_inconsistent_and_keeps_its_failure_record() -> None:
    failure = FailureRecord(kind="MEMORY_LIMIT", message="used 900 MiB, over its cap of 768 MiB", step=3)
    tasks = {"cpu:0": [task("lstm-1", "lstm", 24.0, state="FAILED", failure=failure)],
             "cpu:1": [task("pagerank-1", "pagerank", 3.0)]}  # fmt: skip
    summary = _summary(tasks=tasks)
    assert any("FAILED: MEMORY_LIMIT: used 900 MiB" in p for p in summary.problems)
    lstm = next(t for t in summary.tasks if t.name == "lstm")
    assert lstm.failure is not None and lstm.failure["kind"] == "MEMORY_LIMIT"
    assert "lstm failed: MEMORY_LIMIT" in render_summary(summary)


def test_a_stage_that_logged_fewer_iterations_than_asked_is_inconsistent() -> None:
    summary = _summary(count=9, iterations_expected=10)
    assert sum("logged 9 of 10 iterations" in p for p in summary.problems) == 2


def test_a_device_without_manager_statistics_is_inconsistent() -> None:
    summary = _summary(manager_stats={"cpu:0": stats("cpu:0", 0.3, 0.1)})
    assert "cpu:1: its manager's statistics are missing" in summary.problems


def test_an_unknown_standalone_throughput_leaves_the_efficiency_unknown() -> None:
    summary = _summary(rates={"lstm": None, "pagerank": 200.0, "watermark": 100.0})
    lstm = next(t for t in summary.tasks if t.name == "lstm")
    assert lstm.work_s is None and lstm.efficiency is None
    cpu0 = next(d for d in summary.device_figures if d.device == "cpu:0")
    assert cpu0.efficiency is None
    assert summary.consistent  # unknown is not wrong


def test_more_standalone_work_than_bubble_time_is_noted_not_an_inconsistency() -> None:
    summary = _summary(rates={"lstm": 100.0, "pagerank": 200.0, "watermark": 100.0})
    assert summary.consistent
    assert any(n.startswith("lstm:") for n in summary.notes)


def test_a_training_run_that_missed_a_demo_device_is_an_error() -> None:
    with pytest.raises(DemoError, match="cpu:7"):
        summarize(device_kind="cpu", devices=("cpu:0", "cpu:7"), iterations=10, warmup_iterations=2,
                  baseline=run(), run=run(), manager_stats={}, tasks={}, standalone_per_s={})  # fmt: skip


def test_the_summary_is_json_and_renders_every_figure() -> None:
    summary = _summary()
    doc: dict[str, Any] = json.loads(json.dumps(summary.to_json()))
    assert doc["consistent"] is True
    assert {s["stage"] for s in doc["stages"]} == {0, 1}
    assert {t["name"] for t in doc["tasks"]} == {"lstm", "pagerank", "watermark"}
    text = render_summary(summary)
    for needle in ("bubble fraction", "30.0%", "overhead", "indicative only", "efficiency", "lstm (lstm-1)",
                   "400 samples", "checks: harvested <= bubble time",
                   "side tasks (as the managers had them when training ended, before they were stopped)"):  # fmt: skip
        assert needle in text, needle


def test_an_inconsistent_summary_renders_its_problems() -> None:
    summary = _summary(manager_stats={"cpu:0": stats("cpu:0", 0.3, 0.5), "cpu:1": stats("cpu:1", 0.25, 0.1)})
    assert "INCONSISTENT:" in render_summary(summary)


def test_the_iteration_log_reader_skips_the_trainers_summary_record(tmp_path: Path) -> None:
    log = tmp_path / "it.rank0.jsonl"
    bubble = {"slot": 0, "kind": "drain", "start_ns": 10**9 - 5 * 10**6, "length_ms": 4.0, "predicted_ms": 3.0,
              "free_memory_bytes": 1}
    record = {"iteration": 0, "rank": 0, "stage": 0, "device": "cpu:0", "warmup": True, "time_ms": 12.5,
              "end_ns": 10**9, "bubbles": [bubble]}  # fmt: skip
    log.write_text(json.dumps(record) + "\n" + json.dumps({"summary": True, "rank": 0}) + "\n")
    (it,) = read_iteration_log(log)
    assert it.start_ns == 10**9 - 12_500_000
    assert it.bubbles[0].length_ms == 4.0 and it.warmup


def test_a_malformed_iteration_log_names_the_file_and_line(tmp_path: Path) -> None:
    log = tmp_path / "it.rank1.jsonl"
    log.write_text('{"iteration": 0, "stage": 1}\n')
    with pytest.raises(DemoError, match=r"it.rank1.jsonl:1: .*missing field 'device'"):
        read_iteration_log(log)
    with pytest.raises(DemoError, match="cannot read"):
        read_iteration_log(tmp_path / "absent.jsonl")
