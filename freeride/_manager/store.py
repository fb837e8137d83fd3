"""Durable task records: submitted tasks, their states and latest checkpoints survive restarts.

SQLite in WAL mode with ``synchronous=FULL``: a transaction that returned is on disk, so a
manager killed with SIGKILL (or a machine that loses power) loses no acknowledged submission or
checkpoint. The store is written only on changes that matter after a restart (submission,
residency, terminal states, checkpoints); the frequent PARKED <-> RUNNING flips are not written.
Only the manager loop thread touches the connection.

A state directory that cannot be written (read-only, full, failing) is reported, never ignored:
opening the store probes a real write and raises :class:`~freeride.errors.ConfigError` (the
manager does not start); a write that fails later raises :class:`~freeride.errors.StateNotWritable`
after SQLite rolled the transaction back, so the caller knows nothing was recorded. Every write
goes through :meth:`TaskStore._writing`, the one place those errors are translated.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from freeride._validation import slug
from freeride.errors import ConfigError, StateNotWritable
from freeride.messages import FailureRecord, TaskProgress, TaskRecord, TaskSpec
from freeride.states import TaskState

_SCHEMA = """
CREATE TABLE IF NOT EXISTS tasks (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    task_id TEXT UNIQUE NOT NULL,
    spec_json TEXT NOT NULL,
    state TEXT NOT NULL,
    failure_json TEXT,
    checkpoint_step INTEGER NOT NULL DEFAULT -1,
    checkpoint_path TEXT NOT NULL DEFAULT '',
    steps INTEGER NOT NULL DEFAULT 0,
    progress REAL NOT NULL DEFAULT 0,
    progress_unit TEXT NOT NULL DEFAULT 'steps',
    harvested_s REAL NOT NULL DEFAULT 0,
    overruns INTEGER NOT NULL DEFAULT 0,
    restarts INTEGER NOT NULL DEFAULT 0,
    submitted_unix REAL NOT NULL,
    updated_unix REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""

#: States written as such; the others are stored as the nearest durable state.
_DURABLE = {
    TaskState.RUNNING: TaskState.PARKED,
    TaskState.FROZEN: TaskState.PARKED,
}


def _spec_to_json(spec: TaskSpec) -> str:
    data = asdict(spec)
    data["command"] = list(spec.command)
    return json.dumps(data)


def _spec_from_json(text: str) -> TaskSpec:
    data = json.loads(text)
    data["command"] = tuple(data.get("command", ()))
    return TaskSpec(**data)


def check_writable(directory: Path) -> None:
    """Create, fsync and remove a small file in ``directory``; raise OSError if it cannot be done.

    ``os.access`` is not enough: it ignores full disks and read-only mounts, and root passes it always.
    """
    probe = directory / f".write-probe-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, b"freeride")
            os.fsync(fd)
        finally:
            os.close(fd)
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()


class TaskStore:
    """The task table in ``<state>/tasks.db``; see the module docstring for durability and errors."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            check_writable(path.parent)
            self._db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.executescript(_SCHEMA)
            # A real write: SQLite opens a read-only database without complaint until the first one.
            with self._writing() as db:
                db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('opened_unix', ?)", (str(time.time()),))
        except (OSError, sqlite3.Error, StateNotWritable) as exc:
            raise ConfigError(f"state directory {path.parent} is not writable: {exc}") from None

    def close(self) -> None:
        self._db.close()

    @contextlib.contextmanager
    def _writing(self) -> Iterator[sqlite3.Connection]:
        """One write transaction; a refused write is rolled back and raised as StateNotWritable.

        The connection is in autocommit mode (``isolation_level=None``), where ``with connection``
        begins nothing: without the explicit ``BEGIN``, a multi-statement write could be half done
        when the disk fills between its statements.
        """
        try:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
                self._db.execute("COMMIT")
            except BaseException:
                # SQLite may already have rolled back on its own (SQLITE_FULL, SQLITE_IOERR).
                with contextlib.suppress(sqlite3.Error):
                    self._db.execute("ROLLBACK")
                raise
        except (OSError, sqlite3.OperationalError) as exc:
            # OperationalError covers "database or disk is full", "attempt to write a readonly
            # database" and "disk I/O error"; integrity and programming errors are bugs and propagate.
            raise StateNotWritable(f"state directory {self.path.parent} not writable: {exc}") from None

    def add(self, spec: TaskSpec) -> TaskRecord:
        """Record a new submission; the id is ``<name>-<seq>``."""
        now = time.time()
        with self._writing() as db:
            cur = db.execute(
                "INSERT INTO tasks (task_id, spec_json, state, submitted_unix, updated_unix) VALUES (?, ?, ?, ?, ?)",
                (f"pending-{time.monotonic_ns()}", _spec_to_json(spec), TaskState.SUBMITTED.value, now, now),
            )
            seq = int(cur.lastrowid or 0)
            task_id = f"{slug(spec.display_name)}-{seq}"
            db.execute("UPDATE tasks SET task_id = ? WHERE seq = ?", (task_id, seq))
        stored = self.get(task_id)
        assert stored is not None
        return stored

    def set_state(self, task_id: str, state: TaskState, failure: FailureRecord | None = None) -> None:
        durable = _DURABLE.get(state, state)
        with self._writing() as db:
            if failure is not None:
                db.execute(
                    "UPDATE tasks SET state = ?, failure_json = ?, updated_unix = ? WHERE task_id = ?",
                    (durable.value, json.dumps(failure.to_json()), time.time(), task_id),
                )
            else:
                db.execute(
                    "UPDATE tasks SET state = ?, updated_unix = ? WHERE task_id = ?",
                    (durable.value, time.time(), task_id),
                )

    def record_checkpoint(self, task_id: str, step: int, path: str, progress: float, harvested_s: float = 0.0,
                          progress_unit: str | None = None, overruns: int = 0) -> None:
        """A checkpoint, and the harvested time and overruns so far and the progress's unit (so that they survive
        a ``kill -9`` of the manager: the unit and the overruns were written only at submission, and a restarted
        manager showed "621 steps" of a task that counts images until its worker was ready again, and 0
        overruns)."""
        with self._writing() as db:
            db.execute(
                "UPDATE tasks SET checkpoint_step = ?, checkpoint_path = ?, steps = MAX(steps, ?), progress = ?,"
                " harvested_s = MAX(harvested_s, ?), progress_unit = COALESCE(?, progress_unit),"
                " overruns = MAX(overruns, ?), updated_unix = ? WHERE task_id = ?",
                (step, path, step, progress, harvested_s, progress_unit, overruns, time.time(), task_id),
            )

    def record_progress(self, task_id: str, figures: TaskProgress) -> None:
        """A task's figures (all but its checkpoint, which :meth:`record_checkpoint` writes, and its step
        estimate, which is not kept)."""
        with self._writing() as db:
            db.execute(
                "UPDATE tasks SET steps = ?, progress = ?, progress_unit = ?, harvested_s = ?, overruns = ?,"
                " restarts = ?, updated_unix = ? WHERE task_id = ?",
                (figures.steps, figures.progress, figures.progress_unit, figures.harvested_s, figures.overruns,
                 figures.restarts, time.time(), task_id),
            )

    def restore(self, records: list[TaskRecord]) -> None:
        """Write ``records`` whole (ids, sequence numbers, states, figures, checkpoints and failures as they are),
        in one transaction, over whatever rows of theirs the table holds: the manager's memory written back to a
        new store, after its directory was removed under it. Later submissions number on from the highest."""
        with self._writing() as db:
            for r in records:
                f, state = r.figures, TaskState(r.state)
                db.execute(
                    "INSERT OR REPLACE INTO tasks (seq, task_id, spec_json, state, failure_json, checkpoint_step,"
                    " checkpoint_path, steps, progress, progress_unit, harvested_s, overruns, restarts,"
                    " submitted_unix, updated_unix) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (r.seq, r.task_id, _spec_to_json(r.spec), _DURABLE.get(state, state).value,
                     json.dumps(r.failure.to_json()) if r.failure is not None else None, f.checkpoint_step,
                     r.checkpoint_path, f.steps, f.progress, f.progress_unit, f.harvested_s, f.overruns, f.restarts,
                     r.submitted_unix_s, r.updated_unix_s),
                )

    def get(self, task_id: str) -> TaskRecord | None:
        row = self._db.execute("SELECT * FROM tasks WHERE task_id = ?", (task_id,)).fetchone()
        return self._row(row) if row else None

    def all(self) -> list[TaskRecord]:
        return [self._row(r) for r in self._db.execute("SELECT * FROM tasks ORDER BY seq")]

    @staticmethod
    def _row(row: tuple[Any, ...]) -> TaskRecord:
        (seq, task_id, spec_json, state, failure_json, ck_step, ck_path, steps, progress, unit, harvested,
         overruns, restarts, submitted, updated) = row
        return TaskRecord(
            task_id=task_id,
            spec=_spec_from_json(spec_json),
            state=TaskState(state).value,
            figures=TaskProgress(steps=steps, progress=progress, progress_unit=unit, harvested_s=harvested,
                                 overruns=overruns, restarts=restarts, checkpoint_step=ck_step),
            checkpoint_path=ck_path,
            failure=FailureRecord.from_json(json.loads(failure_json)) if failure_json else None,
            seq=seq,
            submitted_unix_s=submitted,
            updated_unix_s=updated,
        )
