"""A side task that records the process it runs in: the thread pool and cores torch found when the module
was imported, and the priority once the task is built. ``freeride run-task`` and a worker must agree."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from freeride.task import SideTask

AT_IMPORT = {
    "torch_threads": torch.get_num_threads(),
    "cores": sorted(os.sched_getaffinity(0)),
    "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
}


class ProcessProbe(SideTask):
    """Writes what it found to ``out`` (a JSON file), once built; then finishes at once."""

    def __init__(self, out: str) -> None:
        Path(out).write_text(json.dumps({**AT_IMPORT, "nice_when_built": os.nice(0),
                                         "torch_threads_when_built": torch.get_num_threads()}))

    def step(self) -> None:
        pass

    def done(self) -> bool:
        return True
