"""The manager loop as a queue agent sees it (its ``LoopPort``), for the agent's tests on a fake queue
(``tests/unit``) and on a real redis-server (``tests/cluster``)."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from freeride._cluster.placement import Capacity
from freeride._cluster.records import ClaimedTask, QueueView

MiB = 2**20
MS = 1_000_000
ROOM = Capacity(budget_bytes=1024 * MiB, longest_bubble_ns=50 * MS, margin_ns=MS // 5, waiting=0)


@dataclass
class FakeLoop:
    """Answers every ``GetQueueView`` with ``view`` at once, and keeps what the agent posts."""

    view: QueueView = field(default_factory=lambda: QueueView(ROOM))
    posted: list[Any] = field(default_factory=list)
    queue_notes: Any = None
    queue_stats: Any = None

    def post(self, event: Any) -> None:
        self.posted.append(event)

    def call_async(self, request: Any) -> Future[Any]:
        future: Future[Any] = Future()
        future.set_result(self.view)
        return future

    def claimed(self) -> list[str]:
        """The ids of the tasks the agent claimed and posted, in order."""
        return [p.task_id for p in self.posted if isinstance(p, ClaimedTask)]
