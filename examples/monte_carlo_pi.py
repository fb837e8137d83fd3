"""A tiny side task: estimate pi by Monte Carlo sampling, a batch of points per step.

This is the example that ``docs/writing-side-tasks.md`` walks through. Try it alone with::

    cd examples && freeride run-task monte_carlo_pi:MonteCarloPi --arg total_samples=10000000 --seconds 5

The task throws random points into the unit square and counts those inside the quarter circle;
4 * inside / samples tends to pi. Each ``step()`` draws one batch on the device, so a step takes a
steady, short time. Everything that evolves -- the counts and the random generator's state --
is in ``state_dict``, so a run interrupted at any step and resumed ends with exactly the same
estimate as one that ran straight through.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from freeride.errors import ConfigError
from freeride.task import SideTask, TaskContext


class MonteCarloPi(SideTask):
    """Estimate pi from ``total_samples`` random points, ``batch`` points per step.

    Args:
        total_samples: points in all; the task is done when they are drawn.
        batch: points per step (two float32 coordinates each).
        seed: the generator's seed; same seed, same estimate.
    """

    progress_unit: ClassVar[str] = "samples"
    #: Fallback declared peak; :meth:`estimate_memory` refines it from the batch size.
    memory_estimate_bytes: ClassVar[int | None] = 64 << 20

    def __init__(self, total_samples: int = 10_000_000, batch: int = 250_000, seed: int = 0) -> None:
        if total_samples < 1 or batch < 1:
            raise ConfigError("total_samples and batch must be >= 1")
        self.total_samples = int(total_samples)
        self.batch = int(batch)
        self.seed = int(seed)
        self.samples = 0
        self.inside = 0

    @classmethod
    def estimate_memory(cls, **kwargs: Any) -> int | None:
        # Per point: two float32 coordinates, their squares, the sum and a mask (about 21 bytes),
        # doubled for the allocator's cache; plus torch's own start-up buffers.
        return 48 * int(kwargs.get("batch", 250_000)) + (48 << 20)

    def setup(self, ctx: TaskContext) -> None:
        needed = self.estimate_memory(batch=self.batch) or 0
        if needed > ctx.memory_limit_bytes:
            raise ConfigError(
                f"MonteCarloPi with batch {self.batch} needs about {needed} bytes, more than its "
                f"limit of {ctx.memory_limit_bytes}; lower batch"
            )
        self.device = torch.device(ctx.device)
        # A private generator on the task's device: the global RNG belongs to the process.
        self.generator = torch.Generator(device=self.device).manual_seed(self.seed)

    def step(self) -> None:
        count = min(self.batch, self.total_samples - self.samples)
        if count <= 0:
            return
        points = torch.rand(count, 2, generator=self.generator, device=self.device)
        self.inside += int(((points * points).sum(dim=1) <= 1.0).sum())
        self.samples += count

    def done(self) -> bool:
        return self.samples >= self.total_samples

    def progress(self) -> float:
        return float(self.samples)

    def estimate(self) -> float:
        """The current estimate of pi (nan before the first step)."""
        return 4.0 * self.inside / self.samples if self.samples else math.nan

    def state_dict(self) -> dict[str, Any]:
        return {"samples": self.samples, "inside": self.inside, "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.samples = int(state["samples"])
        self.inside = int(state["inside"])
        self.generator.set_state(state["generator"])
