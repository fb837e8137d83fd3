"""The end fast path on its own: a trainer's end sets the word of the worker holding that bubble, and only
that one, before the loop sees the end."""

from __future__ import annotations

from pathlib import Path

from freeride._boards import WorkerBoard
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
