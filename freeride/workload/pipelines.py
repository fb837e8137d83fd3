"""The reference trainer's pipelines: every schedule torch offers, on one rank's model chunks.

=====================  =======================================  ==============================
``--schedule``         torch class                              chunks of rank ``r`` (``p`` ranks)
=====================  =======================================  ==============================
``gpipe``              ``ScheduleGPipe``                        ``r``
``1f1b``               ``Schedule1F1B``                         ``r``
``interleaved-1f1b``   ``ScheduleInterleaved1F1B``              ``r, r + p, ...`` (looped)
``interleaved-zb``     ``ScheduleInterleavedZeroBubble``        looped
``looped-bfs``         ``ScheduleLoopedBFS``                    looped
``zbv``                ``ScheduleZBVZeroBubble``                ``r, 2p - 1 - r`` (V-shaped)
``dualpipev``          ``ScheduleDualPipeV``                    V-shaped
``csv``                ``_PipelineScheduleRuntime`` +           the stages the CSV's row ``r``
                       ``_load_csv(--schedule-csv)``            names
=====================  =======================================  ==============================

Multi-stage schedules hold ``--virtual-stages`` chunks per rank (exactly 2 for the V-shaped ones).
A CSV is torch's compute-only format: one row per rank, one action per cell (``0F0``, ``2B1``,
``1I0``, ``1W0``); :func:`write_csv` writes one from any schedule's order, the bench's way to make
one. ``--slow-stage S --slow-ms X`` makes model chunk ``S`` slower by ``X`` ms of busy compute per
forward (:func:`slow_down`): a known imbalance, so that the waits it causes are known too.
"""

from __future__ import annotations

import csv
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from freeride.errors import ConfigError
from freeride.training.schedules import LOOPED, TORCH_SCHEDULES, V_SHAPED
from freeride.training.torch_plans import csv_actions, csv_rows

SINGLE = ("gpipe", "1f1b")
SCHEDULES = (*SINGLE, *LOOPED, *V_SHAPED, "csv")

_CLASSES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    **TORCH_SCHEDULES,
    "csv": "_PipelineScheduleRuntime",
}


def virtual_stages(schedule: str, virtual: int) -> int:
    """Model chunks per rank for ``schedule`` (``virtual`` where it has a choice)."""
    if schedule in SINGLE:
        return 1
    if schedule in V_SHAPED:
        return 2
    return virtual


def _csv_stages(cells: Sequence[str], path: str | Path) -> set[int]:
    return {a.stage for cell in cells for a in csv_actions(cell, path)}


def local_chunks(schedule: str, rank: int, world: int, virtual: int, csv_path: str = "") -> list[int]:
    """The model chunks (global stage indices) rank ``rank`` holds, in ascending order."""
    if schedule in SINGLE:
        return [rank]
    if schedule in V_SHAPED:
        return sorted({rank, 2 * world - 1 - rank})
    if schedule == "csv":
        rows = csv_rows(csv_path)
        if len(rows) != world:
            raise ConfigError(f"the schedule CSV {csv_path} has {len(rows)} rows but torchrun started {world} ranks")
        return sorted(_csv_stages(rows[rank], csv_path))
    return [c for c in range(world * virtual) if c % world == rank]


def total_chunks(schedule: str, world: int, virtual: int, csv_path: str = "") -> int:
    if schedule == "csv":
        return max(_csv_stages([cell for row in csv_rows(csv_path) for cell in row], csv_path)) + 1
    return world * virtual_stages(schedule, virtual)


def make_schedule(schedule: str, stages: Sequence[Any], microbatches: int, loss_fn: Callable[..., Any],
                   csv_path: str = "") -> Any:
    """The torch schedule object ``schedule`` names, over this rank's ``PipelineStage`` s."""
    from torch.distributed.pipelining import schedules as torch_schedules

    cls = getattr(torch_schedules, _CLASSES[schedule])
    if schedule in SINGLE:
        return cls(stages[0], microbatches, loss_fn=loss_fn)
    sched = cls(list(stages), microbatches, loss_fn=loss_fn)
    if schedule == "csv":
        try:
            sched._load_csv(str(csv_path), format="compute_only")
        except (RuntimeError, ValueError, KeyError, IndexError) as exc:  # torch's parse of a cell or a row
            raise ConfigError(f"the schedule CSV {csv_path} is not one torch can run: {exc}") from None
    return sched


def write_csv(path: str | Path, pipeline_order: dict[int, list[Any]]) -> None:
    """Write a compute-only schedule CSV from a torch ``pipeline_order`` (idle steps dropped)."""
    with open(path, "w", newline="") as fh:
        writer = csv.writer(fh)
        for rank in sorted(pipeline_order):
            writer.writerow([str(a) for a in pipeline_order[rank] if a is not None])


def slow_down(module: Any, ms: float) -> Any:
    """Make ``module``'s every forward ``ms`` milliseconds slower, busy (the core computes, as a
    heavier layer would); returns the hook's handle."""
    spin_ns = int(ms * 1e6)

    def spin(_module: Any, _inputs: Any, _output: Any) -> None:
        end = time.perf_counter_ns() + spin_ns
        while time.perf_counter_ns() < end:
            pass

    return module.register_forward_hook(spin)
