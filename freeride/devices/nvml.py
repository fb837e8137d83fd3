"""The NVML seam: the few queries the manager makes of an NVIDIA GPU, behind one small interface.

:class:`PyNvml` is the real one (nvidia-ml-py). NVML is initialised once per instance and every GPU
handle is looked up once and cached; every NVML error becomes a :class:`NvmlError` (a
:class:`~freeride.devices.base.DeviceError`) that names the call and keeps NVML's code, so the manager
can turn it into a device state instead of a crash. The CPU tests run this same class over a fake of
the ``pynvml`` module (``tests/gpu_fakes.py``).

What each query gives on the set-ups NVML documents:

* **MIG.** ``nvmlDeviceGetHandleByIndex`` counts physical GPUs only; a MIG slice is a *MIG device*
  under its GPU (``nvmlDeviceGetMigDeviceHandleByIndex``) with a ``MIG-`` UUID of its own, which is what
  CUDA reports for it. :meth:`PyNvml.mig_uuids` lists them, and :meth:`PyNvml.handle_by_uuid` finds a
  MIG device's handle by enumerating them where the driver's UUID lookup does not.
* **Process lists** that a GPU or mode does not offer (``NOT_SUPPORTED``), or that this user may not
  read (``NO_PERMISSION``: a MIG GPU's aggregate list without privileges) are empty: the workers'
  own reports count then. The MPS-client list is auxiliary (clients also appear in the compute list
  where NVML can list them): any error there makes it empty, logged once, and never takes the device
  down.
* **A stuck call** (a GPU in trouble can hold an NVML call for minutes) must not hold the manager's
  exit: :meth:`PyNvml.shutdown` waits for the call in flight at most ``shutdown_wait_s`` and leaves
  NVML to the process's exit otherwise.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from freeride.devices.base import DeviceError

log = logging.getLogger(__name__)

T = TypeVar("T")


class NvmlError(DeviceError):
    """An NVML call failed; ``code`` is NVML's return code where known (-1 otherwise)."""

    def __init__(self, message: str, code: int = -1) -> None:
        super().__init__(message)
        self.code = code


#: NVML return codes freeride tells apart (nvml.h).
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
#: nvmlComputeMode_t: only one process may hold a context (the MPS server, where one runs), or none.
COMPUTE_MODE_DEFAULT = 0
COMPUTE_MODE_PROHIBITED = 2
COMPUTE_MODE_EXCLUSIVE_PROCESS = 3
COMPUTE_MODE_NAMES = {0: "DEFAULT", 1: "EXCLUSIVE_THREAD", 2: "PROHIBITED", 3: "EXCLUSIVE_PROCESS"}
_MIG_ENABLED = 1
#: Process lists that come back empty rather than as an error (see the module doc).
_UNLISTABLE = (NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_NO_PERMISSION)


@dataclass(frozen=True)
class GpuProcess:
    """A process NVML lists on a GPU; ``used_bytes`` is None where NVML cannot tell (some modes)."""

    pid: int
    used_bytes: int | None


class Nvml(Protocol):
    """The NVML queries freeride makes. Handles are opaque; every method may raise :class:`NvmlError`."""

    def device_count(self) -> int:
        """Physical GPUs (MIG devices are listed by :meth:`mig_uuids`)."""
        ...

    def handle_by_index(self, index: int) -> Any: ...

    def handle_by_uuid(self, uuid: str) -> Any:
        """A GPU's (``GPU-...``) or a MIG device's (``MIG-...``) handle."""
        ...

    def uuid(self, handle: Any) -> str: ...

    def name(self, handle: Any) -> str: ...

    def memory(self, handle: Any) -> tuple[int, int]:
        """``(total_bytes, free_bytes)``."""
        ...

    def mig_uuids(self, handle: Any) -> list[str]:
        """The UUIDs of a physical GPU's MIG devices; empty where MIG is off or not offered."""
        ...

    def compute_mode(self, handle: Any) -> int:
        """The GPU's compute mode (``COMPUTE_MODE_*``); -1 where NVML cannot tell."""
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
    """NVML through nvidia-ml-py (``module``: a stand-in for ``pynvml``, in tests). Raises NvmlError at
    construction when no driver is usable."""

    def __init__(self, module: Any = None, *, shutdown_wait_s: float = 2.0) -> None:
        if module is None:
            try:
                import pynvml
            except ImportError as exc:  # a core dependency; still, say what is missing
                raise NvmlError(f"nvidia-ml-py is not installed ({exc})") from None
            module = pynvml
        self._nvml = module
        self._lock = threading.Lock()  # nvidia-ml-py is not documented as thread-safe
        self._closed = False
        self._shutdown_wait_s = shutdown_wait_s
        self._in_flight = ""
        self._mps_list_broken = False
        self._call("nvmlInit", module.nvmlInit)

    def _call(self, what: str, fn: Callable[..., T], *args: Any) -> T:
        with self._lock:
            if self._closed:
                raise NvmlError(f"NVML was shut down before {what}")
            self._in_flight = what
            try:
                return fn(*args)
            except self._nvml.NVMLError as exc:
                raise NvmlError(f"NVML {what} failed: {exc}", int(getattr(exc, "value", -1))) from None
            except OSError as exc:  # the library itself cannot be loaded
                raise NvmlError(f"NVML {what} failed: {exc}") from None
            finally:
                self._in_flight = ""

    @staticmethod
    def _text(value: str | bytes) -> str:
        return value.decode() if isinstance(value, bytes) else str(value)

    def device_count(self) -> int:
        return int(self._call("nvmlDeviceGetCount", self._nvml.nvmlDeviceGetCount))

    def handle_by_index(self, index: int) -> Any:
        return self._call("nvmlDeviceGetHandleByIndex", self._nvml.nvmlDeviceGetHandleByIndex, index)

    def handle_by_uuid(self, uuid: str) -> Any:
        try:
            return self._call("nvmlDeviceGetHandleByUUID", self._nvml.nvmlDeviceGetHandleByUUID, uuid.encode())
        except NvmlError:
            if not uuid.upper().startswith("MIG-"):
                raise
        # Drivers that look up GPU UUIDs only: find the MIG device under its GPU.
        for index in range(self.device_count()):
            gpu = self.handle_by_index(index)
            for handle in self._mig_handles(gpu):
                if self.uuid(handle).lower() == uuid.lower():
                    return handle
        raise NvmlError(f"NVML has no MIG device {uuid}", NVML_ERROR_NOT_FOUND)

    def uuid(self, handle: Any) -> str:
        return self._text(self._call("nvmlDeviceGetUUID", self._nvml.nvmlDeviceGetUUID, handle))

    def name(self, handle: Any) -> str:
        return self._text(self._call("nvmlDeviceGetName", self._nvml.nvmlDeviceGetName, handle))

    def memory(self, handle: Any) -> tuple[int, int]:
        info = self._call("nvmlDeviceGetMemoryInfo", self._nvml.nvmlDeviceGetMemoryInfo, handle)
        return int(info.total), int(info.free)

    def _mig_handles(self, gpu: Any) -> list[Any]:
        try:
            current = self._call("nvmlDeviceGetMigMode", self._nvml.nvmlDeviceGetMigMode, gpu)[0]
        except NvmlError as exc:
            if exc.code in (*_UNLISTABLE, NVML_ERROR_FUNCTION_NOT_FOUND):
                return []  # a GPU without MIG, a driver from before it, or a mode this user may not read
            raise
        if current != _MIG_ENABLED:
            return []
        slots = int(self._call("nvmlDeviceGetMaxMigDeviceCount", self._nvml.nvmlDeviceGetMaxMigDeviceCount, gpu))
        handles = []
        for slot in range(slots):
            try:
                handles.append(self._call("nvmlDeviceGetMigDeviceHandleByIndex",
                                          self._nvml.nvmlDeviceGetMigDeviceHandleByIndex, gpu, slot))
            except NvmlError as exc:
                if exc.code != NVML_ERROR_NOT_FOUND:  # an empty slot: no compute instance there
                    raise
        return handles

    def mig_uuids(self, handle: Any) -> list[str]:
        return [self.uuid(h) for h in self._mig_handles(handle)]

    def compute_mode(self, handle: Any) -> int:
        try:
            return int(self._call("nvmlDeviceGetComputeMode", self._nvml.nvmlDeviceGetComputeMode, handle))
        except NvmlError as exc:
            if exc.code in (*_UNLISTABLE, NVML_ERROR_FUNCTION_NOT_FOUND):
                return -1  # a MIG device's handle, say: its GPU's mode is not ours to read here
            raise

    @staticmethod
    def _listed(infos: Any) -> list[GpuProcess]:
        return [GpuProcess(int(i.pid), None if i.usedGpuMemory is None else int(i.usedGpuMemory)) for i in infos]

    def _processes(self, what: str, fn: Callable[..., Any], handle: Any) -> list[GpuProcess]:
        try:
            return self._listed(self._call(what, fn, handle))
        except NvmlError as exc:
            if exc.code in _UNLISTABLE:
                return []
            raise

    def processes(self, handle: Any) -> list[GpuProcess]:
        nv = self._nvml
        return (self._processes("nvmlDeviceGetComputeRunningProcesses", nv.nvmlDeviceGetComputeRunningProcesses, handle)
                + self._processes("nvmlDeviceGetGraphicsRunningProcesses",
                                  nv.nvmlDeviceGetGraphicsRunningProcesses, handle))

    def mps_processes(self, handle: Any) -> list[GpuProcess]:
        fn = getattr(self._nvml, "nvmlDeviceGetMPSComputeRunningProcesses", None)
        if fn is None:
            return []
        try:
            return self._listed(self._call("nvmlDeviceGetMPSComputeRunningProcesses", fn, handle))
        except NvmlError as exc:
            if exc.code != NVML_ERROR_NOT_SUPPORTED and not self._mps_list_broken:
                self._mps_list_broken = True
                log.warning("NVML cannot list MPS clients (%s): they count where the compute list shows them, "
                            "else by their own reports", exc)
            return []

    def driver_version(self) -> str:
        return self._text(self._call("nvmlSystemGetDriverVersion", self._nvml.nvmlSystemGetDriverVersion))

    def shutdown(self) -> None:
        """Shut NVML down once; never waits more than ``shutdown_wait_s`` behind a stuck call."""
        if not self._lock.acquire(timeout=self._shutdown_wait_s):
            log.warning("NVML %s has not returned in %.0f s: left to the process's exit", self._in_flight or "call",
                        self._shutdown_wait_s)
            self._closed = True  # a call that returns later raises nothing new; later ones are refused
            return
        try:
            if self._closed:
                return
            self._closed = True
            try:
                self._nvml.nvmlShutdown()
            except self._nvml.NVMLError:
                pass
        finally:
            self._lock.release()


def usage_by_pid(processes: list[GpuProcess]) -> dict[int, int]:
    """Bytes per PID across NVML's lists; a PID in several lists (a compute process that is also an MPS
    client) is counted once, with its largest figure."""
    out: dict[int, int] = {}
    for proc in processes:
        if proc.used_bytes is not None:
            out[proc.pid] = max(out.get(proc.pid, 0), proc.used_bytes)
    return out


class Deadline:
    """Runs device readings on a thread of its own and waits for each at most ``timeout_s``.

    A GPU in trouble can hold an NVML call for minutes; the thread that asked (the manager's device
    poller) then gets a :class:`NvmlError` saying so, and the device turns NOT_SERVING with that
    reason, instead of the manager admitting work on a reading that stopped coming. While the stuck
    call lasts, every reading fails at once; the first one after it returns is served normally.
    """

    def __init__(self, timeout_s: float, name: str = "nvml-reader") -> None:
        self.timeout_s = timeout_s
        self._name = name
        self._cond = threading.Condition()
        self._callers = threading.Lock()
        self._job: Callable[[], Any] | None = None
        self._result: tuple[bool, Any] | None = None
        self._busy_since = 0.0
        self._busy_what = ""
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._job is None:
                    self._cond.wait()
                job = self._job
            try:
                result: tuple[bool, Any] = (True, job())
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, raised there
                result = (False, exc)
            with self._cond:
                self._job = None
                self._result = result
                self._cond.notify_all()

    def call(self, what: str, fn: Callable[[], T]) -> T:
        # One reading at a time: a second caller waits its turn (at most the deadline), it is not "stuck".
        if not self._callers.acquire(timeout=self.timeout_s):
            raise NvmlError(f"NVML {what} waited {self.timeout_s:.0f} s behind another reading (a GPU in trouble?)")
        try:
            return self._call(what, fn)
        finally:
            self._callers.release()

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        with self._cond:
            if self._job is not None:  # the last reading is still stuck
                stuck_s = time.monotonic() - self._busy_since
                raise NvmlError(f"NVML {self._busy_what} has not returned for {stuck_s:.0f} s (a GPU in trouble?)")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._job, self._result = fn, None
            self._busy_since, self._busy_what = time.monotonic(), what
            self._cond.notify_all()
            if not self._cond.wait_for(lambda: self._result is not None, self.timeout_s):
                raise NvmlError(f"NVML {what} has not returned in {self.timeout_s:.0f} s (a GPU in trouble?)")
            result, self._result = self._result, None
        assert result is not None
        ok, value = result
        if not ok:
            raise value
        return value
