"""The worker's stack watch (:mod:`freeride._worker.stacks`): where a long step, setup or checkpoint is, written
to the log on a schedule of granted time. Pure: a fake clock and a fake stood-still total."""

from __future__ import annotations

import logging
import threading

import pytest

from freeride._worker import stacks
from freeride._worker.stacks import SETUP, STEP, StackWatch, format_threads

MS = 1_000_000


class Clock:
    def __init__(self) -> None:
        self.now = 1_000 * MS
        self.stood = 0

    def __call__(self) -> int:
        return self.now


def _watch(clock: Clock, first_ms: int = 100, steps: int = 19) -> StackWatch:
    return StackWatch("t-1", lambda: clock.stood, lambda: steps, first_report_ns=first_ms * MS, clock=clock)


def where_the_task_is_stuck(watch: StackWatch) -> bool:
    return watch.check()  # called from this frame: its name must be in the report


def test_a_step_is_reported_with_its_stack_after_the_first_report_time_of_granted_time(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    watch = _watch(clock)
    watch.started = (clock.now, 0, 1 * MS, STEP)
    clock.now += 99 * MS
    assert not watch.check()
    clock.now += 1 * MS
    with caplog.at_level(logging.WARNING, logger="freeride.worker"):
        assert where_the_task_is_stuck(watch)  # checked here, not from the watch's thread: no thread is skipped
    [record] = caplog.records
    text = record.getMessage()
    assert text.startswith("[task=t-1] a step (after 19 steps) has run 0.1 s of granted time without finishing; "
                           "where its threads are (most recent call last):")
    assert "thread MainThread:" in text and "where_the_task_is_stuck" in text and "watch.check()" in text


def test_time_the_manager_kept_the_worker_stopped_is_not_granted_time() -> None:
    clock = Clock()
    watch = _watch(clock)
    clock.stood = 5_000 * MS  # stopped before the step began: not this step's
    watch.started = (clock.now, clock.stood, 0, STEP)
    clock.now += 150 * MS
    clock.stood += 60 * MS  # frozen 60 ms of those 150: 90 ms granted
    assert not watch.check()
    clock.now += 10 * MS
    assert watch.check()


def test_reports_come_at_doubling_times_a_bounded_number_of_times() -> None:
    clock = Clock()
    watch = _watch(clock)
    watch.started = (clock.now, 0, 0, SETUP)
    at = []
    for ms in range(1, 100_000):
        clock.now = 1_000 * MS + ms * MS
        if watch.check():
            at.append(ms)
    assert at == [100 * 2**i for i in range(stacks.MAX_REPORTS)]
    assert watch.reports == stacks.MAX_REPORTS


def test_a_new_phase_starts_its_own_schedule_and_a_finished_one_is_never_reported() -> None:
    clock = Clock()
    watch = _watch(clock)
    watch.started = (clock.now, 0, 0, STEP)
    clock.now += 300 * MS
    assert watch.check()  # at 100 ms: the next is due at 200
    watch.started = None  # it finished
    assert not watch.check()
    watch.started = (clock.now, 0, 0, STEP)  # the next step
    clock.now += 50 * MS
    assert not watch.check()
    clock.now += 50 * MS
    assert watch.check()  # its own first report, at 100 ms


def test_a_task_whose_steps_are_long_is_reported_only_past_many_of_its_estimate() -> None:
    clock = Clock()
    watch = _watch(clock)
    watch.started = (clock.now, 0, 50 * MS, STEP)  # a 50 ms step estimate: the first report at 20 of them, 1 s
    clock.now += 999 * MS
    assert not watch.check()
    clock.now += 1 * MS
    assert watch.check()


def test_the_report_fits_a_failures_log_tail_however_deep_the_stack() -> None:
    def deep(n: int) -> str:
        if n:
            return deep(n - 1)
        import sys
        frames = sys._current_frames()
        return format_threads(frames)

    text = deep(200)
    assert len(text) <= stacks.REPORT_CHARS + 20
    assert text.startswith("  thread MainThread:") and "in deep" in text


def test_the_watch_thread_writes_a_report_of_a_real_long_phase(caplog: pytest.LogCaptureFixture) -> None:
    watch = StackWatch("t-2", lambda: 0, lambda: 0, first_report_ns=1)
    done = threading.Event()
    with caplog.at_level(logging.WARNING, logger="freeride.worker"):
        watch.started = (0, 0, 0, SETUP)
        original = watch.check

        def check() -> bool:
            made = original()
            if made:
                done.set()
            return made

        watch.check = check  # type: ignore[method-assign]
        watch.start()
        assert done.wait(30)
        watch.close()
    text = caplog.records[0].getMessage()
    assert "setup() has run" in text and "thread MainThread:" in text
    assert "freeride-stack-watch-t-2" not in text  # its own stack is not the task's
