"""A board file is replaced, never reset in place: a process still mapping the old one must live.

Regression: a manager killed with SIGKILL and restarted re-made its end board with ``O_TRUNC`` on the
same inode, which the trainer's reporter still mapped; a trainer's store that fell between the truncate
and the write was a SIGBUS, and the training rank died.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from freeride._boards import END_BOARD_BYTES, EndBoard, WorkerBoard, read_step

REPO = Path(__file__).resolve().parents[2]

#: A "trainer": maps the board and records ends without a pause until told to stop on stdin.
TRAINER = """
import os, sys, threading
from pathlib import Path
from freeride._boards import EndBoard
board = EndBoard.open(Path(sys.argv[1]), writable=True)
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
print("mapped", flush=True)
i = 0
while not stop.is_set():
    i += 1
    board.record_end(3, i, i + 1)
print("recorded", i, flush=True)
"""


def test_a_trainer_mapping_the_end_board_survives_a_restarted_manager_remaking_it(tmp_path: Path) -> None:
    path = tmp_path / "manager.sock.ends"
    EndBoard.create(path)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, str(path)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert trainer.stdout is not None and trainer.stdout.readline() == "mapped\n"
        for _ in range(300):  # each, a restarted manager's board (the truncating version died within a few)
            EndBoard.create(path)
            assert trainer.poll() is None, f"the trainer died: {signal.Signals(-trainer.returncode).name}"
        out, _ = trainer.communicate("stop", timeout=30)
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
    assert trainer.returncode == 0 and out.startswith("recorded")


def test_a_remade_end_board_starts_empty_while_the_old_mapping_keeps_its_records(tmp_path: Path) -> None:
    path = tmp_path / "manager.sock.ends"
    EndBoard.create(path)
    old = EndBoard.open(path, writable=True)
    old.record_end(1, 100, 150)
    EndBoard.create(path)
    new = EndBoard.open(path, writable=False)
    try:
        assert new.ended_ns(1, 100) == 0  # the new manager's board knows nothing of the old one's bubbles
        assert old.ended_ns(1, 100) == 150
        assert path.stat().st_size == END_BOARD_BYTES and path.stat().st_mode & 0o777 == 0o600
        assert [p.name for p in tmp_path.iterdir()] == [path.name]  # nothing left aside
    finally:
        old.close()
        new.close()


def test_a_remade_worker_board_starts_at_step_minus_one_while_the_old_mapping_keeps_its_step(tmp_path: Path) -> None:
    path = tmp_path / "board"
    old = WorkerBoard.create(path)
    old.publish_step(41)
    new = WorkerBoard.create(path)
    try:
        assert read_step(path) == -1 and new.step() == -1
        assert old.step() == 41
    finally:
        old.close()
        new.close()


def test_the_workers_read_of_an_end_takes_a_later_bubble_of_the_rank_as_the_end_of_an_earlier_one(
        tmp_path: Path) -> None:
    EndBoard.create(tmp_path / "ends")
    board = EndBoard.open(tmp_path / "ends", writable=True)
    try:
        assert board.ended_by_ns(1, 100) == 0  # nothing written yet
        board.record_end(1, 100, 150)
        assert board.ended_by_ns(1, 100) == 150 and board.ended_by_ns(1, 200) == 0
        board.record_end(1, 200, 260)
        assert board.ended_by_ns(1, 100) == 200  # over before the later bubble began
        assert board.ended_ns(1, 100) == 0  # the manager's read names only the bubble's own end
        assert board.ended_by_ns(2, 100) == 0  # another rank's record says nothing
    finally:
        board.close()
