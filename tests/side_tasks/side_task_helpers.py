"""Helpers for side-task tests: a CPU TaskContext and an interrupt-and-resume driver."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch
from conftest import cpu_devices

from freeride.task import SideTask, TaskContext

DEVICE = cpu_devices(1)[0]  # a core this process may run on: tests never name core numbers

GiB = 1 << 30


def make_ctx(work_dir: Path, memory_limit_bytes: int = 2 * GiB) -> TaskContext:
    work_dir.mkdir(parents=True, exist_ok=True)
    return TaskContext(
        device="cpu",
        device_name=DEVICE,
        memory_limit_bytes=memory_limit_bytes,
        task_id="test",
        work_dir=work_dir,
        logger=logging.getLogger("test.task"),
    )


def run_to_end(task: SideTask, max_steps: int = 10_000) -> int:
    steps = 0
    while not task.done() and steps < max_steps:
        task.step()
        steps += 1
    return steps


def run_interrupted(
    factory: Callable[[], SideTask], work_dir: Path, stop_after: int, until_done: bool = True, total: int = 0
) -> SideTask:
    """Run ``stop_after`` steps, checkpoint through torch.save (as the runtime does), build a
    fresh instance, set it up, load the checkpoint and finish (or run to ``total`` steps)."""
    first = factory()
    first.setup(make_ctx(work_dir))
    for _ in range(stop_after):
        first.step()
    path = work_dir / "checkpoint.pt"
    torch.save(first.state_dict(), path)
    first.close()
    del first
    second = factory()
    second.setup(make_ctx(work_dir))
    second.load_state_dict(torch.load(path, weights_only=False))
    if until_done:
        run_to_end(second)
    else:
        for _ in range(total - stop_after):
            second.step()
    return second
