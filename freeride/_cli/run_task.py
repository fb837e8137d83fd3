"""``freeride run-task``: run one side task alone and report its throughput and memory.

    freeride run-task side_tasks.graphs:PageRank --arg graph=rmat:16 --device cpu:0 --seconds 10
    freeride run-task mypkg.tasks:MyTask --args-json '{"size": 4}' --memory 2GiB --json

``--arg key=value`` values are parsed as JSON when they parse (``--arg n=3`` gives an int,
``--arg flip=true`` a bool) and are strings otherwise, as ``submit`` parses them; they override
``--args-json``. The run happens in this process, made a worker's before the task's module is
imported (:mod:`freeride._task_process`: the worker's environment and thread counts, its core and
nice 19 on ``cpu:N``; on ``cuda:N`` this GPU alone, the context and the one cap), so the numbers are
the ones a worker would see; on ``cpu:N`` it warns when other processes took more than 10% of the
core meanwhile (a worker yields to them: its steps are then slower than on an idle core). The
current directory is searched first for the task's module, so ``freeride run-task
my_task:MyTask`` works next to ``my_task.py``. The memory limit (``--memory``, else the task's
estimate) is enforced as in a worker: going over it fails the run. There is no step timeout: a
step that never returns holds the run until Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from freeride._cli.submission import TaskCode, parse_task_args
from freeride._validation import check_memory
from freeride.standalone import StandaloneReport, check_target_syntax, run_standalone
from freeride.units import format_ms, format_rate, format_size, parse_size


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "run-task",
        help="run one side task alone and measure throughput, step times and memory",
        description="Run a side task (module:Class) alone on a device, with no bubbles, and report "
        "its throughput, step-time percentiles and peak memory.",
    )
    parser.add_argument("target", help="the task class, as package.module:ClassName")
    parser.add_argument("--arg", action="append", default=[], metavar="KEY=VALUE",
                        help="a constructor argument, parsed as submit parses it; repeatable")  # fmt: skip
    parser.add_argument("--args-json", default=None, metavar="JSON", help="constructor arguments as a JSON object")
    parser.add_argument("--device", default="cpu:0", help="cpu:N or cuda:N (default cpu:0)")
    parser.add_argument("--seconds", type=float, default=10.0, help="time budget of the run (default 10)")
    parser.add_argument("--memory", default=None, help="memory limit, e.g. 2GiB (default: the task's estimate)")
    parser.add_argument("--work-dir", default=None, help="the task's work directory (default: a temporary one)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.set_defaults(func=run)


def render(report: StandaloneReport) -> str:
    """The human-readable report."""
    status = "finished" if report.finished else "time limit reached"
    arguments = ", ".join(f"{k}={v!r}" for k, v in report.args.items()) or "(none)"
    memory = ("resident-set growth after the task was constructed, as a worker's cap counts it"
              if report.memory_measure == "rss_growth"
              else "as the GPU counts it: context + allocator; a cap of this size holds")
    ran = f"{report.steps} steps"
    throughput = f"{format_rate(report.steps_per_s)} steps/s"
    if report.progress_unit != "steps":  # a unit of its own: both, or "200 steps, 200 steps"
        ran += f", {report.progress:g} {report.progress_unit}"
        throughput = f"{format_rate(report.progress_per_s)} {report.progress_unit}/s, " + throughput
    return "\n".join([
        f"task        {report.target} on {report.device} ({status})",
        f"arguments   {arguments}",
        f"setup       {format_ms(report.setup_s * 1000)}",
        f"ran         {ran} in {report.elapsed_s:.2f} s",
        f"throughput  {throughput}",
        f"step time   p50 {format_ms(report.step_ms_p50)}, p90 {format_ms(report.step_ms_p90)}, "
        f"p99 {format_ms(report.step_ms_p99)}",
        f"peak memory {format_size(report.peak_memory_bytes)} ({memory}; "
        f"limit {format_size(report.memory_limit_bytes)})",
        *([f"warning     {busy_core_warning(report)}"] if report.core_was_busy else []),
    ])  # fmt: skip


def busy_core_warning(report: StandaloneReport) -> str:
    return (f"other processes took {100 * (report.core_busy_share or 0):.0f}% of {report.device} during the run; "
            "a worker runs at nice 19 and yields to them, so these step times are longer than on an idle core "
            "(measure on an idle one, --device cpu:N, to size steps)")


def run(args: argparse.Namespace) -> int:
    check_target_syntax(args.target)
    task_args = parse_task_args(args.arg, args.args_json)
    limit = parse_size(args.memory, "--memory") if args.memory is not None else None
    if limit is not None:
        check_memory(limit)  # as submit does: a cap no worker can run in, refused before the import
    with TaskCode():  # the task's prints go to stderr, away from the report (and its JSON)
        report = run_standalone(
            args.target,
            task_args,
            args.device,
            args.seconds,
            limit,
            Path(args.work_dir) if args.work_dir else None,
            prepare_device=True,
            search_path=os.getcwd(),
        )
    if args.json and report.core_was_busy:
        print(f"freeride run-task: warning: {busy_core_warning(report)}", file=sys.stderr)
    print(report.to_json() if args.json else render(report), file=sys.stdout)
    return 0
