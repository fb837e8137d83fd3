"""``freeride bench``: what freeride costs and saves on your own training job.

    freeride bench [--devices auto] --task side_tasks.graphs:PageRank --arg graph=/data/web.mtx \\
        --memory 2GiB [--task ...] -- torchrun --nproc-per-node 4 train.py

The command runs again and again, in **paired, interleaved trials**: each trial runs it alone (no
manager), with a manager per device and no side task, and with the managers running the side tasks,
in a fresh random order (``freeride._cli.bench_figures``). Before its runs, each trial measures every
side task alone on the job's first device: the yardstick of its work. Trials are added until the 95%
intervals of both overheads are within ``--target-pp`` percentage points, or ``--max-trials`` or
``--budget-min`` is reached (``freeride.measure``'s stopping rule, the research bench's too); the
report then says which. One warm-up run alone (``--warmup-runs``) goes first and is not counted.

**Devices** are ``freeride launch``'s (``--devices auto``: from torchrun's ``--nproc-per-node``,
Slurm, ``$CUDA_VISIBLE_DEVICES`` or the visible GPUs; see :func:`freeride._cli.launch.local_devices`).
Every task is submitted to every device. **How the job reaches the managers**, and what a run does,
is in :mod:`freeride._cli.bench_runs`: the job must report to its devices' default endpoints.

**Tasks** are given as ``freeride submit`` takes them: ``--task MODULE:CLASS`` starts one, and the
options after it (``--arg``, ``--args-json``, ``--memory``, ``--name``, ``--priority``,
``--step-time-hint-ms``, ``--checkpoint-interval-s``) up to the next ``--task`` are its own; or
``--tasks-file FILE``, one task a line in the same words (``#`` starts a comment). Each is checked as
``freeride submit`` checks it, before anything runs.

**Failures.** A command that exits non-zero or outlives ``--run-timeout-s`` (default: three times the
longest run so far plus a minute, an hour for the first) ends the bench with exit 1 and the tail of
its output; so does a side task that fails, with its failure record, and a job whose managers saw no
bubble. Ctrl-C is forwarded to the running command, and the bench then prints what the complete
trials measured and exits 130. The run directories (logs, manager state) are kept where ``--keep``
says, or when something failed.

Needs the ``[bench]`` extra (SciPy, for the intervals).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import shlex
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from freeride._cli import tasks as task_commands
from freeride._cli.bench_figures import (
    ALONE,
    TASKS,
    Run,
    overhead_intervals,
    render,
    summarize,
    trial_plan,
    watched_modes,
)
from freeride._cli.bench_runs import BenchFailed, BenchTask, Runner, job_env, private_runtime
from freeride._cli.launch import add_device_options, job_devices, remainder_command
from freeride._extras import require
from freeride.errors import ConfigError, RequestRejected
from freeride.measure import PRICE_RATIOS, StopRule, stop_decision

#: The options that belong to the ``--task`` before them (``freeride submit``'s own names), with their metavars.
TASK_OPTION_VALUES = {"--arg": "KEY=VALUE", "--args-json": "JSON", "--memory": "SIZE", "--name": "NAME",
                      "--priority": "N", "--step-time-hint-ms": "MS", "--checkpoint-interval-s": "S"}
TASK_OPTIONS = tuple(TASK_OPTION_VALUES)
FIRST_RUN_TIMEOUT_S = 3600.0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "bench",
        help="measure what freeride costs and saves on your training command (paired, interleaved trials)",
        description="Run COMMAND alone, with managers, and with managers and side tasks, in paired interleaved "
        "trials; report the training overhead with its interval, the bubbles, the harvest and the saving.",
    )
    add_device_options(p)
    p.add_argument("--task", dest="task_words", action=_TaskAction, metavar="MODULE:CLASS",
                   help="a side task for every device; the options after it up to the next --task are its own")
    for option, metavar in TASK_OPTION_VALUES.items():
        p.add_argument(option, dest="task_words", action=_TaskAction, metavar=metavar,
                       help=f"freeride submit's {option}, for the --task before it")
    p.add_argument("--tasks-file", default=None, metavar="FILE",
                   help="side tasks, one a line in freeride submit's words (MODULE:CLASS --arg k=v --memory 2GiB)")
    p.add_argument("--min-trials", type=int, default=3, help="trials always run (default 3)")
    p.add_argument("--max-trials", type=int, default=10, help="trials never exceeded (default 10)")
    p.add_argument("--budget-min", type=float, default=60.0,
                   help="wall time the trials may take; no trial starts that would end past it (default 60)")
    p.add_argument("--target-pp", type=float, default=1.0,
                   help="stop once both overheads' 95%% intervals are within +- this many percentage points")
    p.add_argument("--warmup-runs", type=int, default=1, help="runs alone before the trials, not counted (default 1)")
    p.add_argument("--standalone-s", type=float, default=5.0,
                   help="seconds each side task runs alone per trial, for its yardstick (default 5)")
    p.add_argument("--run-timeout-s", type=float, default=None,
                   help="stop a run that takes longer (default: 3 x the longest run so far + 60 s; 1 h at first)")
    p.add_argument("--price-ratios", default=",".join(f"{r:g}" for r in PRICE_RATIOS),
                   help="price ratios of the saving (default %(default)s; see the README's What it saves)")
    p.add_argument("--ready-timeout-s", type=float, default=60.0,
                   help="how long the managers may take to serve and the side tasks to start, each run (default 60)")
    p.add_argument("--seed", type=int, default=0, help="seeds the order of the runs in each trial")
    p.add_argument("--manager-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for every manager (repeatable), e.g. --manager-arg=--grace-ms=1")
    p.add_argument("--keep", default=None, metavar="DIR",
                   help="keep every run's logs and manager state, in a new directory under DIR")
    p.add_argument("--out", default=None, metavar="FILE", help="write every run and the summary as JSON to FILE")
    p.add_argument("--json", action="store_true", help="print the summary as JSON instead of the report")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then your training command and its arguments")
    p.set_defaults(func=run, task_words=None)


class _TaskAction(argparse.Action):
    """``--task`` starts a task's word list; the task options append to the latest one."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        words: list[list[str]] = list(getattr(namespace, self.dest) or [])
        if option_string == "--task":
            words.append([str(values)])
        elif not words:
            parser.error(f"{option_string} belongs to a side task: put it after a --task MODULE:CLASS")
        else:
            words[-1] = [*words[-1], f"{option_string}={values}"]
        setattr(namespace, self.dest, words)


class _RaisingParser(argparse.ArgumentParser):
    """``freeride submit``'s parser, with its errors as ConfigError (a task's words, not the bench's)."""

    def error(self, message: str) -> Any:
        raise ConfigError(message)


def require_extra() -> None:
    """MissingExtra (a ConfigError), in one line, when the ``[bench]`` extra (SciPy, for the intervals) is
    not installed."""
    require("bench", "freeride bench")


def task_word_lists(args: argparse.Namespace) -> list[list[str]]:
    """Every task's words: the command line's, then the tasks file's lines."""
    lists = [list(words) for words in (args.task_words or [])]
    if args.tasks_file:
        try:
            text = Path(args.tasks_file).read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read --tasks-file {args.tasks_file}: {exc.strerror}") from None
        for number, line in enumerate(text.splitlines(), 1):
            try:
                words = shlex.split(line, comments=True)
            except ValueError as exc:
                raise ConfigError(f"{args.tasks_file}:{number}: {exc}") from None
            for word in words[1:]:
                if word.startswith("-") and word.split("=", 1)[0] not in TASK_OPTIONS:
                    raise ConfigError(f"{args.tasks_file}:{number}: {word.split('=', 1)[0]} is not a task option here "
                                      f"(one of {', '.join(TASK_OPTIONS)})")
            if words:
                lists.append(words)
    return lists


def parse_tasks(word_lists: Sequence[Sequence[str]]) -> tuple[BenchTask, ...]:
    """Each task checked as ``freeride submit`` checks it, with a unique name (the class's, lower case,
    unless ``--name`` gives one; ``-2``, ``-3`` ... on repeats)."""
    parser = _RaisingParser(prog="freeride bench --task", add_help=False)
    task_commands.register(parser.add_subparsers(dest="subcommand"))
    out: list[BenchTask] = []
    for words in word_lists:
        if not words or words[0].startswith("-"):
            raise ConfigError(f"a side task starts with MODULE:CLASS, got {' '.join(words) or 'nothing'}")
        try:
            ns = parser.parse_args(["submit", *words])
            spec = task_commands.build_spec(ns)
        except (ConfigError, RequestRejected) as exc:  # RequestRejected: a cap no worker can run in
            raise ConfigError(f"side task {words[0]}: {exc}") from None
        base = spec.name or words[0].rpartition(":")[2].lower()
        name, n = base, 1
        while any(t.name == name for t in out):
            n += 1
            name = f"{base}-{n}"
        out.append(BenchTask(name, dataclasses.replace(spec, name=name)))
    return tuple(out)


def parse_ratios(text: str) -> tuple[float, ...]:
    try:
        ratios = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"--price-ratios takes numbers like 1,5.5,22, got {text!r}") from None
    if not ratios or any(not r > 0 or r == float("inf") for r in ratios):
        raise ConfigError(f"--price-ratios must be numbers > 0, got {text!r}")
    return ratios


def run_timeout(explicit: float | None, runs: Sequence[Run]) -> float:
    """A run's time limit: the one given, else 3 x the longest run so far + 60 s, else an hour."""
    if explicit is not None:
        return explicit
    longest = max((r.wall_s for r in runs), default=None)
    return FIRST_RUN_TIMEOUT_S if longest is None else 3 * longest + 60.0


def _check_numbers(args: argparse.Namespace) -> StopRule:
    if args.warmup_runs < 0:
        raise ConfigError(f"--warmup-runs must be >= 0, got {args.warmup_runs}")
    if not args.standalone_s > 0:
        raise ConfigError(f"--standalone-s must be > 0, got {args.standalone_s}")
    if args.run_timeout_s is not None and not args.run_timeout_s > 0:
        raise ConfigError(f"--run-timeout-s must be > 0, got {args.run_timeout_s}")
    # In the options' own units: StopRule's words are a fraction and seconds ("-0.01" for --target-pp -1).
    for flag, value in (("--target-pp", args.target_pp), ("--budget-min", args.budget_min)):
        if not 0 < value < float("inf"):
            raise ConfigError(f"{flag} must be a positive number, got {value:g}")
    try:
        return StopRule(args.target_pp / 100, args.min_trials, args.max_trials, args.budget_min * 60)
    except ValueError as exc:
        raise ConfigError(f"bad trial settings: {exc}".replace("min_trials", "--min-trials")
                          .replace("max_trials", "--max-trials")) from None


def _say(text: str) -> None:
    print(f"freeride bench: {text}", file=sys.stderr, flush=True)


def _run_line(run: Run) -> str:
    what = "warm-up" if run.trial < 0 else f"trial {run.trial}"
    line = f"{what} {run.mode:8s} {run.wall_s:8.2f} s"
    if run.mode != ALONE:
        line += f", bubbles {run.bubble_s:.2f} s"
    if run.mode == TASKS and run.bubble_s > 0:
        line += f", harvested {run.harvested_s:.2f} s ({100 * run.harvested_s / run.bubble_s:.0f}%)"
    return line + (f" (load {run.loadavg:.2f})" if run.loadavg is not None else "")


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    command = remainder_command(args.command, "freeride bench --task MODULE:CLASS ... -- COMMAND [ARGS...]")
    require_extra()
    rule = _check_numbers(args)
    ratios = parse_ratios(args.price_ratios)
    found, source = job_devices(args.devices, args.device_kind, command)
    devices = tuple(found)
    _say(f"the job's devices: {', '.join(devices)} (from {source})")
    bench_tasks = parse_tasks(task_word_lists(args))
    runtime = private_runtime()
    keep = Path(args.keep) if args.keep else None
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
    # Always a fresh directory: a manager given an old run's state directory would resume its tasks.
    work_dir = Path(tempfile.mkdtemp(prefix="freeride-bench-", dir=keep))
    if not 0 < args.ready_timeout_s < float("inf"):
        raise ConfigError(f"--ready-timeout-s must be a positive number, got {args.ready_timeout_s}")
    runner = Runner(tuple(command), devices, job_env(os.environ, runtime), work_dir, bench_tasks,
                    tuple(args.manager_arg), ready_timeout_s=args.ready_timeout_s)
    command_text = shlex.join(command)
    modes = "alone, with managers" + (", with managers and side tasks" if bench_tasks else "")
    _say(f"each trial runs `{command_text}` {modes}, in a random order; {rule.min_trials} to {rule.max_trials} "
         f"trials, within {args.budget_min:g} min; logs under {work_dir}")
    runs: list[Run] = []
    rates: dict[int, dict[str, float]] = {}
    stop = "interrupted before the first trial ended"
    failed = interrupted = False
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)  # SIGTERM unwinds like Ctrl-C
    started = time.monotonic()

    def measure_alone(trial: int) -> None:
        rates[trial] = runner.standalone_rates(trial, args.standalone_s)
        alone = ", ".join(f"{name} {rate:.4g}/s" for name, rate in rates[trial].items())
        _say(f"trial {trial}: side tasks alone on {devices[0]}: {alone}")

    try:
        if bench_tasks:  # before the warm-up: a task that cannot run alone is said before any run (a stranger's
            measure_alone(0)  # task whose arguments broke its setup was found only after a warm-up run of the job)
        for _ in range(args.warmup_runs):
            warm = runner.run(-1, ALONE, run_timeout(args.run_timeout_s, runs))
            runs.append(warm)
            _say(_run_line(warm))
        rng = random.Random(args.seed)
        trial = 0
        trials_started = time.monotonic()
        while True:
            if bench_tasks and trial not in rates:
                measure_alone(trial)
            for mode in trial_plan(bool(bench_tasks), rng):
                result = runner.run(trial, mode, run_timeout(args.run_timeout_s, runs))
                runs.append(result)
                _say(_run_line(result))
                if mode != ALONE and not any(d.bubbles for d in result.devices):
                    raise BenchFailed("the managers saw no bubble from the command: is it instrumented, and does it "
                                      "report to its devices' default endpoints? (the bench points them at its own "
                                      "managers through $XDG_RUNTIME_DIR; an explicit endpoint in the job bypasses "
                                      f"them); its output is in {work_dir}")
            trial += 1
            decision = stop_decision(rule, overhead_intervals(runs, bool(bench_tasks)), trial,
                                     time.monotonic() - trials_started)
            stop = decision.reason
            _say(f"after trial {trial - 1}: {stop}")
            if decision.stop:
                break
    except KeyboardInterrupt:
        interrupted = True
        stop = "interrupted (Ctrl-C): the figures are those of the trials that ended before it"
    except BaseException:
        failed = True
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
        shutil.rmtree(runtime, ignore_errors=True)
        if keep is None and not failed:
            shutil.rmtree(work_dir, ignore_errors=True)
        elif failed:
            _say(f"logs and manager state kept in {work_dir}")
    summary = summarize(runs, rates, len(devices), ratios)
    loads = [r.loadavg for r in runs if r.loadavg is not None]
    meta = {"command": command, "command_text": command_text, "devices": list(devices),
            "tasks": [{"name": t.name, "target": t.spec.target, "args": t.spec.args,
                       "memory_bytes": t.spec.memory_bytes} for t in bench_tasks],
            "stop": stop, "interrupted": interrupted, "watched": list(watched_modes(bool(bench_tasks))),
            "loadavg": f"{min(loads):.2f} .. {max(loads):.2f}" if loads else "-",
            "wall_s": time.monotonic() - started, "price_ratios": list(ratios)}
    doc = {"meta": meta, "summary": summary, "runs": [r.to_json() for r in runs],
           "standalone_per_s": {str(k): v for k, v in rates.items()}}
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1))
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        print("\n".join(render(summary, meta)))
    return 130 if interrupted else 0
