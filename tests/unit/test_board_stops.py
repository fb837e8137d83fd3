"""The end board's stop records (:mod:`freeride._boards`): on a ``cpu:N`` device the trainer stops, at its own
end, the side-task step still running in the bubble the manager armed, and claims the stop for the manager.

A real process in its own session stands in for the worker: what is checked is whether it is stopped
(``/proc/<pid>/stat``), not what a call returned alone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import wait_for

from freeride._boards import END_RECORDS_BYTES, QUIET_SLOTS_END, EndBoard
from freeride._task_process import process_state as state

RANK, START = 3, 1_000


@pytest.fixture
def worker() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    yield proc
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@pytest.fixture
def boards(tmp_path: Path) -> Iterator[tuple[EndBoard, EndBoard, EndBoard]]:
    """The manager's, the worker's and the trainer's mappings of one board."""
    path = tmp_path / "ends"
    EndBoard.create(path)
    maps = (EndBoard.open(path, writable=True), EndBoard.open(path, writable=True), EndBoard.open(path, writable=True))
    yield maps
    for board in maps:
        board.close()


def test_the_trainer_stops_a_step_running_at_the_end_of_the_armed_bubble_and_claims_when(
        boards: tuple[EndBoard, EndBoard, EndBoard], worker: subprocess.Popen[bytes]) -> None:
    manager, in_worker, trainer = boards
    manager.arm_stop(RANK, START, worker.pid, holding=False)
    in_worker.set_holding(RANK, True)
    before = time.monotonic_ns()
    assert trainer.stop_at_end(RANK, START) == worker.pid
    wait_for(lambda: state(worker.pid) == "T", 5, what="the worker to be stopped")
    claimed = manager.disarm_stop(RANK, worker.pid)
    assert before <= claimed <= time.monotonic_ns()
    # Taken back: the record no longer names the bubble, so no later end stops anything.
    os.killpg(worker.pid, signal.SIGCONT)
    assert trainer.stop_at_end(RANK, START) == 0


def test_a_worker_that_parked_or_another_bubble_or_rank_is_not_stopped(
        boards: tuple[EndBoard, EndBoard, EndBoard], worker: subprocess.Popen[bytes]) -> None:
    manager, in_worker, trainer = boards
    manager.arm_stop(RANK, START, worker.pid)
    in_worker.set_holding(RANK, True)
    in_worker.set_holding(RANK, False)  # it parked before the end
    assert trainer.stop_at_end(RANK, START) == 0
    in_worker.set_holding(RANK, True)
    assert trainer.stop_at_end(RANK, START + 1) == 0  # the end of another bubble
    assert trainer.stop_at_end(RANK + 1, START) == 0  # of another rank
    assert state(worker.pid) != "T"
    assert manager.disarm_stop(RANK, worker.pid) == 0  # nothing was claimed


def test_a_worker_letting_go_of_its_bubble_late_leaves_a_later_grants_record_holding(
        boards: tuple[EndBoard, EndBoard, EndBoard], worker: subprocess.Popen[bytes]) -> None:
    # A worker starved between its park report and letting go: the manager armed its next grant meanwhile.
    manager, in_worker, trainer = boards
    manager.arm_stop(RANK, START, worker.pid)
    manager.disarm_stop(RANK, worker.pid)  # the park reached the manager
    manager.arm_stop(RANK, START + 5, worker.pid)  # and the next bubble's grant went out
    in_worker.let_go(RANK, START)  # the first grant's, late
    assert trainer.stop_at_end(RANK, START + 5) == worker.pid
    wait_for(lambda: state(worker.pid) == "T", 5, what="the worker to be stopped")
    os.killpg(worker.pid, signal.SIGCONT)
    manager.disarm_stop(RANK, worker.pid)
    # On time, it lets go of the bubble it parked in.
    manager.arm_stop(RANK, START + 9, worker.pid)
    in_worker.let_go(RANK, START + 9)
    assert trainer.stop_at_end(RANK, START + 9) == 0


def test_a_worker_is_held_from_its_grant_on_before_its_first_step_and_in_a_step_it_was_stopped_in(
        boards: tuple[EndBoard, EndBoard, EndBoard], worker: subprocess.Popen[bytes]) -> None:
    # A grant that thaws a step stopped mid-way: the worker set nothing for it (it was stopped); the manager does.
    manager, _, trainer = boards
    manager.arm_stop(RANK, START, worker.pid)
    assert trainer.stop_at_end(RANK, START) == worker.pid
    wait_for(lambda: state(worker.pid) == "T", 5, what="the worker to be stopped")


def test_a_record_armed_again_for_another_worker_is_not_taken_back_by_the_first(
        boards: tuple[EndBoard, EndBoard, EndBoard], worker: subprocess.Popen[bytes]) -> None:
    manager, _, trainer = boards
    manager.arm_stop(RANK, START, 4_000_000, holding=True)  # a pid beyond any pid_max: never stopped
    manager.arm_stop(RANK, START + 5, worker.pid, holding=True)
    assert manager.disarm_stop(RANK, 4_000_000) == 0
    assert trainer.stop_at_end(RANK, START + 5) == worker.pid


def test_a_worker_that_is_gone_is_not_claimed_stopped(boards: tuple[EndBoard, EndBoard, EndBoard]) -> None:
    manager, _, trainer = boards
    proc = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    proc.wait()  # reaped: its pid names nothing (here the manager would have taken the record back first)
    manager.arm_stop(RANK, START, proc.pid, holding=True)
    assert trainer.stop_at_end(RANK, START) == 0


def test_an_older_managers_board_without_stop_records_maps_and_keeps_its_end_records(tmp_path: Path) -> None:
    path = tmp_path / "ends"
    path.write_bytes(bytes(END_RECORDS_BYTES))
    board = EndBoard.open(path, writable=True)
    try:
        assert not board.stops
        board.record_end(RANK, START, START + 7)
        assert board.ended_ns(RANK, START) == START + 7
    finally:
        board.close()
    path.write_bytes(bytes(END_RECORDS_BYTES - 8))
    with pytest.raises(OSError, match="shorter"):
        EndBoard.open(path, writable=False)


def test_a_trainer_in_another_pid_namespace_stops_nothing(tmp_path: Path) -> None:
    # A trainer in a container of its own (a sidecar manager sharing only the socket's volume): the manager's pids
    # name other processes there. The board says the manager's namespace; a trainer elsewhere leaves stops be.
    import struct

    from freeride._boards import STOP_RECORDS_END

    path = tmp_path / "ends"
    EndBoard.create(path)
    board = EndBoard.open(path, writable=True)
    assert board.stops
    board.close()
    with open(path, "r+b") as fh:
        fh.seek(STOP_RECORDS_END - 16)
        fh.write(struct.pack("<qq", 1, 2))  # another namespace's
    trainer = EndBoard.open(path, writable=True)
    try:
        assert not trainer.stops  # what the reporter checks before it reads a stop record
    finally:
        trainer.close()


def test_a_command_tasks_command_is_stopped_with_its_worker_and_a_later_python_grant_stops_no_group(
        boards: tuple[EndBoard, EndBoard, EndBoard], worker: subprocess.Popen[bytes]) -> None:
    # A command task's command runs in a process group of its own: stopped with the worker alone, a slice in
    # flight ran on past the end until the manager froze the group.
    manager, in_worker, trainer = boards
    command = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        manager.arm_stop(RANK, START, worker.pid, group=command.pid)
        in_worker.set_holding(RANK, True)
        assert trainer.stop_at_end(RANK, START) == worker.pid
        wait_for(lambda: state(worker.pid) == "T" and state(command.pid) == "T", 5, what="both groups stopped")
        manager.disarm_stop(RANK, worker.pid)
        for pid in (worker.pid, command.pid):
            os.killpg(pid, signal.SIGCONT)
        wait_for(lambda: state(command.pid) != "T", 5, what="the command continued")
        manager.arm_stop(RANK, START + 5, worker.pid)  # a grant without a command: the old group is not named
        in_worker.set_holding(RANK, True)
        assert trainer.stop_at_end(RANK, START + 5) == worker.pid
        wait_for(lambda: state(worker.pid) == "T", 5, what="the worker stopped")
        assert state(command.pid) != "T"
    finally:
        os.killpg(command.pid, signal.SIGKILL)
        command.wait()


def test_an_older_managers_board_without_command_groups_stops_the_worker_alone(
        tmp_path: Path, worker: subprocess.Popen[bytes]) -> None:
    path = tmp_path / "ends"
    EndBoard.create(path)
    with open(path, "r+b") as fh:
        fh.truncate(QUIET_SLOTS_END)  # as an older manager made it: the quiet slots last
    manager, trainer = EndBoard.open(path, writable=True), EndBoard.open(path, writable=True)
    command = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        assert manager.has_quiet and not manager.has_groups
        manager.arm_stop(RANK, START, worker.pid, group=command.pid)  # nowhere to write the group: not written
        assert trainer.stop_at_end(RANK, START) == worker.pid
        wait_for(lambda: state(worker.pid) == "T", 5, what="the worker stopped")
        assert state(command.pid) != "T"
    finally:
        os.killpg(command.pid, signal.SIGKILL)
        command.wait()
        manager.close()
        trainer.close()


def test_a_cpu_trainers_thread_is_said_per_rank_and_an_older_board_says_none(tmp_path: Path) -> None:
    from freeride._boards import GROUPS_END

    path = tmp_path / "ends"
    EndBoard.create(path)
    trainer, worker = EndBoard.open(path, writable=True), EndBoard.open(path, writable=False)
    try:
        assert worker.trainer_thread(RANK) == 0
        trainer.set_trainer_thread(RANK, 4321)
        assert worker.trainer_thread(RANK) == 4321 and worker.trainer_thread(RANK + 1) == 0
    finally:
        trainer.close()
        worker.close()
    with open(path, "r+b") as fh:
        fh.truncate(GROUPS_END)  # as an older manager made it: the command groups last
    older = EndBoard.open(path, writable=True)
    try:
        assert not older.has_threads
        older.set_trainer_thread(RANK, 4321)  # nowhere to write it
        assert older.trainer_thread(RANK) == 0
    finally:
        older.close()


def test_a_threads_state_reads_runnable_only_while_it_runs_or_waits_for_a_core() -> None:
    import threading

    from freeride._boards import ThreadState

    here = ThreadState(threading.get_native_id())
    assert here.runnable()  # this thread, reading: running
    here.close()
    asleep = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        state = ThreadState(asleep.pid)
        wait_for(lambda: not state.runnable(), 10, what="the process asleep")
        asleep.kill()
        asleep.wait()
        assert not state.runnable()  # gone
        state.close()
    finally:
        if asleep.poll() is None:
            asleep.kill()
            asleep.wait()
    assert not ThreadState(2**31 - 1).runnable()  # no such thread
