"""Durability on its own, over a real store: refused writes are kept and retried, submissions wait for the
disk, only what matters after a restart is written, and a restart recovers from the newest checkpoint."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from freeride._manager import core as C
from freeride._manager.durability import Durability, stamped
from freeride._manager.paths import TaskPaths
from freeride._manager.state_lock import LOCK_NAME, StateDirLock
from freeride._manager.store import TaskStore
from freeride.errors import ConfigError, StateNotWritable
from freeride.messages import FailureRecord, TaskProgress, TaskSpec
from freeride.states import TaskState

SPEC = TaskSpec(target="m:C", memory_bytes=2**20, name="c")
RETRY_NS = 1_000_000_000


class Clock:
    now = 5_000_000_000

    def __call__(self) -> int:
        return self.now


@pytest.fixture
def durable(tmp_path: Path) -> Iterator[tuple[Durability, Clock]]:
    clock = Clock()
    d = Durability(TaskStore(tmp_path / "tasks.db"), retry_ms=RETRY_NS / 1e6, device="cpu:0", now_ns=clock)
    yield d, clock
    d.close()


def refuse(d: Durability, refused: bool) -> None:
    d.store._db.execute(f"PRAGMA query_only = {'ON' if refused else 'OFF'}")


def test_a_refused_write_is_kept_submissions_wait_for_the_disk_and_the_timer_writes_it_later(
    durable: tuple[Durability, Clock],
) -> None:
    d, clock = durable
    record = d.submit(SPEC)
    assert d.records[record.task_id] == record and record.state == "SUBMITTED"
    refuse(d, True)
    d.write(record.task_id, "progress", lambda: d.store.record_progress(record.task_id, TaskProgress(steps=3)))
    d.write(record.task_id, "progress", lambda: d.store.record_progress(record.task_id, TaskProgress(steps=7)))
    assert d.fault and d.next_timer_ns() == clock.now + RETRY_NS
    with pytest.raises(StateNotWritable, match="the task was not submitted"):
        d.submit(SPEC)
    refuse(d, False)
    d.poll(clock.now + RETRY_NS - 1)
    assert d.fault and d.store.get(record.task_id).steps == 0  # type: ignore[union-attr]
    d.poll(clock.now + RETRY_NS)
    assert not d.fault and d.next_timer_ns() is None
    assert d.store.get(record.task_id).steps == 7  # type: ignore[union-attr]  # the latest write only


def test_only_changes_that_matter_after_a_restart_are_written(durable: tuple[Durability, Clock]) -> None:
    d, _ = durable
    tid = d.submit(SPEC).task_id
    task = C.TaskRuntime(tid, SPEC, 1, steps=9, harvested_ns=1_500_000_000)
    d.state_changed(C.StateChanged(tid, TaskState.PARKED, TaskState.RUNNING, "granted"), task)
    assert d.store.get(tid).state == "SUBMITTED"  # type: ignore[union-attr]
    failure = FailureRecord(kind="EXIT", message="exit 3", at_unix_s=1.0)
    d.state_changed(C.StateChanged(tid, TaskState.RUNNING, TaskState.FAILED, "exited", failure), task)
    stored = d.store.get(tid)
    assert stored is not None and (stored.state, stored.steps, stored.harvested_s) == ("FAILED", 9, 1.5)
    assert stored.failure == failure


def test_a_restart_recovers_live_tasks_from_the_newest_checkpoint_file_and_leaves_ended_ones(
    durable: tuple[Durability, Clock], tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="freeride")
    d, _ = durable
    live, ended = d.submit(SPEC).task_id, d.submit(SPEC).task_id
    d.store.set_state(live, TaskState.PARKED)
    d.store.record_checkpoint(live, 4, "/old/ckpt-4.pt", 4.0)
    d.store.set_state(ended, TaskState.FINISHED)
    paths = TaskPaths(tmp_path, None, lambda tid: False)
    checkpoints = paths.task_dir(live) / "checkpoints"
    checkpoints.mkdir(parents=True)
    (checkpoints / "ckpt-6.pt").write_bytes(b"whole")  # written, not yet recorded, when the manager died
    again = Durability(d.store, 1000.0, "cpu:0")
    [added] = again.recover(paths)
    assert (added.task_id, added.checkpoint_path, added.checkpoint_step, added.steps, added.restarts) == (
        live, str(checkpoints / "ckpt-6.pt"), 6, 6, 1)
    assert set(again.records) == {live, ended} and d.store.get(live).state == "SUBMITTED"  # type: ignore[union-attr]
    # said once, with where they came from (a stranger's first manager listed someone's earlier tasks, unsaid)
    assert f"1 task(s) from {tmp_path} start again" in caplog.text
    # at a level the CLI shows by default (WARNING): a user's first manager on an old directory runs those tasks
    assert [r.levelno for r in caplog.records if "start again" in r.getMessage()] == [logging.WARNING]


def test_a_failure_the_core_decided_is_completed_with_the_time_the_boards_step_and_the_log() -> None:
    bare = FailureRecord(kind="MEMORY_LIMIT", message="over its cap", step=0)
    done = stamped(bare, step=3, log_tail=lambda: "tail")
    assert (done.step, done.log_tail, done.kind) == (3, "tail", "MEMORY_LIMIT") and done.at_unix_s > 0
    assert stamped(bare, step=-1, log_tail=lambda: "").step == 0  # no board: the core's step stands


# ---------------------------------------------------------------- the state directory removed under the manager


@pytest.fixture
def homed(tmp_path: Path) -> Iterator[tuple[Durability, StateDirLock, Path]]:
    state = tmp_path / "state"
    lock = StateDirLock(state, "unix:/tmp/test.sock")
    d = Durability(TaskStore(state / "tasks.db"), retry_ms=RETRY_NS / 1e6, device="cpu:0", now_ns=Clock())
    yield d, lock, state
    d.close()
    lock.release()


def test_the_lock_says_when_its_file_or_directory_is_removed_or_replaced_and_nothing_once_released(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    lock = StateDirLock(state, "e")
    assert lock.lost() == ""
    (state / LOCK_NAME).unlink()
    assert lock.lost() == f"its lock file {state / LOCK_NAME} was removed"
    (state / LOCK_NAME).write_text("someone's\n")
    assert lock.lost() == f"its lock file {state / LOCK_NAME} was replaced by another"
    shutil.rmtree(state)
    assert lock.lost() == f"the state directory {state} was removed"
    lock.retake()
    assert lock.lost() == "" and (state / LOCK_NAME).read_text().startswith(f"pid {os.getpid()}")
    with pytest.raises(ConfigError, match="another manager"):
        StateDirLock(state, "second")
    lock.release()
    assert lock.lost() == ""
    StateDirLock(state, "next").release()  # the path's lock is free again


def test_a_state_directory_removed_under_the_manager_is_made_again_with_every_task_as_it_is_now(
    homed: tuple[Durability, StateDirLock, Path], caplog: pytest.LogCaptureFixture,
) -> None:
    d, lock, state = homed
    first, second = d.submit(SPEC), d.submit(SPEC)
    assert not d.check_home(lock, lambda: [], lambda: [])  # still its own: nothing is done
    assert d.store.get(first.task_id) is not None
    shutil.rmtree(state)
    d.write(first.task_id, "state", lambda: d.store.set_state(first.task_id, TaskState.PARKED))  # into the void
    failure = FailureRecord(kind="EXIT", message="exit 3", at_unix_s=1.0)
    now = [
        dataclasses.replace(first, state="RUNNING", checkpoint_path="/ck/step-5",
                            figures=TaskProgress(steps=9, harvested_s=1.5, checkpoint_step=5)),
        dataclasses.replace(second, state="FAILED", failure=failure),
    ]
    live = state / "tasks" / first.task_id
    with caplog.at_level(logging.WARNING, logger="freeride"):
        assert d.check_home(lock, lambda: now, lambda: [live])  # made again: the caller opens the logs again
    assert not d.check_home(lock, lambda: now, lambda: [live])
    assert f"the state directory {state} was removed while this manager runs" in caplog.text
    assert "2 task record(s) written from memory" in caplog.text
    assert lock.lost() == "" and not d.fault and d.next_timer_ns() is None
    assert (live / "checkpoints").is_dir() and (live / "work").is_dir()
    made = (live.parent, live, live / "checkpoints", live / "work")
    assert {oct(p.stat().st_mode & 0o777) for p in made} == {"0o700"}  # owner-only, as the manager makes them
    # Its checkpoint was in the removed directory: said, so that a restart from the beginning is no surprise.
    assert f"the checkpoints of {first.task_id} (step 5) were in the removed directory" in caplog.text
    kept = TaskStore(state / "tasks.db")  # what a manager started after this one reads
    try:
        back = {r.task_id: r for r in kept.all()}
    finally:
        kept.close()
    assert back[first.task_id].state == "PARKED"  # RUNNING is stored as the nearest durable state
    assert (back[first.task_id].figures.steps, back[first.task_id].checkpoint_path) == (9, "/ck/step-5")
    assert back[second.task_id].failure == failure and back[second.task_id].seq == second.seq
    assert d.submit(SPEC).seq == second.seq + 1  # numbering goes on: no id is given twice
    with pytest.raises(ConfigError, match="another manager"):
        StateDirLock(state, "second")  # the directory is guarded again


def test_a_directory_that_cannot_be_made_again_yet_is_tried_again_at_the_next_check(
    homed: tuple[Durability, StateDirLock, Path],
) -> None:
    d, lock, state = homed
    record = d.submit(SPEC)
    shutil.rmtree(state)
    state.write_text("a file where the directory was")
    assert not d.check_home(lock, lambda: [record], lambda: [])
    assert lock.lost()
    refusal = f"the state directory {state} was removed \\(.*File exists.*\\); the task was not submitted"
    with pytest.raises(StateNotWritable, match=refusal):
        d.submit(SPEC)  # it would be written to the removed store only
    state.unlink()
    assert d.check_home(lock, lambda: [record], lambda: [])
    assert lock.lost() == ""
    assert [r.task_id for r in d.store.all()] == [record.task_id]


def test_after_another_manager_took_the_removed_directory_this_one_writes_nothing_and_refuses_tasks(
    homed: tuple[Durability, StateDirLock, Path], caplog: pytest.LogCaptureFixture,
) -> None:
    d, lock, state = homed
    record = d.submit(SPEC)
    shutil.rmtree(state)
    other = StateDirLock(state, "unix:/other.sock")  # a second manager, started meanwhile
    theirs = TaskStore(state / "tasks.db")
    try:
        with caplog.at_level(logging.ERROR, logger="freeride"):
            d.check_home(lock, lambda: [record], lambda: [])
            d.check_home(lock, lambda: [record], lambda: [])
        assert caplog.text.count("another manager took the state directory") == 1
        d.write(record.task_id, "state", lambda: d.store.set_state(record.task_id, TaskState.PARKED))
        assert d.next_timer_ns() is None  # no retry timer that could only spin
        with pytest.raises(StateNotWritable, match="another manager took the state directory .* accepts no tasks"):
            d.submit(SPEC)
        assert theirs.all() == []  # its store is left alone
    finally:
        theirs.close()
        other.release()
