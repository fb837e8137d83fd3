"""``freeride bench``'s records and arithmetic: pure functions of what its runs measured.

A **trial** runs the user's command once in each mode, in a fresh random order
(:func:`trial_plan`): ``alone`` (no manager: the baseline), ``managers`` (a manager per device, no
side task: what reporting and the managers cost) and ``tasks`` (the managers with the submitted side
tasks). Every figure is computed per trial and then summarised over the trials, which are the
independent samples; a trial cut short (Ctrl-C, a failure) counts for nothing.

* **overhead** of a mode: the mean over trials of ``T_mode / T_alone - 1`` with a Student-t 95%
  interval (:func:`freeride.measure.paired_overhead`), ``T`` the command's wall time.
* **bubble time** ``B``: the bubble time the managers measured, summed over the job's devices.
* **harvested time**: the time side tasks spent stepping inside those bubbles (the managers' figure).
* **side work** ``W``: each task's progress over its standalone throughput, measured in the same
  trial on the same kind of device (seconds the task would need with a device to itself); the
  **harvest efficiency** is ``H = W / B``.
* **saving** at price ratio ``r``: :func:`freeride.measure.cost_saving`, per trial, then its mean and
  interval; and its first term alone, ``W / (r n T)`` (``work_value``), which the report gives where the
  overhead with side tasks is not resolved (its noise is then most of the saving).

Nothing here starts a process or reads a clock: the bench (``freeride._cli.bench``) measures, this
module adds up, so the arithmetic is tested on plain numbers.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from freeride.measure import (
    PRICE_RATIO_TEXT,
    SAVING_TEXT,
    CostInputs,
    Interval,
    cost_saving,
    paired_overhead,
    t_interval,
)
from freeride.units import format_p99_ms

ALONE, MANAGERS, TASKS = "alone", "managers", "tasks"
MODES = (ALONE, MANAGERS, TASKS)
MODE_TEXT = {ALONE: "your command alone, no manager",
             MANAGERS: "managers up, no side task",
             TASKS: "managers with the side tasks"}


def trial_plan(with_tasks: bool, rng: random.Random) -> list[str]:
    """One trial's modes in a fresh random order (``tasks`` only when there are side tasks)."""
    modes = [ALONE, MANAGERS] + ([TASKS] if with_tasks else [])
    rng.shuffle(modes)
    return modes


def watched_modes(with_tasks: bool) -> tuple[str, ...]:
    """The modes whose overhead interval the stopping rule watches."""
    return (MANAGERS, TASKS) if with_tasks else (MANAGERS,)


@dataclass(frozen=True)
class TaskFigures:
    """One side task on one device at the end of a run, as its manager reported it."""

    name: str
    device: str
    state: str
    steps: int
    progress: float
    progress_unit: str
    harvested_s: float
    failure: str = ""


@dataclass(frozen=True)
class DeviceFigures:
    """One manager's statistics at the end of a run (``freeride stats``)."""

    device: str
    bubbles: int
    bubble_s: float
    granted_s: float
    harvested_s: float
    overruns: int
    #: None where the manager measured none (a distribution with no sample: its p99 read 0.00 ms).
    overrun_p99_ms: float | None
    grant_p99_ms: float | None
    park_p99_ms: float | None
    tasks: tuple[TaskFigures, ...] = ()


@dataclass(frozen=True)
class Run:
    """One run of the command in one mode of one trial (trial -1: a warm-up run, not counted)."""

    trial: int
    mode: str
    wall_s: float
    devices: tuple[DeviceFigures, ...] = ()
    loadavg: float | None = None

    @property
    def bubble_s(self) -> float:
        return sum(d.bubble_s for d in self.devices)

    @property
    def harvested_s(self) -> float:
        return sum(d.harvested_s for d in self.devices)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Run:
        devices = tuple(DeviceFigures(**{**d, "tasks": tuple(TaskFigures(**t) for t in d.get("tasks", ()))})
                        for d in doc.get("devices", ()))
        return cls(int(doc["trial"]), str(doc["mode"]), float(doc["wall_s"]), devices, doc.get("loadavg"))


def work_s(run: Run, rates: Mapping[str, float]) -> dict[str, float]:
    """Per task name, the standalone-equivalent seconds of its progress in ``run``, summed over devices.

    ``rates``: progress per second of each task alone (the same trial's measurement). A task with no
    rate is an error: a figure without its yardstick would be a guess.
    """
    out: dict[str, float] = {}
    for device in run.devices:
        for task in device.tasks:
            rate = rates.get(task.name)
            if not rate or not math.isfinite(rate) or rate <= 0:
                raise ValueError(f"no standalone throughput for task {task.name!r}")
            out[task.name] = out.get(task.name, 0.0) + task.progress / rate
    return out


def complete_trials(runs: Sequence[Run], with_tasks: bool) -> dict[int, dict[str, Run]]:
    """The trials that ran every mode, by trial, then by mode."""
    wanted = set(MODES if with_tasks else (ALONE, MANAGERS))
    trials: dict[int, dict[str, Run]] = {}
    for run in runs:
        if run.trial >= 0:
            trials.setdefault(run.trial, {})[run.mode] = run
    return {t: modes for t, modes in sorted(trials.items()) if wanted <= set(modes)}


def overhead_intervals(runs: Sequence[Run], with_tasks: bool) -> dict[str, Interval]:
    """The overhead of every watched mode against ``alone``, over the complete trials."""
    trials = complete_trials(runs, with_tasks)
    out: dict[str, Interval] = {}
    for mode in watched_modes(with_tasks):
        if trials:
            out[mode] = paired_overhead([t[mode].wall_s for t in trials.values()],
                                        [t[ALONE].wall_s for t in trials.values()])
    return out


def _interval(values: Sequence[float]) -> dict[str, Any] | None:
    return t_interval(values).to_json() if values else None


def _mean(values: Sequence[float]) -> float | None:
    return math.fsum(values) / len(values) if values else None


def summarize(runs: Sequence[Run], rates: Mapping[int, Mapping[str, float]], devices: int,
              price_ratios: Sequence[float]) -> dict[str, Any]:
    """Every figure of the module docstring over the complete trials, as one JSON-able document.

    ``rates``: per trial, each task's standalone progress per second; ``devices``: the training
    devices (``n`` of the saving).
    """
    with_tasks = any(r.mode == TASKS for r in runs)
    trials = complete_trials(runs, with_tasks)
    doc: dict[str, Any] = {"trials": len(trials), "devices": devices, "with_tasks": with_tasks}
    doc["alone_s"] = _mean([t[ALONE].wall_s for t in trials.values()])
    doc["overhead"] = {mode: iv.to_json() for mode, iv in overhead_intervals(runs, with_tasks).items()}
    managed = [t[mode] for t in trials.values() for mode in ((MANAGERS, TASKS) if with_tasks else (MANAGERS,))]
    doc["bubbles_per_run"] = _mean([float(sum(d.bubbles for d in r.devices)) for r in managed])
    doc["bubble_s"] = _mean([r.bubble_s for r in managed])
    # Bubble time over device time: n devices for the wall time of each managed run.
    doc["bubble_share"] = _mean([r.bubble_s / (devices * r.wall_s) for r in managed if r.wall_s > 0])
    doc["no_bubbles"] = sorted({d.device for r in managed for d in r.devices if d.bubbles == 0})
    if not with_tasks:
        return doc
    task_runs = {t: modes[TASKS] for t, modes in trials.items()}
    works = {t: work_s(r, rates[t]) for t, r in task_runs.items()}
    # The base of the harvest's shares: the bubbles of the runs with side tasks (``bubble_s`` pools the runs
    # with managers only too, and 2.91 s over it did not read as the share printed beside it).
    doc["task_bubble_s"] = _mean([r.bubble_s for r in task_runs.values()])
    doc["harvested_s"] = _interval([r.harvested_s for r in task_runs.values()])
    doc["harvested_share"] = _interval([r.harvested_s / r.bubble_s for r in task_runs.values() if r.bubble_s > 0])
    doc["work_s"] = _interval([math.fsum(w.values()) for w in works.values()])
    doc["harvest_efficiency"] = _interval([math.fsum(works[t].values()) / r.bubble_s
                                           for t, r in task_runs.items() if r.bubble_s > 0])
    names = list(dict.fromkeys(task.name for r in task_runs.values() for d in r.devices for task in d.tasks))
    doc["tasks"] = [_task_row(name, task_runs, works, rates) for name in names]
    doc["saving"], doc["work_value"] = {}, {}
    for ratio in price_ratios:
        values = [cost_saving(CostInputs(math.fsum(works[t].values()), trials[t][TASKS].wall_s,
                                         trials[t][ALONE].wall_s, devices), ratio) for t in trials]
        doc["saving"][f"{ratio:g}x"] = _interval(values)
        # The saving's first term alone, W / (r n T): what the side work is worth, the saving were dT 0. Where the
        # overhead is not resolved, dT's noise is most of the saving (a run 17 s faster by chance read +25% at
        # every ratio, of which the work was worth under 1%).
        doc["work_value"][f"{ratio:g}x"] = _mean([math.fsum(works[t].values()) / ratio
                                                  / (devices * trials[t][ALONE].wall_s) for t in trials])
    overruns = [d for r in task_runs.values() for d in r.devices]
    doc["overruns_per_run"] = _mean([float(sum(d.overruns for d in r.devices)) for r in task_runs.values()])
    for key in ("overrun_p99_ms", "grant_p99_ms", "park_p99_ms"):
        doc[key] = max((v for d in overruns if (v := getattr(d, key)) is not None), default=None)
    doc["finished"] = sorted({f"{t.name} on {d.device}" for r in task_runs.values() for d in r.devices
                              for t in d.tasks if t.state == "FINISHED"})
    return doc


def _task_row(name: str, task_runs: Mapping[int, Run], works: Mapping[int, Mapping[str, float]],
              rates: Mapping[int, Mapping[str, float]]) -> dict[str, Any]:
    progress = [sum(t.progress for d in r.devices for t in d.tasks if t.name == name) for r in task_runs.values()]
    unit = next((t.progress_unit for r in task_runs.values() for d in r.devices for t in d.tasks if t.name == name),
                "steps")
    return {"name": name, "progress_unit": unit, "progress": _mean(progress),
            "work_s": _mean([w.get(name, 0.0) for w in works.values()]),
            "standalone_per_s": _mean([rates[t][name] for t in task_runs if name in rates[t]])}


# ------------------------------------------------------------------ text


def fmt_interval(iv: Mapping[str, Any] | None, pct: bool = True, digits: int = 1, share: bool = False,
                 nonnegative: bool = False) -> str:
    """``+1.2% (+0.3 .. +2.1)``, ``0.81 (0.77 .. 0.85)``; ``(one trial)`` where unbounded; ``-`` if none.

    ``share``: a part of a whole (``35.0% (12.0 .. 58.0)``): no sign, and the interval kept within 0 .. 100%
    (a t interval of two trials ran to -160 .. +270%). ``nonnegative``: a quantity that cannot be below 0
    (seconds of work): the interval's low end is kept at 0 or above."""
    if not iv or iv.get("estimate") is None:
        return "-"
    est, low, high = iv["estimate"], iv.get("low"), iv.get("high")
    if share:
        low, high = (None if low is None else max(0.0, low)), (None if high is None else min(1.0, high))
    elif nonnegative and low is not None:
        low = max(0.0, low)
    if pct:
        sign = "" if share else "+"
        head, scale, spec = f"{100 * est:{sign}.{digits}f}%", 100.0, f"{sign}.{digits}f"
    else:
        head, scale, spec = f"{est:.{max(digits, 2)}f}", 1.0, f".{max(digits, 2)}f"
    if low is None or high is None:
        return f"{head} (one trial)"
    return f"{head} ({scale * low:{spec}} .. {scale * high:{spec}})"


#: How far H must exceed the harvested share for the report to say so (the two rates' noise is within it).
H_OVER_SHARE = 1.1


def render(summary: Mapping[str, Any], meta: Mapping[str, Any]) -> list[str]:
    """The report ``freeride bench`` prints, line by line."""
    devices = ", ".join(meta["devices"])
    out = [f"freeride bench: {summary['trials']} complete trial(s) of `{meta['command_text']}` on {devices}",
           f"  stop: {meta['stop']}",
           f"  load average (1 min) over the runs: {meta['loadavg']}"]
    if not summary["trials"]:
        return [*out, "  no trial completed: no figure to give"]
    oh = summary["overhead"]
    out += ["", f"  your command alone: {summary['alone_s']:.2f} s (mean wall time)",
            "  training overhead (wall time vs alone, mean of per-trial ratios, 95% t interval):",
            f"    {MODE_TEXT[MANAGERS]:34s} {fmt_interval(oh.get(MANAGERS))}"]
    if summary["with_tasks"]:
        out.append(f"    {MODE_TEXT[TASKS]:34s} {fmt_interval(oh.get(TASKS))}")
    out.append(f"  bubbles: {summary['bubbles_per_run']:.0f} a run, {summary['bubble_s']:.2f} s over "
               f"{summary['devices']} device(s) ({100 * summary['bubble_share']:.1f}% of their time)")
    if summary["no_bubbles"]:
        out.append(f"  no bubble was reported on {', '.join(summary['no_bubbles'])}: is a stage of the job there?")
    if not summary["with_tasks"]:
        return [*out, "  no side task given (--task): the managers' own overhead only"]
    out += [f"  harvested: {fmt_interval(summary['harvested_s'], pct=False, nonnegative=True)} s a run stepping in "
            f"bubbles, of the {summary['task_bubble_s']:.2f} s of bubbles a run with side tasks had: "
            f"{fmt_interval(summary['harvested_share'], share=True)} of them (the mean of each trial's share)",
            f"  side work: {fmt_interval(summary['work_s'], pct=False, nonnegative=True)} s a run of standalone "
            f"work; harvest efficiency H = work / bubble time {fmt_interval(summary['harvest_efficiency'], pct=False)}"
            " (the mean of each trial's)"]
    h, share = summary["harvest_efficiency"], summary["harvested_share"]
    if h and share and h.get("estimate") is not None and share.get("estimate") is not None \
            and h["estimate"] > share["estimate"] * H_OVER_SHARE:
        # Both as percentages to the same digit: "H is more than the share" beside H 0.02 and a share of 2.1%
        # (0.022 against 0.021) read as a contradiction; a difference that small is the rates' noise.
        out.append(f"  note: H ({100 * h['estimate']:.1f}%) is more than the share of the bubble time the tasks "
                   f"stepped in ({100 * share['estimate']:.1f}%): they did more work in bubbles than their rate "
                   "alone allows, so that rate (the yardstick) read low: was its core busy?")
    for row in summary["tasks"]:
        out.append(f"    {row['name']:20s} {row['progress']:.4g} {row['progress_unit']} a run = {row['work_s']:.2f} s "
                   f"of work alone (each trial at its own rate alone; their mean {row['standalone_per_s']:.4g} "
                   f"{row['progress_unit']}/s)")
    stalled = [row["name"] for row in summary["tasks"] if not row["progress"]]
    if stalled:
        # A task whose setup() outlasted the bubbles of every run showed 0 work and no word of why.
        out.append(f"  note: {', '.join(stalled)} made no progress in any run: a setup() longer than the bubbles a "
                   "run gives (it runs in them), or steps that fit no bubble? `freeride run-task` times both")
    if summary.get("finished"):
        # A stranger's PageRank finished in 5 iterations: the saving then printed at every price ratio was the
        # overhead's noise alone, and nothing said that the task's size, not the bubbles, bounded its work.
        out.append(f"  finished during a run (its work stopped there): {', '.join(summary['finished'])}: its size, "
                   "not the bubbles, bounded the side work and the saving below; give it more work (or no end) to "
                   "measure what the bubbles hold")
    out.append(f"  overruns: {summary['overruns_per_run']:.1f} a run, p99 {format_p99_ms(summary['overrun_p99_ms'])}; "
               f"grant p99 {format_p99_ms(summary['grant_p99_ms'])}, park p99 {format_p99_ms(summary['park_p99_ms'])}")
    out += ["", f"  saving = {SAVING_TEXT}", "  at price ratio r (an hour of a training device / an hour of a "
            "dedicated device that does the side work as fast):"]
    for key, iv in summary["saving"].items():
        text = PRICE_RATIO_TEXT.get(float(key.rstrip("x")), "")
        out.append(f"    {key:>5s}  {fmt_interval(iv)}" + (f"   {text}" if text else ""))
    tasks_overhead = summary["overhead"].get(TASKS) or {}
    low, high = tasks_overhead.get("low"), tasks_overhead.get("high")
    unresolved = low is None or high is None or low < 0 < high
    if unresolved and summary.get("work_value"):
        worth = " / ".join(f"{100 * v:+.2f}%" for v in summary["work_value"].values())
        out.append(f"  not resolved: the overhead with side tasks ({fmt_interval(tasks_overhead)}) may be 0, and its "
                   "noise is in every saving above; the side work alone is worth "
                   f"{worth} of the training cost at {' / '.join(summary['work_value'])} (the saving were the "
                   "overhead 0): more trials (--min-trials) resolve it")
    return out

