"""The demo's figures, their consistency checks and their rendering: pure functions on plain data.

Inputs are what the demo's processes left behind: the trainer's iteration logs (one JSON line per
iteration and rank, see :mod:`freeride.workload.run`) of the baseline run and of the run with side
tasks, each manager's :class:`~freeride.messages.ManagerStats`, task list and trace (``--trace``)
taken when training ended, and each side task's standalone throughput. The arithmetic is
:mod:`freeride.measure`'s and :mod:`freeride.harvest`'s:

* **bubble fraction** of a stage: its measured bubble time over its training time, both summed
  over the iterations after the warm-up; learned slots (recurring waits the schedule model does not
  list, which the instrumentation learned and reports as slots of their own) count in it and are
  shown apart ("of it learned");
* **training time** ``T`` of a run: the slowest stage's summed iteration time after the warm-up
  (the stages of a pipeline finish an iteration together, so they differ by noise only), and the
  **overhead** ``T_with / T_base - 1``;
* **harvest efficiency** of a device: :func:`freeride.harvest.harvest` on its manager's trace, over
  the bubbles after the warm-up and after every task's first step (:func:`freeride.harvest.steady_window`,
  the window the bench uses): the steps of those bubbles' grants, each
  worth its task's standalone seconds per step, over their bubble time; with the breakdown of that
  bubble time (work, slower steps, grant latency, margins...). The bench computes H with the same
  function, the same window and the same yardstick (:mod:`freeride._demo.probe`, one device at a
  time), so the two differ only by what they run (layout, tasks per device, run length);
* **harvested** time: the step time the manager counted inside grants (its own statistics, whole run).

Consistency checks (:func:`check_consistency`) are the invariants a correct run satisfies whatever
the machine's load: a device never harvests more than its bubble time, every side task made
progress and none failed, every stage logged every iteration, bubble fractions lie in [0, 1].
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from freeride import harvest as harvest_mod
from freeride import measure
from freeride.errors import FreerideError
from freeride.messages import ManagerStats, TaskInfo
from freeride.states import TaskState
from freeride.training.learned_slots import LEARNED_KIND
from freeride.units import format_p99_ms

#: Slack for comparing two sums of float milliseconds (harvested vs bubble time).
_EPSILON_S = 1e-6


class DemoError(FreerideError):
    """The demo could not complete: a process failed or left unreadable output (message says which)."""


@dataclass(frozen=True)
class Bubble:
    """One measured bubble of an iteration (the trainer's log)."""

    slot: int
    kind: str
    start_ns: int
    length_ms: float
    predicted_ms: float


@dataclass(frozen=True)
class Iteration:
    """One iteration of one stage (rank), as the trainer logged it."""

    iteration: int
    stage: int
    device: str
    warmup: bool
    time_ms: float
    end_ns: int
    bubbles: tuple[Bubble, ...] = ()

    @property
    def start_ns(self) -> int:
        return self.end_ns - round(self.time_ms * 1e6)


def parse_iteration(record: Mapping[str, Any]) -> Iteration:
    """One log record; :class:`ValueError` naming the field when it is missing or malformed."""
    try:
        bubbles = tuple(
            Bubble(int(b["slot"]), str(b["kind"]), int(b["start_ns"]), float(b["length_ms"]), float(b["predicted_ms"]))
            for b in record.get("bubbles") or ()
        )
        return Iteration(
            iteration=int(record["iteration"]),
            stage=int(record["stage"]),
            device=str(record["device"]),
            warmup=bool(record.get("warmup", False)),
            time_ms=float(record["time_ms"]),
            end_ns=int(record["end_ns"]),
            bubbles=bubbles,
        )
    except KeyError as exc:
        raise ValueError(f"missing field {exc}") from None
    except (TypeError, ValueError) as exc:
        raise ValueError(f"malformed field: {exc}") from None


def read_iteration_log(path: Path) -> list[Iteration]:
    """The iterations of one rank's log, in order (its closing summary record is skipped)."""
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise DemoError(f"cannot read the trainer's iteration log {path}: {exc.strerror or exc}") from None
    iterations = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if record.get("summary"):
                continue
            iterations.append(parse_iteration(record))
        except (json.JSONDecodeError, ValueError, AttributeError) as exc:
            raise DemoError(f"{path}:{number}: not an iteration record: {exc}") from None
    return iterations


# ------------------------------------------------------------------ figures


@dataclass(frozen=True)
class StageFigures:
    """One pipeline stage in the run with side tasks (times in the units their names say)."""

    stage: int
    device: str
    iterations: int  # logged, warm-up included
    measured_iterations: int  # after the warm-up
    iteration_ms_p50: float
    bubbles_per_iteration: float
    bubble_ms_p50: float
    train_s: float  # summed iteration time after the warm-up
    bubble_s: float  # summed bubble time after the warm-up
    bubble_fraction: float
    run_bubble_s: float  # summed bubble time of every iteration: what side tasks could harvest
    #: Of ``bubble_s``: learned slots (recurring waits the schedule model does not list), over train_s.
    learned_fraction: float = 0.0


@dataclass(frozen=True)
class TaskFigures:
    """One side task at the end of training."""

    task_id: str
    name: str
    device: str
    target: str
    state: str
    progress: float
    progress_unit: str
    steps: int
    harvested_s: float
    step_p95_ms: float
    standalone_per_s: float | None  # progress per second alone on the same device
    work_s: float | None  # progress after the warm-up as seconds of standalone work
    efficiency: float | None  # work_s over the device's bubble time after the warm-up
    failure: dict[str, Any] | None = None


@dataclass(frozen=True)
class DeviceFigures:
    """One device: its bubbles, what its manager harvested, and the harvest efficiency."""

    device: str
    stage: int
    bubble_s: float  # bubble time after the warm-up, from the manager's trace (the window of the efficiency)
    manager_bubbles: int
    manager_bubble_s: float  # the manager's own sum of the bubbles it was told about
    harvested_s: float
    harvested_share: float | None  # harvested_s / manager_bubble_s
    work_s: float | None  # summed over its tasks (None when a task's throughput is unknown)
    efficiency: float | None  # work_s / bubble_s
    overruns: int
    grant_latency_p99_ms: float | None  # None: none measured
    park_latency_p99_ms: float | None
    breakdown: dict[str, float] | None = None  # share of bubble_s per freeride.harvest category


@dataclass(frozen=True)
class DemoSummary:
    """Everything the demo prints and writes to ``summary.json``."""

    device_kind: str
    devices: tuple[str, ...]
    iterations: int
    warmup_iterations: int
    baseline_s: float
    with_tasks_s: float
    overhead: float
    stages: tuple[StageFigures, ...]
    device_figures: tuple[DeviceFigures, ...]
    tasks: tuple[TaskFigures, ...]
    problems: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    wall_s: float = 0.0
    files: dict[str, str] = field(default_factory=dict)
    processes: dict[str, int] = field(default_factory=dict)

    @property
    def consistent(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["consistent"] = self.consistent
        return doc


def _median(values: Sequence[float]) -> float:
    return measure.percentile(values, 50) if values else 0.0


def measured(iterations: Sequence[Iteration]) -> list[Iteration]:
    """The iterations after the warm-up."""
    return [it for it in iterations if not it.warmup]


def stage_figures(iterations: Sequence[Iteration]) -> StageFigures:
    """Figures of one stage from its iteration log (at least one iteration after the warm-up)."""
    if not iterations:
        raise DemoError("a stage logged no iterations")
    after = measured(iterations)
    if not after:
        raise DemoError(f"stage {iterations[0].stage} logged only warm-up iterations")
    train_s = sum(it.time_ms for it in after) / 1e3
    bubble_s = sum(b.length_ms for it in after for b in it.bubbles) / 1e3
    return StageFigures(
        stage=iterations[0].stage,
        device=iterations[0].device,
        iterations=len(iterations),
        measured_iterations=len(after),
        iteration_ms_p50=_median([it.time_ms for it in after]),
        bubbles_per_iteration=sum(len(it.bubbles) for it in after) / len(after),
        bubble_ms_p50=_median([b.length_ms for it in after for b in it.bubbles]),
        train_s=train_s,
        bubble_s=bubble_s,
        bubble_fraction=measure.bubble_fraction(bubble_s, train_s) if train_s > 0 else 0.0,
        run_bubble_s=sum(b.length_ms for it in iterations for b in it.bubbles) / 1e3,
        learned_fraction=(sum(b.length_ms for it in after for b in it.bubbles if b.kind == LEARNED_KIND) / 1e3
                          / train_s) if train_s > 0 else 0.0,
    )


def training_time_s(by_stage: Mapping[int, Sequence[Iteration]]) -> float:
    """``T`` of a run: the slowest stage's summed iteration time after the warm-up."""
    if not by_stage:
        raise DemoError("no stage logged any iteration")
    return max(sum(it.time_ms for it in measured(its)) / 1e3 for its in by_stage.values())


def task_figures(info: TaskInfo, device: str, standalone_per_s: float | None,
                 window_steps: int | None, device_bubble_s: float) -> TaskFigures:
    """One task's figures: ``window_steps`` of its steps ran in the bubbles after the warm-up (None:
    unknown, no trace); its efficiency is their standalone work over the device's bubble time there."""
    work_s = efficiency = None
    if standalone_per_s is not None and standalone_per_s > 0 and window_steps is not None:
        work_s = window_steps * harvest_mod.standalone_step_s(max(0.0, info.progress), info.steps, standalone_per_s)
        efficiency = work_s / device_bubble_s if device_bubble_s > 0 else 0.0
    failure = info.failure.to_json() if info.failure is not None else None
    return TaskFigures(
        task_id=info.task_id,
        name=info.spec.display_name,
        device=device,
        target=info.spec.target or " ".join(info.spec.command),
        state=info.state,
        progress=info.progress,
        progress_unit=info.progress_unit,
        steps=info.steps,
        harvested_s=info.harvested_s,
        step_p95_ms=info.step_p95_ms,
        standalone_per_s=standalone_per_s,
        work_s=work_s,
        efficiency=efficiency,
        failure=failure,
    )


def device_figures(device: str, stage: StageFigures, stats: ManagerStats, tasks: Sequence[TaskFigures],
                   harvest: harvest_mod.Harvest | None) -> DeviceFigures:
    works = [t.work_s for t in tasks]
    work_s = sum(w for w in works if w is not None) if tasks and None not in works else None
    bubble_s = harvest.bubble_s if harvest is not None else 0.0
    return DeviceFigures(
        device=device,
        stage=stage.stage,
        bubble_s=bubble_s,
        manager_bubbles=stats.bubbles,
        manager_bubble_s=stats.bubble_time_s,
        harvested_s=stats.harvested_s,
        harvested_share=stats.harvested_s / stats.bubble_time_s if stats.bubble_time_s > 0 else None,
        work_s=work_s,
        efficiency=work_s / bubble_s if work_s is not None and bubble_s > 0 else None,
        overruns=stats.overruns,
        grant_latency_p99_ms=stats.grant_latency_ms.p99 if stats.grant_latency_ms.count else None,
        park_latency_p99_ms=stats.park_latency_ms.p99 if stats.park_latency_ms.count else None,
        breakdown=harvest.shares() if harvest is not None and harvest.bubble_s > 0 else None,
    )


def measurement_window(run: Mapping[int, Sequence[Iteration]]) -> tuple[int, int]:
    """The bench's window (:func:`freeride.harvest.measurement_window`) on parsed iterations: from the
    end of the last warm-up iteration of any stage to the end of the last iteration."""
    return harvest_mod.window_of(
        [{"iteration": it.iteration, "warmup": it.warmup, "end_ns": it.end_ns, "time_ms": it.time_ms} for it in its]
        for its in run.values()
    )


def summarize(
    *,
    device_kind: str,
    devices: Sequence[str],
    iterations: int,
    warmup_iterations: int,
    baseline: Mapping[int, Sequence[Iteration]],
    run: Mapping[int, Sequence[Iteration]],
    manager_stats: Mapping[str, ManagerStats],
    tasks: Mapping[str, Sequence[TaskInfo]],
    standalone_per_s: Mapping[str, float | None],
    traces: Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
) -> DemoSummary:
    """The demo's figures and their consistency checks.

    Args:
        baseline, run: iterations per stage of the run without side tasks and of the run with them.
        manager_stats: per device, its manager's statistics when training ended.
        tasks: per device, its manager's tasks when training ended.
        standalone_per_s: per task name, its standalone throughput on its device (None: unknown).
        traces: per device, its manager's trace records; a device without one has no efficiency.
    """
    stages = tuple(stage_figures(run[s]) for s in sorted(run))
    stage_of = {st.device: st for st in stages}
    missing = [d for d in devices if d not in stage_of]
    if missing:
        raise DemoError(f"no stage of the training run ran on {', '.join(missing)} (stages ran on "
                        f"{', '.join(stage_of) or 'nothing'})")
    task_figs: list[TaskFigures] = []
    dev_figs: list[DeviceFigures] = []
    window = harvest_mod.steady_window([records for records in (traces or {}).values()], measurement_window(run))
    for device in devices:
        stage = stage_of[device]
        infos = list(tasks.get(device, ()))
        records = (traces or {}).get(device)
        harvested: harvest_mod.Harvest | None = None
        if records:
            step_s = {}
            for info in infos:
                rate = standalone_per_s.get(info.spec.display_name)
                if rate is not None and rate > 0 and math.isfinite(info.progress):
                    step_s[info.task_id] = harvest_mod.standalone_step_s(max(0.0, info.progress), info.steps, rate)
            harvested = harvest_mod.harvest([records], step_s, window)
        figs = [
            task_figures(info, device, standalone_per_s.get(info.spec.display_name),
                         harvested.steps.get(info.task_id, 0) if harvested is not None else None,
                         harvested.bubble_s if harvested is not None else 0.0)
            for info in infos
        ]
        task_figs += figs
        if device in manager_stats:
            dev_figs.append(device_figures(device, stage, manager_stats[device], figs, harvested))
    t_base = training_time_s(baseline)
    t_with = training_time_s(run)
    summary = DemoSummary(
        device_kind=device_kind,
        devices=tuple(devices),
        iterations=iterations,
        warmup_iterations=warmup_iterations,
        baseline_s=t_base,
        with_tasks_s=t_with,
        overhead=measure.overhead(t_with, t_base),
        stages=stages,
        device_figures=tuple(dev_figs),
        tasks=tuple(task_figs),
    )
    problems = check_consistency(summary, expected_devices=devices)
    notes = tuple(
        f"{t.name}: {100 * t.efficiency:.0f}% of the device's bubble time in standalone work is more than "
        "the bubbles held: its standalone measurement ran slower than its steps in bubbles (other load)"
        for t in task_figs
        if t.efficiency is not None and t.efficiency > 1.0
    )
    return dataclasses.replace(summary, problems=tuple(problems), notes=notes)


def check_consistency(summary: DemoSummary, expected_devices: Sequence[str] = ()) -> list[str]:
    """What a correct run can never show, in words; empty when the summary is consistent."""
    problems: list[str] = []
    for stage in summary.stages:
        if stage.iterations != summary.iterations:
            problems.append(f"stage {stage.stage} logged {stage.iterations} of {summary.iterations} iterations")
        if not 0.0 <= stage.bubble_fraction <= 1.0:
            problems.append(f"stage {stage.stage}: bubble fraction {stage.bubble_fraction:.3f} is outside [0, 1]")
    reported = {d.device for d in summary.device_figures}
    for device in expected_devices:
        if device not in reported:
            problems.append(f"{device}: its manager's statistics are missing")
    for dev in summary.device_figures:
        if dev.harvested_s > dev.manager_bubble_s + _EPSILON_S:
            problems.append(
                f"{dev.device}: harvested {dev.harvested_s:.3f} s, more than its {dev.manager_bubble_s:.3f} s "
                "of bubble time"
            )
    if expected_devices and not summary.tasks:
        problems.append("no side task ran")
    for task in summary.tasks:
        if task.state == TaskState.FAILED.value:
            failure = task.failure or {}
            problems.append(f"{task.name} ({task.task_id}) FAILED: {failure.get('kind', '?')}: "
                            f"{failure.get('message', 'no failure record')}")
        if not task.progress > 0:
            problems.append(f"{task.name} ({task.task_id}) made no progress")
    return problems


# ------------------------------------------------------------------ rendering


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _number(value: float) -> str:
    if value >= 100 or value == int(value):
        return f"{value:,.0f}"
    return f"{value:.3g}"


def _table(rows: list[list[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]


def render_summary(summary: DemoSummary) -> str:
    """The human summary the demo prints at the end."""
    kind = "GPUs" if summary.device_kind == "cuda" else "CPU cores"
    lines = [
        f"freeride demo: a 2-stage 1F1B GPT on {kind} {', '.join(summary.devices)}, {summary.iterations} "
        f"iterations ({summary.warmup_iterations} warm-up), {len(summary.tasks)} side tasks",
        "",
        "training (after the warm-up)",
    ]
    rows = [["stage", "device", "iteration p50", "bubbles/iter", "bubble p50", "bubble fraction",
             "learned (of iteration)"]]
    for st in summary.stages:
        rows.append([str(st.stage), st.device, f"{st.iteration_ms_p50:.1f} ms", f"{st.bubbles_per_iteration:.1f}",
                     f"{st.bubble_ms_p50:.1f} ms", _pct(st.bubble_fraction), _pct(st.learned_fraction)])
    lines += _table(rows)
    lines += [
        f"  training time: {summary.baseline_s:.2f} s without side tasks, {summary.with_tasks_s:.2f} s with "
        f"freeride and side tasks: overhead {100 * summary.overhead:+.1f}%",
        "  (one baseline run against one run on a possibly busy machine: indicative only; the bench "
        "measures overhead with interleaved trials)",
        "",
        "harvest (bubbles after the warm-up, from the managers' traces)",
    ]
    rows = [["device", "bubble time", "harvested of the manager's bubble time (whole run)", "standalone work",
             "efficiency",
             "overruns", "grant p99", "park p99"]]
    for dev in summary.device_figures:
        work = "-" if dev.work_s is None else f"{dev.work_s:.2f} s"
        rows.append([dev.device, f"{dev.bubble_s:.2f} s",
                     f"{dev.harvested_s:.2f} s of {dev.manager_bubble_s:.2f} s ({_pct(dev.harvested_share)})", work,
                     _pct(dev.efficiency), str(dev.overruns), format_p99_ms(dev.grant_latency_p99_ms),
                     format_p99_ms(dev.park_latency_p99_ms)])
    lines += _table(rows)
    lines += [
        "  bubble time and efficiency: the bubbles after the warm-up; harvested: the manager's count over the",
        "  whole run. efficiency = side-task steps x their standalone seconds per step / bubble time",
        "  (freeride.harvest, the bench's function). park p99: from the manager receiving a bubble's end to",
        "  the worker parked; 0 when the worker, reading the trainer's end board, parked before that",
    ]
    with_breakdown = [dev for dev in summary.device_figures if dev.breakdown]
    if with_breakdown:
        lines += ["", "where the bubble time went"]
        rows = [["", *(dev.device for dev in with_breakdown)]]
        for category in harvest_mod.CATEGORIES:
            if any(abs((dev.breakdown or {}).get(category, 0.0)) >= 0.0005 for dev in with_breakdown):
                rows.append([harvest_mod.CATEGORY_TEXT[category],
                             *(_pct((dev.breakdown or {}).get(category, 0.0)) for dev in with_breakdown)])
        lines += _table(rows)
        # Stranger trial: "work 2.1%" here against "efficiency 2.3%" above read as two figures that disagree.
        lines.append("  the work here is what ran inside the bubbles; the efficiency above also counts the part of "
                     "steps that ran past a bubble's end")
    lines += [
        "",
        "side tasks (as the managers had them when training ended, before they were stopped)",
    ]
    rows = [["task", "device", "state", "progress", "standalone", "harvested", "step p95", "efficiency"]]
    for t in summary.tasks:
        alone = "-" if t.standalone_per_s is None else f"{_number(t.standalone_per_s)} {t.progress_unit}/s"
        rows.append([f"{t.name} ({t.task_id})", t.device, t.state, f"{_number(t.progress)} {t.progress_unit}", alone,
                     f"{t.harvested_s:.2f} s", f"{t.step_p95_ms:.2f} ms", _pct(t.efficiency)])
    lines += _table(rows)
    for t in summary.tasks:
        if t.failure:
            lines.append(f"  {t.name} failed: {t.failure.get('kind')}: {t.failure.get('message')}")
    lines.append("")
    if summary.problems:
        lines.append("INCONSISTENT:")
        lines += [f"  - {p}" for p in summary.problems]
    else:
        lines.append("checks: harvested <= bubble time on every device; every side task progressed; none failed")
    lines += [f"note: {n}" for n in summary.notes]
    if summary.files:
        lines.append("")
        lines += [f"{name + ':':<10} {path}" for name, path in summary.files.items()]
    if summary.wall_s:
        lines.append(f"demo wall time: {summary.wall_s:.0f} s")
    return "\n".join(lines)

