"""``cpu:N``: one CPU core, so that the whole system runs, is tested and is shown without a GPU.

A pipeline stage pinned to core N has real bubbles while it waits on its gloo receive, and side tasks
pinned to the same core harvest them. Memory is the host's RAM; a task's cap is enforced by the
manager's resident-set watchdog (so :meth:`CpuWorkerDevice.used_bytes` reports nothing of its own),
over the worker's resident set once the task is imported and constructed
(:meth:`CpuWorkerDevice.baseline_bytes`): a cap covers what ``setup`` and the steps add, not the
interpreter and libraries every worker loads (torch alone is about 200 MiB of resident set).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Sequence

import psutil

from freeride.devices.base import Device, DeviceName, WorkerDevice, lower_priority

_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")

#: The calling thread's scheduler figures: time on the core, time waiting for it (run delay), slices.
SCHEDSTAT_PATH = "/proc/thread-self/schedstat"

#: One core per device: torch and BLAS must not spread threads over other stages' cores.
CPU_WORKER_THREADS = "1"


class ProcField:
    """One number of a ``/proc`` file, read by one ``pread`` of a descriptor kept open (~1-3 us): the ``field``-th
    whitespace-separated one. Opened at the first read, by the reading thread (``/proc/thread-self`` then names
    that thread for good; ``/proc/<pid>`` that process, so a read after it is reaped fails rather than reading a
    process that took its pid); :meth:`read` is None where the file cannot be opened or read, then and from then on."""

    def __init__(self, path: str, field: int) -> None:
        self._path = path
        self._field = field
        self._fd: int | None = None
        self._missing = False

    def read(self) -> int | None:
        words = self._words()
        try:
            return None if words is None else int(words[self._field])
        except (IndexError, ValueError):
            self.close()
            return None

    def read_first(self, count: int) -> tuple[int, ...] | None:
        """The file's first ``count`` numbers, from one read (figures of one moment: a process's run time and run
        delay); None as :meth:`read`."""
        words = self._words()
        if words is None:
            return None
        try:
            if len(words) < count:
                raise ValueError(f"{len(words)} numbers")
            return tuple(int(w) for w in words[:count])
        except ValueError:
            self.close()
            return None

    def _words(self) -> list[bytes] | None:
        fd = self._fd
        if fd is None:
            if self._missing:
                return None
            try:
                fd = self._fd = os.open(self._path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                self._missing = True
                return None
        try:
            return os.pread(fd, 128, 0).split()
        except OSError:
            self.close()
            return None

    def close(self) -> None:
        """Close its descriptor: :meth:`read` is None from then on."""
        self._missing = True
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


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
    """Inside a worker of ``cpu:N``: pinned to core N, at the lowest priority.

    At nice 19 the worker gets its core only when nothing else wants it: a step begun while the trainer
    still does host work at a bubble's start, or while its manager handles the bubble, waits for the core
    before it computes. That wait is the core not being idle, not the step's cost: counted as step time it
    made a task of 0.2 ms steps measure a p95 of 1-2 ms on a rank whose bubbles last ~0.8 ms, so that it
    was granted almost none of them and never measured its real steps again. :meth:`waited_ns` is the
    kernel's count of it: the thread's run delay (the second field of ``/proc/thread-self/schedstat``),
    read with one ``pread`` (~1 us) of a descriptor opened by the stepping thread.
    """

    def __init__(self, name: DeviceName) -> None:
        super().__init__(name)
        self._run_delay = ProcField(SCHEDSTAT_PATH, 1)  # the second field: time runnable without a core (ns)
        self._resident_pages = ProcField("/proc/self/statm", 1)

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

    def resident_bytes(self) -> int | None:
        """The resident set as the manager's watchdog reads it (``/proc/self/statm``), by one ``pread`` of a
        descriptor kept open (a few microseconds); None where it cannot be read."""
        pages = self._resident_pages.read()
        return None if pages is None else pages * _PAGE_SIZE

    def waited_ns(self) -> int | None:
        """The run delay of the thread that first asked (the worker's stepping thread), in ns; None where the
        kernel does not keep it (no ``/proc/thread-self/schedstat``: a kernel without ``CONFIG_SCHED_INFO``)."""
        return self._run_delay.read()


def check_cpu_device(name: DeviceName) -> None:
    """Raise ConfigError unless a thread of this process may be pinned to core ``name.index``: in this process's
    affinity, or outside it but allowed (online, in the cgroup's cpuset). A manager run under ``taskset -c K`` on a
    core no rank uses, as its warning advises, serves ``cpu:N`` with workers that pin themselves to core N: its
    own affinity refused the device ("this machine offers CPU cores cpu:0")."""
    from freeride.errors import ConfigError

    if not _may_pin(name.index):
        cores = [c for c in range(os.cpu_count() or 1) if _may_pin(c)]
        raise ConfigError(
            f"unknown device {name}: this machine offers CPU cores {', '.join(f'cpu:{c}' for c in cores)}"
        )


def _may_pin(core: int) -> bool:
    """Whether a thread of this process may be pinned to ``core`` (tried on a throwaway thread, outside this
    process's affinity: the kernel refuses a core that is offline or outside the cgroup's cpuset)."""
    if core in os.sched_getaffinity(0):
        return True
    if core < 0:
        return False
    pinned: list[bool] = []

    def probe() -> None:
        try:
            os.sched_setaffinity(0, {core})  # this thread only (Linux): gone with it
            pinned.append(True)
        except (OSError, ValueError, OverflowError):
            pinned.append(False)

    thread = threading.Thread(target=probe, name="freeride-core-probe", daemon=True)
    thread.start()
    thread.join()
    return pinned == [True]
