"""Validation of ``freeride plan``'s model against measured runs of the reference trainer.

For a few pipeline configurations the reference trainer (``python -m freeride.workload`` under
torchrun; on CPU one gloo rank per core, on GPU one NCCL rank per GPU) runs with ``--memory-probe``:
every iteration logs each stage's measured bubbles (slot, length), the time of every compute action,
and the memory the stage holds after every action, at every bubble start and after the schedule's
step (see :mod:`freeride.workload.memory_probe` for how memory is counted and why).

The model is then fed only with what the planner would be given -- the trainer's model dimensions
(:func:`freeride.training.memory.transformer_chunks`) and the measured action times -- and compared:

* **the model's inputs**: each model stage's median forward and backward time, plus the runtime's
  median work between two actions where no wait is expected (posting and completing transfers,
  the schedule's own Python: measured in the gaps outside the trainer's slots, added to every
  action's cost, since the simulator has free transfers); the model's iteration is the simulated
  makespan (:func:`freeride.training.schedules.schedule_from_orders`) plus the first stage's median time
  outside the schedule (zeroing, optimizer step: that stage ends the iteration last in these
  schedules, so its optimizer step is on the critical path).
* **slot lengths**: each slot the trainer reports (its layout is the schedule simulated at the
  reference 1 : 2 cost ratio; a slot is identified by the actions around it), its median measured
  length against the length of the same gap in the model fed with the measured costs
  (:func:`freeride.training.rank_slots.gap_length`).
* **bubble fraction per stage**: those slots' total over the iteration time (measured: the
  trainer's logged bubbles, per iteration, median).
* **memory held between actions** (:func:`freeride.training.memory.rank_memory`, runtime ``torch``): after
  every action (the median over iterations of each position), in every slot (the sample at its
  start; the ``boundary`` slot, which spans the optimizer step, is compared at the step's end, the
  larger of the two states the model takes), and each stage's peak over the iteration.
* **peak resident set growth** (CPU only): the process's RSS high-water mark minus its RSS before
  the model was built, against the model's peak. Reported but not comparable: it includes the
  optimizer step's temporaries, the backward's workspace, pages the allocator keeps after a free,
  and anything else the process touched.

Every figure is a relative error ``|model - measured| / measured``; the summary gives p50, p90 and the
maximum per quantity over all configurations, stages and slots.

Run (CPU, about a minute): ``python -m bench.bench_plan``
GPU (one GPU per stage, not run on this project's CI): ``python -m bench.bench_plan --device cuda
--out bench/results/gpu``. On CUDA the action times are host times around asynchronously queued
kernels (the instrumentation's caveat, docs/bubbles.md), and memory is
``torch.cuda.memory_allocated``.
Results: ``plan_validation.json`` (every number) and ``plan_validation.md`` in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.machine import machine_info
from freeride.measure import median, percentile
from freeride.training.memory import PRECISIONS, RUNTIMES, TransformerDims, rank_memory, transformer_chunks
from freeride.training.rank_slots import gap_length
from freeride.training.schedules import BOUNDARY, FORWARD, Schedule, build_schedule, schedule_from_orders

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class RunConfig:
    schedule: str
    microbatches: int
    virtual: int = 1

    @property
    def label(self) -> str:
        return f"{self.schedule} m={self.microbatches}" + (f" v={self.virtual}" if self.virtual > 1 else "")


#: The configurations run; p is the number of devices (2 on the CPU machine: one core per stage).
CONFIGS = (RunConfig("1f1b", 4), RunConfig("1f1b", 8), RunConfig("gpipe", 4), RunConfig("interleaved-1f1b", 4, 2))
#: The reference trainer's model (its defaults, spelled out: the model is fed the same numbers).
MODEL = {"vocab": 256, "d_model": 128, "heads": 4, "layers": 4, "seq_len": 64, "microbatch_size": 4}


# ---------------------------------------------------------------- running


def trainer_argv(cfg: RunConfig, stages: int, device: str, iterations: int, warmup: int, log: Path) -> list[str]:
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(stages),
            "-m", "freeride.workload", "--stages", str(stages), "--schedule", cfg.schedule,
            "--microbatches", str(cfg.microbatches), "--iterations", str(iterations), "--warmup", str(warmup),
            "--device", device, "--memory-probe", "--iteration-log", str(log)]
    if cfg.virtual > 1:
        argv += ["--virtual-stages", str(cfg.virtual)]
    for key, value in MODEL.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    return argv


def run_config(cfg: RunConfig, stages: int, device: str, iterations: int, warmup: int,
               work: Path) -> dict[int, list[dict[str, Any]]]:
    """One trainer run; per rank, its log records (iterations, then the summary line)."""
    log = work / f"{cfg.label.replace(' ', '_').replace('=', '')}.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1", FREERIDE_LOG_LEVEL="WARNING",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(trainer_argv(cfg, stages, device, iterations, warmup, log), env=env, capture_output=True,
                          text=True, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"{cfg.label}: the trainer failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    out = {}
    for rank in range(stages):
        path = log.with_name(f"{log.stem}.rank{rank}{log.suffix}")
        out[rank] = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return out


# ---------------------------------------------------------------- analysis (pure)


def _median(values: Sequence[float]) -> float:
    return median(values)


def measured_costs(
    runs: dict[int, list[dict[str, Any]]], layout: Schedule
) -> tuple[dict[int, tuple[float, float, float]], float, float]:
    """Per model stage (chunk): median forward and backward ms; the median gap between two actions
    where the trainer's layout has no slot (the runtime's own work per action, ms); and the first
    rank's median time outside the schedule per iteration (ms)."""
    times: dict[tuple[str, int], list[float]] = defaultdict(list)
    overhead: list[float] = []
    for rank, records in runs.items():
        slotted = {(str(s.after), str(s.before)) for s in layout.cyclic_slots(rank)}
        for rec in records:
            if rec.get("summary") or rec["warmup"]:
                continue
            prev: tuple[str, float] | None = None
            for kind, stage, mb, start, length in rec["actions"]:
                times[(kind, stage)].append(length)
                label = f"{stage}{kind}{mb}"
                if prev is not None and (prev[0], label) not in slotted:
                    overhead.append(start - prev[1])
                prev = (label, start + length)
    costs = {}
    for s in sorted({stage for _, stage in times}):
        tf, tb = _median(times[(FORWARD, s)]), _median(times[("B", s)])
        costs[s] = (tf, tb, tb / 2)
    outside = [rec["time_ms"] - rec["schedule_ms"] for rec in runs[0] if not rec.get("summary") and not rec["warmup"]]
    return costs, (_median(overhead) if overhead else 0.0), _median(outside)


def model_schedule(cfg: RunConfig, stages: int, costs: dict[int, tuple[float, float, float]]) -> Schedule:
    """The schedule simulated with each model stage's own measured costs."""
    orders = build_schedule(cfg.schedule, stages, cfg.microbatches, virtual=cfg.virtual).orders
    mean_f = statistics.fmean(c[0] for c in costs.values())
    mean_b = statistics.fmean(c[1] for c in costs.values())
    return schedule_from_orders(cfg.schedule, orders, stages * cfg.virtual, mean_f * cfg.virtual,
                                mean_b * cfg.virtual, mean_b * cfg.virtual / 2, virtual=cfg.virtual,
                                microbatches=cfg.microbatches, stage_costs=costs)


def _rel(model: float, measured: float) -> float:
    return abs(model - measured) / measured if measured else float("nan")


def compare(cfg: RunConfig, stages: int, runs: dict[int, list[dict[str, Any]]], memory: bool = True) -> dict[str, Any]:
    """Model against measurement for one configuration: rows per stage, slot and action."""
    # The trainer's slot layout: the same order at the reference 1 : 2 ratio (InstrumentedSchedule).
    layout = build_schedule(cfg.schedule, stages, cfg.microbatches, 1.0, 2.0, virtual=cfg.virtual)
    costs, overhead_ms, outside_ms = measured_costs(runs, layout)
    schedule = model_schedule(cfg, stages, {k: (f + overhead_ms, b + overhead_ms, b / 2) for k, (f, b, _) in
                                            costs.items()})
    iteration_ms = schedule.makespan + outside_ms
    dims = TransformerDims(layers=MODEL["layers"], hidden=MODEL["d_model"], heads=MODEL["heads"],
                           seq_len=MODEL["seq_len"], microbatch_size=MODEL["microbatch_size"], vocab=MODEL["vocab"])
    chunks = transformer_chunks(dims, stages * cfg.virtual, PRECISIONS["fp32"])
    out: dict[str, Any] = {"config": cfg.label, "iteration_ms": {"model": iteration_ms}, "stages": []}
    measured_iter = []
    for rank in range(stages):
        records = [r for r in runs[rank] if not r.get("summary") and not r["warmup"]]
        summary = next((r for r in runs[rank] if r.get("summary")), {})
        reported = [(s["slot"], s["kind"]) for s in summary.get("slots", [])]
        slots = layout.cyclic_slots(rank)
        if reported and reported != [(s.index, s.kind) for s in slots]:
            raise SystemExit(f"{cfg.label} stage {rank}: the trainer reports slots {reported}, the layout has "
                             f"{[(s.index, s.kind) for s in slots]}")
        measured_iter += [r["time_ms"] for r in records]
        fractions = [sum(b["length_ms"] for b in r["bubbles"]) / r["time_ms"] for r in records]
        unplanned = [(r["schedule_ms"] - sum(a[4] for a in r["actions"]) - sum(b["length_ms"] for b in r["bubbles"]))
                     / r["time_ms"] for r in records]
        stage: dict[str, Any] = {
            "stage": rank,
            "bubble_fraction": {"model": sum(gap_length(schedule, rank, s) for s in slots) / iteration_ms,
                                "measured": _median(fractions)},
            "unplanned_wait_fraction_measured": _median(unplanned),
            "slots": [],
        }
        lengths: dict[int, list[float]] = defaultdict(list)
        for r in records:
            for b in r["bubbles"]:
                lengths[b["slot"]].append(b["length_ms"])
        mem = rank_memory(schedule, rank, chunks, PRECISIONS["fp32"], "adam", RUNTIMES["torch"]) if memory else None
        held_slot: dict[int, list[int]] = defaultdict(list)
        after_actions: dict[int, list[int]] = defaultdict(list)
        peaks: list[int] = []
        for r in records:
            probe = r.get("memory") or {}
            for key, value in probe.get("slots", {}).items():
                held_slot[int(key)].append(value)
            samples = probe.get("after_actions", [])
            for k, value in enumerate(samples):
                after_actions[k].append(value)
            if samples:
                peaks.append(max(samples))
            if probe.get("after_step") is not None:
                held_slot[-1].append(probe["after_step"])
        for slot in slots:
            row: dict[str, Any] = {"slot": slot.index, "kind": slot.kind,
                                   "length_ms": {"model": gap_length(schedule, rank, slot),
                                                 "measured": _median(lengths[slot.index])}}
            if mem is not None:
                sample_key = -1 if slot.kind == BOUNDARY else slot.index
                row["held_bytes"] = {"model": mem.during(slot).total_bytes,
                                     "measured": _median(held_slot[sample_key]),
                                     "sampled": "after the schedule's step" if slot.kind == BOUNDARY else "slot start"}
            stage["slots"].append(row)
        if mem is not None:
            stage["peak_bytes"] = {"model": mem.peak.total_bytes, "measured": _median(peaks),
                                   "peak_in_flight": mem.peak_in_flight}
            stage["after_actions"] = [
                {"action": str(action), "model": mem.points[k + 1].total_bytes, "measured": _median(after_actions[k])}
                for k, action in enumerate(schedule.orders[rank]) if after_actions.get(k)
            ]
            probe_summary = summary.get("memory_probe") or {}
            if probe_summary.get("baseline_rss_bytes"):
                stage["peak_rss_growth_bytes"] = {
                    "model": mem.peak.total_bytes,
                    "measured": probe_summary["peak_rss_bytes"] - probe_summary["baseline_rss_bytes"],
                }
        out["stages"].append(stage)
    out["iteration_ms"]["measured"] = _median(measured_iter)
    out["costs_ms"] = {str(k): {"forward": v[0], "backward": v[1]} for k, v in costs.items()}
    out["overhead_per_action_ms"] = overhead_ms
    out["outside_schedule_ms"] = outside_ms
    return out


QUANTITIES = (
    ("bubble_fraction", "bubble fraction per stage"),
    ("slot_length", "idle slot length"),
    ("peak_bytes", "peak memory held per stage"),
    ("slot_held", "memory held in each idle slot"),
    ("after_action", "memory held after each action"),
    ("iteration", "iteration time"),
    ("peak_rss", "peak RSS growth (not comparable, see text)"),
)


def errors(results: Sequence[dict[str, Any]]) -> dict[str, list[float]]:
    """Relative errors per quantity over every configuration, stage and slot."""
    errs: dict[str, list[float]] = defaultdict(list)
    for res in results:
        errs["iteration"].append(_rel(res["iteration_ms"]["model"], res["iteration_ms"]["measured"]))
        for st in res["stages"]:
            errs["bubble_fraction"].append(_rel(st["bubble_fraction"]["model"], st["bubble_fraction"]["measured"]))
            for slot in st["slots"]:
                errs["slot_length"].append(_rel(slot["length_ms"]["model"], slot["length_ms"]["measured"]))
                if "held_bytes" in slot:
                    errs["slot_held"].append(_rel(slot["held_bytes"]["model"], slot["held_bytes"]["measured"]))
            if "peak_bytes" in st:
                errs["peak_bytes"].append(_rel(st["peak_bytes"]["model"], st["peak_bytes"]["measured"]))
            for a in st.get("after_actions", []):
                errs["after_action"].append(_rel(a["model"], a["measured"]))
            if "peak_rss_growth_bytes" in st:
                errs["peak_rss"].append(_rel(st["peak_rss_growth_bytes"]["model"],
                                             st["peak_rss_growth_bytes"]["measured"]))
    return errs


def error_summary(errs: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    return {k: {"count": len(v), "p50": percentile(v, 50), "p90": percentile(v, 90), "max": max(v)}
            for k, v in errs.items() if v}


# ---------------------------------------------------------------- report


def _mib(value: float) -> str:
    return f"{value / 2**20:.2f}"


def _pct(value: float) -> str:
    return f"{value:.1%}"


def markdown(doc: dict[str, Any]) -> str:
    m = doc["machine"]
    lines = [
        f"# Planner model vs the reference trainer ({doc['device']})",
        "",
        f"Machine: {m['cpu']}, {m['cores']} usable cores, Python {m['python']}, torch {m['versions']['torch']}; "
        f"load average at start {doc['loadavg_start']}, at end {doc['loadavg_end']}.",
        f"Workload: reference GPT ({', '.join(f'{k} {v}' for k, v in MODEL.items())}), {doc['stages']} stages "
        f"({'gloo, one core each' if doc['device'] == 'cpu' else 'NCCL, one GPU each'}), AdamW, "
        f"{doc['iterations']} iterations per configuration, the first {doc['warmup']} left out.",
        "The model is fed the trainer's model dimensions and what it measured of time: the median forward and "
        "backward per model stage, the runtime's median work between two actions where no wait is expected "
        "(added to every action: the simulator's transfers are free), and the first stage's median time "
        "outside the schedule (optimizer step); nothing else.",
        "",
        "## Relative error |model - measured| / measured",
        "",
        "| quantity | count | p50 | p90 | max |",
        "|---|---|---|---|---|",
    ]
    for key, name in QUANTITIES:
        e = doc["errors"].get(key)
        if e:
            lines.append(f"| {name} | {e['count']} | {_pct(e['p50'])} | **{_pct(e['p90'])}** | {_pct(e['max'])} |")
    lines += ["", "## Per configuration and stage", "",
              "| configuration | stage | bubble fraction model / measured | slots: length ms model / measured "
              "| held MiB in slots model / measured | peak MiB model / measured (in flight) |",
              "|---|---|---|---|---|---|"]
    for res in doc["results"]:
        for st in res["stages"]:
            bf = st["bubble_fraction"]
            slots = "; ".join(
                f"{s['slot']}:{s['kind']} {s['length_ms']['model']:.2f} / {s['length_ms']['measured']:.2f}"
                for s in st["slots"]) or "-"
            held = "; ".join(f"{s['slot']}: {_mib(s['held_bytes']['model'])} / {_mib(s['held_bytes']['measured'])}"
                             for s in st["slots"] if "held_bytes" in s) or "-"
            peak = st.get("peak_bytes")
            peak_text = (f"{_mib(peak['model'])} / {_mib(peak['measured'])} ({peak['peak_in_flight']})"
                         if peak else "-")
            lines.append(f"| {res['config']} | {st['stage']} | {_pct(bf['model'])} / {_pct(bf['measured'])} | "
                         f"{slots} | {held} | {peak_text} |")
    lines += ["", "Model inputs (ms): " + "; ".join(
        f"{r['config']}: F/B per stage " + ", ".join(f"{c['forward']:.2f}/{c['backward']:.2f}"
                                                     for c in r["costs_ms"].values())
        + f", between actions {r['overhead_per_action_ms']:.2f}, outside the schedule {r['outside_schedule_ms']:.2f}"
        for r in doc["results"]) + "."]
    lines += ["", "Iteration time, model / measured: " + "; ".join(
        f"{r['config']} {r['iteration_ms']['model']:.1f} / {r['iteration_ms']['measured']:.1f} ms"
        for r in doc["results"]) + "."]
    lines += ["", "## What is and is not comparable", "", *doc["notes"], "", f"Command: `{doc['command']}`"]
    return "\n".join(lines) + "\n"


NOTES_CPU = [
    "- Memory is the C allocator's count of bytes in use (glibc `mallinfo2`: torch's CPU tensors come "
    "from `malloc`), sampled after every compute action and at every bubble start, relative to a "
    "baseline taken after one throwaway training step (so that the framework's one-time allocations are "
    "not counted). It also counts other `malloc` users (Python objects, gloo, autograd's graph nodes): "
    "the few percent of noise here. The model counts state held *between* actions; the backward's "
    "workspace and the optimizer step's temporaries are not in either figure.",
    "- The boundary slot spans the optimizer step; it is compared at the end of the schedule's step, the "
    "state the model takes for it (the larger of the iteration's end and start).",
    "- Peak RSS growth is not comparable: RSS counts pages the allocator keeps after a free, the "
    "optimizer's temporaries, the backward's workspace and the interpreter's own growth; it is shown "
    "for honesty, not as a target.",
    "- Times: stages are pinned one per core on a 2-core machine shared with other work (see the load "
    "average above), so every measured bubble carries that machine's noise (instrumentation.md measures "
    "its floor: an oracle predicting each slot's median is off by p90 55% per bubble). Gloo's transfers "
    "share the stages' cores, and a wait for a peer that is preempted lasts as long as the preemption: "
    "measured iterations are longer than the model's, and the error of a slot's length is mostly that.",
    "- Only 2 stages: one core per stage is all this machine has. ZB-H1 is not run: the reference "
    "trainer has no zero-bubble schedule.",
]
NOTES_GPU = [
    "- Memory is `torch.cuda.memory_allocated` (live tensors), sampled after every compute action and at "
    "every bubble start, relative to a baseline after one throwaway training step.",
    "- Times are host times around asynchronously queued kernels (docs/bubbles.md): action times and "
    "bubbles are what the host sees.",
    "- ZB-H1 is not run: the reference trainer has no zero-bubble schedule.",
]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.bench_plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--stages", type=int, default=2, help="pipeline stages: cores (CPU) or GPUs (CUDA) used")
    ap.add_argument("--iterations", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=6)
    ap.add_argument("--out", default=None, help="results directory (default bench/results/<device>)")
    args = ap.parse_args(argv)
    if args.device == "cpu" and len(os.sched_getaffinity(0)) < args.stages:
        raise SystemExit(f"{args.stages} stages need {args.stages} cores; this process may use "
                         f"{len(os.sched_getaffinity(0))}")
    if args.device == "cuda":
        import torch

        if torch.cuda.device_count() < args.stages:
            raise SystemExit(f"{args.stages} stages need {args.stages} GPUs; torch sees {torch.cuda.device_count()}")
    out_dir = Path(args.out or REPO / "bench" / "results" / args.device)
    load_start = tuple(round(x, 2) for x in os.getloadavg())
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-plan-") as tmp:
        for cfg in CONFIGS:
            t0 = time.monotonic()
            runs = run_config(cfg, args.stages, args.device, args.iterations, args.warmup, Path(tmp))
            res = compare(cfg, args.stages, runs)
            res["wall_s"] = round(time.monotonic() - t0, 1)
            results.append(res)
            print(f"{cfg.label}: {res['wall_s']} s", file=sys.stderr)
    doc = {
        "device": args.device,
        "stages": args.stages,
        "iterations": args.iterations,
        "warmup": args.warmup,
        "model": MODEL,
        "machine": machine_info(),
        "loadavg_start": load_start,
        "loadavg_end": tuple(round(x, 2) for x in os.getloadavg()),
        "command": " ".join(["python -m bench.bench_plan", *(argv if argv is not None else sys.argv[1:])]),
        "errors": error_summary(errors(results)),
        "results": results,
        "notes": NOTES_CPU if args.device == "cpu" else NOTES_GPU,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "plan_validation.json").write_text(json.dumps(doc, indent=2) + "\n")
    (out_dir / "plan_validation.md").write_text(markdown(doc))
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
