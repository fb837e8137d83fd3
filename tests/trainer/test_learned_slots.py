"""Learned slots: recurring waits the schedule model does not list become bubbles of their own.

Pure tests of :class:`WaitLearner` on plain numbers; the tracker's use of it is in ``test_tracker.py``.
"""

from __future__ import annotations

import pytest

from freeride.training.learned_slots import LEARNED_KIND, LEARNED_SLOT_BASE, WAITS_PER_GAP, LearningConfig, WaitLearner
from freeride.training.schedules import Action

MS = 1_000_000
ORDER = [Action("F", 0, 0), Action("F", 0, 1), Action("B", 0, 0), Action("B", 0, 1)]


def test_a_wait_that_recurs_with_a_stable_length_becomes_a_slot_with_its_own_id() -> None:
    learner = WaitLearner(rank=0, order=ORDER, config=LearningConfig(recur_iterations=3, min_length_ns=MS))
    site = (2, 1)  # the second wait before B0: after F1
    assert learner.observe([(site, 2 * MS)], []) == []
    assert learner.observe([(site, int(2.2 * MS))], []) == []
    [slot] = learner.observe([(site, int(1.9 * MS))], [])
    assert slot.index == LEARNED_SLOT_BASE + 2 * WAITS_PER_GAP + 1 and slot.kind == LEARNED_KIND
    assert slot.length == 2 * MS
    assert slot.after == Action("F", 0, 1) and slot.before == Action("B", 0, 0)
    assert learner.opens == {site: slot}
    assert learner.lengths(site) == [2 * MS, int(2.2 * MS), int(1.9 * MS)]


def test_a_wait_after_the_last_action_or_beyond_the_waits_a_gap_can_name() -> None:
    learner = WaitLearner(rank=0, order=ORDER, config=LearningConfig(recur_iterations=1, min_length_ns=MS))
    [tail] = learner.observe([((4, 0), 2 * MS), ((1, WAITS_PER_GAP), 2 * MS), ((9, 0), 2 * MS)], [])
    assert tail.before is None and tail.after == Action("B", 0, 1)
    assert list(learner.opens) == [(4, 0)]


@pytest.mark.parametrize("lengths_ms", [
    [2.0, 2.0, 0.0],  # missed an iteration
    [2.0, 0.4, 2.0],  # too short once
    [0.8, 3.2, 2.0],  # not stable: 0.8 and 3.2 are not within 50% of 2
])
def test_a_wait_that_does_not_recur_steadily_is_no_slot(lengths_ms: list[float]) -> None:
    learner = WaitLearner(rank=0, order=ORDER, config=LearningConfig(recur_iterations=3, min_length_ns=MS // 2))
    for ms in lengths_ms:
        assert learner.observe([((2, 0), int(ms * MS))] if ms else [], []) == []
    assert learner.opens == {}


def test_a_learned_slot_that_stops_recurring_is_dropped() -> None:
    learner = WaitLearner(rank=0, order=ORDER, config=LearningConfig(recur_iterations=2, min_length_ns=MS,
                                                                     drop_after=2))
    for _ in range(2):
        learner.observe([((3, 0), 3 * MS)], [])
    slot_id = LEARNED_SLOT_BASE + 3 * WAITS_PER_GAP
    learner.observe([], [(slot_id, 3 * MS)])  # measured as a bubble now: it stays
    assert list(learner.opens) == [(3, 0)]
    learner.observe([], [(slot_id, MS // 10)])
    assert list(learner.opens) == [(3, 0)]  # once short: kept
    learner.observe([], [])
    assert learner.opens == {}


def test_learning_is_bounded_and_can_be_switched_off() -> None:
    waits = [((k, 0), 2 * MS) for k in range(len(ORDER))]
    capped = WaitLearner(rank=0, order=ORDER, config=LearningConfig(recur_iterations=1, max_slots=2))
    assert len(capped.observe(waits, [])) == 2
    off = WaitLearner(rank=0, order=ORDER, config=LearningConfig(recur_iterations=1, max_slots=0))
    assert off.observe(waits, []) == []
