"""A step that the manager froze (SIGSTOP) and thawed (SIGCONT) is timed without its frozen time.

Regression: on a loaded machine a step overran a bubble, was frozen across the next compute
phase and reported as a 250-400 ms step; that one sample made the step-time estimate fit no
20-40 ms bubble (the task starved until a re-probe), counted compute time as harvested, and,
reported under the thawing grant, gave a negative "bubble start -> first step" latency.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import cpu_devices
from test_worker_step_cost import WaitingCore

from freeride._boards import WorkerBoard
from freeride._channel import Grant, Init, Message, Parked
from freeride._worker.runtime import WorkerRuntime
from freeride._worker.timing import ThawCounter
from freeride.task import SideTask, TaskContext

DEVICE = cpu_devices(1)[0]  # a core this process may run on: tests never name core numbers

MS = 1_000_000


class _FakeChannel:
    """Records what the worker sends; hands it queued messages between steps."""

    def __init__(self) -> None:
        self.sent: list[Message] = []
        self.inbox: list[Message] = []

    def send(self, msg: Message) -> None:
        self.sent.append(msg)

    def recv_nowait(self) -> Message | None:
        return self.inbox.pop(0) if self.inbox else None


class _Steps(SideTask):
    """Three steps; the hook runs inside step 2 (index 1)."""

    def __init__(self, hook: Any) -> None:
        self.n = 0
        self.hook = hook

    def setup(self, ctx: TaskContext) -> None:
        pass

    def step(self) -> None:
        self.n += 1
        if self.n == 2:
            self.hook()

    def done(self) -> bool:
        return self.n >= 3

    def progress(self) -> float:
        return float(self.n)



def test_a_board_closed_while_a_frozen_step_ran_leaves_the_step_its_wall_time() -> None:
    thaws = ThawCounter()

    def closed() -> int:
        raise ValueError("mmap closed or invalid")

    thaws.stood_still = closed  # the total read at the start was 1000; at the end the mapping is gone (0)
    assert thaws.ran_ns(start_ns=0, end_ns=1000, stood_before=1000, deadline_ns=5000, cpu_ns=0) == 1000

@pytest.fixture
def runtime(tmp_path: Path) -> Iterator[tuple[WorkerRuntime, _FakeChannel]]:
    chan = _FakeChannel()
    init = Init(task_id="t-1", memory_limit_bytes=2**28, work_dir=str(tmp_path / "work"),
                checkpoint_dir=str(tmp_path / "ckpt"), device=DEVICE)
    rt = WorkerRuntime(chan, init)  # type: ignore[arg-type]
    previous = signal.getsignal(signal.SIGCONT)
    rt.thaws.install()
    yield rt, chan
    signal.signal(signal.SIGCONT, previous)


def _grant(g: int) -> Grant:
    return Grant(g, deadline_ns=time.monotonic_ns() + 60_000 * MS, margin_ns=0)


def test_a_frozen_step_counts_what_ran_before_its_deadline_and_after_the_thaw_not_the_frozen_time(
    runtime: tuple[WorkerRuntime, _FakeChannel],
) -> None:
    rt, chan = runtime

    def frozen_then_thawed() -> None:
        time.sleep(0.4)  # past the grant's deadline: the time it spent frozen
        os.kill(os.getpid(), signal.SIGCONT)  # what the manager's thaw delivers

    rt.task = _Steps(frozen_then_thawed)
    rt.setup_done = True
    grant = Grant(1, deadline_ns=time.monotonic_ns() + 150 * MS, margin_ns=0)
    assert rt._run_grant(grant) is False  # the deadline passed: parked after the frozen step
    parked = next(m for m in chan.sent if isinstance(m, Parked))
    assert parked.steps == 2 and parked.progress == 2.0
    first, frozen = parked.durations_ns
    assert frozen <= 150 * MS + 20 * MS, "the frozen time was counted"
    assert frozen >= grant.deadline_ns - parked.starts_ns[1] > 0, "less than the bubble time it had"
    estimate = rt.estimator.estimate_ns()
    assert estimate is not None and estimate < 200 * MS
    assert parked.first_step_ns > 0  # the grant's first step was not the frozen one


def test_a_step_frozen_after_an_early_bubble_end_is_bounded_by_that_end_not_the_predicted_deadline(
    runtime: tuple[WorkerRuntime, _FakeChannel], tmp_path: Path,
) -> None:
    """Regression: the bound used the grant's predicted deadline, so each early end counted the frozen
    time up to it as step time; under early-ending bubbles the p95 grew to fit no bubble."""
    rt, chan = runtime
    rt._board = WorkerBoard.create(tmp_path / "board")
    ended = {"at": 0}

    def ended_early_then_frozen_then_thawed() -> None:
        time.sleep(0.02)
        ended["at"] = time.monotonic_ns()
        assert rt._board is not None
        rt._board.end_grant(1, ended["at"])  # the real end, long before the predicted deadline
        time.sleep(0.4)  # frozen until the next bubble
        os.kill(os.getpid(), signal.SIGCONT)

    rt.task = _Steps(ended_early_then_frozen_then_thawed)
    rt.setup_done = True
    deadline = time.monotonic_ns() + 60_000 * MS  # predicted: far beyond the real end
    assert rt._run_grant(Grant(1, deadline_ns=deadline, margin_ns=0)) is False
    parked = next(m for m in chan.sent if isinstance(m, Parked))
    assert parked.steps == 2 and parked.reason == "park"
    frozen = parked.durations_ns[1]
    ran_before_end = ended["at"] - parked.starts_ns[1]
    assert ran_before_end <= frozen < ran_before_end + 100 * MS, "the frozen time was counted as step time"


def test_running_time_of_a_frozen_step_is_its_cpu_time_or_its_runs_around_the_freezes_whichever_is_more() -> None:
    thaws = ThawCounter()
    thaws.last_ns = 900  # the last thaw; a run between two freezes (say 400-500) is missed by the bounds
    assert thaws.running_ns(start_ns=0, end_ns=1000, deadline_ns=100, cpu_ns=0) == 100 + 100
    assert thaws.running_ns(start_ns=0, end_ns=1000, deadline_ns=100, cpu_ns=300) == 300  # compute-bound
    # Never more than the wall time, whatever the stamps say.
    assert thaws.running_ns(start_ns=0, end_ns=1000, deadline_ns=100, cpu_ns=5000) == 1000
    thaws.last_ns = 0
    assert thaws.running_ns(start_ns=50, end_ns=150, deadline_ns=500, cpu_ns=0) == 100


def test_a_grant_a_freeze_ended_is_reported_with_its_own_steps_and_the_next_grant_with_only_its_own(
    runtime: tuple[WorkerRuntime, _FakeChannel],
) -> None:
    """Regression: the thawing grant's report held every step since the last park, those of the grants
    that freezes ended included, so that a trace showed their bubbles empty and one bubble with
    thousands of steps."""
    rt, chan = runtime
    rt.task = _Steps(lambda: chan.inbox.append(_grant(2)))  # thawed: the manager's next grant is queued
    rt.setup_done = True
    rt._run_grant(_grant(1))
    frozen, thawing = [m for m in chan.sent if isinstance(m, Parked)]
    assert (frozen.grant_id, frozen.reason, frozen.steps, len(frozen.durations_ns)) == (1, "frozen", 2, 2)
    assert frozen.first_step_ns > 0  # grant 1's own first step
    assert (thawing.grant_id, thawing.steps, len(thawing.durations_ns)) == (2, 1, 1)
    assert thawing.starts_ns[0] > frozen.starts_ns[-1]
    assert thawing.first_step_ns == 0  # "not measured": it came after the rest of grant 1's step
    assert thawing.total_steps == 3
    # Each report carries the process's CPU time at its own last step's start, in order.
    assert 0 < frozen.last_start_cpu_ns <= thawing.last_start_cpu_ns <= time.process_time_ns()


def test_a_second_thaw_before_any_step_of_the_first_reports_nothing_for_it(
    runtime: tuple[WorkerRuntime, _FakeChannel],
) -> None:
    rt, chan = runtime
    rt.task = _Steps(lambda: chan.inbox.extend([_grant(2), _grant(3)]))  # frozen twice in one step
    rt.setup_done = True
    rt._run_grant(_grant(1))
    reports = [(m.grant_id, m.reason, m.steps) for m in chan.sent if isinstance(m, Parked)]
    assert reports == [(1, "frozen", 2), (3, "done", 1)]


def test_an_unfrozen_grant_still_reports_every_duration_and_its_first_step(
    runtime: tuple[WorkerRuntime, _FakeChannel],
) -> None:
    rt, chan = runtime
    rt.task = _Steps(lambda: None)
    rt.setup_done = True
    before = time.monotonic_ns()
    rt._run_grant(_grant(1))
    parked = next(m for m in chan.sent if isinstance(m, Parked))
    assert len(parked.durations_ns) == 3
    assert parked.first_step_ns >= before


def test_the_board_totals_the_time_the_manager_kept_the_worker_stopped(tmp_path: Path) -> None:
    board = WorkerBoard.create(tmp_path / "board")
    board.note_stop(100, continued=False)
    board.note_stop(150, continued=True)
    board.note_stop(160, continued=True)  # a continue with no stop before it (a grant's SIGCONT to a parked worker)
    assert board.stood_still_ns() == 50
    board.note_stop(200, continued=False)
    board.note_stop(260, continued=True)
    assert board.stood_still_ns() == 110
    board.close()


def test_a_frozen_steps_time_is_its_wall_time_less_what_the_board_says_it_stood_still() -> None:
    thaws = ThawCounter()
    total = {"ns": 1000}
    thaws.stood_still = lambda: total["ns"]
    before = thaws.stood_still_ns()
    total["ns"] += 700  # two stops while the step ran (one SIGCONT handled: pending ones are one signal)
    assert thaws.ran_ns(start_ns=0, end_ns=1000, stood_before=before, deadline_ns=5000, cpu_ns=0) == 300
    thaws.stood_still = None  # no board: the bound
    assert thaws.ran_ns(start_ns=0, end_ns=1000, stood_before=0, deadline_ns=100, cpu_ns=0) == (
        thaws.running_ns(0, 1000, 100, 0))


@pytest.fixture
def boarded(tmp_path: Path) -> Iterator[tuple[WorkerRuntime, _FakeChannel, WorkerBoard]]:
    """A runtime whose manager shares a board with it (the manager's side returned), its SIGCONT counted."""
    manager_board = WorkerBoard.create(tmp_path / "board")
    chan = _FakeChannel()
    init = Init(task_id="t-1", memory_limit_bytes=2**28, work_dir=str(tmp_path / "work"),
                checkpoint_dir=str(tmp_path / "ckpt"), device=DEVICE, board_file=str(tmp_path / "board"))
    rt = WorkerRuntime(chan, init)  # type: ignore[arg-type]
    previous = signal.getsignal(signal.SIGCONT)
    rt.thaws.install()
    yield rt, chan, manager_board
    signal.signal(signal.SIGCONT, previous)
    manager_board.close()


def _stood_still(board: WorkerBoard, seconds: float) -> None:
    """What a manager's freeze and thaw do to the board around ``seconds`` stopped (the signals are not sent)."""
    board.note_stop(time.monotonic_ns(), continued=False)
    time.sleep(seconds)
    board.note_stop(time.monotonic_ns(), continued=True)


def _second_step(rt: WorkerRuntime, chan: _FakeChannel, hook: Any) -> Parked:
    rt.task = _Steps(hook)
    rt.setup_done = True
    rt._run_grant(Grant(1, deadline_ns=time.monotonic_ns() + 60_000 * MS, margin_ns=0))
    return next(m for m in chan.sent if isinstance(m, Parked))


def test_a_step_thawed_by_a_later_bubble_that_ended_too_runs_its_time_less_the_stop_not_to_that_end(
    boarded: tuple[WorkerRuntime, _FakeChannel, WorkerBoard],
) -> None:
    """Regression: the bound took the latest ended grant's end, a later bubble's once the thawing grant had ended
    too: a 0.2 ms step measured 1-70 ms, and on the second ranks of the multi-stage schedules the p95 estimate
    fitted no bubble (a stranger's task did 33 steps in 100 iterations)."""
    rt, chan, board = boarded

    def stopped_then_thawed_by_a_bubble_that_ended() -> None:
        time.sleep(0.01)  # ran in its bubble
        board.end_grant(1, time.monotonic_ns())
        _stood_still(board, 0.3)
        board.end_grant(2, time.monotonic_ns() + 50 * MS)  # the thawing grant's bubble, over later
        os.kill(os.getpid(), signal.SIGCONT)

    parked = _second_step(rt, chan, stopped_then_thawed_by_a_bubble_that_ended)
    assert parked.steps == 2  # parked at the end it then read
    assert 10 * MS <= parked.durations_ns[1] < 100 * MS, "the time it stood still was counted"


def test_a_frozen_steps_cost_is_its_time_less_the_stops_and_less_its_wait_for_the_core(
    boarded: tuple[WorkerRuntime, _FakeChannel, WorkerBoard],
) -> None:
    # A step stood still 200 ms (frozen) and waited 30 ms for its core (the trainer had it): it cost the rest.
    rt, chan, board = boarded
    core = WaitingCore()
    rt.device = core

    def waited_then_stopped() -> None:
        time.sleep(0.04)
        core.waited += 30 * MS  # 30 of those 40 ms the core was the trainer's
        _stood_still(board, 0.2)
        os.kill(os.getpid(), signal.SIGCONT)

    parked = _second_step(rt, chan, waited_then_stopped)
    ran, cost = parked.durations_ns[1], parked.costs_ns[1]
    assert 40 * MS <= ran < 150 * MS, "the stop was counted"
    # Less the wait; never less than the process's CPU time over the step (other threads of a loaded test process).
    assert ran - 30 * MS <= cost < ran - 10 * MS, "the wait for the core was counted"


def test_two_stops_before_the_worker_ran_again_are_both_left_out_of_its_step(
    boarded: tuple[WorkerRuntime, _FakeChannel, WorkerBoard],
) -> None:
    # At nice 19 a thawed worker may not run before the next freeze stops it again: its two SIGCONTs are then one
    # signal, one handler call. The board's total holds both stops.
    rt, chan, board = boarded

    def stopped_twice() -> None:
        time.sleep(0.01)
        _stood_still(board, 0.15)
        _stood_still(board, 0.15)
        os.kill(os.getpid(), signal.SIGCONT)

    parked = _second_step(rt, chan, stopped_twice)
    assert 10 * MS <= parked.durations_ns[1] < 100 * MS, "a stop was counted as step time"
