"""A bubble's end read from the trainer itself (``TrainerEndSeen``, from a local trainer's event): the
freeze of a step still running counts its grace from that end, not from the end event's arrival."""

from __future__ import annotations

from core_sim import MS, S, Sim, non_state, of, paper_sim

from freeride._manager.core import Freeze, Grant, Park, TrainerEndSeen
from freeride._manager.core.machines import BubblePhase


def _running(sim: Sim, predicted_ms: float = 50) -> Grant:
    sim.resident("a")
    grant = of(sim.start(predicted_ms=predicted_ms), Grant)[0]
    assert sim.state("a") == S.RUNNING
    return grant


def test_a_step_running_at_the_trainers_end_is_frozen_grace_after_it_before_the_end_event_comes() -> None:
    sim = Sim(grace_ns=MS // 2)
    grant = _running(sim)
    sim.advance_ms(20)
    end_ns = sim.now
    sim.advance_ms(0.05)  # the wake reaches the loop
    assert sim.send(TrainerEndSeen("a", grant.grant_id, end_ns)) == []
    assert sim.core.next_timer_ns() == end_ns + MS // 2
    assert sim.core.bubbles.open is not None and sim.core.bubbles.open.phase is BubblePhase.SEEN_ENDED
    sim.at(end_ns + MS // 2)
    assert non_state(sim.tick()) == [Freeze("a")]
    assert sim.state("a") == S.FROZEN
    assert sim.core.stats.overrun_ms[-1] == 0.5  # measured from the real end
    # The end event, arriving after the freeze, is measured like any other (the bubble stayed open for it).
    sim.advance_ms(1)
    assert non_state(sim.end(end_ns=end_ns)) == []
    assert sim.core.stats.bubble_ns == 20 * MS
    assert sim.core.bubbles.open is None


def test_the_end_event_arriving_before_the_freeze_keeps_the_freeze_at_the_trainers_end() -> None:
    sim = Sim(grace_ns=MS // 2)
    grant = _running(sim)
    sim.advance_ms(20)
    end_ns = sim.now
    sim.send(TrainerEndSeen("a", grant.grant_id, end_ns))
    sim.advance_ms(0.3)  # the wire: its grace would count from here
    assert of(sim.end(end_ns=end_ns), Park) == [Park("a", grant.grant_id, sim.now, end_ns)]
    assert sim.core.next_timer_ns() == end_ns + MS // 2


def test_a_wake_the_loop_read_late_freezes_at_once() -> None:
    sim = Sim(grace_ns=MS // 2)
    grant = _running(sim)
    sim.advance_ms(20)
    end_ns = sim.now
    sim.advance_ms(2)  # the loop was busy: end + grace has passed
    assert non_state(sim.send(TrainerEndSeen("a", grant.grant_id, end_ns))) == [Freeze("a")]


def test_a_worker_that_parks_first_is_not_frozen() -> None:
    sim = Sim(grace_ns=MS // 2)
    grant = _running(sim)
    sim.advance_ms(20)
    end_ns = sim.now
    sim.send(TrainerEndSeen("a", grant.grant_id, end_ns))
    sim.advance_ms(0.1)
    sim.parked("a", [5.0, 5.0], reason="ended", last_end_ns=end_ns - 1)
    assert sim.state("a") == S.PARKED
    assert sim.core.next_timer_ns() is None
    sim.at(end_ns + MS)
    assert of(sim.tick(), Freeze) == []


def test_stale_and_foreign_ends_change_nothing() -> None:
    sim = Sim(grace_ns=MS // 2)
    grant = _running(sim)
    sim.advance_ms(20)
    timer = sim.core.next_timer_ns()
    start_ns = sim.open.start_ns if sim.open else 0
    for event in (TrainerEndSeen("a", grant.grant_id - 1, sim.now),  # an older grant's
                  TrainerEndSeen("b", grant.grant_id, sim.now),  # no such task
                  TrainerEndSeen("a", grant.grant_id, start_ns - 1),  # before its bubble began
                  TrainerEndSeen("a", grant.grant_id, sim.now + MS)):  # in the future
        assert sim.send(event) == []
    assert sim.core.next_timer_ns() == timer
    assert sim.core.bubbles.open is not None and sim.core.bubbles.open.phase is BubblePhase.OPEN


def test_an_end_for_a_worker_that_died_while_armed_is_ignored() -> None:
    sim = Sim(grace_ns=MS // 2)
    grant = _running(sim)
    sim.advance_ms(5)
    sim.exited("a", exit_code=None, sig=9)
    assert sim.state("a") == S.FAILED
    assert sim.send(TrainerEndSeen("a", grant.grant_id, sim.now)) == []


def test_without_the_trainers_end_the_freeze_stays_at_the_predicted_end() -> None:
    sim = Sim(grace_ns=MS // 2)
    _running(sim, predicted_ms=10)
    assert sim.core.next_timer_ns() == sim.open.predicted_end_ns + MS // 2 if sim.open else False
    sim.advance_ms(10.5)
    assert non_state(sim.tick()) == [Freeze("a")]


def test_the_reference_policy_ignores_the_trainers_end() -> None:
    sim = paper_sim()  # "a" resident
    sim.tick()
    sim.start(predicted_ms=50)
    sim.advance_ms(10)
    sim.tick()  # its poll grants
    task = sim.core.tasks["a"]
    assert task.state == S.RUNNING
    sim.advance_ms(5)
    assert sim.send(TrainerEndSeen("a", task.grant_id, sim.now - MS)) == []
    assert sim.core.bubbles.open is not None and sim.core.bubbles.open.phase is BubblePhase.OPEN


# ---------------------------------------------------------------- the trainer's own stop (cpu:N)


def test_a_step_the_trainer_stopped_at_its_end_is_frozen_at_once_and_booked_at_the_stop() -> None:
    sim = Sim(grace_ns=MS // 2)
    grant = _running(sim)
    sim.advance_ms(20)
    end_ns = sim.now
    stopped_ns = end_ns + 20_000  # the training thread's killpg, right after it wrote the end
    sim.advance_ms(3)  # the end reached the loop late: a manager waiting for its core
    out = sim.send(TrainerEndSeen("a", grant.grant_id, end_ns, stopped_ns=stopped_ns))
    assert non_state(out) == [Freeze("a", stopped_ns)]
    assert sim.state("a") == S.FROZEN
    assert sim.core.stats.overrun_ms[-1] == 0.02  # to the trainer's stop, not to when the loop read it
    assert sim.core.next_timer_ns() is None
    # The end event after it is measured like any other; the next bubble thaws the step.
    sim.advance_ms(0.1)
    assert non_state(sim.end(end_ns=end_ns)) == []
    sim.advance_ms(5)
    assert of(sim.start(predicted_ms=50), Grant)[0].thaw


def test_a_stop_read_after_the_end_was_seen_still_freezes_at_the_stop() -> None:
    # The end came as the trainer's own (its local event) before the stop was read (the wire's copy of the end).
    sim = Sim(grace_ns=5 * MS)
    grant = _running(sim)
    sim.advance_ms(20)
    end_ns = sim.now
    sim.send(TrainerEndSeen("a", grant.grant_id, end_ns))
    sim.advance_ms(0.2)
    out = sim.send(TrainerEndSeen("a", grant.grant_id, end_ns, stopped_ns=end_ns + 10_000))
    assert non_state(out) == [Freeze("a", end_ns + 10_000)]


def test_a_stop_claimed_for_a_worker_that_parked_first_freezes_nothing() -> None:
    # The loop continues that worker before its next message (the supervisor); the core has nothing to freeze.
    sim = Sim(grace_ns=MS // 2)
    grant = _running(sim)
    sim.advance_ms(20)
    end_ns = sim.now
    sim.parked("a", [5.0, 5.0], reason="ended", last_end_ns=end_ns - 1)
    assert sim.send(TrainerEndSeen("a", grant.grant_id, end_ns, stopped_ns=end_ns + 1)) == []
    assert sim.state("a") == S.PARKED


def test_a_stop_in_a_step_past_the_end_its_grant_was_sized_to_widens_the_margin_one_between_steps_does_not() -> None:
    # Between steps the worker had stopped beginning steps in time and was on its way to park: its estimate was right.
    for began_ns, widened in ((1, True), (0, False)):
        sim = Sim(margin_ns=MS, max_margin_ns=20 * MS, grace_ns=MS // 2)
        sim.resident("a")
        task = sim.core.tasks["a"]
        task.estimator.extend([MS] * 8)
        grant = of(sim.start(predicted_ms=10), Grant)[0]
        sim.advance_ms(10.2)  # the bubble outlived its prediction: the grant was sized to a shorter one
        end_ns = sim.now
        step_began = end_ns - MS // 2 if began_ns else 0
        out = sim.send(TrainerEndSeen("a", grant.grant_id, end_ns, step_began, stopped_ns=end_ns + 5_000))
        assert non_state(out) == [Freeze("a", end_ns + 5_000)]
        assert (task.margin_ns > 0) is widened, began_ns


def test_the_late_report_of_a_bubbles_first_grant_the_trainer_stopped_still_measures_its_grant_latency() -> None:
    # On cpu:N most grants end in the trainer's stop: their reports come once thawed, and `stats` kept no grant latency.
    from freeride._manager.core import WorkerParked

    sim = Sim(grace_ns=MS // 2)
    grant = _running(sim)
    received = sim.core.bubbles.open.received_ns if sim.core.bubbles.open else 0
    first_step = sim.now + 30_000
    sim.advance_ms(5)
    sim.send(TrainerEndSeen("a", grant.grant_id, sim.now, 1, stopped_ns=sim.now + 1))
    assert sim.state("a") == S.FROZEN and len(sim.core.stats.grant_latency_ms) == 0
    sim.advance_ms(3)
    sim.start(predicted_ms=50)  # thaws it; its stopped step ends, and the frozen grant is reported
    sim.send(WorkerParked("a", grant.grant_id, steps=3, durations_ns=(MS, MS, MS), first_step_ns=first_step,
                          last_end_ns=sim.now, parked_ns=sim.now, reason="frozen", progress=3.0, total_steps=3))
    assert list(sim.core.stats.grant_latency_ms) == [(first_step - received) / MS]
    sim.send(WorkerParked("a", grant.grant_id, steps=0, durations_ns=(), first_step_ns=first_step, last_end_ns=sim.now,
                          parked_ns=sim.now, reason="frozen", progress=3.0, total_steps=3))  # said twice: measured once
    assert len(sim.core.stats.grant_latency_ms) == 1


def test_a_trainer_stop_fed_after_the_freeze_timer_fell_due_is_booked_at_the_stop_and_widens_nothing() -> None:
    # A manager that waited for its core past the grant's deadline + grace: the loop reads the trainer's stop off
    # the board before the event that would fire the timer (loop._feed), so the freeze is the trainer's.
    sim = Sim(grace_ns=MS // 2)
    grant = _running(sim, predicted_ms=1)
    task = sim.core.tasks["a"]
    sim.advance_ms(0.8)
    end_ns = sim.now  # the bubble ended before the end it was granted to (its prediction): the step says nothing
    sim.advance_ms(14)  # deadline + grace long past, the end's message unread
    assert sim.core.next_freeze_ns() is not None and sim.core.next_freeze_ns() < sim.now
    out = sim.send(TrainerEndSeen("a", grant.grant_id, end_ns, end_ns - 100_000, stopped_ns=end_ns + 10_000))
    assert non_state(out) == [Freeze("a", end_ns + 10_000)]
    assert sim.core.stats.overrun_ms[-1] == 0.01 and task.margin_ns == 0
