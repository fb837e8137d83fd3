"""freeride: run side tasks inside the bubbles of pipeline-parallel training.

The public surface: :class:`SideTask` and :class:`TaskContext` (write a side task; test it with
:mod:`freeride.testing`), the error tree, :class:`ControlClient` (manage tasks from Python) and the
message dataclasses it returns; the trainer's side is :mod:`freeride.training`.
"""

from freeride.errors import (
    ConfigError,
    FreerideError,
    ManagerUnavailable,
    RequestRejected,
    TaskLoadError,
    TaskNotFound,
    Unauthenticated,
)
from freeride.messages import BubbleEnd, BubbleStart, FailureRecord, TaskInfo, TaskSpec
from freeride.task import SideTask, TaskContext

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # ControlClient loads grpc: only when asked for, so that a worker importing SideTask does not.
    if name == "ControlClient":
        from freeride._wire.client import ControlClient

        return ControlClient
    raise AttributeError(f"module 'freeride' has no attribute {name!r}")


__all__ = [
    "BubbleEnd",
    "BubbleStart",
    "ConfigError",
    "ControlClient",
    "FailureRecord",
    "FreerideError",
    "ManagerUnavailable",
    "RequestRejected",
    "SideTask",
    "TaskContext",
    "TaskInfo",
    "TaskLoadError",
    "TaskNotFound",
    "TaskSpec",
    "Unauthenticated",
    "__version__",
]
