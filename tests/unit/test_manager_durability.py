"""Durability on its own, over a real store: refused writes are kept and retried, submissions wait for the
disk, only what matters after a restart is written, and a restart recovers from the newest checkpoint."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from freeride._manager import core as C
from freeride._manager.durability import Durability, stamped
from freeride._manager.paths import TaskPaths
from freeride._manager.store import TaskStore
from freeride.errors import StateNotWritable
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
