"""The iterative side-task API: what a user writes to run work inside pipeline bubbles.

A side task is a class with a small contract::

    class PageRank(freeride.SideTask):
        progress_unit = "iterations"
        memory_estimate_bytes = 512 * 2**20

        def __init__(self, graph: str, damping: float = 0.85): ...   # JSON-able keyword arguments
        def setup(self, ctx): ...        # build state on ctx.device, within ctx.memory_limit_bytes
        def step(self): ...              # one bounded unit of work
        def done(self): ...              # True when there is nothing left to do
        def state_dict(self): ...        # everything needed to resume (tensors allowed)
        def load_state_dict(self, state): ...
        def progress(self): ...          # work done so far, in progress_unit

The worker runtime, not the task, decides when ``step()`` runs: only inside a bubble grant, and only
while ``now + estimated step time (a high percentile learned online) + margin <= deadline``. A step
should therefore take a bounded, roughly steady time; split long work into many short steps.

Resuming: after a restart the runtime builds the task with the same arguments, calls ``setup`` and
then ``load_state_dict`` with the last checkpoint. An interrupted-and-resumed run must end with the
same result as an uninterrupted one, so everything that evolves (counters, RNG state, cursors) must
be in ``state_dict``.
"""

from __future__ import annotations

import abc
import logging
import math
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar


@dataclass(frozen=True)
class TaskContext:
    """What the runtime gives a task in ``setup``.

    Attributes:
        device: the torch device string to allocate on (``"cpu"`` or ``"cuda:N"``).
        device_name: the freeride device name (``"cpu:0"``, ``"cuda:1"``).
        memory_limit_bytes: the task's cap; the runtime enforces it (over it, the task fails with a
            MEMORY_LIMIT record), so size working sets to fit.
        task_id: the manager's id for this task.
        work_dir: a directory private to this task that survives restarts (outputs, caches).
        logger: a logger whose records land in the task's log.
    """

    device: str
    device_name: str
    memory_limit_bytes: int
    task_id: str
    work_dir: Path
    logger: logging.Logger = field(default_factory=lambda: logging.getLogger("freeride.task"))


class SideTask(abc.ABC):
    """Base class of iterative side tasks. Override ``step`` and whatever else applies."""

    #: Natural unit of :meth:`progress` (iterations, images, samples, ...).
    progress_unit: ClassVar[str] = "steps"
    #: Declared peak memory, used when a submission gives no ``--memory``.
    memory_estimate_bytes: ClassVar[int | None] = None
    #: False for a task with no state to keep (a program run as it is): no checkpoint is written, and a
    #: restart starts it afresh.
    checkpoints: ClassVar[bool] = True

    @classmethod
    def estimate_memory(cls, **kwargs: Any) -> int | None:
        """Peak memory for these arguments; defaults to :attr:`memory_estimate_bytes`."""
        return cls.memory_estimate_bytes

    def setup(self, ctx: TaskContext) -> None:  # noqa: B027 - optional hook
        """Build state on ``ctx.device``. Runs inside the first grant, before any step."""

    @abc.abstractmethod
    def step(self) -> None:
        """Do one bounded unit of work."""

    def done(self) -> bool:
        """True when the task has finished its work; the default never finishes."""
        return False

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume; saved with ``torch.save``."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # noqa: B027 - optional hook
        """Restore what :meth:`state_dict` returned. Called after :meth:`setup`."""

    def progress(self) -> float | None:
        """Work done so far in :attr:`progress_unit`; None lets the runtime count steps."""
        return None

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release external resources; called once when the task stops for any reason."""


def finite_progress(reported: object, steps: int) -> float:
    """What :meth:`SideTask.progress` returned, as the runtime reads it: ``steps`` for None, else a finite
    number, or ValueError (a NaN took a manager down through its store). The worker and ``run-task`` both
    read it so."""
    progress = float(steps if reported is None else reported)  # type: ignore[arg-type]
    if not math.isfinite(progress):
        raise ValueError(f"progress() returned {reported!r}: it must be a finite number")
    return progress


def check_saveable(state: Any) -> None:
    """TypeError naming the entry of ``state`` that pickle refuses (``state_dict()['f']``), if one does:
    "AttributeError: Can't pickle local object ..." named no key of a state of dozens. Plain pickle, in this
    process: no file, and no torch.save (whose first call imports much of torch: minutes at nice 19 on a busy
    core)."""
    try:
        pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # noqa: BLE001 - any refusal: find where
        where = _unsaveable(state, "state_dict()") or "state_dict()"
        raise TypeError(f"{where} cannot be saved ({type(exc).__name__}: {exc}): keep only data in state_dict "
                        "(numbers, strings, lists, dicts, tensors, arrays), not lambdas, locks or open files") from exc


def _unsaveable(value: Any, path: str) -> str | None:
    """The path of the innermost entry of ``value`` that pickle refuses (``state_dict()['f']``), or None."""
    if isinstance(value, dict):
        for key, item in value.items():
            found = _unsaveable(item, f"{path}[{key!r}]")
            if found is not None:
                return found
    try:
        pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - any refusal names this entry
        return path
    return None
