"""Placement: may this manager take a task from the cluster queue now, and which one first? (pure)

A manager claims a task only when it can place it, so that nothing claimed waits on a device that
cannot run it while another could. It can place a task when:

* it is not draining, its device can be read, and the device runs a stage of the trainer's current layout;
* it has seen a bubble since it started or since the layout last changed (no bubbles: no harvest), and one
  began in the last 5 s (the trainer runs now);
* no task here still waits for memory (a manager that cannot start what it holds takes no more);
* the task's memory cap fits the device budget left (:meth:`SchedulerCore.budget_bytes`);
* the task's step time, when known (the submitter's hint, or the p95 learned on an earlier device),
  plus the manager's margin fits the longest bubble seen. A task whose step time is unknown fits:
  the manager probes it, as it does for a local task.

Among the tasks it can place, it takes the highest priority first, then the oldest submission.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

MS = 1_000_000


@dataclass(frozen=True)
class Capacity:
    """What a manager offers now, as its loop sees it."""

    budget_bytes: int | None  # None: no memory figure yet
    longest_bubble_ns: int  # predicted, since start or the last layout change; 0: no bubble seen
    margin_ns: int
    waiting: int  # tasks here that wait for memory
    draining: bool = False
    hosts_stage: bool = True
    device_problem: str = ""  # the device cannot be read now: nothing is admitted here meanwhile
    #: No bubble started for a trainer pause (``TRAINER_PAUSE_NS``): the trainer paused or ended. A manager
    #: whose trainer had ended claimed every new task from its bubbles of before, and held them through the
    #: next run while the device beside it, restarted, harvested nothing.
    trainer_paused: bool = False
    #: The device's memory in all (0: unknown): announced in the queue, where ``submit --queue`` checks a cap.
    total_bytes: int = 0


@dataclass(frozen=True)
class Candidate:
    """A task waiting in the cluster queue, with what placement needs to know of it."""

    task_id: str
    memory_bytes: int
    priority: int
    seq: int
    step_ns: int | None = None  # None: unknown


def closed_reason(cap: Capacity) -> str | None:
    """Why this manager takes no task at all now, or None if it may take one that fits."""
    if cap.draining:
        return "draining"
    if cap.device_problem:
        return f"the device cannot be read: {cap.device_problem}"
    if not cap.hosts_stage:
        return "no stage of the trainer's layout runs on this device"
    if cap.budget_bytes is None:
        return "no free-memory figure yet"
    if cap.longest_bubble_ns <= 0:
        return "no bubble seen yet (since start or the last layout change)"
    if cap.trainer_paused:
        return "no bubble for 5 s: the trainer paused or ended"
    if cap.waiting > 0:
        return f"{cap.waiting} task(s) here still wait for memory"
    return None


def refusal(task: Candidate, cap: Capacity) -> str | None:
    """Why this manager cannot place ``task`` now, or None if it can."""
    closed = closed_reason(cap)
    if closed is not None:
        return closed
    assert cap.budget_bytes is not None
    if task.memory_bytes > cap.budget_bytes:
        return (f"needs {task.memory_bytes / 2**20:.0f} MiB, the device budget has "
                f"{max(0, cap.budget_bytes) / 2**20:.0f} MiB")
    if task.step_ns is not None and task.step_ns + cap.margin_ns > cap.longest_bubble_ns:
        return (f"its step ({task.step_ns / MS:.1f} ms) fits no bubble here "
                f"(longest predicted {cap.longest_bubble_ns / MS:.1f} ms)")
    return None


def ranked(candidates: Iterable[Candidate], cap: Capacity) -> list[Candidate]:
    """The tasks this manager can place, in the order it tries to claim them: highest priority, then oldest.

    A manager that loses the race for the first (another manager claimed it a moment earlier) tries the
    next one rather than looking at the queue again.
    """
    return sorted((t for t in candidates if refusal(t, cap) is None), key=lambda t: (-t.priority, t.seq))


def pick(candidates: Iterable[Candidate], cap: Capacity) -> Candidate | None:
    """The task to claim first, or None if this manager can place none of them."""
    order = ranked(candidates, cap)
    return order[0] if order else None
