"""End-to-end (issue 23): a step running at the trainer's real end is frozen by that end, not by the end's
arrival over the wire. A real daemon, a real ``BubbleReporter`` and a real worker whose steps take 50 ms;
the bubble ends long before its prediction, and the end's trip over the wire is held back until the test
has seen the freeze, so the order of events, not a timing, says which end froze it."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from conftest import ManagerHarness, wait_for

from freeride._boards import read_step
from freeride._manager.trace import read_trace
from freeride.messages import BubbleEnd, TrainerEvent
from freeride.training.reporter import BubbleReporter

pytestmark = pytest.mark.e2e
MS = 1_000_000


class HeldWire:
    """Holds every message that carries an end in the stream's servicer thread until released."""

    def __init__(self, post: Callable[[Sequence[TrainerEvent], int], int]) -> None:
        self._post = post
        self.release = threading.Event()
        self.ends_posted = 0

    def __call__(self, events: Sequence[TrainerEvent], received_ns: int) -> int:
        if any(isinstance(e, BubbleEnd) for e in events):
            self.release.wait(60)
            self.ends_posted += 1
        return self._post(events, received_ns)


def test_a_long_step_running_at_an_early_end_is_frozen_by_the_trainers_end_before_the_wire_brings_it(
    make_manager: Callable[..., ManagerHarness], tmp_path: Path,
) -> None:
    trace = tmp_path / "trace.jsonl"
    harness = make_manager(trace_path=trace)
    task = harness.submit("sample_tasks:Counter", args={"step_ms": 50.0})
    harness.wait_state(task.task_id, "PARKED")
    wire = HeldWire(harness.manager.loop.post_bubbles)
    harness.manager.loop.post_bubbles = wire  # type: ignore[method-assign]
    reporter = BubbleReporter(str(harness.manager.device), stage=0, rank=0, endpoint=harness.endpoint,
                              backoff_initial_s=0.01)
    try:
        wait_for(lambda: reporter.counters().connected and reporter._end_wake is not None, 10,
                 what="the reporter to connect and open the end wake")
        # Predicted at 60 s: without the trainer's end, nothing would freeze the step for a minute.
        reporter.bubble_start(0, 0, "test", predicted_ns=60_000 * MS)
        board = harness.manager.loop.task_dir(task.task_id) / "board"
        wait_for(lambda: read_step(board) >= 0, 30, what="the worker to begin a step")
        reporter.bubble_end(0, 0)  # steps of 50 ms back to back: one is running now
        harness.wait_state(task.task_id, "FROZEN", timeout_s=20)
        assert wire.ends_posted == 0, "the end crossed the wire before the freeze: this test shows nothing"
        wire.release.set()
        wait_for(lambda: harness.client.stats().bubble_time_s > 0, 10, what="the end to be measured")
        stats = harness.client.stats()
        assert stats.overruns == 1 and stats.events_rejected == 0
        # The next bubble thaws it and grants it again.
        reporter.bubble_start(1, 0, "test", predicted_ns=60_000 * MS)
        harness.wait_state(task.task_id, "RUNNING", timeout_s=20)
        reporter.bubble_end(1, 0)
    finally:
        wire.release.set()
        reporter.close()
    harness.wait_state(task.task_id, "PARKED", "FROZEN", timeout_s=20)
    wait_for(lambda: any(r["ev"] == "bubble_end" and r.get("iteration") == 1 for r in read_trace(trace)), 10,
             what="the trace to carry the second end")
    order = [r["ev"] for r in read_trace(trace) if r["ev"] in ("freeze", "bubble_end")]
    assert order[:2] == ["freeze", "bubble_end"], order


def test_a_worker_that_dies_while_its_bubbles_end_is_armed_fails_alone_and_the_manager_serves_on(
    harness: ManagerHarness,
) -> None:
    task = harness.submit("sample_tasks:Counter", args={"step_ms": 50.0})
    harness.wait_state(task.task_id, "PARKED")
    wire = HeldWire(harness.manager.loop.post_bubbles)
    harness.manager.loop.post_bubbles = wire  # type: ignore[method-assign]
    reporter = BubbleReporter(str(harness.manager.device), stage=0, rank=0, endpoint=harness.endpoint,
                              backoff_initial_s=0.01)
    try:
        wait_for(lambda: reporter.counters().connected and reporter._end_wake is not None, 10,
                 what="the reporter to connect and open the end wake")
        reporter.bubble_start(0, 0, "test", predicted_ns=60_000 * MS)
        board = harness.manager.loop.task_dir(task.task_id) / "board"
        wait_for(lambda: read_step(board) >= 0, 30, what="the worker to begin a step")
        info = harness.client.get(task.task_id)
        assert info.pid
        os.kill(info.pid, signal.SIGKILL)
        reporter.bubble_end(0, 0)  # its wake comes for a grant whose worker is dying or gone
        failed = harness.wait_state(task.task_id, "FAILED", timeout_s=20)
        assert failed.failure is not None and failed.failure.kind == "SIGNAL"
        wire.release.set()
        wait_for(lambda: harness.client.stats().bubble_time_s > 0, 10, what="the end to be measured")
        other = harness.submit("sample_tasks:Counter", args={"step_ms": 1.0})
        harness.wait_state(other.task_id, "PARKED")
        reporter.bubble_start(1, 0, "test", predicted_ns=200 * MS)
        harness.wait_state(other.task_id, "RUNNING", timeout_s=20)
        reporter.bubble_end(1, 0)
        harness.wait_state(other.task_id, "PARKED", "FROZEN", timeout_s=20)  # frozen if a step ran at the end
        assert harness.client.stats().events_rejected == 0
    finally:
        wire.release.set()
        reporter.close()
