"""Cap enforcement on a GPU: NVML's peak for each bundled task's worker, against its cap.

Each task runs under a real manager of ``cuda:0`` with a cap, in bubbles, for ``--seconds``; a thread
samples NVML's figure for the worker every 5 ms. Two kinds of enforcement are told apart
(:func:`verdict`): what allocates through torch's allocator (CuPy included) is held by the allocator's
limit, so its peak must stay within the cap ("held" or "OVER"); a raw ``cudaMalloc`` goes around every
pool and is seen only by the manager's NVML poll after the fact, so its row reports the overshoot past
the cap before the task was failed with MEMORY_LIMIT ("caught") or that it was not ("NOT CAUGHT"). A
task that fails MEMORY_LIMIT through its allocator says its cap was too small for it (the right
outcome when it is: the record is the enforcement).

    python -m bench.gpu.caps [--seconds 20] [--cap 3GiB]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.gpu.common import REPO, GiB, MiB, NvmlSampler, Trainer, client, gpu_manager, wait_until, write_results
from freeride.devices import CudaDevice
from freeride.messages import TaskSpec
from freeride.units import parse_size

TASKS: list[tuple[str, str, dict[str, Any]]] = [
    ("pagerank", "side_tasks.graphs:PageRank", {"graph": "rmat:20"}),
    ("bfs", "side_tasks.graphs:BFS", {"graph": "rmat:20"}),
    ("components", "side_tasks.graphs:ConnectedComponents", {"graph": "rmat:20"}),
    ("watermark", "side_tasks.images:ImageWatermark", {"repeat": 1000}),
    ("resnet18", "side_tasks.training:ResNet18Training", {"batch_size": 64}),
    ("lstm", "side_tasks.training:LSTMLanguageModelTraining", {}),
    ("kernel-storm", "bench.gpu.tasks:KernelStorm", {"size": 8192, "kernels": 4}),
    ("hog-torch", "bench.gpu.tasks:CudaHog", {"mib_per_step": 256, "via": "torch"}),
    ("hog-raw", "bench.gpu.tasks:CudaHog", {"mib_per_step": 256, "via": "raw"}),
]


def verdict(args: dict[str, Any], cap: int, peak: int | None, failure: str) -> dict[str, Any]:
    """How the cap fared for one task: ``enforcement`` (``allocator`` or ``watchdog``), ``overshoot_bytes``
    (past the cap; None where NVML could not see the worker), ``verdict`` and ``ok``."""
    raw = args.get("via") == "raw"
    overshoot = None if peak is None else max(0, peak - cap)
    if raw:
        caught = failure == "MEMORY_LIMIT"
        return {"enforcement": "watchdog", "overshoot_bytes": overshoot, "verdict": "caught" if caught else
                "NOT CAUGHT", "ok": caught}
    if overshoot is None:
        return {"enforcement": "allocator", "overshoot_bytes": None, "verdict": "not visible to NVML", "ok": True}
    return {"enforcement": "allocator", "overshoot_bytes": overshoot,
            "verdict": "held" if overshoot == 0 else "OVER", "ok": overshoot == 0}


def measure(name: str, target: str, args: dict[str, Any], cap: int, seconds: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp, gpu_manager(Path(tmp)) as manager, client(manager) as c:
        device = manager.device
        assert isinstance(device, CudaDevice)
        task = c.submit(TaskSpec(target=target, args=args, memory_bytes=cap, working_dir=str(REPO))).task_id
        trainer = Trainer(manager.endpoint)
        with NvmlSampler(device.uuid) as sampler:
            wait_until(lambda: c.get(task).pid or c.get(task).state == "FAILED", 120, f"{name} started")
            sampler.pids.add(c.get(task).pid)
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline and c.get(task).state not in ("FAILED", "FINISHED"):
                trainer.bubbles(5, length_ms=100, gap_ms=20)
        trainer.close()
        info = c.get(task)
        failure = info.failure.kind if info.failure else ""
        return {
            "task": name, "cap_bytes": cap, "nvml_peak_bytes": sampler.peak, "nvml_visible": sampler.visible,
            "samples": sampler.samples, "state": info.state, "steps": info.steps, "failure": failure,
            "message": info.failure.message if info.failure else "",
            **verdict(args, cap, sampler.peak if sampler.visible else None, failure),
        }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--cap", default="3GiB")
    ns = ap.parse_args(argv)
    cap = parse_size(ns.cap)
    rows = []
    for name, target, args in TASKS:
        row = measure(name, target, args, cap, ns.seconds)
        print(row, flush=True)
        rows.append(row)
    write_results("caps", {"rows": rows}, table(rows), "python -m bench.gpu.caps " + " ".join(sys.argv[1:]))
    return 0 if all(r["ok"] for r in rows) else 1


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| task | enforced by | cap | NVML peak | past the cap | verdict | state | failure |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        visible = r["nvml_visible"]
        peak = f"{r['nvml_peak_bytes'] / MiB:.0f} MiB" if visible else "not visible to NVML"
        over = "-" if r["overshoot_bytes"] is None else f"{r['overshoot_bytes'] / MiB:.0f} MiB"
        lines.append(f"| {r['task']} | {r['enforcement']} | {r['cap_bytes'] / GiB:.1f} GiB | {peak} | {over} | "
                     f"{r['verdict']} | {r['state']} ({r['steps']} steps) | {r['failure']} {r['message'][:80]} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
