"""A task between the core and its records: its figures as the core has them, and the core's event for
a task that comes in with a record (submitted, recovered at a start, claimed from the cluster queue)."""

from __future__ import annotations

from freeride._manager import core as C
from freeride.messages import TaskProgress, TaskRecord


def figures_of(task: C.TaskRuntime) -> TaskProgress:
    """A task's figures as the core has them now (read only)."""
    p95 = task.estimator.estimate_ns() if task.estimator.count else None
    return TaskProgress(steps=task.steps, progress=task.progress, progress_unit=task.progress_unit,
                        harvested_s=task.harvested_ns / 1e9, overruns=task.overruns, restarts=task.restarts,
                        checkpoint_step=task.checkpoint_step, step_p95_ms=(p95 or 0) / 1e6)


def task_added(record: TaskRecord, from_queue: bool = False) -> C.TaskAdded:
    """The core's event for a task that comes in with ``record``'s figures and checkpoint; a task claimed
    from the queue brings its step estimate as a hint."""
    figures = record.figures
    return C.TaskAdded(
        task_id=record.task_id, spec=record.spec, seq=record.seq, checkpoint_path=record.checkpoint_path,
        checkpoint_step=figures.checkpoint_step, steps=max(figures.steps, figures.checkpoint_step),
        progress=figures.progress, progress_unit=figures.progress_unit, restarts=figures.restarts,
        harvested_ns=int(figures.harvested_s * 1e9),
        overruns=figures.overruns, from_queue=from_queue,
        step_hint_ns=int(figures.step_p95_ms * 1e6) if from_queue else 0,
    )
