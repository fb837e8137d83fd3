"""The loop's side of the cluster queue: cluster tasks held here, between the queue agent and the core.

The queue agent (:mod:`freeride._cluster.agent`, its own thread, all of the Redis I/O) posts what it
claimed or wants released, and asks for a :class:`~freeride._cluster.records.QueueView`; this bridge
turns those into core events and answers, and tells the agent, through ``notes`` (an append to the
agent's deque, never blocking), what a cluster task did here: it ended, it left this device, or it
was lost. A cluster task is never in the local store: Redis holds its record.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from freeride._cluster.placement import Capacity
from freeride._cluster.records import CancelTask, QueueNote, QueueView, ReleaseTask, is_cluster_id
from freeride._manager import core as C
from freeride._manager.core.steps import TRAINER_PAUSE_NS
from freeride._manager.figures import figures_of, task_added
from freeride._manager.paths import TaskPaths
from freeride.messages import FailureRecord, QueueStats, TaskProgress, TaskRecord, TaskSpec
from freeride.states import TaskState

log = logging.getLogger(__name__)


class ClusterBridge:
    """``records``: every task the manager knows (claimed ones are added here); ``ids``: the cluster tasks
    held here, each with its claim epoch (``paths`` reads it too: it names the task's checkpoint directory);
    ``failure_of``: a task's failure as the loop completed it."""

    def __init__(self, core: C.SchedulerCore, records: dict[str, TaskRecord], paths: TaskPaths, ids: dict[str, int],
                 device: str, node: str, failure_of: Callable[[C.TaskRuntime], FailureRecord | None]) -> None:
        self.core = core
        self.records = records
        self.paths = paths
        self.ids = ids
        self.device = device
        self.node = node
        self._failure_of = failure_of
        #: The agent's inbox (set by the agent; called on the loop thread, must not block).
        self.notes: Callable[[QueueNote], None] | None = None
        #: The agent's figures (set by the agent; a frozen snapshot, read for ``Stats``).
        self.stats_source: Callable[[], QueueStats] | None = None

    def __contains__(self, task_id: str) -> bool:
        return task_id in self.ids

    # ------------------------------------------------------------ from the agent

    def request(self, item: ReleaseTask | CancelTask) -> list[Any]:
        if isinstance(item, ReleaseTask):
            return [C.ReleaseRequested(item.task_id, item.reason, item.checkpoint)]
        return [C.CancelRequested(item.task_id)]

    def claimed(self, claim: TaskRecord, epoch: int) -> list[Any]:
        """Add a task the agent claimed (claim ``epoch``); it resumes from the checkpoint the agent chose
        (:func:`freeride._cluster.fencing.resume_point`: the record's, or a newer file of the previous claim;
        the agent reads the shared directory, so that this loop never waits on it)."""
        tid = claim.task_id
        if tid in self.core.tasks or tid in self.records or not is_cluster_id(tid):
            # The same task twice (its earlier copy here is still on its way out; the agent avoids it):
            # the claim is dropped and the agent told to forget it, so its lease runs out and the queue
            # places it again.
            log.warning("[%s task=%s] claimed while still held here; dropped", self.device, tid)
            self._note("lost", claim, "claimed while still held here")
            return []
        self.ids[tid] = epoch
        ck_path, ck_step = claim.checkpoint_path, claim.checkpoint_step
        root = self.paths.cluster_root(tid)
        # A check of the names only (no I/O on the shared directory from this loop): the agent found the file
        # under the same root.
        if ck_path and (root is None or not Path(os.path.normpath(ck_path)).is_relative_to(os.path.normpath(root))):
            ck_path, ck_step = "", -1  # not this task's shared directory here: start without it
        now = time.time()
        # A new holder starts its own count of harvested time and overruns.
        figures = dataclasses.replace(claim.figures, checkpoint_step=ck_step, harvested_s=0.0, overruns=0)
        record = dataclasses.replace(claim, state=TaskState.SUBMITTED.value, figures=figures, checkpoint_path=ck_path,
                                     submitted_unix_s=claim.submitted_unix_s or now, updated_unix_s=now)
        self.records[tid] = record
        log.info("[%s task=%s] claimed from the cluster queue (checkpoint step %d)", self.device, tid, ck_step)
        return [task_added(record, from_queue=True)]

    def queue_stats(self) -> QueueStats | None:
        source = self.stats_source
        return source() if source is not None else None

    def view(self, margin_ns: int, now_ns: int, total_bytes: int = 0) -> QueueView:
        """Room for more here, and the cluster tasks held here as they are now (``now_ns``: the loop's clock;
        ``total_bytes``: the device's memory in all, 0 unknown)."""
        core = self.core
        layout = core.layout
        last_start = core.bubbles.last_start_ns
        capacity = Capacity(
            budget_bytes=core.budget_bytes(), longest_bubble_ns=core.longest_bubble_ns, margin_ns=margin_ns,
            waiting=core.count_in(TaskState.SUBMITTED), draining=core.draining,
            hosts_stage=layout is None or layout.hosts_stage(self.device, self.node),
            device_problem=core.device_problem,
            trainer_paused=last_start > 0 and now_ns - last_start > TRAINER_PAUSE_NS, total_bytes=total_bytes,
        )
        return QueueView(capacity, tuple(self._record(core.tasks[t]) for t in sorted(self.ids) if t in core.tasks))

    # ------------------------------------------------------------ from the core

    def state_changed(self, action: C.StateChanged) -> None:
        """Redis, not the local store, keeps a cluster task: the agent records its end."""
        task = self.core.tasks.get(action.task_id)
        if action.new.is_terminal and task is not None:
            self._note("ended", self._record(task), action.reason)
        if action.new.is_terminal or action.new == TaskState.STARTING:
            log.info("[%s task=%s] %s -> %s (%s)", self.device, action.task_id,
                     action.old.value if action.old else "-", action.new.value, action.reason)

    def released(self, action: C.Released) -> None:
        """A cluster task left this device: hand it back to the queue (or forget it if it was lost)."""
        meta = self.records.pop(action.task_id, None)
        self.ids.pop(action.task_id, None)
        figures = TaskProgress(
            steps=action.steps, progress=action.progress,
            progress_unit=action.progress_unit or (meta.progress_unit if meta else "steps"),
            checkpoint_step=action.checkpoint_step, restarts=action.restarts,
            step_p95_ms=(action.step_p95_ns or 0) / 1e6,
        )
        record = TaskRecord(action.task_id, meta.spec if meta else TaskSpec(), "EVICTED", figures,
                            action.checkpoint_path, seq=meta.seq if meta else 0)
        log.info("[%s task=%s] left this device: %s", self.device, action.task_id, action.reason)
        self._note("left" if action.checkpoint else "lost", record, action.reason)

    def _record(self, task: C.TaskRuntime) -> TaskRecord:
        failure = self._failure_of(task)
        if failure is not None and not failure.at_unix_s:
            failure = dataclasses.replace(failure, at_unix_s=time.time())
        return TaskRecord(task.task_id, task.spec, task.state.value, figures_of(task), task.checkpoint_path,
                          failure, seq=task.seq)

    def _note(self, kind: str, record: TaskRecord, reason: str) -> None:
        sink = self.notes
        if sink is not None:
            try:
                sink(QueueNote(kind, record, reason))
            except Exception:  # the agent's inbox must never take the loop down
                log.exception("[%s] queue note dropped", self.device)
