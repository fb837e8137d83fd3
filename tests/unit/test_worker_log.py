"""A worker's log: rotated at its size limit, tail read across the rotation, never fatal."""

from __future__ import annotations

from pathlib import Path

import pytest

from freeride._manager.worker_log import CHUNK_BYTES, MIN_MAX_BYTES, WorkerLog

LIMIT = MIN_MAX_BYTES


def chunks(count: int, size: int = CHUNK_BYTES) -> list[bytes]:
    return [f"{i:08d}".encode().ljust(size, b".")[:size - 1] + b"\n" for i in range(count)]


def test_log_is_rotated_at_its_limit_and_keeps_that_many_backups(tmp_path: Path) -> None:
    log = WorkerLog(tmp_path / "worker.log", LIMIT, backups=2)
    for data in chunks(40):
        log.write(data)
    log.close()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["worker.log", "worker.log.1", "worker.log.2"]
    assert all((tmp_path / name).stat().st_size <= LIMIT for name in files)
    # The newest output is in worker.log, the one before in .1: nothing in between was lost.
    last = (tmp_path / "worker.log").read_bytes()
    before = (tmp_path / "worker.log.1").read_bytes()
    assert last.endswith(chunks(40)[-1]) and before.endswith(chunks(40)[-1 - len(last) // CHUNK_BYTES])


def test_without_backups_the_log_starts_over(tmp_path: Path) -> None:
    log = WorkerLog(tmp_path / "worker.log", LIMIT, backups=0)
    for data in chunks(10):
        log.write(data)
    log.close()
    assert [p.name for p in tmp_path.iterdir()] == ["worker.log"]
    assert (tmp_path / "worker.log").stat().st_size <= LIMIT


def test_tail_reads_across_the_rotation(tmp_path: Path) -> None:
    log = WorkerLog(tmp_path / "worker.log", LIMIT, backups=1)
    for data in chunks(4):
        log.write(data)
    log.write(b"last words\n")  # rotates first: the new log holds only this line
    assert (tmp_path / "worker.log").read_bytes() == b"last words\n"
    tail = log.tail(4096)
    assert len(tail) == 4096 and tail.endswith(".\nlast words\n")


def test_an_existing_log_is_appended_to_and_counted(tmp_path: Path) -> None:
    (tmp_path / "worker.log").write_bytes(b"y" * (LIMIT - 10))
    log = WorkerLog(tmp_path / "worker.log", LIMIT, backups=1)
    log.write(b"z" * 100)
    assert (tmp_path / "worker.log").read_bytes() == b"z" * 100
    assert (tmp_path / "worker.log.1").stat().st_size == LIMIT - 10


def test_a_log_reopened_after_its_directory_was_removed_and_made_again_is_written_there(tmp_path: Path) -> None:
    (tmp_path / "task").mkdir()
    log = WorkerLog(tmp_path / "task" / "worker.log", LIMIT, backups=1)
    log.write(b"before\n")
    (tmp_path / "task" / "worker.log").unlink()
    (tmp_path / "task").rmdir()  # the state directory removed under the manager...
    (tmp_path / "task").mkdir()  # ...and made again
    log.write(b"lost\n")  # the open file is the removed one
    log.reopen()
    log.write(b"after\n")
    assert (tmp_path / "task" / "worker.log").read_bytes() == b"after\n"


def test_a_log_that_cannot_be_written_drops_its_lines_without_raising(tmp_path: Path) -> None:
    log = WorkerLog(tmp_path / "missing-dir" / "worker.log", LIMIT, backups=1)
    log.write(b"lost\n")
    assert log.dropped_bytes == 5
    assert log.tail(100) == ""


@pytest.mark.parametrize(("max_bytes", "backups"), [(1024, 1), (LIMIT, -1), (LIMIT, 101)])
def test_limits_are_checked(tmp_path: Path, max_bytes: int, backups: int) -> None:
    with pytest.raises(ValueError):
        WorkerLog(tmp_path / "worker.log", max_bytes, backups)
