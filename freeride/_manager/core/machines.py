"""Every lifecycle the core keeps besides the task's own (:mod:`freeride.states`), declared in one place.

Each is an enum and a table of allowed transitions; the part that owns the state changes it only through
:meth:`Lifecycle.check` (a bug, not an event, makes it raise: the property tests drive every event in
every state and would see it).

::

    StopPhase (why a resident task is being stopped; one per task)
        NONE -> EVICT | DRAIN | RELEASE | FAIL       EVICT | DRAIN -> RELEASE (a release takes the stop over)
        EVICT | DRAIN | RELEASE -> FAIL              any -> NONE (its process is gone)

    StepPhase (the health of the step a task's current process is in; see ``steps.py``)
        FRESH <-> IN_SETUP  (its board: frozen inside setup(), or past it into its first step)
        FRESH | IN_SETUP -> STEPPED -> HUNG -> STEPPED (a finished step)      any -> FRESH (a new process)

    BubblePhase (one bubble, from its start; see ``bubbles.py``)
        OPEN -> SEEN_ENDED (a worker saw its end on a board) -> CLOSING | CLOSED
        OPEN -> CLOSING (ended, its worker still in a step) -> CLOSED;  OPEN -> CLOSED

    DrainPhase (the device)
        SERVING -> DRAINING -> DRAINED -> DRAINING (asked again: answered again)

    BudgetPhase (the device's memory budget; see ``memory.py``)
        UNKNOWN (no figure since the start or a layout change) <-> KNOWN
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from typing import Generic, TypeVar

from freeride.errors import InvalidTransition

E = TypeVar("E", bound=enum.Enum)


class Lifecycle(Generic[E]):
    """The allowed transitions of one enum; staying in the same state is always allowed (a no-op)."""

    def __init__(self, what: str, allowed: Mapping[E, Iterable[E]]) -> None:
        self.what = what
        # Tuples, not sets: membership then compares identities, where a set would call the enum's
        # Python-level __hash__ (these checks run on every bubble).
        self.next: dict[E, tuple[E, ...]] = {old: tuple(news) for old, news in allowed.items()}

    def allows(self, old: E, new: E) -> bool:
        return old is new or new in self.next[old]

    def check(self, old: E, new: E, subject: object = "") -> None:
        """Raise :class:`InvalidTransition` unless ``old -> new`` is allowed (``subject``, formatted only
        then, names whose state it is)."""
        if old is not new and new not in self.next[old]:
            who = f" {subject}" if subject != "" else ""
            raise InvalidTransition(f"{self.what}{who}: {old.name} -> {new.name} is not allowed")


class StopPhase(enum.Enum):
    """Why a resident task is being stopped (NONE: it is not)."""

    NONE = "none"
    EVICT = "evict"  # the memory budget shrank: checkpoint, exit, be placed again
    DRAIN = "drain"  # the manager drains: checkpoint, exit, be placed again
    RELEASE = "release"  # a cluster task goes back to the queue (or to the manager that owns it now)
    FAIL = "fail"  # killed for a failure already recorded; its exit only completes the record


STOP = Lifecycle[StopPhase]("stop", {
    StopPhase.NONE: {StopPhase.EVICT, StopPhase.DRAIN, StopPhase.RELEASE, StopPhase.FAIL},
    StopPhase.EVICT: {StopPhase.RELEASE, StopPhase.FAIL, StopPhase.NONE},
    StopPhase.DRAIN: {StopPhase.RELEASE, StopPhase.FAIL, StopPhase.NONE},
    StopPhase.RELEASE: {StopPhase.FAIL, StopPhase.NONE},
    StopPhase.FAIL: {StopPhase.NONE},
})


class StepPhase(enum.Enum):
    """Where a task's current process is in its steps."""

    FRESH = "fresh"  # it has finished no step: setup() or its first step is under way
    IN_SETUP = "in setup"  # it was frozen inside setup() (its board showed no step begun)
    STEPPED = "stepped"  # it has finished a step
    HUNG = "hung"  # its current step was seen to look hung, and has not finished since


STEP = Lifecycle[StepPhase]("step", {
    StepPhase.FRESH: {StepPhase.IN_SETUP, StepPhase.STEPPED},
    StepPhase.IN_SETUP: {StepPhase.FRESH, StepPhase.STEPPED},
    StepPhase.STEPPED: {StepPhase.HUNG, StepPhase.FRESH},
    StepPhase.HUNG: {StepPhase.STEPPED, StepPhase.FRESH},
})


class BubblePhase(enum.Enum):
    OPEN = "open"  # started, its end not known: grants until its deadline
    SEEN_ENDED = "seen ended"  # a worker saw its end on a board before the end event came: no more grants
    CLOSING = "closing"  # ended (or lost), its worker still in a step: kept to measure that step's overrun
    CLOSED = "closed"


BUBBLE = Lifecycle[BubblePhase]("bubble", {
    BubblePhase.OPEN: {BubblePhase.SEEN_ENDED, BubblePhase.CLOSING, BubblePhase.CLOSED},
    BubblePhase.SEEN_ENDED: {BubblePhase.CLOSING, BubblePhase.CLOSED},
    BubblePhase.CLOSING: {BubblePhase.CLOSED},
    BubblePhase.CLOSED: set(),
})


class DrainPhase(enum.Enum):
    SERVING = "serving"
    DRAINING = "draining"  # stopping every resident task with a checkpoint; nothing admitted or granted
    DRAINED = "drained"  # nothing resident, and DrainComplete said so


DRAIN = Lifecycle[DrainPhase]("drain", {
    DrainPhase.SERVING: {DrainPhase.DRAINING},
    DrainPhase.DRAINING: {DrainPhase.DRAINED},
    DrainPhase.DRAINED: {DrainPhase.DRAINING},
})


class BudgetPhase(enum.Enum):
    UNKNOWN = "unknown"  # no free-memory figure since the start or the last layout change: admit nothing
    KNOWN = "known"


BUDGET = Lifecycle[BudgetPhase]("budget", {
    BudgetPhase.UNKNOWN: {BudgetPhase.KNOWN},
    BudgetPhase.KNOWN: {BudgetPhase.UNKNOWN},
})
