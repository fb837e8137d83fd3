"""The views of requests: what the loop answers, read from the core and the records, never written.

:meth:`Views.answer` turns a request into a :class:`Reply`: the core events it causes (a submission's
``TaskAdded``, a cancel) and a function that reads the answer once the loop has fed them, so that an
answer shows the state the request produced (a submitted task already ``STARTING``).

Failures the core decides (memory, timeouts, exits) lack what the pure core cannot see (the time,
the step the worker was in, its log's tail): the loop completes them once (:class:`Failures`), and
every view shows the completed record instead of the core's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from freeride._cluster.records import GetQueueView
from freeride._manager import core as C
from freeride._manager.cluster_bridge import ClusterBridge
from freeride._manager.durability import Durability
from freeride._manager.figures import figures_of, task_added
from freeride._manager.requests import CancelTask, GetBubbles, GetStats, GetTask, ListTasks, SubmitTask
from freeride.devices import Device
from freeride.devices.cuda import MIN_ALLOCATOR_BYTES
from freeride.errors import RequestRejected, TaskNotFound
from freeride.messages import FailureRecord, ManagerStats, Percentiles, TaskInfo
from freeride.states import TaskState
from freeride.units import over_device_text


class Failures:
    """Failures the loop completed, shown in place of the core's own record of them."""

    def __init__(self) -> None:
        self._done: dict[str, tuple[FailureRecord, FailureRecord]] = {}

    def completed(self, task_id: str, original: FailureRecord, completed: FailureRecord) -> None:
        self._done[task_id] = (original, completed)

    def of(self, task: C.TaskRuntime) -> FailureRecord | None:
        done = self._done.get(task.task_id)
        if done is not None and done[0] is task.failure:
            return done[1]
        return task.failure


@dataclass(frozen=True)
class Counters:
    """The loop's own counts, for the statistics."""

    started_unix: float
    events_received: int
    events_rejected: int
    events_dropped: int
    messages_dropped: int
    event_delay_ms: Percentiles
    end_to_worker_ms: Percentiles
    trainer_stops: int = 0
    events_late: int = 0


@dataclass(frozen=True)
class Reply:
    """The core events a request causes, and its answer, read after they are fed."""

    events: tuple[Any, ...]
    answer: Callable[[], Any]


class Views:
    def __init__(self, core: C.SchedulerCore, device: Device, durability: Durability, cluster: ClusterBridge,
                 failures: Failures, pid_of: Callable[[str], int], counters: Callable[[], Counters],
                 margin_ns: int, now_ns: Callable[[], int] = time.monotonic_ns,
                 task_dir: Callable[[str], Path] | None = None) -> None:
        self.core = core
        self.device = device
        self.durability = durability
        self.records = durability.records
        self.cluster = cluster
        self.failures = failures
        self._pid_of = pid_of
        self._counters = counters
        self._margin_ns = margin_ns
        self.now_ns = now_ns  # the loop's clock (the core's times are on it)
        self._task_dir = task_dir

    def answer(self, request: Any) -> Reply:
        if isinstance(request, SubmitTask):
            record = self.durability.submit(self._admissible(request))
            return Reply((task_added(record),), lambda: self.info(record.task_id))
        if isinstance(request, ListTasks):
            return _now(self.list(request.include_finished))
        if isinstance(request, GetTask):
            return _now(self.info(request.task_id))
        if isinstance(request, CancelTask):
            info = self.info(request.task_id)  # raises TaskNotFound for unknown ids
            if request.task_id not in self.core.tasks:
                return _now(info)  # already terminal before this run
            return Reply((C.CancelRequested(request.task_id),), lambda: self.info(request.task_id))
        if isinstance(request, GetStats):
            return _now(self.stats())
        if isinstance(request, GetBubbles):
            return _now(self.core.slot_stats())
        if isinstance(request, GetQueueView):
            return _now(self.cluster.view(self._margin_ns, self.now_ns(), self.device.total_memory_bytes() or 0))
        raise TypeError(f"unknown request {request!r}")

    def _admissible(self, request: SubmitTask) -> Any:
        """The spec, if this manager can take it now; else :class:`RequestRejected` saying why."""
        spec = request.spec
        if self.core.draining:
            raise RequestRejected("the manager is draining (`freeride drain`, or stopping) and accepts no new tasks: "
                                  "submit once a manager is started on this device again (after `freeride drain` it "
                                  "stays up, drained, until it is stopped)")
        total = self.device.total_memory_bytes()
        if total and spec.memory_bytes > total:
            raise RequestRejected(over_device_text(spec.memory_bytes, self.device, total))
        context = self.core.context_bytes
        if context and spec.memory_bytes < context + MIN_ALLOCATOR_BYTES:
            raise RequestRejected(
                f"memory {spec.memory_bytes / 2**20:.0f} MiB is below what a task needs on "
                f"{self.device}: its CUDA context takes {context / 2**20:.0f} MiB (measured by a worker "
                f"here), so give at least {(context + MIN_ALLOCATOR_BYTES) / 2**20:.0f} MiB"
            )
        return spec

    def info(self, task_id: str) -> TaskInfo:
        meta = self.records.get(task_id)
        if meta is None:
            raise TaskNotFound(f"no task {task_id!r} on this manager")
        task = self.core.tasks.get(task_id)
        where = str(self._task_dir(task_id)) if self._task_dir is not None else ""
        if task is None:  # terminal before this manager started
            return TaskInfo(task_id=task_id, spec=meta.spec, state=meta.state, figures=meta.figures,
                            submitted_unix_s=meta.submitted_unix_s, updated_unix_s=meta.updated_unix_s,
                            failure=meta.failure, task_dir=where)
        p50 = task.estimator.median_ns()
        return TaskInfo(
            task_id=task_id, spec=task.spec, state=task.state.value, figures=figures_of(task),
            step_p50_ms=(p50 or 0) / 1e6, waiting_reason=self.core.waiting_reason(task, self.now_ns()),
            submitted_unix_s=meta.submitted_unix_s, updated_unix_s=time.time(), failure=self.failures.of(task),
            pid=self._pid_of(task_id), task_dir=where,
        )

    def list(self, include_finished: bool) -> list[TaskInfo]:
        infos = [self.info(tid) for tid in self.records]
        return [i for i in infos if include_finished or not TaskState(i.state).is_terminal]

    def stats(self) -> ManagerStats:
        core = self.core
        s = core.stats
        by_state: dict[str, int] = {}
        for tid, meta in self.records.items():
            task = core.tasks.get(tid)
            state = task.state.value if task else meta.state
            by_state[state] = by_state.get(state, 0) + 1
        budget = core.budget_bytes()
        n = self._counters()
        return ManagerStats(
            device=str(self.device),
            uptime_s=time.time() - n.started_unix,
            bubbles=s.bubbles,
            bubble_time_s=s.bubble_ns / 1e9,
            granted_s=s.granted_ns / 1e9,
            harvested_s=s.harvested_ns / 1e9,
            overruns=s.overruns,
            overrun_ms=_pct(s.overrun_ms),
            grant_latency_ms=_pct(s.grant_latency_ms),
            park_latency_ms=_pct(s.park_latency_ms),
            memory_budget_bytes=-1 if budget is None else budget,
            tasks_by_state=by_state,
            events_received=n.events_received,
            events_rejected=n.events_rejected,
            events_ignored=s.ignored_events,
            events_late=n.events_late,
            draining=core.draining,
            messages_dropped=n.messages_dropped,
            event_delay_ms=n.event_delay_ms,
            end_to_worker_ms=n.end_to_worker_ms,
            events_dropped=n.events_dropped,
            device_info=self.device.describe(),
            device_problem=core.device_problem,
            layout_changes=s.layout_changes,
            layout=core.layout.describe() if core.layout is not None else "",
            queue=self.cluster.queue_stats(),
            shared_by_ranks=core.shared_by,
            events_other_ranks=s.other_rank_events,
            bubbles_while_shared=s.shared_bubbles,
            shared_quiet_s=core.shared_quiet_ns(self.now_ns()) / 1e9,
            trainer_stops=n.trainer_stops,
            hung_overruns=s.hung_overruns,
            **self._run_figures(),
        )

    def _run_figures(self) -> dict[str, Any]:
        """The current run's figures (:meth:`CoreStats.run`), none before a layout."""
        s = self.core.stats
        if not s.layout_changes:
            return {}
        bubbles, bubble_ns, granted_ns, harvested_ns = s.run()
        return {"run_s": max(0, self.now_ns() - s.run_since_ns) / 1e9, "run_bubbles": bubbles,
                "run_bubble_time_s": bubble_ns / 1e9, "run_granted_s": granted_ns / 1e9,
                "run_harvested_s": harvested_ns / 1e9}


def _now(answer: Any) -> Reply:
    return Reply((), lambda: answer)


def _pct(values: Any) -> Percentiles:
    return Percentiles(*C.percentiles(values))
