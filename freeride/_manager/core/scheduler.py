"""The scheduler of one device: ``on_event(event, now_ns) -> actions``, composed of the core's parts.

No I/O, no threads, no clock of its own: the manager loop feeds it events (bubbles from the trainer,
messages and exits from workers, user requests, memory samples) with the current monotonic time, and
carries out the actions it returns (spawn, grant, park, freeze, stop, kill, persist, and notes to log).
Timers (freeze a worker that overran a bubble, kill a worker that ignores a stop, the reference policy's
poll) are data too: :meth:`SchedulerCore.next_timer_ns` tells the loop when to call back.

Each event type has one handler (``_HANDLERS``, checked against the :data:`Event` union at import). After
the handler, every event lets due timers fire, admits what memory allows and announces a finished drain.
The rules live in the parts this module composes:

* ``tasks.py``: what the core knows of each task, and the one place a task changes state;
* ``bubbles.py``: the open and the closing bubble, and per-slot statistics;
* ``memory.py``: the device's budget, admission and eviction;
* ``grants.py``: who gets a bubble (pure rankings); ``steps.py``: when a step looks hung;
* ``overruns.py``: the freeze past a bubble's end and the margins overruns teach;
* ``stopping.py``: stopping a task's process (why, its timeout) and what its exit completes;
* ``policy.py``: what differs between the freeride policy and the reference system's;
* ``explain.py``: why a task waits; ``machines.py``: every lifecycle, declared.

A well-formed event never makes the core raise: one that does not apply in the state it finds (a stale
park, a duplicate submission, a message from a worker that was already stopped) changes nothing, or is
refused with a :class:`Note`.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable
from typing import Any

from freeride._estimator import StepEstimator
from freeride._manager.core import explain
from freeride._manager.core.api import (
    Action,
    BubbleEnded,
    BubbleStarted,
    CancelRequested,
    CheckpointRecorded,
    CoreConfig,
    CoreStats,
    DeviceMemorySampled,
    DeviceStatusChanged,
    DrainComplete,
    DrainRequested,
    Event,
    Kill,
    LayoutChanged,
    Note,
    NoteLevel,
    ReleaseRequested,
    Spawn,
    TaskAdded,
    TaskMemorySampled,
    Thaw,
    Tick,
    TrainerEndSeen,
    WorkerCheckpointed,
    WorkerExited,
    WorkerFailed,
    WorkerFinished,
    WorkerParked,
    WorkerReady,
    WorkerStepsSeen,
    WorkerUsage,
)
from freeride._manager.core.bubbles import Bubbles, OpenBubble, SlotStats
from freeride._manager.core.machines import DRAIN, BubblePhase, DrainPhase, StepPhase, StopPhase
from freeride._manager.core.memory import MemoryBudget, admissions, over_cap, victims
from freeride._manager.core.overruns import Overruns
from freeride._manager.core.policy import make_policy
from freeride._manager.core.stopping import Stopping
from freeride._manager.core.tasks import TaskRuntime, Tasks
from freeride.messages import RANK_LEFT_NS, RANK_LEFT_S, BubbleSlotStats, TrainerLayout
from freeride.states import TaskState
from freeride.units import counts_steps

MS = 1_000_000
# A trainer rank that sent this device no bubble event for RANK_LEFT_NS has left it (its run ended, or moved):
# the device no longer counts it as sharing (SchedulerCore._follows).
_PARKED, _RUNNING, _FROZEN = TaskState.PARKED, TaskState.RUNNING, TaskState.FROZEN
#: Slot indices below this may be quiet (:meth:`SchedulerCore.quiet_slots`): the end board's
#: (``freeride._boards.QUIET_SLOTS``; a test checks they agree). A trainer may number a slot 2**62.
QUIET_SLOTS = 1024
_SERVING, _DRAINING = DrainPhase.SERVING, DrainPhase.DRAINING


#: A trainer rank as the core tells it apart: its job (as its reporter's layout named it; "" unknown) and number.
_Rank = tuple[str, int]


def _rank_names(ranks: tuple[_Rank, ...]) -> dict[_Rank, str]:
    """How a message names each of ``ranks``: by number, and by job too where two jobs' ranks share a number."""
    numbers = [r[1] for r in ranks]
    clash = {n for n in numbers if numbers.count(n) > 1}
    return {r: f"{r[1]} (job {r[0] or 'unknown'})" if r[1] in clash else str(r[1]) for r in ranks}


class SchedulerCore:
    """Deterministic scheduler of one device. See the module docstring and the parts' for the policy."""

    def __init__(self, config: CoreConfig | None = None) -> None:
        self.config = config or CoreConfig()
        self.policy = make_policy(self.config)
        self.stats = CoreStats()
        self._tasks = Tasks()
        #: Every task by id (the loop reads it; only the core writes it).
        self.tasks: dict[str, TaskRuntime] = self._tasks.by_id
        self.bubbles = Bubbles(self.config.max_slots)
        self.memory = MemoryBudget(self.config.headroom_bytes, self.config.memory_window_iterations)
        self.overruns = Overruns(self.config, self.stats, self._tasks, self.bubbles)
        self.drain = DrainPhase.SERVING
        #: The largest device context a worker of this device reported: a cap must leave room past it.
        self.context_bytes = 0
        #: The trainer's current layout, once one was reported.
        self.layout: TrainerLayout | None = None
        self._grant_seq = 0
        #: Each trainer rank whose bubble events reached this device, by job and rank, and when it was last heard
        #: (:meth:`_follows`).
        self._ranks_heard: dict[_Rank, int] = {}
        #: The rank whose waits are this device's bubbles (None before any event), and its job's.
        self._followed: _Rank | None = None
        self.followed_rank: int | None = None
        self._quiet_key: tuple[int, int, int] | None = None  # quiet_slots()'s, as last computed
        self._quiet: tuple[int, bytes] | None = None
        #: Other ranks heard beside it within :data:`RANK_LEFT_NS`: while there are any, nothing is granted.
        self._sharing: tuple[_Rank, ...] = ()
        self.sharing_ranks: tuple[int, ...] = ()
        self.stopping = Stopping(self._tasks, self.bubbles, self.overruns, self.config.stop_timeout_ns)

    # ------------------------------------------------------------------ entry point

    def on_event(self, event: Event, now_ns: int) -> list[Action]:
        """Apply one event at time ``now_ns``; return the actions to carry out, in order."""
        out: list[Action] = []
        handler = _HANDLERS.get(type(event))
        if handler is None:
            raise TypeError(f"not a core event: {event!r}")
        handler(self, event, now_ns, out)
        self._fire_timers(now_ns, out)
        self._admit(out)
        if self.drain is _DRAINING and not any(True for _ in self._tasks.resident()):
            self._to_drain(DrainPhase.DRAINED)
            out.append(DrainComplete())
        return out

    def next_timer_ns(self) -> int | None:
        """The earliest time at which :meth:`on_event` with a :class:`Tick` has work to do."""
        times = []
        stop = self.stopping.next_deadline_ns()
        if stop is not None:
            times.append(stop)
        if self.overruns.freeze_at_ns:
            times.append(self.overruns.freeze_at_ns)
        poll = self.policy.next_timer_ns()
        if poll:
            times.append(poll)
        retry = self._retry_ns()
        if retry:
            times.append(retry)
        if self.sharing_ranks:  # when the device stops being shared, if no event comes (_update_ranks)
            heard = self._ranks_heard
            last = min((heard[r] for r in self._sharing if r in heard), default=None)
            times.append(0 if last is None else last + RANK_LEFT_NS + 1)  # (none heard: due at once)
        return min(times) if times else None

    def wants_trainer_events(self) -> bool:
        """Whether the trainer's events may decide something now: a bubble may be granted, or its end park or
        freeze a worker. Otherwise they only add to the statistics, and the loop may read them late
        (``loop.LAZY_READ_NS``): with no task resident, and with every resident task parked and its step
        (plus margins) longer than any bubble the trainer now makes (:meth:`Bubbles.reach_ns`) and no re-probe
        near. A stranger's task of 2.2 ms steps beside an interleaved trainer's 0.03-0.8 ms waits ran two steps
        in 60 iterations, and the managers' per-event work made those iterations 27% longer. A bubble read late
        is over (``loop.with_ends_known``): it still counts towards the re-probe (:meth:`_count_unfit`), and its
        free memory reaches the budget up to a lazy read later."""
        if any(True for _ in self._tasks.in_states(_RUNNING)):
            return True  # its bubble's end parks it
        need = self.need_ns()
        return need is not None and (need <= self.policy.grant_floor_ns or need <= self.bubbles.reach_ns())

    def need_ns(self) -> int | None:
        """The least time left in a bubble that some resident task could be granted now (:meth:`_fit_ns`, the least
        over them; the policy's floor where any bubble would do); None with no task resident."""
        floor = self.policy.grant_floor_ns
        need: int | None = None
        for task in self._tasks.resident():
            fit = self._fit_ns(task)
            if need is None or fit < need:
                need = fit
                if need <= floor:
                    break
        return need

    def quiet_slots(self) -> tuple[int, bytes] | None:
        """The followed rank and, one byte a slot index from 0, its slots that no resident task could use now
        (1: every slot of that index, of any stage, reaches less than :meth:`need_ns`; a slot not seen yet is
        not quiet). The trainer holds such a bubble's events back and sends them with a later one
        (:meth:`freeride._boards.EndBoard.quiet`): read at once, they would cost the manager a wake-up each
        on a core that may compute a rank, for nothing. None where no slot is quiet: no rank followed yet,
        ranks that share the device, no task resident (the loop reads late then), or one that any bubble
        would do for. Recomputed only when the need, the rank or a slot's reach changed."""
        rank = self.followed_rank
        need = self.need_ns()
        if rank is None or self.sharing_ranks or need is None or need <= self.policy.grant_floor_ns:
            return None
        key = (rank, need, self.bubbles.reach_version)
        if key != self._quiet_key:
            loud: set[int] = set()
            quiet: set[int] = set()
            for (_, slot_rank, slot), stats in self.bubbles.slots.items():
                if slot_rank == rank and 0 <= slot < QUIET_SLOTS:
                    (loud if stats.reach_ns >= need else quiet).add(slot)
            quiet -= loud
            flags = bytearray(max(quiet) + 1 if quiet else 0)
            for slot in quiet:
                flags[slot] = 1
            self._quiet_key, self._quiet = key, (rank, bytes(flags))
        return self._quiet

    def _fit_ns(self, task: TaskRuntime) -> int:
        """The least time left in a bubble that ``task`` could be granted (``grants.rank``): its step plus margins,
        or just the policy's floor where any would do (starting, frozen: a thaw fits any; being stopped; step not
        known yet; a re-probe near; a policy that does not size steps). A task holding a bubble counts as
        parked: its next grant is what it needs."""
        floor = self.policy.grant_floor_ns
        est = task.known_step_ns
        if (task.state is not _PARKED and task.state is not _RUNNING) or task.stopping or est is None \
                or not self.policy.fits_steps:
            return floor
        health = task.health
        if self.policy.reprobes and health.unfit_bubbles + 1 >= health.reprobe_after(self.config.reprobe_after_bubbles):
            return floor
        return max(floor, est + self.config.margin_ns + task.margin_ns)

    def wants_tick(self, now_ns: int) -> bool:
        """Whether a :class:`Tick` now has anything to do: a timer due, a frozen step that may look hung, ranks
        that share the device, tasks waiting for admission, a drain. The loop feeds one only then: a tick at
        each of its turns cost its thread ~4 us each, seven turns a bubble."""
        if self._tasks.frozen or self.sharing_ranks or self._tasks.submitted or self.drain is not _SERVING:
            return True
        due = self.next_timer_ns()
        return due is not None and due <= now_ns

    def _retry_ns(self) -> int:
        """When the open bubble, ungranted for want of time, is offered again (0: not armed)."""
        bubble = self.bubbles.open
        if bubble is None or not bubble.retry_at_ns or bubble.running or bubble.end_ns or bubble.seen_end_ns:
            return 0
        return bubble.retry_at_ns

    def next_freeze_ns(self) -> int | None:
        """When a step still running is frozen (one of :meth:`next_timer_ns`'s times), if one is armed."""
        return self.overruns.freeze_at_ns or None

    # ------------------------------------------------------------------ queries

    @property
    def draining(self) -> bool:
        return self.drain is not _SERVING

    @property
    def device_problem(self) -> str:
        """Why the device cannot be read now ("" when it can): no task is admitted meanwhile."""
        return self.memory.problem

    @property
    def bubble(self) -> OpenBubble | None:
        """The open bubble."""
        return self.bubbles.open

    @property
    def slots(self) -> dict[tuple[int, int, int], SlotStats]:
        return self.bubbles.slots

    @property
    def longest_bubble_ns(self) -> int:
        """The longest bubble predicted since the start or the last layout change (0: none yet)."""
        return self.bubbles.longest_ns

    def count_in(self, state: TaskState) -> int:
        return self._tasks.count_in(state)

    def capacity_bytes(self) -> int | None:
        """Memory the side tasks may hold in all: recent minimum capacity minus headroom."""
        return self.memory.capacity_bytes()

    def budget_bytes(self) -> int | None:
        """Memory left for a new resident task, or None before any memory figure arrived."""
        return self.memory.budget_bytes(sum(t.memory_bytes for t in self._tasks.resident()))

    def waiting_reason(self, task: TaskRuntime, now_ns: int = 0) -> str:
        """Why a non-running task is not running, in one line (``now_ns``: the loop's clock, 0: not known)."""
        last = self.bubbles.last_start_ns
        return explain.waiting_reason(task, explain.Circumstances(
            draining=self.draining, device_problem=self.memory.problem, budget_bytes=self.budget_bytes(),
            longest_bubble_ns=self.bubbles.longest_ns, margin_ns=self.config.margin_ns,
            reprobe_after_bubbles=self.config.reprobe_after_bubbles, reprobes=self.policy.reprobes,
            sharing_ranks=self.shared_by, since_bubble_ns=max(0, now_ns - last) if now_ns and last else 0,
            shared_quiet_ns=self.shared_quiet_ns(now_ns) if now_ns else 0, drained=self.drain is DrainPhase.DRAINED,
        ))

    @property
    def shared_by(self) -> tuple[int, ...]:
        """The trainer ranks that share this device now, the followed one first; empty while one reports."""
        if self.followed_rank is None or not self.sharing_ranks:
            return ()
        return (self.followed_rank, *self.sharing_ranks)

    def shared_quiet_ns(self, now_ns: int) -> int:
        """While ranks share the device: how long since any of them sent an event (0 otherwise). A job that ended
        leaves its device shared until :data:`RANK_LEFT_NS` of quiet; what says so says it in the past tense."""
        if self._followed is None or not self._sharing:
            return 0
        heard = self._ranks_heard
        times = [heard[r] for r in (self._followed, *self._sharing) if r in heard]
        return max(0, now_ns - max(times)) if times else 0

    def slot_stats(self) -> list[BubbleSlotStats]:
        return self.bubbles.slot_stats()

    # ------------------------------------------------------------------ bubbles

    def _follows(self, rank: int, job: str, now_ns: int, out: list[Action]) -> bool:
        """Whether a bubble event of ``rank`` of the trainer run ``job`` is one of this device's bubbles.

        A device is idle only while every trainer rank on it waits. The core follows one rank's waits (the
        first it heard; another once that one has been silent for :data:`RANK_LEFT_NS`, or after a new run's
        layout): a second rank's starts and ends, taken as the device's, would close the first rank's bubbles
        as lost ends, and their real ends then count as out of order (a stranger's 4 ranks on 2 CPU devices: a
        quarter of the events rejected). The others' events are counted (``other_rank_events``) and otherwise
        ignored, and while any other rank shares the device nothing is granted (:meth:`grant_next`) and its
        waits are not counted as the device's bubble time: one rank's wait there is another's compute, which a
        side task would slow. (A bubble granted before the second rank was first heard runs to its end.) Said
        in the log when it starts and when it ends (:meth:`_update_ranks`, also on ticks: a device is no longer
        shared 5 s after the other rank's last event, whether bubbles come or not).

        A rank is told apart by its job too (the job its reporter's layout named on that connection, "" where
        none did): two jobs run at once on the same managers both have a rank 0, and a stranger's two jobs' events
        were taken for one rank's, mixed into one set of slots and granted while the other job computed. An event
        of an unknown job is the known one's of its rank number (a trainer that reports no layout, or an event that
        came another way than its layout)."""
        heard = self._ranks_heard
        key = (job, rank)
        if key not in heard:
            key = self._same_rank(key)
        heard[key] = now_ns
        if len(heard) == 1 and key == self._followed:
            return True  # the usual case: one rank per device
        self._update_ranks(now_ns, out, key)
        if key == self._followed:
            return True
        self.stats.other_rank_events += 1
        return False

    def _same_rank(self, key: _Rank) -> _Rank:
        """The rank heard already that ``key`` is, where one's job or the other's is unknown ("") and their rank
        numbers agree (a job learnt replaces the unknown one in the key); else ``key``."""
        job, rank = key
        for other in self._ranks_heard:
            if other[1] != rank or (job and other[0]):
                continue
            if job:  # the rank's job is known now: its key says so from here on
                self._ranks_heard[key] = self._ranks_heard.pop(other)
                if self._followed == other:
                    self._followed = key
                self._sharing = tuple(key if k == other else k for k in self._sharing)
                return key
            return other
        return key

    def _update_ranks(self, now_ns: int, out: list[Action], arriving: _Rank | None = None) -> None:
        """Forget the ranks silent for :data:`RANK_LEFT_NS`; the followed rank, once gone, is the ``arriving``
        one's; say when the device starts or stops being shared (:meth:`_follows`)."""
        heard = self._ranks_heard
        for other, at in list(heard.items()):
            if now_ns - at > RANK_LEFT_NS:
                del heard[other]
        if self._followed not in heard:
            self._followed = arriving
        followed = self._followed
        self.followed_rank = followed[1] if followed is not None else None
        sharing = tuple(sorted(r for r in heard if r != followed)) if followed is not None else ()
        if sharing == self._sharing:
            return
        if followed is not None and sharing and not self._sharing:
            name = _rank_names((followed, *sharing))
            out.append(Note(NoteLevel.WARNING, (
                f"trainer ranks {name[followed]} and {', '.join(name[r] for r in sharing)} report bubbles to this "
                "device: it is idle only while all of them wait, which freeride does not follow, so it grants nothing "
                f"here while they share it (run one pipeline rank per device to harvest it); rank {name[followed]}'s "
                "waits are measured, the others' events are counted and ignored")))
        elif not sharing:
            alone = (f"only trainer rank {followed[1]} reports bubbles to it now" if followed is not None
                     and followed in heard else f"no trainer rank has reported for {RANK_LEFT_S} s")
            out.append(Note(NoteLevel.WARNING, f"this device is no longer shared by trainer ranks ({alone}): its "
                                               "bubbles are granted again"))
        self._sharing = sharing
        self.sharing_ranks = tuple(r[1] for r in sharing)

    def _on_bubble_started(self, event: BubbleStarted, now_ns: int, out: list[Action]) -> None:
        b = event.bubble
        if not self._follows(b.rank, event.job, now_ns, out):
            return
        current = self.bubbles.open
        if current is not None and b.start_ns < current.event.start_ns:
            # A stale start (an old iteration delivered late): the open bubble is the newer truth.
            self.stats.anomalies += 1
            self.stats.ignored_events += 1
            return
        if current is not None:
            # A start while another bubble is open: the trainer lost an end. Close it at this start.
            self.stats.anomalies += 1
            self._end_bubble(current, b.start_ns, now_ns, out, measured=False)
        self.stats.bubbles += 1
        if b.free_memory_bytes >= 0:
            self.memory.sample_iteration((b.rank, b.iteration), b.free_memory_bytes + self._resident_usage())
            self._evict_if_over_budget(now_ns, out)
        bubble = self.bubbles.start(b, event.received_ns)
        if event.end_ns:
            # Over already: a grant would only thaw a worker to freeze it again, and count an overrun.
            self.bubbles.saw_end(bubble, event.end_ns)
            self._count_unfit(event.end_ns - b.start_ns)
        self.policy.bubble_opened(self, bubble, now_ns, out)

    def _on_bubble_ended(self, event: BubbleEnded, now_ns: int, out: list[Action]) -> None:
        e = event.bubble
        if not self._follows(e.rank, event.job, now_ns, out):
            return
        bubble = self.bubbles.open
        if bubble is None or bubble.event.key != e.key or e.end_ns < bubble.event.start_ns:
            # An end without its start (nothing to park), or before its start.
            self.stats.anomalies += 1
            self.stats.ignored_events += 1
            return
        bubble.end_ns = e.end_ns
        bubble.end_received_ns = event.received_ns
        self._end_bubble(bubble, e.end_ns, now_ns, out, measured=True)

    def _on_trainer_end_seen(self, event: TrainerEndSeen, now_ns: int, out: list[Action]) -> None:
        task = self.tasks.get(event.task_id)
        if task is None or task.grant_id != event.grant_id or task.state != _RUNNING:
            return  # the grant is over already (parked, frozen, failed): nothing runs past this end
        bubble = self.bubbles.held_by(task.task_id)
        if bubble is None or not bubble.event.start_ns <= event.end_ns <= now_ns:
            return
        self.policy.end_seen(self, bubble, event.end_ns, now_ns, event.step_began_ns, event.stopped_ns)

    def _end_bubble(self, bubble: OpenBubble, end_ns: int, now_ns: int, out: list[Action], measured: bool) -> None:
        length = self.bubbles.measure_end(bubble, end_ns, measured, shared=bool(self.sharing_ranks))
        if not self.sharing_ranks:  # a rank's wait on a shared device is not the device's idle time (_follows)
            self.stats.bubble_ns += length
        else:
            self.stats.shared_bubbles += 1
        if bubble.running:
            self.policy.bubble_ended(self, bubble, self.tasks[bubble.running], end_ns, measured, now_ns, out)
        self.bubbles.close(bubble, end_ns, now_ns)

    # ------------------------------------------------------------------ grants

    def grant_next(self, now_ns: int, out: list[Action]) -> None:
        """Grant the open bubble to the best candidate (``grants.py``), if it has time left and nobody holds it."""
        bubble = self.bubbles.open
        if bubble is None or bubble.running or self.drain is not _SERVING or self.sharing_ranks:
            return
        if bubble.phase is not BubblePhase.OPEN:
            return  # a worker saw its end on a board
        closing = self.bubbles.closing
        if closing is not None and closing.running:
            return  # the last bubble's worker is finishing its step: one task at a time
        bubble.retry_at_ns = 0
        remaining = bubble.deadline_at(now_ns) - now_ns
        if remaining <= self.policy.grant_floor_ns:
            self._retry_later(bubble, now_ns)
            return
        granted = bubble.granted
        first = not granted
        longest = self.bubbles.longest_ns
        if first:
            self._fail_hung_too_long(now_ns, out)
        ranking = self.policy.rank(self._tasks.grantable(), granted, remaining, longest)
        task = ranking.best
        if first and not bubble.ranked:
            for unfit in ranking.unfit:  # once a bubble, however often it is offered again
                unfit.health.unfit_bubbles += 1
            if task is not None:
                self._count_outranked(task, ranking.unfit)
        bubble.ranked = True
        if task is None:
            if ranking.unfit:
                self._retry_later(bubble, now_ns)
            return
        if first:
            # The steps that look hung, and long setups and first steps (StepHealth.takes_turns), share one first
            # turn (each took its own, and two of them took every bubble between them while the healthy tasks
            # waited out the step timeout), due once the others have had as much bubble time since
            # (StepHealth.hung_turn_due).
            hung = [other for other in self._tasks.frozen.values()
                    if not other.stopping and other.health.takes_turns(longest, other.known_step_ns)]
            if task not in hung:
                for other in hung:
                    other.health.passed_over_ns += remaining
                task.health.turn_ns, task.health.passed_over_ns = remaining, 0
            elif task.health.hung_turn_due:  # a turn, shared; a bubble no other task could use is no turn
                for other in hung:
                    other.health.turn_ns, other.health.passed_over_ns = remaining, 0
        task.health.unfit_bubbles = 0
        task.health.outranked_bubbles = task.health.outranked_by_priority = 0
        thaw = task.state is _FROZEN
        task.finishing_frozen_step = thaw
        probe = ranking.reprobe
        task.probing = probe or task.known_step_ns is None
        if probe:
            task.health.reprobes += 1
        elif not thaw and not task.probing:
            task.health.reprobes = 0  # its known step fitted this bubble
        if probe:
            out.append(Note(NoteLevel.INFO, "re-probing its step time", task.task_id))
            task.estimator = StepEstimator(hint_ns=0)
        self._grant_seq += 1
        task.grant_id = self._grant_seq
        task.granted_at_ns = now_ns
        task.grant_bubble = bubble.event.key
        granted.add(task.task_id)
        bubble.running = task.task_id
        self._tasks.move(task, _RUNNING, "granted", out)
        grant = self.policy.grant(self, task, bubble, thaw, probe, now_ns)
        out.append(dataclasses.replace(grant, late=True) if first and bubble.offered_again else grant)

    def _count_outranked(self, winner: TaskRuntime, unfit: tuple[TaskRuntime, ...]) -> None:
        """A bubble's first grant goes to ``winner``: every other candidate whose step fitted it was outranked
        once more (in a row: a grant starts its count again), by priority or not. A task that sat parked while
        others of a higher priority took every bubble read only "waiting for a bubble"."""
        for other in self._tasks.grantable():
            if other is winner or other.stopping or other in unfit:
                continue
            other.health.outranked_bubbles += 1
            other.health.outranked_by_priority += winner.spec.priority > other.spec.priority

    def _retry_later(self, bubble: OpenBubble, now_ns: int) -> None:
        """No step fits what the open bubble has left: try again once it has outlived one more of its slot's
        lengths and its deadline moves out far enough for the shortest candidate's step
        (``OpenBubble.next_chance_ns``, :meth:`_fit_ns`), if any. Not at each length it outlives: a task whose
        step fits none of them woke the loop up to ``SURVIVAL_LENGTHS`` times a bubble for nothing."""
        need = min((self._fit_ns(task) for task in self._tasks.grantable() if not task.stopping), default=None)
        if need is not None:
            bubble.retry_at_ns = bubble.next_chance_ns(now_ns, need)

    def _count_unfit(self, length_ns: int) -> None:
        """A bubble over before it could be offered (read late: a lazy read, or a loop that fell behind): each
        parked task whose step would not have fitted it counts it, as a ranking counts the bubbles it offers
        (``grants.rank``), so that a step that fits no bubble is re-probed however its bubbles are read."""
        if not self.policy.reprobes:
            return
        margin = self.config.margin_ns
        for task in self._tasks.parked.values():
            est = task.known_step_ns
            if est is not None and not task.stopping and est + margin + task.margin_ns > length_ns:
                task.health.unfit_bubbles += 1

    def _fail_hung_too_long(self, now_ns: int, out: list[Action]) -> None:
        """At a bubble's first grant, and at each tick: fail each frozen step that has looked hung for
        ``step_timeout`` of wall time while the trainer made bubbles (``StepHealth.hung_too_long``).

        Counted from when it first looked hung, until it finishes: a step asleep in a hang is made runnable by
        every stop and continue, and on a busy core reads as waiting for its core at most freezes, which takes
        those grants off its stuck time; judged only while it looked hung again, a stranger's step hung in a sleep
        was failed after 8.5 s of a 5 s step timeout, 27 s after it hung."""
        timeout = self.config.step_timeout_ns
        longest, last = self.bubbles.longest_ns, self.bubbles.last_start_ns
        for task in list(self._tasks.frozen.values()):
            health = task.health
            if (not task.stopping
                    and (health.phase is StepPhase.HUNG or health.looks_hung(longest, task.known_step_ns))
                    and health.hung_too_long(now_ns, timeout, last)):
                self.stopping.fail(task, health.hung_failure(timeout, health.step_reached(task.steps)), out)

    def _on_worker_parked(self, event: WorkerParked, now_ns: int, out: list[Action]) -> None:
        task = self.tasks.get(event.task_id)
        if task is None:
            return
        task.finishing_frozen_step = False  # the worker is back at its loop: any frozen step is done
        # The estimate learns what each step cost, not what the device's other users added to it.
        samples = event.costs_ns if len(event.costs_ns) == len(event.durations_ns) else event.durations_ns
        task.estimator.extend(list(samples[event.warmup_steps:]))
        harvested = event.harvested_ns
        task.harvested_ns += harvested
        task.share_ns += harvested
        self.stats.harvested_ns += harvested
        task.progress = event.progress
        task.steps = event.total_steps
        if event.steps:
            task.health.finished_steps()
        late = task.frozen_first_grant
        if late is not None and late[0] == event.grant_id:
            # The report of a bubble's first grant that a freeze closed (on cpu:N the trainer stops a worker still
            # holding its bubble at the end: most grants end so there): its first step measures as a park would.
            task.frozen_first_grant = None
            if event.first_step_ns:
                self.stats.grant_latency_ms.append((event.first_step_ns - late[1]) / MS)
        if event.grant_id != task.grant_id or task.state != _RUNNING:
            return  # a park for a grant that a freeze already closed; stats only
        bubble = self.bubbles.held_by(task.task_id)
        self.stats.granted_ns += max(0, event.parked_ns - task.granted_at_ns)
        if bubble is not None:
            self.policy.park_seen(self, bubble, event, now_ns)
            # Only a bubble's first grant measures "bubble start received -> first step".
            if event.first_step_ns and len(bubble.granted) == 1:
                self.stats.grant_latency_ms.append((event.first_step_ns - bubble.received_ns) / MS)
            real_end = bubble.end_ns or bubble.seen_end_ns
            overrun = event.last_end_ns - real_end if real_end and event.steps else 0
            if overrun > 0:
                self.overruns.record(task, overrun)
            else:
                self.overruns.clean_grant(task)
            self.bubbles.let_go(bubble)
        self._tasks.move(task, _PARKED, event.reason, out)
        self.overruns.disarm()
        self.policy.parked(self, now_ns, out)

    # ------------------------------------------------------------------ timers

    def _fire_timers(self, now_ns: int, out: list[Action]) -> None:
        self.policy.poll(self, now_ns, out)
        retry = self._retry_ns()
        if retry and now_ns >= retry and self.bubbles.open is not None:
            # The bubble outlived its slot's next length with no end known: what it has left grew. The timer is
            # spent whatever comes of it (grant_next arms the next one where nothing fits; a worker still
            # finishing the last bubble's step backfills this one when it parks).
            self.bubbles.open.offered_again = True
            self.bubbles.open.retry_at_ns = 0
            self.grant_next(now_ns, out)
        freeze_at = self.overruns.freeze_at_ns
        if freeze_at and now_ns >= freeze_at:
            stopped, mid_step = self.overruns.stopped_ns, self.overruns.stopped_mid_step
            self.overruns.disarm()
            for stuck in self.overruns.freeze_running(now_ns, out, stopped, mid_step):
                stuck.health.verdict_due = True  # judged on this freeze's board read (_on_worker_steps_seen)
            # A bubble that opened while the frozen worker overran is free now: use what is left.
            self.grant_next(now_ns, out)
        if self.stopping.timers:
            self.stopping.fire(now_ns, out)

    # ------------------------------------------------------------------ requests

    def _on_task_added(self, event: TaskAdded, now_ns: int, out: list[Action]) -> None:
        if event.task_id in self.tasks:
            out.append(Note(NoteLevel.WARNING, "refused: a task with this id exists already", event.task_id))
            return
        self._tasks.add(TaskRuntime.added(event), out)

    def _on_cancel_requested(self, event: CancelRequested, now_ns: int, out: list[Action]) -> None:
        task = self.tasks.get(event.task_id)
        if task is None or task.state.is_terminal:
            return
        if task.state.is_resident:
            self.stopping.let_go(task)
            out.append(Kill(task.task_id))
        self._tasks.move(task, TaskState.CANCELLED, "cancelled by user", out)

    def _on_drain_requested(self, event: DrainRequested, now_ns: int, out: list[Action]) -> None:
        """Stop every resident task with a checkpoint; idempotent.

        Each request is answered: DrainComplete comes once nothing is resident, at once for a request that
        finds the device drained already (a second ``freeride drain``, or SIGTERM after a drain). Announcing
        it only once left every later waiter without an answer, and a manager that could not be stopped by
        SIGTERM after a drain.
        """
        self._to_drain(DrainPhase.DRAINING)
        for task in list(self.tasks.values()):
            if task.state.is_resident and not task.stopping:
                self.stopping.stop(task, StopPhase.DRAIN, now_ns, out, checkpoint=task.state != TaskState.STARTING)
            elif task.from_queue and task.state == TaskState.SUBMITTED:
                self.stopping.leave(task, "the manager is draining", out)

    def _on_release_requested(self, event: ReleaseRequested, now_ns: int, out: list[Action]) -> None:
        task = self.tasks.get(event.task_id)
        if task is None or task.state.is_terminal or not task.from_queue:
            return
        self.stopping.release(task, event.reason, now_ns, out, event.checkpoint)

    def _on_layout_changed(self, event: LayoutChanged, now_ns: int, out: list[Action]) -> None:
        """Put away what was learned of the old layout's bubbles; evict what the new budget cannot hold.

        Dropped: the open bubble (its running task is parked), the memory budget's window and every task's
        count of bubbles it did not fit. Put away: per-slot telemetry and the longest bubble seen, kept by
        shape for the job's last few layouts and given back when a shape returns
        (:meth:`Bubbles.change_layout`). A memory figure in the layout seeds the new window at once,
        standing in for an iteration until the new layout's own iterations replace it; without one, nothing
        is admitted until a figure arrives. Kept: side tasks' own step estimates (they describe the task,
        not the trainer) and the run's totals. A device with no stage in the new layout hands its cluster
        tasks back to the queue: it will see no bubbles. The same layout again from the same job changes
        nothing; from another job (the trainer run again, its shape unchanged) it is a new layout: that
        run's bubbles are its own, and so are its ranks (:meth:`_follows`: a new run on another rank of this
        device is not a second rank beside the last run's).
        """
        layout, leaving = event.layout, self.layout
        if layout.same_shape(leaving) and layout.same_job(leaving):
            return
        was = leaving.describe() if leaving else "-"
        if layout.same_shape(leaving):
            was += ", another job"
        out.append(Note(NoteLevel.INFO, f"trainer layout: {layout.describe()} (was {was})"))
        self.layout = layout
        self.stats.layout_changes += 1
        self.stats.new_run(now_ns)
        # A new run: the ranks heard were the last run's (ranks that share the device are heard again at once).
        self._ranks_heard.clear()
        self._followed, self.followed_rank, self._sharing, self.sharing_ranks = None, None, (), ()
        current = self.bubbles.open
        if current is not None:
            self._end_bubble(current, max(layout.at_ns, current.event.start_ns), now_ns, out, measured=False)
        self.bubbles.change_layout(leaving.shape if leaving else None, layout.shape,
                                   leaving is None or layout.same_job(leaving))
        self.memory.forget()
        for task in self.tasks.values():
            task.health.unfit_bubbles = task.health.reprobes = 0
        if layout.free_memory_bytes >= 0:
            self.memory.sample_iteration((-1, -1), layout.free_memory_bytes + self._resident_usage())
            self._evict_if_over_budget(now_ns, out)
        if not event.hosts_stage:
            for task in list(self.tasks.values()):
                if task.from_queue and not task.state.is_terminal and not task.stopping:
                    self.stopping.release(task, "no stage of the new layout runs on this device", now_ns, out, True)

    # ------------------------------------------------------------------ workers

    def _on_worker_ready(self, event: WorkerReady, now_ns: int, out: list[Action]) -> None:
        task = self.tasks.get(event.task_id)
        if task is None or task.state != TaskState.STARTING:
            return
        task.pid = event.pid
        task.progress_unit = event.progress_unit
        task.baseline_bytes = event.baseline_bytes
        task.host_baseline_bytes, task.host_bytes = event.host_baseline_bytes, 0
        self.context_bytes = max(self.context_bytes, event.context_bytes)
        others = [t.share_ns for t in self._tasks.resident() if t is not task and t.state != TaskState.STARTING]
        task.share_ns = max(task.share_ns, min(others, default=0))
        self._tasks.move(task, _PARKED, "worker ready", out)
        if self.bubbles.open is not None:
            self.grant_next(now_ns, out)

    def _on_worker_checkpointed(self, event: WorkerCheckpointed, now_ns: int, out: list[Action]) -> None:
        task = self.tasks.get(event.task_id)
        if task is None:
            return
        task.checkpoint_path = event.path
        task.checkpoint_step = event.step
        out.append(CheckpointRecorded(task.task_id, event.step, event.path, event.progress))

    def _on_worker_finished(self, event: WorkerFinished, now_ns: int, out: list[Action]) -> None:
        task = self.tasks.get(event.task_id)
        if task is None or task.state not in (_PARKED, _RUNNING, _FROZEN):
            return  # only a worker that is ready can finish: anything else is a stale message
        task.steps = event.total_steps
        task.progress = event.progress
        task.finished_seen = True
        self.stopping.let_go(task)
        if task.state == _FROZEN:
            # Its last message crossed the freeze that stopped it (the step outlived its bubble, then the task was
            # done): finished all the same, and let run to its exit. Left frozen, it exited at its next grant with
            # code 0 and no finish, and a task that had done all its work was FAILED ("EXIT").
            out.append(Thaw(task.task_id))
        self._tasks.move(task, TaskState.FINISHED, "done", out)
        if self.bubbles.open is not None:
            self.grant_next(now_ns, out)

    def _on_worker_failed(self, event: WorkerFailed, now_ns: int, out: list[Action]) -> None:
        task = self.tasks.get(event.task_id)
        if task is None or task.state.is_terminal:
            return
        # The process exits right after this message; its exit record completes the failure.
        task.pending_failure = event.failure
        harvested = event.harvested_ns
        task.harvested_ns += harvested
        self.stats.harvested_ns += harvested
        if event.total_steps >= 0:
            task.steps = max(task.steps, event.total_steps)
        if event.progress >= 0:
            task.progress = event.progress

    def _on_worker_steps_seen(self, event: WorkerStepsSeen, now_ns: int, out: list[Action]) -> None:
        task = self.tasks.get(event.task_id)
        if task is None or not task.state.is_resident:
            return
        health = task.health
        health.seen_on_board(event.steps_done, event.in_setup, event.in_checkpoint)
        health.waited(event.run_delay_ns, now_ns, event.starved, event.asleep)
        before = task.margin_before_freeze_ns
        if before is not None:
            task.margin_before_freeze_ns = None
            if health.freeze_wait_ns >= self.config.grace_ns // 2:
                # It waited for its core in the grant it was frozen in, half a grace or more: past the end the
                # trainer had the core back, and the worker, at nice 19, could not finish its step and park. The
                # overrun was the core's, not the step's estimate: no wider margin. A stranger's DeepSpeed rank
                # with its side task on the rank's core had 1,449 of 1,630 bubbles "overrun" by the grace, 58 us steps,
                # and its margin widened from 0.2 to 2.4 ms against 0.7 ms bubbles: 11.9% harvested.
                task.margin_ns = before
        health.board_step = max(health.board_step, event.step)
        counted = counts_steps(task.progress_unit)
        if event.step > task.steps and (counted or not task.progress):
            # Steps finished inside grants it never parked from (its park would have reported them): a task hung
            # after 9 steps read "progress: - (0 steps)". A progress that counts steps moves with them. One in a
            # unit of the task's own is the task's to say (a task hung before its first park read "29 numbers" for
            # 1,450,000 numbers), and once said, its steps stay those it said it at: one hung after its last park
            # read "120 matmuls (50 steps)" for 120 matmuls at 30 steps (the board's 50 go to its failure).
            if task.progress == task.steps and counted:
                task.progress = float(event.step)
            task.steps = event.step
        if not health.verdict_due:
            return
        health.verdict_due = False
        if task.state is _FROZEN and not task.stopping and health.stuck_ns >= self.config.step_timeout_ns:
            reached = health.step_reached(task.steps)
            self.stopping.fail(task, health.stuck_failure(self.config.step_timeout_ns, reached), out)
        elif self.bubbles.open is not None:
            self.grant_next(now_ns, out)  # the board showed it stepping: it may take the open bubble

    def _on_worker_exited(self, event: WorkerExited, now_ns: int, out: list[Action]) -> None:
        task = self.tasks.get(event.task_id)
        if task is not None and self.stopping.exited(task, event, out) and self.bubbles.open is not None:
            self.grant_next(now_ns, out)

    # ------------------------------------------------------------------ memory

    def _on_worker_usage(self, event: WorkerUsage, now_ns: int, out: list[Action]) -> None:
        task = self.tasks.get(event.task_id)
        if task is None or not task.state.is_resident:
            return
        task.reported_bytes = event.device_bytes
        self._check_cap(task, out)

    def _on_task_memory_sampled(self, event: TaskMemorySampled, now_ns: int, out: list[Action]) -> None:
        task = self.tasks.get(event.task_id)
        if task is None or not task.state.is_resident:
            return
        task.used_bytes = event.used_bytes
        if event.host_bytes >= 0:
            task.host_bytes = event.host_bytes
        self._check_cap(task, out)

    def _on_device_memory_sampled(self, event: DeviceMemorySampled, now_ns: int, out: list[Action]) -> None:
        self.memory.sample_device(event.free_bytes + self._resident_usage())
        self._evict_if_over_budget(now_ns, out)

    def _on_device_status_changed(self, event: DeviceStatusChanged, now_ns: int, out: list[Action]) -> None:
        if event.problem and not self.memory.problem:
            out.append(Note(NoteLevel.WARNING, f"device unreadable, admitting no task: {event.problem}"))
        self.memory.problem = event.problem

    def _on_tick(self, event: Tick, now_ns: int, out: list[Action]) -> None:
        # A step that looks hung times out in wall time while bubbles come, between bubbles too: the ticks count
        # it up to a pause after the last bubble (``TRAINER_PAUSE_NS``). Once the trainer pauses or ends, its
        # clock stops: the step is frozen and cannot finish, and failing it then lost healthy tasks.
        if self._tasks.frozen:
            self._fail_hung_too_long(now_ns, out)
        if self.sharing_ranks:
            self._update_ranks(now_ns, out)

    def _check_cap(self, task: TaskRuntime, out: list[Action]) -> bool:
        """Fail a task over its cap (``memory.over_cap``; not while it starts); True if so."""
        if task.state == TaskState.STARTING or task.stop is StopPhase.FAIL:
            return False
        failure = over_cap(task)
        if failure is None:
            return False
        self.stopping.fail(task, failure, out)
        return True

    def _resident_usage(self) -> int:
        return sum(max(t.used_bytes, t.reported_bytes) for t in self._tasks.resident())

    def _admit(self, out: list[Action]) -> None:
        waiting = self._tasks.submitted
        if self.drain is not _SERVING or not waiting or self.memory.problem:
            return
        budget = self.budget_bytes()
        if budget is None or self.memory.skip(self._tasks.waiting_epoch, budget):
            return
        chosen, left = admissions(waiting.values(), budget)
        for task in chosen:
            task.health.new_process()
            task.killed_at_stop = False
            self._tasks.move(task, TaskState.STARTING, "memory fits", out)
            out.append(Spawn(task.task_id, task.spec, task.memory_bytes, task.checkpoint_path))
        self.memory.passed(self._tasks.waiting_epoch, left)

    def _evict_if_over_budget(self, now_ns: int, out: list[Action]) -> None:
        budget = self.budget_bytes()
        if budget is None:
            return
        # Caps of tasks already stopping are on their way out: counting them again would evict more.
        budget += sum(t.memory_bytes for t in self._tasks.resident() if t.stopping)
        if budget >= 0:
            return
        for task in victims((t for t in self._tasks.parked.values() if not t.stopping), budget):
            out.append(Note(NoteLevel.INFO, "evicting: device memory budget shrank", task.task_id))
            self.stopping.stop(task, StopPhase.EVICT, now_ns, out, checkpoint=True)
            budget += task.memory_bytes
        if budget >= 0:
            return
        # Frozen steps hold their memory too. One cannot checkpoint without first running to its step's end, on
        # the device and in training's time, which is what the shrunken budget says training needs: it is
        # killed, and restarts from its last checkpoint once memory fits again. Kept, a frozen task held
        # its memory until its step finished or failed, however short the trainer ran.
        for task in victims((t for t in self._tasks.frozen.values() if not t.stopping), budget):
            out.append(Note(NoteLevel.WARNING, "evicting a frozen step: device memory budget shrank; killed (it "
                                               "restarts from its last checkpoint)", task.task_id))
            self.stopping.stop(task, StopPhase.EVICT, now_ns, out, checkpoint=False, kill=True)

    # ------------------------------------------------------------------ stopping tasks

    def _to_drain(self, phase: DrainPhase) -> None:
        DRAIN.check(self.drain, phase)
        self.drain = phase


# ====================================================================== dispatch

_Handler = Callable[[SchedulerCore, Any, int, list[Action]], None]

#: One handler per event type. A new event type without a handler fails at import (below), not at run time.
_HANDLERS: dict[type, _Handler] = {
    BubbleStarted: SchedulerCore._on_bubble_started,
    BubbleEnded: SchedulerCore._on_bubble_ended,
    TrainerEndSeen: SchedulerCore._on_trainer_end_seen,
    TaskAdded: SchedulerCore._on_task_added,
    CancelRequested: SchedulerCore._on_cancel_requested,
    DrainRequested: SchedulerCore._on_drain_requested,
    ReleaseRequested: SchedulerCore._on_release_requested,
    LayoutChanged: SchedulerCore._on_layout_changed,
    WorkerReady: SchedulerCore._on_worker_ready,
    WorkerStepsSeen: SchedulerCore._on_worker_steps_seen,
    WorkerParked: SchedulerCore._on_worker_parked,
    WorkerUsage: SchedulerCore._on_worker_usage,
    WorkerCheckpointed: SchedulerCore._on_worker_checkpointed,
    WorkerFinished: SchedulerCore._on_worker_finished,
    WorkerFailed: SchedulerCore._on_worker_failed,
    WorkerExited: SchedulerCore._on_worker_exited,
    TaskMemorySampled: SchedulerCore._on_task_memory_sampled,
    DeviceMemorySampled: SchedulerCore._on_device_memory_sampled,
    DeviceStatusChanged: SchedulerCore._on_device_status_changed,
    Tick: SchedulerCore._on_tick,
}


def _check_exhaustive() -> None:
    events = set(typing.get_args(Event))
    if events != set(_HANDLERS):
        missing = sorted(t.__name__ for t in events - set(_HANDLERS))
        extra = sorted(t.__name__ for t in set(_HANDLERS) - events)
        raise TypeError(f"core event handlers do not match the Event union: missing {missing}, extra {extra}")


_check_exhaustive()
