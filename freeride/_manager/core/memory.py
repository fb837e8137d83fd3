"""Memory admission: the device's budget for side tasks, who is admitted to it, who is evicted from it.

The **capacity** is the minimum over recent iterations of (free memory reported + memory the side tasks
held at that moment) minus a headroom: the side tasks' own memory counts as theirs to use. The **budget**
is the capacity minus the caps of resident tasks. A waiting task becomes resident only if its cap fits
(highest priority first, then oldest; a smaller later task may fill what a bigger one cannot use); when the
budget falls below zero, parked tasks are evicted, lowest priority and newest first, as few as needed.
While the device cannot be read (a lost GPU, NVML failing), nothing is admitted. A task whose usage goes
over its cap fails MEMORY_LIMIT (:func:`over_cap`).

The choices (:func:`admissions`, :func:`victims`, :func:`over_cap`) are pure; :class:`MemoryBudget` keeps
the samples and the budget's phase (:class:`BudgetPhase`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from freeride._manager.core.machines import BUDGET, BudgetPhase
from freeride._manager.core.tasks import TaskRuntime
from freeride.messages import FailureRecord
from freeride.units import format_mib, format_mib_apart, memory_limit_hint


class MemoryBudget:
    def __init__(self, headroom_bytes: int, window_iterations: int) -> None:
        self.phase = BudgetPhase.UNKNOWN
        #: Why the device cannot be read now ("" when it can): no task is admitted meanwhile.
        self.problem = ""
        self._headroom = headroom_bytes
        self._window = window_iterations
        # (rank, iteration) -> min over that iteration of free + side-task usage at the time
        self._by_iteration: dict[tuple[int, int], int] = {}
        self._device: deque[int] = deque(maxlen=window_iterations)
        # Admission is skipped while it cannot succeed: (waiting-set epoch, budget left after the last
        # pass). Every task a pass left waiting has a cap above that budget, so no pass admits anything at
        # a budget as small or smaller until a task joins the waiting set (a new epoch).
        self._floor: tuple[int, int] | None = None

    def _known(self) -> None:
        if self.phase is BudgetPhase.UNKNOWN:
            BUDGET.check(self.phase, BudgetPhase.KNOWN)
            self.phase = BudgetPhase.KNOWN

    def sample_iteration(self, key: tuple[int, int], capacity_bytes: int) -> None:
        """A capacity seen during iteration ``key`` (rank, iteration); the window keeps the newest few."""
        old = self._by_iteration.get(key)
        self._by_iteration[key] = capacity_bytes if old is None else min(old, capacity_bytes)
        while len(self._by_iteration) > self._window:
            del self._by_iteration[next(iter(self._by_iteration))]
        self._known()

    def sample_device(self, capacity_bytes: int) -> None:
        self._device.append(capacity_bytes)
        self._known()

    def forget(self) -> None:
        """A new trainer layout: the old window no longer says what the device has."""
        self._by_iteration.clear()
        self._device.clear()
        self._floor = None
        BUDGET.check(self.phase, BudgetPhase.UNKNOWN)
        self.phase = BudgetPhase.UNKNOWN

    def capacity_bytes(self) -> int | None:
        """Memory the side tasks may hold in all: recent minimum capacity minus headroom."""
        samples = list(self._by_iteration.values()) + list(self._device)
        if not samples:
            return None
        return max(0, min(samples) - self._headroom)

    def budget_bytes(self, resident_caps: int) -> int | None:
        """Memory left for a new resident task, or None before any memory figure arrived."""
        capacity = self.capacity_bytes()
        return None if capacity is None else capacity - resident_caps

    def skip(self, epoch: int, budget: int) -> bool:
        """Nothing fitted at this budget or a larger one, and nobody new is waiting."""
        floor = self._floor
        return floor is not None and floor[0] == epoch and budget <= floor[1]

    def passed(self, epoch: int, budget_left: int) -> None:
        self._floor = (epoch, budget_left)


def admissions(waiting: Iterable[TaskRuntime], budget: int) -> tuple[list[TaskRuntime], int]:
    """The waiting tasks to make resident at ``budget``, in order, and the budget left after them."""
    chosen = []
    for task in sorted(waiting, key=lambda t: (-t.spec.priority, t.seq)):
        if task.memory_bytes > budget:
            continue
        budget -= task.memory_bytes
        chosen.append(task)
    return chosen, budget


def victims(parked: Iterable[TaskRuntime], budget: int) -> list[TaskRuntime]:
    """The parked tasks to evict so that a negative ``budget`` is back at zero or more."""
    candidates = sorted(parked, key=lambda t: (t.spec.priority, -t.seq))
    chosen: list[TaskRuntime] = []
    for task in candidates:
        if budget >= 0:
            break
        chosen.append(task)
        budget += task.memory_bytes
    # A victim picked early (lowest priority, newest) may have been needed only until a larger one was
    # picked: keep, most important first, every victim whose cap the surplus still holds.
    for task in reversed(list(chosen)):
        if budget >= 0 and task.memory_bytes <= budget:
            chosen.remove(task)
            budget -= task.memory_bytes
    return chosen


def over_cap(task: TaskRuntime) -> FailureRecord | None:
    """The MEMORY_LIMIT failure of a task whose usage (the device's figure or its own report) is over its
    cap; None if it is within.

    The cap covers what the task holds beyond its worker's baseline (reported with ``ready``: on a CPU core
    the interpreter and the task's libraries, on a GPU nothing). While the worker starts, that baseline is
    still being loaded and is not known: nothing runs then but imports and the constructor, and the cap is
    checked from ``ready`` on (the caller's part). On a GPU the same cap also bounds the task's host memory,
    beyond its worker's host baseline, as on a CPU core.
    """
    used = task.usage_bytes() - task.baseline_bytes
    host = task.host_bytes - task.host_baseline_bytes if task.host_baseline_bytes else 0
    if used <= task.memory_bytes and host <= task.memory_bytes:
        return None
    beyond = hint = ""
    if used <= task.memory_bytes:  # its host memory, on a device whose own memory is capped apart
        used = host
        beyond = f" of host memory beyond its worker's {format_mib(task.host_baseline_bytes)} baseline"
        hint = memory_limit_hint(task.steps, host=True)
    elif task.baseline_bytes:
        beyond = f" beyond its worker's {format_mib(task.baseline_bytes)} baseline"
        hint = memory_limit_hint(task.steps)
    shown_used, shown_cap = format_mib_apart(used, task.memory_bytes)
    return FailureRecord(
        kind="MEMORY_LIMIT",
        message=f"used {shown_used}{beyond}, over its cap of {shown_cap}{hint}",
        step=task.steps,
    )
