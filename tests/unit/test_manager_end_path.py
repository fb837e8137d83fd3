"""The end fast path on its own: a trainer's end sets the word of the worker holding that bubble, and only
that one, before the loop sees the end."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from freeride._boards import EndBoard, WorkerBoard
from freeride._manager.ends import EndPath
from freeride.messages import BubbleEnd, BubbleStart

KEY = (1, 0, 5, 2)


def end(key: tuple[int, int, int, int] = KEY, end_ns: int = 2_000) -> BubbleEnd:
    return BubbleEnd(*key, end_ns=end_ns)


def test_the_end_of_the_published_grants_bubble_sets_its_word_and_is_timed(tmp_path: Path) -> None:
    clock = iter([10_500])
    path = EndPath(lambda: next(clock))
    board = WorkerBoard.create(tmp_path / "board")
    path.granted("t", 7, KEY, start_ns=1_000, board=board)
    path.trainer_events([BubbleStart(*KEY, "k", 1_000, 5, -1), end()], received_ns=10_000)
    assert (board.ended_grant(), board.ended_at_ns()) == (7, 2_000)
    assert path.end_to_worker_ms().count == 1


def test_other_bubbles_ends_before_its_start_and_reported_grants_set_nothing(tmp_path: Path) -> None:
    path = EndPath(lambda: 0)
    board = WorkerBoard.create(tmp_path / "board")
    path.granted("t", 7, KEY, start_ns=1_000, board=board)
    path.trainer_events([end((1, 0, 6, 2)), end(end_ns=999)], received_ns=0)
    assert board.ended_grant() < 7
    path.reported(7)  # the worker parked and said so: the bubble is no longer held
    path.trainer_events([end()], received_ns=0)
    assert board.ended_grant() < 7 and path.end_to_worker_ms().count == 0


def test_a_grant_without_a_board_is_not_published_and_the_cores_park_sets_the_word_again(tmp_path: Path) -> None:
    path = EndPath(lambda: 500)
    path.granted("t", 3, KEY, start_ns=0, board=None)
    path.trainer_events([end()], received_ns=0)  # nothing published: nothing to do, nothing raised
    board = WorkerBoard.create(tmp_path / "board")
    path.parked(board, 3, end_ns=400, end_received_ns=100)
    assert board.ended_grant() == 3 and path.end_to_worker_ms().count == 1
    path.parked(board, 3, end_ns=400, end_received_ns=100)  # the same word again: no second timing
    assert path.end_to_worker_ms().count == 1


def test_a_local_end_carries_when_the_workers_running_step_began_from_its_board(tmp_path: Path) -> None:
    from freeride._manager.core import TrainerEndSeen

    path = EndPath(lambda: 3_000)
    board = WorkerBoard.create(tmp_path / "board")
    path.granted("t", 7, KEY, start_ns=1_000, board=board)
    board.publish_step(4, began_ns=1_800)  # the worker, before its step
    assert path.local_end(end(), received_ns=2_500) == [TrainerEndSeen("t", 7, 2_000, 1_800)]
    board.publish_done(5)  # between steps: no step runs, so none is said to have begun
    path.granted("t", 8, KEY, start_ns=1_000, board=board)
    assert path.local_end(end(), received_ns=2_500) == [TrainerEndSeen("t", 8, 2_000, 0)]
    assert board.step() == 4 and board.steps_done() == 5


# ---------------------------------------------------------------- the trainer's stops (cpu:N)


class Stopped:
    """What the loop is told of each stop the trainer made (the supervisor's ``stopped_by_trainer``)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def __call__(self, task_id: str, at_ns: int) -> None:
        self.calls.append((task_id, at_ns))


def stopping_path(tmp_path: Path) -> tuple[EndPath, EndBoard, Stopped]:
    ends = tmp_path / "ends"
    EndBoard.create(ends)
    told = Stopped()
    return EndPath(lambda: 3_000, ends, told), EndBoard.open(ends, writable=True), told


@pytest.fixture
def sleeper() -> Iterator[int]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    yield proc.pid
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def test_a_step_the_trainer_stopped_at_its_end_is_said_seen_with_the_stops_time_and_told_at_once(
        tmp_path: Path, sleeper: int) -> None:
    from freeride._manager.core import TrainerEndSeen

    path, trainer, told = stopping_path(tmp_path)
    board = WorkerBoard.create(tmp_path / "board")
    path.arm_stop("t", 7, KEY, 1_000, sleeper)
    path.granted("t", 7, KEY, start_ns=1_000, board=board)
    trainer.set_holding(KEY[1], True)  # the worker, as its step begins
    trainer.record_end(KEY[1], 1_000, 2_000)
    assert trainer.stop_at_end(KEY[1], 1_000) == sleeper
    [seen] = path.local_end(end(), received_ns=2_500)
    assert seen.stopped_ns > 0 and seen == TrainerEndSeen("t", 7, 2_000, 0, stopped_ns=seen.stopped_ns)
    assert told.calls == [("t", seen.stopped_ns)] and path.trainer_stops == 1
    assert trainer.stop_at_end(KEY[1], 1_000) == 0  # spent: the record was taken back with the end


def test_an_end_after_the_worker_parked_takes_the_record_back_and_says_no_stop(tmp_path: Path, sleeper: int) -> None:
    from freeride._manager.core import TrainerEndSeen

    path, trainer, told = stopping_path(tmp_path)
    board = WorkerBoard.create(tmp_path / "board")
    path.arm_stop("t", 7, KEY, 1_000, sleeper)
    path.granted("t", 7, KEY, start_ns=1_000, board=board)
    trainer.set_holding(KEY[1], False)  # the worker, right before it reports its park
    assert trainer.stop_at_end(KEY[1], 1_000) == 0
    assert path.local_end(end(), received_ns=2_500) == [TrainerEndSeen("t", 7, 2_000, 0)]
    assert told.calls == []


def test_a_stop_claimed_for_a_worker_that_parked_first_is_told_when_its_grant_is_taken_back(
        tmp_path: Path, sleeper: int) -> None:
    # The worker's park report reached the loop before the trainer's end: the stop is not lost with the record, so
    # the supervisor continues the worker before its next message.
    path, trainer, told = stopping_path(tmp_path)
    path.arm_stop("t", 7, KEY, 1_000, sleeper)
    assert trainer.stop_at_end(KEY[1], 1_000) == sleeper
    path.reported(7)
    assert [tid for tid, _ in told.calls] == ["t"]
    assert path.local_end(end(), received_ns=2_500) == []  # no grant of it is held any more


def test_an_end_from_the_wire_is_said_seen_only_where_the_trainer_stopped_the_step(
        tmp_path: Path, sleeper: int) -> None:
    path, trainer, _ = stopping_path(tmp_path)
    path.arm_stop("t", 7, KEY, 1_000, sleeper)
    assert path.stopped_end(end((1, 0, 6, 2))) == []  # another bubble's
    trainer.set_holding(KEY[1], True)
    trainer.stop_at_end(KEY[1], 1_000)
    [seen] = path.stopped_end(end())
    assert (seen.task_id, seen.grant_id, seen.end_ns) == ("t", 7, 2_000) and seen.stopped_ns > 0


def test_a_worker_about_to_be_reaped_and_a_frozen_one_are_no_longer_stopped_by_the_trainer(
        tmp_path: Path, sleeper: int) -> None:
    path, trainer, told = stopping_path(tmp_path)
    path.arm_stop("t", 7, KEY, 1_000, sleeper)
    path.forget_pid(sleeper + 1)  # another worker's: this record stays
    path.forget_pid(sleeper)
    assert trainer.stop_at_end(KEY[1], 1_000) == 0
    path.arm_stop("t", 8, KEY, 1_500, sleeper)
    path.grant_over("t")
    assert trainer.stop_at_end(KEY[1], 1_500) == 0
    path.arm_stop("t", 9, KEY, 1_700, sleeper)
    path.close()  # a manager stopping takes its last record back before it kills its workers
    assert trainer.stop_at_end(KEY[1], 1_700) == 0 and told.calls == []


def test_no_stop_is_armed_without_a_board_with_stop_records(tmp_path: Path, sleeper: int) -> None:
    from freeride._boards import END_RECORDS_BYTES

    EndPath(lambda: 0).arm_stop("t", 7, KEY, 1_000, sleeper)  # no board: nothing to do, nothing raised
    old = tmp_path / "old-ends"
    old.write_bytes(bytes(END_RECORDS_BYTES))  # an older manager's size: no stop records
    EndPath(lambda: 0, old).arm_stop("t", 7, KEY, 1_000, sleeper)
    EndPath(lambda: 0, tmp_path / "missing").arm_stop("t", 7, KEY, 1_000, sleeper)


def test_a_stop_the_trainer_made_is_read_off_its_board_before_the_cores_own_freeze_without_its_end_message(
        tmp_path: Path, sleeper: int) -> None:
    from freeride._manager.core import TrainerEndSeen

    path, trainer, told = stopping_path(tmp_path)
    board = WorkerBoard.create(tmp_path / "board")
    path.arm_stop("t", 7, KEY, 1_000, sleeper)
    path.granted("t", 7, KEY, start_ns=1_000, board=board)
    assert path.stopped_before_freeze() == []  # not stopped: the record stays armed for the trainer
    trainer.record_end(KEY[1], 1_000, 2_000)
    assert trainer.stop_at_end(KEY[1], 1_000) == sleeper
    [seen] = path.stopped_before_freeze()
    assert seen == TrainerEndSeen("t", 7, 2_000, 0, stopped_ns=seen.stopped_ns) and seen.stopped_ns > 0
    assert told.calls == [("t", seen.stopped_ns)] and path.trainer_stops == 1
    assert path.stopped_before_freeze() == [] and path.local_end(end(), received_ns=2_500) == [
        TrainerEndSeen("t", 7, 2_000, 0)]  # the end's message, read later, books no second stop


def test_a_stop_whose_end_record_a_later_bubble_overwrote_is_said_seen_at_the_stop(tmp_path: Path,
                                                                                  sleeper: int) -> None:
    path, trainer, _ = stopping_path(tmp_path)
    path.arm_stop("t", 7, KEY, 1_000, sleeper)
    trainer.record_end(KEY[1], 1_000, 2_000)
    trainer.stop_at_end(KEY[1], 1_000)
    trainer.record_end(KEY[1], 3_000, 3_500)  # the rank's next bubble, over too before the manager woke
    [seen] = path.stopped_before_freeze()
    assert seen.end_ns == seen.stopped_ns > 0
