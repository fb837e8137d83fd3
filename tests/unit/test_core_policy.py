"""The reference system's policy (``core/policy.py``, ``ReferencePolicy``), emulated for the bench."""

from __future__ import annotations

from core_sim import MS, T0, S, Sim, grants, of, paper_sim

from freeride._manager.core import (
    Freeze,
    Grant,
    Park,
)


def test_paper_policy_grants_only_at_its_next_10ms_poll() -> None:
    sim = paper_sim()
    sim.tick()  # the first event starts the poll clock: next poll at +10 ms
    sim.advance_ms(1)
    assert grants(sim.start(predicted_ms=30)) == []
    sim.advance_ms(5)
    assert grants(sim.tick()) == []
    sim.advance_ms(4)
    assert grants(sim.tick()) == ["a"]
    assert sim.core.next_timer_ns() == T0 + 20 * MS


def test_paper_policy_deadline_is_start_plus_profiled_minimum_not_the_trainers_prediction() -> None:
    sim = paper_sim(profile_ms=12)
    sim.tick()
    sim.start(predicted_ms=50)
    sim.advance_ms(10)
    [grant] = of(sim.tick(), Grant)
    assert grant.deadline_ns == T0 + 12 * MS
    assert grant.margin_ns == 0


def test_paper_policy_ignores_the_real_end_and_parks_at_the_first_poll_past_the_predicted_end() -> None:
    sim = paper_sim(profile_ms=15)
    sim.tick()
    sim.start(predicted_ms=15)
    sim.advance_ms(10)
    assert grants(sim.tick()) == ["a"]
    sim.advance_ms(3)
    assert of(sim.end(), Park) == []  # the reference never sees real ends
    sim.advance_ms(4)  # past the predicted end (15 ms), before the next poll (20 ms)
    assert of(sim.tick(), Park) == []
    sim.advance_ms(3)
    assert [p.task_id for p in of(sim.tick(), Park)] == ["a"]
    assert of(sim.actions, Freeze) == []  # a running step is never interrupted


def test_paper_policy_never_freezes_a_step_that_overruns() -> None:
    sim = paper_sim(profile_ms=15)
    sim.tick()
    sim.start(predicted_ms=15)
    sim.advance_ms(10)
    assert grants(sim.tick()) == ["a"]
    sim.advance_ms(6)
    sim.end()
    for _ in range(10):
        sim.advance_ms(10)
        sim.tick()
    assert of(sim.actions, Freeze) == []
    assert sim.state("a") == S.RUNNING
    sim.parked("a", [30.0], reason="park")
    assert sim.core.stats.overruns == 1


def test_paper_policy_grants_fifo_without_backfill_after_an_early_park() -> None:
    sim = Sim(policy="paper")
    sim.resident("a", "b")
    sim.tick()
    sim.start(predicted_ms=40)
    sim.advance_ms(10)
    assert grants(sim.tick()) == ["a"]
    sim.advance_ms(1)
    assert grants(sim.parked("a", [1.0], reason="deadline")) == []  # no backfill to b
    sim.advance_ms(10)
    assert grants(sim.tick()) == []
