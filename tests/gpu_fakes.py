"""Fakes of NVML, the CUDA driver, torch.cuda and CuPy: the CUDA path's logic, tested without a GPU.

Each fake keeps the real seam's methods (``freeride.devices.nvml.Nvml``, ``cuda.CudaDriver``,
``cuda.CudaRuntime``) and records what was asked of it, so a test says what a GPU would have been told.
"""

from __future__ import annotations

import uuid as uuid_module
from dataclasses import dataclass, field
from typing import Any

from freeride.devices.nvml import NVML_ERROR_NOT_SUPPORTED, GpuProcess, NvmlError

GiB = 2**30
MiB = 2**20


def gpu_uuid(n: int, kind: str = "GPU") -> str:
    """A stable, realistic UUID for fake GPU ``n``."""
    return f"{kind}-{uuid_module.UUID(int=0xABCDEF00 + n)}"


@dataclass
class FakeGpu:
    uuid: str
    model: str = "NVIDIA H100 80GB HBM3"
    total_bytes: int = 80 * GiB
    free_bytes: int = 70 * GiB
    processes: list[GpuProcess] = field(default_factory=list)
    mps: list[GpuProcess] = field(default_factory=list)
    #: Process lists this GPU does not support (as NVML on some MIG set-ups).
    lists_unsupported: bool = False


class FakeNvml:
    """NVML over a list of fake GPUs in PCI order. ``fail`` makes every call raise that error."""

    def __init__(self, gpus: list[FakeGpu]) -> None:
        self.gpus = gpus
        self.fail = ""
        self.fail_code = 15  # NVML_ERROR_GPU_IS_LOST
        self.shutdowns = 0
        self.calls: list[str] = []

    def _check(self, what: str) -> None:
        self.calls.append(what)
        if self.fail:
            raise NvmlError(f"NVML {what} failed: {self.fail}", self.fail_code)

    def device_count(self) -> int:
        self._check("count")
        return len(self.gpus)

    def handle_by_index(self, index: int) -> Any:
        self._check("by_index")
        if not 0 <= index < len(self.gpus):
            raise NvmlError("NVML nvmlDeviceGetHandleByIndex failed: Invalid Argument", 2)
        return index

    def handle_by_uuid(self, uuid: str) -> Any:
        self._check("by_uuid")
        for i, gpu in enumerate(self.gpus):
            if gpu.uuid == uuid:
                return i
        raise NvmlError("NVML nvmlDeviceGetHandleByUUID failed: Not Found", 6)

    def uuid(self, handle: Any) -> str:
        self._check("uuid")
        return self.gpus[handle].uuid

    def name(self, handle: Any) -> str:
        self._check("name")
        return self.gpus[handle].model

    def memory(self, handle: Any) -> tuple[int, int]:
        self._check("memory")
        gpu = self.gpus[handle]
        return gpu.total_bytes, gpu.free_bytes

    def processes(self, handle: Any) -> list[GpuProcess]:
        self._check("processes")
        gpu = self.gpus[handle]
        if gpu.lists_unsupported:
            return []  # what PyNvml makes of NOT_SUPPORTED
        return list(gpu.processes)

    def mps_processes(self, handle: Any) -> list[GpuProcess]:
        self._check("mps_processes")
        return list(self.gpus[handle].mps)

    def driver_version(self) -> str:
        self._check("driver")
        return "580.159.04"

    def shutdown(self) -> None:
        self.shutdowns += 1


assert NVML_ERROR_NOT_SUPPORTED == 3


class FakeDriver:
    """libcuda as seen through CUDA_VISIBLE_DEVICES: the raw UUIDs of the GPUs, in CUDA's order."""

    def __init__(self, uuids: list[str], fail: str = "") -> None:
        self.raw = [uuid_module.UUID(u.split("-", 1)[1]).bytes for u in uuids]
        self.fail = fail
        self.blocking_sync: list[int] = []

    def device_uuids(self) -> list[bytes]:
        from freeride.devices import DeviceError

        if self.fail:
            raise DeviceError(self.fail)
        return list(self.raw)

    def set_blocking_sync(self, ordinal: int) -> None:
        self.blocking_sync.append(ordinal)


class FakeCudaRuntime:
    """torch.cuda for one GPU: a context of ``context_bytes`` appears on :meth:`create_context`; the
    allocator reserves what tests say; ``visible`` says whether NVML lists this process (False in a
    container without the host's PID namespace)."""

    def __init__(self, *, context_bytes: int = 500 * MiB, workspace_bytes: int = 8 * MiB, visible: bool = True,
                 gpu_free_bytes: int = 70 * GiB, total_bytes: int = 80 * GiB, cupy: bool = True) -> None:
        self.context_bytes = context_bytes
        self.workspace_bytes = workspace_bytes
        self.visible = visible
        self.gpu_free = gpu_free_bytes
        self.total = total_bytes
        self.cupy = cupy
        self.contexts = 0
        self.reserved = 0
        self.max_reserved = 0
        self.limits: list[int] = []
        self.syncs = 0
        self.threads = 0
        self.routed = False

    def create_context(self, ordinal: int) -> None:
        self.contexts += 1
        self.gpu_free -= self.context_bytes + self.workspace_bytes
        self.reserve(self.workspace_bytes)

    def reserve(self, total_bytes: int) -> None:
        """The allocator now holds ``total_bytes`` (what a task's allocations made it reserve)."""
        self.reserved = total_bytes
        self.max_reserved = max(self.max_reserved, total_bytes)

    def total_bytes(self, ordinal: int) -> int:
        return self.total

    def reserved_bytes(self, ordinal: int) -> int:
        return self.reserved

    def max_reserved_bytes(self, ordinal: int) -> int:
        return self.max_reserved

    def set_allocator_limit(self, ordinal: int, limit_bytes: int) -> None:
        self.limits.append(limit_bytes)

    def synchronize(self, ordinal: int) -> None:
        self.syncs += 1

    def set_num_threads(self, threads: int) -> None:
        self.threads = threads

    def route_cupy(self, ordinal: int) -> bool:
        self.routed = self.cupy
        return self.cupy

    def own_device_bytes(self) -> int | None:
        if not self.visible:
            return None
        return (self.context_bytes if self.contexts else 0) + self.reserved

    def device_free_bytes(self) -> int | None:
        return self.gpu_free


class FakeCupy:
    """Just enough of CuPy for :func:`freeride.devices.cuda.route_cupy_through`."""

    def __init__(self) -> None:
        outer = self
        self.allocator: Any = None

        class _Stream:
            ptr = 0x5EED

        class _UnownedMemory:
            def __init__(self, ptr: int, size: int, owner: Any, device_id: int = -1) -> None:
                self.ptr, self.size, self.owner, self.device_id = ptr, size, owner, device_id

        class _MemoryPointer:
            def __init__(self, mem: _UnownedMemory, offset: int) -> None:
                self.mem, self.ptr = mem, mem.ptr + offset

        class _Memory:
            UnownedMemory = _UnownedMemory
            MemoryPointer = _MemoryPointer

        class _Cuda:
            memory = _Memory

            @staticmethod
            def get_current_stream() -> _Stream:
                return _Stream()

            @staticmethod
            def set_allocator(fn: Any) -> None:
                outer.allocator = fn

        self.cuda = _Cuda
