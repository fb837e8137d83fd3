"""The managers' timelines (``freeride manager --trace``) as grants with their steps inside.

A manager's trace (see :mod:`freeride._manager.trace`) says when it granted a bubble to a task,
when it told the task to park, when it froze one, and, once the worker parked, the spans of the
steps it ran in that grant. :func:`grants_from_trace` joins those records by ``(task, grant)``
into one :class:`Grant` each. The worker parks on its own when its next step would not fit, and
its park time is not in the trace, so a grant ends at the later of the manager's park order and
its last step's end; it always contains its steps, so viewers nest them under it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Grant:
    """One grant of a bubble to a task on a device, with the steps the task ran in it."""

    device: str
    task: str
    grant: int
    start_ns: int
    end_ns: int
    deadline_ns: int
    steps: tuple[tuple[int, int], ...]
    reason: str  # why the worker parked ("" when it never said)
    thaw: bool  # the grant also thawed a frozen worker (a step, or setup, goes on)


@dataclass(frozen=True)
class Instant:
    """A point event on a task's timeline (a freeze, a state change)."""

    device: str
    task: str
    at_ns: int
    name: str
    args: Mapping[str, Any]


def grants_from_trace(records: Iterable[Mapping[str, Any]]) -> list[Grant]:
    """Every grant of a trace, in the order granted; records of other kinds are ignored."""
    grants: dict[tuple[str, int], dict[str, Any]] = {}
    parks: dict[tuple[str, int], int] = {}
    steps: dict[tuple[str, int], tuple[list[list[int]], str]] = {}
    for r in records:
        ev = r.get("ev")
        if ev not in ("grant", "park", "steps"):
            continue
        key = (str(r["task"]), int(r["grant"]))
        if ev == "grant":
            grants[key] = dict(r)
        elif ev == "park":
            parks[key] = int(r["at_ns"])
        else:
            steps[key] = (list(r.get("spans") or []), str(r.get("reason", "")))
    result = []
    for key, g in grants.items():
        spans, reason = steps.get(key, ([], ""))
        pairs = tuple(sorted((int(s), max(int(s), int(e))) for s, e in spans))
        start = min([int(g["at_ns"]), *(s for s, _ in pairs)])
        end = max([start, parks.get(key, start), *(e for _, e in pairs)])
        result.append(Grant(
            device=str(g.get("device", "")), task=key[0], grant=key[1], start_ns=start, end_ns=end,
            deadline_ns=int(g["deadline_ns"]), steps=pairs, reason=reason, thaw=bool(g.get("thaw", False)),
        ))  # fmt: skip
    result.sort(key=lambda g: (g.start_ns, g.grant))
    return result


def instants_from_trace(records: Iterable[Mapping[str, Any]]) -> list[Instant]:
    """Freezes, and the state changes other than the routine ones of every grant and freeze."""
    routine = {("PARKED", "RUNNING"), ("RUNNING", "PARKED"), ("RUNNING", "FROZEN"), ("FROZEN", "RUNNING")}
    out = []
    for r in records:
        ev = r.get("ev")
        if ev == "freeze":
            out.append(Instant(str(r.get("device", "")), str(r["task"]), int(r["at_ns"]), "freeze", {}))
        elif ev == "state" and (r.get("old"), r.get("new")) not in routine:
            name = f"{r.get('old') or 'new'} -> {r.get('new')}"
            out.append(Instant(str(r.get("device", "")), str(r["task"]), int(r["at_ns"]), name,
                               {"reason": r.get("reason", "")}))
    return out


def step_spans(grants: Sequence[Grant]) -> list[tuple[str, int, int]]:
    """``(task, start_ns, end_ns)`` of every step of these grants."""
    return [(g.task, s, e) for g in grants for s, e in g.steps]
