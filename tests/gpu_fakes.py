"""Fakes of NVML, the CUDA driver, torch.cuda and CuPy: the CUDA path's logic, tested without a GPU.

Each fake keeps the real interface it stands for and the behaviour its documentation gives, and
records what was asked of it, so a test says what a GPU would have been told:

* :class:`FakePynvml` is the ``pynvml`` module (nvidia-ml-py): the same function names, return shapes
  and ``NVMLError`` codes, MIG devices under their GPU, compute modes, calls that fail or hang.
  :class:`FakeNvml` is the real :class:`~freeride.devices.nvml.PyNvml` over it, so the CUDA tests run
  freeride's own NVML code.
* :class:`FakeDriver` is libcuda's UUID listing (``cuDeviceGetUuid_v2``: a MIG device's own UUID).
* :class:`FakeCudaRuntime` is what a worker asks of torch.cuda; :class:`FakeCupy` enough of CuPy.
* :class:`FakeTorchCuda` is the part of torch.cuda the device clock uses, over a simulated device:
  streams that run queued work in order on a device clock, events, graph capture with CUDA's capture
  modes, and a single hardware queue (``CUDA_DEVICE_MAX_CONNECTIONS=1``) where every stream waits
  behind the others' backlog.
"""

from __future__ import annotations

import threading
import time
import uuid as uuid_module
from dataclasses import dataclass, field
from typing import Any

from freeride.devices.nvml import GpuProcess, PyNvml

GiB = 2**30
MiB = 2**20


def gpu_uuid(n: int, kind: str = "GPU") -> str:
    """A stable, realistic UUID for fake GPU (or MIG device) ``n``; the first hex digits differ, so that a
    12-character prefix names one device, as real UUIDs' do."""
    return f"{kind}-{uuid_module.UUID(int=((0xA0 + n) << 120) | (0xABCDEF00 + n))}"


# ---------------------------------------------------------------------- NVML


@dataclass
class FakeGpu:
    """A physical GPU, or (in another's ``mig``) one of its MIG devices."""

    uuid: str
    model: str = "NVIDIA H100 80GB HBM3"
    total_bytes: int = 80 * GiB
    free_bytes: int = 70 * GiB
    processes: list[GpuProcess] = field(default_factory=list)
    mps: list[GpuProcess] = field(default_factory=list)
    #: NVML's answer to the process lists: 0 (they work), or the error code they fail with
    #: (3 NOT_SUPPORTED on some MIG set-ups, 4 NO_PERMISSION for a MIG GPU's aggregate list).
    lists_error: int = 0
    #: The MPS-client list's error code (13 FUNCTION_NOT_FOUND on a driver without it, 999 UNKNOWN ...).
    mps_error: int = 0
    compute_mode: int = 0
    #: MIG devices, in slot order; None in a slot is one without a compute instance.
    mig: list[FakeGpu | None] = field(default_factory=list)
    #: False: the GPU cannot do MIG at all (nvmlDeviceGetMigMode is NOT_SUPPORTED).
    mig_capable: bool = True

    @property
    def lists_unsupported(self) -> bool:
        return self.lists_error == 3

    @lists_unsupported.setter
    def lists_unsupported(self, value: bool) -> None:
        self.lists_error = 3 if value else 0


class _NVMLError(Exception):
    """nvidia-ml-py's NVMLError: ``value`` is the return code; str() is NVML's error string."""

    _STRINGS = {2: "Invalid Argument", 3: "Not Supported", 4: "Insufficient Permissions", 6: "Not Found",
                13: "Function Not Found", 15: "GPU is lost", 18: "Driver/library version mismatch",
                999: "Unknown Error"}

    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return self._STRINGS.get(self.value, f"NVML error {self.value}")


@dataclass(frozen=True)
class _Handle:
    gpu: int
    mig: int | None = None


@dataclass
class _MemoryInfo:
    total: int
    free: int
    used: int


@dataclass
class _ProcessInfo:
    pid: int
    usedGpuMemory: int | None  # noqa: N815 - nvidia-ml-py's name


class FakePynvml:
    """The ``pynvml`` module over fake GPUs in PCI order (see the module doc).

    ``fail`` (an NVML code) makes every call after init fail with it; ``fail_on`` fails one function by
    name; ``hang_on`` makes a function block until its event is set (a GPU in trouble). ``uuid_lookup_mig``:
    whether ``nvmlDeviceGetHandleByUUID`` finds MIG devices too (drivers differ; PyNvml must cope with both).
    """

    NVMLError = _NVMLError
    NVML_DEVICE_MIG_DISABLE = 0
    NVML_DEVICE_MIG_ENABLE = 1

    def __init__(self, gpus: list[FakeGpu], *, uuid_lookup_mig: bool = True) -> None:
        self.gpus = gpus
        self.uuid_lookup_mig = uuid_lookup_mig
        self.fail = 0
        self.fail_on: dict[str, int] = {}
        self.hang_on: dict[str, threading.Event] = {}
        self.calls: list[str] = []
        self.shutdowns = 0
        self.initialised = False

    def _enter(self, name: str) -> None:
        self.calls.append(name)
        if name in self.hang_on:
            self.hang_on[name].wait()
        if name not in ("nvmlInit", "nvmlShutdown") and not self.initialised:
            raise _NVMLError(1)  # UNINITIALIZED
        code = self.fail_on.get(name) or (self.fail if name not in ("nvmlInit", "nvmlShutdown") else 0)
        if code:
            raise _NVMLError(code)

    def _gpu(self, handle: _Handle) -> FakeGpu:
        if not isinstance(handle, _Handle) or not 0 <= handle.gpu < len(self.gpus):
            raise _NVMLError(2)
        gpu = self.gpus[handle.gpu]
        if handle.mig is None:
            return gpu
        mig = gpu.mig[handle.mig] if handle.mig < len(gpu.mig) else None
        if mig is None:
            raise _NVMLError(2)
        return mig

    def nvmlInit(self) -> None:  # noqa: N802 - the module's names
        self._enter("nvmlInit")
        if self.fail:
            raise _NVMLError(self.fail)
        self.initialised = True

    def nvmlShutdown(self) -> None:  # noqa: N802
        self._enter("nvmlShutdown")
        self.shutdowns += 1
        self.initialised = False

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        self._enter("nvmlDeviceGetCount")
        return len(self.gpus)  # physical GPUs only, MIG or not

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:  # noqa: N802
        self._enter("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.gpus):
            raise _NVMLError(2)
        return _Handle(index)

    def nvmlDeviceGetHandleByUUID(self, uuid: bytes) -> _Handle:  # noqa: N802
        self._enter("nvmlDeviceGetHandleByUUID")
        text = uuid.decode() if isinstance(uuid, bytes) else uuid
        for i, gpu in enumerate(self.gpus):
            if gpu.uuid == text:
                return _Handle(i)
            for j, mig in enumerate(gpu.mig):
                if mig is not None and mig.uuid == text and self.uuid_lookup_mig:
                    return _Handle(i, j)
        raise _NVMLError(6)

    def nvmlDeviceGetUUID(self, handle: _Handle) -> str:  # noqa: N802
        self._enter("nvmlDeviceGetUUID")
        return self._gpu(handle).uuid

    def nvmlDeviceGetName(self, handle: _Handle) -> str:  # noqa: N802
        self._enter("nvmlDeviceGetName")
        return self._gpu(handle).model

    def nvmlDeviceGetMemoryInfo(self, handle: _Handle) -> _MemoryInfo:  # noqa: N802
        self._enter("nvmlDeviceGetMemoryInfo")
        gpu = self._gpu(handle)
        return _MemoryInfo(gpu.total_bytes, gpu.free_bytes, gpu.total_bytes - gpu.free_bytes)

    def nvmlDeviceGetComputeMode(self, handle: _Handle) -> int:  # noqa: N802
        self._enter("nvmlDeviceGetComputeMode")
        if handle.mig is not None:
            raise _NVMLError(3)  # a GPU's setting, not a MIG device's
        return self._gpu(handle).compute_mode

    def _list(self, handle: _Handle, which: str) -> list[_ProcessInfo]:
        gpu = self._gpu(handle)
        code = gpu.mps_error if which == "mps" else gpu.lists_error
        if code:
            raise _NVMLError(code)
        procs = gpu.mps if which == "mps" else (gpu.processes if which == "compute" else [])
        return [_ProcessInfo(p.pid, p.used_bytes) for p in procs]

    def nvmlDeviceGetComputeRunningProcesses(self, handle: _Handle) -> list[_ProcessInfo]:  # noqa: N802
        self._enter("nvmlDeviceGetComputeRunningProcesses")
        return self._list(handle, "compute")

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: _Handle) -> list[_ProcessInfo]:  # noqa: N802
        self._enter("nvmlDeviceGetGraphicsRunningProcesses")
        return self._list(handle, "graphics")

    def nvmlDeviceGetMPSComputeRunningProcesses(self, handle: _Handle) -> list[_ProcessInfo]:  # noqa: N802
        self._enter("nvmlDeviceGetMPSComputeRunningProcesses")
        return self._list(handle, "mps")

    def nvmlDeviceGetMigMode(self, handle: _Handle) -> list[int]:  # noqa: N802
        self._enter("nvmlDeviceGetMigMode")
        gpu = self._gpu(handle)
        if handle.mig is not None or not gpu.mig_capable:
            raise _NVMLError(3)
        mode = self.NVML_DEVICE_MIG_ENABLE if gpu.mig else self.NVML_DEVICE_MIG_DISABLE
        return [mode, mode]

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: _Handle) -> int:  # noqa: N802
        self._enter("nvmlDeviceGetMaxMigDeviceCount")
        return 7 if self._gpu(handle).mig_capable else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: _Handle, index: int) -> _Handle:  # noqa: N802
        self._enter("nvmlDeviceGetMigDeviceHandleByIndex")
        gpu = self._gpu(handle)
        if index >= len(gpu.mig) or gpu.mig[index] is None:
            raise _NVMLError(6)  # NOT_FOUND: no compute instance in this slot
        return _Handle(handle.gpu, index)

    def nvmlSystemGetDriverVersion(self) -> str:  # noqa: N802
        self._enter("nvmlSystemGetDriverVersion")
        return "580.159.04"


class FakeNvml(PyNvml):
    """freeride's real :class:`PyNvml` over :class:`FakePynvml` (``module``), with the fake's knobs at hand."""

    def __init__(self, gpus: list[FakeGpu], *, uuid_lookup_mig: bool = True, shutdown_wait_s: float = 2.0) -> None:
        self.module = FakePynvml(gpus, uuid_lookup_mig=uuid_lookup_mig)
        super().__init__(self.module, shutdown_wait_s=shutdown_wait_s)

    @property
    def gpus(self) -> list[FakeGpu]:
        return self.module.gpus

    @property
    def calls(self) -> list[str]:
        return self.module.calls

    @property
    def shutdowns(self) -> int:
        return self.module.shutdowns

    @property
    def fail(self) -> int:
        return self.module.fail

    @fail.setter
    def fail(self, code: int) -> None:
        self.module.fail = code


# ---------------------------------------------------------------------- the CUDA driver


class FakeDriver:
    """libcuda as seen through CUDA_VISIBLE_DEVICES: the raw UUIDs of the GPUs (or MIG devices, whose own
    UUID ``cuDeviceGetUuid_v2`` gives), in CUDA's order."""

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


# ---------------------------------------------------------------------- torch.cuda in a worker


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
    """Just enough of CuPy for :func:`freeride.devices.cuda_worker.route_cupy_through`."""

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


# ---------------------------------------------------------------------- torch.cuda under the device clock

CAPTURE_GLOBAL, CAPTURE_THREAD_LOCAL, CAPTURE_RELAXED = 0, 1, 2
_CAPTURE_MODES = {"global": CAPTURE_GLOBAL, "thread_local": CAPTURE_THREAD_LOCAL, "relaxed": CAPTURE_RELAXED}


class FakeCudaError(RuntimeError):
    """What torch raises for a failed CUDA call."""


class FakeStream:
    def __init__(self, name: str, private: bool = False) -> None:
        self.name = name
        self.private = private
        self.busy_until = 0  # device ns when its queued work is done
        self.capture: _Capture | None = None


@dataclass
class _Capture:
    thread: int
    mode: int
    invalidated: str = ""
    events: int = 0


class FakeEvent:
    """A timing, blocking-sync CUDA event on :class:`FakeTorchCuda`'s simulated device."""

    RESOLUTION_NS = 500  # cudaEventElapsedTime's resolution: about half a microsecond

    def __init__(self, gpu: FakeTorchCuda) -> None:
        self._gpu = gpu
        self.at: int | None = None  # device ns of its completion; None: never recorded
        self.captured = False

    def record(self, stream: FakeStream) -> None:
        self.at, self.captured = self._gpu._record(stream)

    def _ready_at(self, what: str) -> int:
        self._gpu._unsafe_call(what)
        if self.captured:
            raise FakeCudaError("CUDA error: operation not permitted on an event last recorded in a capturing stream")
        if self.at is None:
            raise FakeCudaError("CUDA error: invalid resource handle (the event was never recorded)")
        return self.at

    def query(self) -> bool:
        return self._gpu.device_now() >= self._ready_at("cudaEventQuery")

    def synchronize(self) -> None:
        at = self._ready_at("cudaEventSynchronize")
        while (wait := self._gpu.host_ns_of(at) - time.monotonic_ns()) > 0:
            time.sleep(min(wait, 50_000_000) / 1e9)  # a blocking-sync wait: the thread sleeps

    def elapsed_time(self, end: FakeEvent) -> float:
        if self.captured or end.captured or self.at is None or end.at is None:
            raise FakeCudaError("CUDA error: invalid resource handle")
        delta = end.at - self.at
        return round(delta / self.RESOLUTION_NS) * self.RESOLUTION_NS / 1e6  # ms


class FakeTorchCuda:
    """The device clock's view of torch.cuda and the driver (``ClockDevice``), over a simulated GPU.

    The device's clock runs at ``drift_ppm`` from the host's, from an arbitrary base (``offset_ns``):
    only differences between events mean anything, as with real events. Work is queued with
    :meth:`launch` and runs in stream order; with ``max_connections=1`` every stream shares one
    hardware queue, so whatever is recorded anywhere completes only after all work queued before it
    (CUDA_DEVICE_MAX_CONNECTIONS=1). :meth:`capture` captures a graph on the calling thread; as CUDA
    documents, while a capture in global mode runs, an event query or synchronize from another thread
    in global mode is refused and invalidates the capture; a thread in thread-local mode is checked only
    against its own captures. ``thread_local_ok=False`` stands for a driver without
    ``cuThreadExchangeStreamCaptureMode``.
    """

    def __init__(self, *, offset_ns: int = 7_000_000_000_000, drift_ppm: float = 0.0, max_connections: int = 32,
                 thread_local_ok: bool = True) -> None:
        self.offset_ns = offset_ns
        self.drift = drift_ppm * 1e-6
        self.t0 = time.monotonic_ns()
        self.single_queue = max_connections == 1
        self.thread_local_ok = thread_local_ok
        self._lock = threading.RLock()
        self._tls = threading.local()
        self.default_stream = FakeStream("default")
        self._queue_busy = 0
        self._captures: list[_Capture] = []
        self.private_streams: list[FakeStream] = []
        self.released: list[FakeStream] = []
        self.refused_calls: list[str] = []

    # the simulated clock
    def device_now(self) -> int:
        return self.device_ns_of(time.monotonic_ns())

    def device_ns_of(self, host_ns: int) -> int:
        return int(host_ns + self.offset_ns + self.drift * (host_ns - self.t0))

    def host_ns_of(self, device_ns: int) -> int:
        return int((device_ns - self.offset_ns + self.drift * self.t0) / (1 + self.drift))

    # work
    def _stream(self, stream: FakeStream | None) -> FakeStream:
        return stream if stream is not None else self.current_stream()

    def launch(self, duration_ns: int, stream: FakeStream | None = None) -> None:
        """Queue a kernel of ``duration_ns`` on ``stream`` (the calling thread's current one)."""
        with self._lock:
            s = self._stream(stream)
            if s.capture is not None:
                return  # captured, not run
            start = max(s.busy_until, self.device_now(), self._queue_busy if self.single_queue else 0)
            s.busy_until = start + duration_ns
            if self.single_queue:
                self._queue_busy = s.busy_until

    def _record(self, stream: FakeStream) -> tuple[int | None, bool]:
        with self._lock:
            if stream.capture is not None:
                stream.capture.events += 1
                return None, True
            at = max(stream.busy_until, self.device_now(), self._queue_busy if self.single_queue else 0)
            if self.single_queue:
                self._queue_busy = at
            return at, False

    def _unsafe_call(self, what: str) -> None:
        me = threading.get_ident()
        mode = getattr(self._tls, "mode", CAPTURE_GLOBAL)
        with self._lock:
            for cap in self._captures:
                mine = cap.thread == me
                if (mine and cap.mode != CAPTURE_RELAXED) or (
                        not mine and cap.mode == CAPTURE_GLOBAL and mode == CAPTURE_GLOBAL):
                    cap.invalidated = cap.invalidated or f"{what} from another thread during a global capture"
                    self.refused_calls.append(what)
                    raise FakeCudaError(f"CUDA error: operation not permitted when stream is capturing ({what})")

    # ClockDevice
    def new_event(self) -> FakeEvent:
        return FakeEvent(self)

    def current_stream(self) -> FakeStream:
        return getattr(self._tls, "stream", None) or self.default_stream

    def capturing(self) -> bool:
        return self.current_stream().capture is not None

    def private_stream(self) -> FakeStream:
        stream = FakeStream(f"private-{len(self.private_streams)}", private=True)
        self.private_streams.append(stream)
        return stream

    def release_stream(self, stream: FakeStream) -> None:
        self.released.append(stream)

    def thread_local_capture_mode(self) -> bool:
        if not self.thread_local_ok:
            return False
        self._tls.mode = CAPTURE_THREAD_LOCAL
        return True

    # graphs
    def capture(self, mode: str = "global") -> _CaptureScope:
        """``with gpu.capture():`` captures what the calling thread queues meanwhile, as torch.cuda.graph."""
        return _CaptureScope(self, _CAPTURE_MODES[mode])


class _CaptureScope:
    def __init__(self, gpu: FakeTorchCuda, mode: int) -> None:
        self._gpu = gpu
        self._mode = mode
        self.capture: _Capture | None = None

    def __enter__(self) -> _Capture:
        gpu = self._gpu
        stream = FakeStream("capture")
        self.capture = stream.capture = _Capture(threading.get_ident(), self._mode)
        with gpu._lock:
            gpu._captures.append(self.capture)
        self._previous = getattr(gpu._tls, "stream", None)
        gpu._tls.stream = stream
        return self.capture

    def __exit__(self, *exc: object) -> None:
        gpu = self._gpu
        gpu._tls.stream = self._previous
        assert self.capture is not None
        with gpu._lock:
            gpu._captures.remove(self.capture)
        if self.capture.invalidated and exc[0] is None:
            raise FakeCudaError(f"CUDA error: operation not permitted when stream is capturing "
                                f"(the capture was invalidated: {self.capture.invalidated})")
