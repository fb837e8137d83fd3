"""End-to-end: the manager's timeline trace, and the reference policy the bench emulates."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import ManagerHarness, cpu_devices, read_steps, wait_for

from freeride._manager.trace import read_trace

DEVICE = cpu_devices(1)[0]  # a core this process may run on: tests never name core numbers

pytestmark = pytest.mark.e2e

MS = 1_000_000


def test_trace_records_every_bubble_and_each_grants_steps_inside_it(
    make_manager: Callable[..., ManagerHarness], tmp_path: Path
) -> None:
    trace = tmp_path / "trace.jsonl"
    h = make_manager(trace_path=trace)
    task = h.submit("sample_tasks:Counter", args={"step_ms": 1.0})
    h.wait_state(task.task_id, "PARKED")
    feeder = h.feeder()
    # Predicted longer than real: each real end reaches a running worker and parks it.
    feeder.run(12, length_ms=20, predicted_ms=40, gap_ms=10)
    feeder.close()
    # A step that overran the last bubble leaves its worker frozen until a next bubble that never comes.
    h.wait_state(task.task_id, "PARKED", "FROZEN")
    h.manager.stop()
    records = read_trace(trace)
    kinds = {r["ev"] for r in records}
    assert {"bubble_start", "bubble_end", "grant", "park", "steps", "state"} <= kinds
    assert sum(r["ev"] == "bubble_start" for r in records) == 12
    assert sum(r["ev"] == "bubble_end" for r in records) == 12
    assert all(r["device"] == DEVICE for r in records)
    spans = [span for r in records if r["ev"] == "steps" for span in r["spans"]]
    assert spans, "the trace has no step spans"
    for start, end in spans:
        assert start <= end
        assert any(b.start_ns <= start <= b.predicted_end_ns for b in feeder.sent)
    # The trace's spans are the worker's own steps (the task logs each step it takes).
    logged = {s for s, _ in read_steps(h.manager.loop.task_dir(task.task_id) / "work")}
    assert len(spans) <= len(logged)


def test_the_trace_can_be_read_while_the_manager_runs(
    make_manager: Callable[..., ManagerHarness], tmp_path: Path
) -> None:
    # Stranger trial: the file stayed empty until SIGTERM, and a kill -9 lost the whole run.
    trace = tmp_path / "trace.jsonl"
    h = make_manager(trace_path=trace)
    feeder = h.feeder()
    feeder.run(3, length_ms=5, gap_ms=5)
    wait_for(lambda: sum(r["ev"] == "bubble_end" for r in read_trace(trace)) == 3, 10,
             what="the running manager's trace to show the three bubbles")
    feeder.close()


def test_paper_policy_runs_steps_only_before_the_profiled_end_and_never_freezes(
    make_manager: Callable[..., ManagerHarness], tmp_path: Path
) -> None:
    trace = tmp_path / "trace.jsonl"
    # Profiled minimum 30 ms for every bubble of slot 0; the real bubbles last 40 ms.
    h = make_manager(trace_path=trace, policy="paper", paper_profile_ns={(0, 0): 30 * MS})
    task = h.submit("sample_tasks:Counter", args={"step_ms": 1.0})
    h.wait_state(task.task_id, "PARKED")
    feeder = h.feeder()
    feeder.run(15, length_ms=40, gap_ms=10)
    feeder.close()
    # A step that overran the last bubble leaves its worker frozen until a next bubble that never comes.
    h.wait_state(task.task_id, "PARKED", "FROZEN")
    h.manager.stop()
    records = read_trace(trace)
    grants = [r for r in records if r["ev"] == "grant"]
    assert grants, "the paper policy never granted"
    starts = {r["start_ns"] for r in records if r["ev"] == "bubble_start"}
    for g in grants:
        assert g["deadline_ns"] - 30 * MS in starts, "the deadline is not start + the profiled minimum"
        assert g["at_ns"] >= g["deadline_ns"] - 30 * MS, "granted before its bubble started"
    assert not [r for r in records if r["ev"] == "freeze"]
    spans = [span for r in records if r["ev"] == "steps" for span in r["spans"]]
    assert spans
    for start, _end in spans:
        assert any(b.start_ns <= start <= b.start_ns + 30 * MS for b in feeder.sent)
