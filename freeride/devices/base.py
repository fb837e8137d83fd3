"""The device seam's shapes: names, the manager's view of a device, a worker's view of it.

A device is named ``cuda:N`` (one GPU, numbered as the training job sees it) or ``cpu:N`` (one CPU
core). Two views of it, because two kinds of process use it:

* :class:`Device`, in the manager: what memory is free, how much each side task's processes hold
  (:meth:`Device.sample`, called on the device poller's thread, never on the manager's loop), and the
  environment a worker starts with (:meth:`Device.worker_env`).
* :class:`WorkerDevice`, inside a worker: prepare the process before any task code runs (core
  pinning and priority; on a GPU the context, the allocator caps and the thread count), wait for a
  step's device work before the runtime times it (:meth:`WorkerDevice.synchronize`), and say how much
  memory the worker holds as the device counts it (:meth:`WorkerDevice.used_bytes`), the fallback
  when the manager cannot see the worker's processes on the device (containers, MPS).
"""

from __future__ import annotations

import abc
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from freeride.devices.time_slice import set_time_slice
from freeride.errors import ConfigError, FreerideError

_DEVICE_RE = re.compile(r"^(cpu|cuda):(\d+)$")

#: ``os.nice`` increment for side-task workers: the trainer always wins the core.
WORKER_NICENESS = 19


@dataclass(frozen=True)
class DeviceName:
    """A parsed device name; ``str()`` gives it back as ``kind:index``."""

    kind: str
    index: int

    def __str__(self) -> str:
        return f"{self.kind}:{self.index}"

    @property
    def slug(self) -> str:
        """A file-name-safe form, e.g. ``cpu-0``."""
        return f"{self.kind}-{self.index}"


def parse_device_name(text: str) -> DeviceName:
    """Parse ``cpu:N`` or ``cuda:N`` (syntax only; :func:`freeride.devices.open_device` checks it exists)."""
    match = _DEVICE_RE.match(text.strip()) if isinstance(text, str) else None
    if match is None:
        several = isinstance(text, str) and "," in text
        raise ConfigError(f"unknown device {text!r}: expected cpu:N or cuda:N, e.g. cpu:0" + (
            "; one device per --device (repeat it), or --devices cpu:0,cpu:1 where a command takes several"
            if several else ""))
    return DeviceName(match.group(1), int(match.group(2)))


class DeviceError(FreerideError):
    """The device cannot be queried (a lost GPU, a driver and library that do not match, ...).

    The manager turns it into a device state (NOT_SERVING, with this message as the reason) and
    never lets it escape its loop.
    """


class WorkerSetupError(FreerideError):
    """A worker's device preparation refused the task; ``kind`` is its failure kind (``MEMORY_LIMIT``)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class DeviceSample:
    """One reading of a device: its free memory and what each side task holds on it.

    ``task_bytes`` has an entry for every task asked about: 0 when its processes hold nothing the
    device can see. ``host_bytes``, where the device's memory is not the host's (a GPU), is each task's
    resident set on the host. ``error`` is set instead when the device could not be read.
    """

    free_bytes: int | None
    task_bytes: Mapping[str, int] = field(default_factory=dict)
    error: str = ""
    host_bytes: Mapping[str, int] = field(default_factory=dict)


class Device(abc.ABC):
    """One device as its manager sees it."""

    def __init__(self, name: DeviceName) -> None:
        self.name = name

    def __str__(self) -> str:
        return str(self.name)

    @abc.abstractmethod
    def free_memory_bytes(self) -> int:
        """Free memory of the device now. Raises :class:`DeviceError` when it cannot be read."""

    def total_memory_bytes(self) -> int | None:
        """All the memory the device has (a cap above it can never be placed); None when unknown."""
        return None

    @abc.abstractmethod
    def process_memory_bytes(self, pids: Sequence[int]) -> int:
        """Device memory these processes hold together (0 for those gone or not visible).

        Raises :class:`DeviceError` when the device cannot be read.
        """

    def sample(self, task_pids: Mapping[str, Sequence[int]], *, free: bool = True) -> DeviceSample:
        """Free memory (when ``free``) and each task's usage in one reading; never raises."""
        try:
            free_bytes = self.free_memory_bytes() if free else None
            usage = {task: self.process_memory_bytes(pids) for task, pids in task_pids.items()}
        except DeviceError as exc:
            return DeviceSample(None, {}, str(exc))
        return DeviceSample(free_bytes, usage)

    def worker_env(self, memory_limit_bytes: int, *, command: bool = False) -> dict[str, str]:
        """Extra environment for a worker of this device (``command``: it runs a command task)."""
        return {}

    def describe(self) -> str:
        """One line naming the device for logs and statistics."""
        return str(self.name)

    def close(self) -> None:  # noqa: B027 - optional: most devices hold nothing to release
        """Release what the device holds (NVML, for one); the manager calls it once, at exit."""


class WorkerDevice(abc.ABC):
    """One device as a worker process sees it, after its manager prepared its environment."""

    def __init__(self, name: DeviceName) -> None:
        self.name = name
        #: What the device's runtime holds before the task allocates anything (the CUDA context).
        self.context_bytes = 0

    @property
    @abc.abstractmethod
    def torch_device(self) -> str:
        """The device string a side task allocates on (``cpu``; ``cuda:0`` in a GPU worker, which sees
        only its own GPU)."""

    @abc.abstractmethod
    def prepare(self, memory_limit_bytes: int, *, command: bool = False) -> None:
        """Called once in a fresh worker before any task code runs.

        ``command``: the task is a command in its own process; this process then creates no device
        context of its own. Raises :class:`WorkerSetupError` when the task cannot run within its cap.
        """

    def synchronize(self) -> None:  # noqa: B027 - optional: a CPU core has no queue to wait for
        """Return once the work this process queued on the device is done (no-op on a CPU core)."""

    def waited_ns(self) -> int | None:
        """How long, in all, the calling thread has waited for the device while it could have run on it: the
        part of a step's wall time that is the device busy with others, not the step's own cost. None where
        the device keeps no such count (a GPU: a step's device time is what it costs there).

        A step's cost (what the worker's admission estimate and the manager's placement learn) is its
        wall time less what this count grew by over it."""
        return None

    def used_bytes(self) -> int:
        """Device memory this process holds as the device counts it; 0 where the manager measures it."""
        return 0

    def resident_bytes(self) -> int | None:
        """This process's resident set now, where the task's cap is the host's and the worker checks it too
        between steps (a CPU core); None where it does not."""
        return None

    def peak_bytes(self) -> int:
        """The most :meth:`used_bytes` has been since :meth:`prepare`, as far as it is known."""
        return self.used_bytes()

    def baseline_bytes(self) -> int:
        """What the manager's figure for this process holds that the task's cap does not cover.

        Read once the task is imported and constructed, before ``setup``. On a GPU it is 0: the
        device holds nothing for a worker but its context, which the cap covers (see
        :mod:`freeride.devices.cuda`). On a CPU core the manager counts resident sets, and a worker
        holds the interpreter, freeride and the task's libraries before the task allocates anything
        (about 200 MiB once torch is imported): the cap covers the task's growth beyond that.
        """
        return 0

    def host_baseline_bytes(self) -> int:
        """Where the device's memory is not the host's (a GPU): this worker's resident set once the task
        is imported and constructed, read with :meth:`baseline_bytes`; the manager caps the host
        memory the task grows by beyond it. 0 where the device's memory is the host's (a CPU core:
        :meth:`baseline_bytes` is that baseline already)."""
        return 0


#: The nice a manager gives its autogroup where it may (``freeride manager`` leading its session, as
#: ``freeride launch`` and the demo start it, with CAP_SYS_NICE): see :func:`set_autogroup_nice`.
MANAGER_AUTOGROUP_NICE = -10
#: The kernel takes one autogroup nice change per 100 ms, machine-wide (EAGAIN otherwise).
_AUTOGROUP_RETRIES, _AUTOGROUP_RETRY_S = 5, 0.11


def set_autogroup_nice(niceness: int, path: str = "/proc/self/autogroup",
                       sleep: Callable[[float], None] = time.sleep) -> str:
    """Give this process's autogroup ``niceness``: "" when the kernel took it, else why not, in one line.

    With ``sched_autogroup_enabled`` (the default on many distributions) the scheduler shares a core
    between *sessions* first, and a thread's own nice only ranks it inside its session.

    * **A worker** (nice 19) starts in a session of its own: it would compete with the trainer as an
      equal (measured: 1.53 s of CPU against 1.76 s for a nice 0 loop); its autogroup at 19 restores
      the intent.
    * **A manager** that leads its session sleeps most of the time, so its autogroup's weight on a core
      is small beside a trainer rank's, which computes without a break: on a core shared with the
      slower rank (Interleaved1F1B, two CPU ranks, ``perf sched``) the manager waited for the core up to
      38-57 ms while the rank ran uninterrupted, and a bubble's start reached it p95 12.7 ms late. At
      ``MANAGER_AUTOGROUP_NICE`` the same run read starts p95 0.3 ms late (p99 1.1 ms), and its iterations
      were no slower (p50 76 / 96 / 109 ms on 1F1B / Interleaved1F1B / ZBV against 79-85 / 107-121 /
      102-117 ms in two runs at nice 0): the manager's CPU time is the same, taken sooner, and it parks and
      freezes its worker as the trainer needs the core back.

    Only a process that leads its session touches it: the autogroup is the *session's*, and its nice
    outlives the process. A standalone measurement or ``run-task`` started from a terminal, or a bench's
    probe, shares the caller's session; writing there put the user's shell, and every trainer and
    manager started from it afterwards, at nice 19 against the rest of the machine (found: a manager
    of a bench run from such a session waited 2.6 ms for a core at each wake-up). Such a process keeps
    its own nice and leaves the session alone; a caller that wants the conditions starts it in a session
    of its own. A nice below 0 needs CAP_SYS_NICE (or RLIMIT_NICE); without autogroups the file is
    absent and there is nothing to do.
    """
    if os.getsid(0) != os.getpid():
        return "it does not lead its session (the autogroup is the session's)"
    for attempt in range(_AUTOGROUP_RETRIES):
        try:
            _write_existing(path, str(niceness))
            return ""
        except FileNotFoundError:
            return "the kernel schedules no autogroups"
        except PermissionError:
            return "not permitted (a nice below 0 needs CAP_SYS_NICE or RLIMIT_NICE)"
        except BlockingIOError:  # another process changed one within the last 100 ms
            if attempt + 1 < _AUTOGROUP_RETRIES:
                sleep(_AUTOGROUP_RETRY_S)
        except OSError as exc:
            return f"the kernel refused it ({exc.strerror or exc})"
    return "the kernel was busy with other autogroup changes (EAGAIN)"


def _write_existing(path: str, text: str) -> None:
    """Write ``text`` to a file that must exist (a kernel file: never created)."""
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def lower_autogroup_priority(niceness: int) -> bool:
    """A worker's autogroup at ``niceness`` (:func:`set_autogroup_nice`); True when the kernel took it."""
    return not set_autogroup_nice(niceness)


def lower_priority() -> None:
    """Nice 19 for this process and its autogroup: the trainer's threads always win a core. And the
    kernel's default time slice: the manager's loop thread that started it runs with a short one, which
    a process inherits (:mod:`freeride.devices.time_slice`)."""
    os.nice(WORKER_NICENESS)
    lower_autogroup_priority(WORKER_NICENESS)
    set_time_slice(None)
