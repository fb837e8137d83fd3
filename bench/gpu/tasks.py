"""Synthetic GPU side tasks for the GPU tests and measurements: known work, known memory.

* :class:`KernelStorm` queues ``kernels`` matrix products of ``size`` x ``size`` per step and returns at
  once, as CUDA code does: the kernel-heavy case for park tails and step-time accuracy.
* :class:`CudaHog` holds ``mib_per_step`` more memory after every step, through torch's allocator
  (``via="torch"``: the allocator cap stops it), around it (``via="raw"``: a bare ``cudaMalloc``
  through CuPy's runtime, which only the manager's watchdog sees), or on the host (``via="host"``:
  the manager's resident-set watchdog caps a GPU worker's host memory too).
* :class:`InheritedSettings` fails its step if its worker kept a CUDA setting of the manager's
  environment that workers must drop (``CUDA_LAUNCH_BLOCKING``, allocator settings).
"""

from __future__ import annotations

from typing import Any

from freeride import SideTask, TaskContext


class KernelStorm(SideTask):
    progress_unit = "kernels"

    def __init__(self, size: int = 4096, kernels: int = 8, total_steps: int = 0) -> None:
        self.size = int(size)
        self.kernels = int(kernels)
        self.total_steps = int(total_steps)
        self.steps = 0

    def setup(self, ctx: TaskContext) -> None:
        import torch

        self.torch = torch
        self.a = torch.randn(self.size, self.size, device=ctx.device, dtype=torch.bfloat16)
        self.b = torch.randn(self.size, self.size, device=ctx.device, dtype=torch.bfloat16)
        self.c = torch.empty_like(self.a)

    def step(self) -> None:
        for _ in range(self.kernels):
            self.torch.matmul(self.a, self.b, out=self.c)
        self.steps += 1

    def done(self) -> bool:
        return bool(self.total_steps) and self.steps >= self.total_steps

    def progress(self) -> float:
        return float(self.steps * self.kernels)

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state["steps"])


class CudaHog(SideTask):
    progress_unit = "MiB"

    def __init__(self, mib_per_step: int = 256, via: str = "torch") -> None:
        if via not in ("torch", "raw", "host"):
            raise ValueError("via must be torch, raw or host")
        self.mib = int(mib_per_step)
        self.via = via
        self.held: list[Any] = []

    def setup(self, ctx: TaskContext) -> None:
        self.device = ctx.device

    def step(self) -> None:
        size = self.mib * 2**20
        if self.via == "torch":
            import torch

            block = torch.empty(size, dtype=torch.uint8, device=self.device)
            block.fill_(1)
            self.held.append(block)
        elif self.via == "raw":
            import cupy

            self.held.append(cupy.cuda.runtime.malloc(size))  # around every pool: only NVML sees it
        else:
            page = bytearray(size)
            page[::4096] = b"\x01" * len(page[::4096])  # touched: resident, not only reserved
            self.held.append(page)

    def done(self) -> bool:
        return False

    def progress(self) -> float:
        return float(len(self.held) * self.mib)


class InheritedSettings(SideTask):
    """Fails if its worker still has a CUDA setting the manager's environment carried."""

    def setup(self, ctx: TaskContext) -> None:
        import os

        from freeride.devices.cuda_driver import INHERITED_SETTINGS

        self.kept = {k: os.environ[k] for k in INHERITED_SETTINGS if k in os.environ}

    def step(self) -> None:
        if self.kept:
            raise RuntimeError(f"the worker kept {self.kept}")

    def done(self) -> bool:
        return False
