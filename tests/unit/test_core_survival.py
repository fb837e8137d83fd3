"""A bubble that outlives its prediction (``surviving_end_ns``, ``OpenBubble.sized_end_ns``): what a grant
carries to extend its deadline, when the core freezes a step in such a bubble, and what it teaches the margin.

Issue 21: on torch's runtime schedules the trainer's low-percentile prediction left 40% of the bubble time
ungranted (``past_predicted``): the worker stopped at the predicted end of a bubble that went on, and the
core froze its step there, each freeze doubling the task's margin until most bubbles fitted no step.
"""

from __future__ import annotations

import pytest
from core_sim import MS, Sim, of
from hypothesis import given
from hypothesis import strategies as st

from freeride._estimator import SURVIVAL_LENGTHS, surviving_end_ns
from freeride._manager.core import DrainRequested, Freeze, Grant


def _measure(sim: Sim, lengths_ms: list[float]) -> None:
    """Bubbles of slot 0 with these real lengths, with no task to grant them to."""
    for length in lengths_ms:
        sim.advance_ms(1)
        sim.start(predicted_ms=length)
        sim.advance_ms(length)
        sim.end()


# ---------------------------------------------------------------- the rule


@pytest.mark.parametrize(("now", "within_grace", "expected"), [
    (0, False, 2),     # nothing passed: the p10 of 16 lengths (the trainer's own prediction)
    (0, True, 16),     # a step within the grace: the longest
    (5, False, 7),     # 11 lengths left above 5: their p10 is the second
    (14, False, 15),   # 2 left: the first of them
    (16, False, 16),   # outlived every length: the longest, and no more
    (99, True, 16),
])
def test_the_surviving_end_is_the_low_percentile_of_the_longer_lengths_or_the_longest_within_the_grace(
        now: int, within_grace: bool, expected: int) -> None:
    lengths = tuple(range(1, 17))
    assert surviving_end_ns(1000, lengths, 1000 + now, within_grace) == 1000 + expected


def test_a_slot_with_no_lengths_extends_nothing() -> None:
    assert surviving_end_ns(1000, (), 5000) == 0


@given(st.lists(st.integers(0, 10**9), min_size=1, max_size=SURVIVAL_LENGTHS),
       st.lists(st.integers(0, 2 * 10**9), min_size=2, max_size=20), st.booleans())
def test_the_surviving_end_never_moves_back_and_never_passes_the_longest_length(
        lengths: list[int], times: list[int], within_grace: bool) -> None:
    ordered = tuple(sorted(lengths))
    ends = [surviving_end_ns(0, ordered, t, within_grace) for t in sorted(times)]
    assert ends == sorted(ends)
    assert all(end <= ordered[-1] for end in ends)


# ---------------------------------------------------------------- the core


def test_a_grant_carries_its_slots_last_lengths_sorted_and_the_grace() -> None:
    sim = Sim(grace_ns=MS // 2)
    _measure(sim, [float(n) for n in range(20, 0, -1)])  # 20 ms .. 1 ms: the last 16 are 16 .. 1
    sim.resident("a")
    actions = sim.start(predicted_ms=2)
    [grant] = of(actions, Grant)
    assert grant.survival_ns == tuple(n * MS for n in range(1, 17))
    assert grant.grace_ns == MS // 2
    assert grant.deadline_ns == sim.now + 2 * MS


def test_a_step_running_past_the_prediction_of_a_bubble_not_ended_is_frozen_only_past_its_slots_longest_length(
) -> None:
    sim = Sim(margin_ns=MS // 5, grace_ns=MS // 2)
    _measure(sim, [3, 5, 8])
    sim.resident("a")
    task = sim.core.tasks["a"]
    task.estimator.extend([MS // 10] * 8)
    start = sim.now
    sim.start(predicted_ms=3)
    sim.at(start + 3 * MS + MS // 2)
    assert of(sim.tick(), Freeze) == []  # the worker may step on: the bubble may last 5 or 8 ms
    assert sim.core.next_timer_ns() == start + 8 * MS + MS // 2
    sim.at(start + 8 * MS + MS // 2)
    assert of(sim.tick(), Freeze) == [Freeze("a")]
    assert task.margin_ns > 0  # longer than any bubble of its slot, and no end: the step's time is in doubt


def test_a_freeze_at_an_end_past_the_prediction_but_within_the_extended_deadline_leaves_the_margin_alone() -> None:
    sim = Sim(margin_ns=MS // 5, grace_ns=MS // 2)
    _measure(sim, [3, 5, 8])
    sim.resident("a")
    task = sim.core.tasks["a"]
    task.estimator.extend([MS // 10] * 8)
    sim.start(predicted_ms=3)
    sim.advance_ms(4)  # past the 3 ms prediction, where the worker stepped on
    sim.end()
    sim.at(sim.now + sim.core.config.grace_ns)
    assert Freeze("a") in sim.tick()  # its step ran on past the real end (a busy core): frozen as ever
    assert task.margin_ns == 0  # but the end came before the end the step was sized to


def test_a_task_ready_after_the_prediction_is_granted_up_to_the_low_percentile_of_the_longer_lengths() -> None:
    sim = Sim(margin_ns=MS // 5, grace_ns=MS // 2)
    _measure(sim, [3, 5, 8])
    start = sim.now
    sim.start(predicted_ms=3)
    sim.advance_ms(3.5)
    sim.add("a")
    sim.free(100_000)
    [grant] = of(sim.ready("a"), Grant)
    assert grant.deadline_ns == start + 5 * MS


def test_the_reference_policy_grants_to_its_own_fixed_end_and_carries_no_lengths() -> None:
    sim = Sim(policy="paper", paper_profile_ns={(0, 0): 30 * MS})  # type: ignore[arg-type]
    _measure(sim, [3, 5, 8])
    sim.resident("a")
    sim.tick()
    start = sim.now
    sim.start(predicted_ms=4)
    sim.advance_ms(10)
    [grant] = of(sim.tick(), Grant)
    assert grant.survival_ns == ()
    assert grant.deadline_ns == start + 30 * MS


# ---------------------------------------------------------------- offered again once it outlives its prediction


def _spread_slot(sim: Sim) -> None:
    """Slot 0 waits either 0.3 ms or 5 ms (a runtime schedule's slot whose wait depends on the other rank)."""
    _measure(sim, [0.3, 5.0] * 8)


def _short_steps_on_a_spread_slot() -> Sim:
    """A parked task of 0.2 ms steps beside the spread slot; margin 0.2 ms."""
    sim = Sim(margin_ns=MS // 5, grace_ns=MS // 2)
    _spread_slot(sim)
    sim.resident("a")
    sim.core.tasks["a"].estimator.extend([MS // 5] * 8)
    return sim


def test_a_bubble_whose_prediction_fits_no_step_is_granted_once_it_outlives_its_slots_short_lengths() -> None:
    sim = _short_steps_on_a_spread_slot()
    start = sim.now
    assert of(sim.start(predicted_ms=0.3), Grant) == []  # 0.3 ms left: no 0.2 ms step plus 0.2 ms of margin
    assert sim.core.next_timer_ns() == start + 3 * MS // 10 + 1  # just past the short lengths
    sim.at(start + 3 * MS // 10 + 1)
    [grant] = of(sim.tick(), Grant)
    assert grant.deadline_ns == start + 5 * MS  # the low percentile of the lengths it may still reach
    assert grant.late


def test_a_bubble_granted_at_its_start_is_not_late() -> None:
    sim = _short_steps_on_a_spread_slot()
    [grant] = of(sim.start(predicted_ms=2), Grant)
    assert not grant.late


def test_a_bubble_whose_end_came_first_is_not_offered_again() -> None:
    sim = _short_steps_on_a_spread_slot()
    start = sim.now
    sim.start(predicted_ms=0.3)
    sim.advance_ms(0.25)
    sim.end()
    assert sim.core.next_timer_ns() is None
    sim.at(start + MS)
    assert of(sim.tick(), Grant) == []


def test_a_bubble_longer_than_every_length_of_its_slot_is_not_offered_again() -> None:
    sim = Sim(margin_ns=MS // 5, grace_ns=MS // 2)
    _measure(sim, [0.3] * 16)
    sim.resident("a")
    sim.core.tasks["a"].estimator.extend([MS // 5] * 8)
    sim.start(predicted_ms=0.3)
    assert sim.core.next_timer_ns() is None  # past 0.3 ms nothing is known to be left


def test_a_bubble_is_not_offered_again_with_no_task_to_take_it() -> None:
    sim = Sim(margin_ns=MS // 5, grace_ns=MS // 2)
    _spread_slot(sim)
    sim.start(predicted_ms=0.3)
    assert sim.core.next_timer_ns() is None


def test_a_task_unfit_for_a_bubble_offered_again_counts_it_once() -> None:
    sim = Sim(margin_ns=MS // 5, grace_ns=MS // 2)
    _measure(sim, [0.5, 3.0] * 8)
    sim.resident("a")
    sim.resident("b")
    a, b = sim.core.tasks["a"], sim.core.tasks["b"]
    a.estimator.extend([3 * MS] * 8)  # fits neither length
    b.estimator.extend([MS] * 8)  # fits what the long length leaves once the bubble outlived the short one
    start = sim.now
    sim.start(predicted_ms=0.5)  # 0.5 ms left: both ranked, and unfit
    assert a.health.unfit_bubbles == b.health.unfit_bubbles == 1
    assert sim.core.next_timer_ns() == start + MS // 2 + 1
    sim.at(start + MS // 2 + 1)
    assert [g.task_id for g in of(sim.tick(), Grant)] == ["b"]  # ranked again, 2.5 ms left: a still unfit
    assert a.health.unfit_bubbles == 1


def test_a_bubble_is_not_offered_again_where_no_candidates_step_fits_what_it_could_leave() -> None:
    # A step that fits none of its slot's lengths woke the loop at each length the bubble outlived, for nothing.
    sim = Sim(margin_ns=MS // 5, grace_ns=MS // 2)
    _measure(sim, [0.5, 1.0] * 8)
    sim.resident("a")
    task = sim.core.tasks["a"]
    task.estimator.extend([2 * MS] * 8)  # fits neither length
    sim.start(predicted_ms=0.5)
    assert task.health.unfit_bubbles == 1
    assert sim.core.next_timer_ns() is None


def test_the_reference_policy_never_offers_a_bubble_again() -> None:
    sim = Sim(policy="paper", paper_profile_ns={(0, 0): MS // 10})  # type: ignore[arg-type]
    _spread_slot(sim)
    sim.resident("a")
    sim.tick()
    sim.start(predicted_ms=0.3)
    assert sim.core.bubble is not None and sim.core.bubble.next_chance_ns(sim.now, 0) == 0


def test_an_offer_that_comes_while_the_device_drains_is_spent_not_due_at_every_turn_of_the_loop() -> None:
    # An offer left armed in the past (nothing granted while draining) turned the loop into a busy wait.
    sim = _short_steps_on_a_spread_slot()
    start = sim.now
    sim.start(predicted_ms=0.3)
    offer = start + 3 * MS // 10 + 1
    assert sim.core.next_timer_ns() == offer
    sim.send(DrainRequested())
    sim.at(offer)
    assert of(sim.tick(), Grant) == []
    next_timer = sim.core.next_timer_ns()
    assert next_timer is None or next_timer > sim.now
