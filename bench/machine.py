"""Machine and version facts recorded with every benchmark result."""

from __future__ import annotations

import os
import platform
import sys
from importlib import metadata
from typing import Any


def machine_info() -> dict[str, Any]:
    cpu = ""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    versions = {}
    for package in ("freeride", "torch", "grpcio", "protobuf", "cupy-cuda12x", "cupy-cuda13x", "nvidia-ml-py"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = "not installed"
    versions = {k: v for k, v in versions.items() if not (k.startswith("cupy") and v == "not installed")}
    return {
        "cpu": cpu,
        "cores": len(os.sched_getaffinity(0)),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "versions": versions,
        **({"gpu": gpu} if (gpu := gpu_info()) else {}),
    }


def gpu_info() -> dict[str, Any]:
    """The first visible GPU's model, memory, driver and CUDA versions, from NVML (no CUDA context); {} without one."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no driver here: a CPU machine
        return {}
    try:
        count = pynvml.nvmlDeviceGetCount()
        if count == 0:
            return {}
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)

        def text(value: Any) -> str:
            return value.decode() if isinstance(value, bytes) else str(value)

        cuda = pynvml.nvmlSystemGetCudaDriverVersion()
        info: dict[str, Any] = {
            "name": text(pynvml.nvmlDeviceGetName(handle)),
            "count": count,
            "memory_bytes": int(pynvml.nvmlDeviceGetMemoryInfo(handle).total),
            "driver": text(pynvml.nvmlSystemGetDriverVersion()),
            "cuda_driver_api": f"{cuda // 1000}.{cuda % 1000 // 10}",
        }
    finally:
        pynvml.nvmlShutdown()
    try:
        import torch

        info["torch_cuda"] = torch.version.cuda
    except ImportError:
        pass
    return info


def gpu_slug(info: dict[str, Any]) -> str:
    """A folder-name form of the GPU's model: ``NVIDIA H100 80GB HBM3`` -> ``h100-80gb-hbm3``."""
    words = str(info.get("name", "unknown")).lower().replace("nvidia", "").split()
    return "-".join(w for w in ("".join(c for c in word if c.isalnum()) for word in words) if w) or "unknown"
