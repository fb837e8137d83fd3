"""A task's life in the core: submission, failures and exits, finishing, cancel, drain, stop timeouts, and
the StateChanged audit trail."""

from __future__ import annotations

import signal

import pytest
from core_sim import MS, T0, MiB, S, Sim, grants, non_state, of

from freeride._manager.core import (
    CancelRequested,
    DrainComplete,
    DrainRequested,
    Kill,
    Note,
    NoteLevel,
    Spawn,
    StateChanged,
    Stop,
    TaskMemorySampled,
    Thaw,
    WorkerCheckpointed,
    WorkerExited,
    WorkerFailed,
    WorkerFinished,
)
from freeride.messages import FailureRecord
from freeride.states import TaskState


def test_task_added_is_submitted_with_state_changed_from_none() -> None:
    sim = Sim()
    actions = sim.add("a")
    assert actions == [StateChanged("a", None, S.SUBMITTED, "submitted")]
    assert sim.state("a") == S.SUBMITTED


def test_duplicate_task_id_is_rejected() -> None:
    sim = Sim()
    sim.add("a", mem_mib=100)
    first = sim.core.tasks["a"]
    # The core never raises on a well-formed event: the duplicate is refused with a warning, and the task
    # that holds the id is untouched.
    actions = sim.add("a", mem_mib=999)
    assert actions == [Note(NoteLevel.WARNING, "refused: a task with this id exists already", "a")]
    assert sim.core.tasks["a"] is first and first.memory_bytes == 100 * MiB


def test_worker_failure_then_exit_is_failed_with_the_failure_record() -> None:
    sim = Sim()
    sim.resident("a")
    sim.start(predicted_ms=10)
    failure = FailureRecord(kind="EXCEPTION", message="ZeroDivisionError: boom", step=3, traceback="Traceback ...")
    assert sim.send(WorkerFailed("a", failure)) == []
    assert sim.state("a") == S.RUNNING  # the exit completes the record
    actions = sim.exited("a", exit_code=1, log_tail="last lines\n")
    changes = of(actions, StateChanged)
    assert len(changes) == 1
    assert (changes[0].old, changes[0].new, changes[0].reason) == (S.RUNNING, S.FAILED, "EXCEPTION")
    recorded = sim.core.tasks["a"].failure
    assert recorded == changes[0].failure
    assert recorded is not None
    assert recorded.kind == "EXCEPTION"
    assert recorded.traceback == "Traceback ..."
    assert recorded.step == 3
    assert recorded.log_tail == "last lines\n"


def test_steps_of_the_grant_a_task_failed_in_count_as_harvested_work() -> None:
    # No park follows a failure: the failure report carries that grant's steps.
    sim = Sim()
    sim.resident("a")
    sim.start(predicted_ms=10)
    before = sim.core.stats.harvested_ns
    failure = FailureRecord(kind="EXCEPTION", message="boom", step=3)
    sim.send(WorkerFailed("a", failure, durations_ns=(2 * MS, 3 * MS, 4 * MS), progress=30.0, total_steps=3))
    sim.exited("a", exit_code=1)
    task = sim.core.tasks["a"]
    assert task.state == S.FAILED
    assert task.harvested_ns == 9 * MS and sim.core.stats.harvested_ns - before == 9 * MS
    assert task.steps == 3 and task.progress == 30.0


def test_worker_failure_keeps_its_own_log_tail() -> None:
    sim = Sim()
    sim.resident("a")
    sim.send(WorkerFailed("a", FailureRecord(kind="IMPORT", message="no module x", log_tail="own tail")))
    sim.exited("a", exit_code=1, log_tail="exit tail")
    failure = sim.core.tasks["a"].failure
    assert failure is not None and failure.log_tail == "own tail"


def test_exit_by_signal_without_a_failure_message_is_failed_signal() -> None:
    sim = Sim()
    sim.resident("a")
    actions = sim.exited("a", exit_code=None, sig=signal.SIGSEGV, log_tail="segfault")
    assert StateChanged("a", S.PARKED, S.FAILED, "SIGNAL", sim.core.tasks["a"].failure) in actions
    failure = sim.core.tasks["a"].failure
    assert failure is not None
    assert failure.kind == "SIGNAL"
    assert failure.signal == signal.SIGSEGV
    assert "SIGSEGV" in failure.message
    assert failure.log_tail == "segfault"


def test_exit_without_finishing_or_reporting_is_failed_exit_with_the_code() -> None:
    sim = Sim()
    sim.resident("a")
    sim.exited("a", exit_code=3)
    failure = sim.core.tasks["a"].failure
    assert failure is not None and failure.kind == "EXIT" and failure.exit_code == 3


def test_starting_worker_that_dies_is_failed() -> None:
    sim = Sim()
    sim.add("a")
    sim.free(1000)
    actions = sim.exited("a", exit_code=1)
    assert of(actions, StateChanged)[0].new == S.FAILED


def test_crash_of_the_running_task_lets_another_task_use_the_rest_of_the_bubble() -> None:
    sim = Sim()
    sim.resident("crashy", "steady")
    assert grants(sim.start(predicted_ms=10)) == ["crashy"]
    sim.advance_ms(2)
    sim.send(WorkerFailed("crashy", FailureRecord(kind="EXCEPTION", message="boom")))
    actions = sim.exited("crashy", exit_code=1)
    assert sim.state("crashy") == S.FAILED
    assert grants(actions) == ["steady"]


def test_crash_of_one_task_does_not_stop_others_at_the_next_bubble() -> None:
    sim = Sim()
    sim.resident("crashy", "steady")
    sim.start(predicted_ms=10)
    sim.advance_ms(10)
    sim.end()
    sim.exited("crashy", exit_code=None, sig=signal.SIGABRT)
    assert sim.state("crashy") == S.FAILED
    assert sim.core.next_timer_ns() is None  # no freeze pending for a dead worker
    sim.advance_ms(5)
    assert grants(sim.start(predicted_ms=10)) == ["steady"]


def test_regression_memory_limit_kill_of_the_running_task_backfills_the_bubble_after_exit() -> None:
    sim = Sim()
    sim.resident("hog", "steady")
    assert grants(sim.start(predicted_ms=10)) == ["hog"]
    sim.advance_ms(1)
    actions = sim.send(TaskMemorySampled("hog", used_bytes=10_000 * MiB))
    assert of(actions, Kill) == [Kill("hog")]
    assert grants(actions) == []  # not while the killed process may still run kernels
    sim.advance_ms(1)
    assert grants(sim.exited("hog", exit_code=None, sig=signal.SIGKILL)) == ["steady"]


def test_worker_finished_is_finished_and_exit_afterwards_changes_nothing() -> None:
    sim = Sim()
    sim.resident("a")
    sim.start(predicted_ms=10)
    actions = sim.send(WorkerFinished("a", total_steps=42, progress=1.0))
    assert StateChanged("a", S.RUNNING, S.FINISHED, "done") in actions
    assert sim.core.tasks["a"].steps == 42
    assert sim.exited("a", exit_code=0) == []
    assert sim.state("a") == S.FINISHED


def test_a_finish_that_crossed_the_freeze_is_finished_and_the_worker_let_run_to_its_exit() -> None:
    # Stranger trial: 5 of 31 tasks that had done all their work were FAILED "EXIT: worker exited with code 0
    # without reporting an error": the finish arrived after the freeze of a step that outlived its bubble, was
    # dropped ("a frozen worker sends nothing"), and the worker exited at its next grant.
    sim = Sim()
    sim.resident("a")
    sim.start(predicted_ms=10)
    sim.advance_ms(20)
    sim.tick()
    assert sim.state("a") == S.FROZEN
    actions = sim.send(WorkerFinished("a", total_steps=7, progress=1.0))
    assert Thaw("a") in actions and StateChanged("a", S.FROZEN, S.FINISHED, "done") in actions
    assert sim.exited("a", exit_code=0) == []
    assert sim.state("a") == S.FINISHED and sim.core.tasks["a"].failure is None


def test_worker_finished_frees_the_bubble_for_the_next_task() -> None:
    sim = Sim()
    sim.resident("a", "b")
    sim.start(predicted_ms=10)
    assert grants(sim.send(WorkerFinished("a", total_steps=1, progress=1.0))) == ["b"]


def test_events_for_unknown_tasks_are_ignored() -> None:
    sim = Sim()
    for event in (
        WorkerFailed("ghost", FailureRecord(kind="EXIT", message="")),
        WorkerExited("ghost", exit_code=0, signal=0),
        WorkerFinished("ghost", total_steps=1, progress=1.0),
        WorkerCheckpointed("ghost", step=1, path="/x", progress=0.1),
        TaskMemorySampled("ghost", used_bytes=1),
    ):
        assert sim.send(event) == []


def test_cancel_of_a_submitted_task_goes_directly_to_cancelled() -> None:
    sim = Sim()
    sim.add("a")
    actions = sim.send(CancelRequested("a"))
    assert actions == [StateChanged("a", S.SUBMITTED, S.CANCELLED, "cancelled by user")]


@pytest.mark.parametrize("state", [S.STARTING, S.PARKED, S.RUNNING, S.FROZEN])
def test_cancel_of_a_resident_task_kills_it_and_cancels(state: TaskState) -> None:
    sim = Sim()
    sim.add("a")
    sim.free(1000)
    if state != S.STARTING:
        sim.ready("a")
    if state in (S.RUNNING, S.FROZEN):
        sim.start(predicted_ms=10)
    if state == S.FROZEN:
        sim.advance_ms(20)
        sim.tick()
    assert sim.state("a") == state
    actions = sim.send(CancelRequested("a"))
    assert actions == [Kill("a"), StateChanged("a", state, S.CANCELLED, "cancelled by user")]
    assert sim.core.next_timer_ns() is None


def test_cancelled_task_frees_its_memory_for_waiting_tasks() -> None:
    sim = Sim()
    sim.add("a", mem_mib=600)
    sim.add("b", mem_mib=600)
    sim.free(1000)
    actions = sim.send(CancelRequested("a"))
    assert [s.task_id for s in of(actions, Spawn)] == ["b"]


def test_later_events_for_a_cancelled_task_change_nothing() -> None:
    sim = Sim()
    sim.resident("a")
    sim.start(predicted_ms=10)
    sim.send(CancelRequested("a"))
    assert sim.send(CancelRequested("a")) == []
    assert sim.send(WorkerFailed("a", FailureRecord(kind="SIGNAL", message="killed"))) == []
    assert sim.send(WorkerFinished("a", total_steps=1, progress=1.0)) == []
    assert sim.send(TaskMemorySampled("a", used_bytes=10**12)) == []
    assert sim.exited("a", exit_code=None, sig=signal.SIGKILL) == []
    assert sim.state("a") == S.CANCELLED
    assert sim.core.tasks["a"].failure is None


def test_transition_out_of_a_terminal_state_raises_invalid_transition() -> None:
    from freeride.errors import InvalidTransition

    sim = Sim()
    sim.add("a")
    sim.send(CancelRequested("a"))
    with pytest.raises(InvalidTransition):
        sim.core._tasks.move(sim.core.tasks["a"], S.SUBMITTED, "resurrect", [])


# ====================================================================== drain


def test_drain_stops_every_resident_task_with_checkpoint() -> None:
    sim = Sim()
    sim.resident("a", "b", "c")
    sim.start(predicted_ms=10)  # "a" running
    actions = sim.send(DrainRequested())
    assert sorted(of(actions, Stop), key=lambda s: s.task_id) == [
        Stop("a", checkpoint=True),
        Stop("b", checkpoint=True),
        Stop("c", checkpoint=True),
    ]
    assert of(actions, DrainComplete) == []


def test_drain_completes_once_no_task_is_resident_and_tasks_go_back_to_submitted() -> None:
    sim = Sim()
    sim.resident("a", "b")
    sim.add("queued", mem_mib=10**6)
    sim.send(DrainRequested())
    assert of(sim.exited("a", exit_code=0), DrainComplete) == []
    actions = sim.exited("b", exit_code=0)
    assert of(actions, DrainComplete) == [DrainComplete()]
    assert of(actions, Spawn) == []  # no re-placement while draining
    assert {t: sim.state(t) for t in ("a", "b", "queued")} == {
        "a": S.SUBMITTED,
        "b": S.SUBMITTED,
        "queued": S.SUBMITTED,
    }
    # Drained, not "draining": a stranger waited for a stop that comes only with a SIGTERM.
    assert sim.core.waiting_reason(sim.core.tasks["a"]).startswith("the manager is drained: nothing starts until")
    assert of(sim.tick(), DrainComplete) == []  # announced once


def test_drain_with_nothing_resident_completes_at_once() -> None:
    sim = Sim()
    sim.add("a", mem_mib=10**6)
    assert sim.send(DrainRequested()) == [DrainComplete()]


def test_a_second_drain_is_answered_at_once_once_nothing_is_resident() -> None:
    # Regression (issue 13): DrainComplete was announced once, so a second drain (or SIGTERM after a
    # drain) never got an answer and the manager could no longer be stopped.
    sim = Sim()
    sim.resident("a")
    sim.send(DrainRequested())
    assert of(sim.exited("a", exit_code=0), DrainComplete) == [DrainComplete()]
    assert sim.send(DrainRequested()) == [DrainComplete()]
    assert sim.send(DrainRequested()) == [DrainComplete()]
    assert of(sim.tick(), DrainComplete) == []


def test_a_drain_asked_again_while_under_way_completes_once_for_both() -> None:
    sim = Sim()
    sim.resident("a")
    sim.send(DrainRequested())
    again = sim.send(DrainRequested())
    assert of(again, DrainComplete) == [] and of(again, Stop) == []  # nothing new to stop
    assert of(sim.exited("a", exit_code=0), DrainComplete) == [DrainComplete()]


def test_no_grants_or_spawns_while_draining() -> None:
    sim = Sim()
    sim.resident("a")
    sim.send(DrainRequested())
    sim.add("b")
    assert of(sim.free(10_000), Spawn) == []
    assert sim.start(predicted_ms=10) == []
    assert sim.state("b") == S.SUBMITTED


def test_drain_kills_a_starting_task_instead_of_asking_it_to_checkpoint() -> None:
    sim = Sim()
    sim.add("a")
    sim.free(1000)
    actions = sim.send(DrainRequested())
    assert non_state(actions) == [Kill("a")]


def test_a_task_told_to_stop_mid_step_is_thawed_at_once_when_its_bubble_ends_and_freezes_it() -> None:
    # A drain beside a running job: the worker, told to stop mid-step, was frozen at its bubble's end, no grant came
    # to thaw it, and the stop timeout killed it (a stranger's; a CI run's).
    from freeride._manager.core import Freeze

    sim = Sim()
    sim.resident("a")
    assert grants(sim.start(predicted_ms=10)) == ["a"]
    sim.advance_ms(1)
    assert of(sim.send(DrainRequested()), Stop) == [Stop("a", checkpoint=True)]
    sim.end()
    sim.advance_ms(5)  # past the end + grace: the step still runs
    actions = sim.tick()
    assert of(actions, Freeze) and of(actions, Thaw) == [Thaw("a")]
    assert sim.core.tasks["a"].killed_at_stop is False


def test_worker_that_ignores_stop_is_killed_at_the_stop_timeout() -> None:
    sim = Sim(stop_timeout_ns=100 * MS)
    sim.resident("a")
    sim.send(DrainRequested())
    deadline = sim.core.next_timer_ns()
    assert deadline == T0 + 100 * MS
    sim.at(deadline - 1)
    assert sim.tick() == []
    sim.at(deadline)
    assert sim.tick() == [Note(NoteLevel.WARNING, "did not stop in time; killing it", "a"), Kill("a")]
    assert sim.core.next_timer_ns() is None
    actions = sim.exited("a", exit_code=None, sig=signal.SIGKILL)
    # Killed during a drain: it loses only the work since its last checkpoint and is placed again.
    assert sim.state("a") == S.SUBMITTED
    assert of(actions, DrainComplete) == [DrainComplete()]


def test_worker_that_stops_in_time_is_not_killed() -> None:
    sim = Sim(stop_timeout_ns=100 * MS)
    sim.resident("a")
    sim.send(DrainRequested())
    sim.advance_ms(10)
    sim.exited("a", exit_code=0)
    assert sim.core.next_timer_ns() is None
    sim.advance_ms(200)
    assert sim.tick() == []


def test_every_transition_emits_exactly_one_state_changed_and_they_chain() -> None:
    """Replay a busy scenario; the StateChanged stream alone must reconstruct every task's state."""
    sim = Sim(grace_ns=MS, step_timeout_ns=10**12, stop_timeout_ns=50 * MS, margin_ns=MS // 5)
    sim.add("a", mem_mib=300)
    sim.add("b", mem_mib=300, priority=1)
    sim.add("c", mem_mib=300)
    sim.add("gone", mem_mib=50)
    sim.send(CancelRequested("gone"))
    sim.start(predicted_ms=10, free_mib=700)  # a, b fit; c waits
    sim.ready("a")
    sim.ready("b")
    sim.advance_ms(3)
    sim.parked("b", [1.0, 1.0], reason="deadline")  # backfill to "a"
    sim.advance_ms(7)
    sim.end()
    sim.advance_ms(2)
    sim.tick()  # freeze "a"
    sim.advance_ms(3)
    sim.start(predicted_ms=10, free_mib=700)  # thaw "a"
    sim.advance_ms(2)
    sim.send(WorkerFailed("a", FailureRecord(kind="EXCEPTION", message="x")))
    sim.exited("a", exit_code=1)  # c spawns, b backfills
    sim.ready("c")
    sim.advance_ms(8)
    sim.end()
    sim.parked("b", [2.0], reason="park")
    sim.core.memory._device.clear()
    sim.free(350)  # evict "c" (lowest priority parked)
    sim.exited("c", exit_code=0)
    sim.send(DrainRequested())
    sim.advance_ms(100)
    sim.tick()  # kill "b"
    sim.exited("b", exit_code=None, sig=signal.SIGKILL)

    replayed: dict[str, TaskState] = {}
    for change in of(sim.actions, StateChanged):
        assert replayed.get(change.task_id) == change.old, change
        assert change.old != change.new
        replayed[change.task_id] = change.new
    assert replayed == {task_id: task.state for task_id, task in sim.core.tasks.items()}
    seen = {(c.task_id, c.new) for c in of(sim.actions, StateChanged)}
    for expected in [
        ("a", S.FROZEN),
        ("a", S.FAILED),
        ("c", S.EVICTED),
        ("c", S.SUBMITTED),
        ("gone", S.CANCELLED),
        ("b", S.RUNNING),
    ]:
        assert expected in seen
    assert of(sim.actions, DrainComplete) == [DrainComplete()]


def test_a_starting_task_says_its_worker_is_starting_not_nothing() -> None:
    # Stranger trial: after a restart, `ls` showed tasks STARTING with WHY "-" for a minute.
    sim = Sim()
    sim.add("a")
    sim.free(1000)
    assert sim.state("a") == S.STARTING
    assert sim.core.waiting_reason(sim.core.tasks["a"]).startswith("its worker is starting: importing the task's")
    sim.ready("a")
    assert not sim.core.waiting_reason(sim.core.tasks["a"]).startswith("its worker is starting")


def test_a_tick_is_wanted_only_when_one_has_work() -> None:
    # The loop feeds a tick at a turn only then: one at each of its ~7 turns a bubble cost its thread ~4 us each.
    sim = Sim(grace_ns=MS // 2)
    assert not sim.core.wants_tick(sim.now)  # nothing at all
    sim.add("a")
    assert sim.core.wants_tick(sim.now)  # a task waits for admission
    sim.free(100_000)
    sim.ready("a")
    assert not sim.core.wants_tick(sim.now)  # parked, nothing due
    sim.start(predicted_ms=10)  # granted: its freeze is armed at the predicted end + grace
    due = sim.core.next_timer_ns()
    assert due is not None and not sim.core.wants_tick(due - 1) and sim.core.wants_tick(due)
    sim.at(due)
    sim.tick()  # frozen: a step that may come to look hung is judged on ticks
    assert sim.state("a") == S.FROZEN and sim.core.wants_tick(sim.now)


def test_trainer_events_may_decide_something_only_while_a_task_is_resident() -> None:
    sim = Sim()
    assert not sim.core.wants_trainer_events()  # no task: they only add to the statistics
    sim.add("a")
    assert not sim.core.wants_trainer_events()  # waiting for admission: its memory figure may come late
    sim.free(100_000)
    assert sim.state("a") == S.STARTING and sim.core.wants_trainer_events()
    sim.ready("a")
    assert sim.core.wants_trainer_events()  # parked: the next bubble is its
