"""What the demo runs, where, and how big.

The demo trains the reference GPT as a 2-stage 1F1B pipeline, one stage per device, and gives
the two devices three side tasks: a small language model (the training task) alone on stage 0's
device, a PageRank and an image watermarking task sharing stage 1's device. Stage 0 has two
bubbles per iteration (1F1B's turnaround and its drain), stage 1 one longer one. On stage 1 the two
tasks share the bubbles one grant at a time (the manager's best fit; a task that parks early hands
the rest of its bubble to the other), which the timeline picture shows.

Sizes are chosen from what the trainer measures on CPU cores. With the trainer's default model
(128 wide) iterations take 100-200 ms and bubbles 2-30 ms, shorter than a small training step on a
busy machine (2.5 ms alone, 10-15 ms when other programs share the core), which then fits no
bubble. The demo trains a 256-wide model instead: iterations of 200-500 ms and bubbles of 25-90 ms
(stage 0's turnaround, stage 1's) and 5-20 ms (stage 0's drain), depending on the machine's load,
for side-task steps of 1-6 ms alone (``freeride run-task ... --seconds 3`` prints a task's step
time). Every task is sized so that it cannot finish during the demo (no convergence test for
PageRank, a long image stream, many training steps): a finished task would stop harvesting and
understate the harvest efficiency. Memory caps count the worker's whole resident set on CPU, torch
included (about 250-350 MiB).

**On GPUs** (the default where there is one): with two or more GPUs the same 2-stage pipeline runs
for real over NCCL, stage k on GPU k; with one GPU, stage 0 runs for real on ``cuda:0`` and its
neighbour is emulated by timed waits (:mod:`freeride.workload.single_stage`), and the three tasks
share that GPU. The trainer is larger (so that GPU bubbles last milliseconds) and so are the side
tasks, whose caps (2 GiB) cover a CUDA context as well as their data. The GPU plan has not run on this
project's CI, which has no GPU.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from freeride.errors import ConfigError

DEVICE_KINDS = ("cpu", "cuda")
#: What ``freeride demo --device`` accepts: ``auto`` is cuda where torch sees a GPU, cpu otherwise.
DEVICE_CHOICES = ("auto", *DEVICE_KINDS)
#: Iterations of a full run: about 60 s of training per run on two CPU cores, 2-4 min in all.
FULL_ITERATIONS = 250
#: Iterations of a ``--quick`` run (CI): a few seconds of bubble time per device.
QUICK_ITERATIONS = 40
#: Iterations the trainer marks as warm-up; the bubble fractions and the overhead leave them out.
WARMUP_ITERATIONS = 3
MAX_ITERATIONS = 100_000
#: Standalone measurement of each side task (seconds of stepping, setup excluded).
FULL_STANDALONE_S = 3.0
QUICK_STANDALONE_S = 1.0

_MIB = 2**20
_GIB = 2**30
#: Large enough that no task finishes within any demo run.
_ENDLESS = 10**7


@dataclass(frozen=True)
class TaskPlan:
    """One side task of the demo: what to submit, and to which of the two devices (0 or 1)."""

    name: str
    target: str
    args: dict[str, Any]
    memory_bytes: int
    device_index: int


@dataclass(frozen=True)
class DemoConfig:
    """The demo's knobs, validated at construction (:class:`ConfigError` with a clear message).

    Attributes:
        device_kind: ``cpu`` (stage k on a CPU core) or ``cuda`` (stage k on GPU k).
        single_stage: one device: stage 0 runs for real on it and its neighbour is emulated (one GPU).
        iterations: training iterations of the baseline run and of the run with side tasks.
        warmup_iterations: leading iterations left out of bubble fractions and overhead.
        out_dir: where every output goes (see :func:`freeride._demo.run.run_demo`).
        quick: the CI size (fewer iterations, shorter standalone measurements).
        standalone_s: seconds each side task steps alone to measure its throughput.
        ready_timeout_s: how long managers may take to serve and workers to start.
        stop_timeout_s: how long a stopped process may take before it is killed.
        progress_interval_s: seconds between progress lines while training runs.
    """

    device_kind: str = "cpu"
    iterations: int = FULL_ITERATIONS
    warmup_iterations: int = WARMUP_ITERATIONS
    out_dir: Path = Path("out/demo")
    quick: bool = False
    standalone_s: float = FULL_STANDALONE_S
    ready_timeout_s: float = 60.0
    stop_timeout_s: float = 30.0
    progress_interval_s: float = 2.0
    trainer_args: tuple[str, ...] = field(default=())
    single_stage: bool = False

    def __post_init__(self) -> None:
        if self.device_kind not in DEVICE_KINDS:
            raise ConfigError(f"--device must be one of {', '.join(DEVICE_KINDS)}, got {self.device_kind!r}")
        if self.warmup_iterations < 0:
            raise ConfigError(f"warm-up iterations must be >= 0, got {self.warmup_iterations}")
        low = self.warmup_iterations + 2
        if not low <= self.iterations <= MAX_ITERATIONS:
            raise ConfigError(
                f"--iterations must be between {low} (warm-up {self.warmup_iterations} + 2 measured) "
                f"and {MAX_ITERATIONS}, got {self.iterations}"
            )
        for name in ("standalone_s", "ready_timeout_s", "stop_timeout_s", "progress_interval_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{name} must be a finite number > 0, got {value}")

    @classmethod
    def make(cls, device_kind: str, iterations: int | None, out_dir: Path, quick: bool,
             cuda_count: Callable[[], int] | None = None) -> DemoConfig:
        """The configuration for the command line's choices (sizes from ``quick`` and the device).

        ``device_kind`` ``auto`` picks cuda where there is a GPU; one GPU means the single-stage mode.
        """
        count = (cuda_count or _cuda_device_count)() if device_kind in ("auto", "cuda") else 0
        if device_kind == "auto":
            device_kind = "cuda" if count >= 1 else "cpu"
        if iterations is None:
            iterations = QUICK_ITERATIONS if quick else FULL_ITERATIONS
        return cls(
            device_kind=device_kind,
            iterations=iterations,
            out_dir=out_dir,
            quick=quick,
            standalone_s=QUICK_STANDALONE_S if quick else FULL_STANDALONE_S,
            trainer_args=trainer_model_args(device_kind),
            single_stage=device_kind == "cuda" and count == 1,
        )


def trainer_model_args(device_kind: str) -> tuple[str, ...]:
    """The reference trainer's model options for a device kind.

    On CPU, a 4-layer 256-wide GPT with 4 micro-batches of 4 (see the module docstring). On GPUs
    that model would finish an iteration in a few milliseconds and leave bubbles shorter than any
    side-task step, so the CUDA demo trains a larger one.
    """
    if device_kind == "cuda":
        return ("--d-model", "1024", "--heads", "16", "--layers", "8", "--seq-len", "512",
                "--microbatch-size", "8")  # fmt: skip
    return ("--d-model", "256")


def plan_tasks(device_kind: str, devices: int = 2) -> tuple[TaskPlan, ...]:
    """The three side tasks and their device, of ``devices`` (see the module docstring for the choices)."""
    if device_kind == "cuda":
        second = 1 if devices > 1 else 0
        return (
            TaskPlan("lstm", "side_tasks.training:LSTMLanguageModelTraining",
                     {"seq_len": 64, "batch_size": 16, "hidden": 128, "max_steps": _ENDLESS}, 2 * _GIB, 0),
            TaskPlan("pagerank", "side_tasks.graphs:PageRank",
                     {"graph": "rmat:18", "tol": 0.0, "max_iterations": _ENDLESS}, 2 * _GIB, second),
            TaskPlan("watermark", "side_tasks.images:ImageWatermark",
                     {"max_side": 512, "batch_size": 1, "repeat": _ENDLESS}, 2 * _GIB, second),
        )  # fmt: skip
    if device_kind != "cpu":
        raise ConfigError(f"unknown device kind {device_kind!r}")
    return (
        # About 2.5 ms a step alone on one core.
        TaskPlan("lstm", "side_tasks.training:LSTMLanguageModelTraining",
                 {"seq_len": 32, "batch_size": 8, "embed": 32, "hidden": 64, "layers": 1, "max_steps": _ENDLESS},
                 768 * _MIB, 0),
        # 16k vertices, 262k edges: about 1.6 ms an iteration, 0.25 s to generate; tol 0 never converges.
        TaskPlan("pagerank", "side_tasks.graphs:PageRank",
                 {"graph": "rmat:14", "tol": 0.0, "max_iterations": _ENDLESS}, 640 * _MIB, 1),
        # One bundled photograph per step, resized to 256 px: about 5 ms.
        TaskPlan("watermark", "side_tasks.images:ImageWatermark",
                 {"max_side": 256, "batch_size": 1, "repeat": _ENDLESS}, 640 * _MIB, 1),
    )  # fmt: skip


def _cuda_device_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


def demo_devices(
    device_kind: str,
    cpu_affinity: Iterable[int] | None = None,
    cuda_count: Callable[[], int] | None = None,
) -> tuple[str, ...]:
    """The devices the pipeline's real stages run on, or :class:`ConfigError` if there are too few.

    CPU: stage k runs on the k-th core this process may use (the trainer's own rule), so the managers
    sit on the very cores the stages are pinned to. CUDA: stage k on GPU k with two or more GPUs; with
    one, stage 0 alone on ``cuda:0`` (its neighbour emulated).
    """
    if device_kind == "cuda":
        count = (cuda_count or _cuda_device_count)()
        if count == 0:
            raise ConfigError("freeride demo --device cuda needs a GPU, but no CUDA device is available; "
                              "run the CPU demo with --device cpu")
        return ("cuda:0", "cuda:1") if count >= 2 else ("cuda:0",)
    if device_kind != "cpu":
        raise ConfigError(f"--device must be one of {', '.join(DEVICE_KINDS)}, got {device_kind!r}")
    cores = sorted(set(cpu_affinity if cpu_affinity is not None else os.sched_getaffinity(0)))
    if len(cores) < 2:
        raise ConfigError(
            f"freeride demo needs 2 CPU cores (one per pipeline stage); this process may use {len(cores)}"
        )
    return (f"cpu:{cores[0]}", f"cpu:{cores[1]}")
