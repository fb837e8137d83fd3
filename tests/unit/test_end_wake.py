"""The trainer's end wake (``freeride._boards.EndWake``) and the loop's exact timer (``_manager/timer.py``)."""

from __future__ import annotations

import os
import select
import time
from pathlib import Path

from freeride._boards import EndWake, EndWakeSender, WorkerBoard
from freeride._manager import core as C
from freeride._manager.ends import EndPath
from freeride._manager.timer import make_timer

KEY = (1, 0, 5, 2)


def test_a_wake_carries_its_end_whole_and_malformed_datagrams_are_counted(tmp_path: Path) -> None:
    wake = EndWake(tmp_path / "w")
    sender = EndWakeSender(tmp_path / "w")
    sender.send(0, 1_000, 2_000)
    sender._sock.send(b"garbage")
    sender.send(0, 1_000, 999)  # an end before its start
    assert wake.read() == [(0, 1_000, 2_000)]
    assert wake.malformed == 2 and wake.read() == []
    assert oct(os.stat(tmp_path / "w").st_mode & 0o777) == "0o600"
    wake.close()
    assert not (tmp_path / "w").exists()


def test_sending_to_a_manager_that_died_or_fell_behind_never_raises(tmp_path: Path) -> None:
    wake = EndWake(tmp_path / "w")
    sender = EndWakeSender(tmp_path / "w")
    for _ in range(5000):  # far past the socket's queue: the extra wakes are dropped, counted
        sender.send(0, 1, 2)
    assert sender.dropped > 0
    wake.close()  # the manager is gone
    dropped = sender.dropped
    sender.send(0, 1, 2)
    assert sender.dropped == dropped + 1


def test_only_the_published_grants_bubble_becomes_an_end_seen_and_sets_its_word(tmp_path: Path) -> None:
    path = EndPath(lambda: 0)
    assert path.woken([(0, 1_000, 2_000)]) == []  # nothing published
    board = WorkerBoard.create(tmp_path / "board")
    path.granted("t", 7, KEY, start_ns=1_000, board=board)
    assert path.woken([(1, 1_000, 2_000), (0, 900, 2_000)]) == []  # another rank, another bubble
    assert board.ended_grant() < 7
    assert path.woken([(0, 1_000, 2_000)]) == [C.TrainerEndSeen("t", 7, 2_000)]
    assert (board.ended_grant(), board.ended_at_ns()) == (7, 2_000)
    board.close()  # the worker died and was reaped while armed: the wake is still answered
    assert path.woken([(0, 1_000, 2_000)]) == [C.TrainerEndSeen("t", 7, 2_000)]


def test_the_timer_wakes_a_select_at_its_time_not_at_the_next_millisecond() -> None:
    timer = make_timer()
    assert timer is not None
    try:
        assert select.select([timer], [], [], 0)[0] == []
        timer.arm(time.monotonic_ns() - 1)  # past: readable at once
        assert select.select([timer], [], [], 1)[0] == [timer]
        timer.clear()
        timer.arm(time.monotonic_ns() + 3_600 * 10**9)
        assert select.select([timer], [], [], 0)[0] == []
        timer.arm(None)  # disarmed
        assert select.select([timer], [], [], 0)[0] == []
    finally:
        timer.close()
