"""Cap enforcement on a GPU: NVML's peak for each bundled task's worker, against its cap.

Each task runs under a real manager of ``cuda:0`` with a cap, in bubbles, for ``--seconds``; a thread
samples NVML's figure for the worker every 5 ms. Two kinds of enforcement are told apart
(:func:`verdict`): what allocates through torch's allocator (CuPy included) is held by the allocator's
limit, so its peak must stay within the cap ("held" or "OVER"); a raw ``cudaMalloc`` goes around every
pool and is seen only by the manager's NVML poll after the fact, so its row reports the overshoot past
the cap before the task was failed with MEMORY_LIMIT ("caught") or that it was not ("NOT CAUGHT"). A
task that fails MEMORY_LIMIT through its allocator says its cap was too small for it (the right
outcome when it is: the record is the enforcement). A task that took no step and did not fail was "not
exercised": its peak is its worker's CUDA context, not the task (the first GPU run's graph tasks, frozen in
setup, and its training tasks, still starting, read "held" that way).

The ``--seconds`` start once the worker is ready (past STARTING: imports and the CUDA context take seconds
before any bubble can be granted), and bubbles go on past them until the task has taken :data:`MIN_STEPS`
steps (:func:`keep_stepping`): setup runs in the first grant and, overrunning a bubble, is frozen and thawed
at the next (a frozen task has the first turn), so long bubbles with short gaps give it most of the wall
time. Results are written after every task, so a run cut off at its limit keeps the rows it finished.

    python -m bench.gpu.caps [--seconds 20] [--cap 3GiB]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.gpu.common import (
    REPO,
    RMAT18_BFS_SOURCE,
    GiB,
    MiB,
    NvmlSampler,
    Trainer,
    client,
    gpu_manager,
    not_measured,
    pagerank_args,
    wait_until,
    write_results,
)
from freeride.devices import CudaDevice
from freeride.messages import TaskSpec
from freeride.units import parse_size

#: Graphs of rmat:18: generating one takes seconds on the host (rmat:20's did not finish in the first GPU
#: run's 5 s), once per task.
TASKS: list[tuple[str, str, dict[str, Any]]] = [
    ("pagerank", "side_tasks.graphs:PageRank", pagerank_args("rmat:18")),
    ("bfs", "side_tasks.graphs:BFS", {"graph": "rmat:18", "source": RMAT18_BFS_SOURCE}),
    ("components", "side_tasks.graphs:ConnectedComponents", {"graph": "rmat:18"}),
    ("watermark", "side_tasks.images:ImageWatermark", {"repeat": 1000}),
    ("resnet18", "side_tasks.training:ResNet18Training", {"batch_size": 64}),
    ("lstm", "side_tasks.training:LSTMLanguageModelTraining", {}),
    ("kernel-storm", "bench.gpu.tasks:KernelStorm", {"size": 8192, "kernels": 4}),
    ("hog-torch", "bench.gpu.tasks:CudaHog", {"mib_per_step": 256, "via": "torch"}),
    ("hog-raw", "bench.gpu.tasks:CudaHog", {"mib_per_step": 256, "via": "raw"}),
]
#: Steps a task must have taken for its row to speak of the task, not only of its worker's CUDA context.
MIN_STEPS = 3
#: The worker's start (spawn, imports, CUDA context) until it is ready; not part of ``--seconds``.
STARTUP_LIMIT_S = 120.0
#: Bubbles past ``--seconds`` for a long setup to reach MIN_STEPS: the bound on a task's stepping phase.
SETUP_LIMIT_S = 20.0
BUBBLE_MS = 200.0
GAP_MS = 20.0
_NOT_READY = ("SUBMITTED", "STARTING")
_ENDED = ("FINISHED", "FAILED", "CANCELLED")


def keep_stepping(elapsed_s: float, seconds: float, steps: int, state: str) -> bool:
    """Whether to send another bubble ``elapsed_s`` after the worker was ready: not once the task has ended;
    else for ``seconds`` and until it has taken MIN_STEPS steps, but not past ``seconds + SETUP_LIMIT_S``."""
    if state in _ENDED or elapsed_s >= seconds + SETUP_LIMIT_S:
        return False
    return elapsed_s < seconds or steps < MIN_STEPS


def verdict(args: dict[str, Any], cap: int, peak: int | None, failure: str, steps: int) -> dict[str, Any]:
    """How the cap fared for one task: ``enforcement`` (``allocator`` or ``watchdog``), ``overshoot_bytes``
    (past the cap; None where NVML could not see the worker), ``verdict`` and ``ok``.

    A task that took no step and did not fail was "not exercised" (not ok): whatever its peak, it is its
    worker's context, unless that is already past the cap. A failure counts as exercised: a raw allocation the
    watchdog caught mid-grant has no step reported yet.
    """
    raw = args.get("via") == "raw"
    overshoot = None if peak is None else max(0, peak - cap)

    def out(word: str, ok: bool) -> dict[str, Any]:
        return {"enforcement": "watchdog" if raw else "allocator", "overshoot_bytes": overshoot, "verdict": word,
                "ok": ok}

    if raw and failure == "MEMORY_LIMIT":
        return out("caught", True)
    if overshoot:
        return out("NOT CAUGHT" if raw else "OVER", False)
    if steps == 0 and not failure:
        return out("not exercised", False)
    if raw:
        return out("NOT CAUGHT", False)
    return out("not visible to NVML" if overshoot is None else "held", True)


def measure(name: str, target: str, args: dict[str, Any], cap: int, seconds: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp, gpu_manager(Path(tmp)) as manager, client(manager) as c:
        device = manager.device
        assert isinstance(device, CudaDevice)
        task = c.submit(TaskSpec(target=target, args=args, memory_bytes=cap, working_dir=str(REPO))).task_id
        trainer = Trainer(manager.endpoint)
        with NvmlSampler(device.uuid) as sampler:
            begun = time.monotonic()
            wait_until(lambda: c.get(task).pid or c.get(task).state == "FAILED", STARTUP_LIMIT_S, f"{name} started")
            if pid := c.get(task).pid:
                sampler.pids.add(pid)
            wait_until(lambda: c.get(task).state not in _NOT_READY, STARTUP_LIMIT_S - (time.monotonic() - begun),
                       f"{name} ready")
            ready = time.monotonic()
            info = c.get(task)
            while keep_stepping(time.monotonic() - ready, seconds, info.steps, info.state):
                trainer.bubbles(1, length_ms=BUBBLE_MS, gap_ms=GAP_MS)
                info = c.get(task)
            stepped_s = time.monotonic() - ready
        trainer.close()
        info = c.get(task)
        failure = info.failure.kind if info.failure else ""
        return {
            "task": name, "cap_bytes": cap, "nvml_peak_bytes": sampler.peak, "nvml_visible": sampler.visible,
            "samples": sampler.samples, "state": info.state, "steps": info.steps, "failure": failure,
            "message": info.failure.message if info.failure else "", "ready_after_s": ready - begun,
            "bubbles_for_s": stepped_s,
            **verdict(args, cap, sampler.peak if sampler.visible else None, failure, info.steps),
        }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--cap", default="3GiB")
    ns = ap.parse_args(argv)
    cap = parse_size(ns.cap)
    command = "python -m bench.gpu.caps " + " ".join(sys.argv[1:])
    rows: list[dict[str, Any]] = []
    for i, (name, target, args) in enumerate(TASKS):
        row = measure(name, target, args, cap, ns.seconds)
        print(row, flush=True)
        rows.append(row)
        left = [n for n, _, _ in TASKS[i + 1:]]
        write_results("caps", {"rows": rows, "not_measured_yet": left}, table(rows, left), command)
    return 0 if all(r["ok"] for r in rows) else 1


def table(rows: list[dict[str, Any]], left: list[str] | None = None) -> str:
    lines = ["| task | enforced by | cap | NVML peak | past the cap | verdict | state | failure |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        visible = r["nvml_visible"]
        peak = f"{r['nvml_peak_bytes'] / MiB:.0f} MiB" if visible else "not visible to NVML"
        over = "-" if r["overshoot_bytes"] is None else f"{r['overshoot_bytes'] / MiB:.0f} MiB"
        lines.append(f"| {r['task']} | {r['enforcement']} | {r['cap_bytes'] / GiB:.1f} GiB | {peak} | {over} | "
                     f"{r['verdict']} | {r['state']} ({r['steps']} steps) | {r['failure']} {r['message'][:80]} |")
    return "\n".join(lines + not_measured(left))


if __name__ == "__main__":
    raise SystemExit(main())
