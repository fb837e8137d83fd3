"""Learned slots: recurring waits the schedule model does not list become bubbles of their own.

Pure tests of :class:`WaitLearner` on plain numbers, then :class:`InstrumentedSchedule` on a fake
stage and a fake clock (every action takes 1 ms, and the test decides where the stage waits), so no
test depends on real time.
"""

from __future__ import annotations

from typing import Any

import pytest

from freeride.training.instrument import InstrumentedSchedule
from freeride.training.learned_slots import LEARNED_KIND, LEARNED_SLOT_BASE, LearningConfig, WaitLearner
from freeride.training.schedules import build_schedule

MS = 1_000_000
ORDER = [("F", 0, 0), ("F", 0, 1), ("B", 0, 0), ("B", 0, 1)]


def test_a_wait_that_recurs_with_a_stable_length_becomes_a_slot_with_its_own_id() -> None:
    learner = WaitLearner(rank=0, order=ORDER, config=LearningConfig(recur_iterations=3, min_length_ns=MS))
    assert learner.observe([(("F", 0, 1), 2 * MS)], []) == []
    assert learner.observe([(("F", 0, 1), int(2.2 * MS))], []) == []
    [slot] = learner.observe([(("F", 0, 1), int(1.9 * MS))], [])
    assert slot.index == LEARNED_SLOT_BASE + 1 and slot.kind == LEARNED_KIND and slot.length == 2 * MS
    assert slot.after is not None and slot.after.label() == "F1"
    assert learner.opens == {("F", 0, 1): slot}
    assert learner.lengths(("F", 0, 1)) == [2 * MS, int(2.2 * MS), int(1.9 * MS)]


@pytest.mark.parametrize("lengths_ms", [
    [2.0, 2.0, 0.0],  # missed an iteration
    [2.0, 0.4, 2.0],  # too short once
    [0.8, 3.2, 2.0],  # not stable: 0.8 and 3.2 are not within 50% of 2
])
def test_a_wait_that_does_not_recur_steadily_is_no_slot(lengths_ms: list[float]) -> None:
    learner = WaitLearner(rank=0, order=ORDER, config=LearningConfig(recur_iterations=3, min_length_ns=MS // 2))
    for ms in lengths_ms:
        assert learner.observe([(("B", 0, 0), int(ms * MS))] if ms else [], []) == []
    assert learner.opens == {}


def test_a_learned_slot_that_stops_recurring_is_dropped() -> None:
    learner = WaitLearner(rank=0, order=ORDER, config=LearningConfig(recur_iterations=2, min_length_ns=MS,
                                                                     drop_after=2))
    for _ in range(2):
        learner.observe([(("B", 0, 0), 3 * MS)], [])
    slot_id = LEARNED_SLOT_BASE + 2
    learner.observe([], [(slot_id, 3 * MS)])  # measured as a bubble now: it stays
    assert list(learner.opens) == [("B", 0, 0)]
    learner.observe([], [(slot_id, MS // 10)])
    assert list(learner.opens) == [("B", 0, 0)]  # once short: kept
    learner.observe([], [])
    assert learner.opens == {}


def test_learning_is_bounded_and_can_be_switched_off() -> None:
    waits = [(key, 2 * MS) for key in ORDER]
    capped = WaitLearner(rank=0, order=ORDER, config=LearningConfig(recur_iterations=1, max_slots=2))
    assert len(capped.observe(waits, [])) == 2
    off = WaitLearner(rank=0, order=ORDER, config=LearningConfig(recur_iterations=1, max_slots=0))
    assert off.observe(waits, []) == []


# ---------------------------------------------------------------- in the instrumentation


class FakeTime:
    def __init__(self) -> None:
        self.now = 10**12


class FakeClock:
    """The host clock's shape (every mark delivered at once), on the test's time."""

    synchronous = True

    def __init__(self, consumer: Any, time: FakeTime) -> None:
        self.consumer, self.time = consumer, time

    def mark(self, payload: Any) -> None:
        self.consumer(payload, self.time.now)

    def flush(self, timeout_s: float = 30.0) -> bool:
        return True

    def close(self) -> None:
        pass


class WaitingStage:
    """A stage whose every action takes 1 ms, and that waits ``waits[label]`` ms before an action."""

    def __init__(self, time: FakeTime, waits: dict[str, float]) -> None:
        self.stage_index, self.num_stages = 0, 2
        self.time, self.waits = time, waits

    def _run(self, label: str) -> None:
        self.time.now += MS

    def forward_one_chunk(self, mb: int, args: Any = None, kwargs: Any = None) -> None:
        self._run(f"F{mb}")

    def backward_one_chunk(self, mb: int, loss: Any = None, full_backward: bool = True,
                           last_backward: bool = False) -> None:
        self._run(f"B{mb}")

    def backward_weight_one_chunk(self, mb: int, last_backward: bool = False) -> None:
        self._run(f"W{mb}")


class ScheduleGPipe:  # named like torch's: the instrumentation models it as GPipe
    def __init__(self, stage: WaitingStage, n_microbatches: int) -> None:
        self._stage = stage
        self._n_microbatches = n_microbatches
        self.order = [a.label() for a in build_schedule("gpipe", 2, n_microbatches).orders[0]]

    def step(self, *args: Any, **kwargs: Any) -> None:
        for label in self.order:
            self._stage.time.now += int(self._stage.waits.get(label, 0.0) * MS)  # the receive wait
            mb = int(label[1:])
            if label[0] == "F":
                self._stage.forward_one_chunk(mb)
            else:
                self._stage.backward_one_chunk(mb, full_backward=True)


class Sink:
    def __init__(self) -> None:
        self.starts: list[tuple[int, int, str, int, bool]] = []
        self.ends: list[tuple[int, int, int]] = []

    def bubble_start(self, iteration: int, slot: int, kind: str, predicted_ns: int, free_memory_bytes: int = -1,
                     start_ns: int | None = None, learned: bool = False) -> None:
        self.starts.append((iteration, slot, kind, predicted_ns, learned))

    def bubble_end(self, iteration: int, slot: int, end_ns: int | None = None) -> None:
        self.ends.append((iteration, slot, int(end_ns or 0)))


def test_a_recurring_wait_between_two_forwards_is_reported_as_a_learned_slot_from_its_fourth_iteration() -> None:
    # Stage 0 of a 2-stage GPipe runs its forwards back to back in the model; here it waits 2 ms before
    # F3 every iteration (its neighbour is slower than the model says): an unplanned wait, until learned.
    time = FakeTime()
    sink = Sink()
    inst = InstrumentedSchedule(ScheduleGPipe(WaitingStage(time, {"F3": 2.0}), 4), sink=sink,
                                clock=lambda consumer: FakeClock(consumer, time))
    learned_id = LEARNED_SLOT_BASE + inst._order_keys.index(("F", 0, 2))
    for _ in range(3):
        inst.step()
    assert [s for s in sink.starts if s[4]] == []
    assert inst.unplanned_wait_ns == 6 * MS
    for _ in range(3):
        inst.step()
    learned = [s for s in sink.starts if s[4]]
    assert learned == [(it, learned_id, LEARNED_KIND, 2 * MS, True) for it in (3, 4, 5)]
    assert [e for e in sink.ends if e[1] == learned_id][0][2] > 0
    assert inst.unplanned_wait_ns == 6 * MS  # no longer unplanned: reported
    assert {b.slot for b in inst.last_bubbles} >= {learned_id}
    # Modelled slots keep their ids, all below the learned ones.
    assert all(s.index < LEARNED_SLOT_BASE for s in inst.slots)


def test_learning_off_leaves_every_unmodelled_wait_unplanned() -> None:
    time = FakeTime()
    sink = Sink()
    inst = InstrumentedSchedule(ScheduleGPipe(WaitingStage(time, {"F3": 2.0}), 4), sink=sink,
                                clock=lambda consumer: FakeClock(consumer, time),
                                learning=LearningConfig(max_slots=0))
    for _ in range(6):
        inst.step()
    assert [s for s in sink.starts if s[4]] == [] and inst.unplanned_wait_ns == 12 * MS
