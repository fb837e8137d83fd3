"""``cuda:N``: one NVIDIA GPU, named as the training job sees it, identified by its UUID.

**Identity.** CUDA numbers GPUs after ``CUDA_VISIBLE_DEVICES`` (and ``CUDA_DEVICE_ORDER``, fastest
first by default); NVML numbers them by PCI bus. Under Slurm or Kubernetes the two differ, and
reading NVML's GPU N would read another job's GPU. So ``cuda:N`` is resolved once, at start, to a
UUID: through the CUDA driver itself where ``libcuda`` loads (``cuDeviceGetUuid`` on ordinal N, which
applies both variables exactly as the job's processes do; ``cuInit`` creates no context and takes no
GPU memory), else from ``CUDA_VISIBLE_DEVICES`` (UUIDs and UUID prefixes are exact; plain indices
assume PCI order, which holds on GPUs of one model). Every NVML query then goes to that UUID's
handle, and every worker is started with ``CUDA_VISIBLE_DEVICES=<UUID>``: it sees its GPU as
``cuda:0`` and no other, so no library it loads can open a context on another device.

**Accounting.** A side task's memory is what NVML lists for its processes: compute, graphics and
MPS-client lists together (under MPS clients appear only in the last). In a container without the
host's PID namespace NVML lists host PIDs that match none of the manager's: the worker's own report
(:meth:`CudaWorkerDevice.used_bytes`, context plus allocator reservation) is then the figure.

**One cap for everything a task holds** (see :class:`CudaWorkerDevice`): the CUDA context is
created and measured first, the torch allocator gets the cap minus the context, and CuPy allocates
through the torch allocator, so torch and CuPy share that one limit instead of each getting it whole.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from freeride.devices.base import (
    Device,
    DeviceError,
    DeviceName,
    DeviceSample,
    WorkerDevice,
    WorkerSetupError,
    lower_priority,
)
from freeride.devices.mps import MpsPlan
from freeride.devices.nvml import GpuProcess, Nvml, NvmlError, usage_by_pid
from freeride.errors import ConfigError

log = logging.getLogger(__name__)

#: Set in every CUDA worker's environment: the UUID of its GPU (also its CUDA_VISIBLE_DEVICES).
UUID_ENV = "FREERIDE_CUDA_UUID"
#: Threads a GPU worker's CPU side may use: it launches kernels and waits; it must not take cores
#: from the trainer's own launch thread.
GPU_WORKER_THREADS = "2"
#: The least the allocator must be left after the context for a task to be worth starting.
MIN_ALLOCATOR_BYTES = 64 * 2**20
MiB = 2**20


# ---------------------------------------------------------------------- identity


class CudaDriver(Protocol):
    """What freeride asks of the CUDA driver API (libcuda): no context is created by either call."""

    def device_uuids(self) -> list[bytes]:
        """The 16-byte UUID of each GPU this process sees, in CUDA's order."""
        ...

    def set_blocking_sync(self, ordinal: int) -> None:
        """Make synchronisation on this GPU's primary context sleep, not spin (before it exists)."""
        ...


_CU_CTX_SCHED_BLOCKING_SYNC = 0x04


class LibCuda:
    """The CUDA driver API through ctypes. Raises DeviceError when libcuda cannot be loaded."""

    def __init__(self) -> None:
        try:
            self._lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise DeviceError(f"libcuda cannot be loaded ({exc})") from None

    def _check(self, what: str, rc: int) -> None:
        if rc != 0:
            raise DeviceError(f"{what} failed with CUDA error {rc}")

    def _device(self, ordinal: int) -> ctypes.c_int:
        self._check("cuInit", self._lib.cuInit(0))
        dev = ctypes.c_int()
        self._check("cuDeviceGet", self._lib.cuDeviceGet(ctypes.byref(dev), ordinal))
        return dev

    def device_uuids(self) -> list[bytes]:
        self._check("cuInit", self._lib.cuInit(0))
        count = ctypes.c_int()
        self._check("cuDeviceGetCount", self._lib.cuDeviceGetCount(ctypes.byref(count)))
        getter = getattr(self._lib, "cuDeviceGetUuid_v2", None) or self._lib.cuDeviceGetUuid
        out = []
        for ordinal in range(count.value):
            raw = (ctypes.c_ubyte * 16)()
            self._check("cuDeviceGetUuid", getter(raw, self._device(ordinal)))
            out.append(bytes(raw))
        return out

    def set_blocking_sync(self, ordinal: int) -> None:
        dev = self._device(ordinal)
        self._check("cuDevicePrimaryCtxSetFlags",
                    self._lib.cuDevicePrimaryCtxSetFlags(dev, _CU_CTX_SCHED_BLOCKING_SYNC))


def format_uuid(raw: bytes) -> str:
    """The 8-4-4-4-12 hex form NVML prints after ``GPU-`` or ``MIG-``."""
    h = raw.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def _nvml_uuids(nvml: Nvml) -> list[str]:
    return [nvml.uuid(nvml.handle_by_index(i)) for i in range(nvml.device_count())]


def _match_uuid(entry: str, known: list[str]) -> str | None:
    """A CUDA_VISIBLE_DEVICES UUID entry (full or a unique prefix, ``GPU-``/``MIG-`` included)."""
    found = [u for u in known if u.lower().startswith(entry.lower())]
    return found[0] if len(found) == 1 else None


def uuids_from_visible_devices(value: str | None, nvml: Nvml, order: str | None = None) -> list[str]:
    """The UUIDs a process sees under ``CUDA_VISIBLE_DEVICES=value``, as CUDA reads the list.

    Unset: every GPU, in NVML's (PCI) order. Entries are indices or UUIDs (or unique UUID prefixes);
    like CUDA, the list ends at the first entry that names no GPU. Indices count in PCI order, which
    is CUDA's under ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` and on GPUs of one model; on mixed models with the
    default fastest-first order they may not be, and a warning says so (the libcuda path is exact).
    """
    known = _nvml_uuids(nvml)
    entries = [str(i) for i in range(len(known))] if value is None else [e.strip() for e in value.split(",")]
    if order != "PCI_BUS_ID" and any(e.isdigit() for e in entries) and len({_model(nvml, u) for u in known}) > 1:
        log.warning("CUDA_VISIBLE_DEVICES has indices and the GPUs differ in model: without CUDA_DEVICE_ORDER="
                    "PCI_BUS_ID, CUDA may number them differently from NVML; name GPUs by UUID to be exact")
    out: list[str] = []
    for entry in entries:
        uuid = known[int(entry)] if entry.isdigit() and int(entry) < len(known) else _match_uuid(entry, known)
        if uuid is None or uuid in out:
            break
        out.append(uuid)
    return out


def _model(nvml: Nvml, uuid: str) -> str:
    return nvml.name(nvml.handle_by_uuid(uuid))


def resolve_uuid(name: DeviceName, nvml: Nvml, driver: CudaDriver | None,
                 env: Mapping[str, str] | None = None) -> str:
    """The UUID of ``cuda:N`` as this process's CUDA numbers it. Raises ConfigError if there is none."""
    env = os.environ if env is None else env
    visible: list[str] | None = None
    if driver is not None:
        try:
            raw = driver.device_uuids()
        except DeviceError as exc:
            log.warning("CUDA driver query failed (%s); reading CUDA_VISIBLE_DEVICES instead", exc)
        else:
            known = _nvml_uuids(nvml)
            visible = []
            for r in raw:
                text = format_uuid(r)
                match = next((u for u in known if u.lower().endswith(text)), None)
                visible.append(match or f"GPU-{text}")
    if visible is None:
        visible = uuids_from_visible_devices(env.get("CUDA_VISIBLE_DEVICES"), nvml, env.get("CUDA_DEVICE_ORDER"))
    if name.index >= len(visible):
        shown = env.get("CUDA_VISIBLE_DEVICES")
        where = f" (CUDA_VISIBLE_DEVICES={shown})" if shown is not None else ""
        raise ConfigError(f"unknown device {name}: this job sees {len(visible)} GPU(s){where}")
    return visible[name.index]


# ---------------------------------------------------------------------- the manager's view


class CudaDevice(Device):
    """One GPU, by UUID, as its manager sees it; every query goes through NVML (see the module doc)."""

    def __init__(self, name: DeviceName, uuid: str, nvml: Nvml, mps: MpsPlan) -> None:
        super().__init__(name)
        self.uuid = uuid
        self.mps = mps
        self._nvml = nvml
        try:
            self._handle = nvml.handle_by_uuid(uuid)
            self.model = nvml.name(self._handle)
            self.total_bytes = nvml.memory(self._handle)[0]
        except NvmlError as exc:
            raise ConfigError(f"device {name} ({uuid}) cannot be read: {exc}") from None

    def _guard(self, what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except NvmlError as exc:
            raise DeviceError(f"{self.name} ({self.uuid}): {what}: {exc}") from None

    def free_memory_bytes(self) -> int:
        return int(self._guard("free memory", lambda: self._nvml.memory(self._handle)[1]))

    def total_memory_bytes(self) -> int | None:
        return int(self.total_bytes) or None

    def _processes(self) -> list[GpuProcess]:
        return list(self._guard("process list", lambda: self._nvml.processes(self._handle)
                                + self._nvml.mps_processes(self._handle)))

    def process_memory_bytes(self, pids: Sequence[int]) -> int:
        usage = usage_by_pid(self._processes())
        return sum(usage.get(pid, 0) for pid in set(pids))

    def sample(self, task_pids: Mapping[str, Sequence[int]], *, free: bool = True) -> DeviceSample:
        # One process listing for every task, rather than one per task as the default would make.
        try:
            free_bytes = self.free_memory_bytes() if free else None
            usage = usage_by_pid(self._processes()) if task_pids else {}
        except DeviceError as exc:
            return DeviceSample(None, {}, str(exc))
        return DeviceSample(free_bytes, {task: sum(usage.get(p, 0) for p in set(pids))
                                         for task, pids in task_pids.items()})

    def worker_env(self, memory_limit_bytes: int, *, command: bool = False) -> dict[str, str]:
        env = {
            "CUDA_VISIBLE_DEVICES": self.uuid,
            UUID_ENV: self.uuid,
            "OMP_NUM_THREADS": GPU_WORKER_THREADS,
            "MKL_NUM_THREADS": GPU_WORKER_THREADS,
            "OPENBLAS_NUM_THREADS": GPU_WORKER_THREADS,
        }
        env.update(self.mps.worker_env(memory_limit_bytes))
        return env

    def describe(self) -> str:
        return f"{self.name} = {self.model} {self.uuid}, {self.total_bytes / 2**30:.1f} GiB; {self.mps.describe()}"

    def close(self) -> None:
        self._nvml.shutdown()
        if self.mps.private_pipe_directory:
            try:
                os.rmdir(self.mps.private_pipe_directory)
            except OSError:
                pass


# ---------------------------------------------------------------------- inside a worker


class CudaRuntime(Protocol):
    """What a CUDA worker asks of torch.cuda (and NVML for itself). Real: :class:`TorchCudaRuntime`."""

    def create_context(self, ordinal: int) -> None:
        """Create the primary context on ``ordinal`` and the handles every task needs (cuBLAS)."""
        ...

    def total_bytes(self, ordinal: int) -> int: ...

    def reserved_bytes(self, ordinal: int) -> int:
        """What the torch allocator holds from the device now (CuPy's allocations included)."""
        ...

    def max_reserved_bytes(self, ordinal: int) -> int: ...

    def set_allocator_limit(self, ordinal: int, limit_bytes: int) -> None: ...

    def synchronize(self, ordinal: int) -> None: ...

    def set_num_threads(self, threads: int) -> None: ...

    def route_cupy(self, ordinal: int) -> bool:
        """Make CuPy allocate through the torch allocator; False when CuPy is not installed."""
        ...

    def own_device_bytes(self) -> int | None:
        """This process's memory on its GPU as NVML lists it, or None where NVML cannot see it."""
        ...

    def device_free_bytes(self) -> int | None:
        """The GPU's free memory as NVML sees it (no context needed), or None."""
        ...


class CudaWorkerDevice(WorkerDevice):
    """A GPU inside a worker: one cap for the context, torch's allocator and CuPy together.

    :meth:`prepare` creates the context, measures it (NVML's figure for this process, else the drop
    in the GPU's free memory while it was created, which another process allocating at the same time
    can only make larger), refuses a cap that leaves the allocator less than ``MIN_ALLOCATOR_BYTES``,
    gives torch's allocator the rest and routes CuPy through it. Kernels load lazily, so the context
    grows as a task first uses new ones: :meth:`used_bytes` re-measures it where NVML can see this
    process and lowers the allocator's limit by the growth, keeping context + allocator within the cap.
    """

    def __init__(self, name: DeviceName, runtime: CudaRuntime | None = None, driver: CudaDriver | None = None,
                 env: Mapping[str, str] | None = None) -> None:
        super().__init__(name)
        env = os.environ if env is None else env
        self.uuid = env.get(UUID_ENV, "")
        #: In a worker the manager narrowed CUDA_VISIBLE_DEVICES to this GPU: it is cuda:0 here.
        self.ordinal = 0 if self.uuid else name.index
        self._runtime = runtime
        self._driver = driver
        self.limit_bytes = 0
        self.allocator_limit_bytes = 0
        self.cupy_routed = False
        self._peak = 0
        #: A command task's worker holds no context: nothing of its own to wait for or to count.
        self._command = False

    @property
    def torch_device(self) -> str:
        return f"cuda:{self.ordinal}"

    @property
    def runtime(self) -> CudaRuntime:
        if self._runtime is None:
            self._runtime = TorchCudaRuntime(self.uuid)
        return self._runtime

    def prepare(self, memory_limit_bytes: int, *, command: bool = False) -> None:
        lower_priority()
        self.limit_bytes = memory_limit_bytes
        self._command = command
        if command:
            # The command is the GPU user, in its own process: a context here would cost the cap for
            # nothing. Its memory is what NVML lists for its process group (and MPS's pinned limit).
            return
        driver = self._driver
        if driver is None:
            try:
                driver = LibCuda()
            except DeviceError:
                driver = None
        if driver is not None:
            try:
                driver.set_blocking_sync(self.ordinal)  # a step's wait sleeps instead of spinning a core
            except DeviceError as exc:
                log.info("blocking synchronisation not set: %s", exc)
        rt = self.runtime
        rt.set_num_threads(int(GPU_WORKER_THREADS))
        free_before = rt.device_free_bytes()
        rt.create_context(self.ordinal)
        reserved = rt.reserved_bytes(self.ordinal)
        own = rt.own_device_bytes()
        if own is not None:
            context = own - reserved
        else:
            free_after = rt.device_free_bytes()
            context = (free_before - free_after - reserved) if free_before is not None and free_after is not None else 0
        self.context_bytes = max(0, context)
        allocator = memory_limit_bytes - self.context_bytes - reserved
        if allocator < MIN_ALLOCATOR_BYTES:
            raise WorkerSetupError(
                "MEMORY_LIMIT",
                f"a cap of {memory_limit_bytes / MiB:.0f} MiB leaves too little after the CUDA context: the context "
                f"takes {self.context_bytes / MiB:.0f} MiB on this GPU, so give at least "
                f"{(self.context_bytes + reserved + MIN_ALLOCATOR_BYTES) / MiB:.0f} MiB",
            )
        self.allocator_limit_bytes = allocator + reserved
        rt.set_allocator_limit(self.ordinal, self.allocator_limit_bytes)
        self.cupy_routed = rt.route_cupy(self.ordinal)
        self._peak = self.context_bytes + reserved

    def synchronize(self) -> None:
        if not self._command:
            self.runtime.synchronize(self.ordinal)

    def used_bytes(self) -> int:
        if self._command:
            return 0
        rt = self.runtime
        reserved = rt.reserved_bytes(self.ordinal)
        own = rt.own_device_bytes()
        if own is not None and self.allocator_limit_bytes and own - reserved > self.context_bytes:
            growth = own - reserved - self.context_bytes
            self.context_bytes += growth
            # Never below what the allocator already holds: the watchdog judges the total.
            self.allocator_limit_bytes = max(reserved, self.allocator_limit_bytes - growth)
            rt.set_allocator_limit(self.ordinal, self.allocator_limit_bytes)
            log.info("the CUDA context grew by %.0f MiB (kernels loaded on first use); the allocator may now "
                     "hold %.0f MiB", growth / MiB, self.allocator_limit_bytes / MiB)
        used = max(own or 0, self.context_bytes + reserved)
        self._peak = max(self._peak, used, self.context_bytes + rt.max_reserved_bytes(self.ordinal))
        return used

    def peak_bytes(self) -> int:
        self.used_bytes()
        return self._peak


class TorchCudaRuntime:
    """:class:`CudaRuntime` on torch.cuda, CuPy and NVML (the real one; imported in GPU workers only)."""

    def __init__(self, uuid: str = "") -> None:
        import torch

        self._torch = torch
        self._uuid = uuid
        self._nvml: Any = None
        self._handle: Any = None

    def _nvml_handle(self) -> Any:
        if self._handle is None and self._uuid:
            from freeride.devices.nvml import PyNvml

            try:
                self._nvml = PyNvml()
                self._handle = self._nvml.handle_by_uuid(self._uuid)
            except NvmlError:
                self._uuid = ""  # no NVML here: fall back for good, do not retry every call
        return self._handle

    def create_context(self, ordinal: int) -> None:
        torch = self._torch
        torch.cuda.set_device(ordinal)
        x = torch.ones(8, 8, device=f"cuda:{ordinal}")
        (x @ x).sum().item()  # the context, the default stream and a cuBLAS handle, as a task will have them
        del x
        torch.cuda.empty_cache()

    def total_bytes(self, ordinal: int) -> int:
        return int(self._torch.cuda.get_device_properties(ordinal).total_memory)

    def reserved_bytes(self, ordinal: int) -> int:
        return int(self._torch.cuda.memory_reserved(ordinal))

    def max_reserved_bytes(self, ordinal: int) -> int:
        return int(self._torch.cuda.max_memory_reserved(ordinal))

    def set_allocator_limit(self, ordinal: int, limit_bytes: int) -> None:
        fraction = min(1.0, max(0.0, limit_bytes / self.total_bytes(ordinal)))
        self._torch.cuda.set_per_process_memory_fraction(fraction, ordinal)

    def synchronize(self, ordinal: int) -> None:
        self._torch.cuda.synchronize(ordinal)

    def set_num_threads(self, threads: int) -> None:
        self._torch.set_num_threads(threads)

    def route_cupy(self, ordinal: int) -> bool:
        try:
            import cupy
        except ImportError:
            return False
        torch = self._torch
        route_cupy_through(cupy, lambda size, stream: torch.cuda.caching_allocator_alloc(size, ordinal, stream),
                           torch.cuda.caching_allocator_delete, ordinal)
        return True

    def own_device_bytes(self) -> int | None:
        handle = self._nvml_handle()
        if handle is None:
            return None
        try:
            usage = usage_by_pid(self._nvml.processes(handle) + self._nvml.mps_processes(handle))
        except NvmlError:
            return None
        return usage.get(os.getpid())  # absent: host PIDs in a container; the caller falls back

    def device_free_bytes(self) -> int | None:
        handle = self._nvml_handle()
        if handle is None:
            return None
        try:
            return int(self._nvml.memory(handle)[1])
        except NvmlError:
            return None


def route_cupy_through(cupy: Any, alloc: Callable[[int, int], int], free: Callable[[int], None], ordinal: int) -> None:
    """Make every CuPy device allocation come from ``alloc(size, stream) -> pointer`` and go back
    through ``free(pointer)`` when CuPy lets go of it: one pool, so one cap, for torch and CuPy.

    CuPy wraps the pointer as unowned memory whose owner frees it when the last array using it is
    gone. The allocation is made on CuPy's current stream, so the torch allocator reuses it safely.
    """
    memory = cupy.cuda.memory

    class _Owner:
        __slots__ = ("ptr",)

        def __init__(self, ptr: int) -> None:
            self.ptr = ptr

        def __del__(self) -> None:
            free(self.ptr)

    def allocate(size: int) -> Any:
        if size == 0:
            return memory.MemoryPointer(memory.UnownedMemory(0, 0, None, ordinal), 0)
        ptr = alloc(size, cupy.cuda.get_current_stream().ptr)
        return memory.MemoryPointer(memory.UnownedMemory(ptr, size, _Owner(ptr), ordinal), 0)

    cupy.cuda.set_allocator(allocate)
