"""The loop wakes ``FREEZE_LEAD_NS`` before a freeze and turns without sleeping until it is due, so that waking
an idle core does not stretch a step's grace (``ManagerLoop._timeout_s``); with ``event_spin_ns`` it also turns
that long after each trainer event, so that the next one finds it awake."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import cpu_devices

from freeride._manager import core as C
from freeride._manager.loop import (
    FREEZE_LEAD_NS,
    IDLE_WAKE_NS,
    MAX_EVENT_SPIN_NS,
    SPIN_BACKOFF_NS,
    SPIN_CHECK_NS,
    SPIN_GIVE_WAY_NS,
    SPIN_QUIET_NS,
    LoopConfig,
    ManagerLoop,
)
from freeride.devices import open_device
from freeride.messages import BubbleEnd, BubbleStart, TrainerLayout

HOUR_NS = 3600 * 10**9


@pytest.fixture
def loop(tmp_path: Path) -> Iterator[ManagerLoop]:
    loop = ManagerLoop(open_device(cpu_devices(1)[0]), LoopConfig(state_dir=tmp_path / "state"))
    yield loop
    loop.stop()


def test_the_timer_is_armed_a_lead_before_a_freeze(loop: ManagerLoop) -> None:
    assert loop._timer is not None
    freeze = time.monotonic_ns() + HOUR_NS // 2  # inside the idle wake-up: the freeze is the next timer
    loop.core.overruns.freeze_at_ns = freeze
    assert 0 < loop._timeout_s() <= (HOUR_NS // 2 - FREEZE_LEAD_NS) / 1e9
    assert loop._timer._at_ns == freeze - FREEZE_LEAD_NS


def test_a_freeze_due_within_the_lead_makes_the_loop_turn_without_sleeping(loop: ManagerLoop) -> None:
    loop.core.overruns.freeze_at_ns = time.monotonic_ns() + FREEZE_LEAD_NS // 4  # due within the lead (or past)
    assert loop._timeout_s() == 0
    loop.core.overruns.freeze_at_ns = time.monotonic_ns() - 1  # past due: the next turn freezes
    assert loop._timeout_s() == 0


def test_without_a_freeze_the_loop_sleeps_until_its_idle_wake_up(loop: ManagerLoop) -> None:
    loop.core.overruns.freeze_at_ns = 0
    assert loop._timeout_s() == pytest.approx(IDLE_WAKE_NS / 1e9, rel=0.01)
    assert loop._timer is not None and loop._timer._at_ns == 0


def test_on_a_fake_clock_there_is_no_lead_and_no_turning(tmp_path: Path) -> None:
    now = [10 * HOUR_NS]
    loop = ManagerLoop(open_device(cpu_devices(1)[0]), LoopConfig(state_dir=tmp_path / "state"),
                       now_ns=lambda: now[0])
    try:
        assert loop._timer is None
        loop.core.overruns.freeze_at_ns = now[0] + 1_000_000
        assert loop._timeout_s() == pytest.approx(0.001)
    finally:
        loop.stop()


# ---------------------------------------------------------------- awake after trainer events (--event-spin-us)

SPIN_NS = 2_000_000


def _spinning_loop(tmp_path: Path, now: list[int], spin_ns: int = SPIN_NS) -> ManagerLoop:
    return ManagerLoop(open_device(cpu_devices(1)[0]),
                       LoopConfig(state_dir=tmp_path / "state", event_spin_ns=spin_ns), now_ns=lambda: now[0])


def _start(at_ns: int) -> C.BubbleStarted:
    return C.BubbleStarted(BubbleStart(0, 0, 0, 0, "bubble", at_ns, 5_000_000, 2**30), at_ns)


def test_after_a_trainer_event_the_loop_turns_without_sleeping_for_the_spin(tmp_path: Path) -> None:
    now = [10 * HOUR_NS]
    loop = _spinning_loop(tmp_path, now)
    try:
        assert loop._timeout_s() == pytest.approx(IDLE_WAKE_NS / 1e9)  # no event yet: asleep
        loop._feed_trainer(_start(now[0]), now[0])
        assert loop._timeout_s() == 0
        now[0] += SPIN_NS - 1
        assert loop._timeout_s() == 0
        now[0] += 1  # the spin is over with no further event: asleep until the next timer
        assert loop._timeout_s() > 0
        loop._feed_trainer(C.BubbleEnded(BubbleEnd(0, 0, 0, 0, now[0]), now[0]), now[0])
        assert loop._timeout_s() == 0  # each event starts the spin again
    finally:
        loop.stop()


def test_without_a_spin_a_trainer_event_leaves_the_loop_sleeping(tmp_path: Path) -> None:
    now = [10 * HOUR_NS]
    loop = _spinning_loop(tmp_path, now, spin_ns=0)
    try:
        loop._feed_trainer(_start(now[0]), now[0])
        assert loop._timeout_s() > 0
    finally:
        loop.stop()


def test_a_manager_whose_cores_all_compute_ranks_turns_its_spin_off_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    now = [10 * HOUR_NS]
    loop = _spinning_loop(tmp_path, now)
    try:
        cores = sorted(loop._cores)
        layout = TrainerLayout("Schedule1F1B", len(cores), 8, tuple(f"cpu:{c}" for c in cores), now[0])
        with caplog.at_level(logging.WARNING):
            loop._trainer_input(layout, now[0])
        assert "--event-spin-us is off" in caplog.text
        loop._feed_trainer(_start(now[0]), now[0])
        assert loop._timeout_s() > 0
    finally:
        loop.stop()


def test_cores_guessed_to_be_ranks_from_the_managers_sockets_leave_the_spin_on_and_the_warning_says_it_is_a_guess(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Stranger trial: both DeepSpeed ranks on core 0, a spinning manager on core 1; the idle cpu:0 manager's socket
    # made it say "every core computes a rank" and turn its spin off.
    now = [10 * HOUR_NS]
    sockets = tmp_path / "run"
    sockets.mkdir()
    config = LoopConfig(state_dir=tmp_path / "state", event_spin_ns=SPIN_NS, end_board_path=sockets / "ends")
    loop = ManagerLoop(open_device(cpu_devices(1)[0]), config, now_ns=lambda: now[0])
    try:
        for core in loop._cores:
            (sockets / f"cpu-{core}.sock").touch()
        with caplog.at_level(logging.WARNING):
            loop._trainer_input(TrainerLayout("TrainSchedule", 2, 8, (), now[0]), now[0])
        assert "has a cpu manager, and is taken for a rank's" in caplog.text
        assert "--event-spin-us is off" not in caplog.text
        loop._feed_trainer(_start(now[0]), now[0])
        assert loop._timeout_s() == 0  # still spinning: it gives way by itself where a rank takes its core
    finally:
        loop.stop()


class _Readings:
    """The loop thread's run delay, the process's CPU time and the loop thread's, as the kernel would count
    them (``ManagerLoop._spin_reading``): a test moves them."""

    def __init__(self) -> None:
        self.delay, self.process, self.thread = 5_000_000, 1_000_000_000, 400_000_000
        self.readable = True

    def __call__(self) -> tuple[int, int, int] | None:
        return (self.delay, self.process, self.thread) if self.readable else None


def _spin_with(tmp_path: Path, now: list[int]) -> tuple[ManagerLoop, _Readings]:
    loop = _spinning_loop(tmp_path, now)
    readings = _Readings()
    loop._spin_reading = readings  # type: ignore[method-assign]
    return loop, readings


def _spins(loop: ManagerLoop, now: list[int], readings: _Readings, waited_ns: int = 0, others_ns: int = 0) -> bool:
    """One check's worth of spinning later: the loop waited ``waited_ns`` for its core, while the manager's
    other threads ran ``others_ns``; whether it still spins."""
    now[0] += SPIN_CHECK_NS
    readings.delay += waited_ns
    readings.process += others_ns + SPIN_CHECK_NS // 2
    readings.thread += SPIN_CHECK_NS // 2
    return loop._timeout_s() == 0


def test_a_spinning_loop_that_another_process_keeps_from_its_core_stops_spinning_for_a_back_off(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # bench_spin: beside a busy process, the spin's event delays reached 4.1 ms (p99) where asleep they were 0.1.
    now = [10 * HOUR_NS]
    loop, readings = _spin_with(tmp_path, now)
    try:
        loop._feed_trainer(_start(now[0]), now[0])
        assert loop._timeout_s() == 0  # the spin's baseline reading
        for _ in range(5):  # the core to itself: the kernel's own short turns now and then
            assert _spins(loop, now, readings, waited_ns=SPIN_GIVE_WAY_NS // 4)
        with caplog.at_level(logging.INFO):
            assert not _spins(loop, now, readings, waited_ns=2 * SPIN_GIVE_WAY_NS)
        assert loop.spins_given_way == 1 and "--event-spin-us gives way" in caplog.text
        # for the back-off, trainer events leave it asleep
        now[0] += SPIN_BACKOFF_NS // 2
        loop._feed_trainer(_start(now[0]), now[0])
        assert loop._timeout_s() > 0
        # after it, the next event spins again, against a new baseline (a wake-up's own wait is not held against it)
        now[0] += SPIN_BACKOFF_NS
        readings.delay += 10 * SPIN_GIVE_WAY_NS
        loop._feed_trainer(_start(now[0]), now[0])
        assert loop._timeout_s() == 0
        assert _spins(loop, now, readings)
        # a second give-way soon after: twice the back-off
        assert not _spins(loop, now, readings, waited_ns=2 * SPIN_GIVE_WAY_NS)
        now[0] += SPIN_BACKOFF_NS + 1
        loop._feed_trainer(_start(now[0]), now[0])
        assert loop._timeout_s() > 0  # still off: 2x the back-off
        now[0] += SPIN_BACKOFF_NS
        loop._feed_trainer(_start(now[0]), now[0])
        assert loop._timeout_s() == 0 and loop.spins_given_way == 2
        # long after the last give-way, one starts from the short back-off again
        now[0] += SPIN_QUIET_NS
        loop._feed_trainer(_start(now[0]), now[0])
        assert loop._timeout_s() == 0
        assert not _spins(loop, now, readings, waited_ns=2 * SPIN_GIVE_WAY_NS)
        now[0] += SPIN_BACKOFF_NS + 1
        loop._feed_trainer(_start(now[0]), now[0])
        assert loop._timeout_s() == 0
    finally:
        loop.stop()


def test_the_managers_own_threads_on_its_core_do_not_stop_the_spin(tmp_path: Path) -> None:
    # Its gRPC threads and watchdog share a manager's core of its own: their turns are no other process's.
    now = [10 * HOUR_NS]
    loop, readings = _spin_with(tmp_path, now)
    try:
        loop._feed_trainer(_start(now[0]), now[0])
        assert loop._timeout_s() == 0
        assert _spins(loop, now, readings, waited_ns=3 * SPIN_GIVE_WAY_NS, others_ns=3 * SPIN_GIVE_WAY_NS)
        assert loop.spins_given_way == 0
    finally:
        loop.stop()


def test_where_the_run_delay_cannot_be_read_the_spin_runs_its_length(tmp_path: Path) -> None:
    now = [10 * HOUR_NS]
    loop, readings = _spin_with(tmp_path, now)
    readings.readable = False
    try:
        loop._feed_trainer(_start(now[0]), now[0])
        for _ in range(SPIN_NS // SPIN_CHECK_NS - 1):
            assert _spins(loop, now, readings, waited_ns=10 * SPIN_GIVE_WAY_NS)
        assert loop.spins_given_way == 0
    finally:
        loop.stop()


@pytest.mark.parametrize("spin_ns", [-1, MAX_EVENT_SPIN_NS + 1])
def test_a_spin_out_of_bounds_is_refused(tmp_path: Path, spin_ns: int) -> None:
    with pytest.raises(ValueError, match="event_spin_ns must be 0.."):
        LoopConfig(state_dir=tmp_path / "state", event_spin_ns=spin_ns)


def test_the_loops_reading_is_its_threads_run_delay_and_cpu_times(tmp_path: Path) -> None:
    now = [10 * HOUR_NS]
    loop = _spinning_loop(tmp_path, now)
    try:
        first = loop._spin_reading()
        assert first is not None and all(v >= 0 for v in first)
        t = time.thread_time_ns() + 5_000_000
        while time.thread_time_ns() < t:  # 5 ms of this thread's CPU time
            pass
        second = loop._spin_reading()
        assert second is not None and second[2] - first[2] >= 5_000_000 and second[1] - first[1] >= 5_000_000
    finally:
        loop.stop()
