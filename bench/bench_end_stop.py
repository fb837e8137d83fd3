"""Every step running at a bubble's real end stops by end + grace (issue 23): the replay, with a trainer on its core.

A real :class:`~freeride.training.reporter.BubbleReporter` replays stage 0 of a 4-stage 1F1B schedule
(8 micro-batches, ``tf`` ms a forward, twice that a backward) in real time against a real ``freeride
manager`` on ``cpu:0`` with one side task of fixed-length steps (``bench.bench_tasks:SpinStep``);
``--early-fraction`` of the bubbles (seeded) end at ``--early-ratio`` of their prediction. Unlike the
control-plane bench, the trainer runs where a ``cpu:N`` trainer runs: its thread is pinned to core 0, the
side task's core, and between bubbles it *computes* (a fixed amount of CPU time, in ``hashlib`` calls that
release the GIL so the reporter's sender thread is not starved), so a step still running at an end
competes with the trainer for the core, at nice 19. The reporter's threads and the manager run on the
other cores (``cpu_affinity``, as a pinned trainer would pass).

Figures, per run (one per step length):

* **stopped after the real end**: for each bubble with a step running at its real end, when that step
  stopped, finished (its end as the worker reported it) or frozen (the manager's ``freeze`` in its trace),
  minus the real end. Target: p99 <= grace + 0.2 ms.
* **steps begun after their bubble's real end**, out of all steps (target <= 0.1%).
* **harvested / bubble time**: the manager's own figures (``Stats.harvested_s / bubble_time_s``).
* **end delay**: the trainer's end -> the manager's loop reading it (``end_seen`` in the trace: ends of
  bubbles a worker holds), and the manager's event delay (trainer stamp -> core, every event: local
  datagrams with the board, the wire without).
* **the trainer's cost**, from ``/proc/self/task/<tid>/schedstat`` of the training thread: over the compute
  phase that follows each end, its CPU time, its run-queue wait (runnable, waiting for the core) and its
  wall time, early ends apart from the others: what a step overrunning an end costs training.

Run (about 3 minutes on an idle 2-core machine): ``python -m bench.bench_end_stop``; results in
``bench/results/cpu/end_stop.{json,md}`` with the load average beside them.
"""

from __future__ import annotations

import argparse
import bisect
import hashlib
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.bench_control_plane import REPO, control_cpus, pct, stage0_pattern, start_manager
from bench.machine import machine_info
from freeride._manager.trace import read_trace
from freeride._wire.client import ControlClient
from freeride.endpoints import Endpoint
from freeride.messages import TaskSpec
from freeride.training.reporter import BubbleReporter

MS = 1_000_000
_BLOCK = bytes(16384)  # hashlib releases the GIL for inputs this large


class SchedStat:
    """The calling thread's CPU time, run-queue wait and timeslices (``/proc/self/task/<tid>/schedstat``)."""

    def __init__(self) -> None:
        self._path = f"/proc/self/task/{threading.get_native_id()}/schedstat"

    def read(self) -> tuple[int, int]:
        with open(self._path) as fh:
            cpu, wait, _ = fh.read().split()
        return int(cpu), int(wait)


def compute(cpu_ms: float) -> None:
    """Burn ``cpu_ms`` of this thread's CPU time (a trainer's compute, which run-queue waits stretch)."""
    until = time.thread_time_ns() + int(cpu_ms * MS)
    while time.thread_time_ns() < until:
        hashlib.sha256(_BLOCK).digest()


def replay(reporter: BubbleReporter, pattern: list[tuple[float, int, float]], iterations: int, early_fraction: float,
           early_ratio: float, seed: int, sched: SchedStat | None) -> list[dict[str, Any]]:
    """Play the pattern in real time: compute (CPU time), then the bubble (a sleep: a trainer waiting on its
    receive holds no core). Each bubble's record gets the schedstat of the compute phase after its end."""
    rng = random.Random(seed)
    played: list[dict[str, Any]] = []
    for it in range(iterations):
        for compute_ms, slot, predicted_ms in pattern:
            before = sched.read() if sched is not None else (0, 0)
            wall = time.monotonic_ns()
            if sched is not None:
                compute(compute_ms)
            else:
                time.sleep(compute_ms / 1000)
            if played and sched is not None:
                cpu, wait = sched.read()
                played[-1].update(after_cpu_ms=(cpu - before[0]) / MS, after_wait_ms=(wait - before[1]) / MS,
                                  after_wall_ms=(time.monotonic_ns() - wall) / MS, after_nominal_ms=compute_ms)
            early = rng.random() < early_fraction
            real_ms = predicted_ms * (early_ratio if early else 1.0)
            reporter.bubble_start(it, slot, "bench", int(predicted_ms * MS), 16 * 2**30)
            time.sleep(real_ms / 1000)
            reporter.bubble_end(it, slot)
            played.append({"predicted_ms": predicted_ms, "real_ms": real_ms, "early": early})
    return played


def stop_figures(records: list[dict[str, Any]], grace_ms: float) -> dict[str, Any]:
    """From a manager's trace: when each step running at a real end stopped, steps begun after real ends.

    A step's span in the trace is its start plus its *running* time (a frozen step's frozen time is left
    out), so a frozen step is found another way: it is the last step of a grant the worker reported as
    ``frozen`` (when the next grant thawed it). Such a step stopped at the first freeze after it began; any
    other at its end.
    """
    bubbles: list[tuple[int, int, int]] = []  # start, real end, predicted end
    open_start: dict[tuple[Any, ...], tuple[int, int]] = {}
    spans: list[tuple[int, int, bool]] = []  # start, end, carried over a freeze into a later grant
    freezes: list[int] = []
    wake_ms: list[float] = []
    for r in records:
        key = (r.get("stage"), r.get("rank"), r.get("iteration"), r.get("slot"))
        if r["ev"] == "bubble_start":
            open_start[key] = (int(r["start_ns"]), int(r["start_ns"]) + int(r["predicted_ns"]))
        elif r["ev"] == "bubble_end" and key in open_start:
            start, predicted_end = open_start.pop(key)
            bubbles.append((start, int(r["end_ns"]), predicted_end))
        elif r["ev"] == "steps":
            listed = r["spans"]
            frozen_report = r.get("reason") == "frozen"
            spans += [(int(a), int(b), frozen_report and k == len(listed) - 1) for k, (a, b) in enumerate(listed)]
        elif r["ev"] == "freeze":
            freezes.append(int(r["at_ns"]))
        elif r["ev"] == "end_seen":
            wake_ms.append((int(r["at_ns"]) - int(r["end_ns"])) / MS)
    bubbles.sort()
    spans.sort()
    freezes.sort()
    starts = [b[0] for b in bubbles]
    late = 0
    for s, _, _ in spans:
        i = bisect.bisect_right(starts, s) - 1
        if i >= 0 and s > bubbles[i][1]:
            late += 1
    stopped_early: list[float] = []
    stopped_all: list[float] = []
    frozen = 0
    for start, end, predicted_end in bubbles:
        first = bisect.bisect_left(spans, (start, 0, False))
        running = [(s, e, carried) for s, e, carried in spans[first:bisect.bisect_right(spans, (end, 2**63, True))]
                   if carried or e > end]
        if not running:
            continue
        s, e, carried = running[-1]
        stop = e
        if carried:  # frozen: at the first freeze after it began (before its end, when the end came late)
            j = bisect.bisect_left(freezes, s)
            if j < len(freezes):
                stop = freezes[j]
                frozen += 1
        after = max(0, stop - end) / MS
        stopped_all.append(after)
        if end < predicted_end:
            stopped_early.append(after)
    limit = grace_ms + 0.2
    return {
        "bubbles": len(bubbles),
        "early_bubbles": sum(1 for b in bubbles if b[1] < b[2]),
        "steps": len(spans),
        "steps_after_real_end": late,
        "steps_after_real_end_pct": round(100 * late / max(1, len(spans)), 4),
        "running_at_end": len(stopped_all),
        "frozen": frozen,
        "stopped_after_end_ms": pct(stopped_all),
        "stopped_after_early_end_ms": pct(stopped_early),
        "stopped_past_limit": sum(1 for v in stopped_all if v > limit),
        "end_wake_ms": pct(wake_ms),
    }


def trainer_cost(played: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for label, early in (("after_early_end", True), ("after_other_end", False)):
        rows = [p for p in played if p["early"] is early and "after_wait_ms" in p]
        out[label] = {
            "phases": len(rows),
            "run_queue_wait_ms": pct([p["after_wait_ms"] for p in rows]),
            "cpu_ms": pct([p["after_cpu_ms"] for p in rows]),
            "wall_minus_nominal_ms": pct([p["after_wall_ms"] - p["after_nominal_ms"] for p in rows]),
            "run_queue_wait_total_ms": round(sum(p["after_wait_ms"] for p in rows), 3),
            "nominal_total_ms": round(sum(p["after_nominal_ms"] for p in rows), 3),
        }
    return out


def run(ns: argparse.Namespace, tmp: Path, step_us: float, tf_ms: float, iterations: int,
        board: bool) -> dict[str, Any]:
    label = f"{int(step_us)}us-{'board' if board else 'wire'}"
    sock = Path(f"/tmp/fr-endstop-{os.getpid()}-{label}.sock")
    trace = tmp / f"trace-{label}.jsonl"
    cpus = control_cpus()
    allowed = os.sched_getaffinity(0)
    manager = start_manager(sock, tmp / f"state-{label}", "--trace", str(trace), cpus=cpus)
    endpoint = Endpoint("unix", str(sock))
    pattern = stage0_pattern(tf_ms)
    on_core = not ns.trainer_off_core
    try:
        with ControlClient(endpoint) as client:
            task = client.submit(TaskSpec(target="bench.bench_tasks:SpinStep", args={"step_us": step_us},
                                          memory_bytes=256 * 2**20, working_dir=str(REPO)))
            while client.get(task.task_id).state != "PARKED":
                time.sleep(0.05)
            reporter = BubbleReporter("cpu:0", stage=0, rank=0, endpoint=endpoint, end_board=board,
                                      cpu_affinity=cpus)
            os.sched_setaffinity(0, {0} if on_core else cpus)  # this (the training) thread only
            sched = SchedStat() if on_core else None
            deadline = time.monotonic() + 10
            while not reporter.counters().connected and time.monotonic() < deadline:
                time.sleep(0.01)
            replay(reporter, pattern, 3, 0.0, 1.0, ns.seed, sched)  # warm-up: setup and the first estimates
            before = client.stats()
            load_before = [round(x, 2) for x in os.getloadavg()]
            started = time.monotonic()
            played = replay(reporter, pattern, iterations, ns.early_fraction, ns.early_ratio, ns.seed, sched)
            wall = time.monotonic() - started
            os.sched_setaffinity(0, allowed)
            reporter.close(timeout_s=10)
            time.sleep(0.3)
            stats = client.stats()
    finally:
        os.sched_setaffinity(0, allowed)
        manager.send_signal(signal.SIGTERM)
        manager.wait(30)
    bubble_s = stats.bubble_time_s - before.bubble_time_s
    harvested_s = stats.harvested_s - before.harvested_s
    return {
        "end_board": board,
        "step_us": step_us,
        "tf_ms": tf_ms,
        "trainer_on_side_task_core": on_core,
        "control_cpus": sorted(cpus),
        "pattern_ms": [round(p, 3) for _, _, p in pattern],
        "iterations": iterations,
        "bubbles_played": len(played),
        "early_played": sum(1 for p in played if p["early"]),
        "wall_s": round(wall, 2),
        "loadavg_before": load_before,
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        **stop_figures(read_trace(trace), ns.grace_ms),
        "harvested_over_bubble_time": round(harvested_s / bubble_s, 4) if bubble_s else 0.0,
        "harvested_s": round(harvested_s, 3),
        "bubble_time_s": round(bubble_s, 3),
        "manager_overrun_ms": asdict(stats.overrun_ms),
        "event_delay_ms": asdict(stats.event_delay_ms),
        "trainer": trainer_cost(played),
    }


def render(results: dict[str, Any]) -> str:
    runs: list[dict[str, Any]] = results["runs"]

    def p(d: dict[str, Any]) -> str:
        return f"{d.get('p50', 0):.3f} / {d.get('p99', 0):.3f} / {d.get('max', 0):.3f} (n={d.get('count', 0)})"

    head = "| figure (ms: p50 / p99 / max) | " + " | ".join(
        f"{r['step_us'] / 1000:g} ms steps, tf {r['tf_ms']:g} ms, "
        f"{'board + local events' if r['end_board'] else 'wire only'}"
        for r in runs) + " | target |"
    rows = [
        ("a step running at the real end stopped after it", lambda r: p(r["stopped_after_end_ms"]),
         f"p99 <= grace + 0.2 = {results['grace_ms'] + 0.2:g}"),
        ("... at early ends only", lambda r: p(r["stopped_after_early_end_ms"]), ""),
        ("... past grace + 0.2 ms / frozen / running at an end",
         lambda r: f"{r['stopped_past_limit']} / {r['frozen']} / {r['running_at_end']}", ""),
        ("steps begun after their bubble's real end", lambda r: f"{r['steps_after_real_end']} of {r['steps']} "
         f"({r['steps_after_real_end_pct']:.3f}%)", "<= 0.1%"),
        ("harvested / bubble time", lambda r: f"{r['harvested_over_bubble_time']:.3f}", ">= 0.90"),
        ("trainer's end -> manager's loop (a local end, held by a worker)", lambda r: p(r["end_wake_ms"]), ""),
        ("trainer stamp -> core, every event", lambda r: p(r["event_delay_ms"]), "p99 <= 0.5"),
        ("manager's overrun at freezes", lambda r: p(r["manager_overrun_ms"]), ""),
        ("trainer's run-queue wait after an early end", lambda r: p(r["trainer"]["after_early_end"]
                                                                   ["run_queue_wait_ms"]), ""),
        ("trainer's run-queue wait after other ends", lambda r: p(r["trainer"]["after_other_end"]
                                                                 ["run_queue_wait_ms"]), ""),
        ("trainer's CPU time after an early end", lambda r: p(r["trainer"]["after_early_end"]["cpu_ms"]), ""),
        ("trainer's wall - nominal after an early end", lambda r: p(r["trainer"]["after_early_end"]
                                                                   ["wall_minus_nominal_ms"]), ""),
        ("load average before / after", lambda r: f"{r['loadavg_before']} / {r['loadavg_after']}", ""),
    ]
    machine = results["machine"]
    lines = [
        "# Steps running at a bubble's real end (issue 23)",
        "",
        f"Machine: {machine['cpu']}, {machine['cores']} cores, Python {machine['python']}. Command: "
        f"`{results['command']}`. Load average at start {results['loadavg_start']}, at end "
        f"{results['loadavg_end']} (a shared machine: re-run on a quiet one for figures to quote).",
        "",
        "A `BubbleReporter` replays stage 0 of 1F1B (4 stages, 8 micro-batches) in real time; "
        f"{results['early_fraction']:.0%} of the bubbles end at {results['early_ratio']:.0%} of their prediction. "
        "The training thread is pinned to the side task's core and computes between bubbles (CPU time, so a "
        "run-queue wait stretches it); the reporter's threads and the manager run on the other core. "
        "Grace 0.5 ms. Trainer figures from the training thread's schedstat over the compute phase after each end.",
        "",
        head,
        "|---|" + "---|" * len(runs) + "---|",
    ]
    for name, cell, target in rows:
        lines.append(f"| {name} | " + " | ".join(cell(r) for r in runs) + f" | {target} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default="2000:10:150,10000:50:40,2000:10:150:wire",
                        help="comma-separated step_us:tf_ms:iterations[:wire] (wire: no end board, no local events)")
    parser.add_argument("--early-fraction", type=float, default=0.2)
    parser.add_argument("--early-ratio", type=float, default=0.7)
    parser.add_argument("--grace-ms", type=float, default=0.5, help="the manager's grace (its default)")
    parser.add_argument("--trainer-off-core", action="store_true",
                        help="run the replay's thread off the side task's core, sleeping between bubbles (the "
                             "control-plane bench's layout)")
    parser.add_argument("--seed", type=int, default=13)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "cpu")
    ns = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="fr-endstop-"))
    results: dict[str, Any] = {
        "machine": machine_info(), "command": " ".join(["python -m bench.bench_end_stop", *sys.argv[1:]]),
        "loadavg_start": [round(x, 2) for x in os.getloadavg()], "early_fraction": ns.early_fraction,
        "early_ratio": ns.early_ratio, "grace_ms": ns.grace_ms, "runs": [],
    }
    for spec in ns.runs.split(","):
        parts = spec.split(":")
        board = not (len(parts) > 3 and parts[3] == "wire")
        results["runs"].append(run(ns, tmp, float(parts[0]), float(parts[1]), int(parts[2]), board))
        print(json.dumps({k: v for k, v in results["runs"][-1].items() if k != "pattern_ms"}), flush=True)
    results["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    ns.out.mkdir(parents=True, exist_ok=True)
    (ns.out / "end_stop.json").write_text(json.dumps(results, indent=2) + "\n")
    table = render(results)
    (ns.out / "end_stop.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
