"""The pure scheduling core of a manager: ``on_event(event, now_ns) -> actions``.

No I/O, no threads, no clock of its own: the manager loop feeds it events (bubbles from the
trainer, messages and exits from workers, user requests, memory samples) with the current
monotonic time, and carries out the actions it returns (spawn, grant, park, freeze, stop, kill,
persist). Timers (freeze a worker that overran a bubble, kill a worker that ignores a stop) are
data too: :meth:`SchedulerCore.next_timer_ns` tells the loop when to call back.

Policy, in one place:

* **Memory.** The device budget is the minimum over recent iterations of (free memory reported +
  memory the side tasks held at that moment) minus a headroom, minus the caps of resident tasks. A
  task becomes resident (its process is spawned) only if its cap fits; when the budget shrinks
  below zero, parked tasks of the lowest priority are evicted (checkpointed and stopped). A task's
  usage is the larger of the device's figure for its processes and its worker's own report (the
  only figure where the device cannot see the worker's processes); over its cap it fails
  MEMORY_LIMIT. While the device cannot be read (a lost GPU, NVML failing), nothing is admitted.
* **Grants.** At each bubble one resident task is granted until the bubble's predicted end:
  priority first, then a frozen task that must finish its step (unless that step looks hung: then
  every other bubble), then a task whose step time is not known yet (one probe), then the task
  that has harvested least among those whose step fits (fair share), then the best fit of its
  high-percentile step time to the time left, then FIFO. When a worker parks early and time
  remains, the rest of the bubble goes to the next task.
  A task whose step (plus margin) fits no bubble seen so far is never granted and says why.
* **Ends.** The real bubble end parks the running worker after its current step (the loop sets the
  worker's ended-grant word before it sends the park; the worker reads it before each step). Where
  the trainer shares the host, the worker may stop on the trainer's own end before the manager learns
  of it (it parks with reason ``ended``): that bubble gets no more grants. A step still
  running ``grace`` past the real end (or past the predicted end, when no end has come) has the
  worker frozen with SIGSTOP until its next grant; each such overrun doubles that task's margin up
  to a bound. A step that holds grants for longer than ``step_timeout`` in total fails the task.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from freeride._manager.core.api import (
    MS,
    Action,
    BubbleEnded,
    BubbleStarted,
    CancelRequested,
    CheckpointRecorded,
    CoreConfig,
    DeviceMemorySampled,
    DeviceStatusChanged,
    DrainComplete,
    DrainRequested,
    Event,
    Freeze,
    Grant,
    Kill,
    LayoutChanged,
    Park,
    Released,
    ReleaseRequested,
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
from freeride._manager.estimator import StepEstimator, percentiles
from freeride.errors import InvalidTransition
from freeride.messages import (
    BubbleSlotStats,
    BubbleStart,
    FailureRecord,
    Percentiles,
    TaskSpec,
    TrainerLayout,
)
from freeride.states import TaskState, check_transition
from freeride.units import format_mib

log = logging.getLogger(__name__)


_RESIDENT_STATES = tuple(state for state in TaskState if state.is_resident)


# ====================================================================== state


@dataclass
class TaskRuntime:
    """What the core knows about one task."""

    task_id: str
    spec: TaskSpec
    seq: int
    state: TaskState = TaskState.SUBMITTED
    memory_bytes: int = 0
    pid: int = 0
    progress_unit: str = "steps"
    estimator: StepEstimator = field(default_factory=StepEstimator)
    margin_ns: int = 0
    grant_id: int = 0
    granted_at_ns: int = 0
    grant_bubble: tuple[int, int, int, int] | None = None
    stuck_ns: int = 0  # granted time spent inside one step that has not finished yet
    unfit_bubbles: int = 0  # bubbles in a row whose time its step estimate did not fit
    passed_over: int = 0  # bubbles given to others while this frozen task's step looked hung
    hung_since_ns: int = 0  # when its current step was first seen to look hung (0: it does not)
    in_setup: bool = False  # its worker was frozen inside setup() (from its board)
    has_stepped: bool = False  # its current process finished a step (setup is over)
    #: Its share clock: step time harvested here, raised on joining to the least among the resident
    #: tasks, so that a newcomer does not take every bubble until it has caught up (see _grant_next).
    share_ns: int = 0
    probing: bool = False  # the current grant learns the step time (setup, first step, re-probe)
    used_bytes: int = 0
    reported_bytes: int = 0  # the worker's own measure of its device memory
    baseline_bytes: int = 0  # of used_bytes, what the cap does not cover (the worker's libraries on CPU)
    host_bytes: int = 0  # on a GPU: the resident set of its processes on the host
    host_baseline_bytes: int = 0  # of host_bytes, what the cap does not cover (0: no host cap)
    steps: int = 0
    progress: float = 0.0
    harvested_ns: int = 0
    overruns: int = 0
    checkpoint_path: str = ""
    checkpoint_step: int = -1
    restarts: int = 0
    stopping: str = ""  # "", "evict", "drain", "release", "cancel", "fail"
    stop_deadline_ns: int = 0
    failure: FailureRecord | None = None
    pending_failure: FailureRecord | None = None
    finished_seen: bool = False
    from_queue: bool = False
    release_checkpoint: bool = True  # a release without it: the copy here is killed, not checkpointed

    @property
    def known_step_ns(self) -> int | None:
        return self.estimator.estimate_ns()


@dataclass
class OpenBubble:
    event: BubbleStart
    received_ns: int
    end_ns: int = 0  # real end, once known
    end_received_ns: int = 0
    granted: set[str] = field(default_factory=set)
    running: str = ""  # task id holding the bubble now
    #: ``paper`` policy: the predicted end that stands, whatever the real end says.
    fixed_deadline_ns: int = 0
    park_sent: bool = False
    #: The real end, as a worker saw it on a board before the end reached this core: the bubble is
    #: over, so nothing more is granted in it.
    seen_end_ns: int = 0

    @property
    def deadline_ns(self) -> int:
        if self.fixed_deadline_ns:
            return self.fixed_deadline_ns
        return self.end_ns or self.event.predicted_end_ns


@dataclass
class SlotStats:
    kind: str
    learned: bool = False
    lengths_ns: deque[int] = field(default_factory=lambda: deque(maxlen=1024))
    predicted_ns: deque[int] = field(default_factory=lambda: deque(maxlen=1024))
    abs_error_pct: deque[float] = field(default_factory=lambda: deque(maxlen=1024))
    count: int = 0
    min_free: int = -1


@dataclass
class CoreStats:
    bubbles: int = 0
    bubble_ns: int = 0
    granted_ns: int = 0
    harvested_ns: int = 0
    overruns: int = 0
    anomalies: int = 0
    layout_changes: int = 0
    #: Out-of-order events dropped: an end without its open start, an end before its start, a start
    #: older than the open bubble's. Counted with the rejected events in the manager's stats.
    ignored_events: int = 0
    overrun_ms: deque[float] = field(default_factory=lambda: deque(maxlen=10_000))
    grant_latency_ms: deque[float] = field(default_factory=lambda: deque(maxlen=10_000))
    park_latency_ms: deque[float] = field(default_factory=lambda: deque(maxlen=10_000))


# ====================================================================== core


class SchedulerCore:
    """Deterministic scheduler of one device. See the module docstring for the policy."""

    def __init__(self, config: CoreConfig | None = None) -> None:
        self.config = config or CoreConfig()
        self.tasks: dict[str, TaskRuntime] = {}
        self.bubble: OpenBubble | None = None
        self.stats = CoreStats()
        self.slots: dict[tuple[int, int, int], SlotStats] = {}
        self.draining = False
        #: Why the device cannot be read now ("" when it can): no task is admitted meanwhile.
        self.device_problem = ""
        #: The largest device context a worker of this device reported: a cap must leave room past it.
        self.context_bytes = 0
        #: The trainer's current layout, once one was reported.
        self.layout: TrainerLayout | None = None
        self._grant_seq = 0
        # (rank, iteration) -> min over that iteration of free + side-task usage at the time
        self._capacity_by_iteration: dict[tuple[int, int], int] = {}
        self._device_capacity: deque[int] = deque(maxlen=self.config.memory_window_iterations)
        self._longest_bubble_ns = 0
        self._freeze_at_ns = 0
        self._drain_announced = False
        self._paper = self.config.policy == "paper"
        self._next_poll_ns = 0
        # Every task, indexed by its state; kept by _transition and _on_TaskAdded. The paths that run
        # on every bubble event (grants, budgets, admission, timers) read only the states they need,
        # so a few hundred queued tasks do not cost each event a scan of all of them.
        self._by_state: dict[TaskState, dict[str, TaskRuntime]] = {state: {} for state in TaskState}
        # Admission is skipped while it cannot succeed: (waiting-set epoch, budget left after the
        # last pass). Every task a pass left waiting has a cap above that budget, so no pass admits
        # anything at a budget as small or smaller until a task joins the waiting set (a new epoch).
        self._waiting_epoch = 0
        self._admit_floor: tuple[int, int] | None = None
        # Tasks given a stop deadline (only _stop sets one); those whose deadline was cleared since
        # are pruned when the timers are next looked at.
        self._stop_timers: dict[str, TaskRuntime] = {}

    # ------------------------------------------------------------------ entry point

    def on_event(self, event: Event, now_ns: int) -> list[Action]:
        """Apply one event at time ``now_ns``; return the actions to carry out, in order."""
        out: list[Action] = []
        handler = getattr(self, f"_on_{type(event).__name__}")
        handler(event, now_ns, out)
        self._fire_timers(now_ns, out)
        self._admit(out)
        self._check_drain(out)
        return out

    def next_timer_ns(self) -> int | None:
        """The earliest time at which :meth:`on_event` with a :class:`Tick` has work to do."""
        times = [t.stop_deadline_ns for t in self._stop_timers.values() if t.stop_deadline_ns]
        if self._freeze_at_ns:
            times.append(self._freeze_at_ns)
        if self._next_poll_ns:
            times.append(self._next_poll_ns)
        return min(times) if times else None

    # ------------------------------------------------------------------ transitions

    def _transition(
        self,
        task: TaskRuntime,
        new: TaskState,
        reason: str,
        out: list[Action],
        failure: FailureRecord | None = None,
    ) -> None:
        """The one place a task changes state; terminal states cannot be left."""
        old = task.state
        if old == new:
            return
        check_transition(task.task_id, old, new)
        task.state = new
        del self._by_state[old][task.task_id]
        self._by_state[new][task.task_id] = task
        if new == TaskState.SUBMITTED:
            self._waiting_epoch += 1
        if failure is not None:
            task.failure = failure
        log.debug("[task=%s] %s -> %s (%s)", task.task_id, old.value, new.value, reason)
        out.append(StateChanged(task.task_id, old, new, reason, failure))

    # ------------------------------------------------------------------ bubbles

    def _on_BubbleStarted(self, event: BubbleStarted, now_ns: int, out: list[Action]) -> None:
        b = event.bubble
        if self.bubble is not None and b.start_ns < self.bubble.event.start_ns:
            # A stale start (an old iteration delivered late): the open bubble is the newer truth.
            self.stats.anomalies += 1
            self.stats.ignored_events += 1
            return
        if self.bubble is not None:
            # A start while another bubble is open: the trainer lost an end. Close it at this start.
            self.stats.anomalies += 1
            self._end_bubble(b.start_ns, now_ns, out, measured=False)
        self.stats.bubbles += 1
        self._longest_bubble_ns = max(self._longest_bubble_ns, b.predicted_ns)
        if b.free_memory_bytes >= 0:
            key = (b.rank, b.iteration)
            capacity = b.free_memory_bytes + self._resident_usage()
            old = self._capacity_by_iteration.get(key)
            self._capacity_by_iteration[key] = capacity if old is None else min(old, capacity)
            while len(self._capacity_by_iteration) > self.config.memory_window_iterations:
                del self._capacity_by_iteration[next(iter(self._capacity_by_iteration))]
            self._evict_if_over_budget(now_ns, out)
        slot = self.slots.get((b.stage, b.rank, b.slot))
        if slot is None and len(self.slots) < self.config.max_slots:
            slot = self.slots[(b.stage, b.rank, b.slot)] = SlotStats(kind=b.kind)
        if slot is not None:
            slot.kind = b.kind
            slot.learned = b.learned
            if b.free_memory_bytes >= 0:
                slot.min_free = b.free_memory_bytes if slot.min_free < 0 else min(slot.min_free, b.free_memory_bytes)
        self.bubble = OpenBubble(event=b, received_ns=event.received_ns)
        if self._paper:
            # The reference predicts start + the minimum profiled length, and acts at its next poll.
            length = self.config.paper_profile_ns.get((b.stage, b.slot), b.predicted_ns)
            self.bubble.fixed_deadline_ns = b.start_ns + length
            return
        self._grant_next(now_ns, out)

    def _on_BubbleEnded(self, event: BubbleEnded, now_ns: int, out: list[Action]) -> None:
        e = event.bubble
        if self.bubble is None or self.bubble.event.key != e.key:
            self.stats.anomalies += 1  # an end without its start: nothing to park
            self.stats.ignored_events += 1
            return
        if e.end_ns < self.bubble.event.start_ns:
            self.stats.anomalies += 1
            self.stats.ignored_events += 1
            return
        self.bubble.end_ns = e.end_ns
        self.bubble.end_received_ns = event.received_ns
        self._end_bubble(e.end_ns, now_ns, out, measured=True)

    def _end_bubble(self, end_ns: int, now_ns: int, out: list[Action], measured: bool) -> None:
        bubble = self.bubble
        assert bubble is not None
        start = bubble.event
        length = max(0, end_ns - start.start_ns)
        self.stats.bubble_ns += length
        slot = self.slots.get((start.stage, start.rank, start.slot))
        if measured and slot is not None:
            slot.count += 1
            slot.lengths_ns.append(length)
            slot.predicted_ns.append(start.predicted_ns)
            if length > 0:
                slot.abs_error_pct.append(abs(start.predicted_ns - length) * 100.0 / length)
        if bubble.running:
            task = self.tasks[bubble.running]
            if task.state == TaskState.RUNNING and not self._paper:  # the reference never sees real ends
                out.append(Park(task.task_id, task.grant_id, bubble.end_received_ns if measured else 0,
                                end_ns if measured else 0))
                # Grace counts from when the manager learns of the end: it cannot act before. The
                # overrun itself is still measured from the trainer's real end.
                self._freeze_at_ns = max(end_ns, now_ns) + self.config.grace_ns
            bubble.end_ns = end_ns
            bubble.end_received_ns = bubble.end_received_ns or now_ns
            # Keep the bubble record until the worker parks, so its overrun can be measured.
            self._closing = bubble
        self.bubble = None

    _closing: OpenBubble | None = None

    # ------------------------------------------------------------------ grants

    def _looks_hung(self, task: TaskRuntime) -> bool:
        """A frozen step that has run more granted time than two of the longest bubbles seen.

        It fits no bubble, so it is a step far longer than its estimate, or a hang. Setup and the
        first step of a process are expected to be long (a graph is generated, a model built): until
        the worker has finished a step (its park reports, or its board read when it was frozen),
        it never looks hung, and keeps the first turn until it finishes or times out. Not under the
        reference policy, whose behaviour the bench compares against.
        """
        if self._paper or not task.has_stepped or self._longest_bubble_ns <= 0:
            return False
        return task.stuck_ns > 2 * self._longest_bubble_ns

    def _hung_too_long(self, task: TaskRuntime, now_ns: int, out: list[Action]) -> bool:
        """Fail a step that has looked hung for ``step_timeout`` of wall time; True if it did.

        Granted only every other whole bubble, a hung step would take many times its step timeout
        of wall time to use up that much granted time (13 minutes for the default 60 s at a 20%
        bubble fraction, with an overrun into training at each of its bubbles).
        """
        if not task.hung_since_ns:
            task.hung_since_ns = now_ns
            return False
        if now_ns - task.hung_since_ns < self.config.step_timeout_ns:
            return False
        self._fail(task, FailureRecord(
            kind="STEP_TIMEOUT",
            message=(f"one step looked hung (more granted time than two of the longest bubbles) for "
                     f"{(now_ns - task.hung_since_ns) / 1e9:.1f} s without finishing; it ran for "
                     f"{task.stuck_ns / 1e9:.1f} s of granted time (limit {self.config.step_timeout_ns / 1e9:.1f} s "
                     "of either)"),
            step=task.steps,
        ), out)
        return True

    def _grant_next(self, now_ns: int, out: list[Action]) -> None:
        bubble = self.bubble
        if bubble is None or bubble.running or self.draining or bubble.seen_end_ns:
            return
        if self._closing is not None and self._closing.running:
            return  # the last bubble's worker is finishing its step: one task at a time
        remaining = bubble.deadline_ns - now_ns
        if remaining <= (0 if self._paper else self.config.margin_ns):
            return
        if not bubble.granted:
            for task in list(self._in_states(TaskState.FROZEN)):
                if not task.stopping and self._looks_hung(task):
                    self._hung_too_long(task, now_ns, out)
        best: tuple[tuple[int, ...], TaskRuntime] | None = None
        for task in self._in_states(TaskState.PARKED, TaskState.FROZEN):
            if task.state not in (TaskState.PARKED, TaskState.FROZEN) or task.stopping:
                continue
            if task.task_id in bubble.granted:
                continue
            margin = self.config.margin_ns + task.margin_ns
            est = task.known_step_ns
            frozen = task.state == TaskState.FROZEN
            # A frozen step is first to go on, unless it looks hung (see _looks_hung): then it gets
            # every other bubble, so that it can still finish or reach its step timeout while the
            # other tasks are not starved of every bubble until then; and only a whole bubble,
            # never the tail others left (a thaw there only runs it past the end, into training).
            hung = frozen and self._looks_hung(task)
            if hung and bubble.granted:
                continue
            thaw_rank = (0 if task.passed_over else 2) if hung else (0 if frozen else 1)
            if self._paper:
                # The reference grants the highest priority, FIFO on ties; the task itself decides
                # whether a step fits (1.2 x its median, see the worker runtime).
                paper_key = (-task.spec.priority, 0, 0, 0, task.seq)
                if best is None or paper_key < best[0]:
                    best = (paper_key, task)
                continue
            if not frozen and est is not None and est + margin > remaining:
                if len(bubble.granted) == 0:
                    task.unfit_bubbles += 1
                if task.unfit_bubbles < self.config.reprobe_after_bubbles:
                    continue
                est = None  # a re-probe: ranked like a task whose step time is unknown
            key = (
                -task.spec.priority,
                thaw_rank,
                0 if est is None else 1,
                # Fair share among equal tasks whose step fits: the one that has harvested least
                # goes first. Best fit alone (below) let the task with the longer step win every
                # bubble, and a shorter one at the same priority never ran; taking turns by grant
                # gave the shorter one the short bubbles and the other every long one.
                task.share_ns,
                remaining - (est or 0),
                task.seq,
            )
            if best is None or key < best[0]:
                best = (key, task)
        if best is None:
            return
        task = best[1]
        if not bubble.granted:
            for other in self._in_states(TaskState.FROZEN):
                if other is not task and not other.stopping and self._looks_hung(other):
                    other.passed_over += 1
        task.passed_over = 0
        thaw = task.state == TaskState.FROZEN
        probe = task.unfit_bubbles >= self.config.reprobe_after_bubbles and not self._paper
        task.unfit_bubbles = 0
        task.probing = probe or task.known_step_ns is None
        if probe:
            log.info("[task=%s] re-probing its step time", task.task_id)
            task.estimator = StepEstimator(hint_ns=0)
        self._grant_seq += 1
        task.grant_id = self._grant_seq
        task.granted_at_ns = now_ns
        task.grant_bubble = bubble.event.key
        bubble.granted.add(task.task_id)
        bubble.running = task.task_id
        self._transition(task, TaskState.RUNNING, "granted", out)
        margin_ns = 0 if self._paper else self.config.margin_ns + task.margin_ns
        out.append(Grant(task.task_id, task.grant_id, bubble.deadline_ns, margin_ns, thaw, probe,
                         rank=bubble.event.rank, bubble_start_ns=bubble.event.start_ns, bubble_key=bubble.event.key,
                         trainer_ends=not self._paper))
        if self._paper:
            return  # the reference never interrupts a running step
        if self._freeze_at_ns == 0 or self._freeze_at_ns < now_ns:
            self._freeze_at_ns = bubble.deadline_ns + self.config.grace_ns

    def _on_WorkerParked(self, event: WorkerParked, now_ns: int, out: list[Action]) -> None:
        task = self.tasks.get(event.task_id)
        if task is None:
            return
        task.estimator.extend(list(event.durations_ns[event.warmup_steps:]))
        harvested = sum(event.durations_ns)
        task.harvested_ns += harvested
        task.share_ns += harvested
        self.stats.harvested_ns += harvested
        task.progress = event.progress
        task.steps = event.total_steps
        if event.steps:
            task.stuck_ns = 0
            task.hung_since_ns = 0
            task.has_stepped = True
            task.in_setup = False
        if event.device_bytes:
            task.reported_bytes = event.device_bytes
            if task.state.is_resident and self._check_cap(task, out):
                return
        if event.grant_id != task.grant_id or task.state != TaskState.RUNNING:
            return  # a park for a grant that a freeze already closed; stats only
        bubble = self._bubble_of(task)
        self.stats.granted_ns += max(0, event.parked_ns - task.granted_at_ns)
        if bubble is not None:
            if (event.seen_end_ns and not bubble.end_ns and not self._paper
                    and bubble.event.start_ns <= event.seen_end_ns <= now_ns):
                # The worker saw the end on a board before the end reached this core: the bubble is over.
                # Its end event still comes, and is measured then; no backfill meanwhile.
                bubble.seen_end_ns = event.seen_end_ns
            # Only a bubble's first grant measures "bubble start received -> first step".
            if event.first_step_ns and len(bubble.granted) == 1:
                self.stats.grant_latency_ms.append((event.first_step_ns - bubble.received_ns) / MS)
            real_end = bubble.end_ns or bubble.seen_end_ns
            overrun = event.last_end_ns - real_end if real_end and event.steps else 0
            if overrun > 0:
                self._record_overrun(task, overrun)
            else:
                # A clean grant: let a margin widened by earlier overruns shrink back (1/8 a time).
                task.margin_ns -= task.margin_ns // 8
            # Parked by the end: the manager's park, or the trainer's end board read by the worker
            # (then usually before the end reached this core: 0). Without the second, a trainer on
            # this host left the figure empty.
            if bubble.end_ns and event.reason in ("park", "ended") and bubble.end_received_ns and not self._paper:
                self.stats.park_latency_ms.append(max(0, event.parked_ns - bubble.end_received_ns) / MS)
            bubble.running = ""
        self._transition(task, TaskState.PARKED, event.reason, out)
        if self._closing is bubble:
            self._closing = None
        self._freeze_at_ns = 0
        if self._paper:
            return  # no backfill: the next poll starts whatever bubble is open
        # Backfill the rest of this bubble, or start the bubble that opened while this step ran.
        self._grant_next(now_ns, out)

    def _bubble_of(self, task: TaskRuntime) -> OpenBubble | None:
        # Match on the holder, not the key: a duplicate start can open a bubble with the same key.
        for bubble in (self.bubble, self._closing):
            if bubble is not None and bubble.running == task.task_id:
                return bubble
        return None

    def _record_overrun(self, task: TaskRuntime, overrun_ns: int) -> None:
        task.overruns += 1
        self.stats.overruns += 1
        self.stats.overrun_ms.append(overrun_ns / MS)

    # ------------------------------------------------------------------ timers

    def _fire_timers(self, now_ns: int, out: list[Action]) -> None:
        if self._paper:
            self._paper_poll(now_ns, out)
        if self._freeze_at_ns and now_ns >= self._freeze_at_ns:
            self._freeze_at_ns = 0
            self._freeze_running(now_ns, out)
            # A bubble that opened while the frozen worker overran is free now: use what is left.
            self._grant_next(now_ns, out)
        for task in list(self._stop_timers.values()):
            if not task.stop_deadline_ns:
                del self._stop_timers[task.task_id]
            elif now_ns >= task.stop_deadline_ns:
                task.stop_deadline_ns = 0
                del self._stop_timers[task.task_id]
                log.warning("[task=%s] did not stop in time; killing it", task.task_id)
                out.append(Kill(task.task_id))

    def _paper_poll(self, now_ns: int, out: list[Action]) -> None:
        """The reference's scheduler thread, every ``poll_interval_ns``: pause a task whose bubble's
        predicted end has passed, then grant the bubble that has started (REFERENCE.md)."""
        if self._next_poll_ns == 0:
            self._next_poll_ns = now_ns + self.config.poll_interval_ns
            return
        if now_ns < self._next_poll_ns:
            return
        while self._next_poll_ns <= now_ns:
            self._next_poll_ns += self.config.poll_interval_ns
        for bubble in (self._closing, self.bubble):
            if bubble is None or not bubble.running or bubble.park_sent or now_ns < bubble.deadline_ns:
                continue
            task = self.tasks[bubble.running]
            if task.state == TaskState.RUNNING:
                bubble.park_sent = True
                out.append(Park(task.task_id, task.grant_id))
        bubble = self.bubble
        if bubble is not None and not bubble.granted and now_ns >= bubble.event.start_ns:
            self._grant_next(now_ns, out)

    def _freeze_running(self, now_ns: int, out: list[Action]) -> None:
        """A worker is still stepping past the end (+ grace): stop it until its next grant."""
        for bubble in (self._closing, self.bubble):
            if bubble is None or not bubble.running:
                continue
            task = self.tasks[bubble.running]
            if task.state != TaskState.RUNNING:
                continue
            if bubble is self.bubble and now_ns < bubble.deadline_ns + self.config.grace_ns:
                self._freeze_at_ns = bubble.deadline_ns + self.config.grace_ns
                continue
            end = bubble.end_ns or bubble.deadline_ns
            self._record_overrun(task, max(0, now_ns - end))
            task.stuck_ns += max(0, now_ns - task.granted_at_ns)
            self.stats.granted_ns += max(0, end - task.granted_at_ns)
            if task.known_step_ns is not None and not task.probing:
                # The estimate was wrong (not a setup or a probe): widen this task's margin.
                task.margin_ns = min(
                    self.config.max_margin_ns - self.config.margin_ns, max(task.margin_ns * 2, self.config.margin_ns)
                )
            bubble.running = ""
            if bubble is self._closing:
                self._closing = None
            # An open bubble whose end has not come stays open: its end may still arrive (late: a
            # trainer that reports ends after its next compute action, a delayed stream), and is then
            # measured like any other. Closing it here counted that end as rejected and lost the
            # bubble from the slot statistics. Its time is past, so nothing is granted in it.
            out.append(Freeze(task.task_id))
            self._transition(task, TaskState.FROZEN, "overran the bubble", out)
            if task.stuck_ns >= self.config.step_timeout_ns:
                self._fail(
                    task,
                    FailureRecord(
                        kind="STEP_TIMEOUT",
                        message=(
                            f"{'setup()' if task.in_setup else 'one step'} ran for {task.stuck_ns / 1e9:.1f} s "
                            f"of granted time without finishing (limit {self.config.step_timeout_ns / 1e9:.1f} s)"
                        ),
                        step=task.steps,
                    ),
                    out,
                )

    # ------------------------------------------------------------------ lifecycle events

    def _on_TaskAdded(self, event: TaskAdded, now_ns: int, out: list[Action]) -> None:
        if event.task_id in self.tasks:
            raise InvalidTransition(f"task {event.task_id} already exists")
        hint_ns = event.step_hint_ns or int(event.spec.step_time_hint_ms * MS)
        task = TaskRuntime(
            task_id=event.task_id,
            spec=event.spec,
            seq=event.seq,
            memory_bytes=event.spec.memory_bytes,
            estimator=StepEstimator(hint_ns=hint_ns),
            checkpoint_path=event.checkpoint_path,
            checkpoint_step=event.checkpoint_step,
            steps=event.steps,
            progress=event.progress,
            restarts=event.restarts,
            harvested_ns=event.harvested_ns,
            overruns=event.overruns,
            from_queue=event.from_queue,
        )
        self.tasks[task.task_id] = task
        self._by_state[TaskState.SUBMITTED][task.task_id] = task
        self._waiting_epoch += 1
        out.append(StateChanged(task.task_id, None, TaskState.SUBMITTED, "submitted"))

    def _on_CancelRequested(self, event: CancelRequested, now_ns: int, out: list[Action]) -> None:
        task = self.tasks.get(event.task_id)
        if task is None or task.state.is_terminal:
            return
        if task.state.is_resident:
            self._release_bubble(task)
            out.append(Kill(task.task_id))
        self._transition(task, TaskState.CANCELLED, "cancelled by user", out)

    def _on_DrainRequested(self, event: DrainRequested, now_ns: int, out: list[Action]) -> None:
        """Stop every resident task with a checkpoint; idempotent.

        Each request is answered: DrainComplete comes once nothing is resident, at once for a request
        that finds the device drained already (a second ``freeride drain``, or SIGTERM after a drain).
        Announcing it only once left every later waiter without an answer, and a manager that could not
        be stopped by SIGTERM after a drain.
        """
        self.draining = True
        self._drain_announced = False
        for task in list(self.tasks.values()):
            if task.state.is_resident and not task.stopping:
                self._stop(task, "drain", now_ns, out, checkpoint=task.state != TaskState.STARTING)
            elif task.from_queue and task.state == TaskState.SUBMITTED:
                self._leave(task, "the manager is draining", out)

    def _on_ReleaseRequested(self, event: ReleaseRequested, now_ns: int, out: list[Action]) -> None:
        task = self.tasks.get(event.task_id)
        if task is None or task.state.is_terminal or not task.from_queue:
            return
        self._release(task, event.reason, now_ns, out, event.checkpoint)

    def _on_LayoutChanged(self, event: LayoutChanged, now_ns: int, out: list[Action]) -> None:
        """Forget what was learned of the old layout's bubbles; evict what the new budget cannot hold.

        Dropped: the open bubble (its running task is parked), per-slot telemetry, the memory
        budget's window, the longest bubble seen and every task's count of bubbles it did not fit.
        A memory figure in the layout seeds the new window at once, standing in for an iteration
        until the new layout's own iterations replace it; without one, nothing is admitted until a
        figure arrives. Kept: side tasks' own step estimates (they describe the task, not the
        trainer) and the run's totals. A device with no stage in the new layout hands its cluster
        tasks back to the queue: it will see no bubbles.
        """
        layout = event.layout
        if layout.same_shape(self.layout):
            return
        log.info("trainer layout: %s (was %s)", layout.describe(), self.layout.describe() if self.layout else "-")
        self.layout = layout
        self.stats.layout_changes += 1
        if self.bubble is not None:
            self._end_bubble(max(layout.at_ns, self.bubble.event.start_ns), now_ns, out, measured=False)
        self.slots.clear()
        self._capacity_by_iteration.clear()
        self._device_capacity.clear()
        self._longest_bubble_ns = 0
        self._admit_floor = None
        for task in self.tasks.values():
            task.unfit_bubbles = 0
        if layout.free_memory_bytes >= 0:
            self._capacity_by_iteration[(-1, -1)] = layout.free_memory_bytes + self._resident_usage()
            self._evict_if_over_budget(now_ns, out)
        if not event.hosts_stage:
            for task in list(self.tasks.values()):
                if task.from_queue and not task.state.is_terminal and not task.stopping:
                    self._release(task, "no stage of the new layout runs on this device", now_ns, out, True)

    def _on_WorkerReady(self, event: WorkerReady, now_ns: int, out: list[Action]) -> None:
        task = self.tasks.get(event.task_id)
        if task is None or task.state != TaskState.STARTING:
            return
        task.pid = event.pid
        task.progress_unit = event.progress_unit
        task.baseline_bytes = event.baseline_bytes
        task.host_baseline_bytes, task.host_bytes = event.host_baseline_bytes, 0
        self.context_bytes = max(self.context_bytes, event.context_bytes)
        others = [t.share_ns for t in self._resident() if t is not task and t.state != TaskState.STARTING]
        task.share_ns = max(task.share_ns, min(others, default=0))
        self._transition(task, TaskState.PARKED, "worker ready", out)
        if self.bubble is not None:
            self._grant_next(now_ns, out)

    def _on_WorkerCheckpointed(self, event: WorkerCheckpointed, now_ns: int, out: list[Action]) -> None:
        task = self.tasks.get(event.task_id)
        if task is None:
            return
        task.checkpoint_path = event.path
        task.checkpoint_step = event.step
        out.append(CheckpointRecorded(task.task_id, event.step, event.path, event.progress))

    def _on_WorkerFinished(self, event: WorkerFinished, now_ns: int, out: list[Action]) -> None:
        task = self.tasks.get(event.task_id)
        if task is None or task.state.is_terminal:
            return
        task.steps = event.total_steps
        task.progress = event.progress
        task.finished_seen = True
        self._release_bubble(task)
        if task.state == TaskState.FROZEN:
            return  # cannot happen: a frozen worker sends nothing
        self._transition(task, TaskState.FINISHED, "done", out)
        if self.bubble is not None:
            self._grant_next(now_ns, out)

    def _on_WorkerFailed(self, event: WorkerFailed, now_ns: int, out: list[Action]) -> None:
        task = self.tasks.get(event.task_id)
        if task is None or task.state.is_terminal:
            return
        # The process exits right after this message; its exit record completes the failure.
        task.pending_failure = event.failure
        harvested = sum(event.durations_ns)
        task.harvested_ns += harvested
        self.stats.harvested_ns += harvested
        if event.total_steps >= 0:
            task.steps = max(task.steps, event.total_steps)
        if event.progress >= 0:
            task.progress = event.progress

    def _on_WorkerStepsSeen(self, event: WorkerStepsSeen, now_ns: int, out: list[Action]) -> None:
        task = self.tasks.get(event.task_id)
        if task is None or not task.state.is_resident:
            return
        task.in_setup = event.in_setup
        if event.steps_done > 0:
            task.has_stepped = True

    def _on_WorkerExited(self, event: WorkerExited, now_ns: int, out: list[Action]) -> None:
        task = self.tasks.get(event.task_id)
        if task is None:
            return
        task.stop_deadline_ns = 0
        task.pid = 0
        was_running = self._release_bubble(task)
        if task.state.is_terminal:
            task.stopping = ""
            # A task failed or cancelled mid-grant let go of its bubble when it was killed; now that
            # its process is gone, the rest of the bubble goes to the next task.
            if self.bubble is not None:
                self._grant_next(now_ns, out)
            return
        stopping, task.stopping = task.stopping, ""
        # A stop for eviction or drain that ended the process one way or another (clean exit after
        # its checkpoint, or killed because it was still starting or ignored the stop) loses at most
        # the work since the last checkpoint: the task goes back to be placed again.
        if stopping in ("evict", "drain", "release") and task.pending_failure is None:
            self._transition(task, TaskState.EVICTED, stopping, out)
            task.restarts += 1
            if task.from_queue:
                self._leave(task, stopping, out)
            else:
                self._transition(task, TaskState.SUBMITTED, "re-placement", out)
        else:
            failure = task.pending_failure
            if failure is None:
                failure = _exit_failure(event, event.step if event.step >= 0 else task.steps)
            elif not failure.log_tail:
                failure = FailureRecord(**{**failure.to_json(), "log_tail": event.log_tail})
            task.pending_failure = None
            if task.state == TaskState.STARTING and failure.kind == "EXIT" and stopping:
                failure = FailureRecord(**{**failure.to_json(), "message": failure.message + " while stopping"})
            self._transition(task, TaskState.FAILED, failure.kind, out, failure=failure)
        if was_running and self.bubble is not None:
            self._grant_next(now_ns, out)

    def _on_TaskMemorySampled(self, event: TaskMemorySampled, now_ns: int, out: list[Action]) -> None:
        task = self.tasks.get(event.task_id)
        if task is None or not task.state.is_resident:
            return
        task.used_bytes = event.used_bytes
        if event.host_bytes >= 0:
            task.host_bytes = event.host_bytes
        self._check_cap(task, out)

    def _check_cap(self, task: TaskRuntime, out: list[Action]) -> bool:
        """Fail a task whose usage (the device's figure or its own report) is over its cap; True if so.

        The cap covers what the task holds beyond its worker's baseline (reported with ``ready``:
        on a CPU core the interpreter and the task's libraries, on a GPU nothing). While the worker
        starts, that baseline is still being loaded and is not known: nothing runs then but imports
        and the constructor, and the cap is checked from ``ready`` on. On a GPU the same cap also
        bounds the task's host memory, beyond its worker's host baseline, as on a CPU core.
        """
        if task.state == TaskState.STARTING or task.stopping == "fail":
            return False
        used = max(task.used_bytes, task.reported_bytes) - task.baseline_bytes
        host = task.host_bytes - task.host_baseline_bytes if task.host_baseline_bytes else 0
        if used <= task.memory_bytes and host <= task.memory_bytes:
            return False
        beyond = hint = ""
        if used <= task.memory_bytes:  # its host memory, on a device whose own memory is capped apart
            used = host
            beyond = f" of host memory beyond its worker's {format_mib(task.host_baseline_bytes)} baseline"
            hint = " (libraries loaded in setup or a step count too)"
        elif task.baseline_bytes:
            beyond = f" beyond its worker's {format_mib(task.baseline_bytes)} baseline"
            hint = " (libraries first imported in setup or a step count too: import them at module level)"
        self._fail(
            task,
            FailureRecord(
                kind="MEMORY_LIMIT",
                message=f"used {format_mib(used)}{beyond}, over its cap of {format_mib(task.memory_bytes)}{hint}",
                step=task.steps,
            ),
            out,
        )
        return True

    def _on_DeviceMemorySampled(self, event: DeviceMemorySampled, now_ns: int, out: list[Action]) -> None:
        self._device_capacity.append(event.free_bytes + self._resident_usage())
        self._evict_if_over_budget(now_ns, out)

    def _on_DeviceStatusChanged(self, event: DeviceStatusChanged, now_ns: int, out: list[Action]) -> None:
        if event.problem and not self.device_problem:
            log.warning("device unreadable, admitting no task: %s", event.problem)
        self.device_problem = event.problem

    def _on_Tick(self, event: Tick, now_ns: int, out: list[Action]) -> None:
        pass

    # ------------------------------------------------------------------ helpers

    def _fail(self, task: TaskRuntime, failure: FailureRecord, out: list[Action]) -> None:
        """Fail a resident task now: kill its process; the exit only completes the record."""
        self._release_bubble(task)
        task.stopping = "fail"
        out.append(Kill(task.task_id))
        self._transition(task, TaskState.FAILED, failure.kind, out, failure=failure)

    def _stop(self, task: TaskRuntime, why: str, now_ns: int, out: list[Action], checkpoint: bool) -> None:
        task.stopping = why
        task.stop_deadline_ns = now_ns + self.config.stop_timeout_ns
        self._stop_timers[task.task_id] = task
        if task.state == TaskState.STARTING:
            out.append(Kill(task.task_id))
            return
        out.append(Stop(task.task_id, checkpoint=checkpoint))

    def _release(self, task: TaskRuntime, reason: str, now_ns: int, out: list[Action], checkpoint: bool) -> None:
        """A cluster task leaves: at once if it has no process, else once its process is gone."""
        log.info("[task=%s] releasing to the queue: %s", task.task_id, reason)
        task.release_checkpoint = checkpoint
        if task.state.is_resident:
            if task.stopping in ("release", "fail", "cancel"):
                return
            if not checkpoint:
                self._release_bubble(task)
                task.stopping = "release"
                out.append(Kill(task.task_id))
                return
            if not task.stopping:
                self._stop(task, "release", now_ns, out, checkpoint=task.state != TaskState.STARTING)
            else:
                task.stopping = "release"  # an eviction or drain under way ends the same way
            return
        if task.state in (TaskState.SUBMITTED, TaskState.EVICTED):
            self._leave(task, reason, out)

    def _leave(self, task: TaskRuntime, reason: str, out: list[Action]) -> None:
        """Forget a cluster task that has no process here; the loop hands it back to the queue."""
        del self.tasks[task.task_id]
        del self._by_state[task.state][task.task_id]
        self._stop_timers.pop(task.task_id, None)
        out.append(Released(
            task.task_id, reason, task.release_checkpoint, task.steps, task.progress, task.checkpoint_path,
            task.checkpoint_step, task.restarts, task.known_step_ns,
        ))

    def _release_bubble(self, task: TaskRuntime) -> bool:
        released = False
        for bubble in (self.bubble, self._closing):
            if bubble is not None and bubble.running == task.task_id:
                bubble.running = ""
                released = True
        if self._closing is not None and not self._closing.running:
            self._closing = None
        if released:
            self._freeze_at_ns = 0
        return released

    def _in_states(self, *states: TaskState) -> Iterator[TaskRuntime]:
        """The tasks now in any of ``states`` (from the state index: no scan of every task)."""
        for state in states:
            yield from self._by_state[state].values()

    def _resident(self) -> Iterator[TaskRuntime]:
        return self._in_states(*_RESIDENT_STATES)

    def _resident_usage(self) -> int:
        return sum(max(t.used_bytes, t.reported_bytes) for t in self._resident())

    def _resident_caps(self) -> int:
        return sum(t.memory_bytes for t in self._resident())

    def capacity_bytes(self) -> int | None:
        """Memory the side tasks may hold in all: recent minimum capacity minus headroom."""
        samples = list(self._capacity_by_iteration.values()) + list(self._device_capacity)
        if not samples:
            return None
        return max(0, min(samples) - self.config.headroom_bytes)

    def budget_bytes(self) -> int | None:
        """Memory left for a new resident task, or None before any memory figure arrived."""
        capacity = self.capacity_bytes()
        return None if capacity is None else capacity - self._resident_caps()

    def _admit(self, out: list[Action]) -> None:
        waiting = self._by_state[TaskState.SUBMITTED]
        if self.draining or not waiting or self.device_problem:
            return
        budget = self.budget_bytes()
        if budget is None:
            return
        floor = self._admit_floor
        if floor is not None and floor[0] == self._waiting_epoch and budget <= floor[1]:
            return  # nothing fitted at this budget or a larger one, and nobody new is waiting
        for task in sorted(waiting.values(), key=lambda t: (-t.spec.priority, t.seq)):
            if task.memory_bytes > budget:
                continue
            budget -= task.memory_bytes
            task.has_stepped = task.in_setup = False
            task.hung_since_ns = 0
            self._transition(task, TaskState.STARTING, "memory fits", out)
            out.append(Spawn(task.task_id, task.spec, task.memory_bytes, task.checkpoint_path))
        self._admit_floor = (self._waiting_epoch, budget)

    def _evict_if_over_budget(self, now_ns: int, out: list[Action]) -> None:
        budget = self.budget_bytes()
        if budget is None:
            return
        # Caps of tasks already stopping are on their way out: counting them again would evict more.
        budget += sum(t.memory_bytes for t in self._resident() if t.stopping)
        if budget >= 0:
            return
        victims = sorted(
            (t for t in self._in_states(TaskState.PARKED) if not t.stopping),
            key=lambda t: (t.spec.priority, -t.seq),
        )
        chosen: list[TaskRuntime] = []
        for task in victims:
            if budget >= 0:
                break
            chosen.append(task)
            budget += task.memory_bytes
        # A victim picked early (lowest priority, newest) may have been needed only until a larger one
        # was picked: keep, most important first, every victim whose cap the surplus still holds.
        for task in reversed(list(chosen)):
            if budget >= 0 and task.memory_bytes <= budget:
                chosen.remove(task)
                budget -= task.memory_bytes
        for task in chosen:
            log.info("[task=%s] evicting: device memory budget shrank", task.task_id)
            self._stop(task, "evict", now_ns, out, checkpoint=True)

    def _check_drain(self, out: list[Action]) -> None:
        if (
            self.draining
            and not self._drain_announced
            and not any(True for _ in self._resident())
        ):
            self._drain_announced = True
            out.append(DrainComplete())

    # ------------------------------------------------------------------ queries

    @property
    def longest_bubble_ns(self) -> int:
        """The longest bubble predicted since the start or the last layout change (0: none yet)."""
        return self._longest_bubble_ns

    def count_in(self, state: TaskState) -> int:
        return len(self._by_state[state])

    def waiting_reason(self, task: TaskRuntime) -> str:
        """Why a non-running task is not running, in one line."""
        if task.state == TaskState.SUBMITTED:
            budget = self.budget_bytes()
            if self.draining:
                return "the manager is draining"
            if self.device_problem:
                return f"the device cannot be read: {self.device_problem}"
            if budget is None:
                return "waiting for the first free-memory figure from the trainer or device"
            return (
                f"needs {task.memory_bytes / 2**20:.0f} MiB; the device budget has "
                f"{max(0, budget) / 2**20:.0f} MiB free"
            )
        if task.state == TaskState.PARKED:
            est = task.known_step_ns
            margin = self.config.margin_ns + task.margin_ns
            if est is not None and self._longest_bubble_ns and est + margin > self._longest_bubble_ns:
                left = max(0, self.config.reprobe_after_bubbles - task.unfit_bubbles)
                again = "" if self._paper else f"; its step time is measured again in {left} more bubbles"
                return (
                    f"its step ({est / MS:.1f} ms p95 + {margin / MS:.1f} ms margin) fits no bubble seen "
                    f"(longest {self._longest_bubble_ns / MS:.1f} ms){again}"
                )
            if self._longest_bubble_ns == 0:
                return "no bubble reported yet"
            return "waiting for a bubble"
        if task.state == TaskState.FROZEN:
            if task.in_setup:
                return "frozen in setup() after overrunning a bubble; resumes at its next grant"
            if task.hung_since_ns:
                return ("frozen in a step that looks hung (more granted time than two of the longest bubbles); "
                        "thawed every other bubble until it finishes or reaches its step timeout")
            return "frozen mid-step after overrunning a bubble; resumes at its next grant"
        return ""

    def slot_stats(self) -> list[BubbleSlotStats]:
        out = []
        for (stage, rank, slot), s in sorted(self.slots.items()):
            out.append(
                BubbleSlotStats(
                    stage=stage,
                    rank=rank,
                    slot=slot,
                    kind=s.kind,
                    count=s.count,
                    length_ms=_pct([v / MS for v in s.lengths_ns]),
                    predicted_ms=_pct([v / MS for v in s.predicted_ns]),
                    abs_error_pct=_pct(list(s.abs_error_pct)),
                    min_free_memory_bytes=s.min_free,
                    learned=s.learned,
                )
            )
        return out


def _pct(values: list[float] | deque[float]) -> Percentiles:
    return Percentiles(*percentiles(values))


def _exit_failure(event: WorkerExited, step: int) -> FailureRecord:
    if event.signal:
        import signal as _signal

        try:
            name = _signal.Signals(event.signal).name
        except ValueError:
            name = str(event.signal)
        return FailureRecord(
            kind="SIGNAL",
            message=f"worker died from signal {name}",
            signal=event.signal,
            step=step,
            log_tail=event.log_tail,
        )
    return FailureRecord(
        kind="EXIT",
        message=f"worker exited with code {event.exit_code} without reporting an error",
        exit_code=event.exit_code,
        step=step,
        log_tail=event.log_tail,
    )
