"""Devices: everything that differs between a GPU and a CPU core lives behind :class:`Device`.

A device is named ``cuda:N`` (one GPU) or ``cpu:N`` (one CPU core). The CPU form exists so that the
whole system runs, is tested and is demonstrated without a GPU: a pipeline stage pinned to core N
has real bubbles while it waits on its gloo receive, and side tasks pinned to the same core harvest
them.

Each device answers three questions for the manager (free memory, how much a side-task process
uses, which environment a worker needs) and prepares a worker process for itself
(:meth:`Device.prepare_worker`: core pinning and priority on CPU, allocator caps on CUDA). Device
queries run in the manager, never on the trainer's path.
"""

from __future__ import annotations

import abc
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

import psutil

from freeride.errors import ConfigError

log = logging.getLogger(__name__)

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
    """Parse ``cpu:N`` or ``cuda:N`` (syntax only; :func:`open_device` checks it exists)."""
    match = _DEVICE_RE.match(text.strip()) if isinstance(text, str) else None
    if match is None:
        raise ConfigError(f"unknown device {text!r}: expected cpu:N or cuda:N, e.g. cpu:0")
    return DeviceName(match.group(1), int(match.group(2)))


class Device(abc.ABC):
    """One device that a manager owns and its side tasks run on."""

    def __init__(self, name: DeviceName) -> None:
        self.name = name

    def __str__(self) -> str:
        return str(self.name)

    @property
    @abc.abstractmethod
    def torch_device(self) -> str:
        """The device string a side task passes to torch (``cpu`` or ``cuda:N``)."""

    @abc.abstractmethod
    def free_memory_bytes(self) -> int:
        """Free memory of the device now, as the manager sees it."""

    @abc.abstractmethod
    def process_memory_bytes(self, pids: list[int]) -> int:
        """Device memory held by these processes together (0 for those gone)."""

    def worker_env(self, memory_limit_bytes: int) -> dict[str, str]:
        """Extra environment for a worker process of this device."""
        return {}

    @abc.abstractmethod
    def prepare_worker(self, memory_limit_bytes: int) -> None:
        """Called inside a fresh worker process before any task code runs."""


_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


def _rss(pid: int) -> int:
    """Resident set size from /proc/PID/statm: about 20 us, cheap enough to poll often."""
    try:
        with open(f"/proc/{pid}/statm", "rb") as fh:
            return int(fh.read().split()[1]) * _PAGE_SIZE
    except (OSError, IndexError, ValueError):
        return 0


class CpuDevice(Device):
    """One CPU core; memory is the host's RAM, capped per task by a resident-set watchdog."""

    @property
    def torch_device(self) -> str:
        return "cpu"

    def free_memory_bytes(self) -> int:
        return int(psutil.virtual_memory().available)

    def process_memory_bytes(self, pids: list[int]) -> int:
        return sum(_rss(pid) for pid in pids)

    def worker_env(self, memory_limit_bytes: int) -> dict[str, str]:
        # One core per device: keep torch and BLAS from spreading threads over other stages' cores.
        return {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}

    def prepare_worker(self, memory_limit_bytes: int) -> None:
        # torch is not imported here: a task that never uses it should not pay its memory and
        # start-up time. OMP_NUM_THREADS from worker_env keeps torch to one thread when it loads.
        os.sched_setaffinity(0, {self.name.index})
        os.nice(WORKER_NICENESS)
        lower_autogroup_priority(WORKER_NICENESS)


def lower_autogroup_priority(niceness: int) -> bool:
    """Give this process's autogroup the niceness too; True when the kernel took it.

    A worker starts in a session of its own, and with ``sched_autogroup_enabled`` (the default on
    many distributions) the scheduler shares a core fairly between *sessions* first: a nice 19
    worker in its own session then competes with the trainer as an equal (measured: 1.53 s of CPU
    against 1.76 s for a nice 0 loop), and its niceness only ranks it inside its session. Setting
    the autogroup's nice restores the intent. Without autogroups the file is absent: nothing to do.
    """
    try:
        with open("/proc/self/autogroup", "w") as fh:
            fh.write(str(niceness))
    except OSError:
        return False
    return True


def mps_pipe_directory() -> Path | None:
    """The pipe directory of a running CUDA MPS control daemon, or None."""
    candidate = Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"))
    return candidate if (candidate / "control").exists() else None


class CudaDevice(Device):
    """One NVIDIA GPU. Caps: torch allocator fraction, CuPy pool limit, MPS pinned limit."""

    @property
    def torch_device(self) -> str:
        return f"cuda:{self.name.index}"

    def _nvml_handle(self) -> object:
        import pynvml

        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetHandleByIndex(self.name.index)

    def total_memory_bytes(self) -> int:
        import pynvml

        return int(pynvml.nvmlDeviceGetMemoryInfo(self._nvml_handle()).total)

    def free_memory_bytes(self) -> int:
        import pynvml

        return int(pynvml.nvmlDeviceGetMemoryInfo(self._nvml_handle()).free)

    def process_memory_bytes(self, pids: list[int]) -> int:
        import pynvml

        handle = self._nvml_handle()
        wanted = set(pids)
        used = 0
        for getter in (
            pynvml.nvmlDeviceGetComputeRunningProcesses,
            pynvml.nvmlDeviceGetGraphicsRunningProcesses,
        ):
            try:
                for info in getter(handle):
                    if info.pid in wanted and info.usedGpuMemory is not None:
                        used += int(info.usedGpuMemory)
            except pynvml.NVMLError:
                continue
        return used

    def worker_env(self, memory_limit_bytes: int) -> dict[str, str]:
        env: dict[str, str] = {}
        if mps_pipe_directory() is not None:
            # MPS clients: below-normal priority and a pinned-memory limit the driver enforces.
            env["CUDA_MPS_CLIENT_PRIORITY"] = "1"
            env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = f"{self.name.index}={memory_limit_bytes // 2**20}M"
        return env

    def prepare_worker(self, memory_limit_bytes: int) -> None:
        os.nice(WORKER_NICENESS)
        import torch

        torch.cuda.set_device(self.name.index)
        total = torch.cuda.get_device_properties(self.name.index).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, memory_limit_bytes / total), self.name.index)
        try:
            import cupy

            with cupy.cuda.Device(self.name.index):
                cupy.get_default_memory_pool().set_limit(size=memory_limit_bytes)
        except ImportError:
            pass


def open_device(name: str | DeviceName) -> Device:
    """Return the :class:`Device` for a name, checking that it exists on this machine."""
    parsed = parse_device_name(name) if isinstance(name, str) else name
    if parsed.kind == "cpu":
        cores = sorted(os.sched_getaffinity(0))
        if parsed.index not in cores:
            raise ConfigError(
                f"unknown device {parsed}: this machine offers CPU cores "
                f"{', '.join(f'cpu:{c}' for c in cores)}"
            )
        return CpuDevice(parsed)
    try:
        import pynvml

        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
    except Exception as exc:  # NVML raises its own hierarchy, or the library is missing
        raise ConfigError(f"unknown device {parsed}: no NVIDIA driver is usable here ({exc})") from None
    if parsed.index >= count:
        raise ConfigError(f"unknown device {parsed}: this machine has {count} GPU(s)")
    return CudaDevice(parsed)
