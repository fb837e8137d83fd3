"""Control-plane latency and throughput of one manager daemon on cpu:0.

Measures, against a real ``freeride manager`` process and a real worker process:

* grant latency: a bubble start reaching the manager -> the worker's first step beginning;
* park latency: a (early) bubble end reaching the manager -> the worker parked;
* sustained bubble events per second that one trainer stream delivers and the manager accepts.

Latencies come from the manager's own histograms (both ends are CLOCK_MONOTONIC stamps on one
host). Run: ``python -m bench.bench_control_plane [--bubbles 2000] [--out bench/results/cpu]``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from bench.machine import machine_info
from freeride._wire.client import BubbleStream, ControlClient, health_status
from freeride.endpoints import Endpoint
from freeride.errors import ManagerUnavailable
from freeride.messages import BubbleEnd, BubbleStart, TaskSpec

REPO = Path(__file__).resolve().parents[1]
MS = 1_000_000


def start_manager(sock: Path, state: Path) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "freeride.cli", "manager", "--device", "cpu:0", "--endpoint", f"unix:{sock}",
         "--state-dir", str(state)],
        stderr=subprocess.DEVNULL,
    )
    endpoint = Endpoint("unix", str(sock))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if health_status(endpoint, timeout_s=1) == "SERVING":
                return proc
        except ManagerUnavailable:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("the manager did not start")


def paced_bubbles(count: int, length_ms: float, predicted_ms: float, gap_ms: float):  # type: ignore[no-untyped-def]
    """Bubbles in real time: start, ``length_ms`` of waiting, end, ``gap_ms`` of 'compute'."""
    for it in range(count):
        start = time.monotonic_ns()
        yield BubbleStart(0, 0, it, 0, "bench", start, int(predicted_ms * MS), 16 * 2**30)
        time.sleep(length_ms / 1000)
        yield BubbleEnd(0, 0, it, 0, time.monotonic_ns())
        time.sleep(gap_ms / 1000)


def flood(count: int):  # type: ignore[no-untyped-def]
    now = time.monotonic_ns()
    for it in range(count):
        yield BubbleStart(1, 1, it, 0, "flood", now + it * 10, MS, -1)
        yield BubbleEnd(1, 1, it, 0, now + it * 10 + 5)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bubbles", type=int, default=2000)
    parser.add_argument("--flood-events", type=int, default=200_000)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "cpu")
    ns = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="fr-bench-"))
    sock = Path(f"/tmp/fr-bench-{os.getpid()}.sock")
    manager = start_manager(sock, tmp / "state")
    endpoint = Endpoint("unix", str(sock))
    results: dict[str, object] = {"machine": machine_info(), "command": " ".join(["python -m bench.bench_control_plane",
                                                                                  *sys.argv[1:]])}
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
    ]
    (ns.out / "control_plane.md").write_text("\n".join(table))
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
