"""What a resident side task costs the trainer where its steps fit few bubbles or none (2 CPU ranks).

A stranger's task of 2.2 ms steps beside an interleaved trainer's 0.03-0.8 ms waits ran two steps in 60
iterations, and those iterations took 27% longer than beside managers with no task: with a task resident, a
manager reads each of the trainer's events at once (a wake-up on a core that computes a rank) and decides on
it, where with none it reads them every ``loop.LAZY_READ_NS``. This bench runs one schedule of
``bench.bench_schedules`` (two gloo ranks, ``--virtual-stages 2``, one stage 3 ms slower per forward, one real
manager per core, as users run them: no trace) once per condition: no side task, and one task per device of
each ``spin:US`` given (busy steps of US microseconds), in rounds whose order alternates. Per run: the median
iteration time (the slower rank's, iteration by iteration), the managers' CPU (every thread, from the trainer's
first measured iteration to its last) per iteration, and what the tasks ran.

An A/B between two builds runs this file from each one's tree (``PYTHONPATH`` and the working directory at that
tree; the file itself may be copied into an older one), alternating, and compares the figures run by run: the
iteration times of a 2-core VM vary by 10-15% between runs; the managers' CPU varies much less.

Results: ``<out>/<name>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.bench_modes import _wait_resident, managers, two_stage_cpu  # noqa: E402
from bench.bench_schedules import SCHEDULES, side_task, trainer_argv, write_csv_order  # noqa: E402
from bench.machine import machine_info  # noqa: E402
from freeride._wire.client import ControlClient  # noqa: E402
from freeride.measure import median  # noqa: E402
from freeride.messages import TaskSpec  # noqa: E402

NONE = "none"


def managers_cpu_s() -> dict[str, float]:
    """Each running ``freeride manager``'s CPU so far (user + system, every thread), by its device."""
    out = {}
    for proc in psutil.process_iter(["cmdline"]):
        argv = proc.info["cmdline"] or []
        if "manager" in argv and "--device" in argv and any(a.endswith("freeride.cli") for a in argv):
            try:
                times = proc.cpu_times()
            except psutil.Error:
                continue
            out[argv[argv.index("--device") + 1]] = times.user + times.system
    return out


class CpuSampler:
    """The managers' CPU (:func:`managers_cpu_s`), read every ``every_s`` on a thread with the monotonic clock
    (the trainer's iteration log's clock), so that a window of iterations can be cut out of it afterwards."""

    def __init__(self, every_s: float = 0.1) -> None:
        self.samples: list[tuple[int, dict[str, float]]] = []
        self._every_s = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            self.samples.append((time.monotonic_ns(), managers_cpu_s()))
            if self._stop.wait(self._every_s):
                self.samples.append((time.monotonic_ns(), managers_cpu_s()))
                return

    def between(self, start_ns: int, end_ns: int) -> dict[str, float]:
        """Each device's manager CPU seconds from the last sample at or before ``start_ns`` to the first at or
        after ``end_ns`` (a window up to one sampling interval wider at each side)."""
        before = [s for t, s in self.samples if t <= start_ns] or [self.samples[0][1]]
        after = [s for t, s in self.samples if t >= end_ns] or [self.samples[-1][1]]
        first, last = before[-1], after[0]
        return {dev: last[dev] - first.get(dev, 0.0) for dev in last}


def run_once(schedule: str, condition: str, args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    """One trainer run beside one manager per device, with ``condition``'s task on each (or none)."""
    run_dir.mkdir(parents=True)
    layout = two_stage_cpu(sorted(os.sched_getaffinity(0)))
    sock_dir = Path(tempfile.mkdtemp(prefix="frs-", dir="/tmp"))
    log = run_dir / "it.jsonl"
    csv_path = run_dir / "order.csv"
    write_csv_order(csv_path, args.microbatches)
    tasks: dict[str, dict[str, Any]] = {}
    try:
        with managers(layout, run_dir, sock_dir, "freeride", None, trace=False) as endpoints:
            ids: dict[str, str] = {}
            if condition != NONE:
                spec = side_task(condition)
                for dev, ep in endpoints.items():
                    with ControlClient(ep) as client:
                        info = client.submit(TaskSpec(target=spec["target"], args=spec["args"], name=spec["name"],
                                                      memory_bytes=spec["memory_bytes"], working_dir=str(REPO)))
                        ids[dev] = info.task_id
                        _wait_resident(client, [info.task_id], timeout_s=600)
            argv = trainer_argv(schedule, args, log, f"unix:{sock_dir}/{{slug}}.sock", csv_path)
            env = dict(os.environ, OMP_NUM_THREADS="1", FREERIDE_LOG_LEVEL="WARNING",
                       PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
            with CpuSampler() as sampler, (run_dir / "trainer.log").open("wb") as out:
                code = subprocess.call(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=1800)
            if code != 0:
                raise SystemExit(f"{schedule}: the trainer failed ({code}); see {run_dir / 'trainer.log'}")
            for dev, ep in endpoints.items():
                tasks[dev] = {}
                if dev in ids:
                    with ControlClient(ep) as client:
                        info = client.get(ids[dev])
                    tasks[dev].update(steps=info.steps, harvested_s=info.harvested_s, state=info.state)
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)
    ranks = []
    window = (2**63, 0)
    for path in layout.rank_logs(log):
        records = [json.loads(line) for line in path.read_text().splitlines()]
        its = [r for r in records if not r.get("summary") and not r["warmup"]]
        ranks.append([r["time_ms"] for r in its])
        window = (min(window[0], int(its[0]["end_ns"] - its[0]["time_ms"] * 1e6)), max(window[1], its[-1]["end_ns"]))
    slower = [max(times) for times in zip(*ranks, strict=True)]
    for dev, cpu_s in sampler.between(*window).items():
        tasks.setdefault(dev, {})["cpu_s"] = cpu_s
    return {"schedule": schedule, "condition": condition, "iteration_ms_p50": median(slower),
            "iterations": len(slower), "devices": tasks,
            "managers_cpu_ms_per_iteration": sum(d["cpu_s"] for d in tasks.values()) * 1e3 / len(slower),
            "loadavg_after": os.getloadavg()}


def report(doc: dict[str, Any]) -> str:
    cfg = doc["config"]
    lines = [
        "# What a resident side task costs where its steps fit few bubbles (2 CPU ranks)",
        "",
        f"`{doc['command']}` on {doc['machine']['cpu']} ({len(os.sched_getaffinity(0))} cores), "
        f"{cfg['schedule']}, {cfg['iterations']} iterations ({cfg['warmup']} warm-up), {cfg['microbatches']} "
        f"micro-batches, stage 1 {cfg['slow_ms']} ms slower per forward; one manager per core, no trace; "
        "rounds alternate the conditions' order.",
        "",
        "| round | condition | iteration p50 ms | vs no task, same round | managers' CPU ms/it "
        "| task steps (dev 0 / 1) "
        "| harvested s (dev 0 / 1) |",
        "|---|---|---|---|---|---|---|",
    ]
    for rnd in doc["rounds"]:
        base = next((r["iteration_ms_p50"] for r in rnd["runs"] if r["condition"] == NONE), None)
        for run in rnd["runs"]:
            devs = list(run["devices"].values())
            ratio = f"{run['iteration_ms_p50'] / base - 1:+.1%}" if base and run["condition"] != NONE else ""
            steps = " / ".join(str(d.get("steps", "")) for d in devs) if run["condition"] != NONE else ""
            harvested = (" / ".join(f"{d.get('harvested_s', 0):.3f}" for d in devs)
                         if run["condition"] != NONE else "")
            lines.append(f"| {rnd['round']} | {run['condition']} | {run['iteration_ms_p50']:.1f} | {ratio} | "
                         f"{run['managers_cpu_ms_per_iteration']:.2f} | {steps} | {harvested} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bench_resident_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--schedule", default="interleaved-zb", choices=SCHEDULES)
    p.add_argument("--conditions", default="none,spin:2500,spin:15000",
                   help="comma-separated: none (no side task) or spin:US (a task of US-microsecond steps per device)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iterations", type=int, default=100)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--slow-ms", type=float, default=3.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "cpu")
    p.add_argument("--results-name", default="resident_cost", help="results go to <out>/<name>.json and .md")
    args = p.parse_args(argv)
    conditions = [c.strip() for c in args.conditions.split(",") if c.strip()]
    for condition in conditions:
        if condition != NONE:
            try:
                side_task(condition)
            except ValueError as exc:
                p.error(str(exc))
    if args.rounds < 1 or args.iterations <= args.warmup:
        p.error("give --rounds >= 1 and --iterations > --warmup")
    work = Path(tempfile.mkdtemp(prefix="bench-resident-"))
    command = "python -m bench.bench_resident_cost" + "".join(
        f" --{k.replace('_', '-')} {getattr(args, k)}" for k in ("schedule", "conditions", "rounds", "iterations")
        if getattr(args, k) != p.get_default(k))
    doc: dict[str, Any] = {"command": command, "config": {k: str(v) if isinstance(v, Path) else v
                                                         for k, v in vars(args).items()},
                           "machine": machine_info(), "rounds": [], "work_dir": str(work)}
    args.out.mkdir(parents=True, exist_ok=True)
    for rnd in range(1, args.rounds + 1):
        order = conditions if rnd % 2 else conditions[::-1]
        runs = []
        for condition in order:
            print(f"[bench_resident_cost] round {rnd}: {condition} ...", flush=True)
            runs.append(run_once(args.schedule, condition, args, work / f"{rnd}-{condition.replace(':', '-')}"))
            time.sleep(1)  # the managers' and workers' exits settle
        doc["rounds"].append({"round": rnd, "runs": runs})
        (args.out / f"{args.results_name}.json").write_text(json.dumps(doc, indent=1))
        (args.out / f"{args.results_name}.md").write_text(report(doc))
    print((args.out / f"{args.results_name}.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
