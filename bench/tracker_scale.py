"""What the rank tracker costs the training thread at the scales users train at: many ranks, many micro-batches.

``python -m bench.tracker_scale [--cases NAME:RANKS:MICROBATCHES,...] [--iterations N]``: for each case, one
rank's tracker (the middle rank of the model's own schedule, :func:`freeride.training.schedules.build_schedule`;
every planned wait reported to a sink that drops it) driven through ``N`` iterations of its order with the marks
back to back, no compute between them. What it shows is the tracker's bookkeeping per iteration, not a mark's
cache-cold cost between compute actions (``bench.hot_path`` measures that): construction (the plan and the first
model), each of the first iterations, which re-simulate the steady state of every rank's order with the costs
profiled so far (:meth:`~freeride.training.tracker.RankTracker.cost_ns`), and the steady iterations after them,
whose waits are learned every :data:`~freeride.training.tracker.LEARN_EVERY` iterations at once, with the
interpreter's full garbage collections counted apart (a steady iteration's max is one of those: the trainer's whole
heap is scanned then, not freeride's work). Written to ``bench/results/cpu/tracker_scale.{json,md}``.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

from bench.hot_path import _Dropped
from bench.machine import machine_info
from freeride.measure import median
from freeride.training.schedules import build_schedule
from freeride.training.tracker import RankTracker

RESULTS = Path(__file__).resolve().parent / "results" / "cpu"
DEFAULT_CASES = "1f1b:4:16,interleaved-1f1b:4:32,zb-h1:8:64,interleaved-1f1b:8:64,interleaved-1f1b:16:128"


def measure(name: str, ranks: int, microbatches: int, iterations: int) -> dict[str, Any]:
    """One case's figures, in ms (module doc)."""
    orders = build_schedule(name, ranks, microbatches).orders
    rank = ranks // 2
    order = orders[rank]
    t0 = time.perf_counter()
    tracker = RankTracker(orders, rank, _Dropped(), waits_follow_compute=True, report_min_ns=0)
    construct_ms = (time.perf_counter() - t0) * 1e3
    begin, end = tracker.compute_begin, tracker.compute_end
    per_iteration = []
    full_collections: list[int] = []  # per iteration: the interpreter's full (generation 2) collections in it

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and info["generation"] == 2:
            full_collections[-1] += 1

    gc.callbacks.append(count)
    try:
        for _ in range(iterations):
            full_collections.append(0)
            t0 = time.perf_counter()
            tracker.iteration_begin()
            for action in order:
                begin(action.kind, action.stage, action.microbatch)
                end(action.kind, action.stage, action.microbatch)
            tracker.iteration_end()
            per_iteration.append((time.perf_counter() - t0) * 1e3)
    finally:
        gc.callbacks.remove(count)
    tracker.close()
    profiling = 5  # RankTracker's remodel_iterations: each delivers and remodels at the next iteration_begin
    steady = per_iteration[profiling + 1:]
    collected = full_collections[profiling + 1:]
    quiet = [ms for ms, n in zip(steady, collected, strict=True) if not n]
    return {"schedule": name, "ranks": ranks, "microbatches": microbatches, "rank": rank,
            "actions_per_rank": len(order), "actions": sum(len(o) for o in orders.values()),
            "wait_positions": len(tracker.plan.positions), "construct_ms": construct_ms,
            "profiling_ms": per_iteration[:profiling + 1], "steady_ms_p50": median(steady),
            "steady_ms_max": max(steady), "steady_full_collections": sum(collected),
            "steady_ms_max_without_collections": max(quiet) if quiet else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.tracker_scale", description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=DEFAULT_CASES, help="comma-separated SCHEDULE:RANKS:MICROBATCHES")
    p.add_argument("--iterations", type=int, default=40)
    p.add_argument("--results-name", default="tracker_scale",
                   help="write bench/results/cpu/NAME.{json,md} ('' to print only)")
    args = p.parse_args(argv)
    if args.iterations < 10:
        p.error("--iterations must be at least 10 (6 profile the model; the rest are steady)")
    cases = []
    for text in (c.strip() for c in args.cases.split(",") if c.strip()):
        parts = text.split(":")
        if len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
            p.error(f"--cases: {text!r} is not SCHEDULE:RANKS:MICROBATCHES")
        cases.append((parts[0], int(parts[1]), int(parts[2])))
    rows = []
    for name, ranks, microbatches in cases:
        row = measure(name, ranks, microbatches, args.iterations)
        rows.append(row)
        print(f"{name} {ranks} ranks x {microbatches} micro-batches ({row['actions_per_rank']} actions a rank): "
              f"construct {row['construct_ms']:.1f} ms; profiling iterations "
              + ", ".join(f"{x:.1f}" for x in row["profiling_ms"])
              + f" ms; steady p50 {row['steady_ms_p50']:.2f} ms, max {row['steady_ms_max']:.2f} ms "
              f"({row['steady_full_collections']} full garbage collections; max without "
              f"{_ms(row['steady_ms_max_without_collections'])} ms)", flush=True)
    if args.results_name:
        command = " ".join(["python -m bench.tracker_scale", *(sys.argv[1:] if argv is None else argv)])
        doc = {"command": command, "machine": machine_info(), "iterations": args.iterations, "rows": rows}
        (RESULTS / f"{args.results_name}.json").write_text(json.dumps(doc, indent=2) + "\n")
        write_markdown(doc, RESULTS / f"{args.results_name}.md")
    return 0


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def write_markdown(doc: dict[str, Any], path: Path) -> None:
    m = doc["machine"]
    lines = [
        "# The rank tracker's bookkeeping at scale (marks back to back, no compute)",
        "",
        f"`{doc['command']}` on {m['cpu']} ({m['cores']} cores), {doc['iterations']} iterations per case "
        "(`bench.tracker_scale`: the middle rank of the model's schedule, every planned wait reported to a sink "
        "that drops it). Profiling: iterations 0-5, each of 1-5 re-simulating every rank's order with the costs "
        "profiled so far; steady: the rest (waits learned every 4 iterations at once). A steady iteration in "
        "which the interpreter ran a full (generation 2) garbage collection is counted: those are the max, "
        "beside the max of the iterations without one.",
        "",
        "| schedule | ranks | micro-batches | actions a rank / in all | construct ms | profiling iterations ms "
        "| steady p50 ms | steady max ms | full collections | steady max without ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["rows"]:
        lines.append(f"| {r['schedule']} | {r['ranks']} | {r['microbatches']} | {r['actions_per_rank']} / "
                     f"{r['actions']} | {r['construct_ms']:.1f} | "
                     + ", ".join(f"{x:.1f}" for x in r["profiling_ms"])
                     + f" | {r['steady_ms_p50']:.2f} | {r['steady_ms_max']:.2f} | {r['steady_full_collections']} | "
                     f"{_ms(r['steady_ms_max_without_collections'])} |")
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
