"""The loop wakes ``FREEZE_LEAD_NS`` before a freeze and turns without sleeping until it is due, so that waking
an idle core does not stretch a step's grace (``ManagerLoop._timeout_s``)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import cpu_devices

from freeride._manager.loop import FREEZE_LEAD_NS, IDLE_WAKE_NS, LoopConfig, ManagerLoop
from freeride.devices import open_device

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
