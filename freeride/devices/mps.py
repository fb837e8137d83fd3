"""CUDA MPS: whether a live control daemon serves this GPU, and what a side-task client is given.

Under MPS the side tasks' kernels run beside the trainer's in one server: below-normal client
priority lets the trainer's kernels go first, an SM share (``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``)
bounds how much of the GPU a side task's kernels can occupy when a bubble ends, and the pinned
memory limit has the driver enforce the cap too. The price is a shared fault domain: a fatal GPU
fault in one MPS client (an illegal address, say) can take down every client of that server, the
trainer included. Without MPS each process has its own context and a faulting side task dies alone.
The README states this trade-off; ``freeride manager --mps`` chooses.

A daemon is *live* when something serves its control pipe: the control daemon holds it open (a
named pipe with a reader, or a unix socket that accepts). That is what a client's ``cuInit`` finds, so
it is the test, whatever the pid file says: a daemon in another PID namespace (the host's, seen from
a container that shares its pipe directory) has a pid this process cannot see, yet workers join it;
a pipe directory left behind by a daemon that died has a control pipe that nobody serves. The pid file
only adds detail. Current daemons serve a unix socket: the probe connects and closes without a word,
which the daemon logs as a connection without credentials and otherwise ignores.
"""

from __future__ import annotations

import enum
import errno
import os
import socket
import stat
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import psutil

from freeride.errors import ConfigError

DEFAULT_PIPE_DIRECTORY = "/tmp/nvidia-mps"
PID_FILE = "nvidia-cuda-mps-control.pid"
CONTROL_PROCESS = "nvidia-cuda-mps-control"
#: CUDA_MPS_CLIENT_PRIORITY: 0 is normal (the trainer), 1 below normal.
SIDE_TASK_CLIENT_PRIORITY = 1
DEFAULT_SM_PERCENT = 50


class MpsMode(str, enum.Enum):
    AUTO = "auto"  # join a live daemon if there is one
    OFF = "off"  # never join one, even if it runs
    REQUIRE = "require"  # refuse to start without a live daemon


@dataclass(frozen=True)
class MpsStatus:
    """What :func:`probe_mps` found."""

    live: bool
    pipe_directory: str
    detail: str


def _process_name(pid: int) -> str | None:
    try:
        return psutil.Process(pid).name()
    except (psutil.Error, ValueError):
        return None


def control_served(control: Path) -> bool | None:
    """Whether something serves the control pipe: True, False, or None when this user may not tell.

    A named pipe is opened for writing without blocking: that fails with ENXIO when no process has
    it open for reading. A unix socket is connected to. Nothing is written either way.
    """
    try:
        mode = os.stat(control).st_mode
    except OSError:
        return False
    try:
        if stat.S_ISSOCK(mode):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(1.0)
                sock.connect(str(control))
            return True
        fd = os.open(control, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EPERM):
            return None
        return False  # ENXIO (a pipe nobody reads), ECONNREFUSED (a socket nobody accepts on), ...
    os.close(fd)
    return True


def probe_mps(env: Mapping[str, str] | None = None,
              process_name: Callable[[int], str | None] = _process_name,
              served: Callable[[Path], bool | None] = control_served) -> MpsStatus:
    """Is an MPS control daemon live for this environment's pipe directory? (See the module doc.)"""
    env = os.environ if env is None else env
    pipe = Path(env.get("CUDA_MPS_PIPE_DIRECTORY") or DEFAULT_PIPE_DIRECTORY)
    control = pipe / "control"
    if not os.path.lexists(control):
        return MpsStatus(False, str(pipe), f"no MPS control pipe in {pipe}")
    try:
        pid: int | None = int((pipe / PID_FILE).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        pid = None
    name = process_name(pid) if pid is not None else None
    who = f"pid {pid}" if pid is not None else f"no readable {PID_FILE}"
    live = served(control)
    if live is None:
        return MpsStatus(False, str(pipe), f"{control} is not usable by this user ({who}): side tasks cannot join it")
    if not live:
        return MpsStatus(False, str(pipe), f"the MPS control pipe of {pipe} is not served ({who}): a stale pipe")
    if name is not None and CONTROL_PROCESS in name:
        return MpsStatus(True, str(pipe), f"MPS control daemon pid {pid} at {pipe}")
    return MpsStatus(True, str(pipe), f"an MPS control daemon serves {pipe} ({who} is not visible here: "
                                      "another PID namespace)")


@dataclass(frozen=True)
class MpsPlan:
    """How this manager's CUDA workers relate to MPS, decided once at start."""

    use: bool
    status: MpsStatus
    sm_percent: int
    #: ``off`` with a live daemon: workers get this empty pipe directory so CUDA does not join it.
    private_pipe_directory: str = ""

    def describe(self) -> str:
        if self.use:
            return f"MPS client (priority {SIDE_TASK_CLIENT_PRIORITY}, {self.sm_percent}% of SMs; {self.status.detail})"
        if self.private_pipe_directory:
            return f"no MPS (a daemon runs, but --mps off keeps side tasks out of it; {self.status.detail})"
        return f"no MPS ({self.status.detail})"

    def release(self) -> None:
        """Remove the private pipe directory (``off`` with a live daemon), if this plan made one."""
        if self.private_pipe_directory:
            try:
                os.rmdir(self.private_pipe_directory)
            except OSError:
                pass

    def worker_env(self, memory_limit_bytes: int) -> dict[str, str]:
        """Environment of a side-task process (with ``CUDA_VISIBLE_DEVICES`` naming its one GPU)."""
        if self.use:
            return {
                "CUDA_MPS_PIPE_DIRECTORY": self.status.pipe_directory,
                "CUDA_MPS_CLIENT_PRIORITY": str(SIDE_TASK_CLIENT_PRIORITY),
                "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(self.sm_percent),
                # The client sees its one GPU as device 0. Limits given by UUID have been seen not to
                # apply; by index they do.
                "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"0={max(1, memory_limit_bytes // 2**20)}M",
            }
        if self.private_pipe_directory:
            return {"CUDA_MPS_PIPE_DIRECTORY": self.private_pipe_directory}
        return {}


def plan_mps(mode: MpsMode | str, sm_percent: int = DEFAULT_SM_PERCENT, status: MpsStatus | None = None) -> MpsPlan:
    """Decide the MPS plan for ``--mps MODE``; ``require`` without a live daemon is a ConfigError."""
    try:
        mode = MpsMode(mode)
    except ValueError:
        raise ConfigError(f"--mps must be auto, off or require, got {mode!r}") from None
    if not (isinstance(sm_percent, int) and 1 <= sm_percent <= 100):
        raise ConfigError(f"--mps-sm-percent must be an integer from 1 to 100, got {sm_percent!r}")
    status = status or probe_mps()
    if mode == MpsMode.REQUIRE and not status.live:
        raise ConfigError(f"--mps require: no live MPS control daemon ({status.detail}); "
                          "start one with nvidia-cuda-mps-control -d")
    if mode == MpsMode.OFF:
        private = tempfile.mkdtemp(prefix="freeride-no-mps-") if status.live else ""
        return MpsPlan(False, status, sm_percent, private)
    return MpsPlan(status.live, status, sm_percent)
