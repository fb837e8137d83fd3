"""``cpu:N``: one CPU core, so that the whole system runs, is tested and is shown without a GPU.

A pipeline stage pinned to core N has real bubbles while it waits on its gloo receive, and side tasks
pinned to the same core harvest them. Memory is the host's RAM; a task's cap is enforced by the
manager's resident-set watchdog (so :meth:`CpuWorkerDevice.used_bytes` reports nothing of its own),
over the worker's resident set once the task is imported and constructed
(:meth:`CpuWorkerDevice.baseline_bytes`): a cap covers what ``setup`` and the steps add, not the
interpreter and libraries every worker loads (torch alone is about 200 MiB of resident set).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import psutil

from freeride.devices.base import Device, DeviceName, WorkerDevice, lower_priority

_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")

#: One core per device: torch and BLAS must not spread threads over other stages' cores.
CPU_WORKER_THREADS = "1"


def rss_bytes(pid: int) -> int:
    """Resident set size from /proc/PID/statm: about 20 us, cheap enough to poll often."""
    try:
        with open(f"/proc/{pid}/statm", "rb") as fh:
            return int(fh.read().split()[1]) * _PAGE_SIZE
    except (OSError, IndexError, ValueError):
        return 0


class CpuDevice(Device):
    """One CPU core; memory is the host's RAM, capped per task by a resident-set watchdog."""

    def free_memory_bytes(self) -> int:
        return int(psutil.virtual_memory().available)

    def total_memory_bytes(self) -> int | None:
        return int(psutil.virtual_memory().total)

    def process_memory_bytes(self, pids: Sequence[int]) -> int:
        return sum(rss_bytes(pid) for pid in pids)

    def worker_env(self, memory_limit_bytes: int, *, command: bool = False) -> dict[str, str]:
        return {name: CPU_WORKER_THREADS for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")}


class CpuWorkerDevice(WorkerDevice):
    """Inside a worker of ``cpu:N``: pinned to core N, at the lowest priority."""

    @property
    def torch_device(self) -> str:
        return "cpu"

    def prepare(self, memory_limit_bytes: int, *, command: bool = False) -> None:
        # torch is not imported here: a task that never uses it should not pay its memory and start-up
        # time. OMP_NUM_THREADS from worker_env keeps torch to one thread when it loads.
        os.sched_setaffinity(0, {self.name.index})
        lower_priority()

    def baseline_bytes(self) -> int:
        return rss_bytes(os.getpid())


def check_cpu_device(name: DeviceName) -> None:
    """Raise ConfigError unless this process may run on core ``name.index``."""
    from freeride.errors import ConfigError

    cores = sorted(os.sched_getaffinity(0))
    if name.index not in cores:
        raise ConfigError(
            f"unknown device {name}: this machine offers CPU cores {', '.join(f'cpu:{c}' for c in cores)}"
        )
