"""``freeride plan``: the analytical bubble model of a schedule, drawn and tabulated.

    freeride plan --schedule 1f1b --stages 4 --microbatches 8 [--t-forward 1 --t-backward 2]

prints the step x stage grid, each stage's idle slots per iteration (offset, length, kind) and the
bubble fraction; ``--json`` gives the same as one JSON document. ``--cyclic`` lists the slots as a
running trainer sees them (a stage's tail and the next iteration's warm-up are one wait).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from freeride.schedules import SCHEDULE_NAMES, IdleSlot, Schedule, build_schedule, draw_grid


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="show a pipeline schedule's bubbles (idle slots per stage, bubble fraction)",
        description="Simulate a pipeline schedule and show each stage's idle slots per iteration.",
    )
    parser.add_argument("--schedule", default="1f1b", help=f"one of {', '.join(SCHEDULE_NAMES)} (default 1f1b)")
    parser.add_argument("--stages", type=int, required=True, help="pipeline stages (ranks)")
    parser.add_argument("--microbatches", type=int, required=True, help="micro-batches per iteration")
    parser.add_argument("--virtual", type=int, default=1, help="model chunks per stage (interleaved only)")
    parser.add_argument("--t-forward", type=float, default=1.0, help="forward time of one micro-batch (ms)")
    parser.add_argument("--t-backward", type=float, default=2.0, help="full backward time (ms)")
    parser.add_argument("--t-weight", type=float, default=None, help="weight-gradient time (zero-bubble; ms)")
    parser.add_argument("--cyclic", action="store_true", help="slots between back-to-back iterations")
    parser.add_argument("--no-grid", action="store_true", help="leave out the step x stage grid")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(func=run)


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
    """The plan as a JSON-ready dict (what ``--json`` prints)."""
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


def render_plan(schedule: Schedule, cyclic: bool = False, grid: bool = True) -> str:
    """The human-readable plan."""
    out = [
        f"schedule {schedule.name}: {schedule.ranks} stages x {schedule.microbatches} micro-batches"
        + (f" x {schedule.virtual} chunks" if schedule.virtual > 1 else "")
        + f", t_f={schedule.t_forward:g} ms, t_b={schedule.t_backward:g} ms"
        + (f", t_w={schedule.t_weight:g} ms" if schedule.name.startswith("zb") else ""),
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


def run(args: argparse.Namespace) -> int:
    schedule = build_schedule(
        args.schedule,
        args.stages,
        args.microbatches,
        t_forward=args.t_forward,
        t_backward=args.t_backward,
        t_weight=args.t_weight,
        virtual=args.virtual,
    )
    if args.json:
        json.dump(plan_json(schedule, cyclic=args.cyclic), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(render_plan(schedule, cyclic=args.cyclic, grid=not args.no_grid))
    return 0
