"""What a reported event costs the training thread: the wire's queue against a local trainer's message.

    python -m bench.bench_local_events [--pairs 4000] [--batches 20]

A real :class:`~freeride.training.reporter.BubbleReporter` reports ``bubble_start`` + ``bubble_end`` pairs
from this (the training) thread, pinned to one core, with ~0.2 ms of busy compute between pairs (so each
call finds the other side idle, as a trainer's does):

* **wire**: over gRPC to a real manager (``freeride manager``, no side task): each call puts a tuple on
  the reporter's queue and wakes its sender thread, which runs on the other core;
* **local**: the same reporter and manager on the same host, each event one message on the manager's
  local socket (:mod:`freeride._local_events`), read by the manager's loop on the other core.

Batches of the two alternate (in a fresh order each round); each pair of calls is timed with
``perf_counter_ns`` on the training thread. Reported: per call pair, p50 / p90 / p99 over all pairs, and
the median of per-batch means. Results: ``<out>/local_events.{json,md}``, with the machine and the load
average.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.bench_control_plane import REPO, control_cpus, pct, start_manager
from bench.machine import machine_info
from freeride.measure import median
from freeride.training.reporter import BubbleReporter


def _compute(us: float) -> None:
    until = time.perf_counter_ns() + int(us * 1000)
    while time.perf_counter_ns() < until:
        pass


def _batch(reporter: BubbleReporter, first: int, pairs: int, gap_us: float) -> list[int]:
    costs = []
    for it in range(first, first + pairs):
        t0 = time.perf_counter_ns()
        reporter.bubble_start(it, 0, "bench", 1_000_000)
        reporter.bubble_end(it, 0)
        costs.append(time.perf_counter_ns() - t0)
        _compute(gap_us)
    return costs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=4000, help="call pairs per path in all")
    ap.add_argument("--batches", type=int, default=20)
    ap.add_argument("--gap-us", type=float, default=200.0, help="busy compute between pairs")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "cpu")
    ns = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="fr-localev-"))
    cpus = control_cpus()
    allowed = os.sched_getaffinity(0)
    load_before = [round(x, 2) for x in os.getloadavg()]
    costs: dict[str, list[int]] = {"wire": [], "local": []}
    batch_means: dict[str, list[float]] = {"wire": [], "local": []}
    counters: dict[str, Any] = {}
    procs = []
    try:
        reporters = {}
        for path in ("wire", "local"):
            sock = Path(f"/tmp/fr-localev-{os.getpid()}-{path}.sock")
            procs.append(start_manager(sock, tmp / f"state-{path}", cpus=cpus))
            reporters[path] = BubbleReporter("cpu:0", stage=0, rank=0, endpoint=f"unix:{sock}",
                                             end_board=path == "local", cpu_affinity=cpus)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not (all(r.counters().connected for r in reporters.values())
                                                    and reporters["local"]._local is not None):
            time.sleep(0.01)
        os.sched_setaffinity(0, {0})  # this (the training) thread only
        per_batch = max(1, ns.pairs // ns.batches)
        first = 0
        for _ in range(ns.batches):
            order = ["wire", "local"]
            random.shuffle(order)
            for path in order:
                got = _batch(reporters[path], first, per_batch, ns.gap_us)
                first += per_batch
                costs[path] += got
                batch_means[path].append(sum(got) / len(got))
        os.sched_setaffinity(0, allowed)
        for path, reporter in reporters.items():
            reporter.close(timeout_s=10)
            counters[path] = reporter.counters().__dict__
    finally:
        os.sched_setaffinity(0, allowed)
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
    doc: dict[str, Any] = {
        "command": " ".join(["python -m bench.bench_local_events", *sys.argv[1:]]),
        "machine": machine_info(), "config": {k: str(v) for k, v in vars(ns).items()},
        "loadavg_before": load_before, "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "pair_us": {p: pct([c / 1000 for c in v]) for p, v in costs.items()},
        "batch_mean_us_median": {p: median(v) / 1000 for p, v in batch_means.items()},
        "reporters": counters,
    }
    ns.out.mkdir(parents=True, exist_ok=True)
    (ns.out / "local_events.json").write_text(json.dumps(doc, indent=2) + "\n")
    m = doc["machine"]
    rows = [
        "# What a reported event costs the training thread (issue 23)",
        "",
        f"`{doc['command']}` on {m['cpu']} ({m['cores']} cores), Python {m['python']}; load average "
        f"{doc['loadavg_before']} before, {doc['loadavg_after']} after. A `bubble_start` + `bubble_end` pair "
        f"from the training thread pinned to core 0, {ns.gap_us:g} us of busy compute between pairs; the "
        "manager and the reporter's sender thread on the other core.",
        "",
        "| path | per call pair, us: p50 / p90 / p99 | median of batch means, us | events sent (as messages) |",
        "|---|---|---|---|",
    ]
    for path, label in (("wire", "wire: queue + sender thread (gRPC)"),
                        ("local", "local: one message per event on `<socket>.events`")):
        p = doc["pair_us"][path]
        c = counters.get(path, {})
        rows.append(f"| {label} | {p['p50']:.1f} / {p['p90']:.1f} / {p['p99']:.1f} "
                    f"| {doc['batch_mean_us_median'][path]:.1f} | {c.get('sent', 0)} ({c.get('local', 0)}) |")
    (ns.out / "local_events.md").write_text("\n".join(rows) + "\n")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
