"""Scheduling policies: what differs between the manager's own policy and the reference system's.

The scheduler (``scheduler.py``) keeps the mechanism (tasks, bubbles, memory, timers) and calls its
policy at fixed points: a bubble opens, a bubble ends while a worker holds it, a bubble is to be granted
(ranking and the grant's terms), a worker parks, the timers are looked at. Two classes implement
:class:`SchedulingPolicy`, chosen by ``CoreConfig.policy`` when the core is built (:func:`make_policy`):

* :class:`FreeridePolicy` (``freeride``): grants at once when a bubble opens and backfills what an early
  park leaves; follows the trainer's prediction, then its real end (a park as the end arrives, a freeze
  ``grace`` after it; the worker may also stop on the trainer's own end board); ranks by ``grants.rank``.
* :class:`ReferencePolicy` (``paper``): an emulation of the reference system (REFERENCE.md), so that the
  bench compares both inside one manager: a scheduler that acts only at a 10 ms poll, a bubble end
  predicted as start + the minimum profiled length of its (stage, slot), real ends ignored, no freeze, no
  backfill, priority then FIFO; the worker admits a step if 1.2 x its median fits.

A policy may use only what :class:`Scheduling` offers of the scheduler.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from freeride._manager.core import grants
from freeride._manager.core.api import CoreConfig, CoreStats, Grant, Park, WorkerParked
from freeride._manager.core.bubbles import Bubbles, OpenBubble
from freeride._manager.core.grants import Ranking
from freeride._manager.core.overruns import Overruns
from freeride._manager.core.tasks import TaskRuntime
from freeride.states import TaskState

MS = 1_000_000


class Scheduling(Protocol):
    """What of the scheduler a policy may use."""

    config: CoreConfig
    stats: CoreStats
    bubbles: Bubbles
    overruns: Overruns

    @property
    def tasks(self) -> dict[str, TaskRuntime]: ...

    def grant_next(self, now_ns: int, out: list) -> None:
        """Grant the open bubble to the best candidate, if it has time left and nobody holds it."""


class SchedulingPolicy(Protocol):
    name: str
    #: A step that fits no bubble gets its time measured again after ``reprobe_after_bubbles``.
    reprobes: bool
    #: A parked task is granted only a bubble that its step (plus margins) fits: while no resident task's step
    #: fits any bubble, the trainer's events decide nothing (``Scheduler.wants_trainer_events``).
    fits_steps: bool
    #: A bubble is granted only with more than this much time left.
    grant_floor_ns: int

    def bubble_opened(self, core: Scheduling, bubble: OpenBubble, now_ns: int, out: list) -> None:
        """``bubble`` just opened (the last one is closed)."""

    def bubble_ended(self, core: Scheduling, bubble: OpenBubble, task: TaskRuntime, end_ns: int, measured: bool,
                     now_ns: int, out: list) -> None:
        """The open bubble ended at ``end_ns`` (``measured``: the trainer's end; else lost) while ``task`` held it."""

    def end_seen(self, core: Scheduling, bubble: OpenBubble, end_ns: int, now_ns: int, step_began_ns: int = 0,
                 stopped_ns: int = 0) -> None:
        """The manager read ``bubble``'s real end (``end_ns``) from the trainer itself while its worker runs a
        step that began at ``step_began_ns`` (0: none, or unknown); ``stopped_ns``: the trainer stopped that step
        then."""

    def rank(self, tasks: Iterable[TaskRuntime], granted: set[str], remaining_ns: int,
             longest_bubble_ns: int) -> Ranking:
        """Who of the parked and frozen ``tasks`` gets the bubble, ``granted`` the tasks it was granted to
        already (pure; see ``grants.py``)."""

    def grant(self, core: Scheduling, task: TaskRuntime, bubble: OpenBubble, thaw: bool, probe: bool,
              now_ns: int) -> Grant:
        """The grant of ``bubble`` to ``task`` (arming whatever timer the policy keeps on it)."""

    def park_seen(self, core: Scheduling, bubble: OpenBubble, event: WorkerParked, now_ns: int) -> None:
        """The worker holding ``bubble`` parked, before its overrun is measured."""

    def parked(self, core: Scheduling, now_ns: int, out: list) -> None:
        """A worker that held a bubble has parked (its task is PARKED again)."""

    def poll(self, core: Scheduling, now_ns: int, out: list) -> None:
        """The timers are looked at (every event)."""

    def next_timer_ns(self) -> int | None:
        """When :meth:`poll` next has work to do (None: never of itself)."""


class FreeridePolicy:
    name = "freeride"
    reprobes = True
    fits_steps = True

    def __init__(self, config: CoreConfig) -> None:
        self._config = config
        self.grant_floor_ns = config.margin_ns

    def bubble_opened(self, core: Scheduling, bubble: OpenBubble, now_ns: int, out: list) -> None:
        core.grant_next(now_ns, out)

    def bubble_ended(self, core: Scheduling, bubble: OpenBubble, task: TaskRuntime, end_ns: int, measured: bool,
                     now_ns: int, out: list) -> None:
        # The worker parks after its current step (the loop sets its ended-grant word before it sends the
        # park; the worker reads it before each step).
        if task.state == TaskState.RUNNING:
            out.append(Park(task.task_id, task.grant_id, bubble.end_received_ns if measured else 0,
                            end_ns if measured else 0))
            if not bubble.seen_end_ns:  # else the freeze is armed at the end the trainer gave: keep it
                core.overruns.arm_at_end(end_ns, now_ns)

    def end_seen(self, core: Scheduling, bubble: OpenBubble, end_ns: int, now_ns: int, step_began_ns: int = 0,
                 stopped_ns: int = 0) -> None:
        # The end the worker reads on the trainer's board, reached the manager without the wire: nothing more
        # is granted in this bubble, and a step still running at end + grace is frozen then (at once when
        # that has passed), not grace after a wire trip; a step that will not end within the grace is frozen
        # at the end (Overruns.arm_at_seen_end), and one the trainer stopped at the end is frozen now, booked then.
        if not bubble.seen_end_ns:
            core.bubbles.saw_end(bubble, end_ns)
        elif not stopped_ns:
            return
        if stopped_ns:
            core.overruns.arm_stopped(end_ns, stopped_ns, mid_step=step_began_ns > 0)
            return
        task = core.tasks.get(bubble.running) if bubble.running else None
        core.overruns.arm_at_seen_end(end_ns, task, step_began_ns)

    def rank(self, tasks: Iterable[TaskRuntime], granted: set[str], remaining_ns: int,
             longest_bubble_ns: int) -> Ranking:
        config = self._config
        return grants.rank(tasks, granted, remaining_ns, config.margin_ns, config.reprobe_after_bubbles,
                           longest_bubble_ns)

    def grant(self, core: Scheduling, task: TaskRuntime, bubble: OpenBubble, thaw: bool, probe: bool,
              now_ns: int) -> Grant:
        # The worker extends the deadline itself while the bubble outlives it (it reads the end on the trainer's
        # board, or its ended-grant word); a step still running at its slot's longest length + grace, with no
        # end come, is frozen then.
        event = bubble.event
        core.overruns.arm_at_grant(bubble.latest_deadline_ns, now_ns)
        return Grant(task.task_id, task.grant_id, bubble.deadline_at(now_ns), self._config.margin_ns + task.margin_ns,
                     thaw, probe, rank=event.rank, bubble_start_ns=event.start_ns, bubble_key=event.key,
                     trainer_ends=True, survival_ns=bubble.survival_ns,
                     grace_ns=self._config.grace_ns)

    def park_seen(self, core: Scheduling, bubble: OpenBubble, event: WorkerParked, now_ns: int) -> None:
        learned = bubble.end_learned_ns  # before the worker's own end below: that one is not the manager's
        seen = event.seen_end_ns
        if seen and not bubble.end_ns and bubble.event.start_ns <= seen <= now_ns:
            # The worker saw the end on a board before the end reached this core: the bubble is over. Its
            # end event still comes, and is measured then; no backfill meanwhile.
            core.bubbles.saw_end(bubble, seen)
        # Parked by the end, each such park counted once: the manager's park, the worker's ended-grant word
        # (set by the end path as the end arrives, often before the end event reaches this core: it counted
        # nothing, and with a trainer on this host under load that was most grants), or the trainer's end
        # board. From the end as the manager learned it; 0 when the worker learned of it first.
        if event.reason in ("park", "ended"):
            core.stats.park_latency_ms.append(max(0, event.parked_ns - learned) / MS if learned else 0.0)

    def parked(self, core: Scheduling, now_ns: int, out: list) -> None:
        # Backfill the rest of this bubble, or start the bubble that opened while this step ran.
        core.grant_next(now_ns, out)

    def poll(self, core: Scheduling, now_ns: int, out: list) -> None:
        pass

    def next_timer_ns(self) -> int | None:
        return None


class ReferencePolicy:
    name = "paper"
    reprobes = False
    fits_steps = False  # the task decides at its worker (1.2 x its median)
    grant_floor_ns = 0

    def __init__(self, config: CoreConfig) -> None:
        self._profile = config.paper_profile_ns
        self._interval_ns = config.poll_interval_ns
        self._next_poll_ns = 0

    def bubble_opened(self, core: Scheduling, bubble: OpenBubble, now_ns: int, out: list) -> None:
        # The reference predicts start + the minimum profiled length, and acts at its next poll.
        b = bubble.event
        bubble.fixed_deadline_ns = b.start_ns + self._profile.get((b.stage, b.slot), b.predicted_ns)

    def bubble_ended(self, core: Scheduling, bubble: OpenBubble, task: TaskRuntime, end_ns: int, measured: bool,
                     now_ns: int, out: list) -> None:
        pass  # the reference never sees real ends: its poll parks at the predicted one

    def end_seen(self, core: Scheduling, bubble: OpenBubble, end_ns: int, now_ns: int, step_began_ns: int = 0,
                 stopped_ns: int = 0) -> None:
        pass  # the reference never sees real ends (its grants do not follow them: no end is published)

    def rank(self, tasks: Iterable[TaskRuntime], granted: set[str], remaining_ns: int,
             longest_bubble_ns: int) -> Ranking:
        return grants.rank_reference(tasks, granted)

    def grant(self, core: Scheduling, task: TaskRuntime, bubble: OpenBubble, thaw: bool, probe: bool,
              now_ns: int) -> Grant:
        # No margin (the worker's own 1.2 x median rule decides), no trainer's end board, and no freeze:
        # the reference never interrupts a running step.
        event = bubble.event
        return Grant(task.task_id, task.grant_id, bubble.deadline_ns, 0, thaw, probe,
                     rank=event.rank, bubble_start_ns=event.start_ns, bubble_key=event.key, trainer_ends=False)

    def park_seen(self, core: Scheduling, bubble: OpenBubble, event: WorkerParked, now_ns: int) -> None:
        pass

    def parked(self, core: Scheduling, now_ns: int, out: list) -> None:
        pass  # no backfill: the next poll starts whatever bubble is open

    def poll(self, core: Scheduling, now_ns: int, out: list) -> None:
        """The reference's scheduler thread, every ``poll_interval_ns``: pause a task whose bubble's predicted
        end has passed, then grant the bubble that has started (REFERENCE.md)."""
        if self._next_poll_ns == 0:
            self._next_poll_ns = now_ns + self._interval_ns
            return
        if now_ns < self._next_poll_ns:
            return
        while self._next_poll_ns <= now_ns:
            self._next_poll_ns += self._interval_ns
        for bubble in (core.bubbles.closing, core.bubbles.open):
            if bubble is None or not bubble.running or bubble.park_sent or now_ns < bubble.deadline_ns:
                continue
            task = core.tasks[bubble.running]
            if task.state == TaskState.RUNNING:
                bubble.park_sent = True
                out.append(Park(task.task_id, task.grant_id))
        bubble = core.bubbles.open
        if bubble is not None and not bubble.granted and now_ns >= bubble.event.start_ns:
            core.grant_next(now_ns, out)

    def next_timer_ns(self) -> int | None:
        return self._next_poll_ns or None


_POLICIES: dict[str, type[FreeridePolicy] | type[ReferencePolicy]] = {
    FreeridePolicy.name: FreeridePolicy,
    ReferencePolicy.name: ReferencePolicy,
}


def make_policy(config: CoreConfig) -> SchedulingPolicy:
    """The policy ``config.policy`` names (``CoreConfig`` has checked the name)."""
    return _POLICIES[config.policy](config)
