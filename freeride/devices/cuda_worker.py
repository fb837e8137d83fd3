"""A GPU inside a side-task worker: one cap for the CUDA context, torch's allocator and CuPy.

:meth:`CudaWorkerDevice.prepare` drops CUDA settings the worker must not inherit
(:data:`~freeride.devices.cuda_driver.INHERITED_SETTINGS`), makes synchronisation sleep instead of spin,
creates the context, measures it (NVML's figure for this process, else the drop in the GPU's free
memory while it was created, which another process allocating at the same time can only make
larger), refuses a cap that leaves the allocator less than ``MIN_ALLOCATOR_BYTES``, gives torch's
allocator the rest less a headroom, and routes CuPy through torch's allocator, so that torch and
CuPy share one limit instead of each getting it whole.

**What the cap enforces, and how.** Allocations through torch's caching allocator (CuPy's
included) fail at once past the allocator's share (an out-of-memory error: ``MEMORY_LIMIT``). The
context is not allocated through it: kernels load lazily (``CUDA_MODULE_LOADING=LAZY``, the default),
so the context grows the first time a step uses new ones. The headroom (an eighth of the share, at
most ``CONTEXT_HEADROOM_BYTES``) absorbs that growth; the context is measured again after ``setup`` and
after the first step, and at every park, and the allocator's share is lowered to what the cap leaves
(never below what it already holds). Memory allocated around the allocator (a raw ``cudaMalloc``,
nvJPEG's buffers, some libraries' workspaces) is seen only by the manager's NVML poll, after the fact,
and only where NVML can see this process; under MPS the driver enforces the cap as the pinned memory
limit. The worker's host memory is capped by the manager like a CPU worker's: its growth beyond
:meth:`CudaWorkerDevice.host_baseline_bytes`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, MutableMapping
from typing import Any, Protocol

from freeride.devices.base import DeviceError, DeviceName, WorkerDevice, WorkerSetupError, lower_priority
from freeride.devices.cpu import rss_bytes
from freeride.devices.cuda_driver import (
    GPU_WORKER_THREADS,
    INHERITED_SETTINGS,
    MIN_ALLOCATOR_BYTES,
    UUID_ENV,
    CudaDriver,
    LibCuda,
    MiB,
)
from freeride.devices.nvml import NvmlError, usage_by_pid
from freeride.devices.torch_allocator import allocator_bytes

log = logging.getLogger(__name__)

#: The most of a task's allocator share held back for its context's growth (lazily loaded kernels).
CONTEXT_HEADROOM_BYTES = 256 * MiB
#: Context measurements after prepare that synchronize() takes (after setup, after the first step).
EARLY_REMEASURES = 2


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


def headroom_bytes(share_bytes: int) -> int:
    """What of an allocator share of ``share_bytes`` is held back for the context's growth."""
    return min(CONTEXT_HEADROOM_BYTES, max(0, share_bytes) // 8)


class CudaWorkerDevice(WorkerDevice):
    """A GPU inside a worker: one cap for the context, torch's allocator and CuPy (see the module doc)."""

    def __init__(self, name: DeviceName, runtime: CudaRuntime | None = None, driver: CudaDriver | None = None,
                 env: MutableMapping[str, str] | None = None) -> None:
        super().__init__(name)
        self._env: MutableMapping[str, str] = os.environ if env is None else env
        self.uuid = self._env.get(UUID_ENV, "")
        #: In a worker the manager narrowed CUDA_VISIBLE_DEVICES to this GPU: it is cuda:0 here.
        self.ordinal = 0 if self.uuid else name.index
        self._runtime = runtime
        self._driver = driver
        self.limit_bytes = 0
        self.allocator_limit_bytes = 0
        self.cupy_routed = False
        self.dropped_settings: list[str] = []
        self._peak = 0
        self._remeasures = 0
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

    def _drop_inherited_settings(self) -> None:
        for key in INHERITED_SETTINGS:
            value = self._env.pop(key, None)
            if value is not None:
                self.dropped_settings.append(f"{key}={value}")
        if self.dropped_settings:
            log.warning("dropped %s inherited from the manager's environment (see the manager's log)",
                        ", ".join(self.dropped_settings))

    def prepare(self, memory_limit_bytes: int, *, command: bool = False) -> None:
        lower_priority()
        self._drop_inherited_settings()  # before CUDA starts here, and before a command inherits them
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
        share = memory_limit_bytes - self.context_bytes - reserved
        if share < MIN_ALLOCATOR_BYTES:
            raise WorkerSetupError(
                "MEMORY_LIMIT",
                f"a cap of {memory_limit_bytes / MiB:.0f} MiB leaves too little after the CUDA context: the context "
                f"takes {self.context_bytes / MiB:.0f} MiB on this GPU, so give at least "
                f"{(self.context_bytes + reserved + MIN_ALLOCATOR_BYTES) / MiB:.0f} MiB",
            )
        self.allocator_limit_bytes = share - headroom_bytes(share) + reserved
        rt.set_allocator_limit(self.ordinal, self.allocator_limit_bytes)
        self.cupy_routed = rt.route_cupy(self.ordinal)
        self._peak = self.context_bytes + reserved
        self._remeasures = EARLY_REMEASURES

    def _remeasure(self) -> tuple[int, int | None]:
        """Measure the context again; lower the allocator's share by what it grew past the headroom.
        Returns what the allocator holds now and NVML's figure for this process (None: NVML cannot see it)."""
        rt = self.runtime
        reserved = rt.reserved_bytes(self.ordinal)
        own = rt.own_device_bytes()
        if own is not None and self.allocator_limit_bytes and own - reserved > self.context_bytes:
            growth = own - reserved - self.context_bytes
            self.context_bytes += growth
            # Never below what the allocator already holds: the manager's watchdog judges the total.
            fits = max(reserved, min(self.allocator_limit_bytes, self.limit_bytes - self.context_bytes))
            log.info("the CUDA context grew by %.0f MiB (kernels loaded on first use), to %.0f MiB",
                     growth / MiB, self.context_bytes / MiB)
            if fits != self.allocator_limit_bytes:
                self.allocator_limit_bytes = fits
                rt.set_allocator_limit(self.ordinal, fits)
                log.info("the allocator may now hold %.0f MiB", fits / MiB)
        self._peak = max(self._peak, max(own or 0, self.context_bytes + reserved),
                         self.context_bytes + rt.max_reserved_bytes(self.ordinal))
        return reserved, own

    def synchronize(self) -> None:
        if self._command:
            return
        self.runtime.synchronize(self.ordinal)
        if self._remeasures:
            self._remeasures -= 1
            self._remeasure()

    def used_bytes(self) -> int:
        """One NVML process query (it can take a millisecond), shared with the context's remeasure."""
        if self._command:
            return 0
        reserved, own = self._remeasure()
        return max(own or 0, self.context_bytes + reserved)

    def peak_bytes(self) -> int:
        self.used_bytes()
        return self._peak

    def host_baseline_bytes(self) -> int:
        """This worker's resident set now (the task imported and constructed): the manager caps the
        host memory it grows by beyond this, as on a CPU core."""
        return max(1, rss_bytes(os.getpid()))


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
        return allocator_bytes(self._torch, ordinal, "reserved_bytes")

    def max_reserved_bytes(self, ordinal: int) -> int:
        return allocator_bytes(self._torch, ordinal, "reserved_bytes", "peak")

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

