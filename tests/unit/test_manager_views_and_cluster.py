"""The views of requests and the cluster bridge on their own, over the real (pure) core and a real store:
they read the core and return its events, and never write its state."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from freeride._cluster.records import CancelTask as QueueCancel
from freeride._cluster.records import GetQueueView, QueueNote, ReleaseTask
from freeride._manager import core as C
from freeride._manager.cluster_bridge import ClusterBridge
from freeride._manager.durability import Durability
from freeride._manager.paths import TaskPaths
from freeride._manager.requests import CancelTask, GetTask, ListTasks, SubmitTask
from freeride._manager.store import TaskStore
from freeride._manager.views import Counters, Failures, Views
from freeride.errors import RequestRejected, TaskNotFound
from freeride.messages import FailureRecord, Percentiles, TaskProgress, TaskRecord, TaskSpec

MiB = 2**20
NOW = 10**12


class FakeDevice:
    def __str__(self) -> str:
        return "cpu:0"

    def total_memory_bytes(self) -> int:
        return 1024 * MiB

    def describe(self) -> str:
        return "a core"


@dataclass
class Parts:
    core: C.SchedulerCore
    views: Views
    bridge: ClusterBridge
    failures: Failures
    paths: TaskPaths
    notes: list[QueueNote] = field(default_factory=list)

    def feed(self, events: Any) -> None:
        for event in events:
            self.core.on_event(event, NOW)


@pytest.fixture
def parts(tmp_path: Path) -> Iterator[Parts]:
    core = C.SchedulerCore(C.CoreConfig())
    durability = Durability(TaskStore(tmp_path / "tasks.db"), 1000.0, "cpu:0")
    ids: dict[str, int] = {}
    paths = TaskPaths(tmp_path, tmp_path / "shared", ids.get)
    failures = Failures()
    bridge = ClusterBridge(core, durability.records, paths, ids, "cpu:0", "n1", failures.of)
    counters = Counters(0.0, 5, 1, 0, 2, Percentiles(), Percentiles())
    views = Views(core, FakeDevice(), durability, bridge, failures, lambda tid: 4242,  # type: ignore[arg-type]
                  lambda: counters, margin_ns=200_000)
    out = Parts(core, views, bridge, failures, paths)
    bridge.notes = out.notes.append
    yield out
    durability.close()


def test_a_submission_is_recorded_and_answered_after_the_loop_fed_its_event(parts: Parts) -> None:
    reply = parts.views.answer(SubmitTask(TaskSpec(target="m:C", memory_bytes=64 * MiB, name="c")))
    [added] = reply.events
    assert isinstance(added, C.TaskAdded) and added.task_id == "c-1"
    assert "c-1" not in parts.core.tasks  # not in the core yet: the answer is read once the event is fed
    parts.feed(reply.events)
    info = reply.answer()
    assert info.task_id == "c-1" and info.state in ("SUBMITTED", "STARTING") and info.pid == 4242
    assert [i.task_id for i in parts.views.answer(ListTasks(False)).answer()] == ["c-1"]
    stats = parts.views.stats()
    assert (stats.events_received, stats.messages_dropped, stats.tasks_by_state) == (5, 2, {info.state: 1})


def test_a_submission_the_manager_cannot_take_is_refused_and_recorded_nowhere(parts: Parts) -> None:
    with pytest.raises(RequestRejected, match="could never be placed"):
        parts.views.answer(SubmitTask(TaskSpec(target="m:C", memory_bytes=2048 * MiB)))
    parts.core.on_event(C.DrainRequested(), NOW)
    with pytest.raises(RequestRejected, match="draining"):
        parts.views.answer(SubmitTask(TaskSpec(target="m:C", memory_bytes=MiB)))
    assert parts.views.list(True) == []


def test_cancel_and_get_of_unknown_tasks_say_so_and_cancel_is_the_cores_event(parts: Parts) -> None:
    with pytest.raises(TaskNotFound):
        parts.views.answer(GetTask("nope-9"))
    with pytest.raises(TaskNotFound):
        parts.views.answer(CancelTask("nope-9"))
    reply = parts.views.answer(SubmitTask(TaskSpec(target="m:C", memory_bytes=MiB, name="c")))
    parts.feed(reply.events)
    cancel = parts.views.answer(CancelTask("c-1"))
    assert cancel.events == (C.CancelRequested("c-1"),)
    parts.feed(cancel.events)
    assert cancel.answer().state == "CANCELLED"


def test_views_show_a_failure_as_the_loop_completed_it_while_the_core_keeps_its_own(parts: Parts) -> None:
    parts.feed(parts.views.answer(SubmitTask(TaskSpec(target="m:C", memory_bytes=MiB, name="c"))).events)
    task = parts.core.tasks["c-1"]
    assert parts.failures.of(task) is None
    core_record = FailureRecord(kind="SPAWN", message="no")
    task.failure = core_record  # as the core records a failure (a test of views only: no loop writes it)
    parts.failures.completed("c-1", core_record, FailureRecord(kind="SPAWN", message="no", at_unix_s=2.0))
    assert parts.views.info("c-1").failure == FailureRecord(kind="SPAWN", message="no", at_unix_s=2.0)
    assert task.failure is core_record
    task.failure = FailureRecord(kind="EXIT", message="later")  # another record: the completion is not it
    assert parts.views.info("c-1").failure == task.failure


def claim(task_id: str = "pr-q7", checkpoint_step: int = 2, path: str = "") -> TaskRecord:
    return TaskRecord(task_id, TaskSpec(target="m:C", memory_bytes=MiB, name="pr"), "CLAIMED",
                      TaskProgress(steps=3, checkpoint_step=checkpoint_step, restarts=1, step_p95_ms=2.5,
                                   harvested_s=9.0, overruns=4), path, seq=7, submitted_unix_s=100.0)


def test_a_claimed_task_resumes_from_the_checkpoint_the_agent_chose_and_writes_to_its_claims_directory(
    parts: Parts,
) -> None:
    shared = parts.paths.checkpoint_root / "pr-q7"  # type: ignore[operator]
    chosen = shared / "e2" / "ckpt-5.pt"  # the agent chose it (fencing.resume_point): the previous claim's
    [added] = parts.bridge.claimed(claim(checkpoint_step=5, path=str(chosen)), epoch=3)
    assert isinstance(added, C.TaskAdded) and added.from_queue and added.step_hint_ns == 2_500_000
    assert (added.checkpoint_path, added.checkpoint_step, added.steps, added.restarts) == (str(chosen), 5, 5, 1)
    assert (added.harvested_ns, added.overruns) == (0, 0)  # a new holder counts its own
    assert "pr-q7" in parts.bridge and parts.paths.checkpoint_dir("pr-q7") == shared / "e3"
    assert parts.views.info("pr-q7").state == "SUBMITTED"


def test_a_claimed_checkpoint_outside_the_tasks_shared_directory_is_not_resumed_from(parts: Parts) -> None:
    [added] = parts.bridge.claimed(claim(checkpoint_step=5, path="/elsewhere/pr-q7/e1/ckpt-5.pt"), epoch=2)
    assert isinstance(added, C.TaskAdded) and (added.checkpoint_path, added.checkpoint_step) == ("", -1)


def test_a_task_claimed_twice_is_dropped_and_the_agent_told_to_forget_it(parts: Parts) -> None:
    parts.feed(parts.bridge.claimed(claim(), 1))
    assert parts.bridge.claimed(claim(), 1) == []
    assert [(n.kind, n.record.task_id) for n in parts.notes] == [("lost", "pr-q7")]
    assert parts.bridge.claimed(claim("pagerank-7"), 1) == [] and len(parts.notes) == 2  # not a cluster id


def test_a_released_task_goes_back_to_the_queue_with_its_figures_or_is_forgotten_without_a_checkpoint(
    parts: Parts,
) -> None:
    parts.feed(parts.bridge.claimed(claim(), 1))
    parts.bridge.released(C.Released("pr-q7", "evicted", checkpoint=True, steps=8, progress=8.0,
                                     checkpoint_path="/s/ckpt-8.pt", checkpoint_step=8, restarts=1,
                                     step_p95_ns=None, progress_unit="iters"))
    [left] = parts.notes
    assert (left.kind, left.record.state, left.record.steps, left.record.checkpoint_path) == (
        "left", "EVICTED", 8, "/s/ckpt-8.pt")
    assert left.record.figures.progress_unit == "iters"  # the worker's unit (a stranger saw "90 steps" after it)
    assert "pr-q7" not in parts.bridge and "pr-q7" not in parts.views.records
    assert parts.bridge.request(ReleaseTask("a-q1", "lease lost", checkpoint=False)) == [
        C.ReleaseRequested("a-q1", "lease lost", False)]
    assert parts.bridge.request(QueueCancel("a-q1")) == [C.CancelRequested("a-q1")]


def test_the_queue_view_holds_the_cluster_tasks_and_the_room_here(parts: Parts) -> None:
    parts.feed(parts.bridge.claimed(claim(), 1))
    view = parts.views.answer(GetQueueView()).answer()
    assert [t.task_id for t in view.tasks] == ["pr-q7"] and view.capacity.margin_ns == 200_000
    assert view.capacity.waiting == 1 and not view.capacity.draining


def test_the_queue_view_says_when_the_trainer_made_no_bubble_for_a_pause(tmp_path: Path) -> None:
    # Stranger trial: a manager whose trainer had ended claimed every new task from its bubbles of before.
    from freeride._manager.core.steps import TRAINER_PAUSE_NS
    from freeride.messages import BubbleStart

    now = [10**12]
    core = C.SchedulerCore(C.CoreConfig())
    durability = Durability(TaskStore(tmp_path / "tasks.db"), 1000.0, "cpu:0")
    failures = Failures()
    bridge = ClusterBridge(core, durability.records, TaskPaths(tmp_path, tmp_path / "shared", {}.get), {}, "cpu:0",
                           "n1", failures.of)
    views = Views(core, FakeDevice(), durability, bridge, failures, lambda tid: 0,  # type: ignore[arg-type]
                  lambda: Counters(0.0, 0, 0, 0, 0, Percentiles(), Percentiles()), 200_000, lambda: now[0])
    try:
        assert not views.answer(GetQueueView()).answer().capacity.trainer_paused  # no bubble yet: said otherwise
        core.on_event(C.BubbleStarted(BubbleStart(0, 0, 0, 1, "steady", now[0], 5_000_000), now[0]), now[0])
        assert not views.answer(GetQueueView()).answer().capacity.trainer_paused
        now[0] += TRAINER_PAUSE_NS + 1
        assert views.answer(GetQueueView()).answer().capacity.trainer_paused
    finally:
        durability.close()


def test_a_task_recovered_with_a_record_keeps_its_progress_unit_before_its_new_worker_says_it() -> None:
    # Stranger trial: after a restart, `ls` read "95916 steps" for 95916 matmuls while the task was STARTING.
    from freeride._manager.figures import task_added

    record = TaskRecord("m-1", TaskSpec(target="m:C", memory_bytes=MiB), "PARKED",
                        TaskProgress(steps=3636, progress=14544.0, progress_unit="matmuls"), "", seq=1)
    task = C.TaskRuntime.added(task_added(record))
    assert (task.progress, task.progress_unit) == (14544.0, "matmuls")
