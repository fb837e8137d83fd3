"""The lifecycles the core declares (``core/machines.py``): each transition table is whole, what it forbids
raises, and each part moves its state only along it (stop phase, step health, bubbles, drain, budget)."""

from __future__ import annotations

import enum

import pytest
from core_sim import MS, MiB, S, Sim

from freeride._manager.core import (
    DrainRequested,
    LayoutChanged,
    ReleaseRequested,
    TaskAdded,
    TaskMemorySampled,
    WorkerStepsSeen,
)
from freeride._manager.core.machines import (
    BUBBLE,
    BUDGET,
    DRAIN,
    STEP,
    STOP,
    BubblePhase,
    BudgetPhase,
    DrainPhase,
    Lifecycle,
    StepPhase,
    StopPhase,
)
from freeride._manager.core.steps import BOOKING_NS, TRAINER_PAUSE_NS, StepHealth
from freeride.errors import InvalidTransition
from freeride.messages import TaskSpec, TrainerLayout

MACHINES: list[tuple[Lifecycle, type[enum.Enum]]] = [
    (STOP, StopPhase), (STEP, StepPhase), (BUBBLE, BubblePhase), (DRAIN, DrainPhase), (BUDGET, BudgetPhase),
]


@pytest.mark.parametrize(("machine", "states"), MACHINES, ids=lambda m: getattr(m, "what", ""))
def test_every_state_has_its_transitions_declared_and_staying_put_is_allowed(
    machine: Lifecycle, states: type[enum.Enum]
) -> None:
    for old in states:
        assert machine.allows(old, old)
        for new in states:
            machine.allows(old, new)  # a KeyError here: a state without its row


def test_a_forbidden_transition_raises_naming_the_machine_and_whose_state_it_is() -> None:
    with pytest.raises(InvalidTransition, match=r"stop pagerank-3: FAIL -> DRAIN is not allowed"):
        STOP.check(StopPhase.FAIL, StopPhase.DRAIN, "pagerank-3")
    with pytest.raises(InvalidTransition, match=r"bubble \(0, 1, 2, 3\): CLOSED -> OPEN"):
        BUBBLE.check(BubblePhase.CLOSED, BubblePhase.OPEN, (0, 1, 2, 3))
    with pytest.raises(InvalidTransition, match=r"^drain: DRAINED -> SERVING"):
        DRAIN.check(DrainPhase.DRAINED, DrainPhase.SERVING)


# ------------------------------------------------------------------ the stop phase


def test_a_release_takes_over_an_eviction_and_the_exit_clears_the_stop() -> None:
    sim = Sim()
    sim.seq += 1
    sim.send(TaskAdded("a", TaskSpec(target="m:C", name="a", memory_bytes=100 * MiB), sim.seq, from_queue=True))
    sim.free(1000)
    sim.ready("a")
    sim.free(0)
    task = sim.core.tasks["a"]
    assert (task.stop, task.stopping) == (StopPhase.EVICT, True)
    sim.send(ReleaseRequested("a", "lost"))
    assert task.stop is StopPhase.RELEASE
    sim.exited("a")
    assert (task.stop, task.stopping) == (StopPhase.NONE, False)


def test_a_task_killed_for_a_failure_is_not_asked_to_stop_for_anything_else() -> None:
    sim = Sim()
    sim.resident("a")
    sim.send(TaskMemorySampled("a", 10_000 * MiB))
    task = sim.core.tasks["a"]
    assert task.stop is StopPhase.FAIL and task.state == S.FAILED
    with pytest.raises(InvalidTransition):
        task.stop_for(StopPhase.DRAIN)
    sim.send(DrainRequested())  # the drain leaves it alone: it is on its way out already
    assert task.stop is StopPhase.FAIL


# ------------------------------------------------------------------ step health


def test_a_board_only_moves_step_health_forward() -> None:
    health = StepHealth()
    health.seen_on_board(0, in_setup=True)
    assert health.phase is StepPhase.IN_SETUP and health.in_setup
    health.seen_on_board(0, in_setup=False)
    assert health.phase is StepPhase.FRESH
    health.seen_on_board(2, in_setup=False)
    assert health.phase is StepPhase.STEPPED and health.has_stepped
    health.seen_on_board(0, in_setup=True)  # a finished step means setup is over, whatever the board says
    assert health.phase is StepPhase.STEPPED


def test_a_step_looks_hung_only_after_the_process_finished_one_and_a_finished_step_clears_it() -> None:
    health = StepHealth(stuck_ns=100 * MS)
    assert not health.looks_hung(longest_bubble_ns=10 * MS)  # setup or a first step: never hung
    health.finished_steps()
    health.ran_past_end(100 * MS)
    assert health.looks_hung(longest_bubble_ns=10 * MS) and not health.looks_hung(longest_bubble_ns=60 * MS)
    assert not health.hung_too_long(now_ns=5 * MS, step_timeout_ns=MS, last_bubble_ns=4 * MS)  # first seen now
    assert health.phase is StepPhase.HUNG and health.hung_seen_ns == 5 * MS
    assert health.hung_too_long(now_ns=6 * MS, step_timeout_ns=MS, last_bubble_ns=4 * MS)
    health.finished_steps()
    assert (health.phase, health.hung_seen_ns, health.stuck_ns) == (StepPhase.STEPPED, 0, 0)
    health.new_process()
    assert health.phase is StepPhase.FRESH


def test_a_step_of_a_task_whose_steps_are_short_for_a_hang_never_looks_hung() -> None:
    # Stranger trial: 3-5 ms steps, 0.3-1.4 ms predicted bubbles on Interleaved1F1B: one ordinary step frozen
    # across three grants looked hung, and the task was failed STEP_TIMEOUT once the training stopped.
    health = StepHealth()
    health.finished_steps()
    for _ in range(3):
        health.ran_past_end(MS)
    assert health.looks_hung(longest_bubble_ns=int(1.4 * MS))  # the bubbles alone say hung ...
    assert not health.looks_hung(longest_bubble_ns=int(1.4 * MS), step_ns=4 * MS)  # ... its steps say not
    for _ in range(40):
        health.ran_past_end(MS)
    assert health.looks_hung(longest_bubble_ns=int(1.4 * MS), step_ns=4 * MS)  # ten of its steps: hung


def test_a_wait_for_the_core_booked_grants_late_keeps_a_step_from_looking_hung() -> None:
    # Stranger trial, reproduced with a busy loop at nice 0 on the core: a task of 1 ms steps (9 of them in 7 s)
    # was held as looking hung. Stopped while it waits for the core, a worker at nice 19 stops only once it gets
    # one, and its run delay is booked then: readings at tens of freezes in a row missed their grants' waits, and
    # a later one showed all of them.
    health = StepHealth()
    health.finished_steps()
    health.ran_past_end(11 * MS, now_ns=0)
    health.waited(0, now_ns=0)  # the first reading: what came before it is not known, the grant is stuck time
    for k in range(1, 30):
        health.ran_past_end(11 * MS, now_ns=k * 12 * MS)
        health.waited(0, now_ns=k * 12 * MS)  # the stop has not landed: nothing booked yet
        assert not health.looks_hung(longest_bubble_ns=10 * MS, step_ns=MS)
    health.ran_past_end(11 * MS, now_ns=30 * 12 * MS)
    health.waited(30 * 11 * MS, now_ns=30 * 12 * MS)  # thirty grants' waits, booked once the worker got the core
    assert health.stuck_ns == 11 * MS and not health.unbooked  # only the first grant's
    assert not health.looks_hung(longest_bubble_ns=10 * MS, step_ns=MS)


def test_a_step_whose_grants_no_wait_explains_looks_hung_once_their_booking_is_overdue() -> None:
    health = StepHealth()
    health.finished_steps()
    health.waited(5 * MS, now_ns=0)
    at = 0
    for _ in range(4):  # it ran, or slept, through its grants: every grant is the step's
        at += 12 * MS
        health.ran_past_end(11 * MS, now_ns=at)
        health.waited(5 * MS, now_ns=at)
    assert not health.looks_hung(longest_bubble_ns=10 * MS, step_ns=MS)  # not yet: a wait may still be booked
    health.ran_past_end(11 * MS, now_ns=at + BOOKING_NS)
    health.waited(5 * MS, now_ns=at + BOOKING_NS + 1)
    assert health.stuck_ns == 44 * MS and health.looks_hung(longest_bubble_ns=10 * MS, step_ns=MS)


def test_a_board_that_moved_keeps_only_the_grant_just_frozen_unbooked() -> None:
    health = StepHealth()
    health.seen_on_board(3, in_setup=False)
    health.waited(0, now_ns=0)
    for k in range(1, 4):
        health.ran_past_end(k * MS, now_ns=k * MS)
    health.seen_on_board(4, in_setup=False)  # a step finished in the last grant: the one it is in began there
    assert health.stuck_ns == 0 and list(health.unbooked) == [(3 * MS, 3 * MS)]


def test_a_hung_steps_clock_runs_only_while_the_trainer_makes_bubbles() -> None:
    s = 1_000 * MS
    health = StepHealth()
    health.finished_steps()
    assert not health.hung_too_long(now_ns=10 * s, step_timeout_ns=60 * s, last_bubble_ns=10 * s)
    assert not health.hung_too_long(now_ns=13 * s, step_timeout_ns=60 * s, last_bubble_ns=12 * s)
    assert health.hung_ns == 3 * s  # training: every second counts
    # The training pauses after a bubble at 13 s: the clock runs for TRAINER_PAUSE_NS after it, then stops.
    for now in range(14, 600):
        assert not health.hung_too_long(now_ns=now * s, step_timeout_ns=60 * s, last_bubble_ns=13 * s)
    before = health.hung_ns
    assert before == 3 * s + TRAINER_PAUSE_NS
    # Bubbles again at 600 s: it counts on, and fails once it has looked hung for 60 s of training (the first
    # check after the pause also counts the idle second since the check before it).
    now, failed = 600 * s, False
    while not failed:
        failed = health.hung_too_long(now_ns=now, step_timeout_ns=60 * s, last_bubble_ns=now)
        now += s
    assert now - s == 600 * s + (60 * s - before) - s


def test_a_respawned_task_starts_its_step_health_afresh() -> None:
    sim = Sim()
    sim.resident("a")
    sim.send(WorkerStepsSeen("a", 3))
    assert sim.core.tasks["a"].health.phase is StepPhase.STEPPED
    sim.free(0)  # evicted
    sim.exited("a")
    sim.core.memory._device.clear()  # the dip leaves the window
    sim.free(1000)
    assert sim.state("a") == S.STARTING
    assert sim.core.tasks["a"].health.phase is StepPhase.FRESH


# ------------------------------------------------------------------ bubbles, drain, budget


def test_a_bubble_is_open_then_closing_while_its_worker_steps_then_closed() -> None:
    sim = Sim()
    sim.resident("a")
    sim.start(predicted_ms=10)
    bubble = sim.core.bubbles.open
    assert bubble is not None and bubble.phase is BubblePhase.OPEN
    sim.advance_ms(10)
    sim.end()
    assert bubble.phase is BubblePhase.CLOSING and sim.core.bubbles.closing is bubble
    sim.parked("a", [9.0], reason="park")
    assert bubble.phase is BubblePhase.CLOSED and sim.core.bubbles.closing is None


def test_a_bubble_nobody_holds_closes_at_its_end() -> None:
    sim = Sim()
    sim.start(predicted_ms=10)
    bubble = sim.core.bubbles.open
    sim.advance_ms(10)
    sim.end()
    assert bubble is not None and bubble.phase is BubblePhase.CLOSED


def test_drain_goes_draining_then_drained_and_back_to_draining_when_asked_again_never_serving() -> None:
    sim = Sim()
    sim.resident("a")
    assert sim.core.drain is DrainPhase.SERVING
    sim.send(DrainRequested())
    assert sim.core.drain is DrainPhase.DRAINING and sim.core.draining
    sim.exited("a")
    assert sim.core.drain is DrainPhase.DRAINED
    sim.send(DrainRequested())
    assert sim.core.drain is DrainPhase.DRAINED  # nothing resident: answered in the same event


def test_the_budget_is_unknown_until_a_figure_and_again_after_a_layout_without_one() -> None:
    sim = Sim()
    assert sim.core.memory.phase is BudgetPhase.UNKNOWN and sim.core.budget_bytes() is None
    sim.free(500)
    assert sim.core.memory.phase is BudgetPhase.KNOWN
    layout = TrainerLayout("1f1b", 2, 4, ("n/cpu:0", "n/cpu:1"), sim.now)
    sim.send(LayoutChanged(layout, sim.now))
    assert sim.core.memory.phase is BudgetPhase.UNKNOWN and sim.core.budget_bytes() is None
