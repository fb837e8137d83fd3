"""``freeride plan``: the bubbles of a pipeline configuration, its memory, and what side tasks fit.

    freeride plan --schedule 1f1b --stages 4 --microbatches 8 [--t-forward 1 --t-backward 2]
    freeride plan --stages 4 --sweep [--schedule 1f1b,interleaved,zb-h1,zbv] [--microbatches 4,8,16]
                  [--virtual 2,4] --layers 32 --hidden 4096 --heads 32 --seq-len 2048 --vocab 50304
                  --device-memory 80GiB --task name=pagerank,memory=2GiB,step_ms=3.5 [--plot frontier.png]

The first form prints the step x stage grid, each stage's idle slots per iteration (offset, length,
kind) and the bubble fraction; ``--cyclic`` lists the slots as a running trainer sees them (a stage's
tail and the next iteration's warm-up are one wait). With a memory model (model dimensions, or
``--weight-bytes`` and ``--activation-bytes`` measured per stage) it adds what each stage holds and,
with ``--device-memory``, what is free in each slot; with ``--task`` where each side task fits.

The schedules torch alone defines (interleaved zero-bubble, looped BFS, ZBV, DualPipeV) take their
order from torch's own classes (:mod:`freeride.training.torch_plans`), so they need torch; a sweep
that names no schedules leaves them out, and says so, where torch is not installed.

``--sweep`` evaluates every schedule x micro-batches x virtual stages combination for the given
stages and prints one line each, with the Pareto-optimal ones marked (``*``): bubble fraction and
peak memory per stage minimised, harvest capacity maximised (see :mod:`freeride.training.planner`).
``--plot FILE`` draws the frontier; ``--json`` prints everything as one JSON document.

The core is :mod:`freeride.training.planner` and :mod:`freeride.training.memory`; this module parses, prints and draws.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from freeride._extras import TORCH_FIRST, installed, require
from freeride.errors import ConfigError
from freeride.training.memory import (
    OPTIMIZER_STATES,
    PRECISIONS,
    RUNTIMES,
    HeldMemory,
    MeasuredStages,
    TransformerDims,
)
from freeride.training.planner import (
    DEFAULT_HEADROOM_BYTES,
    DEFAULT_MARGIN_MS,
    Candidate,
    ConfigPlan,
    Costs,
    MemoryInputs,
    PlanInputs,
    SideTaskDemand,
    SweepResult,
    candidates,
    plan_config,
    sweep,
)
from freeride.training.schedules import (
    LOOPED,
    OWN_SCHEDULES,
    SCHEDULE_NAMES,
    TORCH_SCHEDULES,
    ZERO_BUBBLE,
    IdleSlot,
    Schedule,
    canonical_name,
    chunks_per_rank,
    draw_grid,
)
from freeride.training.torch_plans import csv_orders
from freeride.units import format_size, parse_size

_DIM_FLAGS = ("layers", "hidden", "heads", "seq_len", "vocab")


#: Per-micro-batch times used when the user gives none: the shape of a schedule, not its timing.
_ASSUMED_T_F = 1.0
_ASSUMED_T_B = 2.0
#: The formats ``--plot`` draws, by the file's suffix.
PLOT_SUFFIXES = (".png", ".svg", ".pdf")
#: Bounds of the times the planner takes, in ms: from a nanosecond (below it every figure prints as 0.000) to an
#: hour (above it the tables' numbers run to hundreds of digits).
MIN_ACTION_MS = 1e-6
MAX_TIME_MS = 3.6e6

def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="show a pipeline configuration's bubbles, memory per stage and side-task fit; --sweep for the frontier",
        description="Simulate pipeline schedules: idle slots per stage, memory held and free in each, which side "
        "tasks fit; --sweep compares configurations and marks the Pareto front.",
    )
    sched = parser.add_argument_group("schedule")
    sched.add_argument("--schedule", default=None,
                       help=f"one of {', '.join(SCHEDULE_NAMES)} (default 1f1b; {', '.join(TORCH_SCHEDULES)} "
                       "read their order off torch's own classes, so need torch); with --sweep a comma list "
                       "(default all)")
    sched.add_argument("--schedule-csv", default=None, metavar="FILE",
                       help="an order of your own in torch's compute-only CSV (one row per rank: 0F0,1F0,...,0B0); "
                       "micro-batches and stages per rank come from it")
    sched.add_argument("--stages", type=int, default=None,
                       help="pipeline stages (ranks); required but with --schedule-csv, whose rows they are")
    sched.add_argument("--microbatches", default=None,
                       help="micro-batches per iteration; with --sweep a comma list (default p,2p,4p,8p)")
    sched.add_argument("--virtual", default=None,
                       help=f"model chunks per stage ({', '.join(LOOPED)}; V-shaped zbv and dualpipev hold 2); "
                       "with --sweep a comma list (default 2,4)")
    sched.add_argument("--t-forward", type=float, default=None,
                       help=f"forward time of one micro-batch (ms; default {_ASSUMED_T_F:g}, a placeholder)")
    sched.add_argument("--t-backward", type=float, default=None,
                       help=f"full backward time (ms; default {_ASSUMED_T_B:g}, a placeholder)")
    sched.add_argument("--t-weight", type=float, default=None, help="weight-gradient time (zero-bubble; ms)")
    sched.add_argument("--t-step", type=float, default=0.0,
                       help="time per iteration outside the schedule: optimizer step etc. (ms)")
    sched.add_argument("--global-batch", type=int, default=None,
                       help="hold the samples per iteration fixed: a micro-batch is global/m samples, and times "
                       "and activations (given for --microbatch-size) scale with it")

    model = parser.add_argument_group("memory model: model dimensions (a GPT of pre-norm blocks) ...")
    model.add_argument("--layers", type=int, help="transformer blocks")
    model.add_argument("--hidden", type=int, help="hidden size")
    model.add_argument("--heads", type=int, help="attention heads")
    model.add_argument("--seq-len", type=int, help="sequence length")
    model.add_argument("--vocab", type=int, help="vocabulary size")
    model.add_argument("--microbatch-size", type=int, default=1,
                       help="samples per micro-batch the times (and measured activations) are for (default 1)")
    model.add_argument("--ffn-multiplier", type=int, default=4, help="MLP width / hidden (default 4)")
    model.add_argument("--attention", choices=("flash", "math"), default="flash",
                       help="fused attention saves no s x s matrix (default flash)")
    measured = parser.add_argument_group("... or measured per stage")
    measured.add_argument("--weight-bytes", help="parameter bytes per stage: one size, or one per stage (comma list)")
    measured.add_argument("--activation-bytes",
                          help="bytes one micro-batch saves for its backward, per stage (one size or a comma list)")
    measured.add_argument("--boundary-bytes", default=None,
                          help="one micro-batch's tensor between stages (receive buffers; default 0)")
    state = parser.add_argument_group("training state and device")
    state.add_argument("--precision", choices=sorted(PRECISIONS), default="fp32", help="default fp32")
    state.add_argument("--optimizer", choices=sorted(OPTIMIZER_STATES), default="adam", help="default adam")
    state.add_argument("--runtime", choices=sorted(RUNTIMES), default="torch",
                       help="what the pipeline runtime keeps: torch (torch.distributed.pipelining) or lean")
    state.add_argument("--device-memory", default=None, help="memory per device, e.g. 80GiB")
    state.add_argument("--headroom", default=f"{DEFAULT_HEADROOM_BYTES // 2**20}MiB",
                       help="memory the manager keeps free (its --headroom; default %(default)s)")
    state.add_argument("--margin-ms", type=float, default=DEFAULT_MARGIN_MS,
                       help="admission margin added to a step (the manager's --margin-ms; default %(default)s)")

    tasks = parser.add_argument_group("side tasks")
    tasks.add_argument("--task", action="append", default=[], metavar="name=N,memory=SIZE,step_ms=T",
                       help="a side task's memory cap and measured p95 step time (repeatable)")
    tasks.add_argument("--tasks-file", default=None,
                       help='JSON list of tasks: [{"name": "pagerank", "memory": "2GiB", "step_ms": 3.5}, ...]')

    out = parser.add_argument_group("output")
    out.add_argument("--sweep", action="store_true", help="compare schedules x micro-batches x virtual stages")
    out.add_argument("--plot", default=None, metavar="FILE", help="with --sweep: draw the frontier (PNG, SVG, PDF)")
    out.add_argument("--cyclic", action="store_true", help="slots between back-to-back iterations")
    out.add_argument("--no-grid", action="store_true", help="leave out the step x stage grid")
    out.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(func=run)


# ------------------------------------------------------------------ parsing


def _int_list(flag: str, text: str) -> list[int]:
    values = []
    for part in text.split(","):
        try:
            value = int(part.strip())
        except ValueError:
            raise ConfigError(f"{flag}: expected integers separated by commas, got {text!r}") from None
        if value < 1:
            raise ConfigError(f"{flag}: values must be >= 1, got {value}")
        values.append(value)
    return values


def _single_int(flag: str, text: str | None, default: int) -> int:
    if text is None:
        return default
    values = _int_list(flag, text)
    if len(values) != 1:
        raise ConfigError(f"{flag} takes one value without --sweep, got {text!r}")
    return values[0]


def _sizes_per_stage(flag: str, text: str, stages: int) -> tuple[int, ...]:
    sizes = tuple(parse_size(part.strip()) for part in text.split(","))
    if len(sizes) == 1:
        return sizes * stages
    if len(sizes) != stages:
        raise ConfigError(f"{flag}: give one size or one per stage ({stages}), got {len(sizes)}")
    return sizes


def _size_or_zero(flag: str, text: str) -> int:
    text = text.strip()
    if text in ("0", "0B", "0b"):
        return 0
    try:
        return parse_size(text)
    except ConfigError as exc:
        raise ConfigError(f"{flag}: {exc}") from None


def _memory_inputs(args: argparse.Namespace) -> MemoryInputs | None:
    dims_given = {name: getattr(args, name) for name in _DIM_FLAGS if getattr(args, name) is not None}
    measured_given = args.weight_bytes is not None or args.activation_bytes is not None
    if dims_given and measured_given:
        raise ConfigError("give either model dimensions (--layers ...) or measured bytes (--weight-bytes, "
                          "--activation-bytes), not both")
    source: TransformerDims | MeasuredStages
    if dims_given:
        missing = [f"--{n.replace('_', '-')}" for n in _DIM_FLAGS if n not in dims_given]
        if missing:
            raise ConfigError(f"model dimensions need {', '.join(missing)} as well")
        source = TransformerDims(
            layers=args.layers, hidden=args.hidden, heads=args.heads, seq_len=args.seq_len,
            microbatch_size=args.microbatch_size, vocab=args.vocab, ffn_multiplier=args.ffn_multiplier,
            flash_attention=args.attention == "flash",
        )
    elif measured_given:
        if args.weight_bytes is None or args.activation_bytes is None:
            raise ConfigError("measured memory needs both --weight-bytes and --activation-bytes")
        boundary = 0 if args.boundary_bytes is None else _size_or_zero("--boundary-bytes", args.boundary_bytes)
        source = MeasuredStages(
            _sizes_per_stage("--weight-bytes", args.weight_bytes, args.stages),
            _sizes_per_stage("--activation-bytes", args.activation_bytes, args.stages),
            boundary,
        )
    else:
        if args.boundary_bytes is not None:
            raise ConfigError("--boundary-bytes goes with --weight-bytes and --activation-bytes")
        return None
    return MemoryInputs(source, PRECISIONS[args.precision], args.optimizer, RUNTIMES[args.runtime])


def _tasks(args: argparse.Namespace) -> tuple[SideTaskDemand, ...]:
    tasks = [SideTaskDemand.parse(text) for text in args.task]
    if args.tasks_file:
        path = Path(args.tasks_file)
        try:
            doc = json.loads(path.read_text())
        except OSError as exc:
            raise ConfigError(f"--tasks-file {path}: {exc.strerror or exc}") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--tasks-file {path}: not JSON ({exc})") from None
        if not isinstance(doc, list) or not all(isinstance(t, dict) for t in doc):
            raise ConfigError(f"--tasks-file {path}: expected a JSON list of objects with name, memory, step_ms")
        tasks += [SideTaskDemand.from_mapping(t, where=f"{path} task {i}") for i, t in enumerate(doc)]
    return tuple(tasks)


def _assumed_times_note(args: argparse.Namespace) -> str:
    """A line saying that t_f/t_b are placeholders, when the user gave neither; else empty."""
    if args.t_forward_given or args.t_backward_given:
        return ""
    return (f"note: t_f={_ASSUMED_T_F:g} ms and t_b={_ASSUMED_T_B:g} ms are placeholders, not your model's: "
            "pass --t-forward/--t-backward (measured per micro-batch) for real times; bubble fractions "
            "and the ranking of configurations depend on their ratio only")


def plan_inputs(args: argparse.Namespace) -> PlanInputs:
    """The planner's inputs from the command line (ConfigError with the flag's name when bad)."""
    args.t_forward_given = args.t_forward is not None
    args.t_backward_given = args.t_backward is not None
    if args.t_forward is None:
        args.t_forward = _ASSUMED_T_F
    if args.t_backward is None:
        args.t_backward = _ASSUMED_T_B
    # Each flag checked by its own name and bounds (a stranger met "must be > 0" for 0 but "t_forward_ms must be
    # a finite number >= 0" for -5, and 1e300 printed 300-digit tables).
    for flag, low in (("t_forward", MIN_ACTION_MS), ("t_backward", MIN_ACTION_MS), ("t_weight", 0.0),
                      ("t_step", 0.0), ("margin_ms", 0.0)):
        value = getattr(args, flag)
        if value is not None and not low <= value <= MAX_TIME_MS:  # NaN fails it too
            raise ConfigError(f"--{flag.replace('_', '-')} must be a number of milliseconds from {low:g} to "
                              f"{MAX_TIME_MS:g}, got {value:g}")
    if args.plot and not args.sweep:
        raise ConfigError("--plot draws the frontier of a sweep: add --sweep")
    if args.plot:
        require("demo", "freeride plan --plot", ["matplotlib"])  # before the sweep, not after it
        suffix = Path(args.plot).suffix.lower()
        if suffix not in PLOT_SUFFIXES:
            raise ConfigError(f"--plot {args.plot}: the picture's name ends in {', '.join(PLOT_SUFFIXES)} (its "
                              "format)" + (f", not {suffix}" if suffix else ""))
    device_memory = None if args.device_memory is None else parse_size(args.device_memory)
    headroom = _size_or_zero("--headroom", args.headroom)
    if device_memory is not None and headroom >= device_memory:
        raise ConfigError(f"--headroom ({format_size(headroom)}) leaves nothing of --device-memory "
                          f"({format_size(device_memory)}) for training and side tasks")
    return PlanInputs(
        stages=args.stages,
        costs=Costs(args.t_forward, args.t_backward, args.t_weight, args.t_step),
        memory=_memory_inputs(args),
        device_memory_bytes=device_memory,
        headroom_bytes=headroom,
        margin_ms=args.margin_ms,
        tasks=_tasks(args),
        global_batch=args.global_batch,
        microbatch_size=args.microbatch_size,
    )


# ------------------------------------------------------------------ JSON


def _slot_json(slot: IdleSlot) -> dict[str, Any]:
    return {
        "index": slot.index,
        "kind": slot.kind,
        "start_ms": round(slot.start, 6),
        "length_ms": round(slot.length, 6),
        "before": str(slot.before) if slot.before else None,
        "after": str(slot.after) if slot.after else None,
    }


def plan_json(schedule: Schedule, cyclic: bool = False) -> dict[str, Any]:
    """The schedule as a JSON-ready dict (what ``--json`` prints without a memory model)."""
    stages = []
    for r in range(schedule.ranks):
        slots = schedule.cyclic_slots(r) if cyclic else schedule.slots(r)
        stages.append(
            {
                "stage": r,
                "idle_ms": round(schedule.idle_time(r), 6),
                "bubble_fraction": round(schedule.bubble_fraction(r), 6),
                "slots": [_slot_json(s) for s in slots],
                "order": [str(a) for a in schedule.orders[r]],
            }
        )
    return {
        "schedule": schedule.name,
        "stages": schedule.ranks,
        "microbatches": schedule.microbatches,
        "virtual": schedule.virtual,
        "t_forward_ms": schedule.t_forward,
        "t_backward_ms": schedule.t_backward,
        "t_weight_ms": schedule.t_weight,
        "iteration_ms": round(schedule.makespan, 6),
        "bubble_fraction": round(schedule.bubble_fraction(), 6),
        "layout": "cyclic" if cyclic else "per-iteration",
        "per_stage": stages,
    }


def _held_json(held: HeldMemory) -> dict[str, int]:
    return {"weights": held.weights, "gradients": held.gradients, "optimizer": held.optimizer,
            "buffers": held.buffers, "activations": held.activations, "total": held.total_bytes}


def _num(value: float | None, digits: int = 6) -> float | None:
    return None if value is None else round(value, digits)


def config_json(plan: ConfigPlan) -> dict[str, Any]:
    """One evaluated configuration: times, memory per stage and slot (cyclic layout), task fit."""
    return {
        "schedule": plan.candidate.schedule,
        "microbatches": plan.candidate.microbatches,
        "virtual": plan.candidate.virtual,
        "microbatch_size": plan.microbatch_size,
        "iteration_ms": _num(plan.iteration_ms),
        "bubble_fraction": _num(plan.bubble_fraction),
        "peak_bytes": plan.peak_bytes,
        "harvest_rate_bytes": _num(plan.harvest_rate_bytes, 1),
        "fits_device": plan.fits_device,
        "pareto": plan.pareto,
        "per_stage": [
            {
                "stage": s.rank,
                "idle_ms": _num(s.idle_ms),
                "bubble_fraction": _num(s.bubble_fraction),
                "peak_bytes": None if s.peak is None else s.peak.total_bytes,
                "peak": None if s.peak is None else _held_json(s.peak),
                "peak_in_flight": s.peak_in_flight,
                "budget_bytes": s.budget_bytes,
                "harvest_byte_seconds": _num(s.harvest_byte_seconds, 3),
                "slots": [
                    {"index": x.index, "kind": x.kind, "start_ms": _num(x.start_ms), "length_ms": _num(x.length_ms),
                     "held_bytes": x.held_bytes, "free_bytes": x.free_bytes}
                    for x in s.slots
                ],
            }
            for s in plan.stages
        ],
        "tasks": [
            {"task": f.task, "stage": f.rank, "fits": f.fits, "slots": list(f.slots), "memory_fits": f.memory_fits,
             "usable_ms": _num(f.usable_ms)}
            for f in plan.fits
        ],
    }


def _inputs_json(inputs: PlanInputs) -> dict[str, Any]:
    mem = inputs.memory
    memory: dict[str, Any] | None = None
    if mem is not None:
        src = mem.source
        if isinstance(src, TransformerDims):
            source: dict[str, Any] = {"kind": "dimensions", "layers": src.layers, "hidden": src.hidden,
                                      "heads": src.heads, "seq_len": src.seq_len, "vocab": src.vocab,
                                      "ffn_multiplier": src.ffn_multiplier, "flash_attention": src.flash_attention}
        else:
            source = {"kind": "measured", "weight_bytes": list(src.weight_bytes),
                      "activation_bytes": list(src.activation_bytes), "boundary_bytes": src.boundary_bytes}
        memory = {"source": source, "precision": mem.precision.name, "optimizer": mem.optimizer,
                  "runtime": mem.runtime.name}
    c = inputs.costs
    return {
        "stages": inputs.stages,
        "t_forward_ms": c.t_forward_ms, "t_backward_ms": c.t_backward_ms, "t_weight_ms": c.t_weight_ms,
        "t_step_ms": c.t_step_ms,
        "microbatch_size": inputs.microbatch_size, "global_batch": inputs.global_batch,
        "memory": memory,
        "device_memory_bytes": inputs.device_memory_bytes,
        "headroom_bytes": inputs.headroom_bytes,
        "margin_ms": inputs.margin_ms,
        "tasks": [{"name": t.name, "memory_bytes": t.memory_bytes, "step_ms": t.step_ms} for t in inputs.tasks],
    }


def sweep_json(inputs: PlanInputs, result: SweepResult) -> dict[str, Any]:
    return {
        "inputs": _inputs_json(inputs),
        "objectives": {"minimise": [n for n in result.objectives if n != "harvest_rate_bytes"],
                       "maximise": [n for n in result.objectives if n == "harvest_rate_bytes"]},
        "configs": [config_json(p) for p in result.plans],
        "rejected": [{"schedule": c.schedule, "microbatches": c.microbatches, "virtual": c.virtual, "reason": why}
                     for c, why in result.rejected],
    }


# ------------------------------------------------------------------ text


def render_plan(schedule: Schedule, cyclic: bool = False, grid: bool = True) -> str:
    """The human-readable schedule."""
    out = [
        f"schedule {schedule.name}: {schedule.ranks} stages x {schedule.microbatches} micro-batches"
        + (f" x {schedule.virtual} chunks" if schedule.virtual > 1 else "")
        + f", t_f={schedule.t_forward:g} ms, t_b={schedule.t_backward:g} ms"
        + (f", t_w={schedule.t_weight:g} ms" if schedule.name in ZERO_BUBBLE else ""),
        f"iteration {schedule.makespan:g} ms, bubble fraction {schedule.bubble_fraction():.1%}",
    ]
    if grid:
        out += ["", draw_grid(schedule)]
    out += [
        "",
        "idle slots per iteration" + (" (cyclic: tail + next warm-up are one wait)" if cyclic else "") + ":",
        f"{'stage':>5} {'slot':>4}  {'kind':<10} {'offset ms':>10} {'length ms':>10}  between (model stage, F/B, mb)",
    ]
    for r in range(schedule.ranks):
        slots = schedule.cyclic_slots(r) if cyclic else schedule.slots(r)
        if not slots:
            out.append(f"{r:>5} {'-':>4}  {'(none)':<10}")
        for s in slots:
            between = f"{s.after or '-'} .. {s.before or '-'}"
            out.append(f"{r:>5} {s.index:>4}  {s.kind:<10} {s.start:>10.3f} {s.length:>10.3f}  {between}")
        out.append(
            f"{'':>5} {'':>4}  {'total':<10} {'':>10} {schedule.idle_time(r):>10.3f}  "
            f"({schedule.bubble_fraction(r):.1%} of the iteration)"
        )
    return "\n".join(out)


def _size(value: int | float | None) -> str:
    return "-" if value is None else format_size(value)


def render_memory(plan: ConfigPlan) -> str:
    """Memory per stage (at its peak) and in each idle slot of the cyclic layout."""
    out = [
        f"memory per stage at its peak (between actions), iteration {plan.iteration_ms:g} ms:",
        f"{'stage':>5} {'weights':>10} {'grads':>10} {'optimizer':>10} {'buffers':>10} {'activations':>11} "
        f"{'in flight':>9} {'peak':>10} {'budget':>10}",
    ]
    for s in plan.stages:
        p = s.peak
        if p is None:
            continue
        out.append(f"{s.rank:>5} {_size(p.weights):>10} {_size(p.gradients):>10} {_size(p.optimizer):>10} "
                    f"{_size(p.buffers):>10} {_size(p.activations):>11} {s.peak_in_flight:>9} "
                    f"{_size(p.total_bytes):>10} {_size(s.budget_bytes):>10}")
    out += ["", "idle slots (cyclic) with the memory held and free during each:",
            f"{'stage':>5} {'slot':>4}  {'kind':<10} {'length ms':>10} {'held':>10} {'free':>10}"]
    for s in plan.stages:
        for x in s.slots:
            out.append(f"{s.rank:>5} {x.index:>4}  {x.kind:<10} {x.length_ms:>10.3f} {_size(x.held_bytes):>10} "
                       f"{_size(x.free_bytes):>10}")
    if plan.fits_device is False:
        out.append(f"\nthe peak ({_size(plan.peak_bytes)}) does not fit the device ({_size(plan.device_memory_bytes)})")
    return "\n".join(out)


def render_fit(plan: ConfigPlan, margin_ms: float) -> str:
    """Per task and stage: the slots its step fits, and whether its memory fits the stage's budget."""
    out = [f"side tasks (a slot fits a step when step + {margin_ms:g} ms margin <= its length; memory is checked "
           "against the stage's budget, device - peak - headroom; slots are numbered as in the cyclic layout, "
           "the one a running job has, which --cyclic lists):",
           f"{'task':<16} {'stage':>5}  {'fits':<4} {'slots':<14} {'usable ms':>10}  memory"]
    for f in plan.fits:
        memory = {None: "unknown", True: "fits", False: "over budget"}[f.memory_fits]
        slots = ",".join(str(i) for i in f.slots) or "-"
        fits = "yes" if f.fits else "no"
        out.append(f"{f.task:<16} {f.rank:>5}  {fits:<4} {slots:<14} {f.usable_ms:>10.3f}  {memory}")
    return "\n".join(out)


def _fit_summary(plan: ConfigPlan, tasks: tuple[SideTaskDemand, ...]) -> str:
    parts = []
    for t in tasks:
        stages = plan.fitting_stages(t.name)
        parts.append(f"{t.name}:" + (",".join(str(s) for s in stages) if stages else "-"))
    return " ".join(parts)


def render_sweep(inputs: PlanInputs, result: SweepResult) -> str:
    known = set(result.objectives)
    batch = (f"global batch {inputs.global_batch}" if inputs.global_batch
             else f"micro-batch of {inputs.microbatch_size} (fixed)")
    lines = [f"sweep: {inputs.stages} stages, {batch}, t_f={inputs.costs.t_forward_ms:g} ms, "
             f"t_b={inputs.costs.t_backward_ms:g} ms per micro-batch of {inputs.microbatch_size}"
             + (f", device {format_size(inputs.device_memory_bytes)}" if inputs.device_memory_bytes else "")]
    header = f"{'':1} {'configuration':<26} {'mb':>4} {'iter ms':>9} {'bubble':>7}"
    if "peak_bytes" in known:
        header += f" {'peak/stage':>11}"
    if "harvest_rate_bytes" in known:
        header += f" {'harvest':>11}"
    if inputs.tasks:
        header += "  fits on stages"
    lines += ["", header]
    for p in result.plans:
        row = (f"{'*' if p.pareto else ' ':1} {p.candidate.label:<26} {p.microbatch_size:>4} {p.iteration_ms:>9.3f} "
               f"{p.bubble_fraction:>7.1%}")
        if "peak_bytes" in known:
            row += f" {_size(p.peak_bytes):>11}"
        if "harvest_rate_bytes" in known:
            row += f" {_size(p.harvest_rate_bytes):>11}"
        if inputs.tasks:
            row += "  " + _fit_summary(p, inputs.tasks)
        if p.fits_device is False:
            row += "  (exceeds device memory)"
        lines.append(row)
    goals = ["bubble fraction (min)"]
    if "peak_bytes" in known:
        goals.append("peak memory per stage (min)")
    if "harvest_rate_bytes" in known:
        goals.append("harvest capacity (max)")
    lines += ["", f"* Pareto-optimal on {', '.join(goals)}."]
    if "harvest_rate_bytes" in known:
        lines.append("harvest: free memory x bubble time, summed over stages and slots, per second of training "
                     "(GiB-s per s).")
    if result.rejected:
        lines += ["", "not valid:"] + [f"  {c.label}: {why}" for c, why in result.rejected]
    return "\n".join(lines)


# ------------------------------------------------------------------ run


def _default_schedules() -> tuple[list[str], str]:
    """The schedules a sweep compares when none are named, and a note of those left out (or "")."""
    if installed("torch"):
        return list(SCHEDULE_NAMES), ""
    return list(OWN_SCHEDULES), (f"left out: torch's schedules ({', '.join(TORCH_SCHEDULES)}), whose order comes "
                                 f"from torch, which is not installed here (install {TORCH_FIRST})")


def _sweep_candidates(args: argparse.Namespace) -> tuple[list[Candidate], str]:
    if args.schedule:
        schedules, left_out = [s.strip() for s in args.schedule.split(",")], ""
    else:
        schedules, left_out = _default_schedules()
    ms = _int_list("--microbatches", args.microbatches) if args.microbatches else []
    vs = _int_list("--virtual", args.virtual) if args.virtual else [2, 4]
    return candidates(args.stages, schedules, ms, vs), left_out


def run(args: argparse.Namespace) -> int:
    if args.sweep and args.schedule_csv is not None:
        raise ConfigError("--schedule-csv fixes the order: plan it without --sweep")
    own = _csv_candidate(args) if args.schedule_csv is not None else None
    if args.stages is None:
        if own is None:
            raise ConfigError("--stages is required (or --schedule-csv, whose rows are the stages)")
        args.stages = len(own.orders or {})
    inputs = plan_inputs(args)
    if args.sweep:
        cands, left_out = _sweep_candidates(args)
        result = sweep(inputs, cands)
        if not result.plans:
            raise ConfigError("no valid configuration in the sweep: "
                              + "; ".join(f"{c.label}: {why}" for c, why in result.rejected))
        if args.plot:
            from freeride._cli.plan_figure import draw_frontier

            try:
                draw_frontier(result, Path(args.plot))
            except OSError as exc:
                raise ConfigError(f"cannot write the frontier to {args.plot}: {exc.strerror or exc}") from None
        if args.json:
            doc = sweep_json(inputs, result)
            if left_out:
                doc["left_out"] = left_out
            json.dump(doc, sys.stdout, indent=2)
            sys.stdout.write("\n")
        else:
            print(render_sweep(inputs, result))
            if left_out:
                print("\n" + left_out)
            if note := _assumed_times_note(args):
                print("\n" + note)
            if args.plot:
                print(f"\nfrontier drawn to {args.plot}")
        return 0

    if args.schedule is not None and "," in args.schedule:
        raise ConfigError("--schedule takes one name without --sweep")
    if own is not None:
        return _print_plan(args, inputs, own)
    if args.microbatches is None:
        raise ConfigError("--microbatches is required without --sweep (or --schedule-csv)")
    name = args.schedule or "1f1b"
    asked = _single_int("--virtual", args.virtual, 1)
    if args.virtual is not None and asked < 2 and canonical_name(name) in LOOPED:
        raise ConfigError(f"{canonical_name(name)} runs 2 or more model chunks per stage: --virtual 2 or more")
    candidate = Candidate(name, _single_int("--microbatches", args.microbatches, 1), chunks_per_rank(name, asked))
    return _print_plan(args, inputs, candidate)


def _csv_candidate(args: argparse.Namespace) -> Candidate:
    """The configuration ``--schedule-csv`` gives: its order, its micro-batches, its stages per rank."""
    if args.schedule not in (None, "csv"):
        raise ConfigError(f"--schedule-csv is the schedule; drop --schedule {args.schedule}")
    orders, virtual = csv_orders(args.schedule_csv)
    microbatches = len({a.microbatch for order in orders.values() for a in order})
    for flag, given, found in (("--microbatches", args.microbatches, microbatches),
                               ("--virtual", args.virtual, virtual)):
        if given is not None and _single_int(flag, given, found) != found:
            raise ConfigError(f"{flag} {given} does not match {args.schedule_csv}, which has {found}")
    return Candidate("csv", microbatches, virtual, {r: tuple(o) for r, o in orders.items()})


def _print_plan(args: argparse.Namespace, inputs: PlanInputs, candidate: Candidate) -> int:
    plan = plan_config(inputs, candidate)
    detailed = inputs.memory is not None or bool(inputs.tasks)
    t_step = inputs.costs.t_step_ms
    if args.json:
        doc = plan_json(plan.schedule, cyclic=args.cyclic)
        if t_step:
            # The schedule's figures above leave the optimizer step out; these take it in (as "plan" does).
            doc["with_step"] = {"t_step_ms": t_step, "iteration_ms": _num(plan.iteration_ms),
                                "bubble_fraction": _num(plan.bubble_fraction)}
        if detailed or t_step:
            doc["plan"] = config_json(plan)
            doc["inputs"] = _inputs_json(inputs)
        json.dump(doc, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    text = render_plan(plan.schedule, cyclic=args.cyclic, grid=not args.no_grid)
    if t_step:
        text += (f"\n\nWith the optimizer step (--t-step {t_step:g} ms, every stage busy): iteration "
                 f"{plan.iteration_ms:.1f} ms, bubble fraction {100 * plan.bubble_fraction:.1f}%")
    if inputs.memory is not None:
        text += "\n\n" + render_memory(plan)
    if inputs.tasks:
        text += "\n\n" + render_fit(plan, inputs.margin_ms)
    if note := _assumed_times_note(args):
        text += "\n\n" + note
    print(text)
    return 0
