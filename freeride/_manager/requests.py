"""What the manager's loop is asked (``ManagerLoop.call``): one frozen dataclass per request.

The gRPC servicers, the metrics collector and the daemon build these; the loop answers them on its
own thread (:mod:`freeride._manager.views` for what they read, the core for what they change). The
cluster agent's own questions and requests are in :mod:`freeride._cluster.records`.
"""

from __future__ import annotations

from dataclasses import dataclass

from freeride.messages import TaskSpec


@dataclass(frozen=True)
class SubmitTask:
    spec: TaskSpec


@dataclass(frozen=True)
class ListTasks:
    include_finished: bool


@dataclass(frozen=True)
class GetTask:
    task_id: str


@dataclass(frozen=True)
class CancelTask:
    task_id: str


@dataclass(frozen=True)
class GetStats:
    pass


@dataclass(frozen=True)
class GetBubbles:
    pass


@dataclass(frozen=True)
class Drain:
    """Park, checkpoint and stop every task; answered (tasks parked, of them checkpointed) once done."""


@dataclass(frozen=True)
class Shutdown:
    """Drain, then stop the loop (SIGTERM, SIGINT); posted, never called."""

    immediate: bool = False


Request = SubmitTask | ListTasks | GetTask | CancelTask | GetStats | GetBubbles | Drain
