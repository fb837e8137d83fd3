"""RankTracker on fakes: waits mapped to slots, predictions from the model then conservative, learned
slots only where the model has none, quiet slots, and no torch on import.

Every test drives the tracker's marks itself on a fake clock (the test says what time it is), the way
an adapter would: so no test depends on real time.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from typing import Any

import pytest

from freeride.errors import ConfigError
from freeride.training.learned_slots import LEARNED_KIND, LEARNED_SLOT_BASE, WAITS_PER_GAP, LearningConfig
from freeride.training.schedules import BOUNDARY, Action, build_schedule
from freeride.training.tracker import LEARN_EVERY, ORDER_CHECKED_ITERATIONS, RankTracker

MS = 1_000_000


class FakeClock:
    """The host clock's shape (every mark delivered at once), on the test's time."""

    synchronous = True

    def __init__(self, consumer: Any) -> None:
        self.consumer = consumer
        self.now = 10**12

    def mark(self, payload: Any) -> None:
        self.consumer(payload, self.now)

    def flush(self, timeout_s: float = 30.0) -> bool:
        return True

    def close(self) -> None:
        pass


class Sink:
    def __init__(self) -> None:
        self.starts: list[tuple[int, int, str, int, bool, int]] = []
        self.ends: list[tuple[int, int, int]] = []

    def bubble_start(self, iteration: int, slot: int, kind: str, predicted_ns: int, free_memory_bytes: int = -1,
                     start_ns: int | None = None, learned: bool = False) -> None:
        self.starts.append((iteration, slot, kind, predicted_ns, learned, int(start_ns or 0)))

    def bubble_end(self, iteration: int, slot: int, end_ns: int | None = None) -> None:
        self.ends.append((iteration, slot, int(end_ns or 0)))


def make(orders: dict[int, list[Action]] | Any, rank: int, **kwargs: Any) -> tuple[RankTracker, FakeClock, Sink]:
    clocks: list[FakeClock] = []
    sink = Sink()

    def clock(consumer: Any) -> FakeClock:
        clocks.append(FakeClock(consumer))
        return clocks[-1]

    tracker = RankTracker(orders, rank, sink, clock=clock, **kwargs)
    return tracker, clocks[0], sink


def run_iteration(tracker: RankTracker, clock: FakeClock, cost_ms: dict[str, float],
                  waits_ms: dict[tuple[int, int], float], between_ms: float = 1.0) -> None:
    """One iteration of the rank's order: action kinds cost ``cost_ms``; ``waits_ms[(position, ordinal)]``
    is a marked wait of that length (0 ms: a wait marked but over at once)."""
    tracker.iteration_begin()
    order = tracker.plan.order
    for k in range(len(order) + 1):
        for ordinal in range(WAITS_PER_GAP):
            if (k, ordinal) not in waits_ms:
                break
            tracker.wait_begin()
            clock.now += int(waits_ms[(k, ordinal)] * MS)
            tracker.wait_end()
        if k == len(order):
            break
        a = order[k]
        tracker.compute_begin(a.kind, a.stage, a.microbatch)
        clock.now += int(cost_ms[a.kind] * MS)
        tracker.compute_end(a.kind, a.stage, a.microbatch)
    tracker.iteration_end()
    clock.now += int(between_ms * MS)


def test_importing_the_tracker_does_not_import_torch() -> None:
    code = "import sys, freeride.training.tracker; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_a_wait_is_reported_as_the_slot_of_its_position_at_its_own_times() -> None:
    orders = build_schedule("1f1b", 2, 4).orders  # rank 1: F0 B0 F1 B1 F2 B2 F3 B3, every one received
    tracker, clock, sink = make(orders, 1)
    assert tracker.plan.positions == (0, 2, 4, 6, 8)  # each forward's activation; the tail (B3's send)
    run_iteration(tracker, clock, {"F": 1, "B": 2}, {(0, 0): 3, (2, 0): 0.5, (8, 0): 0.25})
    assert [(s[1], s[2]) for s in sink.starts] == [(0, BOUNDARY), (2, "steady"), (8, "tail")]
    t0 = sink.starts[0][5]
    assert [(s[1], s[5] - t0) for s in sink.starts] == [(0, 0), (2, 6 * MS), (8, 15_500_000)]
    assert [(e[1], e[2] - t0) for e in sink.ends] == [(0, 3 * MS), (2, 6_500_000), (8, 15_750_000)]
    assert [b.length_ns for b in tracker.last_bubbles] == [3 * MS, MS // 2, MS // 4]
    assert tracker.unplanned_waits == 0


def test_cold_predictions_come_from_the_model_with_the_profiled_costs() -> None:
    # GPipe, 2 ranks: rank 0 waits before its first backward for rank 1's forward and backward of
    # micro-batch 3: (t_f + t_b) after its own last forward.
    orders = build_schedule("gpipe", 2, 4).orders
    tracker, clock, sink = make(orders, 0)
    assert tracker.plan.positions == (4, 5, 6, 7)
    run_iteration(tracker, clock, {"F": 2, "B": 4}, {(k, 0): 6 for k in (4,)})
    assert sink.starts[0][3] == 3 * MS  # before anything was measured: 1 ms forwards, 2 ms backwards
    run_iteration(tracker, clock, {"F": 2, "B": 4}, {(k, 0): 6 for k in (4,)})
    assert sink.starts[1][3] == 6 * MS  # the model with the profiled 2 ms and 4 ms
    assert {s.index: s.length for s in tracker.slots}[4] == 6 * MS


def test_warm_predictions_are_a_low_quantile_so_a_grant_rarely_outlives_the_wait() -> None:
    orders = build_schedule("gpipe", 2, 4).orders
    tracker, clock, sink = make(orders, 0)
    lengths = [5.0, 9.0, 6.0, 8.0, 5.5, 7.0, 9.5, 6.5, 8.5, 5.2, 7.5, 6.2, 9.2, 5.8, 8.8, 7.2] * 3
    for ms in lengths:
        run_iteration(tracker, clock, {"F": 1, "B": 2}, {(4, 0): ms})
    predicted = [s[3] for s in sink.starts][3:]  # warm from the fourth on
    measured = [int(ms * MS) for ms in lengths][3:]
    past_the_end = sum(p > m for p, m in zip(predicted, measured, strict=True))
    assert past_the_end <= 0.1 * len(measured)
    assert all(p >= 5 * MS for p in predicted)  # yet not below what the slot always gives


def test_waits_where_the_order_has_no_receive_are_unplanned_until_they_recur_then_learned() -> None:
    orders = build_schedule("gpipe", 2, 4).orders  # rank 0's forwards need nothing from rank 1
    tracker, clock, sink = make(orders, 0, learning=LearningConfig(recur_iterations=3, min_length_ns=MS))
    learned_id = LEARNED_SLOT_BASE + 3 * WAITS_PER_GAP  # before F3 (say, a blocking send of F2)
    for _ in range(3):
        run_iteration(tracker, clock, {"F": 1, "B": 2}, {(3, 0): 2, (4, 0): 3})
    assert [s for s in sink.starts if s[4]] == []
    assert tracker.unplanned_wait_ns == 6 * MS
    for _ in range(2):
        run_iteration(tracker, clock, {"F": 1, "B": 2}, {(3, 0): 2, (4, 0): 3})
    assert [(s[0], s[1], s[2], s[3]) for s in sink.starts if s[4]] == [(it, learned_id, LEARNED_KIND, 2 * MS)
                                                                        for it in (3, 4)]
    assert tracker.unplanned_wait_ns == 6 * MS  # no longer unplanned: reported
    # The modelled slot's recurring wait never became a learned one.
    assert {s[1] for s in sink.starts if not s[4]} == {4} and list(tracker.learned.opens) == [(3, 0)]


def test_a_wait_begun_while_waiting_continues_the_same_wait() -> None:
    orders = build_schedule("gpipe", 2, 4).orders
    tracker, clock, sink = make(orders, 0)
    tracker.iteration_begin()
    for a in tracker.plan.order[:4]:
        tracker.compute_begin(a.kind, a.stage, a.microbatch)
        clock.now += MS
        tracker.compute_end(a.kind, a.stage, a.microbatch)
    tracker.wait_begin()  # the sends' wait after the last forward...
    clock.now += MS
    tracker.wait_begin()  # ...and the first gradient's: one wait, one bubble
    clock.now += 2 * MS
    tracker.compute_begin("B", 0, 0)
    tracker.compute_end("B", 0, 0)
    tracker.iteration_end()
    assert [s[1] for s in sink.starts] == [4] and [b.length_ns for b in tracker.last_bubbles] == [3 * MS]


def test_a_second_wait_in_a_gap_is_no_modelled_slot() -> None:
    orders = build_schedule("gpipe", 2, 4).orders
    tracker, clock, sink = make(orders, 0, learning=LearningConfig(max_slots=0))
    run_iteration(tracker, clock, {"F": 1, "B": 2}, {(4, 0): 3, (4, 1): 2})
    assert [s[1] for s in sink.starts] == [4] and tracker.unplanned_wait_ns == 2 * MS


def test_a_slot_that_stays_short_is_measured_but_not_reported_until_it_grows() -> None:
    orders = build_schedule("gpipe", 2, 4).orders
    tracker, clock, sink = make(orders, 0, report_min_ns=MS // 2)
    for _ in range(4):
        run_iteration(tracker, clock, {"F": 1, "B": 2}, {(4, 0): 3, (5, 0): 0.1})
    assert [s[1] for s in sink.starts if s[0] == 3] == [4]  # quiet once measured 3 times short
    assert [b.slot for b in tracker.last_bubbles] == [4]
    run_iteration(tracker, clock, {"F": 1, "B": 2}, {(4, 0): 3, (5, 0): 2})
    run_iteration(tracker, clock, {"F": 1, "B": 2}, {(4, 0): 3, (5, 0): 2})
    assert [s[1] for s in sink.starts if s[0] == 5] == [4, 5]  # it grew: reported again


def run_posting_iteration(tracker: RankTracker, clock: FakeClock, posting_ms: float, waited_ms: dict[int, float],
                          mark_blocks: bool = True) -> None:
    """GPipe rank 0 where each wait position's gap is ``posting_ms`` of host work, then (``wait_blocks``) the
    wait for the other rank, ``waited_ms[position]`` (0 where the data is there already)."""
    tracker.iteration_begin()
    order = tracker.plan.order
    positions = set(tracker.plan.positions)
    for k, a in enumerate(order):
        if k in positions:
            tracker.wait_begin()
            clock.now += int(posting_ms * MS)
            if mark_blocks:
                tracker.wait_blocks()
            clock.now += int(waited_ms.get(k, 0.0) * MS)
        tracker.compute_begin(a.kind, a.stage, a.microbatch)
        clock.now += MS
        tracker.compute_end(a.kind, a.stage, a.microbatch)
    tracker.iteration_end()
    clock.now += MS


def test_a_position_where_the_rank_only_does_host_work_goes_quiet_although_the_gap_is_long() -> None:
    orders = build_schedule("gpipe", 2, 4).orders
    tracker, clock, sink = make(orders, 0)  # report_min_ns 0.2 ms; the gaps below are 0.5 ms of posting
    tracker.learn_every = 1  # each iteration learned as it ends: the iterations below are exact
    for _ in range(17):
        run_posting_iteration(tracker, clock, 0.5, {4: 3.0})
    bubbles = {b.slot: b for b in tracker.last_bubbles}
    assert [s[1] for s in sink.starts if s[0] == 15] == [4, 5, 6, 7]  # a block-marked wait: quiet after 16
    assert [s[1] for s in sink.starts if s[0] == 16] == [4]  # only where the rank waited for the other
    assert bubbles[4].length_ns == 3 * MS and bubbles[4].waited_ns == 3 * MS  # from the mark (the next test)
    run_posting_iteration(tracker, clock, 0.5, {4: 3.0, 5: 1.0})
    run_posting_iteration(tracker, clock, 0.5, {4: 3.0, 5: 1.0})
    assert [s[1] for s in sink.starts if s[0] == 18] == [4, 5, 6, 7]  # it waited again: reported again (and
    # the other quiet ones with it: see the next test)


def test_a_long_wait_at_a_quiet_position_reports_the_other_quiet_ones_in_the_same_iteration() -> None:
    orders = build_schedule("gpipe", 2, 4).orders
    tracker, clock, sink = make(orders, 0)
    tracker.learn_every = 1
    for _ in range(17):
        run_posting_iteration(tracker, clock, 0.5, {4: 3.0})
    assert [s[1] for s in sink.starts if s[0] == 16] == [4]  # 5, 6 and 7 quiet
    run_posting_iteration(tracker, clock, 0.5, {4: 3.0, 5: 1.0, 6: 1.0, 7: 1.0})  # the other rank slowed
    assert [s[1] for s in sink.starts if s[0] == 17] == [4, 6, 7]  # 5's wait missed; the rest reported
    run_posting_iteration(tracker, clock, 0.5, {4: 3.0})
    assert [s[1] for s in sink.starts if s[0] == 18] == [4, 5, 6, 7]  # until each is short 16 times again


def run_swapped(tracker: RankTracker) -> None:
    """One iteration whose first two actions run swapped: not the planned order."""
    order = list(tracker.plan.order)
    order[0], order[1] = order[1], order[0]
    tracker.iteration_begin()
    for a in order:
        tracker.compute_begin(a.kind, a.stage, a.microbatch)
        tracker.compute_end(a.kind, a.stage, a.microbatch)
    tracker.iteration_end()


def test_the_order_is_checked_in_the_first_iterations_and_a_mismatch_logged_once(
        caplog: pytest.LogCaptureFixture) -> None:
    orders = build_schedule("1f1b", 2, 4).orders
    with caplog.at_level(logging.WARNING, logger="freeride.training.tracker"):
        late, clock, _ = make(orders, 1)
        for _ in range(ORDER_CHECKED_ITERATIONS - 1):
            run_iteration(late, clock, {"F": 1, "B": 2}, {})
        run_swapped(late)  # the last checked iteration: logged
        run_swapped(late)  # and once only
        assert sum("misattributed" in r.message for r in caplog.records) == 1
        later, clock, _ = make(orders, 1)
        for _ in range(ORDER_CHECKED_ITERATIONS):
            run_iteration(later, clock, {"F": 1, "B": 2}, {})
        run_swapped(later)  # a schedule's order does not change once it ran: no longer checked
        assert sum("misattributed" in r.message for r in caplog.records) == 1


def test_after_profiling_the_waits_are_learned_every_learn_every_iterations_and_flush_learns_the_rest() -> None:
    orders = build_schedule("gpipe", 2, 4).orders
    tracker, clock, sink = make(orders, 0)  # the model profiles the first 5 iterations: each learned at once
    assert tracker.learn_every == LEARN_EVERY == 4
    for n in range(1, 6):
        run_posting_iteration(tracker, clock, 0.0, {4: 3.0})
        assert tracker.predictor.measurements(0, 4) == n
    for n in range(1, 10):
        run_posting_iteration(tracker, clock, 0.0, {4: 3.0 + n})
        assert tracker.predictor.measurements(0, 4) == 5 + n // 4 * 4  # then 4 at a time, in order
    assert [b.length_ns for b in tracker.last_bubbles if b.slot == 4] == [12 * MS]  # handed out at once
    assert tracker.flush()
    assert tracker.predictor.measurements(0, 4) == 14  # nothing measured is lost
    tracker.flush()
    assert tracker.predictor.measurements(0, 4) == 14  # nor learned twice


def test_on_the_host_clock_a_block_mark_measures_the_wait_from_itself() -> None:
    # The host clock takes the mark's one-call path (RankTracker.wait_blocks is the timeline's blocks_now).
    orders = build_schedule("gpipe", 2, 4).orders
    tracker = RankTracker(orders, 0, None)
    tracker.iteration_begin()
    for k, a in enumerate(tracker.plan.order):
        if k == 4:
            tracker.wait_begin()
            begun = time.monotonic_ns()
            while time.monotonic_ns() == begun:  # some host work before the mark (the clock moves on)
                pass
            tracker.wait_blocks()
        tracker.compute_begin(a.kind, a.stage, a.microbatch)
        tracker.compute_end(a.kind, a.stage, a.microbatch)
    tracker.iteration_end()
    (bubble,) = [b for b in tracker.last_bubbles if b.slot == 4]
    assert 0 <= bubble.waited_ns < bubble.length_ns


def test_on_the_host_clock_a_marked_sites_bubble_starts_where_the_rank_blocks_from_its_second_wait() -> None:
    # On cpu:N the posting before the block is the core's work, not idle time: the first wait at a site teaches
    # that the adapter marks it; from then on its bubble is reported at the mark, not at the action's end.
    orders = build_schedule("gpipe", 2, 4).orders
    tracker, clock, sink = make(orders, 0)
    first_starts = []
    for iteration in range(2):
        tracker.iteration_begin()
        for k, a in enumerate(tracker.plan.order):
            if k == 4:
                tracker.wait_begin()
                ended = clock.now  # the action before ended here
                clock.now += MS // 2  # posting
                if iteration == 1:
                    assert not [s for s in sink.starts if s[0] == 1]  # nothing reported during the posting
                tracker.wait_blocks()
                blocked = clock.now
                clock.now += 3 * MS
                first_starts.append((ended, blocked))
            tracker.compute_begin(a.kind, a.stage, a.microbatch)
            clock.now += MS
            tracker.compute_end(a.kind, a.stage, a.microbatch)
        tracker.iteration_end()
    (ended0, _), (_, blocked1) = first_starts
    assert [(s[1], s[5]) for s in sink.starts if s[1] == 4] == [(4, ended0), (4, blocked1)]
    (bubble,) = [b for b in tracker.last_bubbles if b.slot == 4]
    assert (bubble.start_ns, bubble.length_ns, bubble.waited_ns) == (blocked1, 3 * MS, 3 * MS)
    assert [e[2] - s[5] for s, e in zip(sink.starts, sink.ends, strict=True)] == [3_500_000, 3 * MS]


def test_a_marked_sites_wait_that_never_blocks_is_measured_not_reported_and_the_next_starts_at_the_action() -> None:
    orders = build_schedule("gpipe", 2, 4).orders
    tracker, clock, sink = make(orders, 0)
    run_posting_iteration(tracker, clock, 0.5, {4: 3.0})  # every position's wait marked: each a blocking site
    reported = len(sink.starts)
    run_posting_iteration(tracker, clock, 0.5, {4: 3.0}, mark_blocks=False)  # the rank never blocked
    assert len(sink.starts) == reported and len(sink.ends) == reported  # no start, so no end either
    assert tracker.last_bubbles == [] and tracker.flush()
    # An adapter that stopped marking loses one wait per site, not every later one: reported whole again.
    run_posting_iteration(tracker, clock, 0.5, {4: 3.0}, mark_blocks=False)
    assert [(b.slot, b.length_ns) for b in tracker.last_bubbles if b.slot == 4] == [(4, 3_500_000)]


def test_on_a_device_clock_a_block_mark_leaves_the_bubble_at_the_actions_end() -> None:
    # On a GPU the device is idle from the action's end, whatever the host does before it blocks.
    orders = build_schedule("gpipe", 2, 4).orders
    clocks: list[FakeClock] = []

    def device_clock(consumer: Any) -> FakeClock:
        clocks.append(FakeClock(consumer))
        clocks[-1].synchronous = False  # type: ignore[misc]
        return clocks[-1]

    sink = Sink()
    tracker = RankTracker(orders, 0, sink, clock=device_clock)
    for _ in range(3):
        run_posting_iteration(tracker, clocks[0], 0.5, {4: 3.0})
    assert tracker.flush()
    assert {e[2] - s[5] for s, e in zip(sink.starts, sink.ends, strict=True) if s[1] == 4} == {3_500_000}


def test_without_block_marks_a_long_gap_of_host_work_stays_reported() -> None:
    # The same rank, its adapter unable to see where it blocks (a framework with no such hook; on a GPU the
    # device is idle through the host work): the whole gap counts, as before.
    orders = build_schedule("gpipe", 2, 4).orders
    tracker, clock, sink = make(orders, 0)
    for _ in range(4):
        run_posting_iteration(tracker, clock, 0.5, {4: 3.0}, mark_blocks=False)
    assert [s[1] for s in sink.starts if s[0] == 3] == list(tracker.plan.positions)  # (4, 5, 6, 7)
    assert all(b.waited_ns == -1 for b in tracker.last_bubbles)


def test_a_block_mark_with_no_wait_open_or_a_second_one_changes_nothing() -> None:
    orders = build_schedule("gpipe", 2, 4).orders
    tracker, clock, sink = make(orders, 0)
    tracker.iteration_begin()
    tracker.wait_blocks()  # rank 0 does not wait before its first forward: nothing is open
    for k, a in enumerate(tracker.plan.order):
        if k == 4:
            tracker.wait_begin()
            clock.now += MS
            tracker.wait_blocks()
            clock.now += MS
            tracker.wait_blocks()  # a second receive of the same wait: the wait began at the first
            clock.now += MS
        tracker.compute_begin(a.kind, a.stage, a.microbatch)
        clock.now += MS
        tracker.compute_end(a.kind, a.stage, a.microbatch)
    tracker.iteration_end()
    assert [(b.slot, b.length_ns, b.waited_ns) for b in tracker.last_bubbles] == [(4, 3 * MS, 2 * MS)]


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1"])
def test_a_framework_that_runs_another_order_is_logged_once_and_keeps_counting(
        name: str, caplog: pytest.LogCaptureFixture) -> None:
    orders = build_schedule(name, 2, 4).orders
    tracker, clock, _ = make(orders, 1)
    tracker.iteration_begin()
    with caplog.at_level("WARNING", logger="freeride.training.tracker"):
        tracker.compute_begin("W", 1, 3)
        tracker.compute_begin("W", 1, 3)
    assert sum("planned order" in r.message for r in caplog.records) == 1


def test_orders_the_tracker_cannot_use_are_refused_clearly() -> None:
    with pytest.raises(ConfigError, match="rank 2 has no actions"):
        RankTracker({0: [Action("F", 0, 0)]}, 2)
    with pytest.raises(ConfigError, match="runs on ranks"):
        RankTracker({0: [Action("F", 0, 0)], 1: [Action("F", 0, 1)]}, 0)
    with pytest.raises(ConfigError, match="report_min_ns"):
        RankTracker({0: [Action("F", 0, 0)]}, 0, report_min_ns=-1)


class LayoutSink(Sink):
    """A sink that takes layouts, as a BubbleReporter does; ``calls`` holds every call in order."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, ...]] = []

    def bubble_start(self, *args: Any, **kwargs: Any) -> None:
        super().bubble_start(*args, **kwargs)
        self.calls.append(("start",))

    def report_layout(self, schedule: str, stages: int, microbatches: int, stage_devices: tuple[str, ...] = (),
                      free_memory_bytes: int = -1, at_ns: int | None = None) -> None:
        self.calls.append(("layout", schedule, stages, microbatches))


def test_a_named_schedule_reports_its_layout_once_before_the_first_bubble() -> None:
    """A manager that served a job of another shape forgets its bubbles at a new layout: without one, ``freeride
    bubbles`` mixed two jobs' slots (found trying Interleaved1F1B after a CSV schedule on long-lived managers)."""
    orders = build_schedule("1f1b", 2, 6).orders
    sink = LayoutSink()
    tracker = RankTracker(orders, 1, sink, clock=FakeClock, schedule="Schedule1F1B")
    clock = tracker.clock
    assert isinstance(clock, FakeClock)
    for _ in range(3):
        run_iteration(tracker, clock, {"F": 1, "B": 2}, {(0, 0): 3, (2, 0): 0.5})
    assert sink.calls[0] == ("layout", "Schedule1F1B", 2, 6)
    assert [c for c in sink.calls if c[0] == "layout"] == [sink.calls[0]] and len(sink.starts) == 6


def test_no_layout_is_reported_without_a_schedule_name_or_to_a_sink_that_takes_none() -> None:
    orders = build_schedule("gpipe", 2, 4).orders
    sink = LayoutSink()
    tracker = RankTracker(orders, 0, sink, clock=FakeClock)
    run_iteration(tracker, tracker.clock, {"F": 1, "B": 2}, {(4, 0): 3})  # type: ignore[arg-type]
    assert all(c[0] == "start" for c in sink.calls) and sink.calls
    plain = Sink()  # no report_layout: a recorder, a user's own sink
    tracker = RankTracker(orders, 0, plain, clock=FakeClock, schedule="ScheduleGPipe")
    run_iteration(tracker, tracker.clock, {"F": 1, "B": 2}, {(4, 0): 3})  # type: ignore[arg-type]
    assert len(plain.starts) == 1


def test_a_sink_whose_layout_report_raises_never_stops_the_training_loop() -> None:
    class Broken(LayoutSink):
        def report_layout(self, *args: Any, **kwargs: Any) -> None:
            raise RuntimeError("sink broke")

    orders = build_schedule("gpipe", 2, 4).orders
    sink = Broken()
    tracker = RankTracker(orders, 0, sink, clock=FakeClock, schedule="ScheduleGPipe")
    run_iteration(tracker, tracker.clock, {"F": 1, "B": 2}, {(4, 0): 3})  # type: ignore[arg-type]
    run_iteration(tracker, tracker.clock, {"F": 1, "B": 2}, {(4, 0): 3})  # type: ignore[arg-type]
    assert len(sink.starts) == 2


def test_a_framework_device_is_named_once_for_the_tracker_and_every_adapter(monkeypatch: pytest.MonkeyPatch) -> None:
    # The DeepSpeed and torchtitan adapters each named torch.device("cuda") "cuda:0"; a rank that called
    # torch.cuda.set_device(3) and built its stage on "cuda" is on cuda:3, and the tracker refused it.
    import types

    from freeride.training.tracker import checked_device, torch_device_name

    fake_torch = types.SimpleNamespace(cuda=types.SimpleNamespace(current_device=lambda: 3))
    monkeypatch.setitem(sys.modules, "torch", fake_torch)

    def device(kind: str, index: int | None = None) -> Any:
        return types.SimpleNamespace(type=kind, index=index)

    assert torch_device_name(device("cuda")) == "cuda:3"
    assert torch_device_name(device("cuda", 1)) == "cuda:1"
    assert torch_device_name(device("cpu")) == "cpu"
    assert torch_device_name(device("cpu", 1)) == "cpu:1"
    assert torch_device_name(None) is None
    assert checked_device(device("cuda")) == "cuda:3"
    with pytest.raises(ConfigError, match=r"name the rank's device as freeride does, 'cpu:N' \(its core\) or 'cuda:N'"):
        torch_device_name(device("meta"))


def test_kept_shapes_give_a_shape_its_tracker_back_with_its_layout_rearmed_and_close_the_oldest() -> None:
    from freeride.training.tracker import KeptShapes

    class Tracker:
        def __init__(self, shape: int) -> None:
            self.shape, self.relayouts, self.closed = shape, 0, False

        def relayout(self) -> None:
            self.relayouts += 1

        def close(self) -> None:
            self.closed = True

    kept: KeptShapes[Any] = KeptShapes(lambda tracker: tracker, keep=2)
    four = kept.get(4, lambda: Tracker(4))
    six = kept.get(6, lambda: Tracker(6))
    assert kept.get(4, lambda: Tracker(-1)) is four and four.relayouts == 1  # seen again: kept, layout re-armed
    eight = kept.get(8, lambda: Tracker(8))  # a third shape: the least recent (6) goes, closed
    assert six.closed and not four.closed and not eight.closed
    assert kept.get(6, lambda: Tracker(60)).shape == 60
    kept.close()
    assert four.closed and eight.closed


def test_a_reporting_cpu_rank_that_may_run_on_other_cores_is_warned_about(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Stranger trial: an unpinned rank (affinity {0, 1}) naming cpu:0 was accepted silently; side tasks on core 0
    # then met it wherever it computed.
    import os

    from freeride.training import tracker as tracker_module

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    sink = object()
    with caplog.at_level(logging.WARNING, logger="freeride.training.tracker"):
        tracker_module.check_rank_device("cpu:0", 0, sink)
        tracker_module.check_rank_device("cpu:0", 0, None)  # measuring only: nothing is harvested beside it
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
        tracker_module.check_rank_device("cpu:0", 0, sink)  # pinned
    [said] = [r.getMessage() for r in caplog.records]
    assert "this rank's device is cpu:0, and its training thread may run on cores 0, 1" in said
    assert "os.sched_setaffinity(0, {0})" in said


def test_a_device_or_stage_that_is_not_where_the_rank_trains_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # Stranger trial: rank 0, pinned to core 0, reported as cpu:1 (and rank 1 as cpu:0) without a word; each
    # manager ran side tasks in the other rank's bubbles, beside that rank's compute.
    import os
    import types

    from freeride.training.tracker import check_rank_device

    orders = build_schedule("1f1b", 2, 4).orders
    elsewhere = max(os.sched_getaffinity(0)) + 1  # a core this thread does not run on, whatever the host
    with pytest.raises(ConfigError, match=rf"this rank's device is cpu:{elsewhere}, and it runs on core\(s\) .* only"):
        RankTracker(orders, 1, None, device=f"cpu:{elsewhere}")
    here = min(os.sched_getaffinity(0))
    RankTracker(orders, 1, None, device=f"cpu:{here}").close()

    class Reporter:
        device, stage = f"cpu:{here}", 0

        def bubble_start(self, *args: Any, **kwargs: Any) -> None: ...

        def bubble_end(self, *args: Any, **kwargs: Any) -> None: ...

    with pytest.raises(ConfigError, match=r"the reporter stamps its bubbles stage 0, and this is pipeline rank 1: "
                                          r"BubbleReporter\(\.\.\., stage=1\)"):
        RankTracker(orders, 1, Reporter(), device=f"cpu:{here}")
    fake_torch = types.SimpleNamespace(cuda=types.SimpleNamespace(current_device=lambda: 0))
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    with pytest.raises(ConfigError, match="this rank's device is cuda:0, and its stage is on cuda:1"):
        check_rank_device("cuda:0", 0, None, types.SimpleNamespace(type="cuda", index=1))
    check_rank_device("cuda:0", 0, None, types.SimpleNamespace(type="cuda", index=None))  # "cuda": the current one


class RunDelay:
    """The training thread's run delay as the test says it grows (ns)."""

    def __init__(self) -> None:
        self.ns = 5 * MS

    def __call__(self) -> int:
        return self.ns


def test_on_the_host_clock_a_wait_ends_where_the_rank_stopped_waiting_for_another_rank_not_for_its_core() -> None:
    # Stranger trial: a DeepSpeed rank reported 1.15-1.25 ms waits beside its side task where its receives took
    # 0.45 ms; the rest was the rank runnable without its core (its manager and side task held it).
    orders = build_schedule("1f1b", 2, 4).orders
    delay = RunDelay()
    tracker, clock, sink = make(orders, 1, run_delay=delay)
    tracker.iteration_begin()
    tracker.wait_begin()  # position 0: the boundary wait
    clock.now += 2 * MS
    delay.ns += int(0.75 * MS)  # the data came 0.75 ms before the rank had its core back
    clock.now += int(0.75 * MS)
    a = tracker.plan.order[0]
    tracker.compute_begin(a.kind, a.stage, a.microbatch)
    assert [(e[1], e[2] - sink.starts[0][5]) for e in sink.ends] == [(0, 2 * MS)]
    clock.now += MS
    tracker.compute_end(a.kind, a.stage, a.microbatch)
    tracker.wait_begin()  # a wait shorter than what the rank waited for its core in it: no time at all
    clock.now += MS // 2
    delay.ns += MS
    b = tracker.plan.order[1]
    tracker.compute_begin(b.kind, b.stage, b.microbatch)
    tracker.compute_end(b.kind, b.stage, b.microbatch)
    tracker.iteration_end()
    tracker.flush()
    assert [(w.length_ns, w.core_wait_ns) for w in tracker.last_bubbles][:1] == [(2 * MS, int(0.75 * MS))]
    assert (tracker.unplanned_waits, tracker._timeline.unplanned_wait_ns) == (1, 0)  # never before its start


def test_a_wait_reported_from_where_the_rank_blocks_counts_only_the_core_waits_after_that_mark() -> None:
    orders = build_schedule("gpipe", 2, 4).orders
    delay = RunDelay()
    tracker, clock, sink = make(orders, 0, run_delay=delay)
    tracker.learn_every = 1
    for _ in range(2):  # the first marked wait teaches the tracker that position 4 blocks
        run_posting_iteration(tracker, clock, 0.5, {4: 3.0})
    tracker.iteration_begin()
    order = tracker.plan.order
    for k, a in enumerate(order):
        if k == 4:
            tracker.wait_begin()
            clock.now += MS // 2
            delay.ns += MS // 4  # its posting was held up: before the bubble, not in it
            tracker.wait_blocks()
            clock.now += 3 * MS
            delay.ns += MS  # it had its core back 1 ms after the data came
        tracker.compute_begin(a.kind, a.stage, a.microbatch)
        clock.now += MS
        tracker.compute_end(a.kind, a.stage, a.microbatch)
    tracker.iteration_end()
    start = [s for s in sink.starts if s[0] == 2 and s[1] == 4][0][5]
    end = [e for e in sink.ends if e[0] == 2 and e[1] == 4][0][2]
    assert end - start == 2 * MS


def test_only_a_host_clock_reads_the_threads_run_delay_unless_told() -> None:
    orders = build_schedule("1f1b", 2, 4).orders
    assert make(orders, 1)[0]._timeline.run_delay is None  # a test's clock: no real thread's figures
    host = RankTracker(orders, 1, Sink(), device="cpu:0")
    try:
        reader = host._timeline.run_delay
        assert reader is not None and reader() >= -1
    finally:
        host.close()
