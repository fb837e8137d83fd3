"""Where bubble time goes: harvest efficiency and its breakdown, from a manager's trace.

One function computes harvest efficiency for the demo and for the bench (:func:`harvest`), over one
window rule (:func:`steady_window`: after the trainer's warm-up and every task's first step), so the
two cannot disagree by definition. Its inputs are a manager's trace (``freeride manager --trace``,
see :mod:`freeride._manager.trace`), a measurement window, and each task's **standalone seconds
per step**: the progress one of its steps makes, divided by its standalone throughput on the same
device (:mod:`freeride.standalone`). Then

    H = (sum over the steps of the window's grants of their standalone seconds) / B

with ``B`` the summed length of the bubbles that start in the window (real start to real end, as
the trainer reported them). This is DESIGN section 6's ``(progress / standalone throughput) / B``
with the progress counted step by step, so that it can be split by where it happened.

**The breakdown.** Every bubble ``[start, end)`` is cut into labelled pieces that cover it exactly,
so the categories of a bubble, and of a run, sum to 100% of its bubble time:

``work``
    standalone-equivalent work: each step's time in the bubble, scaled by ``standalone / actual``
    (a step that took 3 ms where it takes 2 ms alone gives 2 ms of work for each 3 ms it spent).
``slower``
    the rest of the steps' time: steps running slower in bubbles than alone (cold caches after the
    trainer's compute, a shared memory bus). Negative when they ran faster than the standalone
    yardstick (measured on a busier machine).
``probe``
    a task's first grants (setup, which may span several bubbles, frozen between them, and the
    steps of its first stepping grant, which learn its step time), beyond their work.
    Re-probes (one grant per 200 bubbles that fit none of a task's steps) are not marked in the
    trace and count with the other steps.
``delivery``
    bubble start to the manager receiving the report (trainer to manager).
``decision``
    the report received to the grant (the manager's loop; the reference policy's 10 ms poll).
``wakeup``
    the grant to the worker's first step (the message to the worker, its loop waking).
``between``
    gaps between two steps of one grant (the worker's loop, timing, the reference policy's sleeps).
``handoff``
    one task parked (its next step would not fit) to the next task's grant in the same bubble.
``margin``
    after the last step, up to the grant's deadline: the next step (p95 estimate plus the task's
    margin) would not fit.
``past_predicted``
    after the grant's deadline, up to the real end: the bubble lasted longer than predicted. Also, in a
    bubble whose prediction fitted no step, the wait from the predicted end to the grant made once the
    bubble had outlived it (a ``late`` grant: ``OpenBubble.next_chance_ns``).
``idle``
    bubbles in which nothing was granted (too short for any task's step, or no task to run).

Outside the 100% (step time after the real end, which is training time, not bubble time):
``overrun_s`` and the standalone work done there, ``work_past_end_s``; ``H`` counts both works,
so ``H = (work + work_past_end) / B``.

**Overrun, held and ran.** Per granted bubble, ``overrun_ms`` is how long past the real end a step was
held: to its reported end, or to the freeze that stopped it. ``cpu_overrun_ms`` bounds a frozen step's
part by what the worker could run in it: the worker's CPU time from the latest reading no later than
where that part begins (its last step's start, reported by the worker; or the grant, read by the
manager) to the freeze (read by the manager once the stop is sent); and a step that ended by itself past
the end by its cost (its time less its wait for the core, as the worker measured it; the trace's
``costs``). The two differ where the worker gets no core past the end: on a core shared with the
trainer, the trainer's wake takes the core from the worker (nice 19), which then waits,
unfrozen but idle, until the core is free again or its manager gets a core to freeze it.
On a CPU device ``cpu_overrun_ms`` is the side task's time that competed with the trainer; on a GPU it
is host time only (kernels already queued run on), and ``overrun_ms`` is the figure to read.

**Steps the trace does not list.** A worker reports the spans of at most its 64 most recent steps
per grant (and their count). The time from the grant to its first listed span then holds the
unlisted steps: it counts as their work, and the difference to their standalone time as ``slower``.

A step frozen at a bubble's end and thawed in a later grant is reported there with the start it
had in the earlier bubble and its running time; its pieces outside the later bubble count as work
outside bubbles. Nothing here measures anything: plain arithmetic on trace records.
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: The categories of bubble time, in the order reports list them; they sum to the bubble time.
CATEGORIES: tuple[str, ...] = ("work", "slower", "probe", "delivery", "decision", "wakeup", "between", "handoff",
                               "margin", "past_predicted", "idle")

#: What each category means, one line each, for reports.
CATEGORY_TEXT: dict[str, str] = {
    "work": "standalone-equivalent work",
    "slower": "steps slower in bubbles than alone",
    "probe": "first grant of a task (setup, first steps)",
    "delivery": "grant latency: bubble start to the report reaching the manager",
    "decision": "grant latency: report to grant (manager loop, polling)",
    "wakeup": "grant latency: grant to the worker's first step",
    "between": "between steps of a grant (worker loop, sleeps)",
    "handoff": "hand-off: one task parked to the next one's grant",
    "margin": "margin: the next step would not fit before the deadline",
    "past_predicted": "after the predicted end (bubble longer than predicted)",
    "idle": "bubbles with no grant",
}

_NS = 1e9


@dataclass(frozen=True)
class TraceBubble:
    """One bubble a manager was told about, with both ends (CLOCK_MONOTONIC ns)."""

    stage: int
    rank: int
    iteration: int
    slot: int
    start_ns: int
    end_ns: int
    predicted_ns: int = 0
    received_ns: int | None = None  # when the manager received the start

    @property
    def length_s(self) -> float:
        return max(0, self.end_ns - self.start_ns) / _NS


@dataclass(frozen=True)
class TraceGrant:
    """One grant with the steps the worker reported for it."""

    task: str
    grant: int
    at_ns: int
    deadline_ns: int
    spans: tuple[tuple[int, int], ...] = ()  # the listed steps, in order
    count: int = 0  # steps run in the grant (>= len(spans))
    thaw: bool = False
    first_of_task: bool = False  # a grant before the task's first step, or the one that ran it
    #: When the manager froze the worker during this grant (its ``freeze`` record), if it did.
    frozen_ns: int | None = None
    #: The worker's CPU time read at that freeze, when its last listed step began, and at the grant
    #: (None: not known).
    frozen_cpu_ns: int | None = None
    start_cpu_ns: int | None = None
    granted_cpu_ns: int | None = None
    #: The bubble's first grant, made only once the bubble outlived its prediction (the trace's ``late``).
    late: bool = False
    #: Each listed step's cost, in the order of ``spans`` (its time less its wait for the core, as the worker
    #: measured it); empty where the trace has none.
    costs: tuple[int, ...] = ()
    #: Why the worker's report of this grant ended it (``"frozen"``: the next grant thawed it); None
    #: without a report (a grant that only finished a step an earlier one began, frozen again).
    reason: str | None = None

    @property
    def stopped_by_freeze(self) -> bool:
        """The worker was still inside this grant when it was frozen: its last step ran until the freeze
        (a worker that had parked already, its report not yet read, was frozen idle)."""
        return self.frozen_ns is not None and self.reason in (None, "frozen")


def bubbles_from_trace(records: Iterable[Mapping[str, Any]]) -> list[TraceBubble]:
    """The bubbles of a trace that have both a start and an end, in order of start."""
    starts: dict[tuple[int, int, int, int], Mapping[str, Any]] = {}
    ends: dict[tuple[int, int, int, int], int] = {}
    for r in records:
        ev = r.get("ev")
        if ev not in ("bubble_start", "bubble_end"):
            continue
        key = (int(r["stage"]), int(r["rank"]), int(r["iteration"]), int(r["slot"]))
        if ev == "bubble_start":
            starts[key] = r
        else:
            ends[key] = int(r["end_ns"])
    out = []
    for key, r in starts.items():
        if key not in ends:
            continue
        received = r.get("received_ns")
        out.append(TraceBubble(*key, start_ns=int(r["start_ns"]), end_ns=ends[key],
                               predicted_ns=int(r.get("predicted_ns", 0)),
                               received_ns=int(received) if received is not None else None))
    out.sort(key=lambda b: (b.start_ns, b.stage, b.slot))
    return out


def grants_from_trace(records: Iterable[Mapping[str, Any]]) -> list[TraceGrant]:
    """The grants of a trace joined with their ``steps`` records, in the order granted.

    A ``freeze`` record belongs to the task's latest grant written before it (the manager writes a freeze after the
    grant it ends). Not the latest given at or before its time: a freeze the trainer made at a bubble's end is dated
    at its stop, and a manager that lost its core between sending a grant and stamping it (before the stamp moved
    ahead of the send) wrote a grant dated after the stop of its own worker; by the times, the stop went to the
    grant before, and this grant to a freeze tens of milliseconds later (a 65 ms hold read on a second rank).
    """
    grants: dict[tuple[str, int], Mapping[str, Any]] = {}
    steps: dict[tuple[str, int], Mapping[str, Any]] = {}
    latest: dict[str, tuple[str, int]] = {}  # each task's grant written last so far
    frozen_at: dict[tuple[str, int], tuple[int, int | None]] = {}
    for r in records:
        ev = r.get("ev")
        if ev == "grant":
            key = (str(r["task"]), int(r["grant"]))
            grants[key] = r
            latest[key[0]] = key
        elif ev == "steps":
            steps[(str(r["task"]), int(r["grant"]))] = r
        elif ev == "freeze":
            granted = latest.get(str(r["task"]))
            if granted is not None:
                cpu = r.get("cpu_ns")
                frozen_at.setdefault(granted, (int(r["at_ns"]), None if cpu is None else int(cpu)))
    ordered = sorted(grants.items(), key=lambda kv: (int(kv[1]["at_ns"]), kv[0][1]))
    out = []
    stepped: set[str] = set()  # tasks that have run a step: their probe grants are over
    for key, g in ordered:
        s = steps.get(key, {})
        raw = [(int(a), max(int(a), int(z))) for a, z in s.get("spans") or ()]
        listed_costs = s.get("costs") or ()
        costs: tuple[int, ...] = ()
        if len(listed_costs) == len(raw):
            paired = sorted(zip(raw, (int(c) for c in listed_costs), strict=True))
            spans, costs = tuple(p[0] for p in paired), tuple(p[1] for p in paired)
        else:
            spans = tuple(sorted(raw))
        count = max(len(spans), int(s.get("count", len(spans))))
        frozen, frozen_cpu = frozen_at.get(key, (None, None))
        start_cpu, granted_cpu = s.get("start_cpu_ns"), g.get("cpu_ns")
        out.append(TraceGrant(task=key[0], grant=key[1], at_ns=int(g["at_ns"]), deadline_ns=int(g["deadline_ns"]),
                              spans=spans, count=count, thaw=bool(g.get("thaw", False)),
                              first_of_task=key[0] not in stepped, frozen_ns=frozen, frozen_cpu_ns=frozen_cpu,
                              start_cpu_ns=None if start_cpu is None else int(start_cpu),
                              granted_cpu_ns=None if granted_cpu is None else int(granted_cpu),
                              late=bool(g.get("late", False)), costs=costs,
                              reason=str(s["reason"]) if "reason" in s else None))
        if count:
            stepped.add(key[0])
    return out


# ------------------------------------------------------------------ one bubble


@dataclass
class BubbleAccount:
    """Where one bubble's time went (seconds per category, summing to its length) and what ran."""

    bubble: TraceBubble
    seconds: dict[str, float]
    work_past_end_s: float = 0.0  # standalone work of the step time outside the bubble
    overrun_s: float = 0.0  # step time after the real end
    overrun_ms: float | None = None  # how far the last step ran past the end; None when nothing was granted
    steps: dict[str, int] = field(default_factory=dict)  # task -> steps of the bubble's grants
    #: ``overrun_ms`` with a frozen grant's part past the end bounded by the worker's CPU time up to the
    #: freeze (module doc): what it could run, not how long it was held unfrozen. The same as
    #: ``overrun_ms`` where no frozen grant has the figures.
    cpu_overrun_ms: float | None = None

    @property
    def work_s(self) -> float:
        """All the standalone work of the bubble's grants, inside the bubble and past its end."""
        return self.seconds["work"] + self.work_past_end_s


class _Sweep:
    """Adds labelled pieces of ``[start, end)`` in time order, each clipped and never counted twice."""

    def __init__(self, start: int, end: int) -> None:
        self.start, self.end = start, end
        self.cursor = start
        self.ns: dict[str, float] = dict.fromkeys(CATEGORIES, 0.0)

    def add(self, label: str, a: int, z: int) -> int:
        """Count ``[a, z)`` (clipped) under ``label``; returns the time counted (ns)."""
        a, z = max(a, self.cursor, self.start), min(z, self.end)
        if z <= a:
            return 0
        self.ns[label] += z - a
        self.cursor = z
        return z - a


def account_bubble(bubble: TraceBubble, grants: Sequence[TraceGrant], step_s: Mapping[str, float]) -> BubbleAccount:
    """Cut one bubble into the categories of the module doc.

    ``grants`` are the grants given in this bubble, in order; ``step_s`` maps a task to its
    standalone seconds per step (a task missing from it counts no work: its steps are ``slower``).
    """
    sweep = _Sweep(bubble.start_ns, bubble.end_ns)
    work_past_ns = 0.0
    overrun_ns = 0
    last_step_end: int | None = None
    last_ran_end: int | None = None  # last_step_end, a frozen step's part past the end bounded by CPU time
    steps: dict[str, int] = {}
    if not grants:
        sweep.add("idle", bubble.start_ns, bubble.end_ns)
        return _finish(bubble, sweep, 0.0, 0, None, steps)
    received = bubble.received_ns if bubble.received_ns is not None else bubble.start_ns
    sweep.add("delivery", bubble.start_ns, min(received, grants[0].at_ns))
    decided = grants[0].at_ns
    predicted_end = bubble.start_ns + bubble.predicted_ns
    if grants[0].late and received <= predicted_end < decided:
        # Granted only once it outlived its prediction (no step fitted what the prediction left): the wait
        # past the predicted end is the bubble lasting longer than predicted, not the loop's decision.
        decided = predicted_end
    sweep.add("decision", received, decided)
    sweep.add("past_predicted", decided, grants[0].at_ns)
    previous_end: int | None = None

    def step_time(label: str, a: int, z: int, work_ns: float) -> float:
        """Count ``[a, z)`` of step time as work (at the standalone rate) and ``label``; the
        standalone work of the part outside the bubble is returned."""
        inside = sweep.add(label, a, z)
        share = inside / (z - a) if z > a else 0.0
        work_in = work_ns * share
        sweep.ns[label] -= work_in
        sweep.ns["work"] += work_in
        return work_ns - work_in

    for g in grants:
        w_ns = step_s.get(g.task, 0.0) * _NS
        steps[g.task] = steps.get(g.task, 0) + g.count
        if previous_end is not None:
            sweep.add("handoff", previous_end, g.at_ns)
        slower = "probe" if g.first_of_task else "slower"
        unlisted = g.count - len(g.spans)
        if unlisted > 0:
            # They ran between the grant and the first listed step (a worker that lists none: up to
            # the deadline), where wake-up and step time cannot be told apart.
            until = g.spans[0][0] if g.spans else max(g.at_ns, min(g.deadline_ns, bubble.end_ns))
            inside = sweep.add(slower, g.at_ns, until)
            work_in = min(unlisted * w_ns, float(inside))
            sweep.ns[slower] -= work_in
            sweep.ns["work"] += work_in
            work_past_ns += unlisted * w_ns - work_in
            if not g.spans:
                last_step_end = until if last_step_end is None else max(last_step_end, until)
                last_ran_end = until if last_ran_end is None else max(last_ran_end, until)
        elif g.spans:
            sweep.add("probe" if g.first_of_task else "wakeup", g.at_ns, g.spans[0][0])
        elif g.first_of_task:
            # Setup (or a first step) that has not finished: it runs to the bubble's end and is frozen there.
            sweep.add("probe", g.at_ns, bubble.end_ns)
        previous_step_end: int | None = None
        frozen_at = g.frozen_ns if g.stopped_by_freeze else None
        last = len(g.spans) - 1
        for k, (a, z) in enumerate(g.spans):
            if previous_step_end is not None:
                sweep.add("between", previous_step_end, a)
            work_past_ns += step_time(slower, a, z, w_ns)
            # A frozen step's span is its running time, thawed part included: it ran here until the freeze.
            ran_until = frozen_at if frozen_at is not None and k == last else z
            overrun_ns += max(0, ran_until - max(a, bubble.end_ns))
            previous_step_end = z
            last_step_end = ran_until if last_step_end is None else max(last_step_end, ran_until)
            if frozen_at is not None and k == last:
                since = max(a, bubble.end_ns)
                ran_end = since + _ran_until_freeze_ns(g, since, ((a, g.start_cpu_ns), (g.at_ns, g.granted_cpu_ns)))
            elif g.costs and z > bubble.end_ns:
                # A step that ended by itself past the end ran there no more than its cost: preempted by the
                # trainer, a worker waits idle, unfrozen, until the core is free again or its manager freezes it.
                since = max(a, bubble.end_ns)
                ran_end = since + min(z - since, g.costs[k])
            else:
                ran_end = ran_until
            last_ran_end = ran_end if last_ran_end is None else max(last_ran_end, ran_end)
        if frozen_at is not None and not g.spans:
            # No step of its own finished in it (a step an earlier grant began, frozen again): the
            # worker ran until the freeze all the same.
            overrun_ns += max(0, frozen_at - max(g.at_ns, bubble.end_ns))
            last_step_end = frozen_at if last_step_end is None else max(last_step_end, frozen_at)
            # Before a grant given past the end its worker was parked or frozen: what it ran past the end
            # began at the grant.
            since = max(g.at_ns, bubble.end_ns)
            ran_end = bubble.end_ns + _ran_until_freeze_ns(g, since, ((g.at_ns, g.granted_cpu_ns),))
            last_ran_end = ran_end if last_ran_end is None else max(last_ran_end, ran_end)
        if previous_step_end is not None:
            previous_end = previous_step_end
        else:
            previous_end = max(g.at_ns, last_step_end or 0, previous_end or 0)
    tail_from = max(sweep.cursor, previous_end or sweep.cursor)
    deadline = grants[-1].deadline_ns
    sweep.add("margin", tail_from, min(deadline, bubble.end_ns))
    sweep.add("past_predicted", max(tail_from, deadline), bubble.end_ns)
    overrun_ms = max(0, last_step_end - bubble.end_ns) / 1e6 if last_step_end is not None else 0.0
    cpu_overrun_ms = max(0, last_ran_end - bubble.end_ns) / 1e6 if last_ran_end is not None else 0.0
    return _finish(bubble, sweep, work_past_ns, overrun_ns, overrun_ms, steps, cpu_overrun_ms)


def _ran_until_freeze_ns(g: TraceGrant, since: int, readings: tuple[tuple[int, int | None], ...]) -> int:
    """What a frozen grant's worker ran from ``since`` to the freeze: the time between, or less where the
    worker's CPU time from its latest reading at or before ``since`` (``readings``: when, and the CPU time
    then, or None) to the freeze is shorter.

    What it ran between that reading and ``since`` counts as after it, so this bounds what it ran from
    above: on a core shared with the trainer, a worker at nice 19 that the trainer's wake took the core
    from stays unfrozen, and idle, until its manager gets a core to freeze it.
    """
    assert g.frozen_ns is not None
    held = max(0, g.frozen_ns - since)
    before = [cpu for at, cpu in readings if cpu is not None and at <= since]
    if g.frozen_cpu_ns is None or not before:
        return held
    return min(held, max(0, g.frozen_cpu_ns - max(before)))


def _finish(bubble: TraceBubble, sweep: _Sweep, work_past_ns: float, overrun_ns: int, overrun_ms: float | None,
            steps: dict[str, int], cpu_overrun_ms: float | None = None) -> BubbleAccount:
    # The pieces are contiguous by construction (each starts where the previous one ended, or
    # later only by a piece of its own); whatever a malformed trace leaves uncovered is margin.
    left = max(0, bubble.end_ns - bubble.start_ns) - sum(sweep.ns.values())
    if left > 1e-6:
        sweep.ns["idle" if not steps else "margin"] += left
    return BubbleAccount(bubble, {k: v / _NS for k, v in sweep.ns.items()}, work_past_ns / _NS, overrun_ns / _NS,
                         overrun_ms, steps, overrun_ms if cpu_overrun_ms is None else cpu_overrun_ms)


# ------------------------------------------------------------------ a run


def account_trace(records: Iterable[Mapping[str, Any]], step_s: Mapping[str, float],
                  window: tuple[int, int] | None = None) -> list[BubbleAccount]:
    """Every bubble of one device's trace that starts in ``window`` (``[start_ns, end_ns)``; None: all).

    A grant belongs to the latest bubble that started at or before it was given.
    """
    records = list(records)
    bubbles = bubbles_from_trace(records)
    grants = grants_from_trace(records)
    starts = [b.start_ns for b in bubbles]
    per_bubble: dict[int, list[TraceGrant]] = {}
    for g in grants:
        i = bisect.bisect_right(starts, g.at_ns) - 1
        if i >= 0:
            per_bubble.setdefault(i, []).append(g)
    out = []
    for i, b in enumerate(bubbles):
        if window is not None and not window[0] <= b.start_ns < window[1]:
            continue
        out.append(account_bubble(b, per_bubble.get(i, []), step_s))
    return out


@dataclass(frozen=True)
class Harvest:
    """The harvest of a run (one device or several): efficiency, breakdown, overruns, steps."""

    bubbles: int
    bubble_s: float
    work_s: float  # standalone work, inside bubbles and past their ends
    seconds: dict[str, float]  # per category, summing to bubble_s
    work_past_end_s: float
    overrun_s: float
    overruns_ms: tuple[float, ...]  # per granted bubble, zeros included
    steps: dict[str, int]
    #: Per granted bubble, as ``overruns_ms``: a frozen step's part bounded by the worker's CPU time
    #: (:attr:`BubbleAccount.cpu_overrun_ms`).
    cpu_overruns_ms: tuple[float, ...] = ()

    @property
    def efficiency(self) -> float | None:
        """``H = work / B``; None without bubble time."""
        return self.work_s / self.bubble_s if self.bubble_s > 0 else None

    def shares(self) -> dict[str, float]:
        """Each category as a share of the bubble time (they sum to 1)."""
        return {k: (v / self.bubble_s if self.bubble_s > 0 else 0.0) for k, v in self.seconds.items()}

    def to_json(self) -> dict[str, Any]:
        return {"bubbles": self.bubbles, "bubble_s": self.bubble_s, "work_s": self.work_s,
                "efficiency": self.efficiency, "seconds": dict(self.seconds),
                "work_past_end_s": self.work_past_end_s, "overrun_s": self.overrun_s,
                "overruns_ms": list(self.overruns_ms), "cpu_overruns_ms": list(self.cpu_overruns_ms),
                "steps": dict(self.steps)}


def summarize(accounts: Iterable[BubbleAccount], min_bubble_s: float = 0.0) -> Harvest:
    """Sum bubble accounts, keeping only bubbles at least ``min_bubble_s`` long."""
    seconds = dict.fromkeys(CATEGORIES, 0.0)
    steps: dict[str, int] = {}
    n = 0
    bubble_s = work_past = overrun = 0.0
    overruns: list[float] = []
    cpu_overruns: list[float] = []
    for acc in accounts:
        if acc.bubble.length_s < min_bubble_s:
            continue
        n += 1
        bubble_s += acc.bubble.length_s
        for k, v in acc.seconds.items():
            seconds[k] += v
        work_past += acc.work_past_end_s
        overrun += acc.overrun_s
        if acc.overrun_ms is not None and acc.steps:
            overruns.append(acc.overrun_ms)
            cpu_overruns.append(acc.overrun_ms if acc.cpu_overrun_ms is None else acc.cpu_overrun_ms)
        for task, count in acc.steps.items():
            steps[task] = steps.get(task, 0) + count
    return Harvest(n, bubble_s, seconds["work"] + work_past, seconds, work_past, overrun, tuple(overruns), steps,
                   tuple(cpu_overruns))


def harvest(traces: Iterable[Iterable[Mapping[str, Any]]], step_s: Mapping[str, float],
            window: tuple[int, int] | None = None, min_bubble_s: float = 0.0) -> Harvest:
    """The harvest of one run from its managers' traces (one per device): the demo's and the bench's.

    ``step_s`` maps each task id to its standalone seconds per step (:func:`standalone_step_s`).
    """
    accounts: list[BubbleAccount] = []
    for records in traces:
        accounts += account_trace(records, step_s, window)
    return summarize(accounts, min_bubble_s)


def steady_window(traces: Iterable[Iterable[Mapping[str, Any]]], window: tuple[int, int]) -> tuple[int, int]:
    """``window`` started no earlier than the first step of every task in the traces (steady state).

    A task's first grants run its ``setup`` (building a graph, a model), only inside bubbles and frozen
    between them, so it can take many iterations; that one-off cost is the ``probe`` category, not the
    steady harvest a long training job sees. Both the demo and the bench measure H from here on.
    """
    first: dict[str, int] = {}
    for records in traces:
        for g in grants_from_trace(records):
            if g.spans:
                first[g.task] = min(first.get(g.task, g.spans[0][0]), g.spans[0][0])
    start = max([window[0], *first.values()])
    return (min(start, window[1]), window[1])


def standalone_step_s(progress: float, steps: int, standalone_progress_per_s: float) -> float:
    """A task's standalone seconds per step: the progress of one step over its standalone throughput."""
    if steps <= 0 or not math.isfinite(progress) or progress < 0:
        return 0.0
    if not (math.isfinite(standalone_progress_per_s) and standalone_progress_per_s > 0):
        raise ValueError(f"the standalone throughput must be > 0, got {standalone_progress_per_s!r}")
    return progress / steps / standalone_progress_per_s


def window_of(ranks: Iterable[Iterable[Mapping[str, Any]]]) -> tuple[int, int]:
    """The measurement window of a run: from the end of the last warm-up iteration (of the latest rank)
    to the end of the last iteration of any rank.

    ``ranks`` are each rank's iteration records (``iteration``, ``warmup``, ``end_ns``, ``time_ms``;
    records without ``iteration``, such as a log's closing summary, are skipped). A run without
    warm-up starts at its first iteration's start.
    """
    start = end = 0
    for records in ranks:
        its = [r for r in records if "iteration" in r]
        if not its:
            continue
        warm = [int(r["end_ns"]) for r in its if r.get("warmup")]
        first = min(int(r["end_ns"]) - int(float(r["time_ms"]) * 1e6) for r in its)
        start = max(start, max(warm) if warm else first)
        end = max(end, max(int(r["end_ns"]) for r in its))
    return start, end


def measurement_window(rank_logs: Iterable[Path]) -> tuple[int, int]:
    """:func:`window_of` the trainer's iteration logs (JSON lines, one file per rank)."""
    return window_of([json.loads(line) for line in path.read_text().splitlines() if line.strip()]
                     for path in rank_logs)
