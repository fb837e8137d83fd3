"""freeride: run side tasks inside the bubbles of pipeline-parallel training.

The public surface: :class:`SideTask` and :class:`TaskContext` (write a side task; test it with
:mod:`freeride.testing`), the error tree, :class:`ControlClient` (manage tasks from Python) and the
message dataclasses it returns; the trainer's side is :mod:`freeride.training`.
"""

import os

from freeride.errors import (
    ConfigError,
    FreerideError,
    ManagerUnavailable,
    RequestRejected,
    TaskLoadError,
    TaskNotFound,
    Unauthenticated,
)
from freeride.messages import BubbleEnd, BubbleStart, Drained, FailureRecord, TaskInfo, TaskSpec
from freeride.task import SideTask, TaskContext

# gRPC's fork support (pthread_atfork handlers that pause its threads around every fork) is on by
# default in the grpcio wheels, and its handlers can deadlock: a `freeride bench` hung forever inside
# fork() starting a manager while its own gRPC health checks were in flight. freeride's processes fork
# only to exec (managers, workers, jobs) and never use a channel in a forked child, which is what the
# handlers exist for, so they are off unless the user chose otherwise. It takes effect where freeride
# is imported before grpc: every freeride command, manager and worker (nothing above imports grpc).
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

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
    "Drained",
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
