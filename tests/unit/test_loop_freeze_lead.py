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
    SPIN_CHECK_NS,
    SPIN_GIVE_WAY_NS,
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


class _RunDelay:
    """The loop thread's run delay as the kernel would count it: a test moves it."""

    def __init__(self) -> None:
        self.ns: int | None = 5_000_000

    def read(self) -> int | None:
        return self.ns


def test_a_spinning_loop_that_waits_for_its_core_gives_way_until_the_next_event(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A probe: with the spin on, a shared core's rarest event delays grew to 2.7-4.6 ms (p99.9), 1.3-1.5 asleep.
    now = [10 * HOUR_NS]
    loop = _spinning_loop(tmp_path, now)
    delay = _RunDelay()
    loop._run_delay = delay  # type: ignore[assignment]
    try:
        loop._feed_trainer(_start(now[0]), now[0])
        assert loop._timeout_s() == 0  # the spin's baseline reading
        for _ in range(5):  # the core to itself: a few microseconds of waiting now and then
            now[0] += SPIN_CHECK_NS
            delay.ns += SPIN_GIVE_WAY_NS // 2  # type: ignore[operator]
            assert loop._timeout_s() == 0
        now[0] += SPIN_CHECK_NS
        delay.ns += 3 * SPIN_GIVE_WAY_NS  # type: ignore[operator]  # it waited: something else wanted the core
        with caplog.at_level(logging.INFO):
            assert loop._timeout_s() > 0
        assert loop.spins_given_way == 1 and "--event-spin-us gives way" in caplog.text
        now[0] += 1000
        assert loop._timeout_s() > 0  # asleep for the rest of that spin
        # the next event spins again, against a new baseline (the wake-up's own wait is not held against it)
        delay.ns += 10 * SPIN_GIVE_WAY_NS  # type: ignore[operator]
        loop._feed_trainer(_start(now[0]), now[0])
        assert loop._timeout_s() == 0
        now[0] += SPIN_CHECK_NS
        assert loop._timeout_s() == 0 and loop.spins_given_way == 1
    finally:
        loop.stop()


def test_where_the_run_delay_cannot_be_read_the_spin_runs_its_length(tmp_path: Path) -> None:
    now = [10 * HOUR_NS]
    loop = _spinning_loop(tmp_path, now)
    delay = _RunDelay()
    delay.ns = None
    loop._run_delay = delay  # type: ignore[assignment]
    try:
        loop._feed_trainer(_start(now[0]), now[0])
        for _ in range(SPIN_NS // SPIN_CHECK_NS):
            assert loop._timeout_s() == 0
            now[0] += SPIN_CHECK_NS - 1
        assert loop.spins_given_way == 0
    finally:
        loop.stop()


@pytest.mark.parametrize("spin_ns", [-1, MAX_EVENT_SPIN_NS + 1])
def test_a_spin_out_of_bounds_is_refused(tmp_path: Path, spin_ns: int) -> None:
    with pytest.raises(ValueError, match="event_spin_ns must be 0.."):
        LoopConfig(state_dir=tmp_path / "state", event_spin_ns=spin_ns)
