"""A side task's process: its environment, threads, core and priority, set before any task code loads.

Two kinds of process run side-task code, and both use this module so that they are the same process:

* a **worker**: its manager starts it with :func:`worker_environment`, and the runtime calls
  :func:`prepare_process` before it imports the task's module;
* ``freeride run-task`` (:mod:`freeride.standalone`), which measures a task alone so that its user can
  size steps and caps: it applies :func:`worker_environment` to its own process and pins it
  (:func:`pin_to_core`) before it imports the task, then :func:`prepare_process` before it builds
  it. Its step times and memory are then a worker's.

**The order is the point.** torch, OpenMP and the BLAS libraries size their thread pools once, when
they are first loaded, from the environment (``OMP_NUM_THREADS``, ...) and the cores the process may
use at that moment. A task module imported before these settings (run-task did that) starts one
thread per core, and the process is then pinned to one core: its threads take turns on it, spinning
at every barrier, and a step of a small torch task took 14-65x longer than in a worker.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from freeride.devices import Device, DeviceName, WorkerDevice
from freeride.devices.cpu import ProcField

#: The directory that holds the ``freeride`` package: a worker imports it from there whatever its cwd.
PACKAGE_ROOT = str(Path(__file__).resolve().parents[1])


def worker_environment(device: Device, memory_limit_bytes: int, *, command: bool = False,
                       base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The whole environment a worker of ``device`` starts with.

    ``base`` (default: this process's environment) with the device's settings (thread counts of torch,
    OpenMP and BLAS; on a GPU the one GPU the worker sees and its MPS settings: see
    :meth:`Device.worker_env`), unbuffered output (a crash loses no line of the log), and freeride
    importable from any working directory.
    """
    env = dict(os.environ if base is None else base)
    env.update(device.worker_env(memory_limit_bytes, command=command))
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PACKAGE_ROOT, env.get("PYTHONPATH", "")) if p)
    return env


def enter_worker_environment(device: Device, memory_limit_bytes: int) -> None:
    """Give this process the environment a worker of ``device`` starts with (``freeride run-task``).

    Only worth it before the libraries that read it are loaded: see the module doc.
    """
    os.environ.update(worker_environment(device, memory_limit_bytes))


def pin_to_core(name: DeviceName) -> None:
    """On ``cpu:N``, this process on core N alone, as a worker's preparation does first; nothing on a GPU.

    ``freeride run-task`` pins before it imports the task and lowers its priority only after: see
    :func:`freeride.standalone.run_standalone`.
    """
    if name.kind == "cpu":
        os.sched_setaffinity(0, {name.index})


def prepare_process(device: WorkerDevice, memory_limit_bytes: int, *, command: bool = False) -> None:
    """Make this process a side-task process of ``device``, before any task code is imported.

    The device's preparation (:meth:`WorkerDevice.prepare`: on ``cpu:N`` pinned to core N at nice 19;
    on a GPU low priority, the context, the one cap, two threads), then torch's thread pool matched to
    the environment if torch is loaded already (something imported it before the task: a site hook,
    an embedding program), since its pool was sized when it loaded.
    """
    device.prepare(memory_limit_bytes, command=command)
    torch = sys.modules.get("torch")
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if torch is not None and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))


def schedstat(pid: int) -> ProcField:
    """Process ``pid``'s ``/proc/<pid>/schedstat``, for :func:`sched_times` to read again and again by one ``pread``
    of a descriptor kept open (~1 us against ~10 us for an open); the descriptor names that process, so once it is
    reaped the reads fail rather than read a process that took its pid. Close it when done."""
    return ProcField(f"/proc/{pid}/schedstat", 1)


def sched_times(source: int | ProcField) -> tuple[int, int]:
    """How long a process's main thread has run, and how long it has been runnable but waiting for a core, in ns
    (the first two fields of ``/proc/<pid>/schedstat``), of the process ``source`` or through the reader
    :func:`schedstat` gave; (-1, -1) when they cannot be read (gone, or a kernel without scheduler statistics). The
    kernel books a wait when it ends: a thread waiting now has not had it counted yet."""
    reader = source if isinstance(source, ProcField) else schedstat(source)
    try:
        times = reader.read_first(2)
    finally:
        if reader is not source:
            reader.close()
    return (times[0], times[1]) if times is not None else (-1, -1)


def process_state(pid: int) -> str:
    """Process ``pid``'s state letter in ``/proc/<pid>/stat`` (R: running or waiting for a core; S, D: asleep;
    T: stopped), "" when it is gone. ~60 us: read only where a cheaper figure asks."""
    fields = _stat_fields(pid)
    try:
        return fields[0].decode() if fields else ""
    except UnicodeDecodeError:
        return ""


#: A task's flags (``/proc/<pid>/stat``'s ninth field) while it dies: ``PF_EXITING`` (in the kernel's exit path),
#: ``PF_DUMPCORE`` (writing its core), ``PF_SIGNALED`` (killed by a signal).
_PF_DYING = 0x4 | 0x200 | 0x400


def process_dying(pid: int) -> bool:
    """Whether process ``pid`` is on its way out: exiting, dumping its core, a zombie, or gone (its main thread's
    flags, ~10 us). A worker that crashed closes its channel at once, and at nice 19 on a busy core its exit can
    take longer than the manager's grace for it."""
    fields = _stat_fields(pid)
    try:
        return not fields or fields[0] in (b"Z", b"X") or bool(int(fields[6]) & _PF_DYING)
    except (IndexError, ValueError):
        return True


def _stat_fields(pid: int) -> list[bytes]:
    """The fields of ``/proc/<pid>/stat`` after the command's name (state first); [] when it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return []


#: A group's watch (``sh -c``; ``$0``: the group's id, its leader's pid). After its pipe's end-of-file it waits until
#: the leader is gone or dead (a leader that closed every descriptor closed the pipe too, and is judged by whoever
#: started it), polling ``/proc`` every 0.1 s, then kills the group.
_GROUP_WATCH_SCRIPT = (
    'read _ ; '
    'while s=$(cat "/proc/$0/stat" 2>/dev/null) && [ -n "$s" ]; do '
    'case "${s##*) }" in Z*) break ;; esac ; sleep 0.1 ; done ; '
    'kill -s KILL -- -"$0" 2>/dev/null'
)


def watch_group(pgid: int) -> int:
    """Have process group ``pgid`` killed once this process is gone and the group's leader (pid ``pgid``) is gone
    or dead: however this process dies, a manager killed with -9 included, after which nobody is left to kill
    the group, and what it started lives on, reparented, and stopped for good if a freeze had stopped the group
    (such a group is orphaned, so the kernel continues none of it).

    A tiny shell in a session of its own (never stopped with the group) reads a pipe whose write end only this
    process holds (:data:`_GROUP_WATCH_SCRIPT`); the write end is returned: closing it ends the watch the same
    way (the group is killed once its leader is gone). Not inherited by what this process starts (PEP 446).
    OSError when the watch cannot start."""
    read_end, write_end = os.pipe()
    try:
        subprocess.Popen(["/bin/sh", "-c", _GROUP_WATCH_SCRIPT, str(pgid)],  # noqa: S603 - fixed argv
                         stdin=read_end, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)
    except OSError:
        os.close(write_end)
        raise
    finally:
        os.close(read_end)
    return write_end


def process_cpu_ns(pid: int) -> int | None:
    """The CPU time of process ``pid`` (all its threads, as its own ``CLOCK_PROCESS_CPUTIME_ID`` reads it);
    None when it is gone or the clock cannot be read.

    Linux names another process's CPU clock ``(~pid << 3) | 2`` (a process-wide clock, the scheduler's
    runtime sum), readable by any process for ~1 us: what the manager reads at a freeze, where
    ``/proc/<pid>/stat`` would cost ~60 us and tick-granular figures.
    """
    try:
        return time.clock_gettime_ns(((~pid) << 3) | 2)
    except (OSError, OverflowError):
        return None
