"""Where a task's files are: ``<state dir>/tasks/<id>/`` (board, log, work directory, checkpoints).

A cluster task checkpoints to ``<checkpoint root>/<id>/e<epoch>/`` instead, a directory every node sees,
one per claim (see :mod:`freeride._cluster.fencing`): a task claimed elsewhere resumes from the newest
checkpoint its last holder wrote, and never from a late file of a holder that had lost it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from freeride._boards import read_step
from freeride._validation import TASK_ID_RE


class TaskPaths:
    """``cluster_epoch(task_id)``: the claim epoch of a cluster task held here (its checkpoints are shared),
    None for a task of this manager's own."""

    def __init__(self, state_dir: Path, checkpoint_root: Path | None,
                 cluster_epoch: Callable[[str], int | None]) -> None:
        self.state_dir = state_dir
        self.checkpoint_root = checkpoint_root
        self._cluster_epoch = cluster_epoch

    def _is_cluster(self, task_id: str) -> bool:
        return self._cluster_epoch(task_id) is not None

    def cluster_root(self, task_id: str) -> Path | None:
        """``<checkpoint root>/<id>``: every claim's checkpoints of a cluster task; None for a local task."""
        self.task_dir(task_id)  # the same check of the id
        if self.checkpoint_root is None or not self._is_cluster(task_id):
            return None
        return self.checkpoint_root / task_id

    def task_dir(self, task_id: str) -> Path:
        """``<state dir>/tasks/<id>``: state, checkpoints, log and work directory of one task.

        Ids are made by the store (or the cluster queue) from a slug of ``[a-z0-9-]`` and a sequence
        number, never from a user's text as given, so no name or argument can make this path leave the
        state directory; the check makes that an invariant rather than a property of the store.
        """
        if not TASK_ID_RE.fullmatch(task_id):
            raise ValueError(f"task id {task_id[:80]!r} is not a manager-made id")
        return self.state_dir / "tasks" / task_id

    def checkpoint_dir(self, task_id: str) -> Path:
        """Where a task's worker writes its checkpoints: ``<task dir>/checkpoints``, or for a cluster task
        ``<checkpoint root>/<id>/e<epoch>``, which every node sees (one directory per claim)."""
        root = self.cluster_root(task_id)
        if root is not None:
            return root / f"e{self._cluster_epoch(task_id)}"
        return self.task_dir(task_id) / "checkpoints"

    def checkpoint_home(self, task_id: str) -> Path:
        """The directory a checkpoint the worker reports must be in: the shared one of a cluster task, else
        the task's own directory."""
        return self.checkpoint_dir(task_id) if self._is_cluster(task_id) else self.task_dir(task_id)

    def board_step(self, task_id: str) -> int:
        """The step a task's worker last began, from its board (the file outlives the worker); -1: none."""
        return read_step(self.task_dir(task_id) / "board")
