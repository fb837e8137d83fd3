"""The core's part of the multi-node product, on plain events and a fake clock: a trainer layout change,
and cluster tasks that leave a device (``Released``) instead of waiting on it."""

from __future__ import annotations

from core_sim import MS, MiB, S, Sim, of

from freeride._manager.core import (
    CancelRequested,
    DrainComplete,
    DrainRequested,
    Grant,
    Kill,
    LayoutChanged,
    Park,
    Released,
    ReleaseRequested,
    StateChanged,
    Stop,
    TaskAdded,
)
from freeride._manager.core.machines import StopPhase
from freeride.messages import TaskSpec, TrainerLayout

LAYOUT = TrainerLayout("1f1b", 4, 8, ("n1/cuda:0", "n1/cuda:1", "n2/cuda:0", "n2/cuda:1"), 0)


def _layout(sim: Sim, free_mib: int | None = None, hosts_stage: bool = True, microbatches: int = 8,
            job: str = "") -> list:
    layout = TrainerLayout(LAYOUT.schedule, LAYOUT.stages, microbatches, LAYOUT.stage_devices, sim.now,
                           -1 if free_mib is None else free_mib * MiB, job)
    return sim.send(LayoutChanged(layout, sim.now, hosts_stage))


def _add_queued(sim: Sim, task_id: str, mem_mib: int = 100, checkpoint: tuple[str, int] = ("", -1)) -> list:
    sim.seq += 1
    spec = TaskSpec(target="m:C", name=task_id, memory_bytes=mem_mib * MiB)
    return sim.send(TaskAdded(task_id, spec, sim.seq, checkpoint[0], checkpoint[1], from_queue=True))


def _bubbles(sim: Sim, count: int, free_mib: int, length_ms: float = 20.0) -> None:
    for _ in range(count):
        sim.start(predicted_ms=length_ms, free_mib=free_mib)
        sim.advance_ms(length_ms)
        sim.end()
        for task in list(sim.core.tasks.values()):
            if task.state == S.RUNNING:
                sim.parked(task.task_id, [], reason="park")
        sim.advance_ms(5)


# ------------------------------------------------------------------ layout


def test_a_new_layout_drops_bubble_statistics_and_the_memory_window() -> None:
    sim = Sim()
    sim.resident("a")
    _bubbles(sim, 5, free_mib=4000)
    assert sim.core.slots and sim.core.longest_bubble_ns == 20 * MS and sim.core.budget_bytes() is not None
    _layout(sim)
    assert sim.core.slots == {} and sim.core.longest_bubble_ns == 0
    assert sim.core.budget_bytes() is None  # nothing is admitted on the old layout's figures
    assert sim.core.stats.layout_changes == 1 and sim.core.layout is not None
    assert sim.core.stats.bubbles == 5  # the manager's totals stay
    assert sim.core.stats.run() == (0, 0, 0, 0) and sim.core.stats.run_since_ns == sim.now  # the run's begin
    _bubbles(sim, 2, free_mib=4000)
    assert sim.core.stats.run()[0] == 2 and sim.core.stats.run()[1] == 2 * 20 * MS


def test_the_same_layout_again_changes_nothing() -> None:
    sim = Sim()
    _layout(sim)
    sim.resident("a")
    _bubbles(sim, 3, free_mib=4000)
    assert _layout(sim) == []
    assert sim.core.slots and sim.core.stats.layout_changes == 1


def test_the_same_layout_from_another_job_is_a_new_layout_and_from_the_same_job_changes_nothing() -> None:
    # Regression: a trainer run again with the same shape added its bubbles to the last run's statistics.
    sim = Sim()
    _layout(sim, job="run-1")
    sim.resident("a")
    _bubbles(sim, 3, free_mib=4000)
    assert _layout(sim, job="run-1") == [] and sim.core.slots  # the same job reporting again
    assert _layout(sim) == [] and sim.core.slots  # a layout of no known job: the shape decides
    out = _layout(sim, job="run-2")
    assert sim.core.slots == {} and sim.core.stats.layout_changes == 2
    assert any("another job" in getattr(a, "message", "") for a in out)


def test_a_job_that_alternates_shapes_gets_each_shapes_slot_statistics_back() -> None:
    # Stranger trial: a Megatron job alternating its micro-batch count showed count 0-1 per slot in
    # ``freeride bubbles`` at every switch; the manager forgot each layout's statistics at the change.
    sim = Sim()
    _layout(sim, microbatches=8, job="run-1")
    sim.resident("a")
    _bubbles(sim, 3, free_mib=4000, length_ms=20.0)
    _layout(sim, microbatches=4, job="run-1")
    assert sim.core.slots == {} and sim.core.longest_bubble_ns == 0  # a shape not seen before starts afresh
    _bubbles(sim, 2, free_mib=4000, length_ms=10.0)
    _layout(sim, microbatches=8, job="run-1")
    assert [s.count for s in sim.core.slots.values()] == [3] and sim.core.longest_bubble_ns == 20 * MS
    _bubbles(sim, 1, free_mib=4000, length_ms=20.0)
    _layout(sim, microbatches=4, job="run-1")
    assert [s.count for s in sim.core.slots.values()] == [2] and sim.core.longest_bubble_ns == 10 * MS
    _layout(sim, microbatches=8, job="run-1")
    assert [s.count for s in sim.core.slots.values()] == [4]
    # Another job's bubbles are its own: nothing of run-1 comes back, even in a shape run-1 had.
    _layout(sim, microbatches=4, job="run-2")
    assert sim.core.slots == {}
    _layout(sim, microbatches=8, job="run-2")
    assert sim.core.slots == {}


def test_only_the_last_four_shapes_of_a_job_are_kept() -> None:
    sim = Sim()
    sim.resident("a")
    for microbatches in (1, 2, 3, 4, 5, 6):
        _layout(sim, microbatches=microbatches, job="run-1")
        _bubbles(sim, microbatches, free_mib=4000)
    kept = []
    for microbatches in (2, 3, 4, 5, 1):  # each shape seen again, oldest first
        _layout(sim, microbatches=microbatches, job="run-1")
        kept.append(sum(s.count for s in sim.core.slots.values()))
    assert kept == [0, 3, 4, 5, 0]  # 2 and 1 were dropped for 6's and the current shapes'


def test_a_layout_change_inside_a_bubble_parks_the_running_task() -> None:
    sim = Sim()
    sim.resident("a")
    sim.start(predicted_ms=50, free_mib=4000)
    assert sim.state("a") == S.RUNNING
    actions = _layout(sim, microbatches=16)
    assert [p.task_id for p in of(actions, Park)] == ["a"]
    assert sim.core.bubble is None


def test_a_layout_with_less_free_memory_evicts_the_tasks_that_no_longer_fit() -> None:
    sim = Sim()
    sim.resident("big", mem_mib=3000)
    sim.resident("small", mem_mib=500)
    _bubbles(sim, 3, free_mib=8000)
    actions = _layout(sim, free_mib=1000)  # the new sharding leaves this device 1000 MiB
    # Evicting the newer "small" first would not have been enough; evicting "big" alone is.
    assert [s.task_id for s in of(actions, Stop)] == ["big"]
    assert sim.core.tasks["big"].stop is StopPhase.EVICT
    sim.exited("big")
    assert sim.state("big") == S.SUBMITTED  # a local task waits here for memory
    assert sim.state("small") == S.PARKED


def test_a_local_task_waits_while_the_new_layouts_memory_is_unknown() -> None:
    sim = Sim()
    _layout(sim)
    sim.add("a")
    assert sim.state("a") == S.SUBMITTED
    _bubbles(sim, 1, free_mib=4000)
    assert sim.state("a") == S.STARTING


# ------------------------------------------------------------------ cluster tasks


def _released(actions: list) -> list[Released]:
    return of(actions, Released)


def test_an_evicted_cluster_task_leaves_the_device_with_its_checkpoint() -> None:
    sim = Sim()
    _add_queued(sim, "pr-q1", mem_mib=3000, checkpoint=("/ck/pr-q1/ckpt-10.pt", 10))
    sim.free(8000)
    sim.ready("pr-q1")
    _bubbles(sim, 2, free_mib=8000)
    _layout(sim, free_mib=1000)
    actions = sim.exited("pr-q1")
    [left] = _released(actions)
    assert (left.task_id, left.checkpoint, left.checkpoint_step, left.restarts) == ("pr-q1", True, 10, 1)
    assert "pr-q1" not in sim.core.tasks  # forgotten here: the queue places it again
    assert [(a.old, a.new) for a in of(actions, StateChanged)] == [(S.PARKED, S.EVICTED)]


def test_releasing_a_waiting_cluster_task_is_immediate() -> None:
    sim = Sim()
    _add_queued(sim, "big-q1", mem_mib=9000)
    sim.free(1000)
    assert sim.state("big-q1") == S.SUBMITTED
    [left] = _released(sim.send(ReleaseRequested("big-q1", "waited for memory here")))
    assert left.task_id == "big-q1" and left.checkpoint and "big-q1" not in sim.core.tasks


def test_a_lost_cluster_task_is_killed_without_a_checkpoint() -> None:
    sim = Sim()
    _add_queued(sim, "c-q2")
    sim.free(8000)
    sim.ready("c-q2")
    sim.start(predicted_ms=50)
    assert sim.state("c-q2") == S.RUNNING
    actions = sim.send(ReleaseRequested("c-q2", "lease lost", checkpoint=False))
    assert of(actions, Kill) and not of(actions, Stop)
    [left] = _released(sim.exited("c-q2", exit_code=None, sig=9))
    assert not left.checkpoint


def test_release_is_for_cluster_tasks_only() -> None:
    sim = Sim()
    sim.resident("local")
    assert sim.send(ReleaseRequested("local", "why")) == []
    assert sim.state("local") == S.PARKED


def test_a_drain_hands_every_cluster_task_back_and_keeps_local_ones() -> None:
    sim = Sim()
    sim.resident("local")
    _add_queued(sim, "run-q1")
    _add_queued(sim, "wait-q2", mem_mib=200_000)
    sim.ready("run-q1")
    actions = sim.send(DrainRequested())
    assert [r.task_id for r in _released(actions)] == ["wait-q2"]
    assert sorted(s.task_id for s in of(actions, Stop)) == ["local", "run-q1"]
    sim.exited("local")
    actions = sim.exited("run-q1")
    assert [r.task_id for r in _released(actions)] == ["run-q1"] and of(actions, DrainComplete)
    assert sim.state("local") == S.SUBMITTED


def test_a_device_without_a_stage_in_the_new_layout_releases_its_cluster_tasks() -> None:
    sim = Sim()
    _add_queued(sim, "a-q1")
    sim.resident("local")
    sim.ready("a-q1")
    actions = _layout(sim, hosts_stage=False)
    assert [s.task_id for s in of(actions, Stop)] == ["a-q1"]
    assert [r.task_id for r in _released(sim.exited("a-q1"))] == ["a-q1"]
    assert sim.state("local") == S.PARKED


def test_a_cancelled_cluster_task_ends_here_like_any_other() -> None:
    sim = Sim()
    _add_queued(sim, "a-q1")
    sim.free(8000)
    sim.ready("a-q1")
    actions = sim.send(CancelRequested("a-q1"))
    assert sim.state("a-q1") == S.CANCELLED and not _released(actions)
    assert not of(sim.exited("a-q1", exit_code=None, sig=9), Released)


def test_a_cluster_tasks_learned_step_time_comes_with_it() -> None:
    sim = Sim()
    sim.seq += 1
    spec = TaskSpec(target="m:C", name="x", memory_bytes=MiB)
    sim.send(TaskAdded("x-q1", spec, sim.seq, from_queue=True, step_hint_ns=7 * MS))
    assert sim.core.tasks["x-q1"].known_step_ns == 7 * MS
    sim.free(8000)
    sim.ready("x-q1")
    sim.start(predicted_ms=5)  # a 7 ms step fits no 5 ms bubble: no grant
    assert not of(sim.actions[-3:], Grant)
