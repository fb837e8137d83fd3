"""Control-plane latency and throughput of one manager daemon on cpu:0.

Measures, against a real ``freeride manager`` process and a real worker process:

* grant latency: a bubble start reaching the manager -> the worker's first step beginning;
* park latency: a (early) bubble end reaching the manager -> the worker parked;
* sustained bubble events per second that one trainer stream delivers and the manager accepts;
* **early ends**: a real :class:`~freeride.training.reporter.BubbleReporter` replays the idle slots of
  stage 0 of a 4-stage 1F1B schedule with 8 micro-batches (``--tf-ms`` per forward, twice that per
  backward, the compute between slots slept), and ``--early-fraction`` of the bubbles (chosen at random,
  seeded) end at ``--early-ratio`` of their prediction. Measured from the manager's trace (every
  bubble's real start and end, every step's start and end as the worker reported it): the overrun past
  the real end of each bubble that had a step in it (the last step's end minus the real end, 0 when it
  ended before), and the steps that began after their bubble's real end, out of all steps; from the
  manager's histogram, a bubble end received -> the running worker's ended-grant word set. Run twice:
  with the trainer's end board (the default path on one host) and with ends over the wire only.

Latencies come from the manager's own histograms or its trace (CLOCK_MONOTONIC stamps on one
host). Run: ``python -m bench.bench_control_plane [--bubbles 2000] [--out bench/results/cpu]``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.machine import machine_info
from freeride._manager.trace import read_trace
from freeride._wire.client import BubbleStream, ControlClient, health_status
from freeride.endpoints import Endpoint
from freeride.errors import ManagerUnavailable
from freeride.messages import BubbleEnd, BubbleStart, TaskSpec
from freeride.training.reporter import BubbleReporter
from freeride.training.schedules import build_schedule

REPO = Path(__file__).resolve().parents[1]
MS = 1_000_000


def start_manager(sock: Path, state: Path, *options: str, cpus: set[int] | None = None) -> subprocess.Popen[bytes]:
    """A manager for cpu:0; with ``cpus``, its threads are moved there once it serves (threads it starts
    later inherit that; its workers pin themselves to cpu:0 whatever their parent's affinity). It reads a local
    trainer's events at each one even with no side task (``--idle-read-ms 0``): the benches that start it time
    those events as a manager with a task reads them."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "freeride.cli", "manager", "--device", "cpu:0", "--endpoint", f"unix:{sock}",
         "--state-dir", str(state), "--idle-read-ms", "0", *options],
        stderr=subprocess.DEVNULL,
    )
    endpoint = Endpoint("unix", str(sock))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if health_status(endpoint, timeout_s=1) == "SERVING":
                for tid in os.listdir(f"/proc/{proc.pid}/task") if cpus else ():
                    os.sched_setaffinity(int(tid), cpus)  # type: ignore[arg-type]
                return proc
        except ManagerUnavailable:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("the manager did not start")


def paced_bubbles(count: int, length_ms: float, predicted_ms: float,
                  gap_ms: float) -> Iterator[BubbleStart | BubbleEnd]:
    """Bubbles in real time: start, ``length_ms`` of waiting, end, ``gap_ms`` of 'compute'."""
    for it in range(count):
        start = time.monotonic_ns()
        yield BubbleStart(0, 0, it, 0, "bench", start, int(predicted_ms * MS), 16 * 2**30)
        time.sleep(length_ms / 1000)
        yield BubbleEnd(0, 0, it, 0, time.monotonic_ns())
        time.sleep(gap_ms / 1000)


def flood(count: int) -> Iterator[BubbleStart | BubbleEnd]:
    now = time.monotonic_ns()
    for it in range(count):
        yield BubbleStart(1, 1, it, 0, "flood", now + it * 10, MS, -1)
        yield BubbleEnd(1, 1, it, 0, now + it * 10 + 5)


# ---------------------------------------------------------------- early-ending bubbles


def stage0_pattern(tf_ms: float) -> list[tuple[float, int, float]]:
    """One iteration of stage 0 (1F1B, 4 stages, 8 micro-batches): (compute before, slot, predicted ms)."""
    schedule = build_schedule("1f1b", stages=4, microbatches=8, t_forward=tf_ms * MS, t_backward=2 * tf_ms * MS)
    timeline = schedule.timeline[0]
    pattern: list[tuple[float, int, float]] = []
    busy_since = 0.0
    for before, after in zip(timeline, timeline[1:], strict=False):
        if after.start > before.end:
            slot = len(pattern)
            pattern.append(((before.end - busy_since) / MS, slot, (after.start - before.end) / MS))
            busy_since = after.start
    tail = (timeline[-1].end - busy_since) / MS
    turnaround = (schedule.makespan - timeline[-1].end + timeline[0].start) / MS
    if turnaround > 0:
        pattern.append((tail, len(pattern), turnaround))
    else:
        pattern[0] = (pattern[0][0] + tail, pattern[0][1], pattern[0][2])
    return pattern


def replay(reporter: BubbleReporter, pattern: list[tuple[float, int, float]], iterations: int,
           early_fraction: float, early_ratio: float, seed: int) -> list[dict[str, float]]:
    """Play the pattern in real time; returns each bubble's (predicted, real) length in ms."""
    rng = random.Random(seed)
    played = []

    def wait_ms(ms: float) -> None:
        # Sleeping, never spinning: a trainer waiting on its receive holds neither a core nor the GIL
        # (a spinning replay starved the reporter's sender thread of the GIL for milliseconds). The real
        # lengths are what the reporter stamps, however the sleeps come out.
        time.sleep(ms / 1000)

    for it in range(iterations):
        for compute_ms, slot, predicted_ms in pattern:
            wait_ms(compute_ms)
            early = rng.random() < early_fraction
            real_ms = predicted_ms * (early_ratio if early else 1.0)
            reporter.bubble_start(it, slot, "bench", int(predicted_ms * MS), 16 * 2**30)
            wait_ms(real_ms)
            reporter.bubble_end(it, slot)
            played.append({"predicted_ms": predicted_ms, "real_ms": real_ms, "early": early})
    return played


def early_end_figures(records: list[dict[str, Any]]) -> dict[str, object]:
    """Overruns past real ends and steps begun after them, from a manager's trace records."""
    bubbles: list[tuple[int, int, int]] = []  # start, real end, predicted end
    open_start: dict[tuple[object, ...], tuple[int, int]] = {}
    spans: list[tuple[int, int]] = []
    for r in records:
        key = (r.get("stage"), r.get("rank"), r.get("iteration"), r.get("slot"))
        if r["ev"] == "bubble_start":
            open_start[key] = (int(r["start_ns"]), int(r["start_ns"]) + int(r["predicted_ns"]))
        elif r["ev"] == "bubble_end" and key in open_start:
            start, predicted_end = open_start.pop(key)
            bubbles.append((start, int(r["end_ns"]), predicted_end))
        elif r["ev"] == "steps":
            spans += [(int(a), int(b)) for a, b in r["spans"]]
    bubbles.sort()
    spans.sort()
    starts = [b[0] for b in bubbles]
    import bisect

    late_steps = 0
    last_end: dict[int, int] = {}
    for s, e in spans:
        i = bisect.bisect_right(starts, s) - 1
        if i < 0:
            continue
        if s > bubbles[i][1]:
            late_steps += 1
        last_end[i] = max(last_end.get(i, 0), e)
    overrun_early, overrun_all = [], []
    for i, end in last_end.items():
        start, real_end, predicted_end = bubbles[i]
        overrun = max(0, end - real_end) / MS
        overrun_all.append(overrun)
        if real_end < predicted_end:
            overrun_early.append(overrun)
    return {
        "bubbles": len(bubbles),
        "early_bubbles": sum(1 for b in bubbles if b[1] < b[2]),
        "bubbles_with_steps": len(last_end),
        "steps": len(spans),
        "steps_after_real_end": late_steps,
        "steps_after_real_end_pct": round(100 * late_steps / max(1, len(spans)), 4),
        "overrun_early_ms": pct(overrun_early),
        "overrun_all_ms": pct(overrun_all),
    }


def pct(values: list[float]) -> dict[str, float]:
    if not values:
        return {"count": 0}
    ordered = sorted(values)

    def q(p: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(p * len(ordered)))], 4)

    return {"count": len(ordered), "p50": q(0.5), "p90": q(0.9), "p99": q(0.99), "max": round(ordered[-1], 4)}


def control_cpus() -> set[int]:
    """The cores the control plane (this replay, its reporter, the manager) runs on: every allowed one but
    the side task's core 0, when there is another. A trainer's process and the manager on the side
    task's core take it from the side task at each end (the worker runs at nice 19): the step in flight
    then stretches by the control plane's own CPU time (~0.5 ms here), which measures the contention of
    a shared core, not when the side task learned of the end. On a GPU that CPU work would not delay the
    side task's kernels either."""
    allowed = os.sched_getaffinity(0)
    return (allowed - {0}) or allowed


def early_ends(ns: argparse.Namespace, tmp: Path, board: bool) -> dict[str, object]:
    label = "board" if board else "wire"
    sock = Path(f"/tmp/fr-bench-{os.getpid()}-{label}.sock")
    trace = tmp / f"trace-{label}.jsonl"
    cpus = control_cpus()
    allowed = os.sched_getaffinity(0)
    manager = start_manager(sock, tmp / f"state-{label}", "--trace", str(trace), cpus=cpus)
    os.sched_setaffinity(0, cpus)  # this thread, then the reporter's threads, which it starts
    endpoint = Endpoint("unix", str(sock))
    pattern = stage0_pattern(ns.tf_ms)
    try:
        with ControlClient(endpoint) as client:
            task = client.submit(TaskSpec(target="bench.bench_tasks:SpinStep", args={"step_us": ns.step_us},
                                          memory_bytes=256 * 2**20, working_dir=str(REPO)))
            while client.get(task.task_id).state != "PARKED":
                time.sleep(0.05)
            reporter = BubbleReporter("cpu:0", stage=0, rank=0, endpoint=endpoint, end_board=board)
            deadline = time.monotonic() + 10
            while not reporter.counters().connected and time.monotonic() < deadline:
                time.sleep(0.01)
            replay(reporter, pattern, 5, 0.0, 1.0, ns.seed)  # warm-up: setup and the first estimates
            load_before = [round(x, 2) for x in os.getloadavg()]
            started = time.monotonic()
            played = replay(reporter, pattern, ns.early_iterations, ns.early_fraction, ns.early_ratio, ns.seed)
            wall = time.monotonic() - started
            reporter.close(timeout_s=10)
            time.sleep(0.2)
            stats = client.stats()
    finally:
        manager.send_signal(signal.SIGTERM)
        manager.wait(30)
        os.sched_setaffinity(0, allowed)
    figures = early_end_figures(read_trace(trace))
    return {
        "end_board": board,
        "control_cpus": sorted(cpus),
        "tf_ms": ns.tf_ms,
        "pattern": [{"compute_ms": round(c, 3), "slot": s, "predicted_ms": round(p, 3)} for c, s, p in pattern],
        "iterations": ns.early_iterations,
        "bubbles_played": len(played),
        "early_played": sum(1 for p in played if p["early"]),
        "wall_s": round(wall, 2),
        "loadavg_before": load_before,
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        **figures,
        "manager_overrun_ms": asdict(stats.overrun_ms),
        "end_to_worker_ms": asdict(stats.end_to_worker_ms),
        "park_latency_ms": asdict(stats.park_latency_ms),
        "event_delay_ms": asdict(stats.event_delay_ms),
        "harvested_s": round(stats.harvested_s, 3),
        "bubble_time_s": round(stats.bubble_time_s, 3),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bubbles", type=int, default=2000)
    parser.add_argument("--flood-events", type=int, default=200_000)
    parser.add_argument("--early-iterations", type=int, default=300, help="iterations of the early-end replay")
    parser.add_argument("--early-fraction", type=float, default=0.2, help="share of bubbles that end early")
    parser.add_argument("--early-ratio", type=float, default=0.7, help="an early bubble's real length / predicted")
    parser.add_argument("--tf-ms", type=float, default=1.0, help="forward time of the replayed schedule")
    parser.add_argument("--step-us", type=float, default=100.0, help="the side task's step time")
    parser.add_argument("--seed", type=int, default=13)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "cpu")
    ns = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="fr-bench-"))
    sock = Path(f"/tmp/fr-bench-{os.getpid()}.sock")
    manager = start_manager(sock, tmp / "state")
    endpoint = Endpoint("unix", str(sock))
    results: dict[str, object] = {"machine": machine_info(), "command": " ".join(["python -m bench.bench_control_plane",
                                                                                  *sys.argv[1:]]),
                                  "loadavg_start": [round(x, 2) for x in os.getloadavg()]}
    try:
        with ControlClient(endpoint) as client:
            task = client.submit(TaskSpec(target="bench.bench_tasks:SpinStep", args={"step_us": 100},
                                          memory_bytes=256 * 2**20, working_dir=str(REPO)))
            while client.get(task.task_id).state != "PARKED":
                time.sleep(0.05)
            # Warm-up: setup and the first estimates.
            BubbleStream(endpoint, paced_bubbles(20, 10, 10, 5)).result(60)
            before = client.stats()
            # Real end (8 ms) comes before the predicted end (12 ms): every bubble ends by a park.
            started = time.monotonic()
            BubbleStream(endpoint, paced_bubbles(ns.bubbles, 8, 12, 4)).result(600)
            paced_s = time.monotonic() - started
            time.sleep(0.2)
            stats = client.stats()
            info = client.get(task.task_id)
            results["paced"] = {
                "bubbles": ns.bubbles,
                "bubble_real_ms": 8,
                "bubble_predicted_ms": 12,
                "gap_ms": 4,
                "wall_s": round(paced_s, 3),
                "grant_latency_ms": asdict(stats.grant_latency_ms),
                "park_latency_ms": asdict(stats.park_latency_ms),
                "overrun_ms": asdict(stats.overrun_ms),
                "overruns": stats.overruns - before.overruns,
                "bubble_time_s": round(stats.bubble_time_s - before.bubble_time_s, 4),
                "harvested_s": round(stats.harvested_s - before.harvested_s, 4),
                "task_steps": info.steps,
                "note": "latency histograms include the 20 warm-up bubbles",
            }
            received_before = client.stats().events_received
            started = time.monotonic()
            accepted, rejected = BubbleStream(endpoint, flood(ns.flood_events // 2)).result(600)
            flood_s = time.monotonic() - started
            results["flood"] = {
                "events": accepted + rejected,
                "accepted": accepted,
                "wall_s": round(flood_s, 3),
                "events_per_s": round(accepted / flood_s),
                "manager_counted": client.stats().events_received - received_before,
            }
    finally:
        manager.send_signal(signal.SIGTERM)
        manager.wait(30)
    if ns.early_iterations > 0:
        results["early_board"] = early_ends(ns, tmp, board=True)
        results["early_wire"] = early_ends(ns, tmp, board=False)
    results["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    ns.out.mkdir(parents=True, exist_ok=True)
    (ns.out / "control_plane.json").write_text(json.dumps(results, indent=2) + "\n")
    paced = results["paced"]
    flood_r = results["flood"]
    assert isinstance(paced, dict) and isinstance(flood_r, dict)
    g, p, o = paced["grant_latency_ms"], paced["park_latency_ms"], paced["overrun_ms"]
    machine = results["machine"]
    assert isinstance(machine, dict)
    table = [
        "# Control-plane latency (one manager on cpu:0, one worker process)",
        "",
        f"Machine: {machine['cpu']}, {machine['cores']} cores, Python {machine['python']}, "
        f"grpcio {machine['versions']['grpcio']}. Command: `{results['command']}`.",
        "",
        "| figure | count | p50 | p90 | p99 | max | target |",
        "|---|---|---|---|---|---|---|",
        f"| bubble start -> first step (ms) | {g['count']} | {g['p50']:.3f} | {g['p90']:.3f} | {g['p99']:.3f} "
        f"| {g['max']:.3f} | p99 <= 1 ms |",
        f"| bubble end -> worker parked (ms) | {p['count']} | {p['p50']:.3f} | {p['p90']:.3f} | {p['p99']:.3f} "
        f"| {p['max']:.3f} | p99 <= 1 ms |",
        f"| overrun past the real end (ms) | {o['count']} | {o['p50']:.3f} | {o['p90']:.3f} | {o['p99']:.3f} "
        f"| {o['max']:.3f} | p99 <= 1 ms |",
        "",
        f"Paced run: {paced['bubbles']} bubbles of 8 ms (predicted 12 ms, so each ends by a park), "
        f"4 ms gaps; side task steps of 100 us; harvested {paced['harvested_s']} s of "
        f"{paced['bubble_time_s']} s of bubble time.",
        "",
        f"Sustained stream: {flood_r['accepted']} bubble events in {flood_r['wall_s']} s = "
        f"**{flood_r['events_per_s']} events/s** on one trainer stream (client and manager on the same 2 cores).",
        "",
        f"Load average at start {results['loadavg_start']}, at end {results['loadavg_end']} (the machine is shared: "
        "re-run on a quiet one for figures to quote).",
        "",
    ]
    if "early_board" in results:
        table += render_early(results["early_board"], results["early_wire"])  # type: ignore[arg-type]
    (ns.out / "control_plane.md").write_text("\n".join(table))
    print("\n".join(table))
    return 0



def render_early(board: dict[str, Any], wire: dict[str, Any]) -> list[str]:
    def row(name: str, key: str, target: str) -> str:
        cells = []
        for r in (board, wire):
            p = r[key]
            cells.append(f"{p.get('p50', 0):.3f} / {p.get('p99', 0):.3f} / {p.get('max', 0):.3f} "
                         f"(n={p.get('count', 0)})")
        return f"| {name} | {cells[0]} | {cells[1]} | {target} |"

    pattern = ", ".join(f"{p['predicted_ms']:g}" for p in board["pattern"])
    return [
        "## Early-ending bubbles",
        "",
        f"A `BubbleReporter` replays stage 0 of 1F1B (4 stages, 8 micro-batches, forward "
        f"{board['tf_ms']:g} ms, backward twice that): slots of {pattern} ms an iteration, {board['iterations']} "
        "iterations; "
        f"{board['early_played']} of {board['bubbles_played']} bubbles (chosen at random) end at 70% of their "
        "prediction. One side task of 100 us steps. Overruns and late steps from the manager's trace (every step as "
        "the worker reported it); end -> worker from the manager's histogram.",
        "",
        "| figure (ms: p50 / p99 / max) | trainer end board (default) | wire only | target |",
        "|---|---|---|---|",
        row("overrun past the real end, early bubbles", "overrun_early_ms", "p99 <= 1 ms"),
        row("overrun past the real end, every bubble with a step", "overrun_all_ms", ""),
        row("end received -> worker's end word set", "end_to_worker_ms", "p99 <= 0.1 ms"),
        row("end received -> worker parked", "park_latency_ms", ""),
        row("trainer stamp -> manager loop (every event)", "event_delay_ms", ""),
        f"| steps begun after their bubble's real end | {board['steps_after_real_end']} of {board['steps']} "
        f"({board['steps_after_real_end_pct']:.3f}%) | {wire['steps_after_real_end']} of {wire['steps']} "
        f"({wire['steps_after_real_end_pct']:.3f}%) | <= 0.1% |",
        f"| load average before / after | {board['loadavg_before']} / {board['loadavg_after']} | "
        f"{wire['loadavg_before']} / {wire['loadavg_after']} | |",
        "",
    ]


if __name__ == "__main__":
    sys.exit(main())
