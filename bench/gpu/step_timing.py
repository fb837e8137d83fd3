"""Step-time accuracy on a GPU: the runtime's host timer (after waiting for the device) against CUDA events.

For each task, steps run in this process the way a worker runs them (:class:`CudaWorkerDevice`
prepared with a cap, ``step()`` then ``synchronize()``), bracketed by CUDA events on the current
stream. Reported per task: the host time the runtime uses, the device time between the events, their
difference (p50/p99), and the launch-only host time a runtime without the wait would have used.

    python -m bench.gpu.step_timing [--steps 50]
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.gpu.common import GiB, pct, write_results
from freeride._loading import load_task_class
from freeride.devices import worker_device
from freeride.task import TaskContext

TASKS: list[tuple[str, str, dict[str, Any]]] = [
    ("kernel-storm-small", "bench.gpu.tasks:KernelStorm", {"size": 1024, "kernels": 4}),
    ("kernel-storm-large", "bench.gpu.tasks:KernelStorm", {"size": 8192, "kernels": 16}),
    ("pagerank", "side_tasks.graphs:PageRank", {"graph": "rmat:20"}),
    ("resnet18", "side_tasks.training:ResNet18Training", {"batch_size": 64}),
    ("lstm", "side_tasks.training:LSTMLanguageModelTraining", {}),
]


def measure(name: str, target: str, args: dict[str, Any], steps: int) -> dict[str, Any]:
    import torch

    device = worker_device("cuda:0")
    task = load_task_class(target)(**args)
    with tempfile.TemporaryDirectory() as tmp:
        task.setup(TaskContext(device=device.torch_device, device_name="cuda:0", memory_limit_bytes=8 * GiB,
                               task_id=name, work_dir=Path(tmp), logger=logging.getLogger(name)))
        device.synchronize()
        host, dev, launch = [], [], []
        for i in range(steps + 3):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            t0 = time.monotonic_ns()
            task.step()
            t_launch = time.monotonic_ns()
            device.synchronize()
            t1 = time.monotonic_ns()
            end.record()
            end.synchronize()
            if i >= 3 and not task.done():  # warm-up steps are no samples, as in the runtime
                host.append((t1 - t0) / 1e6)
                launch.append((t_launch - t0) / 1e6)
                dev.append(begin.elapsed_time(end))
            if task.done():
                break
        task.close()
    diff = [h - d for h, d in zip(host, dev, strict=True)]
    return {"task": name, "host_ms": pct(host), "device_ms": pct(dev), "host_minus_device_ms": pct(diff),
            "launch_only_ms": pct(launch), "samples": {"host": host, "device": dev, "launch": launch}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=50)
    ns = ap.parse_args(argv)
    device = worker_device("cuda:0")
    device.prepare(16 * GiB)  # as a worker: the context, the cap, blocking synchronisation
    rows = [measure(n, t, a, ns.steps) for n, t, a in TASKS]
    lines = ["| task | device ms p50 | host ms p50 | host - device p50 / p99 | launch only p50 |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['task']} | {r['device_ms']['p50']:.3f} | {r['host_ms']['p50']:.3f} | "
                     f"{r['host_minus_device_ms']['p50']:.3f} / {r['host_minus_device_ms']['p99']:.3f} | "
                     f"{r['launch_only_ms']['p50']:.3f} |")
    write_results("step_timing", {"rows": rows}, "\n".join(lines),
                  "python -m bench.gpu.step_timing " + " ".join(sys.argv[1:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
