"""Step-time accuracy on a GPU: the runtime's host timer (after waiting for the device) against CUDA events.

For each task, steps run in this process the way a worker runs them (:class:`CudaWorkerDevice`
prepared with a cap, ``step()`` then ``synchronize()``), bracketed by CUDA events on the current
stream: one recorded before ``step()``, one right after it returns (before the wait, so that the
events span the step's device work and nothing the host does after it). Reported per task: the host
time the runtime uses, the device time between the events, their difference (p50/p99: what the
runtime's timer adds, the wait's wake-up included), and the launch-only host time a runtime without
the wait would have used. Work a task queues on other streams is not in the device figure. The
worker's CUDA context is reported after prepare and at the end: its growth is what lazily loaded
kernels took (the allocator's headroom must cover it).

    python -m bench.gpu.step_timing [--steps 50]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.gpu.common import GiB, pagerank_args, pct, write_results
from freeride._loading import load_task_class
from freeride.devices import WorkerDevice, open_device, worker_device
from freeride.task import TaskContext

TASKS: list[tuple[str, str, dict[str, Any]]] = [
    ("kernel-storm-small", "bench.gpu.tasks:KernelStorm", {"size": 1024, "kernels": 4}),
    ("kernel-storm-large", "bench.gpu.tasks:KernelStorm", {"size": 8192, "kernels": 16}),
    ("pagerank", "side_tasks.graphs:PageRank", pagerank_args("rmat:20")),
    ("resnet18", "side_tasks.training:ResNet18Training", {"batch_size": 64}),
    ("lstm", "side_tasks.training:LSTMLanguageModelTraining", {}),
]
WARM_UP = 3  # steps before the samples, as the runtime's estimate skips its first


def measure(device: WorkerDevice, name: str, target: str, args: dict[str, Any], steps: int) -> dict[str, Any]:
    import torch

    task = load_task_class(target)(**args)
    with tempfile.TemporaryDirectory() as tmp:
        task.setup(TaskContext(device=device.torch_device, device_name="cuda:0", memory_limit_bytes=8 * GiB,
                               task_id=name, work_dir=Path(tmp), logger=logging.getLogger(name)))
        device.synchronize()
        host, dev, launch = [], [], []
        taken = 0
        for i in range(steps + WARM_UP):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            t0 = time.monotonic_ns()
            task.step()
            end.record()  # before the wait: the events span the step's device work only
            t_launch = time.monotonic_ns()
            device.synchronize()
            t1 = time.monotonic_ns()
            end.synchronize()
            taken += 1
            if i >= WARM_UP and not task.done():  # warm-up steps are no samples, as in the runtime
                host.append((t1 - t0) / 1e6)
                launch.append((t_launch - t0) / 1e6)
                dev.append(begin.elapsed_time(end))
            if task.done():
                break
        finished = task.done()
        task.close()
    return {"task": name, "steps": taken, "finished": finished, **summarise(host, dev, launch)}


def summarise(host: list[float], device: list[float], launch: list[float]) -> dict[str, Any]:
    """Percentiles of each series and of host minus device, step by step (all in ms)."""
    diff = [h - d for h, d in zip(host, device, strict=True)]
    return {"host_ms": pct(host), "device_ms": pct(device), "host_minus_device_ms": pct(diff),
            "launch_only_ms": pct(launch), "samples": {"host": host, "device": device, "launch": launch}}


def table(rows: list[dict[str, Any]]) -> str:
    """One line a task; a task that gave no sample says why rather than printing NaNs."""
    lines = ["| task | device ms p50 | host ms p50 | host - device p50 / p99 | launch only p50 |",
             "|---|---|---|---|---|"]
    for r in rows:
        if not r["host_ms"]["count"]:
            why = (f"finished in warm-up (done after {r['steps']} steps; the first {WARM_UP} are warm-up)"
                   if r["finished"] else f"none timed ({r['steps']} steps, all warm-up)")
            lines.append(f"| {r['task']} | no steps: {why} | - | - | - |")
            continue
        lines.append(f"| {r['task']} | {r['device_ms']['p50']:.3f} | {r['host_ms']['p50']:.3f} | "
                     f"{r['host_minus_device_ms']['p50']:.3f} / {r['host_minus_device_ms']['p99']:.3f} | "
                     f"{r['launch_only_ms']['p50']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=50)
    ns = ap.parse_args(argv)
    manager_view = open_device("cuda:0")
    os.environ.update(manager_view.worker_env(16 * GiB))  # as a worker: sees its one GPU, by UUID
    manager_view.close()
    device = worker_device("cuda:0")
    device.prepare(16 * GiB)  # as a worker: the context, the cap, blocking synchronisation
    context_before = device.context_bytes
    rows = [measure(device, n, t, a, ns.steps) for n, t, a in TASKS]
    device.used_bytes()  # measures the context again
    context = {"after_prepare_bytes": context_before, "at_end_bytes": device.context_bytes}
    lines = [f"CUDA context: {context_before / 2**20:.0f} MiB after prepare, {device.context_bytes / 2**20:.0f} MiB "
             "after every task's steps (kernels load on first use).", "", table(rows)]
    write_results("step_timing", {"rows": rows, "context": context}, "\n".join(lines),
                  "python -m bench.gpu.step_timing " + " ".join(sys.argv[1:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
