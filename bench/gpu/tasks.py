"""Synthetic GPU side tasks for the GPU tests and measurements: known work, known memory.

* :class:`KernelStorm` queues ``kernels`` matrix products of ``size`` x ``size`` per step and returns at
  once, as CUDA code does: the kernel-heavy case for park tails and step-time accuracy.
* :class:`CudaHog` holds ``mib_per_step`` more memory after every step, through torch's allocator
  (``via="torch"``: the allocator cap stops it) or around it (``via="raw"``: a bare ``cudaMalloc``
  through CuPy's runtime, which only the manager's watchdog sees).
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
        if via not in ("torch", "raw"):
            raise ValueError("via must be torch or raw")
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
        else:
            import cupy

            self.held.append(cupy.cuda.runtime.malloc(size))  # around every pool: only NVML sees it

    def done(self) -> bool:
        return False

    def progress(self) -> float:
        return float(len(self.held) * self.mib)
