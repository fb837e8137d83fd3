"""The demo's run as a Chrome trace-event file, which Perfetto (ui.perfetto.dev) and chrome://tracing open.

Layout: one *process* per device (named ``cpu:0 (stage 0)``), and in it one *thread* for the
training stage and one per side task. The training thread holds a complete event (``ph: "X"``)
per iteration with the iteration's bubbles nested inside; a side task's thread holds one complete
event per grant with the task's steps nested inside, and instant events (``ph: "i"``) for freezes
and state changes. Metadata events (``ph: "M"``) name and order the processes and threads.

Times: ``ts`` and ``dur`` in microseconds (the format's unit), from the earliest event of the run,
on CLOCK_MONOTONIC (the trainer's and the managers' shared clock). Nesting in the legacy JSON
importers needs children inside parents: a bubble is clipped to its iteration, and a grant spans
its steps (see :mod:`freeride._demo.traces`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from freeride._demo.summary import Iteration
from freeride._demo.traces import Grant, Instant

TRAINING_TID = 1
#: Keys every event of the format carries (metadata events use pid/tid and args too).
REQUIRED_KEYS = ("name", "ph", "pid", "tid", "ts")


def chrome_trace(
    run: Mapping[int, Sequence[Iteration]],
    grants: Mapping[str, Sequence[Grant]],
    task_names: Mapping[str, str],
    instants: Mapping[str, Sequence[Instant]] | None = None,
) -> dict[str, Any]:
    """The trace-event document (a dict ready for ``json.dump``).

    Args:
        run: iterations per stage of the run with side tasks.
        grants: per device, the grants of its manager's trace.
        task_names: display name per task id.
        instants: per device, freezes and state changes of its tasks.
    """
    instants = instants or {}
    stage_of: dict[str, int] = {}
    for stage, iterations in sorted(run.items()):
        for it in iterations[:1]:
            stage_of.setdefault(it.device, stage)
    devices = sorted(set(stage_of) | set(grants) | set(instants), key=lambda d: (stage_of.get(d, 1 << 30), d))
    pid = {device: i + 1 for i, device in enumerate(devices)}
    starts = [it.start_ns for its in run.values() for it in its]
    starts += [g.start_ns for gs in grants.values() for g in gs]
    starts += [i.at_ns for ins in instants.values() for i in ins]
    t0 = min(starts) if starts else 0

    def us(ns: int) -> float:
        return round((ns - t0) / 1e3, 3)

    def dur(start_ns: int, end_ns: int) -> float:
        return round(max(0, end_ns - start_ns) / 1e3, 3)

    events: list[dict[str, Any]] = []
    tids: dict[tuple[str, str], int] = {}
    for device in devices:
        p = pid[device]
        label = f"{device} (stage {stage_of[device]})" if device in stage_of else device
        events.append({"name": "process_name", "ph": "M", "pid": p, "tid": 0, "ts": 0, "args": {"name": label}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": p, "tid": 0, "ts": 0,
                       "args": {"sort_index": p}})
        events.append({"name": "thread_name", "ph": "M", "pid": p, "tid": TRAINING_TID, "ts": 0,
                       "args": {"name": "training"}})
        seen = [g.task for g in grants.get(device, ())] + [i.task for i in instants.get(device, ())]
        for task in sorted(set(seen), key=lambda t: (list(task_names).index(t) if t in task_names else 1 << 30, t)):
            tid = TRAINING_TID + 1 + len([k for k in tids if k[0] == device])
            tids[(device, task)] = tid
            events.append({"name": "thread_name", "ph": "M", "pid": p, "tid": tid, "ts": 0,
                           "args": {"name": f"{task_names.get(task, task)} ({task})"}})
        for tid in [TRAINING_TID, *(t for (d, _), t in tids.items() if d == device)]:
            events.append({"name": "thread_sort_index", "ph": "M", "pid": p, "tid": tid, "ts": 0,
                           "args": {"sort_index": tid}})

    for stage, iterations in sorted(run.items()):
        for it in iterations:
            p = pid[it.device]
            events.append({
                "name": f"iteration {it.iteration}", "cat": "training", "ph": "X", "pid": p, "tid": TRAINING_TID,
                "ts": us(it.start_ns), "dur": dur(it.start_ns, it.end_ns),
                "args": {"stage": stage, "iteration": it.iteration, "time_ms": it.time_ms, "warmup": it.warmup},
            })  # fmt: skip
            for b in it.bubbles:
                start = max(it.start_ns, b.start_ns)
                end = min(it.end_ns, b.start_ns + round(b.length_ms * 1e6))
                events.append({
                    "name": f"bubble ({b.kind})", "cat": "bubble", "ph": "X", "pid": p, "tid": TRAINING_TID,
                    "ts": us(start), "dur": dur(start, end),
                    "args": {"slot": b.slot, "kind": b.kind, "length_ms": b.length_ms,
                             "predicted_ms": b.predicted_ms},
                })  # fmt: skip

    for device, device_grants in grants.items():
        p = pid[device]
        for g in device_grants:
            tid = tids[(device, g.task)]
            name = "grant" if g.steps else "grant (setup or a frozen step)"
            events.append({
                "name": name, "cat": "grant", "ph": "X", "pid": p, "tid": tid, "ts": us(g.start_ns),
                "dur": dur(g.start_ns, g.end_ns),
                "args": {"task": g.task, "grant": g.grant, "steps": len(g.steps), "parked": g.reason or "-",
                         "deadline_after_ms": round((g.deadline_ns - g.start_ns) / 1e6, 3), "thaw": g.thaw},
            })  # fmt: skip
            for s, e in g.steps:
                events.append({"name": "step", "cat": "step", "ph": "X", "pid": p, "tid": tid, "ts": us(s),
                               "dur": dur(s, e), "args": {"task": g.task, "grant": g.grant}})
    for device, device_instants in instants.items():
        p = pid[device]
        for i in device_instants:
            events.append({"name": i.name, "cat": "task", "ph": "i", "s": "t", "pid": p,
                           "tid": tids[(device, i.task)], "ts": us(i.at_ns), "args": dict(i.args)})
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"generator": "freeride demo", "clock": "CLOCK_MONOTONIC", "t0_ns": t0},
    }


def write_chrome_trace(path: Path, doc: Mapping[str, Any]) -> None:
    """Write the document as compact JSON."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as fh:
        json.dump(doc, fh, separators=(",", ":"))
