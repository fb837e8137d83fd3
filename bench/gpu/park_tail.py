"""Park tail on a GPU: from a park (a bubble's end) or a SIGSTOP until the trainer's kernels run at their
idle latency again, for each bundled task and a kernel-heavy synthetic one; with and without MPS.

This process plays the trainer: it owns a CUDA context and, right after sending a bubble's end (or
freezing the worker with SIGSTOP, which leaves its queued kernels running), launches tiny probe kernels
back to back. The GPU counts as free of side-task kernels at the first of three consecutive probes
that complete within twice the idle latency (measured first, with the GPU to itself). Under MPS the
probe can run beside side-task kernels, so the figure is what matters to training either way: how
long its kernels are held back. The manager is a real ``freeride manager`` process, as in use: its
threads do not share the trainer's interpreter, and it holds no CUDA context.

Before the trials, bubbles go on until the task has taken :data:`WARM_UP_STEPS` steps: setup runs in
grants, so trials begun sooner park a task inside its setup, on the host, and measure no kernel of it (the
first GPU run's PageRank, generating ``rmat:22``, was in setup through every trial). A task that does not
get there within :data:`WARM_UP_LIMIT_S` is a row that says so. Results are written after every task.

    python -m bench.gpu.park_tail [--trials 30] [--mps off|require]
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.gpu.common import (
    REPO,
    GiB,
    ManagerProcess,
    Trainer,
    not_measured,
    pagerank_args,
    pct,
    results_dir,
    wait_until,
    write_results,
)
from freeride._wire.client import ControlClient
from freeride.measure import median
from freeride.messages import TaskSpec

TASKS: list[tuple[str, str, dict[str, Any]]] = [
    ("kernel-storm", "bench.gpu.tasks:KernelStorm", {"size": 8192, "kernels": 64}),
    # rmat:18: generating the graph takes seconds on the host, rmat:22's far more than the step's limit.
    ("pagerank", "side_tasks.graphs:PageRank", pagerank_args("rmat:18")),
    ("watermark", "side_tasks.images:ImageWatermark", {"repeat": 1000}),
    ("resnet18", "side_tasks.training:ResNet18Training", {"batch_size": 128}),
    ("lstm", "side_tasks.training:LSTMLanguageModelTraining", {"batch_size": 256}),
]
FREE_RUN = 3
WARM_UP_STEPS = 3
WARM_UP_LIMIT_S = 30.0
_ENDED = ("FINISHED", "FAILED", "CANCELLED")


class Probe:
    """Tiny kernels timed from the host: launch, wait, and how long it took."""

    def __init__(self) -> None:
        import torch

        self.torch = torch
        self.x = torch.zeros(1, device="cuda:0")
        self.stream = torch.cuda.Stream(priority=-1)  # the trainer's kernels come first where they can
        for _ in range(20):
            self.once()
        self.idle_s = median(self.once() for _ in range(200))

    def once(self) -> float:
        t0 = time.perf_counter()
        with self.torch.cuda.stream(self.stream):
            self.x.add_(1)
        self.stream.synchronize()
        return time.perf_counter() - t0

    def until_free(self, since: float, timeout_s: float = 10.0) -> float:
        """Seconds from ``since`` (perf_counter) to the first of FREE_RUN fast probes in a row."""
        run = FreeRun(self.idle_s)
        while time.perf_counter() - since < timeout_s:
            t0 = time.perf_counter()
            if run.add(t0, self.once()):
                return run.start - since
        return float("inf")


class FreeRun:
    """Probes in a row that took at most twice the idle latency; ``start`` is when the first of them began."""

    def __init__(self, idle_s: float) -> None:
        self.idle_s = idle_s
        self.start = 0.0
        self.count = 0

    def add(self, began: float, took: float) -> bool:
        """One probe; True once FREE_RUN fast ones came in a row."""
        if took > 2 * self.idle_s:
            self.count = 0
            return False
        if self.count == 0:
            self.start = began
        self.count += 1
        return self.count >= FREE_RUN


def measure(name: str, target: str, args: dict[str, Any], trials: int, probe: Probe, mps: str) -> dict[str, Any]:
    park, stop = [], []
    frozen = 0
    log = results_dir() / f"park_tail-{'mps' if mps == 'require' else 'no-mps'}-manager.log"
    with tempfile.TemporaryDirectory() as tmp, \
            ManagerProcess(Path(tmp) / "state", "--mps", mps, "--memory-poll-ms", "10", log_path=log) as manager, \
            ControlClient(manager.endpoint) as c:
        task = c.submit(TaskSpec(target=target, args=args, memory_bytes=8 * GiB, working_dir=str(REPO))).task_id
        trainer = Trainer(manager.endpoint)
        wait_until(lambda: c.get(task).state == "PARKED", 120, f"{name} ready")
        deadline = time.monotonic() + WARM_UP_LIMIT_S
        info = c.get(task)
        while info.steps < WARM_UP_STEPS and info.state not in _ENDED and time.monotonic() < deadline:
            trainer.bubbles(1, length_ms=300, gap_ms=50)  # setup and a few steps: the estimate exists
            info = c.get(task)
        if info.steps < WARM_UP_STEPS or info.state in _ENDED:
            trainer.close()
            return {"task": name, "not_measured": f"{info.steps} steps in {WARM_UP_LIMIT_S:.0f} s of bubbles before "
                    f"the trials ({info.state})"}
        for i in range(2 * trials):
            trainer.start(500)
            wait_until(lambda: c.get(task).state == "RUNNING", 10, "granted")
            time.sleep(0.05)  # mid-stream of steps
            if i % 2 == 0:
                since = time.perf_counter()
                trainer.end()
                park.append(probe.until_free(since))
            else:
                pid = c.get(task).pid
                since = time.perf_counter()
                os.kill(pid, signal.SIGSTOP)
                stop.append(probe.until_free(since))
                os.kill(pid, signal.SIGCONT)
                trainer.end()
            wait_until(lambda: c.get(task).state in ("PARKED", "FROZEN", "FAILED"), 10, "parked")
            if i % 2 == 0:
                # Frozen: the worker had not reported its park by the grace past the end: a step still running
                # then, or a report that came late (an NVML query held every report until the usage left it).
                frozen += c.get(task).state == "FROZEN"
            time.sleep(0.05)
        trainer.close()
        stats = c.stats()
    ms = 1000.0
    if mps == "require" and "MPS client" not in stats.device_info:
        raise RuntimeError(f"the manager does not run its tasks as MPS clients: {stats.device_info}")
    return {"task": name, "park_ms": pct([v * ms for v in park]), "sigstop_ms": pct([v * ms for v in stop]),
            "manager_park_latency_ms": stats.park_latency_ms.__dict__, "parks_frozen": frozen, "samples_ms": {
                "park": [v * ms for v in park], "sigstop": [v * ms for v in stop]}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=30)
    ap.add_argument("--mps", choices=("off", "require"), default="off",
                    help="side tasks out of MPS, or MPS clients of a live daemon (names the result file)")
    ns = ap.parse_args(argv)
    probe = Probe()
    label = "mps" if ns.mps == "require" else "no-mps"
    command = "python -m bench.gpu.park_tail " + " ".join(sys.argv[1:])
    rows: list[dict[str, Any]] = []
    for i, (name, target, args) in enumerate(TASKS):
        rows.append(measure(name, target, args, ns.trials, probe, ns.mps))
        print({k: v for k, v in rows[-1].items() if k != "samples_ms"}, flush=True)
        left = [n for n, _, _ in TASKS[i + 1:]]
        write_results(f"park_tail-{label}", {"idle_probe_s": probe.idle_s, "rows": rows, "not_measured_yet": left},
                      table(probe.idle_s, rows, left), command)
    return 0 if all("not_measured" not in r for r in rows) else 1


def table(idle_s: float, rows: list[dict[str, Any]], left: list[str] | None = None) -> str:
    lines = [f"Idle probe latency {idle_s * 1e6:.0f} us; free = {FREE_RUN} probes in a row within twice that.",
             "", "| task | park -> free p50 / p99 ms | SIGSTOP -> free p50 / p99 ms | manager park latency p99 ms "
             "| parks ended by a freeze |", "|---|---|---|---|---|"]
    for r in rows:
        if "not_measured" in r:
            lines.append(f"| {r['task']} | not measured: {r['not_measured']} | - | - | - |")
            continue
        lines.append(f"| {r['task']} | {r['park_ms']['p50']:.2f} / {r['park_ms']['p99']:.2f} | "
                     f"{r['sigstop_ms']['p50']:.2f} / {r['sigstop_ms']['p99']:.2f} | "
                     f"{r['manager_park_latency_ms'].get('p99', 0):.2f} | "
                     f"{r.get('parks_frozen', '-')} of {r['park_ms']['count']} |")
    return "\n".join(lines + not_measured(left))


if __name__ == "__main__":
    raise SystemExit(main())
