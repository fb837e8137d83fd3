"""Fixed data shaped like a demo run: iteration logs of two stages, manager stats, tasks and traces."""

from __future__ import annotations

from typing import Any

from freeride._demo.summary import Bubble, Iteration
from freeride.messages import FailureRecord, ManagerStats, Percentiles, TaskInfo, TaskProgress, TaskSpec

MS = 1_000_000
T0 = 10_000 * MS  # an arbitrary CLOCK_MONOTONIC origin
ITERATION_MS = 100.0


def iterations(stage: int, count: int = 10, warmup: int = 2, bubble_ms: tuple[float, ...] = (20.0,),
               iteration_ms: float = ITERATION_MS) -> list[Iteration]:  # fmt: skip
    """``count`` back-to-back iterations of ``stage`` on ``cpu:<stage>``; bubble k starts 10 + 30k ms in."""
    out = []
    for i in range(count):
        start = T0 + round(i * iteration_ms * MS)
        bubbles = tuple(
            Bubble(slot=k, kind="drain" if k else "turnaround", start_ns=start + (10 + 30 * k) * MS, length_ms=length,
                   predicted_ms=length)
            for k, length in enumerate(bubble_ms)
        )  # fmt: skip
        out.append(Iteration(i, stage, f"cpu:{stage}", i < warmup, iteration_ms, start + round(iteration_ms * MS),
                             bubbles))  # fmt: skip
    return out


def run(count: int = 10, warmup: int = 2, iteration_ms: float = ITERATION_MS) -> dict[int, list[Iteration]]:
    return {0: iterations(0, count, warmup, (20.0, 10.0), iteration_ms),
            1: iterations(1, count, warmup, (25.0,), iteration_ms)}  # fmt: skip


def stats(device: str, bubble_s: float, harvested_s: float, bubbles: int = 10) -> ManagerStats:
    p = Percentiles(count=1, p50=0.3, p90=0.4, p99=0.5, max=0.6)
    return ManagerStats(device=device, uptime_s=5.0, bubbles=bubbles, bubble_time_s=bubble_s, granted_s=harvested_s,
                        harvested_s=harvested_s, overruns=0, overrun_ms=Percentiles(), grant_latency_ms=p,
                        park_latency_ms=p, memory_budget_bytes=2**30, tasks_by_state={"PARKED": 1},
                        events_received=2 * bubbles, events_rejected=0, draining=False)  # fmt: skip


def task(task_id: str, name: str, progress: float, state: str = "PARKED", unit: str = "steps",
         failure: FailureRecord | None = None, harvested_s: float = 0.1) -> TaskInfo:  # fmt: skip
    spec = TaskSpec(target=f"side_tasks.x:{name.title()}", memory_bytes=2**28, name=name)
    figures = TaskProgress(steps=int(progress), progress=progress, progress_unit=unit, harvested_s=harvested_s)
    return TaskInfo(task_id=task_id, spec=spec, state=state, figures=figures, failure=failure, pid=4242)


def trace(device: str, task_id: str, bubbles: list[tuple[int, int]]) -> list[dict[str, Any]]:
    """A manager trace: one grant per bubble ``(start_ns, end_ns)``, two 2 ms steps, then a park."""
    records: list[dict[str, Any]] = [
        {"ev": "state", "device": device, "task": task_id, "old": None, "new": "SUBMITTED", "reason": "submitted",
         "at_ns": T0 - 5 * MS},
        {"ev": "state", "device": device, "task": task_id, "old": "STARTING", "new": "PARKED",
         "reason": "worker ready", "at_ns": T0 - MS},
    ]  # fmt: skip
    for grant, (start, end) in enumerate(bubbles, 1):
        at = start + MS // 2
        spans = [[at + MS // 10, at + MS // 10 + 2 * MS], [at + 3 * MS, at + 5 * MS]]
        records += [
            {"ev": "bubble_start", "device": device, "stage": 0, "rank": 0, "iteration": grant, "slot": 0,
             "kind": "turnaround", "start_ns": start, "predicted_ns": end - start, "received_ns": start + 1000},
            {"ev": "grant", "device": device, "task": task_id, "grant": grant, "deadline_ns": end, "thaw": False,
             "at_ns": at},
            {"ev": "state", "device": device, "task": task_id, "old": "PARKED", "new": "RUNNING", "reason": "granted",
             "at_ns": at},
            {"ev": "bubble_end", "device": device, "stage": 0, "rank": 0, "iteration": grant, "slot": 0,
             "end_ns": end, "received_ns": end + 1000},
            {"ev": "park", "device": device, "task": task_id, "grant": grant, "at_ns": end + 2000},
            {"ev": "steps", "device": device, "task": task_id, "grant": grant, "reason": "park", "spans": spans},
        ]  # fmt: skip
    records.append({"ev": "freeze", "device": device, "task": task_id, "at_ns": bubbles[-1][1] + MS})
    return records


def run_traces(by_stage: dict[int, list[Iteration]], tasks: dict[str, list[str]]) -> dict[str, list[dict[str, Any]]]:
    """Per device, a manager trace of ``by_stage``'s bubbles: each bubble granted to the device's tasks in
    turn (``tasks``: device -> task ids), two 2 ms steps per grant as in :func:`trace`."""
    out: dict[str, list[dict[str, Any]]] = {}
    for its in by_stage.values():
        device = its[0].device
        ids = tasks.get(device, [])
        records: list[dict[str, Any]] = []
        grants: dict[str, int] = {}
        bubble_number = 0
        for it in its:
            for b in it.bubbles:
                bubble_number += 1
                start, end = b.start_ns, b.start_ns + round(b.length_ms * MS)
                key = {"device": device, "stage": it.stage, "rank": it.stage, "iteration": it.iteration, "slot": b.slot}
                records += [{"ev": "bubble_start", **key, "kind": b.kind, "start_ns": start,
                             "predicted_ns": end - start, "received_ns": start + 1000},
                            {"ev": "bubble_end", **key, "end_ns": end, "received_ns": end + 1000}]
                if not ids:
                    continue
                task_id = ids[(bubble_number - 1) % len(ids)]
                grants[task_id] = grant = grants.get(task_id, 0) + 1
                at = start + MS // 2
                spans = [[at + MS // 10, at + MS // 10 + 2 * MS], [at + 3 * MS, at + 5 * MS]]
                records += [{"ev": "grant", "device": device, "task": task_id, "grant": grant, "deadline_ns": end,
                             "thaw": False, "at_ns": at},
                            {"ev": "steps", "device": device, "task": task_id, "grant": grant, "reason": "deadline",
                             "count": 2, "spans": spans}]
        out[device] = records
    return out
