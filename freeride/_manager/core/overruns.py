"""Steps that run past a bubble's end: the freeze timer, the freeze, and what an overrun teaches a margin.

A step still running ``grace`` past the bubble's real end (or past its predicted end, when no end has come)
has its worker frozen with SIGSTOP until its next grant (:meth:`Overruns.freeze_running`). Grace counts from
when the manager learns of the end: it cannot act before; the overrun itself is measured from the trainer's
real end. An end the manager reads from the trainer itself (its local event, on one host) is known a wake-up
after it happens: then the freeze is at the real end + grace (:meth:`Overruns.arm_at_seen_end`), the same end
the worker stops its new steps at, or at the end itself for a step that will not end within the grace: one
that began (its worker's board says when) later than the end + grace less a typical (median) step of its task.
Waiting out the grace bought such a step nothing but time on the trainer's device: on the 2-core VM, 1 ms steps
in 0.6 ms bubbles were held 1.6 ms past the end at p99. On a ``cpu:N`` device the trainer itself stops a step
still running at its end (:mod:`freeride._boards`' stop records): that freeze is booked at the trainer's stop
(:meth:`Overruns.arm_stopped`), whenever the end reached the manager.

Each freeze of a step whose time was known (not a setup, a first step or a probe) past the end its grant was
sized to doubles that task's extra margin, up to ``max_margin`` (a bubble that ended before its prediction
says nothing about the step, nor does a thawed step frozen again before the worker reported anything since the
thaw: the grant that thawed it did not size that step); each clean grant lets it shrink back by an eighth.
One timer is enough: at most one worker holds a bubble at a time.
"""

from __future__ import annotations

from freeride._estimator import within_grace
from freeride._manager.core.api import MS, Action, CoreConfig, CoreStats, Freeze, Thaw
from freeride._manager.core.bubbles import Bubbles
from freeride._manager.core.machines import StepPhase
from freeride._manager.core.tasks import TaskRuntime, Tasks
from freeride.states import TaskState


class Overruns:
    def __init__(self, config: CoreConfig, stats: CoreStats, tasks: Tasks, bubbles: Bubbles) -> None:
        self._grace_ns = config.grace_ns
        self._margin_ns = config.margin_ns
        self._max_margin_ns = config.max_margin_ns
        self._step_timeout_ns = config.step_timeout_ns
        self._stats = stats
        self._tasks = tasks
        self._bubbles = bubbles
        #: When the worker holding a bubble is frozen if it has not parked (0: no freeze due).
        self.freeze_at_ns = 0
        #: When the trainer stopped that worker, where it did (0: the freeze stops it), and whether in a step.
        self.stopped_ns = 0
        self.stopped_mid_step = True

    def arm_at_end(self, end_ns: int, now_ns: int) -> None:
        """The real end is known (at ``now_ns``): freeze ``grace`` after it, or after now if it came late."""
        self.freeze_at_ns = max(end_ns, now_ns) + self._grace_ns

    def arm_at_seen_end(self, end_ns: int, task: TaskRuntime | None = None, step_began_ns: int = 0) -> None:
        """The real end came from the trainer, not the wire: freeze ``grace`` after it (at once if that passed), or
        at the end for ``task``'s step that began at ``step_began_ns`` when it will not end within the grace
        (:meth:`ends_past_grace`)."""
        late = task is not None and self.ends_past_grace(task, step_began_ns, end_ns)
        self.freeze_at_ns = end_ns if late else end_ns + self._grace_ns

    def arm_stopped(self, end_ns: int, stopped_ns: int, mid_step: bool = True) -> None:
        """The trainer stopped the worker at its end ``end_ns``, at ``stopped_ns`` (``mid_step``: inside a step, not
        between two or on its way to park): the freeze is due now, and booked then."""
        self.freeze_at_ns = end_ns
        self.stopped_ns = stopped_ns
        self.stopped_mid_step = mid_step

    def ends_past_grace(self, task: TaskRuntime, step_began_ns: int, end_ns: int) -> bool:
        """Whether ``task``'s step that began at ``step_began_ns`` (0: unknown) will run past ``end_ns`` + grace:
        a typical step of it (the median of its recent ones) would. Not a step that a freeze stopped before
        (its start says nothing of what is left of it), a probe or a setup (no step time known)."""
        if step_began_ns <= 0 or task.finishing_frozen_step or task.probing:
            return False
        typical = task.estimator.median_ns()
        return typical is not None and step_began_ns + typical > end_ns + self._grace_ns

    def arm_at_grant(self, deadline_ns: int, now_ns: int) -> None:
        """A grant until ``deadline_ns``: freeze ``grace`` after it, unless an earlier freeze is still due."""
        if self.freeze_at_ns == 0 or self.freeze_at_ns < now_ns:
            self.freeze_at_ns = deadline_ns + self._grace_ns

    def disarm(self) -> None:
        self.freeze_at_ns = 0
        self.stopped_ns = 0
        self.stopped_mid_step = True

    def due(self, now_ns: int) -> bool:
        return bool(self.freeze_at_ns) and now_ns >= self.freeze_at_ns

    def record(self, task: TaskRuntime, overrun_ns: int) -> None:
        """An overrun of ``task``'s step: counted, its length kept unless the step looks hung (``hung_overruns``)."""
        task.overruns += 1
        self._stats.overruns += 1
        if task.health.phase is StepPhase.HUNG:
            self._stats.hung_overruns += 1
        else:
            self._stats.overrun_ms.append(overrun_ns / MS)

    def clean_grant(self, task: TaskRuntime) -> None:
        """A grant that ended in time: a margin widened by earlier overruns shrinks back (1/8 a time)."""
        task.margin_ns -= task.margin_ns // 8

    def frozen(self, task: TaskRuntime) -> None:
        """Its step was frozen past the end: if its estimate was wrong (not a setup, a probe, or a step an
        earlier grant began and a freeze stopped, which its thawing grant did not size), widen its margin."""
        if task.known_step_ns is not None and not task.probing and not task.finishing_frozen_step:
            task.margin_before_freeze_ns = task.margin_ns
            task.margin_ns = min(self._max_margin_ns - self._margin_ns, max(task.margin_ns * 2, self._margin_ns))

    def freeze_running(self, now_ns: int, out: list[Action], stopped_ns: int = 0,
                       mid_step: bool = True) -> list[TaskRuntime]:
        """The freeze is due: freeze the worker still stepping past its bubble's end (+ grace) until its next
        grant (``stopped_ns``: the trainer stopped it then, and it is booked at that time; ``mid_step`` False: it
        stopped it between steps, which teaches the margin nothing). Returns the frozen tasks whose step has now
        used up ``step_timeout`` of granted time."""
        stuck = []
        at_ns = stopped_ns or now_ns
        bubbles = self._bubbles
        for bubble in (bubbles.closing, bubbles.open):
            if bubble is None or not bubble.running:
                continue
            task = self._tasks.by_id[bubble.running]
            if task.state != TaskState.RUNNING:
                continue
            latest = bubble.latest_deadline_ns
            if bubble is bubbles.open and not bubble.seen_end_ns and now_ns < latest + self._grace_ns:
                # (An open bubble whose end the trainer told is over: its freeze is the one armed at that end, which
                # for a step that will not end within the grace is the end itself, before this grace.)
                self.freeze_at_ns = latest + self._grace_ns
                continue
            end = bubble.end_ns or bubble.seen_end_ns or latest
            self.record(task, max(0, at_ns - end))
            # A freeze is how this grant's side task left the device: its park latency, from the end as this
            # core learned it (the wire, or the trainer's local event on this host). Without it, a trainer on
            # this host, whose ends now freeze steps at the real end + grace, left the figure nearly empty.
            learned = bubble.end_learned_ns
            if learned:
                self._stats.park_latency_ms.append(max(0, at_ns - learned) / MS)
            task.health.ran_past_end(max(0, at_ns - task.granted_at_ns), now_ns)
            self._stats.granted_ns += max(0, end - task.granted_at_ns)
            real_end = bubble.end_ns or bubble.seen_end_ns
            short = within_grace(task.known_step_ns, self._grace_ns)
            if mid_step and (not real_end or real_end >= bubble.sized_end_ns(real_end, short)):
                # A step running past the end the grant was sized to (the prediction, or the longer end it
                # was extended to while the bubble outlived it): its estimate (plus margin) was wrong. A
                # bubble that ended before that proves nothing about the step; widening for it made every
                # early end cost later grants (the schedules with short, jittery slots froze a 0.2 ms task
                # hundreds of times, and its margin grew until no step fitted a grant).
                self.frozen(task)
            # An open bubble whose end has not come stays open: its end may still arrive (late: a trainer
            # that reports ends after its next compute action, a delayed stream), and is then measured like
            # any other. Closing it here counted that end as rejected and lost the bubble from the slot
            # statistics. Its time is past, so nothing is granted in it.
            # Its report comes once a later grant thaws it; a bubble's first grant still measures the grant latency.
            task.frozen_first_grant = (task.grant_id, bubble.received_ns) if len(bubble.granted) == 1 else None
            bubbles.let_go(bubble)
            out.append(Freeze(task.task_id, stopped_ns))
            self._tasks.move(task, TaskState.FROZEN, "overran the bubble", out)
            if task.stopping:
                # Told to stop (a drain, an eviction) while it stepped: it runs on to its exit. Left frozen, nothing
                # thawed it (no grant comes to a task being stopped) and the stop timeout killed it, its work since
                # the last checkpoint lost: a drain beside a running job (a stranger's; a CI run's).
                out.append(Thaw(task.task_id))
            if task.health.stuck_ns >= self._step_timeout_ns:
                stuck.append(task)
        return stuck
