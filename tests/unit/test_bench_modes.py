"""The bench's bookkeeping on fixed inputs: measurement windows, traces, per-trial overheads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.bench_modes import RunResult, measurement_window, summarize, targets, window_figures

MS = 1_000_000


def bubble(start_ms: float, end_ms: float, iteration: int) -> list[dict]:
    key = {"stage": 0, "rank": 0, "iteration": iteration, "slot": 0}
    return [{"ev": "bubble_start", **key, "start_ns": int(start_ms * MS), "predicted_ns": 1},
            {"ev": "bubble_end", **key, "end_ns": int(end_ms * MS)}]


def steps(task: str, *spans_ms: tuple[float, float], count: int | None = None) -> dict:
    spans = [[int(a * MS), int(b * MS)] for a, b in spans_ms]
    return {"ev": "steps", "task": task, "grant": 1, "reason": "park", "count": count or len(spans), "spans": spans}


def test_window_counts_only_bubbles_and_steps_that_start_inside_it() -> None:
    records = [*bubble(0, 10, 0), steps("a", (1, 4), (4, 7)),
               *bubble(20, 30, 1), steps("a", (21, 24), (24, 29)),
               *bubble(40, 50, 2), steps("a", (41, 52))]
    fig = window_figures(records, start_ns=15 * MS, end_ns=60 * MS)
    assert fig.bubble_s == pytest.approx(0.020)
    assert fig.steps == {"a": 3}
    assert fig.harvested_s == pytest.approx((3 + 5 + 11) / 1e3)
    # The 20-30 bubble's last step ended at 29 (no overrun); the 40-50 bubble's at 52.
    assert sorted(fig.overruns_ms) == [pytest.approx(0.0), pytest.approx(2.0)]


def test_window_uses_the_grants_step_count_when_spans_were_truncated() -> None:
    records = [*bubble(0, 10, 0), steps("a", (1, 2), count=500)]
    assert window_figures(records, 0, 100 * MS).steps == {"a": 500}


def test_measurement_window_starts_after_the_last_warmup_iteration_of_any_rank(tmp_path: Path) -> None:
    log = tmp_path / "it.jsonl"
    for rank, ends in ((0, [100, 200, 300]), (1, [110, 210, 310])):
        lines = [json.dumps({"iteration": i, "warmup": i == 0, "time_ms": 1.0, "end_ns": e})
                 for i, e in enumerate(ends)]
        (tmp_path / f"it.rank{rank}.jsonl").write_text("\n".join(lines + ['{"summary": true}']) + "\n")
    assert measurement_window(log) == (110, 310)


def run(mode: str, trial: int, iteration_ms: float, task_set: str = "-", work_s: float = 0.0,
        bubble_s: float = 0.0) -> RunResult:
    return RunResult(mode, task_set, trial, iteration_ms, iterations=10, bubble_s=bubble_s, work_s=work_s)


def test_overhead_is_taken_against_none_of_the_same_trial() -> None:
    runs = [run("none", 0, 100.0), run("none", 1, 200.0),
            run("freeride", 0, 101.0, "pagerank", work_s=0.8, bubble_s=1.0),
            run("freeride", 1, 202.0, "pagerank", work_s=0.9, bubble_s=1.0),
            run("freeride-paper", 0, 100.0, "pagerank", work_s=0.4, bubble_s=1.0),
            run("freeride-paper", 1, 200.0, "pagerank", work_s=0.5, bubble_s=1.0)]
    table = summarize(runs, ["pagerank"])
    row = table["pagerank/freeride"]
    assert row["overhead"] == pytest.approx(0.01)
    assert row["harvest_efficiency"] == pytest.approx(0.85)
    assert table["pagerank/none"]["overhead"] == pytest.approx(0.0)
    # Saving at 1x: (W - n dT) / (n T_base) per trial, then the mean.
    t0 = (0.8 - 2 * 0.01) / (2 * 1.0)
    t1 = (0.9 - 2 * 0.02) / (2 * 2.0)
    assert row["saving"]["1x"] == pytest.approx((t0 + t1) / 2)
    lines = targets(table)
    assert any("harvest / paper harvest 1.89x" in line and "met" in line for line in lines)
    assert any("overhead +1.00%" in line and "missed" in line for line in lines)
