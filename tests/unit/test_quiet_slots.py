"""The quiet slots: which of the followed rank's slots no resident task could use (the core), as the loop publishes
them on the end board (``freeride._manager.quiet``) and a late event is read (not timed)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import cpu_devices
from core_sim import MS, S, Sim

from freeride._boards import END_BOARD_RANKS, QUIET_SLOTS, STOP_RECORDS_END, EndBoard
from freeride._local_events import LocalEvents, LocalEventSender
from freeride._manager.core.scheduler import QUIET_SLOTS as CORE_QUIET_SLOTS
from freeride._manager.loop import LoopConfig, ManagerLoop
from freeride._manager.quiet import QuietSlots
from freeride.devices import open_device


def _slots(sim: Sim, lengths_ms: dict[int, float], rank: int = 0, times: int = 2) -> None:
    """Bubbles of these slots (slot: length) of ``rank``, ``times`` rounds, none granted."""
    for _ in range(times):
        sim.iteration += 1
        for slot, length in lengths_ms.items():
            sim.advance_ms(1)
            sim.start(predicted_ms=min(length, 0.1), slot=slot, rank=rank, iteration=sim.iteration)
            sim.advance_ms(length)
            sim.end()


def _with_task(step_ms: float, lengths_ms: dict[int, float]) -> Sim:
    sim = Sim(margin_ns=MS // 5)
    _slots(sim, lengths_ms)
    sim.resident("a")
    sim.core.tasks["a"].estimator.extend([int(step_ms * MS)] * 8)
    return sim


# ---------------------------------------------------------------- the core


def test_the_slots_that_no_tasks_step_fits_are_quiet() -> None:
    sim = _with_task(1.0, {0: 0.3, 1: 3.0, 3: 0.5})
    assert sim.core.quiet_slots() == (0, bytes([1, 0, 0, 1]))  # slot 2 never seen: not quiet


def test_a_slot_past_the_boards_is_never_quiet_however_large_its_index() -> None:
    # A trainer may number a slot 2**62: the flags are one byte a slot index, so only the board's first ones count.
    sim = _with_task(1.0, {0: 0.3, QUIET_SLOTS: 0.3, 2**62: 0.3})
    assert sim.core.quiet_slots() == (0, bytes([1]))
    assert CORE_QUIET_SLOTS == QUIET_SLOTS


def test_a_slot_whose_recent_wait_fits_the_step_is_loud_again() -> None:
    sim = _with_task(1.0, {0: 0.3, 1: 3.0})
    assert sim.core.quiet_slots() == (0, bytes([1]))
    _slots(sim, {0: 2.0}, times=1)  # slot 0 waited 2 ms this time
    assert sim.core.quiet_slots() == (0, b"")


@pytest.mark.parametrize("why", ["no task", "frozen", "starting", "step unknown", "sharing"])
def test_nothing_is_quiet_where_any_bubble_could_be_used_or_no_task_is_resident(why: str) -> None:
    sim = _with_task(1.0, {0: 0.3, 1: 3.0})
    if why == "no task":
        sim = Sim(margin_ns=MS // 5)
        _slots(sim, {0: 0.3})
    elif why == "frozen":  # granted, and frozen past the bubble's end: a thaw fits any bubble
        sim.advance_ms(1)
        sim.start(predicted_ms=3.0, slot=1)
        due = sim.core.next_timer_ns()
        assert due is not None
        sim.at(due)
        sim.tick()
        assert sim.state("a") == S.FROZEN
    elif why == "starting":
        sim.add("b")
        sim.free(100_000)
    elif why == "step unknown":
        sim.resident("b")
    else:
        _slots(sim, {0: 0.3}, rank=1, times=1)  # a second rank on the device
        assert sim.core.sharing_ranks
    assert sim.core.quiet_slots() is None


# ---------------------------------------------------------------- the board and its writer


def test_the_board_keeps_each_ranks_slots_apart(tmp_path: Path) -> None:
    path = tmp_path / "ends"
    EndBoard.create(path)
    board = EndBoard.open(path, writable=True)
    try:
        board.set_quiet(3, bytes([1, 0, 1]))
        assert [board.quiet(3, s) for s in range(4)] == [True, False, True, False]
        assert not board.quiet(4, 0) and not board.quiet(3, -1) and not board.quiet(3, QUIET_SLOTS)
        assert board.quiet(3 + END_BOARD_RANKS, 0)  # ranks share records as the end records do
        board.set_quiet(3, bytes([1]))
        assert [board.quiet(3, s) for s in range(3)] == [True, False, False]  # the rest cleared
    finally:
        board.close()


def test_an_older_managers_board_has_no_quiet_slots(tmp_path: Path) -> None:
    path = tmp_path / "ends"
    path.write_bytes(bytes(STOP_RECORDS_END))
    board = EndBoard.open(path, writable=True)
    try:
        assert not board.has_quiet
        board.set_quiet(0, bytes([1]))  # nothing to write to
        assert not board.quiet(0, 0)
    finally:
        board.close()


def test_the_writer_clears_the_old_ranks_slots_first_and_everything_at_close(tmp_path: Path) -> None:
    path = tmp_path / "ends"
    EndBoard.create(path)
    trainer = EndBoard.open(path, writable=True)
    writer = QuietSlots(path)
    try:
        writer.publish((0, bytes([1, 1])))
        assert trainer.quiet(0, 1)
        writer.publish((1, bytes([0, 1])))
        assert not trainer.quiet(0, 0) and not trainer.quiet(0, 1) and trainer.quiet(1, 1)
        writer.publish(None)
        assert not trainer.quiet(1, 1)
        writer.publish((1, bytes([1])))
        writer.close()
        assert not trainer.quiet(1, 0)
    finally:
        trainer.close()


def test_a_writer_without_a_board_writes_nothing_and_never_raises(tmp_path: Path) -> None:
    QuietSlots(None).publish((0, bytes([1])))
    writer = QuietSlots(tmp_path / "missing")
    writer.publish((0, bytes([1])))
    writer.publish((0, bytes([1, 1])))  # not tried again
    writer.close()


# ---------------------------------------------------------------- the loop


def test_the_loop_publishes_the_quiet_slots_and_reads_late_events_untimed(tmp_path: Path) -> None:
    board_path = tmp_path / "ends"
    EndBoard.create(board_path)
    clock = [10**12]
    config = LoopConfig(state_dir=tmp_path / "state", end_board_path=board_path)
    loop = ManagerLoop(open_device(cpu_devices(1)[0]), config, now_ns=lambda: clock[0])
    loop.listen_locally(LocalEvents(tmp_path / "ev"))
    sender = LocalEventSender(tmp_path / "ev")
    trainer = EndBoard.open(board_path, writable=True)
    try:
        loop.core.quiet_slots = lambda: (0, bytes([0, 1]))  # type: ignore[method-assign]
        loop.core.wants_trainer_events = lambda: True  # type: ignore[method-assign]  # a task could use slot 0
        loop._follow_local()
        assert trainer.quiet(0, 1) and not trainer.quiet(0, 0)
        now = clock[0]
        assert sender.send_start(0, 0, 1, 1, "fwd", now - 3 * MS, MS, -1, False, late=True)
        assert sender.send_end(0, 0, 1, 1, now - 2 * MS, late=True)
        assert sender.send_start(0, 0, 1, 0, "fwd", now - MS, MS, -1, False)
        for key, _ in loop._selector.select(1):
            key.data()
        assert loop.events_received == 3
        assert loop.event_delay.count == 1 and loop.events_late == 2  # the loud start timed, the held ones not
        assert loop.core.bubbles.open is not None and loop.core.bubbles.open.event.slot == 0
    finally:
        sender.close()
        trainer.close()
        loop.stop()
