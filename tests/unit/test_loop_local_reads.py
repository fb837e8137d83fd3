"""A local trainer's events are read at each one while a task could take a grant, and every ``LAZY_READ_NS``
otherwise, out of the loop's selector so that a send wakes no one (``ManagerLoop._follow_local``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import cpu_devices

from freeride._local_events import LocalEvents, LocalEventSender
from freeride._manager.loop import LAZY_READ_NS, LoopConfig, ManagerLoop
from freeride.devices import open_device

MS = 1_000_000


class Clock:
    def __init__(self) -> None:
        self.ns = 10**12

    def __call__(self) -> int:
        return self.ns


@pytest.fixture(params=[LAZY_READ_NS])
def rig(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[ManagerLoop, LocalEventSender, Clock]]:
    clock = Clock()
    config = LoopConfig(state_dir=tmp_path / "state", idle_read_ns=request.param)
    loop = ManagerLoop(open_device(cpu_devices(1)[0]), config, now_ns=clock)
    local = LocalEvents(tmp_path / "ev")
    loop.listen_locally(local)
    sender = LocalEventSender(tmp_path / "ev")
    yield loop, sender, clock
    sender.close()
    loop.stop()


def _registered(loop: ManagerLoop) -> bool:
    assert loop._local is not None
    return loop._local.fileno() in loop._selector.get_map()


def test_without_a_resident_task_events_are_read_every_lazy_interval_and_wake_no_one(rig) -> None:
    loop, sender, clock = rig
    loop._follow_local()  # no task at all: nothing to decide on a trainer's event
    assert not _registered(loop)
    assert loop._timeout_s() == pytest.approx(1.0, rel=0.01)  # no trainer connected yet: no read is due
    for key, _ in loop._selector.select(0):  # the trainer's connection is taken at once
        key.data()
    assert loop._local is not None and loop._local.connections == 1
    assert sender.send_start(0, 0, 1, 0, "fwd", clock.ns - MS, 5 * MS, -1, False)
    assert loop._selector.select(0) == []  # its event wakes no one
    clock.ns += LAZY_READ_NS - 1
    loop._follow_local()
    assert loop.core.bubbles.open is None  # not read yet
    assert loop._timeout_s() == pytest.approx(1e-9, abs=1e-6)  # the select wakes for the next read
    clock.ns += 1
    loop._follow_local()
    assert loop.core.bubbles.open is not None and loop.core.bubbles.open.event.iteration == 1
    assert loop.event_delay.count == 0 and loop.events_late == 1  # read late on purpose: not the event's delay
    assert loop.events_received == 1


def test_a_task_that_could_take_a_grant_brings_the_events_back_at_once(rig, monkeypatch) -> None:
    loop, sender, clock = rig
    loop._follow_local()
    assert not _registered(loop)
    assert sender.send_start(0, 0, 1, 0, "fwd", clock.ns - MS, 5 * MS, -1, False)
    monkeypatch.setattr(loop.core, "wants_trainer_events", lambda: True)  # a task is resident now
    loop._follow_local()
    assert _registered(loop)
    assert loop.core.bubbles.open is not None  # what waited is read at once: the bubble open now may be granted
    assert sender.send_end(0, 0, 1, 0, clock.ns)
    for key, _ in loop._selector.select(0):  # the selector sees the next one
        key.data()
    assert loop.core.bubbles.open is None and loop.event_delay.count == 1


@pytest.mark.parametrize("rig", [0], indirect=True)
def test_idle_reads_off_read_every_event_at_once_without_a_task(rig) -> None:
    # --idle-read-ms 0: the benches that time a manager's events run it so.
    loop, sender, clock = rig
    loop._follow_local()
    assert _registered(loop)
    assert sender.send_start(0, 0, 1, 0, "fwd", clock.ns - MS, 5 * MS, -1, False)
    for key, _ in loop._selector.select(1):
        key.data()
    assert loop.core.bubbles.open is not None and loop.event_delay.count == 1


def test_an_idle_read_interval_out_of_bounds_is_refused(tmp_path: Path) -> None:
    from freeride._manager.loop import MAX_IDLE_READ_NS

    with pytest.raises(ValueError, match="idle_read_ns"):
        LoopConfig(state_dir=tmp_path / "state", idle_read_ns=MAX_IDLE_READ_NS + 1)
