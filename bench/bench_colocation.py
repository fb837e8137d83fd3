"""What sharing two CPU cores with freeride costs the training: the same pipeline, mode against mode.

    python -m bench.bench_colocation                                  # deepspeed and 1f1b, 2 rounds
    python -m bench.bench_colocation --schedules deepspeed --rounds 3 --side-task spin:30

A stranger's DeepSpeed job on the 2-core VM ran 17-29% slower with one side task on its slower stage's core,
whose bubbles were 0.7 ms, while ``bench.bench_schedules`` measures bubbles, harvest and overruns, never the
training's own time against a run without freeride. Here each schedule (or framework) of
``bench.bench_schedules`` runs, under ``torchrun`` on two cores as there, in every mode of a round, the modes in a
fresh random order each round:

``none``
    the trainer alone (no reporter, no manager);
``managers``
    reporting to a manager per core, no side task;
``task-cpu:0``, ``task-cpu:1``
    a side task on that core's manager only;
``tasks``
    one on each.

Per run: the median training iteration after the warm-up (rank 0's log; the ranks keep one pace), and its overhead
against the round's ``none``; per device, the bubbles and events its manager saw, the share of its bubble time the
side task harvested (the manager's own ``stats``: worked time over bubble time) and the manager's CPU time per
iteration while the trainer ran (user + system, every thread, from ``/proc``): on two cores every millisecond of
it comes out of a rank's core. The managers run as users run them, without ``--trace`` (writing the trace took about
a seventh of a manager's CPU per bubble; the runs before this was so had it on).

Results: ``<out>/<name>.json`` and ``<name>.md`` (default ``colocation``), with the machine and the load.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.bench_modes import _wait_resident, managers, two_stage_cpu  # noqa: E402
from bench.bench_schedules import (  # noqa: E402
    FRAMEWORKS,
    SCHEDULES,
    side_task,
    side_task_option,
    trainer_argv,
    write_csv_order,
)
from bench.machine import machine_info  # noqa: E402
from freeride._wire.client import ControlClient  # noqa: E402
from freeride.measure import median  # noqa: E402
from freeride.messages import TaskSpec  # noqa: E402

MODES = ("none", "managers", "task-cpu:0", "task-cpu:1", "tasks")


def _task_devices(mode: str, devices: Sequence[str]) -> list[str]:
    """The devices whose manager gets a side task in ``mode`` (``task-cpu:K`` names the K-th core of the layout)."""
    if mode == "tasks":
        return list(devices)
    if mode.startswith("task-cpu:"):
        return [devices[int(mode.rsplit(":", 1)[1])]]
    return []


def _manager_cpu_s(socket_path: str) -> float:
    """CPU seconds (user + system, all threads) of the manager serving ``socket_path``; 0 if it is not found."""
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info.get("cmdline") or []
        if "manager" in cmdline and f"unix:{socket_path}" in cmdline:
            times = proc.cpu_times()
            return float(times.user + times.system)
    return 0.0


def _iteration_ms(log: Path) -> tuple[float, int]:
    """Rank 0's median iteration after the warm-up, and how many it timed."""
    records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    its = [r["time_ms"] for r in records if not r.get("summary") and not r.get("warmup")]
    return (median(its) if its else 0.0), len(its)


def run_mode(name: str, mode: str, args: argparse.Namespace, run_dir: Path, csv_path: Path) -> dict[str, Any]:
    """One run of schedule ``name`` in ``mode``: its median iteration and, with managers, what they saw and cost."""
    run_dir.mkdir(parents=True, exist_ok=True)
    layout = two_stage_cpu(sorted(os.sched_getaffinity(0)))
    log = run_dir / "it.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1", FREERIDE_LOG_LEVEL="WARNING",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    load_before = os.getloadavg()

    def train(endpoint_template: str) -> float:
        argv = trainer_argv(name, args, log, endpoint_template, csv_path)
        t0 = time.monotonic()
        with (run_dir / "trainer.log").open("wb") as out:
            code = subprocess.call(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=3600)
        if code != 0:
            raise RuntimeError(f"{name} {mode}: the trainer failed ({code}); see {run_dir / 'trainer.log'}")
        return time.monotonic() - t0

    devices: dict[str, Any] = {}
    if mode == "none":
        wall_s = train("")
    else:
        sock_dir = Path(tempfile.mkdtemp(prefix="frc-", dir="/tmp"))
        try:
            with managers(layout, run_dir, sock_dir, "freeride", None, args.manager_arg, trace=False) as endpoints:
                task = side_task(args.side_task)
                for dev in _task_devices(mode, layout.devices):
                    with ControlClient(endpoints[dev]) as client:
                        info = client.submit(TaskSpec(target=task["target"], args=task["args"],
                                                      memory_bytes=task["memory_bytes"], name=task["name"],
                                                      working_dir=str(REPO)))
                        _wait_resident(client, [info.task_id], timeout_s=900)
                cpu_before = {dev: _manager_cpu_s(ep.address) for dev, ep in endpoints.items()}
                wall_s = train(f"unix:{sock_dir}/{{slug}}.sock")
                time.sleep(0.3)  # the last ends and parks reach the managers
                for dev, ep in endpoints.items():
                    with ControlClient(ep) as client:
                        stats = client.stats()
                    devices[dev] = {
                        "side_task": dev in _task_devices(mode, layout.devices),
                        "bubbles": stats.bubbles, "bubble_time_s": stats.bubble_time_s,
                        "harvested_s": stats.harvested_s, "events": stats.events_received,
                        "manager_cpu_s": _manager_cpu_s(ep.address) - cpu_before[dev],
                    }
        finally:
            shutil.rmtree(sock_dir, ignore_errors=True)
    iteration_ms, iterations = _iteration_ms(layout.rank_logs(log)[0])
    for dev in devices.values():
        dev["manager_cpu_ms_per_iteration"] = 1000 * dev["manager_cpu_s"] / max(1, args.iterations + args.warmup)
        dev["bubbles_per_iteration"] = dev["bubbles"] / max(1, args.iterations + args.warmup)
        dev["harvest"] = dev["harvested_s"] / dev["bubble_time_s"] if dev["bubble_time_s"] > 0 else None
    return {"schedule": name, "mode": mode, "iteration_ms_p50": iteration_ms, "iterations": iterations,
            "wall_s": wall_s, "devices": devices, "loadavg_before": load_before, "loadavg_after": os.getloadavg()}


def overheads(runs: list[dict[str, Any]]) -> dict[tuple[str, str], list[float]]:
    """Per (schedule, mode), each round's median iteration over that round's ``none`` run, less 1."""
    base = {(r["schedule"], r["round"]): r["iteration_ms_p50"] for r in runs if r["mode"] == "none"}
    out: dict[tuple[str, str], list[float]] = {}
    for r in runs:
        ref = base.get((r["schedule"], r["round"]))
        if ref and r["mode"] != "none":
            out.setdefault((r["schedule"], r["mode"]), []).append(r["iteration_ms_p50"] / ref - 1)
    return out


def write_markdown(doc: dict[str, Any], path: Path) -> None:
    runs = doc["runs"]
    over = overheads(runs)
    m = doc["machine"]
    lines = [
        "# What sharing the cores with freeride costs the training (2 CPU ranks)", "",
        f"`{doc['command']}` on {m.get('cpu', '?')} ({m.get('cores', '?')} cores), "
        f"torch {m.get('versions', {}).get('torch', '?')}; "
        f"{doc['config']['iterations']} iterations ({doc['config']['warmup']} warm-up), "
        f"{doc['config']['microbatches']} micro-batches, model stage 1 {doc['config']['slow_ms']} ms slower per "
        f"forward; side task `{doc['config']['side_task']}`; the modes of each round in a random order "
        "(`bench/bench_colocation.py`). Load average (1 min) before/after each run in the last column.", "",
        "| schedule | mode | iteration ms per round | overhead per round | harvest cpu:0 / cpu:1 | "
        "bubbles/it cpu:0 / cpu:1 | manager CPU ms/it cpu:0 / cpu:1 | load |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for schedule in dict.fromkeys(r["schedule"] for r in runs):
        for mode in MODES:
            mine = sorted((r for r in runs if r["schedule"] == schedule and r["mode"] == mode),
                          key=lambda r: r["round"])
            if not mine:
                continue
            its = " / ".join(f"{r['iteration_ms_p50']:.1f}" for r in mine)
            ov = " / ".join(f"{100 * o:+.1f}%" for o in over.get((schedule, mode), [])) or "-"

            def per_device(key: str, fmt: str, rs: list[dict[str, Any]] = mine) -> str:
                cells = []
                for r in rs:
                    vals = [r["devices"][d].get(key) for d in sorted(r["devices"])]
                    cells.append(" / ".join("-" if v is None else fmt.format(v) for v in vals) or "-")
                return "; ".join(cells)

            seen = any(r["devices"] for r in mine)
            harvest = per_device("harvest", "{:.0%}") if seen else "-"
            bubbles = per_device("bubbles_per_iteration", "{:.1f}") if seen else "-"
            cpu = per_device("manager_cpu_ms_per_iteration", "{:.2f}") if seen else "-"
            load = "; ".join(f"{r['loadavg_before'][0]:.1f} / {r['loadavg_after'][0]:.1f}" for r in mine)
            lines.append(f"| {schedule} | {mode} | {its} | {ov} | {harvest} | {bubbles} | {cpu} | {load} |")
    lines += ["", "Overhead: the run's median iteration over its round's `none` run, less 1. Harvest: the manager's "
              "harvested time over its bubble time (`freeride stats`). Manager CPU: user + system of every thread "
              "while the trainer ran (with its start-up and the warm-up), per iteration; the managers write no "
              "trace.", ""]
    path.write_text("\n".join(lines))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bench_colocation", description=__doc__.split("\n\n")[0])
    choices = (*SCHEDULES, *FRAMEWORKS)
    p.add_argument("--schedules", default="deepspeed,1f1b", help="comma-separated, of: " + ", ".join(choices))
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated, of: " + ", ".join(MODES))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--iterations", type=int, default=150)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--slow-ms", type=float, default=3.0)
    p.add_argument("--seed", type=int, default=0)
    side_task_option(p, "spin:200")
    p.add_argument("--manager-arg", action="append", default=[], metavar="ARG",
                   help="one more option for every manager (repeat it)")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "cpu")
    p.add_argument("--results-name", default="colocation", help="results go to <out>/<name>.json and .md")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.schedules.split(",") if n.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = sorted(set(names) - set(choices)) + sorted(set(modes) - set(MODES))
    if unknown:
        p.error(f"unknown schedule(s) or mode(s): {', '.join(unknown)}")
    if "none" not in modes:
        p.error("the modes must include none: every overhead is against it")
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    work = Path(tempfile.mkdtemp(prefix="bench-colocation-"))
    csv_path = work / "megatron-interleaved.csv"
    write_csv_order(csv_path, args.microbatches)
    command = "python -m bench.bench_colocation" + "".join(
        f" {flag} {value}" for flag, value, default in (
            ("--schedules", ",".join(names), "deepspeed,1f1b"), ("--modes", ",".join(modes), ",".join(MODES)),
            ("--rounds", str(args.rounds), "2"), ("--side-task", args.side_task, "spin:200"),
            ("--results-name", args.results_name, "colocation")) if value != default)
    command += "".join(f" --manager-arg={arg}" for arg in args.manager_arg)
    doc: dict[str, Any] = {"command": command,
                           "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                           "machine": machine_info(), "runs": [], "failed": [], "work_dir": str(work)}
    args.out.mkdir(parents=True, exist_ok=True)
    for name in names:
        for round_ in range(args.rounds):
            order = random.sample(modes, len(modes))
            for mode in order:
                print(f"[bench_colocation] {name} round {round_ + 1}: {mode} ...", flush=True)
                try:
                    run = run_mode(name, mode, args, work / name / f"{round_}-{mode.replace(':', '-')}", csv_path)
                except (RuntimeError, SystemExit, subprocess.TimeoutExpired, OSError) as exc:
                    print(f"[bench_colocation] {name} {mode} failed: {exc}", flush=True)
                    doc["failed"].append({"schedule": name, "mode": mode, "round": round_, "error": str(exc)})
                    continue
                run["round"] = round_
                doc["runs"].append(run)
                (args.out / f"{args.results_name}.json").write_text(json.dumps(doc, indent=2) + "\n")
                write_markdown(doc, args.out / f"{args.results_name}.md")
    print((args.out / f"{args.results_name}.md").read_text() if doc["runs"] else "nothing ran")
    return 0 if not doc["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
