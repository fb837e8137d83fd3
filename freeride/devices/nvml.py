"""The NVML seam: the few queries the manager makes of an NVIDIA GPU, behind one small interface.

:class:`PyNvml` is the real one (nvidia-ml-py). NVML is initialised once per instance and every GPU
handle is looked up once and cached; every NVML error becomes a :class:`NvmlError` (a
:class:`~freeride.devices.base.DeviceError`) that names the call, so the manager can turn it into a
device state instead of a crash. Tests and the CUDA code's CPU tests use a fake with the same
methods (``tests/fakes/gpu.py``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from freeride.devices.base import DeviceError

T = TypeVar("T")


class NvmlError(DeviceError):
    """An NVML call failed; ``code`` is NVML's return code where known (-1 otherwise)."""

    def __init__(self, message: str, code: int = -1) -> None:
        super().__init__(message)
        self.code = code


#: NVML's NOT_SUPPORTED: a query this GPU or mode does not offer (process lists on some MIG setups).
NVML_ERROR_NOT_SUPPORTED = 3


@dataclass(frozen=True)
class GpuProcess:
    """A process NVML lists on a GPU; ``used_bytes`` is None where NVML cannot tell (some modes)."""

    pid: int
    used_bytes: int | None


class Nvml(Protocol):
    """The NVML queries freeride makes. Handles are opaque; every method may raise :class:`NvmlError`."""

    def device_count(self) -> int: ...

    def handle_by_index(self, index: int) -> Any: ...

    def handle_by_uuid(self, uuid: str) -> Any: ...

    def uuid(self, handle: Any) -> str: ...

    def name(self, handle: Any) -> str: ...

    def memory(self, handle: Any) -> tuple[int, int]:
        """``(total_bytes, free_bytes)``."""
        ...

    def processes(self, handle: Any) -> list[GpuProcess]:
        """Compute and graphics processes with a context on the GPU (host PIDs)."""
        ...

    def mps_processes(self, handle: Any) -> list[GpuProcess]:
        """MPS clients on the GPU (empty where MPS does not run or NVML cannot list them)."""
        ...

    def driver_version(self) -> str: ...

    def shutdown(self) -> None: ...


class PyNvml:
    """NVML through nvidia-ml-py. Raises NvmlError at construction when no driver is usable."""

    def __init__(self) -> None:
        try:
            import pynvml
        except ImportError as exc:  # a core dependency; still, say what is missing
            raise NvmlError(f"nvidia-ml-py is not installed ({exc})") from None
        self._nvml = pynvml
        self._lock = threading.Lock()  # nvidia-ml-py is not documented as thread-safe
        self._closed = False
        self._call("nvmlInit", pynvml.nvmlInit)

    def _call(self, what: str, fn: Callable[..., T], *args: Any) -> T:
        with self._lock:
            if self._closed:
                raise NvmlError(f"NVML was shut down before {what}")
            try:
                return fn(*args)
            except self._nvml.NVMLError as exc:
                raise NvmlError(f"NVML {what} failed: {exc}", int(getattr(exc, "value", -1))) from None
            except OSError as exc:  # the library itself cannot be loaded
                raise NvmlError(f"NVML {what} failed: {exc}") from None

    @staticmethod
    def _text(value: str | bytes) -> str:
        return value.decode() if isinstance(value, bytes) else str(value)

    def device_count(self) -> int:
        return int(self._call("nvmlDeviceGetCount", self._nvml.nvmlDeviceGetCount))

    def handle_by_index(self, index: int) -> Any:
        return self._call("nvmlDeviceGetHandleByIndex", self._nvml.nvmlDeviceGetHandleByIndex, index)

    def handle_by_uuid(self, uuid: str) -> Any:
        return self._call("nvmlDeviceGetHandleByUUID", self._nvml.nvmlDeviceGetHandleByUUID, uuid.encode())

    def uuid(self, handle: Any) -> str:
        return self._text(self._call("nvmlDeviceGetUUID", self._nvml.nvmlDeviceGetUUID, handle))

    def name(self, handle: Any) -> str:
        return self._text(self._call("nvmlDeviceGetName", self._nvml.nvmlDeviceGetName, handle))

    def memory(self, handle: Any) -> tuple[int, int]:
        info = self._call("nvmlDeviceGetMemoryInfo", self._nvml.nvmlDeviceGetMemoryInfo, handle)
        return int(info.total), int(info.free)

    def _processes(self, what: str, fn: Callable[..., Any], handle: Any) -> list[GpuProcess]:
        try:
            infos = self._call(what, fn, handle)
        except NvmlError as exc:
            if exc.code == NVML_ERROR_NOT_SUPPORTED:
                return []
            raise
        return [GpuProcess(int(i.pid), None if i.usedGpuMemory is None else int(i.usedGpuMemory)) for i in infos]

    def processes(self, handle: Any) -> list[GpuProcess]:
        nv = self._nvml
        return (self._processes("nvmlDeviceGetComputeRunningProcesses", nv.nvmlDeviceGetComputeRunningProcesses, handle)
                + self._processes("nvmlDeviceGetGraphicsRunningProcesses",
                                  nv.nvmlDeviceGetGraphicsRunningProcesses, handle))

    def mps_processes(self, handle: Any) -> list[GpuProcess]:
        fn = getattr(self._nvml, "nvmlDeviceGetMPSComputeRunningProcesses", None)
        if fn is None:
            return []
        return self._processes("nvmlDeviceGetMPSComputeRunningProcesses", fn, handle)

    def driver_version(self) -> str:
        return self._text(self._call("nvmlSystemGetDriverVersion", self._nvml.nvmlSystemGetDriverVersion))

    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._nvml.nvmlShutdown()
            except self._nvml.NVMLError:
                pass


def usage_by_pid(processes: list[GpuProcess]) -> dict[int, int]:
    """Bytes per PID across NVML's lists; a PID in several lists (a compute process that is also an MPS
    client) is counted once, with its largest figure."""
    out: dict[int, int] = {}
    for proc in processes:
        if proc.used_bytes is not None:
            out[proc.pid] = max(out.get(proc.pid, 0), proc.used_bytes)
    return out
