"""What the framework jobs share: a rank pinned to its core, and a stage made slower by a known amount.

:class:`Spin` is a module that passes its input through and keeps the core busy ``ms`` milliseconds in
its forward and again in its backward: compute, not idle, so the stage's neighbours wait by that much
more per micro-batch while the stage itself does not.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch


def spin(ms: float) -> None:
    """Busy-wait ``ms`` milliseconds on this thread (the core stays busy, as with compute)."""
    end = time.perf_counter_ns() + int(ms * 1e6)
    while time.perf_counter_ns() < end:
        pass


class _SpinFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, ms: float) -> torch.Tensor:  # type: ignore[override]
        ctx.ms = ms
        spin(ms)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        spin(ctx.ms)
        return grad, None


class Spin(torch.nn.Module):
    """Identity that spins ``ms`` in the forward and in the backward (nothing at ``ms=0``)."""

    def __init__(self, ms: float = 0.0) -> None:
        super().__init__()
        self.ms = float(ms)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ms <= 0:
            return x
        out: torch.Tensor = _SpinFunction.apply(x, self.ms)
        return out


def pin_rank(local_rank: int) -> tuple[str, set[int]]:
    """Pin this process to one of the cores it may use (in order of local rank) and one torch thread.

    Returns the device name (``cpu:N``) and the cores the process was given before, for threads that
    should stay off the training thread's core (the reporter's sender).
    """
    given = set(os.sched_getaffinity(0))
    core = sorted(given)[local_rank % len(given)]
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    return f"cpu:{core}", given
