"""The task store: refused writes change nothing and say why; an unwritable directory is refused at open."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import pytest

from freeride._manager.store import TaskStore
from freeride.errors import ConfigError, StateNotWritable
from freeride.messages import FailureRecord, TaskSpec
from freeride.states import TaskState

SPEC = TaskSpec(target="pkg.mod:Task", memory_bytes=2**20)


def refuse_writes(store: TaskStore, refuse: bool = True) -> None:
    """SQLite's read-only switch: every write then fails as on a read-only or failing disk."""
    store._db.execute(f"PRAGMA query_only = {'ON' if refuse else 'OFF'}")


def test_refused_submission_leaves_no_half_written_row(tmp_path: Path) -> None:
    store = TaskStore(tmp_path / "tasks.db")
    store.add(SPEC)
    refuse_writes(store)
    with pytest.raises(StateNotWritable, match=f"state directory {tmp_path} not writable: attempt to write"):
        store.add(SPEC)
    refuse_writes(store, False)
    assert [t.task_id for t in store.all()] == ["task-1"]
    assert store.add(SPEC).task_id == "task-2"


def test_regression_submission_is_one_transaction_so_no_pending_row_survives_a_failed_rename(tmp_path: Path) -> None:
    store = TaskStore(tmp_path / "tasks.db")
    # The second statement of add() fails as a write to a full disk would; the first must go with it.
    def disk_full() -> None:
        raise OSError(28, "No space left on device")

    store._db.create_function("disk_full", 0, disk_full)
    store._db.execute("CREATE TEMP TRIGGER no_rename BEFORE UPDATE OF task_id ON tasks BEGIN SELECT disk_full(); END")
    with pytest.raises(StateNotWritable):
        store.add(SPEC)
    assert store.all() == []


def test_refused_state_change_is_rolled_back_and_the_store_works_again(tmp_path: Path) -> None:
    store = TaskStore(tmp_path / "tasks.db")
    task = store.add(SPEC)
    refuse_writes(store)
    failure = FailureRecord(kind="EXCEPTION", message="boom")
    with pytest.raises(StateNotWritable):
        store.set_state(task.task_id, TaskState.FAILED, failure)
    with pytest.raises(StateNotWritable):
        store.record_checkpoint(task.task_id, 7, "/x/ckpt-7.pt", 7.0)
    assert not store._db.in_transaction
    refuse_writes(store, False)
    assert store.get(task.task_id).state == TaskState.SUBMITTED  # type: ignore[union-attr]
    store.set_state(task.task_id, TaskState.FAILED, failure)
    assert store.get(task.task_id).failure == failure  # type: ignore[union-attr]


def test_a_checkpoint_keeps_the_progress_unit_and_overruns_and_none_leaves_those_recorded(tmp_path: Path) -> None:
    store = TaskStore(tmp_path / "tasks.db")
    task = store.add(SPEC)
    store.record_checkpoint(task.task_id, 7, "/x/ckpt-7.pt", 70.0, 1.5, progress_unit="images", overruns=3)
    store.record_checkpoint(task.task_id, 8, "/x/ckpt-8.pt", 80.0, 1.6)
    figures = store.get(task.task_id).figures  # type: ignore[union-attr]
    assert (figures.checkpoint_step, figures.progress, figures.progress_unit, figures.overruns) == (
        8, 80.0, "images", 3)


def test_store_that_cannot_be_written_is_refused_at_open(tmp_path: Path) -> None:
    path = tmp_path / "tasks.db"
    TaskStore(path).close()
    db = sqlite3.connect(path)
    db.execute("PRAGMA journal_mode=DELETE")  # so that only the database file itself matters
    db.close()
    if os.geteuid() == 0:
        pytest.skip("root writes read-only files")
    path.chmod(0o400)
    try:
        with pytest.raises(ConfigError, match=f"state directory {tmp_path} is not writable"):
            TaskStore(path)
    finally:
        path.chmod(0o600)


def test_state_directory_that_is_a_file_is_refused_at_open(tmp_path: Path) -> None:
    (tmp_path / "state").write_text("not a directory")
    with pytest.raises(ConfigError, match="is not writable"):
        TaskStore(tmp_path / "state" / "tasks.db")
