"""Durable task records: submitted tasks, their states and latest checkpoints survive restarts.

SQLite in WAL mode with ``synchronous=FULL``: a transaction that returned is on disk, so a
manager killed with SIGKILL (or a machine that loses power) loses no acknowledged submission or
checkpoint. The store is written only on changes that matter after a restart (submission,
residency, terminal states, checkpoints); the frequent PARKED <-> RUNNING flips are not written.
Only the manager loop thread touches the connection.
"""

from __future__ import annotations

import json
import re
import sqlite3
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from freeride.messages import FailureRecord, TaskSpec
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
"""

#: States written as such; the others are stored as the nearest durable state.
_DURABLE = {
    TaskState.RUNNING: TaskState.PARKED,
    TaskState.FROZEN: TaskState.PARKED,
}


@dataclass(frozen=True)
class StoredTask:
    seq: int
    task_id: str
    spec: TaskSpec
    state: TaskState
    failure: FailureRecord | None
    checkpoint_step: int
    checkpoint_path: str
    steps: int
    progress: float
    progress_unit: str
    harvested_s: float
    overruns: int
    restarts: int
    submitted_unix: float
    updated_unix: float


def _spec_to_json(spec: TaskSpec) -> str:
    data = asdict(spec)
    data["command"] = list(spec.command)
    return json.dumps(data)


def _spec_from_json(text: str) -> TaskSpec:
    data = json.loads(text)
    data["command"] = tuple(data.get("command", ()))
    return TaskSpec(**data)


def _slug(text: str) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    return slug[:32] or "task"


class TaskStore:
    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        self._db.close()

    def add(self, spec: TaskSpec) -> StoredTask:
        """Record a new submission; the id is ``<name>-<seq>``."""
        now = time.time()
        with self._db:
            cur = self._db.execute(
                "INSERT INTO tasks (task_id, spec_json, state, submitted_unix, updated_unix) VALUES (?, ?, ?, ?, ?)",
                (f"pending-{time.monotonic_ns()}", _spec_to_json(spec), TaskState.SUBMITTED.value, now, now),
            )
            seq = int(cur.lastrowid or 0)
            task_id = f"{_slug(spec.display_name)}-{seq}"
            self._db.execute("UPDATE tasks SET task_id = ? WHERE seq = ?", (task_id, seq))
        stored = self.get(task_id)
        assert stored is not None
        return stored

    def set_state(self, task_id: str, state: TaskState, failure: FailureRecord | None = None) -> None:
        durable = _DURABLE.get(state, state)
        with self._db:
            if failure is not None:
                self._db.execute(
                    "UPDATE tasks SET state = ?, failure_json = ?, updated_unix = ? WHERE task_id = ?",
                    (durable.value, json.dumps(failure.to_json()), time.time(), task_id),
                )
            else:
                self._db.execute(
                    "UPDATE tasks SET state = ?, updated_unix = ? WHERE task_id = ?",
                    (durable.value, time.time(), task_id),
                )

    def record_checkpoint(self, task_id: str, step: int, path: str, progress: float) -> None:
        with self._db:
            self._db.execute(
                "UPDATE tasks SET checkpoint_step = ?, checkpoint_path = ?, steps = MAX(steps, ?), progress = ?,"
                " updated_unix = ? WHERE task_id = ?",
                (step, path, step, progress, time.time(), task_id),
            )

    def record_progress(
        self,
        task_id: str,
        steps: int,
        progress: float,
        progress_unit: str,
        harvested_s: float,
        overruns: int,
        restarts: int,
    ) -> None:
        with self._db:
            self._db.execute(
                "UPDATE tasks SET steps = ?, progress = ?, progress_unit = ?, harvested_s = ?, overruns = ?,"
                " restarts = ?, updated_unix = ? WHERE task_id = ?",
                (steps, progress, progress_unit, harvested_s, overruns, restarts, time.time(), task_id),
            )

    def get(self, task_id: str) -> StoredTask | None:
        row = self._db.execute("SELECT * FROM tasks WHERE task_id = ?", (task_id,)).fetchone()
        return self._row(row) if row else None

    def all(self) -> list[StoredTask]:
        return [self._row(r) for r in self._db.execute("SELECT * FROM tasks ORDER BY seq")]

    @staticmethod
    def _row(row: tuple[Any, ...]) -> StoredTask:
        (seq, task_id, spec_json, state, failure_json, ck_step, ck_path, steps, progress, unit, harvested,
         overruns, restarts, submitted, updated) = row
        return StoredTask(
            seq=seq,
            task_id=task_id,
            spec=_spec_from_json(spec_json),
            state=TaskState(state),
            failure=FailureRecord.from_json(json.loads(failure_json)) if failure_json else None,
            checkpoint_step=ck_step,
            checkpoint_path=ck_path,
            steps=steps,
            progress=progress,
            progress_unit=unit,
            harvested_s=harvested,
            overruns=overruns,
            restarts=restarts,
            submitted_unix=submitted,
            updated_unix=updated,
        )
