"""The pure scheduler core, driven with plain events and an explicit fake clock (integer ns).

Every test builds a :class:`Sim` (a core plus a clock and a bubble counter), feeds it events and
checks the actions it returns and the task states it keeps. No I/O, no sleeps, no real time.
"""

from __future__ import annotations

import signal
from collections.abc import Iterable

import pytest

from freeride._manager.core import (
    Action,
    BubbleEnded,
    BubbleStarted,
    CancelRequested,
    CheckpointRecorded,
    CoreConfig,
    DeviceMemorySampled,
    DrainComplete,
    DrainRequested,
    Event,
    Freeze,
    Grant,
    Kill,
    Park,
    SchedulerCore,
    Spawn,
    StateChanged,
    Stop,
    TaskAdded,
    TaskMemorySampled,
    Tick,
    WorkerCheckpointed,
    WorkerExited,
    WorkerFailed,
    WorkerFinished,
    WorkerParked,
    WorkerReady,
    WorkerStepsSeen,
)
from freeride.messages import UNKNOWN_MEMORY, BubbleEnd, BubbleStart, FailureRecord, TaskSpec
from freeride.states import TaskState

MS = 1_000_000
MiB = 2**20
T0 = 1_000_000 * MS  # an arbitrary monotonic "now" at which every test starts

S = TaskState


class Sim:
    """A scheduler core with a fake clock and helpers that build well-formed events."""

    def __init__(self, **config: int) -> None:
        config.setdefault("headroom_bytes", 0)
        self.core = SchedulerCore(CoreConfig(**config))
        self.now = T0
        self.seq = 0
        self.iteration = 0
        self.open: BubbleStart | None = None
        self.actions: list[Action] = []

    # -- clock and raw events

    def at(self, now_ns: int) -> Sim:
        assert now_ns >= self.now, "the fake clock never goes back"
        self.now = now_ns
        return self

    def advance_ms(self, ms: float) -> Sim:
        return self.at(self.now + int(ms * MS))

    def send(self, event: Event) -> list[Action]:
        actions = self.core.on_event(event, self.now)
        self.actions.extend(actions)
        return actions

    def tick(self) -> list[Action]:
        return self.send(Tick())

    # -- tasks

    def add(self, task_id: str, mem_mib: int = 100, priority: int = 0, hint_ms: float = 0.0) -> list[Action]:
        self.seq += 1
        spec = TaskSpec(
            target="m:C", name=task_id, memory_bytes=mem_mib * MiB, priority=priority, step_time_hint_ms=hint_ms
        )
        return self.send(TaskAdded(task_id=task_id, spec=spec, seq=self.seq))

    def free(self, free_mib: int) -> list[Action]:
        return self.send(DeviceMemorySampled(free_bytes=free_mib * MiB))

    def ready(self, task_id: str) -> list[Action]:
        return self.send(WorkerReady(task_id=task_id, pid=1000 + len(self.core.tasks)))

    def resident(self, *task_ids: str, mem_mib: int = 100, priority: int = 0) -> None:
        """Add tasks, give the device room for all of them, and bring each one to PARKED."""
        for task_id in task_ids:
            self.add(task_id, mem_mib=mem_mib, priority=priority)
        if self.core.budget_bytes() is None:
            self.free(100_000)
        for task_id in task_ids:
            assert self.state(task_id) == S.STARTING
            self.ready(task_id)
            assert self.state(task_id) == S.PARKED

    def parked(
        self,
        task_id: str,
        durations_ms: Iterable[float] = (),
        reason: str = "deadline",
        grant_id: int | None = None,
        last_end_ns: int | None = None,
    ) -> list[Action]:
        task = self.core.tasks[task_id]
        durations = tuple(int(d * MS) for d in durations_ms)
        return self.send(
            WorkerParked(
                task_id=task_id,
                grant_id=task.grant_id if grant_id is None else grant_id,
                steps=len(durations),
                durations_ns=durations,
                first_step_ns=task.granted_at_ns + 1000 if durations else 0,
                last_end_ns=self.now if last_end_ns is None else last_end_ns,
                parked_ns=self.now,
                reason=reason,
                progress=0.0,
                total_steps=task.steps + len(durations),
            )
        )

    def exited(self, task_id: str, exit_code: int | None = 0, sig: int = 0, log_tail: str = "") -> list[Action]:
        return self.send(WorkerExited(task_id=task_id, exit_code=exit_code, signal=sig, log_tail=log_tail))

    def state(self, task_id: str) -> TaskState:
        return self.core.tasks[task_id].state

    # -- bubbles

    def start(
        self,
        predicted_ms: float,
        free_mib: int | None = None,
        iteration: int | None = None,
        slot: int = 0,
        rank: int = 0,
    ) -> list[Action]:
        if iteration is None:
            self.iteration += 1
            iteration = self.iteration
        self.open = BubbleStart(
            stage=0,
            rank=rank,
            iteration=iteration,
            slot=slot,
            kind="fwd",
            start_ns=self.now,
            predicted_ns=int(predicted_ms * MS),
            free_memory_bytes=UNKNOWN_MEMORY if free_mib is None else free_mib * MiB,
        )
        return self.send(BubbleStarted(bubble=self.open, received_ns=self.now))

    def end(self, bubble: BubbleStart | None = None, end_ns: int | None = None) -> list[Action]:
        b = bubble or self.open
        assert b is not None
        end = BubbleEnd(
            stage=b.stage,
            rank=b.rank,
            iteration=b.iteration,
            slot=b.slot,
            end_ns=self.now if end_ns is None else end_ns,
        )
        return self.send(BubbleEnded(bubble=end, received_ns=self.now))

    def learn(self, task_id: str, step_ms: float, samples: int = 3) -> None:
        """Give a parked task a known step time by granting it a probe bubble that it fills."""
        for other in self.core.tasks.values():
            assert other.state != S.RUNNING
        self.start(predicted_ms=step_ms * samples * 4 + 10)
        assert self.state(task_id) == S.RUNNING, "learn() needs the task to be the only grantable one"
        self.advance_ms(step_ms * samples)
        self.end()  # end first, so that the rest of the bubble goes to nobody else
        self.parked(task_id, [step_ms] * samples, reason="park")
        assert self.state(task_id) == S.PARKED


def of(actions: Iterable[Action], kind: type) -> list:
    return [a for a in actions if isinstance(a, kind)]


def grants(actions: Iterable[Action]) -> list[str]:
    return [a.task_id for a in actions if isinstance(a, Grant)]


def non_state(actions: Iterable[Action]) -> list[Action]:
    return [a for a in actions if not isinstance(a, StateChanged)]


# ====================================================================== config


@pytest.mark.parametrize(
    "kwargs",
    [
        {"headroom_bytes": -1},
        {"grace_ns": -1},
        {"step_timeout_ns": 0},
        {"stop_timeout_ns": 0},
        {"memory_window_iterations": 0},
        {"margin_ns": 5 * MS, "max_margin_ns": 1 * MS},
    ],
)
def test_config_rejects_negative_zero_or_inconsistent_values(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        CoreConfig(**kwargs)


# ====================================================================== memory


def test_task_added_is_submitted_with_state_changed_from_none() -> None:
    sim = Sim()
    actions = sim.add("a")
    assert actions == [StateChanged("a", None, S.SUBMITTED, "submitted")]
    assert sim.state("a") == S.SUBMITTED


def test_duplicate_task_id_is_rejected() -> None:
    sim = Sim()
    sim.add("a")
    with pytest.raises(Exception, match="already exists"):
        sim.add("a")


def test_no_spawn_before_any_free_memory_figure() -> None:
    sim = Sim()
    assert of(sim.add("a", mem_mib=1), Spawn) == []
    # A bubble without a memory figure (free_memory_bytes = -1) says nothing about the budget.
    assert of(sim.start(predicted_ms=10), Spawn) == []
    assert sim.state("a") == S.SUBMITTED
    assert sim.core.budget_bytes() is None
    assert "first free-memory figure" in sim.core.waiting_reason(sim.core.tasks["a"])


def test_task_spawns_when_bubble_reports_enough_free_memory() -> None:
    sim = Sim()
    sim.add("a", mem_mib=300)
    actions = sim.start(predicted_ms=10, free_mib=1000)
    spawns = of(actions, Spawn)
    assert spawns == [Spawn("a", sim.core.tasks["a"].spec, 300 * MiB, "")]
    assert StateChanged("a", S.SUBMITTED, S.STARTING, "memory fits") in actions
    assert sim.state("a") == S.STARTING


def test_task_spawns_when_device_memory_sample_reports_enough_free_memory() -> None:
    sim = Sim()
    sim.add("a", mem_mib=300)
    assert [s.task_id for s in of(sim.free(1000), Spawn)] == ["a"]


def test_task_whose_cap_exceeds_free_minus_headroom_is_not_spawned() -> None:
    sim = Sim(headroom_bytes=200 * MiB)
    sim.add("big", mem_mib=900)
    assert of(sim.free(1000), Spawn) == []
    assert sim.state("big") == S.SUBMITTED
    assert "needs 900 MiB" in sim.core.waiting_reason(sim.core.tasks["big"])
    assert "800 MiB free" in sim.core.waiting_reason(sim.core.tasks["big"])
    sim.add("fits", mem_mib=800)
    assert sim.state("fits") == S.STARTING


def test_cap_equal_to_budget_fits() -> None:
    sim = Sim(headroom_bytes=100 * MiB)
    sim.add("a", mem_mib=900)
    sim.free(1000)
    assert sim.state("a") == S.STARTING


def test_two_tasks_that_do_not_fit_together_only_the_first_is_spawned() -> None:
    sim = Sim()
    sim.add("first", mem_mib=600)
    sim.add("second", mem_mib=600)
    actions = sim.free(1000)
    assert [s.task_id for s in of(actions, Spawn)] == ["first"]
    assert sim.state("second") == S.SUBMITTED
    assert sim.core.budget_bytes() == 400 * MiB


def test_resident_caps_stay_reserved_after_the_worker_parks() -> None:
    sim = Sim()
    sim.resident("a", mem_mib=600)
    sim.free(1000)
    sim.add("b", mem_mib=600)
    assert sim.state("b") == S.SUBMITTED  # a PARKED task keeps its memory


def test_waiting_task_is_spawned_once_the_resident_task_finishes() -> None:
    sim = Sim()
    sim.add("first", mem_mib=600)
    sim.add("second", mem_mib=600)
    sim.free(1000)
    sim.ready("first")
    sim.start(predicted_ms=10)
    actions = sim.send(WorkerFinished("first", total_steps=5, progress=1.0))
    assert StateChanged("first", S.RUNNING, S.FINISHED, "done") in actions
    assert [s.task_id for s in of(actions, Spawn)] == ["second"]


def test_higher_priority_submission_gets_memory_first() -> None:
    sim = Sim()
    sim.add("low", mem_mib=600, priority=0)
    sim.add("high", mem_mib=600, priority=5)
    assert [s.task_id for s in of(sim.free(1000), Spawn)] == ["high"]


def test_smaller_later_task_fills_the_memory_a_bigger_one_cannot_use() -> None:
    sim = Sim()
    sim.add("big", mem_mib=2000)
    sim.add("small", mem_mib=100)
    assert [s.task_id for s in of(sim.free(1000), Spawn)] == ["small"]


def test_budget_counts_memory_the_side_tasks_hold_as_available_to_them() -> None:
    sim = Sim()
    sim.resident("a", mem_mib=500)
    sim.send(TaskMemorySampled("a", used_bytes=400 * MiB))
    sim.start(predicted_ms=10, free_mib=600)  # 600 free + 400 held by "a" = 1000 for side tasks
    assert sim.core.capacity_bytes() == 1000 * MiB
    assert sim.core.budget_bytes() == 500 * MiB
    sim.add("b", mem_mib=500)
    assert sim.state("b") == S.STARTING


def test_budget_is_the_minimum_free_memory_within_an_iteration() -> None:
    sim = Sim()
    sim.start(predicted_ms=1, free_mib=1000, iteration=1, slot=0)
    sim.end()
    sim.start(predicted_ms=1, free_mib=300, iteration=1, slot=1)
    sim.end()
    sim.start(predicted_ms=1, free_mib=900, iteration=1, slot=2)
    assert sim.core.capacity_bytes() == 300 * MiB


def test_budget_uses_the_minimum_over_the_recent_iteration_window_and_forgets_older_ones() -> None:
    sim = Sim(memory_window_iterations=2)
    sim.add("a", mem_mib=800)
    sim.start(predicted_ms=1, free_mib=500)  # iteration 1: a dip
    sim.end()
    sim.start(predicted_ms=1, free_mib=1000)  # iteration 2: the dip is still in the window
    sim.end()
    assert sim.core.capacity_bytes() == 500 * MiB
    assert sim.state("a") == S.SUBMITTED
    actions = sim.start(predicted_ms=1, free_mib=1000)  # iteration 3: iteration 1 falls out
    assert sim.core.capacity_bytes() == 1000 * MiB
    assert [s.task_id for s in of(actions, Spawn)] == ["a"]


def test_budget_shrink_stops_the_lowest_priority_parked_task_with_checkpoint() -> None:
    sim = Sim()
    sim.add("low", mem_mib=400, priority=0)
    sim.add("high", mem_mib=400, priority=5)
    sim.free(1000)
    sim.ready("low")
    sim.ready("high")
    actions = sim.free(500)  # room for one of them only
    assert of(actions, Stop) == [Stop("low", checkpoint=True)]
    assert of(actions, Kill) == []
    assert sim.state("low") == S.PARKED  # still resident until its process is gone
    assert sim.state("high") == S.PARKED


def test_evicted_task_goes_evicted_then_submitted_after_a_clean_exit() -> None:
    sim = Sim()
    sim.add("low", mem_mib=400, priority=0)
    sim.add("high", mem_mib=400, priority=5)
    sim.free(1000)
    sim.ready("low")
    sim.ready("high")
    sim.free(500)
    ckpt = sim.send(WorkerCheckpointed("low", step=7, path="/ckpt/low-7", progress=0.5))
    assert ckpt == [CheckpointRecorded("low", 7, "/ckpt/low-7", 0.5)]
    actions = sim.exited("low", exit_code=0)
    changes = of(actions, StateChanged)
    assert [(c.old, c.new, c.reason) for c in changes] == [
        (S.PARKED, S.EVICTED, "evict"),
        (S.EVICTED, S.SUBMITTED, "re-placement"),
    ]
    low = sim.core.tasks["low"]
    assert low.state == S.SUBMITTED
    assert low.restarts == 1
    assert of(actions, Spawn) == []  # still does not fit
    # Once the trainer's usage drops again (and the dip leaves the window), it resumes from its checkpoint.
    sim.core._device_capacity.clear()
    actions = sim.free(1000)
    assert of(actions, Spawn) == [Spawn("low", low.spec, 400 * MiB, "/ckpt/low-7")]


def test_eviction_with_equal_priority_stops_the_newest_task_first() -> None:
    sim = Sim()
    sim.resident("old", "new", mem_mib=400)
    assert of(sim.free(500), Stop) == [Stop("new", checkpoint=True)]


def test_eviction_stops_only_as_many_tasks_as_needed() -> None:
    sim = Sim()
    sim.resident("a", "b", "c", mem_mib=300)
    actions = sim.free(650)  # 900 held, 650 available: one eviction is enough
    assert of(actions, Stop) == [Stop("c", checkpoint=True)]


def test_regression_memory_sample_while_victim_is_stopping_does_not_evict_another_task() -> None:
    sim = Sim()
    sim.resident("a", "b", "c", mem_mib=300)
    assert of(sim.free(650), Stop) == [Stop("c", checkpoint=True)]
    # A second low sample arrives before "c" has exited: its cap is already on the way out.
    assert of(sim.free(650), Stop) == []
    assert of(sim.start(predicted_ms=5, free_mib=650), Stop) == []


def test_running_tasks_are_not_evicted() -> None:
    sim = Sim()
    sim.resident("a", mem_mib=400)
    sim.start(predicted_ms=10)
    assert sim.state("a") == S.RUNNING
    assert of(sim.free(100), Stop) == []


# ====================================================================== grants


def test_worker_ready_parks_the_starting_task() -> None:
    sim = Sim()
    sim.add("a")
    sim.free(1000)
    actions = sim.ready("a")
    assert actions == [StateChanged("a", S.STARTING, S.PARKED, "worker ready")]
    assert sim.core.tasks["a"].pid > 0
    assert sim.core.waiting_reason(sim.core.tasks["a"]) == "no bubble reported yet"


def test_worker_ready_for_unknown_or_not_starting_task_is_ignored() -> None:
    sim = Sim()
    assert sim.send(WorkerReady("ghost", pid=1)) == []
    sim.resident("a")
    assert sim.ready("a") == []


def test_bubble_start_grants_the_parked_task_until_the_predicted_end() -> None:
    sim = Sim(margin_ns=MS // 5)
    sim.resident("a")
    actions = sim.start(predicted_ms=10)
    assert sim.open is not None
    assert of(actions, Grant) == [Grant("a", 1, T0 + 10 * MS, MS // 5, False, rank=0, bubble_start_ns=T0,
                                        bubble_key=sim.open.key, trainer_ends=True)]
    assert StateChanged("a", S.PARKED, S.RUNNING, "granted") in actions
    assert sim.state("a") == S.RUNNING


def test_bubble_start_without_any_parked_task_grants_nothing() -> None:
    sim = Sim()
    sim.add("a")  # submitted, never spawned
    assert sim.start(predicted_ms=10) == []


def test_grant_ids_increase_across_grants() -> None:
    sim = Sim()
    sim.resident("a")
    first = of(sim.start(predicted_ms=10), Grant)[0].grant_id
    sim.advance_ms(10)
    sim.end()
    sim.parked("a", reason="park")
    sim.advance_ms(5)
    second = of(sim.start(predicted_ms=10), Grant)[0].grant_id
    assert second > first


def test_higher_priority_task_is_granted_first() -> None:
    sim = Sim()
    sim.resident("low", priority=0)
    sim.resident("high", priority=3)
    assert grants(sim.start(predicted_ms=10)) == ["high"]


def _first_grants(sim: Sim, bubbles: int, harvest_ms: float) -> list[str]:
    """Who is granted first in each of ``bubbles`` 10 ms bubbles, each parking after ``harvest_ms`` of steps."""
    firsts = []
    for _ in range(bubbles):
        sim.advance_ms(5)
        first = grants(sim.start(predicted_ms=10))[0]
        firsts.append(first)
        sim.advance_ms(10)
        sim.end()
        sim.parked(first, [harvest_ms], reason="park")
    return firsts


def test_equal_priority_tasks_whose_steps_fit_share_bubble_time_least_harvested_first() -> None:
    # Stranger trial: best fit alone gave every bubble to the longer step; the other never ran.
    sim = Sim(margin_ns=0)
    sim.resident("short")
    sim.learn("short", step_ms=1)  # 3 ms harvested
    sim.resident("long")
    sim.learn("long", step_ms=8)  # 24 ms harvested
    firsts = _first_grants(sim, 8, harvest_ms=5)
    # "short" catches up (3, 8, ... 23, 28 ms) before the two alternate.
    assert firsts == ["short"] * 5 + ["long", "short", "long"]


def test_a_task_that_joins_later_shares_from_then_on_instead_of_catching_up() -> None:
    sim = Sim(margin_ns=0)
    sim.resident("old")
    sim.learn("old", step_ms=8)
    _first_grants(sim, 10, harvest_ms=8)  # "old" alone: 104 ms harvested
    sim.resident("new")
    sim.learn("new", step_ms=8)
    firsts = _first_grants(sim, 6, harvest_ms=8)
    # Joined at the old task's share (104 ms), not at 0: no run of 10 bubbles to catch up.
    assert firsts.count("old") >= 3 and "new" in firsts
    old, new = sim.core.tasks["old"].share_ns, sim.core.tasks["new"].share_ns
    assert abs(old - new) <= 8 * MS


def test_equal_tasks_never_granted_start_with_the_step_time_that_best_fits_the_remaining_time() -> None:
    sim = Sim(margin_ns=0)
    sim.add("short", hint_ms=1)
    sim.add("long", hint_ms=8)
    sim.free(100_000)
    sim.ready("short")
    sim.ready("long")
    # 10 ms left: an 8 ms step leaves less idle time than a 1 ms one.
    assert grants(sim.start(predicted_ms=10)) == ["long"]


def test_best_fit_skips_a_step_that_does_not_fit_the_remaining_time() -> None:
    sim = Sim(margin_ns=0)
    sim.resident("short")
    sim.learn("short", step_ms=1)
    sim.resident("long")
    sim.learn("long", step_ms=8)
    sim.advance_ms(5)
    assert grants(sim.start(predicted_ms=5)) == ["short"]


def test_equal_priority_and_equal_fit_is_first_in_first_out() -> None:
    sim = Sim()
    sim.resident("first", "second", "third")
    assert grants(sim.start(predicted_ms=10)) == ["first"]


def test_priority_beats_best_fit() -> None:
    sim = Sim(margin_ns=0)
    sim.resident("fits_well")
    sim.learn("fits_well", step_ms=8)
    sim.resident("important", priority=1)
    sim.learn("important", step_ms=1)
    sim.advance_ms(5)
    assert grants(sim.start(predicted_ms=10)) == ["important"]


def test_probe_grant_is_given_to_a_task_whose_step_time_is_unknown() -> None:
    sim = Sim()
    sim.resident("known")
    sim.learn("known", step_ms=2)
    sim.resident("new")
    assert sim.core.tasks["new"].known_step_ns is None
    sim.advance_ms(5)
    actions = sim.start(predicted_ms=10)
    assert grants(actions) == ["new"]


def test_task_submitted_with_a_step_time_hint_too_long_for_the_bubble_is_not_granted() -> None:
    sim = Sim(margin_ns=0)
    sim.add("hinted", hint_ms=50)
    sim.free(1000)
    sim.ready("hinted")
    assert sim.core.tasks["hinted"].known_step_ns == 50 * MS
    assert grants(sim.start(predicted_ms=10)) == []


def test_step_learned_longer_than_every_bubble_is_never_granted_and_says_why() -> None:
    sim = Sim(margin_ns=MS, grace_ns=20 * MS)
    sim.resident("slow")
    sim.start(predicted_ms=10)  # probe: step time unknown
    assert sim.state("slow") == S.RUNNING
    sim.advance_ms(10)
    sim.end()
    sim.advance_ms(10)  # the probe step took 20 ms, well past the end but within grace
    sim.parked("slow", [20.0], reason="park")
    assert sim.core.tasks["slow"].known_step_ns == 20 * MS
    for _ in range(5):
        sim.advance_ms(5)
        assert grants(sim.start(predicted_ms=10)) == []
        sim.advance_ms(10)
        sim.end()
    assert sim.state("slow") == S.PARKED
    reason = sim.core.waiting_reason(sim.core.tasks["slow"])
    assert "fits no bubble" in reason
    assert "20.0 ms p95" in reason and "longest 10.0 ms" in reason


def test_waiting_reason_names_step_and_longest_bubble_when_the_step_fits_no_bubble() -> None:
    sim = Sim(margin_ns=MS)
    sim.add("slow", hint_ms=20)
    sim.free(1000)
    sim.ready("slow")
    for _ in range(3):
        sim.advance_ms(5)
        assert grants(sim.start(predicted_ms=10)) == []
        sim.advance_ms(10)
        sim.end()
    reason = sim.core.waiting_reason(sim.core.tasks["slow"])
    assert "fits no bubble" in reason
    assert "20.0 ms" in reason and "1.0 ms margin" in reason and "longest 10.0 ms" in reason


def test_margin_counts_against_the_fit() -> None:
    sim = Sim(margin_ns=3 * MS)
    sim.add("a", hint_ms=8)
    sim.free(1000)
    sim.ready("a")
    assert grants(sim.start(predicted_ms=10)) == []  # 8 + 3 > 10
    sim.advance_ms(10)
    sim.end()
    sim.advance_ms(1)
    assert grants(sim.start(predicted_ms=11)) == ["a"]  # 8 + 3 <= 11


def test_task_that_becomes_ready_inside_a_bubble_is_granted_the_rest_of_it() -> None:
    sim = Sim()
    sim.add("a")
    sim.free(1000)
    sim.start(predicted_ms=10)
    sim.advance_ms(2)
    actions = sim.ready("a")
    assert of(actions, Grant) == [Grant("a", 1, T0 + 10 * MS, sim.core.config.margin_ns, False, rank=0,
                                        bubble_start_ns=T0, bubble_key=sim.open.key,  # type: ignore[union-attr]
                                        trainer_ends=True)]


def test_no_grant_when_the_time_left_is_within_the_margin() -> None:
    sim = Sim(margin_ns=MS)
    sim.add("a")
    sim.free(1000)
    sim.start(predicted_ms=10)
    sim.advance_ms(9.5)
    assert grants(sim.ready("a")) == []


# ====================================================================== ends and parks


def test_bubble_end_while_running_emits_park() -> None:
    sim = Sim()
    sim.resident("a")
    grant = of(sim.start(predicted_ms=10), Grant)[0]
    sim.advance_ms(8)
    actions = sim.end()
    assert actions == [Park("a", grant.grant_id, end_received_ns=sim.now, end_ns=sim.now)]
    assert sim.state("a") == S.RUNNING  # until the worker says it parked


def test_a_worker_that_stopped_on_the_trainers_end_board_records_a_park_latency_of_zero() -> None:
    # Third trial: with the trainer on the manager's host, `stats` showed no park latency at all.
    sim = Sim()
    sim.resident("a")
    sim.start(predicted_ms=10)
    sim.advance_ms(8)
    parked_at = sim.now  # the worker read the end board and parked before the end reached the core
    sim.advance_ms(0.2)
    sim.end(end_ns=parked_at - 1000)
    sim.parked("a", [2.0, 2.0, 2.0], reason="ended", last_end_ns=parked_at - MS)
    assert list(sim.core.stats.park_latency_ms) == [0.0]


def test_worker_parked_returns_the_task_to_parked_and_records_park_latency() -> None:
    sim = Sim()
    sim.resident("a")
    sim.start(predicted_ms=10)
    sim.advance_ms(8)
    sim.end()
    sim.advance_ms(0.3)
    actions = sim.parked("a", [2.0, 2.0, 2.0], reason="park", last_end_ns=sim.now - MS)
    assert StateChanged("a", S.RUNNING, S.PARKED, "park") in actions
    assert list(sim.core.stats.park_latency_ms) == [pytest.approx(0.3)]
    task = sim.core.tasks["a"]
    assert task.known_step_ns == 2 * MS
    assert task.harvested_ns == 6 * MS
    assert task.steps == 3
    assert sim.core.next_timer_ns() is None  # the freeze timer is cancelled


def test_worker_parked_records_grant_latency_of_the_first_grant_of_a_bubble() -> None:
    sim = Sim()
    sim.resident("a")
    sim.start(predicted_ms=10)
    sim.advance_ms(5)
    sim.parked("a", [1.0], reason="deadline")  # first step 1000 ns after the grant
    assert list(sim.core.stats.grant_latency_ms) == [pytest.approx(0.001)]


def test_worker_parking_early_lets_another_task_use_the_rest_of_the_bubble() -> None:
    sim = Sim()
    sim.resident("a", "b")
    assert grants(sim.start(predicted_ms=10)) == ["a"]
    sim.advance_ms(3)
    actions = sim.parked("a", [1.0, 1.0], reason="deadline")
    assert of(actions, Grant) == [Grant("b", 2, T0 + 10 * MS, sim.core.config.margin_ns, False, rank=0,
                                        bubble_start_ns=T0, bubble_key=sim.open.key,  # type: ignore[union-attr]
                                        trainer_ends=True)]
    assert sim.state("a") == S.PARKED
    assert sim.state("b") == S.RUNNING


def test_a_task_is_not_granted_twice_in_the_same_bubble() -> None:
    sim = Sim()
    sim.resident("a")
    sim.start(predicted_ms=10)
    sim.advance_ms(3)
    assert grants(sim.parked("a", [1.0], reason="deadline")) == []
    assert sim.state("a") == S.PARKED


def test_no_second_task_is_granted_while_the_first_is_running() -> None:
    sim = Sim()
    sim.resident("a")
    sim.start(predicted_ms=10)
    sim.advance_ms(1)
    sim.add("b")
    assert grants(sim.ready("b")) == []
    assert sim.state("b") == S.PARKED


def test_no_grant_in_a_new_bubble_while_the_last_bubbles_worker_finishes_its_step() -> None:
    sim = Sim(grace_ns=5 * MS)
    sim.resident("a", "b")
    sim.start(predicted_ms=10)
    sim.advance_ms(10)
    sim.end()  # "a" is told to park but is still inside a step
    sim.advance_ms(1)
    assert grants(sim.start(predicted_ms=10)) == []
    sim.advance_ms(1)
    # When "a" parks, the bubble that opened meanwhile goes to the next task.
    actions = sim.parked("a", [11.0], reason="park")
    assert grants(actions) == ["b"]


def test_late_park_after_the_real_end_counts_an_overrun_without_freezing() -> None:
    sim = Sim(grace_ns=5 * MS)
    sim.resident("a")
    sim.start(predicted_ms=10)
    sim.advance_ms(10)
    sim.end()
    end_ns = sim.now
    sim.advance_ms(2)
    actions = sim.parked("a", [12.0], reason="park", last_end_ns=end_ns + 2 * MS)
    assert of(actions, Freeze) == []
    assert sim.core.tasks["a"].overruns == 1
    assert list(sim.core.stats.overrun_ms) == [pytest.approx(2.0)]


def test_park_for_a_stale_grant_updates_stats_but_not_state() -> None:
    sim = Sim()
    sim.resident("a")
    sim.start(predicted_ms=10)
    actions = sim.parked("a", [1.0], grant_id=999)
    assert actions == []
    assert sim.state("a") == S.RUNNING
    assert sim.core.tasks["a"].harvested_ns == MS


# ====================================================================== overruns and freezes


def _overrun(sim: Sim, task_id: str = "a") -> list[Action]:
    """Grant a 10 ms bubble, end it, and let the grace period pass without a park."""
    sim.start(predicted_ms=10)
    assert sim.state(task_id) == S.RUNNING
    sim.advance_ms(10)
    sim.end()
    end_ns = sim.now
    assert sim.core.next_timer_ns() == end_ns + sim.core.config.grace_ns
    sim.at(end_ns + sim.core.config.grace_ns)
    return sim.tick()


def test_no_park_by_real_end_plus_grace_freezes_the_worker() -> None:
    sim = Sim(grace_ns=MS // 2)
    sim.resident("a")
    actions = _overrun(sim)
    assert non_state(actions) == [Freeze("a")]
    assert StateChanged("a", S.RUNNING, S.FROZEN, "overran the bubble") in actions
    assert sim.state("a") == S.FROZEN
    assert sim.core.tasks["a"].overruns == 1
    assert sim.core.stats.overruns == 1
    assert "frozen" in sim.core.waiting_reason(sim.core.tasks["a"])


def test_tick_before_the_grace_period_ends_does_nothing() -> None:
    sim = Sim(grace_ns=MS)
    sim.resident("a")
    sim.start(predicted_ms=10)
    sim.advance_ms(10)
    sim.end()
    sim.advance_ms(0.9)
    assert sim.tick() == []
    assert sim.state("a") == S.RUNNING


def test_overrun_widens_the_task_margin_up_to_the_bound() -> None:
    sim = Sim(margin_ns=MS, max_margin_ns=5 * MS, grace_ns=MS // 2)
    sim.resident("a")
    sim.core.tasks["a"].estimator.extend([MS] * 8)  # an estimate that then proves wrong
    margins = []
    for _ in range(5):
        sim.advance_ms(5)
        _overrun(sim)
        margins.append(sim.core.config.margin_ns + sim.core.tasks["a"].margin_ns)
    assert margins == [2 * MS, 3 * MS, 5 * MS, 5 * MS, 5 * MS]


def test_frozen_task_is_thawed_by_the_grant_at_the_next_bubble() -> None:
    sim = Sim(margin_ns=MS)
    sim.resident("a")
    sim.core.tasks["a"].estimator.extend([MS] * 8)
    _overrun(sim)
    sim.advance_ms(5)
    grant = of(sim.start(predicted_ms=10), Grant)
    assert len(grant) == 1 and grant[0].thaw is True
    assert grant[0].margin_ns == 2 * MS  # the widened margin goes to the worker
    assert sim.state("a") == S.RUNNING
    sim.advance_ms(4)
    assert StateChanged("a", S.RUNNING, S.PARKED, "deadline") in sim.parked("a", [20.0])


def test_frozen_task_is_thawed_before_other_tasks_of_equal_priority() -> None:
    sim = Sim()
    sim.resident("a")
    _overrun(sim)
    sim.resident("b")  # would otherwise win as a probe
    sim.advance_ms(5)
    assert grants(sim.start(predicted_ms=10)) == ["a"]


def test_frozen_task_is_thawed_even_if_its_step_is_longer_than_the_bubble() -> None:
    sim = Sim(margin_ns=MS)
    sim.resident("a")
    sim.core.tasks["a"].estimator.add(50 * MS)
    sim.start(predicted_ms=60)
    sim.advance_ms(60)
    sim.end()
    sim.advance_ms(1)
    sim.tick()
    assert sim.state("a") == S.FROZEN
    sim.advance_ms(5)
    assert grants(sim.start(predicted_ms=10)) == ["a"]


def test_step_stuck_past_step_timeout_fails_the_task_with_step_timeout_and_kill() -> None:
    sim = Sim(step_timeout_ns=25 * MS, grace_ns=MS)
    sim.resident("a")
    _overrun(sim)  # 11 ms of granted time in one step
    sim.advance_ms(5)
    _overrun(sim)  # 22 ms
    assert sim.state("a") == S.FROZEN
    sim.advance_ms(5)
    actions = _overrun(sim)  # 33 ms > 25 ms
    assert of(actions, Freeze) == [Freeze("a")]
    assert of(actions, Kill) == [Kill("a")]
    assert sim.state("a") == S.FAILED
    failure = sim.core.tasks["a"].failure
    assert failure is not None and failure.kind == "STEP_TIMEOUT"
    assert of(sim.exited("a", exit_code=None, sig=signal.SIGKILL), StateChanged) == []


def test_a_step_that_looks_hung_gets_every_other_bubble_instead_of_all_of_them() -> None:
    # Stranger trial: a hung step was thawed first in every bubble until its 60 s step timeout.
    sim = Sim(step_timeout_ns=10_000 * MS, grace_ns=MS)
    _hung_and_other(sim)
    assert [_steps_once_or_thaw(sim) for _ in range(4)] == ["b", "a", "b", "a"]


def _steps_once(sim: Sim, task_id: str) -> None:
    """A bubble in which ``task_id`` goes first and parks after three 2 ms steps."""
    assert grants(sim.start(predicted_ms=10))[0] == task_id
    sim.advance_ms(7)
    sim.parked(task_id, [2.0, 2.0, 2.0])
    sim.advance_ms(3)
    sim.end()
    sim.advance_ms(5)


def test_a_step_that_hangs_in_the_first_grant_after_other_steps_looks_hung_once_the_board_shows_them() -> None:
    # Stranger trial: steps 1-2 finished inside the first grant, step 3 hung; no park ever reported
    # them, so the task kept every bubble until its step timeout.
    sim = Sim(step_timeout_ns=10_000 * MS, grace_ns=MS)
    sim.resident("a", "b")
    for _ in range(2):  # 22 ms of granted time in one step: more than two 10 ms bubbles
        _overrun(sim)
        sim.send(WorkerStepsSeen("a", steps_done=2))  # what the loop reads from the board at the freeze
        sim.advance_ms(5)
    assert grants(sim.start(predicted_ms=10))[0] == "b"


def _hung_and_other(sim: Sim) -> None:
    """ "a" learned (its step fits), then stuck in one step for 22 ms of granted time: it looks hung."""
    sim.resident("a", "b")
    _steps_once(sim, "a")
    _steps_once(sim, "b")
    for _ in range(2):
        _overrun(sim)
        sim.advance_ms(5)
    assert sim.state("a") == S.FROZEN


def test_a_step_that_looks_hung_is_never_thawed_into_the_tail_another_task_left() -> None:
    # Third trial: the hung task was thawed at 19.2 ms of 20 ms bubbles and overran every one.
    sim = Sim(step_timeout_ns=10_000 * MS, grace_ns=MS)
    _hung_and_other(sim)
    assert grants(sim.start(predicted_ms=10)) == ["b"]
    sim.advance_ms(5)
    assert grants(sim.parked("b", [1.0], reason="done")) == []  # 5 ms left, and "a" would need them all
    assert sim.state("a") == S.FROZEN


def test_a_step_that_looks_hung_fails_after_the_step_timeout_in_wall_time() -> None:
    sim = Sim(step_timeout_ns=200 * MS, grace_ns=MS)
    _hung_and_other(sim)
    for _ in range(20):  # bubbles every 15 ms: 200 ms of wall time within 15 of them
        if sim.state("a") == S.FAILED:
            break
        _steps_once_or_thaw(sim)
    failed = sim.core.tasks["a"].failure
    assert failed is not None and failed.kind == "STEP_TIMEOUT" and "looked hung" in failed.message
    assert sim.core.tasks["a"].stuck_ns < 200 * MS  # far less granted time than the limit


def _steps_once_or_thaw(sim: Sim) -> str:
    """One 10 ms bubble: "b" steps and parks, or "a" is thawed and frozen again; who went first."""
    granted = grants(sim.start(predicted_ms=10))
    if granted and granted[0] == "b":
        sim.advance_ms(9.9)
        sim.parked("b", [2.0] * 4)  # too little of the bubble is left for "a" to be thawed in it
        sim.advance_ms(0.1)
        sim.end()
    else:
        sim.advance_ms(10)
        sim.end()
        sim.advance_ms(1)
        sim.tick()  # frozen again, still inside its step
    sim.advance_ms(5)
    return granted[0] if granted else ""


def test_a_setup_past_its_step_timeout_says_setup_and_frozen_in_setup_says_so() -> None:
    sim = Sim(step_timeout_ns=25 * MS, grace_ns=MS)
    sim.resident("a")
    _overrun(sim)
    sim.send(WorkerStepsSeen("a", steps_done=0, in_setup=True))
    assert "frozen in setup()" in sim.core.waiting_reason(sim.core.tasks["a"])
    for _ in range(2):
        sim.advance_ms(5)
        _overrun(sim)
    failure = sim.core.tasks["a"].failure
    assert failure is not None and failure.kind == "STEP_TIMEOUT" and failure.message.startswith("setup() ran for")


def test_a_long_setup_keeps_the_first_turn_until_it_finishes() -> None:
    # A graph generated in setup takes many bubbles; it is no hang (the quick demo's PageRank).
    sim = Sim(step_timeout_ns=10_000 * MS, grace_ns=MS)
    sim.resident("a", "b")
    for _ in range(6):
        _overrun(sim)  # "a" is granted first every time, inside its setup
        sim.advance_ms(5)
    assert sim.state("a") == S.FROZEN and sim.core.tasks["a"].stuck_ns > 6 * 10 * MS


def test_a_finished_step_resets_the_step_timeout_clock() -> None:
    sim = Sim(step_timeout_ns=25 * MS, grace_ns=MS)
    sim.resident("a")
    _overrun(sim)
    sim.advance_ms(5)
    sim.start(predicted_ms=10)  # thaw
    sim.advance_ms(3)
    sim.parked("a", [4.0])  # the stuck step finished
    assert sim.core.tasks["a"].stuck_ns == 0
    sim.end()
    for _ in range(2):
        sim.advance_ms(5)
        _overrun(sim)
    assert sim.state("a") == S.FROZEN  # 22 ms stuck, under the limit again


def test_no_end_event_at_all_freezes_at_the_predicted_end_plus_grace() -> None:
    sim = Sim(grace_ns=MS)
    sim.resident("a")
    sim.start(predicted_ms=10)
    assert sim.core.next_timer_ns() == T0 + 11 * MS
    sim.at(T0 + 10 * MS)
    assert sim.tick() == []
    sim.at(T0 + 11 * MS)
    actions = sim.tick()
    assert non_state(actions) == [Freeze("a")]
    assert sim.state("a") == S.FROZEN
    assert sim.core.next_timer_ns() is None
    sim.advance_ms(5)
    assert of(sim.start(predicted_ms=10), Grant)[0].thaw is True  # the lost end's bubble is closed by this start


def test_regression_an_end_after_the_freeze_is_measured_not_rejected() -> None:
    # Issue 13: the freeze closed the bubble, so its end, arriving later, was counted as rejected and
    # the bubble was missing from the slot statistics (149 of 150 shown).
    sim = Sim(grace_ns=MS)
    sim.resident("a")
    for _ in range(3):
        sim.start(predicted_ms=10)
        sim.advance_ms(10)
        sim.end()
        sim.parked("a", [9.0], reason="park")
        sim.advance_ms(5)
    sim.start(predicted_ms=10)
    sim.advance_ms(11)
    assert of(sim.tick(), Freeze) == [Freeze("a")]
    sim.advance_ms(4)
    assert sim.end() == []  # 15 ms: the real end, late
    stats = sim.core.slot_stats()
    assert [s.count for s in stats] == [4]
    assert stats[0].length_ms.max == pytest.approx(15.0)
    assert sim.core.stats.ignored_events == 0 and sim.core.stats.anomalies == 0
    assert sim.core.stats.bubble_ns == (3 * 10 + 15) * MS
    sim.advance_ms(5)
    assert of(sim.start(predicted_ms=10), Grant)[0].thaw is True
    assert sim.core.stats.anomalies == 0


def test_regression_freeze_while_a_new_bubble_is_open_grants_that_bubble() -> None:
    sim = Sim(grace_ns=2 * MS)
    sim.resident("a", "b")
    sim.start(predicted_ms=10)
    sim.advance_ms(10)
    sim.end()
    sim.advance_ms(1)
    assert grants(sim.start(predicted_ms=20)) == []  # "a" still in its step
    sim.advance_ms(1)
    actions = sim.tick()  # grace over: "a" is frozen, the open bubble must not go to waste
    assert of(actions, Freeze) == [Freeze("a")]
    assert len(grants(actions)) == 1


def test_next_timer_is_none_when_nothing_is_pending() -> None:
    sim = Sim()
    assert sim.core.next_timer_ns() is None
    sim.resident("a")
    assert sim.core.next_timer_ns() is None


# ====================================================================== failures


def test_worker_failure_then_exit_is_failed_with_the_failure_record() -> None:
    sim = Sim()
    sim.resident("a")
    sim.start(predicted_ms=10)
    failure = FailureRecord(kind="EXCEPTION", message="ZeroDivisionError: boom", step=3, traceback="Traceback ...")
    assert sim.send(WorkerFailed("a", failure)) == []
    assert sim.state("a") == S.RUNNING  # the exit completes the record
    actions = sim.exited("a", exit_code=1, log_tail="last lines\n")
    changes = of(actions, StateChanged)
    assert len(changes) == 1
    assert (changes[0].old, changes[0].new, changes[0].reason) == (S.RUNNING, S.FAILED, "EXCEPTION")
    recorded = sim.core.tasks["a"].failure
    assert recorded == changes[0].failure
    assert recorded is not None
    assert recorded.kind == "EXCEPTION"
    assert recorded.traceback == "Traceback ..."
    assert recorded.step == 3
    assert recorded.log_tail == "last lines\n"


def test_steps_of_the_grant_a_task_failed_in_count_as_harvested_work() -> None:
    # No park follows a failure: the failure report carries that grant's steps.
    sim = Sim()
    sim.resident("a")
    sim.start(predicted_ms=10)
    before = sim.core.stats.harvested_ns
    failure = FailureRecord(kind="EXCEPTION", message="boom", step=3)
    sim.send(WorkerFailed("a", failure, durations_ns=(2 * MS, 3 * MS, 4 * MS), progress=30.0, total_steps=3))
    sim.exited("a", exit_code=1)
    task = sim.core.tasks["a"]
    assert task.state == S.FAILED
    assert task.harvested_ns == 9 * MS and sim.core.stats.harvested_ns - before == 9 * MS
    assert task.steps == 3 and task.progress == 30.0


def test_worker_failure_keeps_its_own_log_tail() -> None:
    sim = Sim()
    sim.resident("a")
    sim.send(WorkerFailed("a", FailureRecord(kind="IMPORT", message="no module x", log_tail="own tail")))
    sim.exited("a", exit_code=1, log_tail="exit tail")
    failure = sim.core.tasks["a"].failure
    assert failure is not None and failure.log_tail == "own tail"


def test_exit_by_signal_without_a_failure_message_is_failed_signal() -> None:
    sim = Sim()
    sim.resident("a")
    actions = sim.exited("a", exit_code=None, sig=signal.SIGSEGV, log_tail="segfault")
    assert StateChanged("a", S.PARKED, S.FAILED, "SIGNAL", sim.core.tasks["a"].failure) in actions
    failure = sim.core.tasks["a"].failure
    assert failure is not None
    assert failure.kind == "SIGNAL"
    assert failure.signal == signal.SIGSEGV
    assert "SIGSEGV" in failure.message
    assert failure.log_tail == "segfault"


def test_exit_without_finishing_or_reporting_is_failed_exit_with_the_code() -> None:
    sim = Sim()
    sim.resident("a")
    sim.exited("a", exit_code=3)
    failure = sim.core.tasks["a"].failure
    assert failure is not None and failure.kind == "EXIT" and failure.exit_code == 3


def test_starting_worker_that_dies_is_failed() -> None:
    sim = Sim()
    sim.add("a")
    sim.free(1000)
    actions = sim.exited("a", exit_code=1)
    assert of(actions, StateChanged)[0].new == S.FAILED


def test_task_memory_over_its_cap_fails_with_memory_limit_and_is_killed() -> None:
    sim = Sim()
    sim.resident("a", mem_mib=100)
    assert sim.send(TaskMemorySampled("a", used_bytes=100 * MiB)) == []  # at the cap is fine
    actions = sim.send(TaskMemorySampled("a", used_bytes=150 * MiB))
    assert of(actions, Kill) == [Kill("a")]
    assert sim.state("a") == S.FAILED
    failure = sim.core.tasks["a"].failure
    assert failure is not None and failure.kind == "MEMORY_LIMIT"
    assert "150 MiB" in failure.message and "100 MiB" in failure.message
    # The exit of the killed process completes nothing and changes nothing.
    assert sim.exited("a", exit_code=None, sig=signal.SIGKILL) == []
    assert sim.core.tasks["a"].failure is failure


def test_cap_covers_what_a_task_holds_beyond_its_workers_reported_baseline() -> None:
    sim = Sim()
    sim.add("a", mem_mib=100)
    sim.free(100_000)
    # A CPU worker with torch imported holds ~200 MiB before setup: not the task's to pay.
    sim.send(WorkerReady("a", pid=1001, baseline_bytes=220 * MiB))
    assert sim.send(TaskMemorySampled("a", used_bytes=320 * MiB)) == []  # 100 MiB beyond: at the cap
    actions = sim.send(TaskMemorySampled("a", used_bytes=330 * MiB))
    assert of(actions, Kill) == [Kill("a")]
    failure = sim.core.tasks["a"].failure
    assert failure is not None and failure.kind == "MEMORY_LIMIT"
    assert "used 110 MiB beyond its worker's 220 MiB baseline" in failure.message
    assert "import them at module level" in failure.message  # the usual surprise: a lazy import of torch


def test_starting_worker_is_not_held_to_its_cap_while_it_imports() -> None:
    sim = Sim()
    sim.add("a", mem_mib=50)
    sim.free(100_000)
    assert sim.state("a") == S.STARTING
    assert sim.send(TaskMemorySampled("a", used_bytes=220 * MiB)) == []  # importing torch
    assert sim.state("a") == S.STARTING
    sim.send(WorkerReady("a", pid=1001, baseline_bytes=220 * MiB))
    assert sim.state("a") == S.PARKED


def test_crash_of_the_running_task_lets_another_task_use_the_rest_of_the_bubble() -> None:
    sim = Sim()
    sim.resident("crashy", "steady")
    assert grants(sim.start(predicted_ms=10)) == ["crashy"]
    sim.advance_ms(2)
    sim.send(WorkerFailed("crashy", FailureRecord(kind="EXCEPTION", message="boom")))
    actions = sim.exited("crashy", exit_code=1)
    assert sim.state("crashy") == S.FAILED
    assert grants(actions) == ["steady"]


def test_crash_of_one_task_does_not_stop_others_at_the_next_bubble() -> None:
    sim = Sim()
    sim.resident("crashy", "steady")
    sim.start(predicted_ms=10)
    sim.advance_ms(10)
    sim.end()
    sim.exited("crashy", exit_code=None, sig=signal.SIGABRT)
    assert sim.state("crashy") == S.FAILED
    assert sim.core.next_timer_ns() is None  # no freeze pending for a dead worker
    sim.advance_ms(5)
    assert grants(sim.start(predicted_ms=10)) == ["steady"]


def test_regression_memory_limit_kill_of_the_running_task_backfills_the_bubble_after_exit() -> None:
    sim = Sim()
    sim.resident("hog", "steady")
    assert grants(sim.start(predicted_ms=10)) == ["hog"]
    sim.advance_ms(1)
    actions = sim.send(TaskMemorySampled("hog", used_bytes=10_000 * MiB))
    assert of(actions, Kill) == [Kill("hog")]
    assert grants(actions) == []  # not while the killed process may still run kernels
    sim.advance_ms(1)
    assert grants(sim.exited("hog", exit_code=None, sig=signal.SIGKILL)) == ["steady"]


def test_worker_finished_is_finished_and_exit_afterwards_changes_nothing() -> None:
    sim = Sim()
    sim.resident("a")
    sim.start(predicted_ms=10)
    actions = sim.send(WorkerFinished("a", total_steps=42, progress=1.0))
    assert StateChanged("a", S.RUNNING, S.FINISHED, "done") in actions
    assert sim.core.tasks["a"].steps == 42
    assert sim.exited("a", exit_code=0) == []
    assert sim.state("a") == S.FINISHED


def test_worker_finished_frees_the_bubble_for_the_next_task() -> None:
    sim = Sim()
    sim.resident("a", "b")
    sim.start(predicted_ms=10)
    assert grants(sim.send(WorkerFinished("a", total_steps=1, progress=1.0))) == ["b"]


def test_events_for_unknown_tasks_are_ignored() -> None:
    sim = Sim()
    for event in (
        WorkerFailed("ghost", FailureRecord(kind="EXIT", message="")),
        WorkerExited("ghost", exit_code=0, signal=0),
        WorkerFinished("ghost", total_steps=1, progress=1.0),
        WorkerCheckpointed("ghost", step=1, path="/x", progress=0.1),
        TaskMemorySampled("ghost", used_bytes=1),
    ):
        assert sim.send(event) == []


# ====================================================================== cancel


def test_cancel_of_a_submitted_task_goes_directly_to_cancelled() -> None:
    sim = Sim()
    sim.add("a")
    actions = sim.send(CancelRequested("a"))
    assert actions == [StateChanged("a", S.SUBMITTED, S.CANCELLED, "cancelled by user")]


@pytest.mark.parametrize("state", [S.STARTING, S.PARKED, S.RUNNING, S.FROZEN])
def test_cancel_of_a_resident_task_kills_it_and_cancels(state: TaskState) -> None:
    sim = Sim()
    sim.add("a")
    sim.free(1000)
    if state != S.STARTING:
        sim.ready("a")
    if state in (S.RUNNING, S.FROZEN):
        sim.start(predicted_ms=10)
    if state == S.FROZEN:
        sim.advance_ms(20)
        sim.tick()
    assert sim.state("a") == state
    actions = sim.send(CancelRequested("a"))
    assert actions == [Kill("a"), StateChanged("a", state, S.CANCELLED, "cancelled by user")]
    assert sim.core.next_timer_ns() is None


def test_cancelled_task_frees_its_memory_for_waiting_tasks() -> None:
    sim = Sim()
    sim.add("a", mem_mib=600)
    sim.add("b", mem_mib=600)
    sim.free(1000)
    actions = sim.send(CancelRequested("a"))
    assert [s.task_id for s in of(actions, Spawn)] == ["b"]


def test_later_events_for_a_cancelled_task_change_nothing() -> None:
    sim = Sim()
    sim.resident("a")
    sim.start(predicted_ms=10)
    sim.send(CancelRequested("a"))
    assert sim.send(CancelRequested("a")) == []
    assert sim.send(WorkerFailed("a", FailureRecord(kind="SIGNAL", message="killed"))) == []
    assert sim.send(WorkerFinished("a", total_steps=1, progress=1.0)) == []
    assert sim.send(TaskMemorySampled("a", used_bytes=10**12)) == []
    assert sim.exited("a", exit_code=None, sig=signal.SIGKILL) == []
    assert sim.state("a") == S.CANCELLED
    assert sim.core.tasks["a"].failure is None


def test_transition_out_of_a_terminal_state_raises_invalid_transition() -> None:
    from freeride.errors import InvalidTransition

    sim = Sim()
    sim.add("a")
    sim.send(CancelRequested("a"))
    with pytest.raises(InvalidTransition):
        sim.core._transition(sim.core.tasks["a"], S.SUBMITTED, "resurrect", [])


# ====================================================================== drain


def test_drain_stops_every_resident_task_with_checkpoint() -> None:
    sim = Sim()
    sim.resident("a", "b", "c")
    sim.start(predicted_ms=10)  # "a" running
    actions = sim.send(DrainRequested())
    assert sorted(of(actions, Stop), key=lambda s: s.task_id) == [
        Stop("a", checkpoint=True),
        Stop("b", checkpoint=True),
        Stop("c", checkpoint=True),
    ]
    assert of(actions, DrainComplete) == []


def test_drain_completes_once_no_task_is_resident_and_tasks_go_back_to_submitted() -> None:
    sim = Sim()
    sim.resident("a", "b")
    sim.add("queued", mem_mib=10**6)
    sim.send(DrainRequested())
    assert of(sim.exited("a", exit_code=0), DrainComplete) == []
    actions = sim.exited("b", exit_code=0)
    assert of(actions, DrainComplete) == [DrainComplete()]
    assert of(actions, Spawn) == []  # no re-placement while draining
    assert {t: sim.state(t) for t in ("a", "b", "queued")} == {
        "a": S.SUBMITTED,
        "b": S.SUBMITTED,
        "queued": S.SUBMITTED,
    }
    assert "draining" in sim.core.waiting_reason(sim.core.tasks["a"])
    assert of(sim.tick(), DrainComplete) == []  # announced once


def test_drain_with_nothing_resident_completes_at_once() -> None:
    sim = Sim()
    sim.add("a", mem_mib=10**6)
    assert sim.send(DrainRequested()) == [DrainComplete()]


def test_a_second_drain_is_answered_at_once_once_nothing_is_resident() -> None:
    # Regression (issue 13): DrainComplete was announced once, so a second drain (or SIGTERM after a
    # drain) never got an answer and the manager could no longer be stopped.
    sim = Sim()
    sim.resident("a")
    sim.send(DrainRequested())
    assert of(sim.exited("a", exit_code=0), DrainComplete) == [DrainComplete()]
    assert sim.send(DrainRequested()) == [DrainComplete()]
    assert sim.send(DrainRequested()) == [DrainComplete()]
    assert of(sim.tick(), DrainComplete) == []


def test_a_drain_asked_again_while_under_way_completes_once_for_both() -> None:
    sim = Sim()
    sim.resident("a")
    sim.send(DrainRequested())
    again = sim.send(DrainRequested())
    assert of(again, DrainComplete) == [] and of(again, Stop) == []  # nothing new to stop
    assert of(sim.exited("a", exit_code=0), DrainComplete) == [DrainComplete()]


def test_no_grants_or_spawns_while_draining() -> None:
    sim = Sim()
    sim.resident("a")
    sim.send(DrainRequested())
    sim.add("b")
    assert of(sim.free(10_000), Spawn) == []
    assert sim.start(predicted_ms=10) == []
    assert sim.state("b") == S.SUBMITTED


def test_drain_kills_a_starting_task_instead_of_asking_it_to_checkpoint() -> None:
    sim = Sim()
    sim.add("a")
    sim.free(1000)
    actions = sim.send(DrainRequested())
    assert non_state(actions) == [Kill("a")]


def test_worker_that_ignores_stop_is_killed_at_the_stop_timeout() -> None:
    sim = Sim(stop_timeout_ns=100 * MS)
    sim.resident("a")
    sim.send(DrainRequested())
    deadline = sim.core.next_timer_ns()
    assert deadline == T0 + 100 * MS
    sim.at(deadline - 1)
    assert sim.tick() == []
    sim.at(deadline)
    assert sim.tick() == [Kill("a")]
    assert sim.core.next_timer_ns() is None
    actions = sim.exited("a", exit_code=None, sig=signal.SIGKILL)
    # Killed during a drain: it loses only the work since its last checkpoint and is placed again.
    assert sim.state("a") == S.SUBMITTED
    assert of(actions, DrainComplete) == [DrainComplete()]


def test_worker_that_stops_in_time_is_not_killed() -> None:
    sim = Sim(stop_timeout_ns=100 * MS)
    sim.resident("a")
    sim.send(DrainRequested())
    sim.advance_ms(10)
    sim.exited("a", exit_code=0)
    assert sim.core.next_timer_ns() is None
    sim.advance_ms(200)
    assert sim.tick() == []


# ====================================================================== malformed bubble streams


def test_bubble_end_without_a_start_is_an_anomaly_and_does_nothing() -> None:
    sim = Sim()
    sim.resident("a")
    end = BubbleEnd(stage=0, rank=0, iteration=9, slot=0, end_ns=T0)
    assert sim.send(BubbleEnded(bubble=end, received_ns=T0)) == []
    assert sim.core.stats.anomalies == 1
    assert sim.core.stats.bubbles == 0


def test_bubble_end_for_another_bubble_is_an_anomaly_and_keeps_the_open_one() -> None:
    sim = Sim()
    sim.resident("a")
    sim.start(predicted_ms=10)
    other = BubbleEnd(stage=0, rank=0, iteration=99, slot=0, end_ns=sim.now + MS)
    assert sim.send(BubbleEnded(bubble=other, received_ns=sim.now)) == []
    assert sim.core.stats.anomalies == 1
    assert sim.state("a") == S.RUNNING
    assert sim.core.bubble is not None


def test_bubble_end_before_its_start_is_an_anomaly_and_does_nothing() -> None:
    sim = Sim()
    sim.resident("a")
    sim.start(predicted_ms=10)
    sim.advance_ms(5)
    assert sim.end(end_ns=T0 - MS) == []
    assert sim.core.stats.anomalies == 1
    assert sim.state("a") == S.RUNNING


def test_duplicate_bubble_start_is_an_anomaly_and_does_nothing_without_tasks() -> None:
    sim = Sim()
    sim.start(predicted_ms=10, iteration=1)
    assert sim.start(predicted_ms=10, iteration=1) == []
    assert sim.core.stats.anomalies == 1
    assert sim.end() == []
    assert sim.core.stats.anomalies == 1


def test_repeated_end_of_the_same_bubble_is_an_anomaly() -> None:
    sim = Sim()
    sim.start(predicted_ms=10)
    sim.advance_ms(10)
    sim.end()
    assert sim.end() == []
    assert sim.core.stats.anomalies == 1


def test_grants_name_their_bubble_for_the_trainers_end_board_except_under_the_reference_policy() -> None:
    sim = Sim()
    sim.resident("a")
    grant = of(sim.start(predicted_ms=10, rank=2), Grant)[0]
    assert (grant.rank, grant.bubble_start_ns, grant.trainer_ends) == (2, sim.now, True)
    paper = paper_sim()
    paper.tick()
    paper.start(predicted_ms=30)
    paper.advance_ms(10)
    assert [g.trainer_ends for g in of(paper.tick(), Grant)] == [False]


def test_a_worker_that_stopped_on_the_trainers_end_closes_its_bubble_to_grants() -> None:
    # The worker read the trainer's end on the end board before the end reached the manager: nothing
    # may be granted in the rest of that bubble, and the end, when it comes, is measured as usual.
    sim = Sim()
    sim.resident("a", "b")
    sim.start(predicted_ms=10)
    assert sim.state("a") == S.RUNNING
    trainer_end = sim.now + 6 * MS
    sim.advance_ms(6.3)
    task = sim.core.tasks["a"]
    actions = sim.send(WorkerParked("a", task.grant_id, 1, (int(6.2 * MS),), task.granted_at_ns + 1000,
                                    trainer_end + MS // 10, sim.now, "ended", 0.0, 1, seen_end_ns=trainer_end))
    assert grants(actions) == []  # no backfill of an ended bubble
    assert sim.state("a") == S.PARKED
    assert list(sim.core.stats.overrun_ms) == [pytest.approx(0.1)]  # measured from the trainer's end
    sim.advance_ms(0.3)
    assert sim.end(end_ns=trainer_end) == []  # no park: nobody runs
    assert [s.count for s in sim.core.slot_stats()] == [1] and sim.core.stats.ignored_events == 0
    sim.advance_ms(5)
    assert grants(sim.start(predicted_ms=10)) == ["b"]  # the next bubble is granted as usual


def test_start_while_another_bubble_is_open_closes_the_lost_one_and_parks_its_worker() -> None:
    sim = Sim()
    sim.resident("a")
    grant = of(sim.start(predicted_ms=10), Grant)[0]
    sim.advance_ms(12)
    actions = sim.start(predicted_ms=10)  # the first bubble's end was lost
    assert sim.core.stats.anomalies == 1
    assert non_state(actions) == [Park("a", grant.grant_id)]


@pytest.mark.parametrize("same_key", [True, False])
def test_regression_worker_parking_after_a_duplicate_start_does_not_wedge_grants(same_key: bool) -> None:
    sim = Sim()
    sim.resident("a", "b")
    sim.start(predicted_ms=10, iteration=1)
    sim.advance_ms(2)
    sim.start(predicted_ms=10, iteration=1 if same_key else 2)  # duplicate / lost end
    sim.advance_ms(1)
    actions = sim.parked("a", [2.0], reason="park")
    assert sim.state("a") == S.PARKED
    assert grants(actions) == ["b"]  # the open bubble goes on being used
    sim.advance_ms(10)
    sim.end()
    sim.parked("b", [5.0], reason="park")
    sim.advance_ms(5)
    assert len(grants(sim.start(predicted_ms=10, iteration=3))) == 1


def test_stale_start_older_than_the_open_bubble_is_ignored_and_counted() -> None:
    sim = Sim()
    sim.resident("a")
    sim.start(predicted_ms=10, iteration=5)
    stale = BubbleStart(0, 0, 3, 0, "fwd", sim.now - 50 * MS, 10 * MS)  # an old iteration, delivered late
    assert sim.send(BubbleStarted(stale, sim.now)) == []
    assert sim.state("a") == S.RUNNING  # the open (newer) bubble keeps its worker
    assert sim.core.stats.ignored_events == 1
    assert sim.core.stats.bubbles == 1


def test_out_of_order_ends_are_counted_as_ignored_events() -> None:
    sim = Sim()
    sim.send(BubbleEnded(BubbleEnd(0, 0, 9, 0, T0), T0))  # an end without its start
    sim.start(predicted_ms=10)
    sim.advance_ms(5)
    sim.end(end_ns=T0 - MS)  # an end before its start
    assert sim.core.stats.ignored_events == 2


def test_duplicate_start_is_not_an_ignored_event() -> None:
    sim = Sim()
    sim.start(predicted_ms=10, iteration=1)
    sim.start(predicted_ms=10, iteration=1)  # used: it closes the bubble whose end was lost
    assert sim.core.stats.ignored_events == 0


def test_malformed_streams_never_raise() -> None:
    sim = Sim()
    sim.resident("a", "b")
    b1 = BubbleStart(0, 0, 1, 0, "fwd", T0, 10 * MS)
    for event in (
        BubbleEnded(BubbleEnd(0, 0, 1, 0, T0), T0),
        BubbleStarted(b1, T0),
        BubbleStarted(b1, T0),
        BubbleEnded(BubbleEnd(0, 0, 1, 0, T0 - 5), T0),
        BubbleEnded(BubbleEnd(0, 0, 1, 0, T0 + MS), T0 + MS),
        BubbleEnded(BubbleEnd(0, 0, 1, 0, T0 + MS), T0 + MS),
        BubbleStarted(BubbleStart(0, 0, 0, 0, "fwd", T0 + 2 * MS, 10 * MS), T0 + 2 * MS),
    ):
        sim.at(max(sim.now, event.received_ns))
        sim.send(event)
    assert sim.core.stats.anomalies >= 4


# ====================================================================== state-change audit


def test_every_transition_emits_exactly_one_state_changed_and_they_chain() -> None:
    """Replay a busy scenario; the StateChanged stream alone must reconstruct every task's state."""
    sim = Sim(grace_ns=MS, step_timeout_ns=10**12, stop_timeout_ns=50 * MS, margin_ns=MS // 5)
    sim.add("a", mem_mib=300)
    sim.add("b", mem_mib=300, priority=1)
    sim.add("c", mem_mib=300)
    sim.add("gone", mem_mib=50)
    sim.send(CancelRequested("gone"))
    sim.start(predicted_ms=10, free_mib=700)  # a, b fit; c waits
    sim.ready("a")
    sim.ready("b")
    sim.advance_ms(3)
    sim.parked("b", [1.0, 1.0], reason="deadline")  # backfill to "a"
    sim.advance_ms(7)
    sim.end()
    sim.advance_ms(2)
    sim.tick()  # freeze "a"
    sim.advance_ms(3)
    sim.start(predicted_ms=10, free_mib=700)  # thaw "a"
    sim.advance_ms(2)
    sim.send(WorkerFailed("a", FailureRecord(kind="EXCEPTION", message="x")))
    sim.exited("a", exit_code=1)  # c spawns, b backfills
    sim.ready("c")
    sim.advance_ms(8)
    sim.end()
    sim.parked("b", [2.0], reason="park")
    sim.core._device_capacity.clear()
    sim.free(350)  # evict "c" (lowest priority parked)
    sim.exited("c", exit_code=0)
    sim.send(DrainRequested())
    sim.advance_ms(100)
    sim.tick()  # kill "b"
    sim.exited("b", exit_code=None, sig=signal.SIGKILL)

    replayed: dict[str, TaskState] = {}
    for change in of(sim.actions, StateChanged):
        assert replayed.get(change.task_id) == change.old, change
        assert change.old != change.new
        replayed[change.task_id] = change.new
    assert replayed == {task_id: task.state for task_id, task in sim.core.tasks.items()}
    seen = {(c.task_id, c.new) for c in of(sim.actions, StateChanged)}
    for expected in [
        ("a", S.FROZEN),
        ("a", S.FAILED),
        ("c", S.EVICTED),
        ("c", S.SUBMITTED),
        ("gone", S.CANCELLED),
        ("b", S.RUNNING),
    ]:
        assert expected in seen
    assert of(sim.actions, DrainComplete) == [DrainComplete()]


def test_task_whose_estimate_fits_no_bubble_gets_a_reprobe_after_enough_bubbles() -> None:
    sim = Sim(reprobe_after_bubbles=3)
    sim.resident("a")
    sim.core.tasks["a"].estimator.extend([500 * MS] * 10)
    grants = []
    for i in range(4):
        grants.append(of(sim.send(BubbleStarted(BubbleStart(0, 0, i, 0, "k", sim.now, 20 * MS, -1), sim.now)), Grant))
        if grants[-1]:
            break
        sim.advance_ms(20)
        sim.send(BubbleEnded(BubbleEnd(0, 0, i, 0, sim.now), sim.now))
        sim.advance_ms(5)
    assert [len(g) for g in grants] == [0, 0, 1]
    assert grants[-1][0].probe
    assert sim.core.tasks["a"].known_step_ns is None


def test_overrun_of_a_first_step_or_probe_does_not_widen_the_margin() -> None:
    sim = Sim(margin_ns=MS, grace_ns=MS // 2)
    sim.resident("a")  # no estimate yet: its first grant learns the step time
    _overrun(sim)
    assert sim.core.tasks["a"].margin_ns == 0


def test_clean_grants_shrink_a_widened_margin_back() -> None:
    sim = Sim(margin_ns=MS, max_margin_ns=20 * MS, grace_ns=MS // 2)
    sim.resident("a")
    sim.core.tasks["a"].margin_ns = 8 * MS
    for _ in range(10):
        sim.advance_ms(5)
        sim.start(predicted_ms=30)
        sim.advance_ms(2)
        sim.parked("a", [0.1])
        sim.advance_ms(1)
        sim.send(BubbleEnded(BubbleEnd(0, 0, sim.core.stats.bubbles - 1, 0, sim.now), sim.now))
    assert sim.core.tasks["a"].margin_ns < 3 * MS


# ====================================================================== the reference policy (bench)


def paper_sim(profile_ms: float | None = None) -> Sim:
    config: dict = {"policy": "paper"}
    if profile_ms is not None:
        config["paper_profile_ns"] = {(0, 0): int(profile_ms * MS)}
    sim = Sim(**config)
    sim.resident("a")
    return sim


def test_paper_policy_grants_only_at_its_next_10ms_poll() -> None:
    sim = paper_sim()
    sim.tick()  # the first event starts the poll clock: next poll at +10 ms
    sim.advance_ms(1)
    assert grants(sim.start(predicted_ms=30)) == []
    sim.advance_ms(5)
    assert grants(sim.tick()) == []
    sim.advance_ms(4)
    assert grants(sim.tick()) == ["a"]
    assert sim.core.next_timer_ns() == T0 + 20 * MS


def test_paper_policy_deadline_is_start_plus_profiled_minimum_not_the_trainers_prediction() -> None:
    sim = paper_sim(profile_ms=12)
    sim.tick()
    sim.start(predicted_ms=50)
    sim.advance_ms(10)
    [grant] = of(sim.tick(), Grant)
    assert grant.deadline_ns == T0 + 12 * MS
    assert grant.margin_ns == 0


def test_paper_policy_ignores_the_real_end_and_parks_at_the_first_poll_past_the_predicted_end() -> None:
    sim = paper_sim(profile_ms=15)
    sim.tick()
    sim.start(predicted_ms=15)
    sim.advance_ms(10)
    assert grants(sim.tick()) == ["a"]
    sim.advance_ms(3)
    assert of(sim.end(), Park) == []  # the reference never sees real ends
    sim.advance_ms(4)  # past the predicted end (15 ms), before the next poll (20 ms)
    assert of(sim.tick(), Park) == []
    sim.advance_ms(3)
    assert [p.task_id for p in of(sim.tick(), Park)] == ["a"]
    assert of(sim.actions, Freeze) == []  # a running step is never interrupted


def test_paper_policy_never_freezes_a_step_that_overruns() -> None:
    sim = paper_sim(profile_ms=15)
    sim.tick()
    sim.start(predicted_ms=15)
    sim.advance_ms(10)
    assert grants(sim.tick()) == ["a"]
    sim.advance_ms(6)
    sim.end()
    for _ in range(10):
        sim.advance_ms(10)
        sim.tick()
    assert of(sim.actions, Freeze) == []
    assert sim.state("a") == S.RUNNING
    sim.parked("a", [30.0], reason="park")
    assert sim.core.stats.overruns == 1


def test_paper_policy_grants_fifo_without_backfill_after_an_early_park() -> None:
    sim = Sim(policy="paper")
    sim.resident("a", "b")
    sim.tick()
    sim.start(predicted_ms=40)
    sim.advance_ms(10)
    assert grants(sim.tick()) == ["a"]
    sim.advance_ms(1)
    assert grants(sim.parked("a", [1.0], reason="deadline")) == []  # no backfill to b
    sim.advance_ms(10)
    assert grants(sim.tick()) == []


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="policy"):
        CoreConfig(policy="fastest")


def test_a_warm_up_step_counts_as_harvest_but_not_as_a_step_time_sample() -> None:
    # Regression: a small LSTM's first step (75 ms, lazy initialisation) became its estimate and fit
    # no 30 ms bubble until a re-probe 200 bubbles later; its other steps take 3 ms.
    sim = Sim()
    sim.resident("a")
    sim.start(predicted_ms=100)
    sim.advance_ms(80)
    sim.end()
    task = sim.core.tasks["a"]
    sim.send(WorkerParked("a", task.grant_id, 1, (75 * MS,), 0, sim.now, sim.now, "park", 1.0, 1, warmup_steps=1))
    assert task.known_step_ns is None, "the warm-up step became the estimate"
    assert task.harvested_ns == 75 * MS
    sim.advance_ms(10)
    assert grants(sim.start(predicted_ms=30)) == ["a"], "a task without an estimate gets its probe"
