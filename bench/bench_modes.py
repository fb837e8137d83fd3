"""The comparison of DESIGN section 6: one trainer config, five modes, paired interleaved trials.

Modes:

* ``none``: the trainer alone (the baseline of its trial).
* ``instrumented``: reporting on, a manager per device, no side tasks.
* ``naive``: the side tasks run unmanaged beside the trainer, pinned to the stage's core at the
  trainer's priority (``bench/naive_runner.py``): the co-location baseline.
* ``freeride-paper``: our managers with the reference system's policy (``--policy paper``, its
  offline profile made by the calibration run: the minimum length of each (stage, slot) bubble).
* ``freeride``: our managers and policy.

**Layouts** (:class:`Layout`; ``--layout``). Where the trainer, the side tasks and the rest of
freeride run decides what an overhead means:

* ``single-stage-cpu`` (default) mirrors a GPU host: one real pipeline stage
  (:mod:`freeride.workload.single_stage`, stage 1 of a 4-stage 1F1B, its neighbours emulated by
  timed waits) pinned to a core of its own, and its side tasks pinned there too; the managers
  (loop, gRPC threads), the trainer's reporter thread and the bench itself on the other cores. On a
  GPU host the trainer's CPU threads and the manager likewise have cores that the stage's device does
  not, so the overhead measured is freeride's, not two processes taking turns on one core. The
  neighbours' action costs are fixed for the whole bench (the calibration run's), so they cannot
  drift with the load a mode puts on the stage.
* ``two-stage-cpu`` is the **stress case**: the reference 2-stage trainer under torchrun, one stage
  per core, so every manager, reporter and gRPC thread runs by taking a stage's time.
* ``--single-stage cuda:0`` (a GPU) is the same single-stage layout on another device.
Cores come from ``os.sched_getaffinity(0)``: the stage gets the last one, the host side the rest.

**Trials.** A trial runs every mode (and task set) once, in a fresh random order, plus a ``none``
run; its overheads are ratios to that ``none`` run. After each trial the stopping rule
(:func:`freeride.measure.stop_decision`) looks at the 95% intervals of the watched overheads
(``instrumented`` and ``freeride`` per task set): trials go on until every one is within +-1
percentage point, or the trial or time budget is spent, and the results say which. Each trial also
measures the tasks' standalone throughput first (``freeride._demo.probe``, the demo's yardstick).

Figures (``bench/modes_report.py``; the arithmetic in ``freeride.measure`` and ``freeride.harvest``):
overheads and their intervals, the stage's compute overhead, harvest efficiency from the managers'
traces with the breakdown of every bubble, overruns, grant and park latencies, savings.

Run: ``python -m bench.bench_modes`` (about 35 minutes on two cores; ``--budget-min``), or a preset
(``bench/modes_presets.py``): ``--preset short`` (about 7 minutes) or ``--preset reference-scale`` (the
comparison with the reference policy at its own bubble scale, about 15 minutes). Results: ``<stem>.json``
(every run, raw), ``<stem>.md`` and ``<stem>.png`` in ``--out`` (stem ``modes``, or the preset's);
``--update-readme README.md`` rewrites the README's generated block of that stem; ``--render-only``
re-renders them from an existing ``<stem>.json``.
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
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.machine import machine_info
from bench.modes_presets import DEFAULT_STEM, PRESETS, REFERENCE_SETS, REFERENCE_SIZED
from bench.modes_report import (
    MODES,
    RunResult,
    gated_intervals,
    interfered,
    loadavg_summary,
    plot,
    readme_block,
    summarize,
    update_readme,
    write_markdown,
)
from freeride._cli.launch import set_pdeathsig as die_with_parent
from freeride._demo.plan import plan_tasks, trainer_model_args
from freeride._manager.trace import read_trace
from freeride._wire.client import ControlClient, health_status
from freeride.devices import parse_device_name
from freeride.endpoints import Endpoint
from freeride.errors import ManagerUnavailable
from freeride.harvest import harvest, measurement_window, standalone_step_s, steady_window
from freeride.measure import StopDecision, StopRule, percentiles, stop_decision
from freeride.messages import TaskSpec

REPO = Path(__file__).resolve().parents[1]
MiB = 2**20


@dataclass(frozen=True)
class SideTaskConfig:
    name: str
    target: str
    args: dict[str, Any]
    memory_bytes: int


_KINDS = {"pagerank": "side_tasks.graphs:PageRank", "image": "side_tasks.images:ImageWatermark",
          "training": "side_tasks.training:LSTMLanguageModelTraining"}


def task_plan(device_kind: str) -> dict[str, SideTaskConfig]:
    """The three kinds of side task, sized as in the demo (``freeride._demo.plan``) for the device kind:
    on CPU for bubbles of tens of milliseconds (steps of a few milliseconds on one core, caps of
    640-768 MiB); on a GPU for millisecond bubbles, with caps (2 GiB) that hold a CUDA context too."""
    plans = {t.target: t for t in plan_tasks(device_kind, 1)}
    tasks = {name: SideTaskConfig(name, target, dict(plans[target].args), plans[target].memory_bytes)
             for name, target in _KINDS.items()}
    if device_kind == "cpu":  # sized like the reference's tasks on one core (bench/modes_presets.py)
        tasks.update({name: SideTaskConfig(name, target, dict(args), memory)
                      for name, (target, args, memory) in REFERENCE_SIZED.items()})
    return tasks


#: The plan in use: the CPU's unless the bench runs on a GPU (``main`` switches it).
TASKS: dict[str, SideTaskConfig] = task_plan("cpu")
TASK_SETS: dict[str, tuple[str, ...]] = {"pagerank": ("pagerank",), "image": ("image",),
                                         "training": ("training",), "mix": ("pagerank", "image", "training"),
                                         **REFERENCE_SETS}


# ---------------------------------------------------------------- layouts


@dataclass(frozen=True)
class Layout:
    """Where the trainer's stages, the side tasks and freeride's own processes run.

    ``devices`` are the devices of the real stages (a manager and the side tasks on each);
    ``host_cores`` the CPU cores for the managers, the reporter threads and the bench (empty: no
    pinning, everything shares). Subclasses say how to start the trainer.
    """

    name: str
    devices: tuple[str, ...]
    host_cores: frozenset[int] = frozenset()
    stress: bool = False

    @property
    def description(self) -> str:
        raise NotImplementedError

    def trainer_text(self) -> str:
        raise NotImplementedError

    def trainer_argv(self, iterations: int, warmup: int, log: Path, extra: Sequence[str],
                     endpoint_template: str | None) -> list[str]:
        raise NotImplementedError

    def rank_logs(self, log: Path) -> list[Path]:
        return [log.with_name(f"{log.stem}.rank{rank}{log.suffix}") for rank in range(len(self.devices))]

    def calibrated(self, rank_records: Mapping[int, list[dict[str, Any]]]) -> Layout:
        """The layout with whatever the calibration run fixes for the whole bench (nothing here)."""
        return self

    def to_json(self) -> dict[str, Any]:
        doc = dataclasses.asdict(self)
        doc["host_cores"] = sorted(self.host_cores)
        doc["description"] = self.description
        return doc


@dataclass(frozen=True)
class SingleStageLayout(Layout):
    """One real stage (``stage_index`` of ``stages``, ``microbatches``), its neighbours emulated.

    ``peer_forward_ms`` / ``peer_backward_ms`` fix the neighbours' costs for every run (set from
    the calibration run, unless given: ``--peer-forward-ms``); unset, each run learns them from its own
    warm-up, so a mode that slows the stage would also slow its emulated neighbours.
    """

    stage_index: int = 1
    stages: int = 4
    microbatches: int = 8
    peer_forward_ms: float | None = None
    peer_backward_ms: float | None = None

    @property
    def description(self) -> str:
        host = ("cores " + ",".join(map(str, sorted(self.host_cores)))) if self.host_cores else "any core"
        return (f"Stage {self.stage_index} of a {self.stages}-stage 1F1B pipeline ({self.microbatches} micro-batches) "
                f"runs for real on {self.devices[0]}, its neighbours emulated by timed waits (costs fixed for the "
                f"bench: forward {self.peer_forward_ms or 0:.2f} ms, backward {self.peer_backward_ms or 0:.2f} ms); "
                f"the side tasks are pinned to the stage's device; the managers, the reporter thread and the bench "
                f"run on {host}, as a GPU host's CPU side does beside its GPU.")

    def trainer_text(self) -> str:
        return (f"one real stage ({self.stage_index} of {self.stages}, 1F1B, {self.microbatches} micro-batches) on "
                f"{self.devices[0]}, neighbours emulated")

    def trainer_argv(self, iterations: int, warmup: int, log: Path, extra: Sequence[str],
                     endpoint_template: str | None) -> list[str]:
        from freeride.workload.single_stage import single_stage_command

        endpoint = endpoint_template.replace("{slug}", _slug(self.devices[0])) if endpoint_template else None
        peers = []
        if self.peer_forward_ms is not None and self.peer_backward_ms is not None:
            peers = ["--peer-forward-ms", f"{self.peer_forward_ms:.4f}", "--peer-backward-ms",
                     f"{self.peer_backward_ms:.4f}"]
        return single_stage_command(self.devices[0], self.stage_index, self.stages, self.microbatches, iterations,
                                    log=self.rank_logs(log)[0], report=bool(endpoint), endpoint=endpoint,
                                    extra=["--warmup", str(warmup), *peers, *extra])

    def calibrated(self, rank_records: Mapping[int, list[dict[str, Any]]]) -> Layout:
        model = next((r["model"] for r in reversed(rank_records.get(0, [])) if "model" in r), None)
        if model is None or (self.peer_forward_ms is not None and self.peer_backward_ms is not None):
            return self  # nothing learned, or costs given (--peer-forward-ms): they stay
        return dataclasses.replace(self, peer_forward_ms=float(model["forward_ms"]),
                                   peer_backward_ms=float(model["backward_ms"]))


@dataclass(frozen=True)
class TwoStageLayout(Layout):
    """The reference 2-stage 1F1B trainer under torchrun, a stage per device (gloo on CPU cores)."""

    @property
    def description(self) -> str:
        return (f"Stress case: the reference 2-stage trainer, one stage on each of {' and '.join(self.devices)}, with "
                "the managers, reporters and gRPC threads taking turns with the stages on the same two cores; no "
                "core is left for freeride's own threads, unlike a GPU host.")

    def trainer_text(self) -> str:
        return f"reference GPT, 1F1B, {len(self.devices)} stages on {'/'.join(self.devices)} (gloo)"

    def trainer_argv(self, iterations: int, warmup: int, log: Path, extra: Sequence[str],
                     endpoint_template: str | None) -> list[str]:
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                str(len(self.devices)), "-m", "freeride.workload", "--stages", str(len(self.devices)), "--schedule",
                "1f1b", "--iterations", str(iterations), "--warmup", str(warmup), "--iteration-log", str(log), *extra]
        if endpoint_template:
            argv += ["--report", "--endpoint-template", endpoint_template]
        return argv


def _slug(device: str) -> str:
    return device.replace(":", "-")


def single_stage_cpu(cores: Sequence[int], stage: tuple[int, int, int] = (1, 4, 8)) -> SingleStageLayout:
    """The default: the stage on the last allowed core, the host side on the others (needs two)."""
    allowed = sorted(cores)
    if len(allowed) < 2:
        raise SystemExit(f"the single-stage CPU layout needs 2 cores (the stage's and the host's); this process may "
                         f"use {len(allowed)}: use --layout two-stage-cpu or allow more cores")
    index, stages, microbatches = stage
    return SingleStageLayout("single-stage cpu", (f"cpu:{allowed[-1]}",), frozenset(allowed[:-1]), False, index,
                             stages, microbatches)


def two_stage_cpu(cores: Sequence[int]) -> TwoStageLayout:
    """The stress case: the reference trainer's two stages on the first two allowed cores (its own rule)."""
    allowed = sorted(cores)
    if len(allowed) < 2:
        raise SystemExit(f"the two-stage layout needs 2 cores; this process may use {len(allowed)}")
    return TwoStageLayout("two-stage cpu", (f"cpu:{allowed[0]}", f"cpu:{allowed[1]}"), frozenset(), True)


def single_stage_device(device: str, stage: tuple[int, int, int], cores: Sequence[int]) -> SingleStageLayout:
    """``--single-stage DEVICE``: the single-stage layout on a named device (``cuda:0``, ``cpu:K``)."""
    index, stages, microbatches = stage
    name = parse_device_name(device)
    host = frozenset(c for c in cores if not (name.kind == "cpu" and c == name.index))
    return SingleStageLayout(f"single-stage {name.kind}", (device,), host if name.kind == "cpu" else frozenset(),
                             False, index, stages, microbatches)


def pin_threads(pid: int, cores: frozenset[int]) -> int:
    """Pin every thread of process ``pid`` to ``cores``; the threads they start later inherit it.

    The managers must start with the stage's core allowed (``freeride manager --device cpu:K``
    checks that it may use core K) and are moved off it once they serve; their workers pin
    themselves to core K. Returns the threads pinned.
    """
    pinned = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
            pinned += 1
        except (ProcessLookupError, FileNotFoundError):  # a thread that just ended
            continue
    return pinned


# ---------------------------------------------------------------- processes


@contextmanager
def managers(layout: Layout, run_dir: Path, sock_dir: Path, policy: str,
             profile: Path | None, extra: Sequence[str] = (), trace: bool = True) -> Iterator[dict[str, Endpoint]]:
    """One real manager daemon per device, off the stage's core where the layout says; SIGTERM on exit.
    ``extra``: more ``freeride manager`` options (a bench comparing one of them). ``trace``: each writes its trace
    (``trace-<device>.jsonl`` in ``run_dir``), which the harvest analyses read; a bench of what the managers cost
    the training leaves it off, as users run them (writing it is a seventh of a manager's CPU per bubble)."""
    procs: list[subprocess.Popen[bytes]] = []
    endpoints: dict[str, Endpoint] = {}
    try:
        for dev in layout.devices:
            sock = sock_dir / f"{_slug(dev)}.sock"
            argv = [sys.executable, "-m", "freeride.cli", "manager", "--device", dev, "--endpoint", f"unix:{sock}",
                    "--state-dir", str(run_dir / f"state-{_slug(dev)}")]
            if trace:
                argv += ["--trace", str(run_dir / f"trace-{_slug(dev)}.jsonl")]
            if policy == "paper":
                argv += ["--policy", "paper"] + (["--paper-profile", str(profile)] if profile else [])
            argv += list(extra)
            log = (run_dir / f"manager-{_slug(dev)}.log").open("wb")
            # As ``freeride launch`` and the demo start them: each in a session, so an autogroup, of its own
            # (not sharing the bench's, which users' managers never do).
            procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                          preexec_fn=die_with_parent))
            endpoints[dev] = Endpoint("unix", str(sock))
        for proc, ep in zip(procs, endpoints.values(), strict=True):
            deadline = time.monotonic() + 60
            while True:
                try:
                    if health_status(ep, timeout_s=1) == "SERVING":
                        break
                except ManagerUnavailable:
                    pass
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"manager at {ep} did not start; see {run_dir}")
                time.sleep(0.1)
            if layout.host_cores:
                pin_threads(proc.pid, layout.host_cores)
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


def run_trainer(argv: list[str], run_dir: Path) -> float:
    t0 = time.monotonic()
    with (run_dir / "trainer.log").open("wb") as out:
        code = subprocess.call(argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if code != 0:
        raise RuntimeError(f"the trainer failed ({code}); see {run_dir / 'trainer.log'}")
    return time.monotonic() - t0


def read_iterations(layout: Layout, log: Path) -> dict[int, list[dict[str, Any]]]:
    """Per rank, the iteration records after warm-up."""
    ranks: dict[int, list[dict[str, Any]]] = {}
    for rank, path in enumerate(layout.rank_logs(log)):
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        ranks[rank] = [r for r in records if "iteration" in r and not r["warmup"]]
    return ranks


def standalone_rates(tasks: Sequence[str], device: str, seconds: float,
                     run_dir: Path) -> tuple[dict[str, float], dict[str, float]]:
    """Progress per second of each task alone on ``device``, and its median step in ms: the demo's
    yardstick (``freeride._demo.probe``, ``freeride.standalone.run_standalone``: pinned to the core, one
    thread, at normal priority, from after ``setup``)."""
    request, result = run_dir / "standalone-request.json", run_dir / "standalone.json"
    request.write_text(json.dumps({"device": device, "seconds": seconds, "tasks": [
        {"name": name, "target": TASKS[name].target, "args": TASKS[name].args,
         "memory_bytes": TASKS[name].memory_bytes} for name in tasks]}))
    with (run_dir / "standalone.log").open("wb") as log:
        code = subprocess.call([sys.executable, "-m", "freeride._demo.probe", str(request), str(result)], cwd=REPO,
                               stdout=log, stderr=subprocess.STDOUT, timeout=120 + 4 * seconds * len(tasks),
                               start_new_session=True)  # its autogroup at nice 19, like a worker's
    entries = json.loads(result.read_text()) if result.exists() else []
    rates = {e["name"]: float(e["report"]["progress_per_s"]) for e in entries if "report" in e}
    step_ms = {e["name"]: float(e["report"]["step_ms_p50"]) for e in entries if "report" in e}
    missing = [name for name in tasks if not rates.get(name)]
    if code != 0 or missing:
        raise RuntimeError(f"standalone measurement failed for {', '.join(missing) or 'a task'}; see {run_dir}")
    return rates, step_ms


def paper_profile(layout: Layout, log: Path, out: Path) -> dict[str, int]:
    """The reference's offline profile: the minimum measured length of each (stage, slot) bubble."""
    mins: dict[tuple[int, int], int] = {}
    for records in read_iterations(layout, log).values():
        for r in records:
            for b in r["bubbles"]:
                key = (int(r["stage"]), int(b["slot"]))
                length = int(b["length_ms"] * 1e6)
                if length > 0:
                    mins[key] = min(mins.get(key, length), length)
    out.write_text(json.dumps({"slots": [{"stage": s, "slot": k, "min_ns": v} for (s, k), v in sorted(mins.items())]}))
    return {f"{s}/{k}": v for (s, k), v in sorted(mins.items())}


# ---------------------------------------------------------------- one run


@dataclass(frozen=True)
class Settings:
    """What every run of the bench shares."""

    layout: Layout
    iterations: int
    warmup: int
    trainer_args: tuple[str, ...]
    root: Path
    profile: Path | None


def _naive(settings: Settings, tasks: Sequence[str], run_dir: Path, log: Path,
           rates: Mapping[str, float]) -> tuple[dict[str, float], float]:
    """The naive mode: the tasks beside the trainer, unmanaged; progress and standalone work in the window."""
    layout = settings.layout
    procs: list[tuple[str, subprocess.Popen[bytes], Path]] = []
    try:
        for dev in layout.devices:
            for name in tasks:
                cfg = TASKS[name]
                tag = f"{name}-{_slug(dev)}"
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
        run_trainer(layout.trainer_argv(settings.iterations, settings.warmup, log, settings.trainer_args, None),
                    run_dir)
    finally:
        for _, proc, _ in procs:
            proc.send_signal(signal.SIGTERM)
        for _, proc, _ in procs:
            proc.wait(60)
    w_start, w_end = measurement_window(layout.rank_logs(log))
    progress: dict[str, float] = {}
    work_s = 0.0
    for name, _, out in procs:
        report = json.loads(out.read_text())
        in_window = sum(w_start <= t < w_end for t in report["step_ends_ns"])
        step_s = standalone_step_s(report["progress"], report["steps"], rates[name])
        progress[name] = progress.get(name, 0.0) + in_window * (report["progress"] / max(1, report["steps"]))
        work_s += in_window * step_s
    return progress, work_s


def run_once(mode: str, task_set: str, trial: int, settings: Settings, rates: Mapping[str, float],
             instrumented_bubble_s: float | None) -> RunResult:
    layout = settings.layout
    run_dir = settings.root / f"t{trial}-{mode}-{task_set}"
    run_dir.mkdir(parents=True)
    log = run_dir / "iterations.jsonl"
    tasks = list(TASK_SETS[task_set]) if mode not in ("none", "instrumented") else []
    result = RunResult(mode, task_set, trial, 0.0, settings.iterations, loadavg=os.getloadavg()[0])
    t0 = time.monotonic()
    if mode == "none":
        run_trainer(layout.trainer_argv(settings.iterations, settings.warmup, log, settings.trainer_args, None),
                    run_dir)
    elif mode == "naive":
        result.progress, result.work_s = _naive(settings, tasks, run_dir, log, rates)
    else:
        _managed(mode, tasks, settings, run_dir, log, rates, result)
    result.wall_s = time.monotonic() - t0
    ranks = read_iterations(layout, log)
    # The saving's T is the time of the iterations whose bubbles H counts: those after the warm-up.
    result.iterations = min(len(recs) for recs in ranks.values())
    means = [sum(r["time_ms"] for r in recs) / len(recs) for recs in ranks.values() if recs]
    result.iteration_ms = sum(means) / len(means)
    if len(ranks) == 1:  # a single stage: its own compute and its waits for its core
        for key in ("compute_ms", "runqueue_wait_ms"):
            values = [r[key] for recs in ranks.values() for r in recs if r.get(key) is not None]
            setattr(result, key, sum(values) / len(values) if values else None)
    for recs in ranks.values():
        busy = sum(r["time_ms"] for r in recs)
        idle = sum(b["length_ms"] for r in recs for b in r["bubbles"])
        if idle:
            result.stage_bubble_fraction.append(idle / busy)
    lengths = [b["length_ms"] for recs in ranks.values() for r in recs for b in r["bubbles"] if b["length_ms"] > 0]
    if lengths:
        low, p50, high = percentiles(lengths, (0, 50, 100))
        result.bubble_ms = {"count": len(lengths), "min": low, "p50": p50, "max": high}
    if mode == "naive":
        # The trainer measured its own bubbles in the window; without (a bare two-stage trainer logs none),
        # the instrumented run's of the same trial.
        logged = sum(b["length_ms"] for recs in ranks.values() for r in recs for b in r["bubbles"]) / 1e3
        result.bubble_s = logged or instrumented_bubble_s or 0.0
    return result


def _managed(mode: str, tasks: Sequence[str], settings: Settings, run_dir: Path, log: Path,
             rates: Mapping[str, float], result: RunResult) -> None:
    """``instrumented``, ``freeride-paper`` and ``freeride``: real managers, their traces read afterwards."""
    layout = settings.layout
    policy = "paper" if mode == "freeride-paper" else "freeride"
    sock_dir = Path(tempfile.mkdtemp(prefix="frb-", dir="/tmp"))
    names: dict[str, str] = {}
    step_s: dict[str, float] = {}  # standalone seconds per step, per task id
    per_step: dict[str, float] = {}  # progress per step, per task id
    try:
        with managers(layout, run_dir, sock_dir, policy, settings.profile) as endpoints:
            ids: dict[str, list[str]] = {}
            for dev, ep in endpoints.items():
                with ControlClient(ep) as client:
                    for name in tasks:
                        cfg = TASKS[name]
                        info = client.submit(TaskSpec(target=cfg.target, args=cfg.args, memory_bytes=cfg.memory_bytes,
                                                      name=name, working_dir=str(REPO)))
                        ids.setdefault(dev, []).append(info.task_id)
                        names[info.task_id] = name
                    _wait_resident(client, ids.get(dev, []))
            run_trainer(layout.trainer_argv(settings.iterations, settings.warmup, log, settings.trainer_args,
                                            f"unix:{sock_dir}/{{slug}}.sock"), run_dir)
            time.sleep(0.3)  # the last ends and parks reach the managers
            for dev, ep in endpoints.items():
                with ControlClient(ep) as client:
                    stats = client.stats()
                    for key, pct in (("grant", stats.grant_latency_ms), ("park", stats.park_latency_ms)):
                        target = result.grant_latency_ms if key == "grant" else result.park_latency_ms
                        target[f"{dev} p50"] = pct.p50
                        target[f"{dev} p99"] = pct.p99
                    for task_id in ids.get(dev, []):
                        info = client.get(task_id)
                        name = names[task_id]
                        step_s[task_id] = standalone_step_s(info.progress, info.steps, rates[name])
                        per_step[task_id] = info.progress / info.steps if info.steps else 0.0
                        if info.state == "FAILED":
                            result.failures.append(f"{dev} {name}: {info.failure}")
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)
    # The managers have stopped and flushed their traces: account for the bubbles after warm-up.
    traces = [read_trace(run_dir / f"trace-{_slug(dev)}.jsonl") for dev in layout.devices]
    window = steady_window(traces, measurement_window(layout.rank_logs(log)))
    result.harvest_window_s = (window[1] - window[0]) / 1e9
    h = harvest(traces, step_s, window)
    longest = max((step_s[t] for t in step_s), default=0.0)
    fit = harvest(traces, step_s, window, min_bubble_s=10 * longest) if longest > 0 else None
    result.bubble_s, result.work_s = h.bubble_s, h.work_s
    result.harvest = h.to_json()
    result.harvest_fit = fit.to_json() if fit is not None else {}
    result.overruns_ms = list(h.overruns_ms)
    for task_id, count in h.steps.items():
        if task_id in names:
            name = names[task_id]
            result.progress[name] = result.progress.get(name, 0.0) + count * per_step.get(task_id, 0.0)


def _wait_resident(client: ControlClient, task_ids: list[str], timeout_s: float = 300.0) -> None:
    """Tasks are resident (worker up) before training starts: the same start line as ``naive``.

    A worker runs at nice 19: on a busy machine a torch task's ``setup`` (a ResNet built and warmed up)
    took over 120 s, so the bound is generous; it only catches a task that will never be ready."""
    deadline = time.monotonic() + timeout_s
    while True:
        states = {t: client.get(t).state for t in task_ids}
        if all(s in ("PARKED", "RUNNING", "FROZEN") for s in states.values()):
            return
        if any(s in ("FAILED", "CANCELLED", "FINISHED") for s in states.values()) or time.monotonic() > deadline:
            raise RuntimeError(f"side tasks did not become resident: {states}")
        time.sleep(0.1)


# ---------------------------------------------------------------- trials


def trial_plan(modes: Sequence[str], task_sets: Sequence[str], rng: random.Random,
               naive_needs_instrumented: bool) -> list[tuple[str, str]]:
    """One trial's runs in a fresh random order: ``none`` and ``instrumented`` once, the other modes
    once per task set. ``naive_needs_instrumented``: its bubble time comes from the instrumented run
    of the trial, which then goes before the first naive run."""
    plan = [(m, "-") for m in ("none", "instrumented") if m in modes]
    plan += [(m, s) for s in task_sets for m in ("naive", "freeride-paper", "freeride") if m in modes]
    rng.shuffle(plan)
    if naive_needs_instrumented and ("instrumented", "-") in plan:
        plan.remove(("instrumented", "-"))
        first_naive = next((i for i, (m, _) in enumerate(plan) if m == "naive"), len(plan))
        plan.insert(first_naive, ("instrumented", "-"))
    return plan


def method_notes(layout: Layout) -> list[str]:
    """The method, in words, for ``modes.md``."""
    return [
        "- **Pairs.** Every trial runs each mode (and task set) once in a fresh random order, next to one `none` "
        "run; an overhead is the mean over trials of T_mode / T_none - 1 of the same trial (T: mean iteration "
        "time after the warm-up), with a Student-t 95% interval over the trials (scipy's t quantile: for 2 "
        "trials it is 12.7, not the 1.96 of a normal approximation).",
        "- **Stopping.** Trials are added until every watched overhead's 95% half-width is within the target, or "
        "the trial or time budget is spent; the line above says which, and how many trials the observed spread "
        "would need.",
        "- **Harvest.** H = standalone-equivalent work / bubble time over the bubbles that start after the warm-up, "
        "from the managers' traces (`freeride.harvest.harvest`, the same function as the demo's); standalone "
        "throughput measured in each trial, before its runs, by the demo's probe (`run_standalone`, pinned, normal "
        "priority). The breakdown cuts every bubble into labelled pieces that cover it.",
        "- **Percentiles** are nearest-rank (`freeride.measure.percentile`), in the managers' figures too.",
        "- **Layout.** " + layout.description,
    ]


def run_trials(settings: Settings, modes: Sequence[str], task_sets: Sequence[str], rule: StopRule,
               standalone_s: float, rng: random.Random) -> tuple[list[RunResult], list[dict[str, float]],
                                                                 list[dict[str, float]], StopDecision]:
    """Trials until the stopping rule says stop; every run, the standalone rates and median steps (ms) per
    trial, the decision."""
    layout = settings.layout
    needed = sorted({t for s in task_sets for t in TASK_SETS[s]} if set(modes) - {"none", "instrumented"} else set())
    runs: list[RunResult] = []
    all_rates: list[dict[str, float]] = []
    all_steps: list[dict[str, float]] = []
    started = time.monotonic()
    trial = 0
    while True:
        trial_dir = settings.root / f"t{trial}-standalone"
        trial_dir.mkdir(parents=True)
        rates, step_ms = standalone_rates(needed, layout.devices[-1], standalone_s, trial_dir) if needed else ({}, {})
        all_rates.append(rates)
        all_steps.append(step_ms)
        instrumented_b: float | None = None
        for mode, task_set in trial_plan(modes, task_sets, rng, isinstance(layout, TwoStageLayout)):
            result = run_once(mode, task_set, trial, settings, rates, instrumented_b)
            if mode == "instrumented":
                instrumented_b = result.bubble_s
            runs.append(result)
            h = result.work_s / result.bubble_s if result.bubble_s else 0.0
            print(f"bench: trial {trial} {mode:15s} {task_set:9s} iteration {result.iteration_ms:7.1f} ms "
                  f"B {result.bubble_s:6.2f} s work {result.work_s:6.2f} s H {h:5.2f} ({result.wall_s:.0f} s, "
                  f"load {result.loadavg:.2f})", flush=True)
        trial += 1
        decision = stop_decision(rule, gated_intervals(runs, task_sets), trial, time.monotonic() - started)
        print(f"bench: after trial {trial - 1}: {decision.reason}", flush=True)
        if decision.stop:
            return runs, all_rates, all_steps, decision


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def make_layout(args: argparse.Namespace, p: argparse.ArgumentParser) -> Layout:
    cores = sorted(os.sched_getaffinity(0))
    try:
        stage = tuple(int(x) for x in args.stage.split("/"))
        if len(stage) != 3:
            raise ValueError
    except ValueError:
        p.error(f"--stage must be INDEX/STAGES/MICROBATCHES, got {args.stage!r}")
    index, stages, microbatches = stage
    if (args.peer_forward_ms is None) != (args.peer_backward_ms is None):
        p.error("--peer-forward-ms and --peer-backward-ms go together")
    if args.layout == "two-stage-cpu" and not args.single_stage:
        if args.peer_forward_ms is not None:
            p.error("--peer-forward-ms is for the single-stage layouts (the two-stage trainer has no emulated peers)")
        return two_stage_cpu(cores)
    if args.single_stage:
        layout = single_stage_device(args.single_stage, (index, stages, microbatches), cores)
    else:
        layout = single_stage_cpu(cores, (index, stages, microbatches))
    if args.peer_forward_ms is not None:
        if not (args.peer_forward_ms > 0 and args.peer_backward_ms > 0):
            p.error("--peer-forward-ms and --peer-backward-ms must be > 0")
        layout = dataclasses.replace(layout, peer_forward_ms=args.peer_forward_ms,
                                     peer_backward_ms=args.peer_backward_ms)
    return layout


def render(out: Path, doc: dict[str, Any], readme: Path | None,
           stem: str = DEFAULT_STEM) -> tuple[dict[str, Any], dict[str, Any]]:
    """Write ``<stem>.md`` and ``<stem>.png`` from a results document; rewrite the README block if asked.

    The summary is computed afresh from the document's runs, so a re-render (``--render-only``) shows
    what the report code says of them now. An older document's runs are brought up to date in place."""
    runs = [RunResult.from_json(r) for r in doc["runs"]]
    if doc["meta"].get("run_iterations") != "measured":
        # Results written before runs recorded their measured iterations hold the total, warm-up included;
        # the saving's T must cover the iterations after the warm-up only, as its work does.
        runs = [dataclasses.replace(r, iterations=r.iterations - int(doc["meta"]["warmup"])) for r in runs]
        doc["runs"] = [dataclasses.asdict(r) for r in runs]  # the document says so from now on
        doc["meta"] = {**doc["meta"], "run_iterations": "measured"}
    task_sets = list(dict.fromkeys(r.task_set for r in runs if r.task_set != "-"))
    meta = {**doc["meta"], "interfered": interfered(runs), "run_iterations": "measured"}
    table = summarize(runs, task_sets, devices=len(meta["devices"]))
    write_markdown(out / f"{stem}.md", meta, table)
    plot(out / f"{stem}.png", table)
    if readme is not None:
        link = os.path.relpath(out / f"{stem}.md", readme.parent)
        if not update_readme(readme, readme_block(meta, table, link, stem), stem):
            print(f"bench: {readme} has no generated block for {stem} to update (markers missing)", file=sys.stderr)
    return meta, table


def parse_args(argv: list[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """The options, a preset's values in place of the defaults, explicit options over both."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=tuple(PRESETS), default="full",
                   help="full (default, ~35 min), short (~7 min) or reference-scale (the reference's bubble and "
                   "step sizes, ~15 min): see bench/modes_presets.py; other options override it")
    p.add_argument("--peer-forward-ms", type=float, default=None,
                   help="single-stage: fix the emulated neighbours' forward (else the calibration run's)")
    p.add_argument("--peer-backward-ms", type=float, default=None,
                   help="single-stage: fix the emulated neighbours' backward (else the calibration run's)")
    p.add_argument("--stem", default=DEFAULT_STEM, help="results file names: STEM.json, .md, .png (default: modes, "
                   "or the preset's)")
    p.add_argument("--layout", choices=("single-stage-cpu", "two-stage-cpu"), default="single-stage-cpu",
                   help="single-stage-cpu (default: mirrors a GPU host) or two-stage-cpu (the stress case)")
    p.add_argument("--single-stage", metavar="DEVICE", default=None,
                   help="the single-stage layout on DEVICE (cuda:0, or a chosen cpu:K)")
    p.add_argument("--stage", default="1/4/8", help="single-stage: INDEX/STAGES/MICROBATCHES (default %(default)s)")
    p.add_argument("--iterations", type=int, default=28)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--task-sets", default="pagerank,image,training,mix",
                   help=f"comma-separated, of: {', '.join(TASK_SETS)} (default %(default)s)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--trainer-args", default=None,
                   help="model options for the trainer (default: the demo's for the device kind; CPU: --d-model 256)")
    p.add_argument("--standalone-s", type=float, default=2.0)
    p.add_argument("--min-trials", type=int, default=3)
    p.add_argument("--max-trials", type=int, default=40)
    p.add_argument("--budget-min", type=float, default=33.0, help="wall time the trials may take (minutes)")
    p.add_argument("--target-pp", type=float, default=1.0, help="95%% half-width to reach, percentage points")
    p.add_argument("--label", default="", help="marks the results (e.g. 'validation run, shortened')")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None,
                   help="results directory (default bench/results/cpu, or bench/results/gpu-<model> on a GPU)")
    p.add_argument("--update-readme", metavar="README", default=None,
                   help="rewrite the README's generated block of STEM")
    p.add_argument("--render-only", action="store_true", help="re-render from --out/STEM.json, run nothing")
    p.add_argument("--keep", action="store_true", help="keep the per-run directories (logs, traces)")
    preset = p.parse_known_args(argv)[0].preset
    p.set_defaults(**PRESETS[preset])
    return p, p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    p, args = parse_args(argv)
    kind = "cuda" if (args.single_stage or "").startswith("cuda") else "cpu"
    if args.out is None:
        from bench.machine import gpu_info, gpu_slug

        args.out = str(REPO / "bench" / "results" / (f"gpu-{gpu_slug(gpu_info())}" if kind == "cuda" else "cpu"))
    if args.trainer_args is None:
        args.trainer_args = " ".join(trainer_model_args(kind))
    if kind == "cuda":  # the GPU plan: side tasks sized for GPU bubbles, caps that hold a context
        TASKS.clear()
        TASKS.update(task_plan("cuda"))
    out = Path(args.out)
    readme = Path(args.update_readme) if args.update_readme else None
    results = out / f"{args.stem}.json"
    if args.render_only:
        doc = json.loads(results.read_text())
        doc["meta"], doc["summary"] = render(out, doc, readme, args.stem)
        results.write_text(json.dumps(doc, indent=1, default=str))
        return 0
    layout = make_layout(args, p)
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
    rule = StopRule(args.target_pp / 100, args.min_trials, args.max_trials, args.budget_min * 60)
    # SIGTERM unwinds like Ctrl-C, so that every manager, trainer and naive task is stopped.
    signal.signal(signal.SIGTERM, _interrupt)
    out.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="freeride-bench-"))
    print(f"bench: layout {layout.name}; runs under {root}", flush=True)
    load_start = os.getloadavg()
    started = time.time()
    # Calibration: managers up, no side task. Its bubbles give the reference policy's offline profile,
    # and its learned stage costs fix the emulated neighbours for every run that follows.
    cal = root / "calibration"
    cal.mkdir()
    sock_dir = Path(tempfile.mkdtemp(prefix="frb-", dir="/tmp"))
    extra = tuple(shlex.split(args.trainer_args))
    with managers(layout, cal, sock_dir, "freeride", None):
        run_trainer(layout.trainer_argv(args.iterations, args.warmup, cal / "iterations.jsonl", extra,
                                        f"unix:{sock_dir}/{{slug}}.sock"), cal)
    shutil.rmtree(sock_dir, ignore_errors=True)
    layout = layout.calibrated(read_iterations(layout, cal / "iterations.jsonl"))
    profile_path = root / "paper-profile.json"
    profile = paper_profile(layout, cal / "iterations.jsonl", profile_path)
    print(f"bench: calibrated; {layout.description}\nbench: paper profile (min ns per stage/slot) {profile}",
          flush=True)
    settings = Settings(layout, args.iterations, args.warmup, extra, root, profile_path)
    runs, all_rates, all_steps, decision = run_trials(settings, modes, task_sets, rule, args.standalone_s,
                                                      random.Random(args.seed))
    table = summarize(runs, task_sets, devices=len(layout.devices))
    command = "python -m bench.bench_modes " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    trials = 1 + max(r.trial for r in runs)
    meta = {"machine": machine_info(), "layout": layout.to_json(), "devices": list(layout.devices),
            "trainer": layout.trainer_text(), "trainer_args": args.trainer_args, "iterations": args.iterations,
            "warmup": args.warmup, "trials": trials, "command": command, "wall_s": time.time() - started,
            "run_iterations": "measured",
            "label": args.label, "loadavg": {**loadavg_summary(r.loadavg for r in runs), "at_start": load_start,
                                             "at_end": os.getloadavg()},
            "stop": {"reason": decision.reason, "converged": decision.converged,
                     "trials_needed": dict(decision.trials_needed or {}), **dataclasses.asdict(rule)},
            "preset": args.preset,
            "tasks": {k: {"target": v.target, "args": v.args, "memory_bytes": v.memory_bytes}
                      for k, v in TASKS.items() if any(k in TASK_SETS[s] for s in task_sets)},
            "fit_note": "bubbles long enough that the task set's slowest step, alone, is at most a tenth of them",
            "method": method_notes(layout), "standalone_rates": all_rates, "standalone_step_ms": all_steps,
            "paper_profile_ns": profile,
            "interfered": interfered(runs)}
    doc = {"meta": meta, "summary": table, "runs": [dataclasses.asdict(r) for r in runs]}
    results.write_text(json.dumps(doc, indent=1, default=str))
    render(out, doc, readme, args.stem)
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    print((out / f"{args.stem}.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
