"""The ``naive`` bench mode's side task: co-location with no management at all.

``python -m bench.naive_runner --target M:C --args JSON --device cpu:K --ready FILE --out FILE``
pins itself to core K at the trainer's own priority (no nice, no grants, no parking: what plain
CUDA MPS co-location is on a GPU), runs ``setup``, touches ``--ready``, then steps back to back
until SIGTERM or ``done()``, and writes ``{"progress", "steps", "elapsed_s", "step_ends_ns"}`` to ``--out``.
On ``cuda:K`` it only selects the device (MPS, if a daemon runs, is the co-location mechanism).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import tempfile
import time
from pathlib import Path

from freeride._loading import load_task_class
from freeride.devices import open_device, parse_device_name, worker_device
from freeride.task import TaskContext


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--target", required=True)
    p.add_argument("--args", default="{}")
    p.add_argument("--device", required=True)
    p.add_argument("--memory-bytes", type=int, default=2**30)
    p.add_argument("--ready", required=True)
    p.add_argument("--out", required=True)
    ns = p.parse_args()
    name = parse_device_name(ns.device)
    open_device(name).close()  # it exists for this process
    device = worker_device(name)  # no caps and no lowered priority: naive co-location
    if name.kind == "cpu":
        os.sched_setaffinity(0, {name.index})
        import torch

        torch.set_num_threads(1)
    stop = False

    def on_term(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    cls = load_task_class(ns.target)
    task = cls(**json.loads(ns.args))
    with tempfile.TemporaryDirectory(prefix="freeride-naive-") as work:
        task.setup(TaskContext(device=device.torch_device, device_name=str(name), memory_limit_bytes=ns.memory_bytes,
                               task_id="naive", work_dir=Path(work), logger=logging.getLogger("naive")))
        Path(ns.ready).touch()
        steps = 0
        ends_ns: list[int] = []  # the bench counts the steps inside its measurement window
        t0 = time.perf_counter()
        while not stop and not task.done():
            task.step()
            steps += 1
            ends_ns.append(time.monotonic_ns())
        elapsed = time.perf_counter() - t0
        reported = task.progress()
        Path(ns.out).write_text(json.dumps({
            "progress": float(steps if reported is None else reported), "steps": steps, "elapsed_s": elapsed,
            "step_ends_ns": ends_ns,
        }))
        task.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
