"""``freeride demo``: the whole system on this machine in a few minutes, with a summary and pictures.

    freeride demo [--device auto|cpu|cuda] [--iterations N] [--out DIR] [--quick] [--json]

Trains the reference GPT as a 2-stage 1F1B pipeline twice -- once alone (the baseline), once with
a manager per device and three side tasks (graph, image, training) harvesting its bubbles -- on
GPUs where there are any (one GPU: stage 0 for real, its neighbour emulated), else on two CPU cores,
and
prints the bubble fraction of each stage, the harvest and its efficiency per device, the training
overhead and each task's progress (see :mod:`freeride._demo.run` for the steps). Progress lines go
to stderr, the summary to stdout (``--json``: the ``summary.json`` document). Writes
``summary.json``, ``timeline.png`` and ``trace.json`` (Perfetto) under ``--out``.

Exit codes: 0 the run completed and its figures are consistent; 1 a step failed, or the summary is
inconsistent (harvested more than the bubble time, a task without progress or failed); 2 bad
input, or this machine lacks the devices (two CPU cores, or a GPU for ``--device cuda``); 128+N on
signal N.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from freeride._demo.plan import DEVICE_CHOICES, FULL_ITERATIONS, QUICK_ITERATIONS, DemoConfig
from freeride._extras import require


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="train a 2-stage pipeline with a manager per device and side tasks in its bubbles; summarize",
        description="Run the reference 2-stage 1F1B trainer alone and then with a freeride manager per device "
        "and a graph, an image and a training side task; print bubble fractions, harvest efficiency, "
        "training overhead and task progress; write summary.json, timeline.png and trace.json (Perfetto).",
    )
    parser.add_argument("--device", choices=DEVICE_CHOICES, default="auto",
                        help="auto (default): cuda where there is a GPU, else cpu. cpu: stage k on CPU core k. "
                        "cuda: stage k on GPU k over NCCL with 2 or more GPUs; with one, stage 0 on cuda:0 "
                        "and its neighbour emulated")
    parser.add_argument("--iterations", type=int, default=None,
                        help=f"training iterations per run (default {FULL_ITERATIONS}, {QUICK_ITERATIONS} "
                        "with --quick)")
    parser.add_argument("--out", default="out/demo", help="output directory (default %(default)s)")
    parser.add_argument("--quick", action="store_true", help="the CI size: fewer iterations, shorter measurements")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON (summary.json's content)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    require("demo", "freeride demo")
    from freeride._demo.processes import DemoInterrupted
    from freeride._demo.run import run_demo, summary_json
    from freeride._demo.summary import render_summary

    config = DemoConfig.make(args.device, args.iterations, Path(args.out), args.quick)
    try:
        summary = run_demo(config)
    except DemoInterrupted as exc:
        print(f"freeride demo: {exc}; every process it started has been stopped", file=sys.stderr)
        return 128 + exc.signum
    print(summary_json(summary) if args.json else render_summary(summary), flush=True)
    return 0 if summary.consistent else 1
