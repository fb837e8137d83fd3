"""The CUDA driver API, as far as freeride uses it, and where each process may call it.

Two calls: the UUID of each GPU this process's CUDA sees (``cuDeviceGetUuid_v2``: the MIG device's
own UUID on a MIG slice, where the first version gives its GPU's) and blocking synchronisation on a
primary context. Neither creates a context. But ``cuInit`` itself makes a process a client of a live
MPS control daemon, whose server then serves it (and, under ``EXCLUSIVE_PROCESS``, holds the GPU for
it). So the manager never initialises CUDA: :class:`SubprocessCudaDriver` asks a short-lived child,
started with an empty private MPS pipe directory, so that the child cannot join a daemon either. A
worker, which is meant to be a client where MPS is used, calls :class:`LibCuda` in its own process.

Run as ``python -m freeride.devices.cuda_driver`` this module is that child: it prints one UUID (32 hex
digits) per visible GPU, in CUDA's order, or ``error: ...`` and exits 1.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Protocol

from freeride.devices.base import DeviceError

#: Set in every CUDA worker's environment: the UUID of its GPU (also its CUDA_VISIBLE_DEVICES).
UUID_ENV = "FREERIDE_CUDA_UUID"
#: Threads a GPU worker's CPU side may use: it launches kernels and waits; it must not take cores
#: from the trainer's own launch thread.
GPU_WORKER_THREADS = "2"
#: The least the allocator must be left after the context for a task to be worth starting.
MIN_ALLOCATOR_BYTES = 64 * 2**20
MiB = 2**20
#: Settings of the manager's environment that a side task must not inherit from it (often the
#: trainer's, when one job script starts both): synchronous launches (``CUDA_LAUNCH_BLOCKING``) make
#: a side task's steps hold the host for every kernel; an allocator configuration chosen for the
#: trainer (another backend, caching off) can void the allocator cap. Workers drop them before
#: CUDA starts, and the manager says so once.
INHERITED_SETTINGS = ("CUDA_LAUNCH_BLOCKING", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF",
                      "PYTORCH_NO_CUDA_MEMORY_CACHING")

_CU_CTX_SCHED_BLOCKING_SYNC = 0x04
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


class CudaDriver(Protocol):
    """What freeride asks of the CUDA driver API (libcuda): no context is created by either call."""

    def device_uuids(self) -> list[bytes]:
        """The 16-byte UUID of each GPU (or MIG device) this process sees, in CUDA's order."""
        ...

    def set_blocking_sync(self, ordinal: int) -> None:
        """Make synchronisation on this GPU's primary context sleep, not spin (before it exists)."""
        ...


class LibCuda:
    """The CUDA driver API through ctypes, in this process. Raises DeviceError when libcuda cannot be loaded."""

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
        # _v2 gives a MIG device's own UUID; the first version gives its parent GPU's, which would
        # resolve a MIG slice to the whole GPU.
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


class SubprocessCudaDriver:
    """:meth:`device_uuids` from a child process that cannot join MPS (see the module doc).

    ``argv`` replaces the child's command (tests); ``env`` is the environment it starts from (the
    manager's: ``CUDA_VISIBLE_DEVICES`` and ``CUDA_DEVICE_ORDER`` apply there as in the job).
    """

    def __init__(self, env: dict[str, str] | None = None, argv: list[str] | None = None,
                 timeout_s: float = 60.0) -> None:
        self._env = dict(os.environ if env is None else env)
        self._argv = argv or [sys.executable, "-m", "freeride.devices.cuda_driver"]
        self._timeout_s = timeout_s

    def device_uuids(self) -> list[bytes]:
        pipes = tempfile.mkdtemp(prefix="freeride-no-mps-")
        env = dict(self._env)
        env["CUDA_MPS_PIPE_DIRECTORY"] = pipes  # empty: the child's cuInit finds no daemon to join
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH", "")) if p)
        try:
            done = subprocess.run(self._argv, env=env, capture_output=True, text=True, timeout=self._timeout_s,
                                  stdin=subprocess.DEVNULL, check=False)
        except subprocess.TimeoutExpired:
            raise DeviceError(f"the CUDA driver did not list the GPUs within {self._timeout_s:.0f} s") from None
        except OSError as exc:
            raise DeviceError(f"cannot ask the CUDA driver ({exc})") from None
        finally:
            shutil.rmtree(pipes, ignore_errors=True)
        return parse_probe_output(done.returncode, done.stdout, done.stderr)

    def set_blocking_sync(self, ordinal: int) -> None:
        raise DeviceError("blocking synchronisation is set in the process that uses the GPU")


def parse_probe_output(returncode: int, stdout: str, stderr: str = "") -> list[bytes]:
    """The UUIDs the probe child printed; DeviceError with its reason when it failed."""
    lines = [line.strip() for line in stdout.splitlines() if line.strip()]
    errors = [line.split(":", 1)[1].strip() for line in lines if line.startswith("error:")]
    if returncode != 0 or errors:
        reason = errors[0] if errors else (stderr.strip().splitlines() or [f"exit {returncode}"])[-1]
        raise DeviceError(reason)
    try:
        return [bytes.fromhex(line) for line in lines if len(line) == 32]
    except ValueError:
        raise DeviceError(f"the CUDA probe printed {stdout[:200]!r}, not UUIDs") from None


def _probe_main() -> int:
    try:
        uuids = LibCuda().device_uuids()
    except DeviceError as exc:
        print(f"error: {exc}", flush=True)
        return 1
    for raw in uuids:
        print(raw.hex())
    return 0


if __name__ == "__main__":
    raise SystemExit(_probe_main())
