"""Durability: the manager's task records, what of them goes to disk and when, and recovery at a start.

``records`` holds every task this manager knows (its store's, and the cluster tasks it holds). Only
changes that matter after a restart are written (submission, residency, terminal states, progress at
those, checkpoints); the frequent PARKED <-> RUNNING <-> FROZEN flips are not.

The state directory may stop taking writes (full, read-only, failing disk). Training is served as
before; a store write that fails is kept and retried every ``retry_ms`` (writes set absolute values,
so only the latest per task and kind is kept), and while any is pending, submissions are refused
with :class:`~freeride.errors.StateNotWritable`: a task is acknowledged only once it is on disk. A
pending write is only in memory: a manager killed before the directory recovers loses it (the task
then comes back in its last durable state).

The state directory may also be removed under a running manager (a clean-up of old files, an ``rm -rf``).
SQLite goes on writing its open, unlinked files without an error, and the directory's lock guards nothing
(:class:`~freeride._manager.state_lock.StateDirLock`), so a second manager could take the directory. The
loop asks every :data:`HOME_CHECK_NS` (:meth:`Durability.check_home`); once the lock is lost, the manager
locks the path again, opens a new store there and writes every task it knows into it as it is now, makes
the live tasks' directories again (their next checkpoints land there; the files written before are gone),
and says so. If another manager took the directory meanwhile, this one records nothing more and refuses
submissions (training and its tasks are still served) until it is stopped.

At a start (:meth:`Durability.recover`) every task that was alive when the last manager died starts
again, from the newest checkpoint file in its directory when that is newer than the one recorded
(files are written whole; the manager may have died before recording the newest), after the
processes a killed manager's workers left behind are killed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from pathlib import Path

from freeride import _checkpoints
from freeride._cluster.records import is_cluster_id
from freeride._manager import core as C
from freeride._manager import orphans
from freeride._manager.figures import figures_of, task_added
from freeride._manager.paths import TaskPaths
from freeride._manager.state_lock import StateDirInUse, StateDirLock
from freeride._manager.store import TaskStore
from freeride.errors import ConfigError, StateNotWritable
from freeride.messages import FailureRecord, TaskRecord, TaskSpec
from freeride.states import TaskState

log = logging.getLogger(__name__)

_FLIPS = (TaskState.PARKED, TaskState.RUNNING, TaskState.FROZEN)
#: How often the loop checks that the state directory is still its own (one stat and one fstat).
HOME_CHECK_NS = 1_000_000_000


class Durability:
    def __init__(self, store: TaskStore, retry_ms: float, device: object,
                 now_ns: Callable[[], int] = time.monotonic_ns) -> None:
        self.store = store
        self.retry_ns = int(retry_ms * 1e6)
        self.device = device
        self.now_ns = now_ns
        #: Every task this manager knows, as it was recorded (or claimed).
        self.records: dict[str, TaskRecord] = {}
        #: Why the state directory refuses writes ("" while it takes them).
        self.fault = ""
        #: Why this manager no longer writes its state directory at all: another manager took it after it was
        #: removed ("" while it is this manager's; see the module doc).
        self.homeless = ""
        self._home_lost = ""  # why the lock was last found lost, while the directory is not made again
        self._home_error = ""  # why it could not be made again at the last check
        self._reopening = False  # the lock is held again, the store not yet made again (check_home)
        # Store writes the state directory refused, oldest first.
        self._pending: dict[tuple[str, str], Callable[[], None]] = {}
        self._next_retry_ns = 0

    # ------------------------------------------------------------ writes

    def write(self, task_id: str, kind: str, write: Callable[[], None]) -> None:
        """Carry out one store write now, or keep it for later if the state directory refuses it.

        Writes set absolute values, so a newer write of the same (task, kind) replaces a pending one;
        the rest keep their order.
        """
        key = (task_id, kind)
        self._pending.pop(key, None)
        self._pending[key] = write
        if not self.fault:  # while the directory refuses writes, the retry timer tries again
            self.flush()

    def flush(self) -> bool:
        """Write what is pending, oldest first; True when nothing is left."""
        if self.homeless or self._reopening:
            return not self._pending
        while self._pending:
            key, write = next(iter(self._pending.items()))
            try:
                write()
            except StateNotWritable as exc:
                if not self.fault:
                    log.error("[%s] %s; training is still served, task records are kept in memory and "
                              "retried, new submissions are refused", self.device, exc)
                self.fault = str(exc)
                self._next_retry_ns = self.now_ns() + self.retry_ns
                return False
            del self._pending[key]
        if self.fault:
            log.warning("[%s] the state directory takes writes again; deferred task records saved", self.device)
            self.fault = ""
        return True

    def next_timer_ns(self) -> int | None:
        if self.homeless or self._reopening:
            return None  # nothing to retry: check_home's own check makes the store again, or none is made
        return self._next_retry_ns if self._pending else None

    def poll(self, now: int) -> None:
        if self._pending and now >= self._next_retry_ns:
            self.flush()

    # ------------------------------------------------------------ what the loop records

    def submit(self, spec: TaskSpec) -> TaskRecord:
        """Record a submission, or raise :class:`StateNotWritable`: acknowledged only once on disk."""
        if self.homeless or self._home_lost:
            why = self.homeless or f"{self._home_lost} ({self._home_error or 'not made again yet'})"
            raise StateNotWritable(f"{why}; the task was not submitted (training is still served)")
        if self._pending and not self.flush():
            raise StateNotWritable(f"{self.fault}; the task was not submitted (training is still served)")
        try:
            record = self.store.add(spec)
        except StateNotWritable as exc:
            raise StateNotWritable(f"{exc}; the task was not submitted (training is still served)") from None
        self.records[record.task_id] = record
        return record

    def state_changed(self, action: C.StateChanged, task: C.TaskRuntime | None) -> None:
        """Write a local task's state (and its figures, as the core has them now, at submission and at its end)."""
        if action.old in _FLIPS and action.new in _FLIPS:
            return  # frequent flips are not durable information
        tid = action.task_id
        self.write(tid, "state", functools.partial(self.store.set_state, tid, action.new, action.failure))
        if task is not None and (action.new.is_terminal or action.new == TaskState.SUBMITTED):
            # The figures are bound now, not read when a deferred write is finally carried out.
            self.write(tid, "progress", functools.partial(self.store.record_progress, tid, figures_of(task)))
        if action.new.is_terminal or action.new in (TaskState.SUBMITTED, TaskState.STARTING):
            log.info("[%s task=%s] %s -> %s (%s)", self.device, tid, action.old.value if action.old else "-",
                     action.new.value, action.reason)
        if action.failure is not None:
            log.warning("[%s task=%s] failed: %s: %s", self.device, tid, action.failure.kind, action.failure.message)

    def checkpoint_recorded(self, action: C.CheckpointRecorded, task: C.TaskRuntime | None) -> None:
        """A checkpoint, with the task's figures that a ``kill -9`` would otherwise lose (its harvested time,
        overruns and progress unit, as the core has them now)."""
        figures = (0.0, None, 0) if task is None else (task.harvested_ns / 1e9, task.progress_unit, task.overruns)
        self.write(action.task_id, "checkpoint", functools.partial(
            self.store.record_checkpoint, action.task_id, action.step, action.path, action.progress, *figures))

    # ------------------------------------------------------------ the directory itself

    def check_home(self, lock: StateDirLock, current: Callable[[], list[TaskRecord]],
                   live_dirs: Callable[[], list[Path]]) -> bool:
        """Whether the state directory is still this manager's; if it was removed under it, make it so again
        (module doc). ``current``: every task this manager knows, as it is now (the store's rows to write);
        ``live_dirs``: the directories of its live tasks, made again. True when it was made again by this call
        (the caller opens the live workers' logs again)."""
        if self.homeless:
            return False
        path = self.store.path
        if not self._reopening:
            lost = lock.lost()
            if not lost:
                return False
            if lost != self._home_lost:
                self._home_lost = lost
                log.error("[%s] %s while this manager runs: its task records and the checkpoints there are gone; "
                          "making it again from what the manager holds", self.device, lost)
            try:
                lock.retake()
            except StateDirInUse:
                self.homeless = (f"another manager took the state directory {path.parent} after it was removed "
                                 "under this one: this manager records nothing more and accepts no tasks (stop it; "
                                 "its tasks run on until then, and the other manager does not know them)")
                log.error("[%s] %s", self.device, self.homeless)
                return False
            except ConfigError as exc:
                self._cannot_remake(str(exc))
                return False
            self.store.close()
            self._reopening = True  # no write reaches the closed store until a new one holds every record
        try:
            store = TaskStore(path)
        except ConfigError as exc:
            self._cannot_remake(str(exc))
            return False
        try:
            records = current()
            store.restore(records)
        except StateNotWritable as exc:
            store.close()
            self._cannot_remake(str(exc))
            return False
        self.store = store
        self._reopening = False
        self._pending.clear()  # bound to the old store; the rows just written hold what they would have
        self.fault = self._home_lost = self._home_error = ""
        for directory in live_dirs():
            # Owner-only, each level, as the manager makes them (``parents=True`` made the upper ones 0755).
            for made in (directory.parent, directory, directory / "checkpoints", directory / "work"):
                with contextlib.suppress(OSError):
                    made.mkdir(mode=0o700, exist_ok=True)
        log.warning("[%s] state directory %s made again: %d task record(s) written from memory; live tasks "
                    "checkpoint there again from their next checkpoint, and their logs begin again there (a task "
                    "working in files of its work directory lost them)", self.device, path.parent, len(records))
        gone = [r for r in records if r.checkpoint_path and not TaskState(r.state).is_terminal
                and not Path(r.checkpoint_path).exists()]
        if gone:
            # A stranger's task, stopped before its next checkpoint, restarted from its beginning, and `show` still
            # named the removed checkpoint: said here, per task.
            log.warning("[%s] the checkpoints of %s were in the removed directory: each starts from its beginning "
                        "if it stops before it checkpoints again", self.device,
                        ", ".join(f"{r.task_id} (step {r.figures.checkpoint_step})" for r in gone))
        return True

    def _cannot_remake(self, why: str) -> None:
        if why != self._home_error:
            log.error("[%s] cannot make the state directory again yet (%s); trying again every %.0f s", self.device,
                      why, HOME_CHECK_NS / 1e9)
        self._home_error = why

    # ------------------------------------------------------------ start and stop

    def recover(self, paths: TaskPaths) -> list[C.TaskAdded]:
        """Load the store; the core's events for the tasks that start again (see the module docstring)."""
        # A cluster task is not in the store (Redis holds it; its lease runs out and it is placed again),
        # but what its workers spawned here dies all the same.
        tasks_dir = paths.state_dir / "tasks"
        for path in sorted(tasks_dir.iterdir()) if tasks_dir.is_dir() else []:
            if is_cluster_id(path.name) and orphans.kill_leftovers(path):
                log.warning("[%s task=%s] killed process(es) left by the previous manager's worker", self.device,
                            path.name)
        events = []
        for stored in self.store.all():
            self.records[stored.task_id] = stored
            killed = orphans.kill_leftovers(paths.task_dir(stored.task_id))
            if killed:
                log.warning("[%s task=%s] killed %d process(es) left by the previous manager's worker",
                            self.device, stored.task_id, killed)
            state = TaskState(stored.state)
            if state.is_terminal:
                continue
            restarts = stored.restarts + (1 if state != TaskState.SUBMITTED else 0)
            if state != TaskState.SUBMITTED:
                log.info("[%s task=%s] recovered after a manager restart (was %s)", self.device, stored.task_id,
                         stored.state)
                self.write(stored.task_id, "state", functools.partial(
                    self.store.set_state, stored.task_id, TaskState.SUBMITTED))
            ck_path, ck_step = _checkpoints.newest(paths.task_dir(stored.task_id) / "checkpoints",
                                                   stored.checkpoint_path, stored.checkpoint_step)
            figures = dataclasses.replace(stored.figures, restarts=restarts, checkpoint_step=ck_step)
            events.append(task_added(dataclasses.replace(stored, figures=figures, checkpoint_path=ck_path)))
        if events:
            # A stranger's first manager on the default state directory listed someone's earlier tasks, unsaid; said
            # at INFO, the line reached no terminal (the CLI's default level is WARNING), and those tasks run in this
            # manager's bubbles.
            log.warning("[%s] %d task(s) from %s start again (`freeride ls` lists them; `freeride cancel ID` ends "
                        "one, and another --state-dir starts afresh)", self.device, len(events), paths.state_dir)
        return events

    def close(self) -> None:
        if self._pending and not self.flush():
            log.error("[%s] stopping with %d task record(s) not saved (%s): those tasks come back in their last "
                      "saved state", self.device, len(self._pending), self.homeless or self.fault)
        self.store.close()


def stamped(failure: FailureRecord, step: int, log_tail: Callable[[], str]) -> FailureRecord:
    """A failure the core decided, completed with what the pure core cannot see: the wall-clock time, the
    step the worker was in (its board: the core's own count is only updated when the worker parks, so a
    task that died in its third step of a grant read "step 0"), and its log's tail."""
    return dataclasses.replace(failure, at_unix_s=time.time(), step=step if step >= 0 else failure.step,
                               log_tail=failure.log_tail or log_tail())
