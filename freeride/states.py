"""The side-task lifecycle: one enum and its allowed transitions.

::

    SUBMITTED -> STARTING -> PARKED <-> RUNNING -> FINISHED | FAILED | CANCELLED
                                         RUNNING <-> FROZEN   (SIGSTOP past the grace period)
                                                     FROZEN -> FINISHED (its finish crossed the freeze)
    STARTING | PARKED | RUNNING | FROZEN -> EVICTED (checkpoint saved, process gone) -> SUBMITTED

Every change goes through :func:`check_transition`; terminal states cannot be left.
"""

from __future__ import annotations

import enum

from freeride.errors import InvalidTransition


class TaskState(str, enum.Enum):
    SUBMITTED = "SUBMITTED"  # waiting for memory on the device
    STARTING = "STARTING"  # process spawned, not yet connected
    PARKED = "PARKED"  # process alive and idle, holding its memory
    RUNNING = "RUNNING"  # inside a grant, stepping
    FROZEN = "FROZEN"  # stopped with SIGSTOP mid-step after overrunning a bubble
    EVICTED = "EVICTED"  # checkpointed and stopped; goes back to SUBMITTED
    FINISHED = "FINISHED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def is_terminal(self) -> bool:
        return self in _TERMINAL

    @property
    def is_resident(self) -> bool:
        """The task has a live process that holds (or may hold) its memory cap."""
        return self in _RESIDENT


_TERMINAL = frozenset({TaskState.FINISHED, TaskState.FAILED, TaskState.CANCELLED})
_RESIDENT = frozenset({TaskState.STARTING, TaskState.PARKED, TaskState.RUNNING, TaskState.FROZEN})

_ALLOWED: dict[TaskState, frozenset[TaskState]] = {
    TaskState.SUBMITTED: frozenset({TaskState.STARTING, TaskState.CANCELLED, TaskState.FAILED}),
    TaskState.STARTING: frozenset(
        {TaskState.PARKED, TaskState.FAILED, TaskState.CANCELLED, TaskState.EVICTED}
    ),
    TaskState.PARKED: frozenset(
        {TaskState.RUNNING, TaskState.FINISHED, TaskState.FAILED, TaskState.CANCELLED, TaskState.EVICTED}
    ),
    TaskState.RUNNING: frozenset(
        {
            TaskState.PARKED,
            TaskState.FROZEN,
            TaskState.FINISHED,
            TaskState.FAILED,
            TaskState.CANCELLED,
            TaskState.EVICTED,
        }
    ),
    TaskState.FROZEN: frozenset(
        {TaskState.RUNNING, TaskState.FINISHED, TaskState.FAILED, TaskState.CANCELLED, TaskState.EVICTED}
    ),
    TaskState.EVICTED: frozenset({TaskState.SUBMITTED, TaskState.CANCELLED, TaskState.FAILED}),
    TaskState.FINISHED: frozenset(),
    TaskState.FAILED: frozenset(),
    TaskState.CANCELLED: frozenset(),
}


def check_transition(task_id: str, old: TaskState, new: TaskState) -> None:
    """Raise :class:`InvalidTransition` unless ``old -> new`` is allowed."""
    if new not in _ALLOWED[old]:
        raise InvalidTransition(f"task {task_id}: {old.value} -> {new.value} is not allowed")
