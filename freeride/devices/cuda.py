"""``cuda:N``: one NVIDIA GPU (or MIG slice), named as the training job sees it, identified by its UUID.

**Identity.** CUDA numbers GPUs after ``CUDA_VISIBLE_DEVICES`` (and ``CUDA_DEVICE_ORDER``, fastest
first by default); NVML numbers them by PCI bus. Under Slurm or Kubernetes the two differ, and
reading NVML's GPU N would read another job's GPU. So ``cuda:N`` is resolved once, at start, to a
UUID: through the CUDA driver where ``libcuda`` loads (``cuDeviceGetUuid_v2`` on ordinal N, which
applies both variables exactly as the job's processes do, and gives a MIG slice's own ``MIG-`` UUID),
asked by a child process so that the manager itself never initialises CUDA (see
:mod:`freeride.devices.cuda_driver`: ``cuInit`` would make it an MPS client); else from
``CUDA_VISIBLE_DEVICES`` (UUIDs and UUID prefixes are exact; plain indices assume PCI order, which
holds on GPUs of one model, and are refused where MIG is on). Every NVML query then goes to that
UUID's handle, and every worker is started with ``CUDA_VISIBLE_DEVICES=<UUID>``: it sees its GPU as
``cuda:0`` and no other, so no library it loads can open a context on another device.

**Compute mode.** In ``EXCLUSIVE_PROCESS`` mode one process holds the GPU (the trainer, or the MPS
server where one runs): side tasks can share it only as MPS clients, so a manager that would run
them outside MPS there refuses to start, saying so, instead of failing every task. ``PROHIBITED``
allows no context at all.

**Accounting.** A side task's memory is what NVML lists for its processes: compute, graphics and
MPS-client lists together (under MPS clients appear only in the last). In a container without the
host's PID namespace NVML lists host PIDs that match none of the manager's: the worker's own report
(:meth:`~freeride.devices.cuda_worker.CudaWorkerDevice.used_bytes`) is then the figure. Each
worker's host memory is read too (its resident set, as on a CPU core): the core caps its growth
beyond the worker's baseline. Readings run on a thread of their own with a deadline
(:class:`~freeride.devices.nvml.Deadline`): a stuck NVML call turns the device NOT_SERVING.

The worker's side (one cap for the context, torch and CuPy) is :mod:`freeride.devices.cuda_worker`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from freeride.devices.base import Device, DeviceError, DeviceName, DeviceSample
from freeride.devices.cpu import rss_bytes
from freeride.devices.cuda_driver import (
    GPU_WORKER_THREADS,
    INHERITED_SETTINGS,
    MIN_ALLOCATOR_BYTES,
    UUID_ENV,
    CudaDriver,
    LibCuda,
    SubprocessCudaDriver,
)
from freeride.devices.mps import MpsPlan
from freeride.devices.nvml import (
    COMPUTE_MODE_EXCLUSIVE_PROCESS,
    COMPUTE_MODE_NAMES,
    COMPUTE_MODE_PROHIBITED,
    Deadline,
    GpuProcess,
    Nvml,
    NvmlError,
    usage_by_pid,
)
from freeride.errors import ConfigError

__all__ = [
    "GPU_WORKER_THREADS",
    "INHERITED_SETTINGS",
    "MIN_ALLOCATOR_BYTES",
    "UUID_ENV",
    "CudaDevice",
    "CudaDriver",
    "LibCuda",
    "SubprocessCudaDriver",
    "format_uuid",
    "resolve_uuid",
    "uuids_from_visible_devices",
]

log = logging.getLogger(__name__)

#: How long one device reading may take before the device counts as unreadable.
NVML_TIMEOUT_S = 10.0


# ---------------------------------------------------------------------- identity


def format_uuid(raw: bytes) -> str:
    """The 8-4-4-4-12 hex form NVML prints after ``GPU-`` or ``MIG-``."""
    h = raw.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def _known_uuids(nvml: Nvml) -> tuple[list[str], list[str]]:
    """(every physical GPU's UUID in PCI order, every MIG device's UUID under them)."""
    gpus, migs = [], []
    for i in range(nvml.device_count()):
        handle = nvml.handle_by_index(i)
        gpus.append(nvml.uuid(handle))
        migs.extend(nvml.mig_uuids(handle))
    return gpus, migs


def _match_uuid(entry: str, known: list[str]) -> str | None:
    """A CUDA_VISIBLE_DEVICES UUID entry (full or a unique prefix, ``GPU-``/``MIG-`` included)."""
    found = [u for u in known if u.lower().startswith(entry.lower())]
    return found[0] if len(found) == 1 else None


def uuids_from_visible_devices(value: str | None, nvml: Nvml, order: str | None = None) -> list[str]:
    """The UUIDs a process sees under ``CUDA_VISIBLE_DEVICES=value``, as CUDA reads the list.

    Unset: every GPU, in NVML's (PCI) order. Entries are indices or UUIDs (or unique UUID prefixes) of
    GPUs or MIG devices; like CUDA, the list ends at the first entry that names no GPU. Indices count in
    PCI order, which is CUDA's under ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` and on GPUs of one model; on mixed
    models with the default fastest-first order they may not be, and a warning says so. With MIG on,
    CUDA numbers MIG devices, not GPUs, in an order NVML does not give: indices are then refused
    (the libcuda path is exact).
    """
    gpus, migs = _known_uuids(nvml)
    entries = [str(i) for i in range(len(gpus))] if value is None else [e.strip() for e in value.split(",")]
    if migs and any(e.isdigit() for e in entries):
        raise ConfigError("MIG is on here and libcuda cannot be asked: CUDA numbers MIG devices in its own order, "
                          "so name the slice by its UUID in CUDA_VISIBLE_DEVICES (nvidia-smi -L lists them)")
    if order != "PCI_BUS_ID" and any(e.isdigit() for e in entries) and len({_model(nvml, u) for u in gpus}) > 1:
        log.warning("CUDA_VISIBLE_DEVICES has indices and the GPUs differ in model: without CUDA_DEVICE_ORDER="
                    "PCI_BUS_ID, CUDA may number them differently from NVML; name GPUs by UUID to be exact")
    out: list[str] = []
    for entry in entries:
        uuid = gpus[int(entry)] if entry.isdigit() and int(entry) < len(gpus) else _match_uuid(entry, gpus + migs)
        if uuid is None or uuid in out:
            break
        out.append(uuid)
    return out


def _model(nvml: Nvml, uuid: str) -> str:
    return nvml.name(nvml.handle_by_uuid(uuid))


def _driver_uuids(raw: list[bytes], nvml: Nvml) -> list[str]:
    """NVML's spelling (``GPU-``/``MIG-`` and case) of the UUIDs the driver gave, in the driver's order."""
    gpus, migs = _known_uuids(nvml)
    out = []
    for r in raw:
        text = format_uuid(r)
        match = next((u for u in gpus + migs if u.lower().endswith(text)), None)
        if match is None:
            raise ConfigError(f"CUDA sees a device with UUID {text} that NVML does not list (GPUs: "
                              f"{', '.join(gpus) or 'none'}; MIG devices: {', '.join(migs) or 'none'})")
        out.append(match)
    return out


def resolve_uuid(name: DeviceName, nvml: Nvml, driver: CudaDriver | None,
                 env: Mapping[str, str] | None = None) -> str:
    """The UUID of ``cuda:N`` as this process's CUDA numbers it. Raises ConfigError if there is none."""
    env = os.environ if env is None else env
    visible: list[str] | None = None
    if driver is not None:
        try:
            raw = driver.device_uuids()
        except DeviceError as exc:
            log.warning("the CUDA driver could not list the GPUs (%s); reading CUDA_VISIBLE_DEVICES instead", exc)
        else:
            visible = _driver_uuids(raw, nvml)
    if visible is None:
        visible = uuids_from_visible_devices(env.get("CUDA_VISIBLE_DEVICES"), nvml, env.get("CUDA_DEVICE_ORDER"))
    if name.index >= len(visible):
        shown = env.get("CUDA_VISIBLE_DEVICES")
        where = f" (CUDA_VISIBLE_DEVICES={shown})" if shown is not None else ""
        raise ConfigError(f"unknown device {name}: this job sees {len(visible)} GPU(s){where}")
    return visible[name.index]


# ---------------------------------------------------------------------- the manager's view


class CudaDevice(Device):
    """One GPU or MIG slice, by UUID, as its manager sees it; every query goes through NVML (module doc).

    ``env`` is the manager's environment (its inherited CUDA settings are named once at start).
    """

    def __init__(self, name: DeviceName, uuid: str, nvml: Nvml, mps: MpsPlan,
                 env: Mapping[str, str] | None = None, nvml_timeout_s: float = NVML_TIMEOUT_S) -> None:
        super().__init__(name)
        self.uuid = uuid
        self.mps = mps
        self._nvml = nvml
        self._deadline = Deadline(nvml_timeout_s, name=f"nvml-{name.slug}")
        try:
            self._handle = nvml.handle_by_uuid(uuid)
            self.model = nvml.name(self._handle)
            self.total_bytes = nvml.memory(self._handle)[0]
            self.compute_mode = nvml.compute_mode(self._handle)
        except NvmlError as exc:
            raise ConfigError(f"device {name} ({uuid}) cannot be read: {exc}") from None
        self._check_compute_mode()
        env = os.environ if env is None else env
        inherited = [f"{k}={env[k]}" for k in INHERITED_SETTINGS if k in env]
        if inherited:
            log.warning("[%s] side tasks do not inherit %s from the manager's environment (set for the "
                        "trainer?): their workers drop them before CUDA starts", name, ", ".join(inherited))

    def _check_compute_mode(self) -> None:
        mode = COMPUTE_MODE_NAMES.get(self.compute_mode, str(self.compute_mode))
        if self.compute_mode == COMPUTE_MODE_PROHIBITED:
            raise ConfigError(f"device {self.name} ({self.uuid}) is in compute mode PROHIBITED: no process may "
                              "create a CUDA context on it, so no side task can run there")
        if self.compute_mode == COMPUTE_MODE_EXCLUSIVE_PROCESS and not self.mps.use:
            why = ("--mps off keeps side tasks out of the MPS daemon that runs" if self.mps.private_pipe_directory
                   else f"no MPS daemon serves it ({self.mps.status.detail})")
            raise ConfigError(
                f"device {self.name} ({self.uuid}) is in compute mode {mode}: one process holds the GPU (the "
                f"trainer, or an MPS server), so side tasks can share it only as MPS clients, and {why}. Start "
                "an MPS daemon (nvidia-cuda-mps-control -d) and run the manager with --mps auto or require, or "
                "set the GPU to DEFAULT mode"
            )

    def _read(self, what: str, fn: Callable[[], Any]) -> Any:
        try:
            return self._deadline.call(what, fn)
        except NvmlError as exc:
            raise DeviceError(f"{self.name} ({self.uuid}): {what}: {exc}") from None

    def free_memory_bytes(self) -> int:
        return int(self._read("free memory", lambda: self._nvml.memory(self._handle)[1]))

    def total_memory_bytes(self) -> int | None:
        return int(self.total_bytes) or None

    def _processes(self) -> list[GpuProcess]:
        return self._nvml.processes(self._handle) + self._nvml.mps_processes(self._handle)

    def process_memory_bytes(self, pids: Sequence[int]) -> int:
        usage = usage_by_pid(self._read("process list", self._processes))
        return sum(usage.get(pid, 0) for pid in set(pids))

    def sample(self, task_pids: Mapping[str, Sequence[int]], *, free: bool = True) -> DeviceSample:
        # One reading (free memory and one process listing for every task), under one deadline.
        def read() -> tuple[int | None, dict[int, int]]:
            free_bytes = int(self._nvml.memory(self._handle)[1]) if free else None
            return free_bytes, (usage_by_pid(self._processes()) if task_pids else {})

        try:
            free_bytes, usage = self._read("reading", read)
        except DeviceError as exc:
            return DeviceSample(None, {}, str(exc))
        return DeviceSample(
            free_bytes,
            {task: sum(usage.get(p, 0) for p in set(pids)) for task, pids in task_pids.items()},
            host_bytes={task: sum(rss_bytes(p) for p in set(pids)) for task, pids in task_pids.items()},
        )

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
        mode = "" if self.compute_mode in (0, -1) else f", compute mode {COMPUTE_MODE_NAMES.get(self.compute_mode)}"
        return (f"{self.name} = {self.model} {self.uuid}, {self.total_bytes / 2**30:.1f} GiB{mode}; "
                f"{self.mps.describe()}")

    def close(self) -> None:
        self._nvml.shutdown()
        self.mps.release()


def default_driver() -> CudaDriver:
    """The manager's driver: a child process asks libcuda (see :mod:`freeride.devices.cuda_driver`)."""
    return SubprocessCudaDriver()

