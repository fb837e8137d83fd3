"""The comparison of DESIGN section 6: one trainer config, five modes, trials interleaved.

Modes, run in a fresh random order inside every trial, on the reference 2-stage 1F1B trainer
(``cpu:0``/``cpu:1``, gloo; one stage per core):

* ``none``: the trainer alone (T_base of its trial).
* ``instrumented``: reporting on, one manager per device, no side tasks.
* ``naive``: the side tasks run unmanaged beside the trainer, pinned to the stages' cores at the
  trainer's priority (``bench/naive_runner.py``): the co-location baseline.
* ``freeride-paper``: our managers with the reference system's policy (``--policy paper``, its
  offline profile made by a profiling run before the trials: the minimum length of each
  (stage, slot) bubble).
* ``freeride``: our managers and policy.

``none`` and ``instrumented`` run once per trial; the other three once per task set per trial. A
task set is one side task alone (one instance per device) or the mix (all of them on each device).

Figures (``freeride.measure`` holds the arithmetic): overhead = T_mode / T_none - 1 of the same
trial (T = mean iteration time after warm-up, both ranks); bubble time B from the managers (every
bubble of the run); harvest efficiency H = (sum over tasks of progress / standalone throughput)
/ B, the standalone throughputs measured on this machine at the start of each trial; overruns past
the real bubble ends from the managers' traces (one value per granted bubble, zeros included);
grant and park latencies from the managers; cost saving at the price ratios of
``freeride.measure.PRICE_RATIOS``. ``naive`` has no managers: its H divides by the B of the
``instrumented`` run of the same trial.

Run: ``python -m bench.bench_modes [--trials 3] [--iterations 40] [--out bench/results/cpu]``.
Results: ``modes.json`` (every run, raw), ``modes.md`` and PNG figures in ``--out``.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.machine import machine_info
from freeride._demo.plan import plan_tasks
from freeride._manager.trace import read_trace
from freeride._wire.client import ControlClient, health_status
from freeride.endpoints import Endpoint
from freeride.errors import ManagerUnavailable
from freeride.measure import PRICE_RATIOS, CostInputs, cost_saving, overhead, percentile, t_interval
from freeride.messages import TaskSpec

REPO = Path(__file__).resolve().parents[1]
MODES = ("none", "instrumented", "naive", "freeride-paper", "freeride")
#: The devices of the trainer's stages; ``--single-stage DEVICE`` makes it that one device.
DEVICES: tuple[str, ...] = ("cpu:0", "cpu:1")
#: ``--single-stage``: (stage index, stages, microbatches) of the one real stage.
SINGLE_STAGE: tuple[int, int, int] | None = None
MiB = 2**20


@dataclass(frozen=True)
class SideTaskConfig:
    name: str
    target: str
    args: dict[str, Any]
    memory_bytes: int


def _demo_sized(name: str, target: str) -> SideTaskConfig:
    plan = {t.target: t for t in plan_tasks("cpu")}[target]
    return SideTaskConfig(name, target, dict(plan.args), plan.memory_bytes)


#: The three kinds of side task, sized as in the demo (``freeride._demo.plan``) for CPU bubbles of
#: tens of milliseconds: steps of a few milliseconds on one core.
TASKS: dict[str, SideTaskConfig] = {
    "pagerank": _demo_sized("pagerank", "side_tasks.graphs:PageRank"),
    "image": _demo_sized("image", "side_tasks.images:ImageWatermark"),
    "training": _demo_sized("training", "side_tasks.training:LSTMLanguageModelTraining"),
}
TASK_SETS: dict[str, tuple[str, ...]] = {"pagerank": ("pagerank",), "image": ("image",),
                                         "training": ("training",), "mix": ("pagerank", "image", "training")}


@dataclass
class RunResult:
    mode: str
    task_set: str
    trial: int
    iteration_ms: float
    iterations: int
    stage_bubble_fraction: list[float] = field(default_factory=list)
    bubble_s: float = 0.0
    harvested_s: float = 0.0
    work_s: float = 0.0
    progress: dict[str, float] = field(default_factory=dict)
    overruns_ms: list[float] = field(default_factory=list)
    grant_latency_ms: dict[str, float] = field(default_factory=dict)
    park_latency_ms: dict[str, float] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    wall_s: float = 0.0


# ---------------------------------------------------------------- processes


@contextmanager
def managers(run_dir: Path, sock_dir: Path, policy: str, profile: Path | None) -> Iterator[dict[str, Endpoint]]:
    """One real manager daemon per device; SIGTERM (drain) on the way out."""
    procs: list[subprocess.Popen[bytes]] = []
    endpoints: dict[str, Endpoint] = {}
    try:
        for dev in DEVICES:
            slug = dev.replace(":", "-")
            sock = sock_dir / f"{slug}.sock"
            argv = [sys.executable, "-m", "freeride.cli", "manager", "--device", dev, "--endpoint", f"unix:{sock}",
                    "--state-dir", str(run_dir / f"state-{slug}"), "--trace", str(run_dir / f"trace-{slug}.jsonl")]
            if policy == "paper":
                argv += ["--policy", "paper"] + (["--paper-profile", str(profile)] if profile else [])
            log = (run_dir / f"manager-{slug}.log").open("wb")
            procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT))
            endpoints[dev] = Endpoint("unix", str(sock))
        for ep in endpoints.values():
            deadline = time.monotonic() + 60
            while True:
                try:
                    if health_status(ep, timeout_s=1) == "SERVING":
                        break
                except ManagerUnavailable:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"manager at {ep} did not start; see {run_dir}")
                time.sleep(0.1)
        yield endpoints
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def trainer_argv(iterations: int, warmup: int, log: Path, extra: list[str], endpoint_template: str | None) -> list[str]:
    if SINGLE_STAGE is not None:
        from freeride.workload.single_stage import single_stage_command

        index, stages, microbatches = SINGLE_STAGE
        endpoint = endpoint_template.replace("{slug}", DEVICES[0].replace(":", "-")) if endpoint_template else None
        return single_stage_command(DEVICES[0], index, stages, microbatches, iterations,
                                    log=log.with_name(f"{log.stem}.rank0{log.suffix}"), report=bool(endpoint),
                                    endpoint=endpoint, extra=["--warmup", str(warmup), *extra])
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "-m", "freeride.workload", "--stages", "2", "--schedule", "1f1b", "--iterations", str(iterations),
            "--warmup", str(warmup), "--iteration-log", str(log), *extra]
    if endpoint_template:
        argv += ["--report", "--endpoint-template", endpoint_template]
    return argv


def run_trainer(argv: list[str], run_dir: Path) -> float:
    t0 = time.monotonic()
    with (run_dir / "trainer.log").open("wb") as out:
        code = subprocess.call(argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if code != 0:
        raise RuntimeError(f"the trainer failed ({code}); see {run_dir / 'trainer.log'}")
    return time.monotonic() - t0


def read_iterations(log: Path) -> dict[int, list[dict[str, Any]]]:
    """Per rank, the iteration records after warm-up."""
    ranks: dict[int, list[dict[str, Any]]] = {}
    for rank in range(len(DEVICES)):
        path = log.with_name(f"{log.stem}.rank{rank}{log.suffix}")
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        ranks[rank] = [r for r in records if "iteration" in r and not r["warmup"]]
    return ranks


def standalone_rates(tasks: list[str], seconds: float, run_dir: Path) -> dict[str, float]:
    """Progress per second of each task with a core to itself, at the trainer's priority.

    The same runner as ``naive`` (pinned, not niced: a niced yardstick would measure the other
    processes of a shared machine as much as the task), timed from the end of ``setup``.
    """
    rates: dict[str, float] = {}
    for name in tasks:
        cfg = TASKS[name]
        ready, out = run_dir / f"standalone-{name}.ready", run_dir / f"standalone-{name}.json"
        ready.unlink(missing_ok=True)
        proc = subprocess.Popen(
            [sys.executable, "-m", "bench.naive_runner", "--target", cfg.target, "--args", json.dumps(cfg.args),
             "--device", DEVICES[-1], "--memory-bytes", str(cfg.memory_bytes), "--ready", str(ready),
             "--out", str(out)], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 120
            while not ready.exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"standalone run of {name} did not start")
                time.sleep(0.05)
            time.sleep(seconds)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
        report = json.loads(out.read_text())
        rates[name] = report["progress"] / report["elapsed_s"]
    return rates


def paper_profile(log: Path, out: Path) -> dict[str, int]:
    """The reference's offline profile: the minimum measured length of each (stage, slot) bubble."""
    mins: dict[tuple[int, int], int] = {}
    for records in read_iterations(log).values():
        for r in records:
            for b in r["bubbles"]:
                key = (int(r["stage"]), int(b["slot"]))
                length = int(b["length_ms"] * 1e6)
                if length > 0:
                    mins[key] = min(mins.get(key, length), length)
    out.write_text(json.dumps({"slots": [{"stage": s, "slot": k, "min_ns": v} for (s, k), v in sorted(mins.items())]}))
    return {f"{s}/{k}": v for (s, k), v in sorted(mins.items())}


# ---------------------------------------------------------------- one run


@dataclass
class WindowFigures:
    """What a manager's trace says about the measurement window (after the trainer's warm-up)."""

    bubble_s: float = 0.0
    harvested_s: float = 0.0
    steps: dict[str, int] = field(default_factory=dict)  # task id -> steps that started in the window
    overruns_ms: list[float] = field(default_factory=list)  # per granted bubble, zeros included


def window_figures(records: list[dict[str, Any]], start_ns: int, end_ns: int) -> WindowFigures:
    """Bubble time, harvested step time, steps per task and overruns of the bubbles in [start, end).

    A grant's steps count in the window when its first reported step starts inside it; its
    overrun is how far its last step ran past the real end of the bubble it started in.
    """
    fig = WindowFigures()
    bubbles = sorted((r["start_ns"], r) for r in records if r["ev"] == "bubble_start")
    ends = {(r["stage"], r["rank"], r["iteration"], r["slot"]): r["end_ns"] for r in records if r["ev"] == "bubble_end"}
    starts = [b for b, _ in bubbles]
    for b_start, b in bubbles:
        b_end = ends.get((b["stage"], b["rank"], b["iteration"], b["slot"]))
        if b_end is not None and start_ns <= b_start < end_ns:
            fig.bubble_s += max(0, b_end - b_start) / 1e9
    last_end: dict[int, int] = {}
    for r in records:
        if r["ev"] != "steps" or not r["spans"]:
            continue
        first = r["spans"][0][0]
        if not start_ns <= first < end_ns:
            continue
        fig.steps[r["task"]] = fig.steps.get(r["task"], 0) + int(r.get("count", len(r["spans"])))
        for span_start, span_end in r["spans"]:
            fig.harvested_s += (span_end - span_start) / 1e9
            i = bisect.bisect_right(starts, span_start) - 1
            if i >= 0:
                last_end[i] = max(last_end.get(i, 0), span_end)
    for i, end_of_steps in last_end.items():
        b = bubbles[i][1]
        real_end = ends.get((b["stage"], b["rank"], b["iteration"], b["slot"]))
        if real_end is not None:
            fig.overruns_ms.append(max(0, end_of_steps - real_end) / 1e6)
    return fig


def measurement_window(log: Path) -> tuple[int, int]:
    """From the end of the last warm-up iteration (latest rank) to the end of the run."""
    start = end = 0
    for rank in range(len(DEVICES)):
        path = log.with_name(f"{log.stem}.rank{rank}{log.suffix}")
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        its = [r for r in records if "iteration" in r]
        warm = [r["end_ns"] for r in its if r["warmup"]]
        start = max(start, max(warm) if warm else min(r["end_ns"] - int(r["time_ms"] * 1e6) for r in its))
        end = max(end, max(r["end_ns"] for r in its))
    return start, end


def run_once(mode: str, task_set: str, trial: int, args: argparse.Namespace, root: Path, profile: Path | None,
             rates: dict[str, float], instrumented_bubble_s: float | None) -> RunResult:
    run_dir = root / f"t{trial}-{mode}-{task_set}"
    run_dir.mkdir(parents=True)
    log = run_dir / "iterations.jsonl"
    extra = shlex.split(args.trainer_args)
    tasks = list(TASK_SETS[task_set]) if mode not in ("none", "instrumented") else []
    result = RunResult(mode, task_set, trial, 0.0, args.iterations)
    t0 = time.monotonic()
    if mode == "none":
        run_trainer(trainer_argv(args.iterations, args.warmup, log, extra, None), run_dir)
    elif mode == "naive":
        procs: list[tuple[str, subprocess.Popen[bytes], Path]] = []
        try:
            for dev in DEVICES:
                for name in tasks:
                    cfg = TASKS[name]
                    tag = f"{name}-{dev.replace(':', '-')}"
                    ready, out = run_dir / f"{tag}.ready", run_dir / f"{tag}.json"
                    proc = subprocess.Popen(
                        [sys.executable, "-m", "bench.naive_runner", "--target", cfg.target, "--args",
                         json.dumps(cfg.args), "--device", dev, "--memory-bytes", str(cfg.memory_bytes),
                         "--ready", str(ready), "--out", str(out)],
                        cwd=REPO, stdout=subprocess.DEVNULL, stderr=(run_dir / f"{tag}.log").open("wb"))
                    procs.append((name, proc, out))
                    deadline = time.monotonic() + 120
                    while not ready.exists():
                        if proc.poll() is not None or time.monotonic() > deadline:
                            raise RuntimeError(f"naive {tag} did not start; see {run_dir}")
                        time.sleep(0.05)
            run_trainer(trainer_argv(args.iterations, args.warmup, log, extra, None), run_dir)
        finally:
            for _, proc, _ in procs:
                proc.send_signal(signal.SIGTERM)
            for _, proc, _ in procs:
                proc.wait(60)
        w_start, w_end = measurement_window(log)
        for name, _, out in procs:
            report = json.loads(out.read_text())
            per_step = report["progress"] / report["steps"] if report["steps"] else 0.0
            in_window = sum(w_start <= t < w_end for t in report["step_ends_ns"])
            result.progress[name] = result.progress.get(name, 0.0) + in_window * per_step
            result.work_s += in_window * per_step / rates[name]
        result.bubble_s = instrumented_bubble_s or 0.0
    else:
        policy = "paper" if mode == "freeride-paper" else "freeride"
        sock_dir = Path(tempfile.mkdtemp(prefix="frb-", dir="/tmp"))
        try:
            with managers(run_dir, sock_dir, policy, profile) as endpoints:
                ids: dict[str, list[tuple[str, str]]] = {}
                for dev, ep in endpoints.items():
                    with ControlClient(ep) as client:
                        for name in tasks:
                            cfg = TASKS[name]
                            info = client.submit(TaskSpec(target=cfg.target, args=cfg.args,
                                                          memory_bytes=cfg.memory_bytes, name=name,
                                                          working_dir=str(REPO)))
                            ids.setdefault(dev, []).append((name, info.task_id))
                        _wait_resident(client, [t for _, t in ids.get(dev, [])])
                run_trainer(trainer_argv(args.iterations, args.warmup, log, extra,
                                         f"unix:{sock_dir}/{{slug}}.sock"), run_dir)
                time.sleep(0.3)  # the last ends and parks reach the managers
                infos: dict[str, Any] = {}
                for dev, ep in endpoints.items():
                    with ControlClient(ep) as client:
                        stats = client.stats()
                        for key, pct in (("grant", stats.grant_latency_ms), ("park", stats.park_latency_ms)):
                            target = result.grant_latency_ms if key == "grant" else result.park_latency_ms
                            target[f"{dev} p50"] = pct.p50
                            target[f"{dev} p99"] = pct.p99
                        for name, task_id in ids.get(dev, []):
                            info = client.get(task_id)
                            infos[task_id] = (name, info)
                            if info.state == "FAILED":
                                result.failures.append(f"{dev} {name}: {info.failure}")
        finally:
            shutil.rmtree(sock_dir, ignore_errors=True)
        # The managers have stopped and flushed their traces: count what happened after warm-up.
        w_start, w_end = measurement_window(log)
        for dev in DEVICES:
            trace = run_dir / f"trace-{dev.replace(':', '-')}.jsonl"
            fig = window_figures(read_trace(trace), w_start, w_end)
            result.bubble_s += fig.bubble_s
            result.harvested_s += fig.harvested_s
            result.overruns_ms += fig.overruns_ms
            for task_id, (name, info) in infos.items():
                steps = fig.steps.get(task_id, 0)
                per_step = info.progress / info.steps if info.steps else 0.0
                result.progress[name] = result.progress.get(name, 0.0) + steps * per_step
                result.work_s += steps * per_step / rates[name]
    result.wall_s = time.monotonic() - t0
    ranks = read_iterations(log)
    means = [sum(r["time_ms"] for r in recs) / len(recs) for recs in ranks.values() if recs]
    result.iteration_ms = sum(means) / len(means)
    # Bubble fraction per stage from the trainer's own measurements (the managers' B is per device).
    for recs in ranks.values():
        busy = sum(r["time_ms"] for r in recs)
        idle = sum(b["length_ms"] for r in recs for b in r["bubbles"])
        if idle:
            result.stage_bubble_fraction.append(idle / busy)
    return result


def _wait_resident(client: ControlClient, task_ids: list[str], timeout_s: float = 120.0) -> None:
    """Tasks are resident (worker up) before training starts: the same start line as ``naive``."""
    deadline = time.monotonic() + timeout_s
    while True:
        states = {t: client.get(t).state for t in task_ids}
        if all(s in ("PARKED", "RUNNING", "FROZEN") for s in states.values()):
            return
        if any(s in ("FAILED", "CANCELLED", "FINISHED") for s in states.values()) or time.monotonic() > deadline:
            raise RuntimeError(f"side tasks did not become resident: {states}")
        time.sleep(0.1)


# ---------------------------------------------------------------- aggregate and report


def mean_ci95(values: list[float]) -> tuple[float, float]:
    """The mean and its Student-t 95% half-width (0 for one value)."""
    iv = t_interval(values)
    return iv.estimate, iv.half_width if iv.n > 1 else 0.0


def summarize(runs: list[RunResult], task_sets: list[str], devices: int = len(DEVICES)) -> dict[str, Any]:
    """Per (task set, mode): overhead against ``none`` of the same trial, H, savings, overruns.

    ``none`` and ``instrumented`` runs have no task set: they appear under every one of ``task_sets``.
    """
    base = {r.trial: r for r in runs if r.mode == "none"}
    groups: dict[tuple[str, str], list[RunResult]] = {}
    for r in runs:
        sets = task_sets if r.mode in ("none", "instrumented") else [r.task_set]
        for s in sets:
            groups.setdefault((s, r.mode), []).append(r)
    table: dict[str, dict[str, Any]] = {}
    for (task_set, mode), rs in sorted(groups.items()):
        overheads = [overhead(r.iteration_ms, base[r.trial].iteration_ms) for r in rs if r.trial in base]
        eff = [r.work_s / r.bubble_s for r in rs if r.bubble_s > 0]
        savings = {}
        for ratio in PRICE_RATIOS:
            vals = []
            for r in rs:
                if r.trial not in base:
                    continue
                t_base = base[r.trial].iteration_ms * r.iterations / 1e3
                t_mode = r.iteration_ms * r.iterations / 1e3
                vals.append(cost_saving(CostInputs(r.work_s, t_mode, t_base, devices), ratio))
            savings[f"{ratio:g}x"] = mean_ci95(vals)[0] if vals else None
        overruns = [o for r in rs for o in r.overruns_ms]
        oh = mean_ci95(overheads) if overheads else (float("nan"), 0.0)
        table[f"{task_set}/{mode}"] = {
            "task_set": task_set, "mode": mode, "trials": len(rs),
            "iteration_ms": mean_ci95([r.iteration_ms for r in rs])[0],
            "overhead": oh[0], "overhead_ci95": oh[1],
            "bubble_s": mean_ci95([r.bubble_s for r in rs])[0],
            "harvested_s": mean_ci95([r.harvested_s for r in rs])[0],
            "work_s": mean_ci95([r.work_s for r in rs])[0],
            "harvest_efficiency": mean_ci95(eff)[0] if eff else None,
            "stage_bubble_fraction": [mean_ci95([r.stage_bubble_fraction[i] for r in rs])[0]
                                      for i in range(min((len(r.stage_bubble_fraction) for r in rs), default=0))],
            "overrun_ms": {"bubbles": len(overruns), "overrun_share": (sum(o > 0 for o in overruns) / len(overruns))
                           if overruns else None,
                           **{f"p{q}": percentile(overruns, q) if overruns else None for q in (50, 90, 99)},
                           "max": max(overruns) if overruns else None},
            "grant_latency_p99_ms": max((r.grant_latency_ms.get(f"{d} p99", 0.0) for r in rs for d in DEVICES),
                                        default=None),
            "park_latency_p99_ms": max((r.park_latency_ms.get(f"{d} p99", 0.0) for r in rs for d in DEVICES),
                                       default=None),
            "saving": savings,
            "failures": [f for r in rs for f in r.failures],
        }
    return table


def _fmt(value: Any, pct: bool = False, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and value != value):
        return "-"
    return f"{value * 100:+.{digits}f}%" if pct else f"{value:.{digits}f}"


def write_markdown(path: Path, meta: dict[str, Any], table: dict[str, dict[str, Any]]) -> None:
    lines = [
        "# freeride vs the reference policy vs co-location (CPU)",
        "",
        f"Machine: {meta['machine']['cpu']}, {meta['machine']['cores']} cores, Python {meta['machine']['python']}, "
        f"versions {meta['machine']['versions']}.",
        f"Trainer: {meta['trainer']}, `{meta['trainer_args']}`, "
        f"{meta['iterations']} iterations ({meta['warmup']} warm-up excluded from times), {meta['trials']} trials; "
        "modes in a fresh random order inside each trial.",
        f"Command: `{meta['command']}`",
        "",
        "Overhead = T_mode / T_none - 1 of the same trial (mean, +- 95% CI over trials). H = (sum of progress / "
        "standalone throughput) / bubble time. Saving = (W / r - n dT) / (n T_base), W the side work in "
        f"standalone device-seconds, n = {len(meta['devices'])} devices, r the price ratio of a training "
        "device-hour to a dedicated side-task device-hour (1x: same device; 5.5x: the reference's $3.96/h "
        "4-GPU server per GPU vs a $0.18/h RTX 3080; 22x: the reference's own server-to-GPU ratio).",
        "",
    ]
    for task_set in dict.fromkeys(row["task_set"] for row in table.values()):
        lines += [f"## {task_set}", "",
                  "| mode | iteration ms | overhead | bubble s | harvested s | work s | H | overrun p50/p99/max ms "
                  "| overrun share | grant p99 ms | park p99 ms | saving 1x / 5.5x / 22x |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for mode in MODES:
            row = table.get(f"{task_set}/{mode}")
            if row is None:
                continue
            o = row["overrun_ms"]
            sv = row["saving"]
            lines.append(
                f"| {mode} | {_fmt(row['iteration_ms'])} | {_fmt(row['overhead'], pct=True)} "
                f"+- {_fmt(row['overhead_ci95'] * 100)}% | {_fmt(row['bubble_s'])} | {_fmt(row['harvested_s'])} "
                f"| {_fmt(row['work_s'])} | {_fmt(row['harvest_efficiency'], pct=False)} "
                f"| {_fmt(o['p50'])}/{_fmt(o['p99'])}/{_fmt(o['max'])} | {_fmt(o['overrun_share'])} "
                f"| {_fmt(row['grant_latency_p99_ms']) if mode.startswith('freeride') else '-'} "
                f"| {_fmt(row['park_latency_p99_ms']) if mode == 'freeride' else '-'} "
                f"| {_fmt(sv.get('1x'), pct=True, digits=1)} / {_fmt(sv.get('5.5x'), pct=True, digits=1)} / "
                f"{_fmt(sv.get('22x'), pct=True, digits=1)} |")
        failures = [f for mode in MODES for f in (table.get(f"{task_set}/{mode}") or {}).get("failures", [])]
        if failures:
            lines += ["", "Failures: " + "; ".join(failures)]
        lines.append("")
    lines += ["## Targets", ""] + [f"- {t}" for t in meta["targets"]] + [""]
    path.write_text("\n".join(lines))


def targets(table: dict[str, dict[str, Any]]) -> list[str]:
    out = []
    for task_set in dict.fromkeys(row["task_set"] for row in table.values()):
        fr = table.get(f"{task_set}/freeride")
        paper = table.get(f"{task_set}/freeride-paper")
        if fr is None:
            continue
        oh = fr["overhead"]
        out.append(f"{task_set}: freeride overhead {_fmt(oh, pct=True)} (+- {_fmt(fr['overhead_ci95'] * 100)}%) "
                   f"vs target <= +0.50%: {'met' if oh <= 0.005 else 'missed'}")
        h = fr["harvest_efficiency"]
        out.append(f"{task_set}: freeride H {_fmt(h)} vs target >= 0.80: "
                   f"{'met' if h is not None and h >= 0.8 else 'missed'}")
        if paper is not None and paper["work_s"] > 0:
            ratio = fr["work_s"] / paper["work_s"]
            out.append(f"{task_set}: freeride harvest / paper harvest {ratio:.2f}x vs target >= 1.3x: "
                       f"{'met' if ratio >= 1.3 else 'missed'}; overhead freeride {_fmt(oh, pct=True)} vs paper "
                       f"{_fmt(paper['overhead'], pct=True)}")
        elif paper is not None:
            out.append(f"{task_set}: the paper policy harvested nothing; freeride harvested {_fmt(fr['work_s'])} s")
    return out


def plot(out: Path, table: dict[str, dict[str, Any]]) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    sets = list(dict.fromkeys(row["task_set"] for row in table.values()))
    modes = [m for m in MODES if m != "none"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        rows = [table.get(f"{s}/{mode}") for s in sets]
        xs = [j + i * width for j in range(len(sets))]
        axes[0].bar(xs, [100 * r["overhead"] if r else 0 for r in rows], width,
                    yerr=[100 * r["overhead_ci95"] if r else 0 for r in rows], label=mode, capsize=2)
        axes[1].bar(xs, [(r["harvest_efficiency"] or 0) if r else 0 for r in rows], width, label=mode)
    for ax, title in zip(axes, ("training overhead vs none (%)", "harvest efficiency H"), strict=True):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(sets))], sets)
        ax.set_title(title)
        ax.axhline(0, color="black", linewidth=0.5)
    axes[0].set_yscale("symlog", linthresh=1)
    axes[1].axhline(0.8, color="grey", linestyle="--", linewidth=0.8)
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "modes.png", dpi=120)
    plt.close(fig)
    written.append("modes.png")
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode in ("freeride-paper", "freeride"):
        row = table.get(f"{sets[-1]}/{mode}")
        if row and row["overrun_ms"]["bubbles"]:
            o = row["overrun_ms"]
            ax.plot([50, 90, 99], [o["p50"], o["p90"], o["p99"]], marker="o", label=mode)
    ax.set_xlabel("percentile of granted bubbles")
    ax.set_ylabel("overrun past the real end (ms)")
    ax.set_title(f"overruns, {sets[-1]}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "overruns.png", dpi=120)
    plt.close(fig)
    written.append("overruns.png")
    return written


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--iterations", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--task-sets", default=",".join(TASK_SETS))
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--trainer-args", default="--d-model 256")
    p.add_argument("--standalone-s", type=float, default=4.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "cpu"))
    p.add_argument("--keep", action="store_true", help="keep the per-run directories (logs, traces)")
    p.add_argument("--single-stage", metavar="DEVICE", default=None,
                   help="one real stage on DEVICE (cuda:0, cpu:0), its neighbours emulated by timed waits "
                   "(freeride.workload.single_stage); --trainer-args then go to that trainer")
    p.add_argument("--stage", default="1/4/8",
                   help="with --single-stage: INDEX/STAGES/MICROBATCHES (default %(default)s)")
    args = p.parse_args(argv)
    global DEVICES, SINGLE_STAGE
    if args.single_stage:
        try:
            index, stages, microbatches = (int(x) for x in args.stage.split("/"))
        except ValueError:
            p.error(f"--stage must be INDEX/STAGES/MICROBATCHES, got {args.stage!r}")
        DEVICES, SINGLE_STAGE = (args.single_stage,), (index, stages, microbatches)
    # SIGTERM unwinds like Ctrl-C, so that every manager, trainer and naive task is stopped.
    signal.signal(signal.SIGTERM, _interrupt)
    task_sets = [s for s in args.task_sets.split(",") if s]
    modes = [m for m in args.modes.split(",") if m]
    for s in task_sets:
        if s not in TASK_SETS:
            p.error(f"unknown task set {s!r}: expected {', '.join(TASK_SETS)}")
    for m in modes:
        if m not in MODES:
            p.error(f"unknown mode {m!r}: expected {', '.join(MODES)}")
    if "none" not in modes:
        p.error("the none mode is every overhead's baseline")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="freeride-bench-"))
    rng = random.Random(args.seed)
    needed = sorted({t for s in task_sets for t in TASK_SETS[s]})
    print(f"bench: runs under {root}", flush=True)
    profile_path = root / "paper-profile.json"
    profile: dict[str, int] = {}
    if "freeride-paper" in modes:
        prof_dir = root / "profile"
        prof_dir.mkdir()
        sock_dir = Path(tempfile.mkdtemp(prefix="frb-", dir="/tmp"))
        with managers(prof_dir, sock_dir, "freeride", None):
            run_trainer(trainer_argv(args.iterations, args.warmup, prof_dir / "iterations.jsonl",
                                     shlex.split(args.trainer_args), f"unix:{sock_dir}/{{slug}}.sock"), prof_dir)
        shutil.rmtree(sock_dir, ignore_errors=True)
        profile = paper_profile(prof_dir / "iterations.jsonl", profile_path)
        print(f"bench: paper profile (min ns per stage/slot) {profile}", flush=True)
    runs: list[RunResult] = []
    all_rates: list[dict[str, float]] = []
    started = time.time()
    for trial in range(args.trials):
        rates = standalone_rates(needed, args.standalone_s, root) if needed else {}
        all_rates.append(rates)
        plan = [(m, "-") for m in ("none", "instrumented") if m in modes]
        plan += [(m, s) for s in task_sets for m in ("naive", "freeride-paper", "freeride") if m in modes]
        rng.shuffle(plan)
        # naive needs the instrumented run's bubble time of its trial: run instrumented first among those two.
        if ("instrumented", "-") in plan:
            plan.remove(("instrumented", "-"))
            first_naive = next((i for i, (m, _) in enumerate(plan) if m == "naive"), len(plan))
            plan.insert(first_naive, ("instrumented", "-"))
        instrumented_b: float | None = None
        for mode, task_set in plan:
            result = run_once(mode, task_set, trial, args, root, profile_path if profile else None, rates,
                              instrumented_b)
            if mode == "instrumented":
                instrumented_b = result.bubble_s
            runs.append(result)
            print(f"bench: trial {trial} {mode:15s} {task_set:9s} iteration {result.iteration_ms:7.1f} ms "
                  f"B {result.bubble_s:6.2f} s work {result.work_s:6.2f} s "
                  f"H {result.work_s / result.bubble_s if result.bubble_s else 0:5.2f} ({result.wall_s:.0f} s)",
                  flush=True)
    table = summarize(runs, task_sets, devices=len(DEVICES))
    command = "python -m bench.bench_modes " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    trainer = (f"one real stage ({SINGLE_STAGE[0]} of {SINGLE_STAGE[1]}, 1F1B, {SINGLE_STAGE[2]} micro-batches) on "
               f"{DEVICES[0]}, neighbours emulated" if SINGLE_STAGE else
               f"reference GPT, 1F1B, {len(DEVICES)} stages on {'/'.join(DEVICES)} (gloo)")
    meta = {"machine": machine_info(), "devices": list(DEVICES), "trainer": trainer,
            "trainer_args": args.trainer_args, "iterations": args.iterations,
            "warmup": args.warmup, "trials": args.trials, "command": command, "wall_s": time.time() - started,
            "tasks": {k: {"target": v.target, "args": v.args, "memory_bytes": v.memory_bytes}
                      for k, v in TASKS.items()},
            "standalone_rates": all_rates, "paper_profile_ns": profile, "targets": targets(table)}
    (out / "modes.json").write_text(json.dumps({"meta": meta, "summary": table,
                                                "runs": [r.__dict__ for r in runs]}, indent=1, default=str))
    write_markdown(out / "modes.md", meta, table)
    plot(out, table)
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    print((out / "modes.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
