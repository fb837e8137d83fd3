"""Devices: everything that differs between a GPU and a CPU core lives behind this package.

A device is named ``cuda:N`` (one GPU, as the training job numbers it) or ``cpu:N`` (one CPU core, so
that everything runs, is tested and is shown without a GPU). :func:`open_device` gives the manager's
view (:class:`Device`: free memory, each task's usage, a worker's environment); :func:`worker_device`
gives a worker's view (:class:`WorkerDevice`: prepare the process, wait for a step's device work,
report its own usage). See :mod:`freeride.devices.cuda` for how GPUs are identified and accounted,
:mod:`freeride.devices.cuda_worker` for how a task's cap is split and enforced inside its worker,
:mod:`freeride.devices.cuda_driver` for where CUDA may be initialised, and :mod:`freeride.devices.mps`
for MPS.
"""

from __future__ import annotations

from collections.abc import Mapping

from freeride.devices.base import (
    MANAGER_AUTOGROUP_NICE,
    WORKER_NICENESS,
    Device,
    DeviceError,
    DeviceName,
    DeviceSample,
    WorkerDevice,
    WorkerSetupError,
    lower_autogroup_priority,
    parse_device_name,
    set_autogroup_nice,
)
from freeride.devices.cpu import CpuDevice, CpuWorkerDevice, check_cpu_device
from freeride.devices.cuda import CudaDevice, default_driver, resolve_uuid
from freeride.devices.cuda_driver import CudaDriver, LibCuda, SubprocessCudaDriver
from freeride.devices.cuda_worker import CudaWorkerDevice
from freeride.devices.mps import DEFAULT_SM_PERCENT, MpsMode, MpsPlan, MpsStatus, plan_mps, probe_mps
from freeride.devices.nvml import Nvml, NvmlError, PyNvml
from freeride.errors import ConfigError

__all__ = [
    "WORKER_NICENESS",
    "CpuDevice",
    "CpuWorkerDevice",
    "CudaDevice",
    "CudaWorkerDevice",
    "Device",
    "DeviceError",
    "DeviceName",
    "DeviceSample",
    "LibCuda",
    "MpsMode",
    "MpsPlan",
    "SubprocessCudaDriver",
    "WorkerDevice",
    "WorkerSetupError",
    "MANAGER_AUTOGROUP_NICE",
    "lower_autogroup_priority",
    "set_autogroup_nice",
    "open_device",
    "parse_device_name",
    "worker_device",
]


def open_device(
    name: str | DeviceName,
    *,
    mps: MpsMode | str = MpsMode.AUTO,
    mps_sm_percent: int | None = None,
    nvml: Nvml | None = None,
    driver: CudaDriver | None = None,
    env: Mapping[str, str] | None = None,
    mps_status: MpsStatus | None = None,
) -> Device:
    """The manager's :class:`Device` for a name, checking that it exists for this process.

    ``nvml``, ``driver``, ``env`` and ``mps_status`` replace the real NVML, libcuda, environment and MPS
    probe (tests). Raises ConfigError for a device that is not there or cannot be read, or (a GPU in
    ``EXCLUSIVE_PROCESS`` or ``PROHIBITED`` compute mode) that side tasks could not use as planned.
    This process never initialises CUDA (see :mod:`freeride.devices.cuda_driver`).
    """
    parsed = parse_device_name(name) if isinstance(name, str) else name
    if parsed.kind == "cpu":
        check_cpu_device(parsed)
        return CpuDevice(parsed)
    if nvml is None:
        try:
            nvml = PyNvml()
        except NvmlError as exc:
            raise ConfigError(f"unknown device {parsed}: no NVIDIA driver is usable here ({exc})") from None
    if driver is None:
        driver = default_driver() if env is None else SubprocessCudaDriver(dict(env))
    try:
        uuid = resolve_uuid(parsed, nvml, driver, env)
        plan = plan_mps(mps, DEFAULT_SM_PERCENT if mps_sm_percent is None else mps_sm_percent,
                        mps_status or probe_mps(env))
        try:
            return CudaDevice(parsed, uuid, nvml, plan, env)
        except ConfigError:
            plan.release()
            raise
    except NvmlError as exc:
        nvml.shutdown()
        raise ConfigError(f"unknown device {parsed}: NVML cannot list the GPUs ({exc})") from None
    except ConfigError:
        nvml.shutdown()
        raise


def worker_device(name: str | DeviceName) -> WorkerDevice:
    """A worker's :class:`WorkerDevice` (inside the process the manager started for a task)."""
    parsed = parse_device_name(name) if isinstance(name, str) else name
    return CpuWorkerDevice(parsed) if parsed.kind == "cpu" else CudaWorkerDevice(parsed)
