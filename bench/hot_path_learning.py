"""What batching the tracker's learning saves the training thread: ``learn_every`` 1 against the default.

``python -m bench.hot_path_learning [--schedules a,b] [--rounds N]``: for each torch schedule's rank, two
instrumented replays of the same order (``bench.hot_path``'s, 1 ms of GIL-free compute per action, every
planned wait reported to a sink that drops it), one learning each iteration as it ends and one learning
every :data:`~freeride.training.tracker.LEARN_EVERY` iterations at once, paired against each other in
shuffled batches on the training thread pinned to one core. The figure is the median difference per
iteration: negative where batching costs less. Measuring the two in one run, against each other, keeps the
machine's drift out of a difference of tens of microseconds that separate runs of ``bench.hot_path`` cannot
show. Written to ``bench/results/cpu/hot_path_learning.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from bench import bench_schedules, hot_path
from bench.machine import machine_info
from freeride.training import tracker as tracker_module
from freeride.training.instrument import InstrumentedSchedule

RESULTS = Path(__file__).resolve().parent / "results" / "cpu"


def _replay(name: str, rank: int, microbatches: int, csv_path: Path, learn_every: int) -> InstrumentedSchedule:
    inst = InstrumentedSchedule(bench_schedules._walker(name, rank, microbatches, csv_path, hot_path.COMPUTE_US),
                                sink=hot_path._Dropped(), device="cpu:0", report_min_ns=0)
    inst.tracker.learn_every = learn_every
    return inst


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.hot_path_learning", description=__doc__.splitlines()[0])
    p.add_argument("--schedules", default="1f1b,interleaved-1f1b,zbv,dualpipev,csv")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--rounds", type=int, default=30)
    args = p.parse_args(argv)
    csv_path = bench_schedules.temporary_csv_order(args.microbatches, "fr-learn-")
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(allowed)})
    rows: list[dict[str, Any]] = []
    try:
        for name in [n.strip() for n in args.schedules.split(",") if n.strip()]:
            for rank in (0, 1):
                each = _replay(name, rank, args.microbatches, csv_path, 1)
                batched = _replay(name, rank, args.microbatches, csv_path, tracker_module.LEARN_EVERY)
                diff_ns = hot_path.paired_ns(each.step, batched.step, args.rounds, 20)
                waits = len(each.tracker.plan.positions)
                each.close()
                batched.close()
                rows.append({"schedule": name, "rank": rank, "wait_positions": waits,
                             "batched_minus_each_us": diff_ns / 1e3})
                print(f"{name} rank {rank}: {diff_ns / 1e3:+.0f} us an iteration ({waits} wait positions)",
                      flush=True)
    finally:
        os.sched_setaffinity(0, allowed)
    command = " ".join(["python -m bench.hot_path_learning", *(sys.argv[1:] if argv is None else argv)])
    doc = {"command": command, "machine": machine_info(), "learn_every": tracker_module.LEARN_EVERY,
           "compute_us": hot_path.COMPUTE_US, "microbatches": args.microbatches, "rounds": args.rounds,
           "rows": rows}
    (RESULTS / "hot_path_learning.json").write_text(json.dumps(doc, indent=2) + "\n")
    m = doc["machine"]
    lines = ["# Learning every 4 iterations against every iteration: the training thread's cost", "",
             f"`{command}` on {m['cpu']} ({m['cores']} cores): {args.microbatches} micro-batches, "
             f"{hot_path.COMPUTE_US:g} us of compute per action, the median over {args.rounds} shuffled pairs of "
             "batches of 20 iterations (`bench/hot_path_learning.py`). Negative: batching costs the training "
             "thread less.", "",
             "| schedule | rank | wait positions | learn every 4 minus every 1 (us an iteration) |",
             "|---|---|---|---|"]
    lines += [f"| {r['schedule']} | {r['rank']} | {r['wait_positions']} | {r['batched_minus_each_us']:+.0f} |"
              for r in rows]
    (RESULTS / "hot_path_learning.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
