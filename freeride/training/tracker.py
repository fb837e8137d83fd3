"""One pipeline rank's bubbles, from marks a framework adapter makes: no framework, no torch.

A :class:`RankTracker` turns where a rank computes and where it waits into reported bubbles. An
adapter (torch pipelining's :class:`~freeride.training.instrument.InstrumentedSchedule`, and those
for DeepSpeed, Megatron Core, torchtitan) hooks its framework and calls, on the training thread:

=================================  ==================================================================
``iteration_begin()``              an iteration (one ``step`` / ``train_batch``) starts
``compute_begin(kind, stage, mb)`` a compute action starts: ``kind`` ``F``/``B``/``I``/``W``
                                   (:mod:`freeride.training.schedules`) of micro-batch ``mb`` on model
                                   stage ``stage``; it also ends a wait still open
``compute_end(kind, stage, mb)``   that action ends
``wait_begin()``                   the framework starts waiting for another rank (a receive's wait,
                                   a blocking send, a collective): call it where the wait really
                                   starts, after any local work of the gap (the loss, posting sends)
``wait_end()``                     the wait is over (optional where the next compute begins at once);
                                   a ``wait_begin`` while a wait is open continues that wait
``iteration_end()``                the iteration's last mark (after the framework's last wait)
=================================  ==================================================================

With ``waits_follow_compute=True`` the tracker starts the waits of the planned wait positions itself:
at ``iteration_begin`` for position 0, and where the action before a wait position ends. That fits a
framework that does only host work between an action and the wait that follows (posting transfers,
as torch's schedules do: on a GPU the device is idle from the action's end), and saves the adapter a
call per action. The one exception is a forward of the last model stage, whose loss the framework
computes after it: the adapter calls ``wait_begin()`` once the loss is done. Where the host's time is the
device's (the host clock), that host work occupies the device: an adapter that sees where the rank starts
waiting for another rank in the open wait (torch's runtime popping the receive it waits for) calls
``wait_blocks()`` there. From the second wait at a site so marked on, its bubble starts at the mark and is
reported there (a wait there that never blocks is measured, not reported, and its site's next wait starts
where the action before it ends again), and a position whose waits from
there are all short goes quiet (below): the rank only posts and computes in it, it never idles. Such a
position may still wait when the pipeline's timing moves (the other rank slows): a long wait from its mark
wakes every quiet position at once, so that the rest of that iteration's waits are reported
(:meth:`RankTracker.wake_quiet`).

Each mark costs a microsecond or two and never blocks: nothing on the training thread waits for
freeride or for the device. Compute actions are stamped only while the model profiles them (the
first ``remodel_iterations``) or with ``time_actions=True`` (:attr:`RankTracker.last_actions`);
otherwise a ``compute_begin`` makes a mark only where it ends a wait, and ``compute_end`` none.

**Slots.** The tracker is given every rank's planned action order (each a list of
:class:`~freeride.training.schedules.Action`, the model stages of a rank merged in the order it runs
them: any schedule, V-shaped placements included). From it
(:class:`~freeride.training.rank_slots.RankPlan`) it knows the *wait positions*: the gaps before the
actions that need another rank's output. A wait's *site* is ``(position, ordinal)``: the position of
the action it comes before (counted by ``compute_begin`` calls since ``iteration_begin``; the
order's length after the last one) and which wait of that gap it is. The first wait at a wait
position is that position's **modelled slot** (slot id = position; position 0 is the ``boundary``
across iterations). Any other wait (a send that blocks, a collective after the schedule, a second wait
in a gap) is *unplanned* until it recurs with a stable length: then it becomes a **learned slot**
(:mod:`freeride.training.learned_slots`), the exception.

**Predictions.** A slot's predicted length is, until it has been measured 3 times, the steady-state
gap at its position from :func:`~freeride.training.rank_slots.steady_state` with the rank's
online-profiled costs (per model stage and kind; stages of other ranks at this rank's mean per kind)
and its measured time between iterations (profiled over the first ``remodel_iterations``: once a
slot has been measured the model no longer speaks for it); then the 10th percentile of its last 16
lengths (:class:`~freeride.training.predictor.BubblePredictor`): conservative where a slot varies, so
a grant cut to it rarely outlives the real wait. A modelled slot none of whose recent waits (at
least 3 of them, all 16 where they are measured from ``wait_blocks`` marks, else whole) reached
``report_min_ns`` is measured but not reported (a bubble nothing fits in, sent every iteration, would
only cost the reporter's thread and the manager); it is reported again once its first wait that does is
learned (below).

**Device time.** ``device`` picks the clock: on ``cuda:N`` each mark records a CUDA event on the
current stream, resolved off the training thread (:mod:`freeride.training.device_clock`; the only
path that imports torch, when the tracker is made); elsewhere the host clock, inline. Bubbles are
reported to the ``sink`` as the clock delivers them; what an iteration measured is learned on the
training thread at the next ``iteration_begin`` (or :meth:`RankTracker.flush`) after the clock
delivered it: each iteration while the model profiles the rank, then every ``learn_every``
(:data:`LEARN_EVERY`, 4) delivered iterations at once.

Example: an adapter for a framework that runs one rank's actions in a loop::

    tracker = RankTracker(orders, rank, sink=BubbleReporter("cuda:0", stage=rank, rank=rank),
                          device="cuda:0")
    tracker.iteration_begin()
    for action in orders[rank]:
        if needs_receive(action):
            tracker.wait_begin()
            work.wait()                       # the framework's own receive wait
        tracker.compute_begin(action.kind, action.stage, action.microbatch)
        run(action)
        tracker.compute_end(action.kind, action.stage, action.microbatch)
    tracker.iteration_end()
    ...
    tracker.close()                           # at the end of training
"""

from __future__ import annotations

import collections
import logging
import os
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, Generic, NamedTuple, Protocol, TypeVar

from freeride.devices import parse_device_name
from freeride.devices.cpu import SCHEDSTAT_PATH, ProcField
from freeride.errors import ConfigError
from freeride.messages import UNKNOWN_MEMORY
from freeride.training.device_clock import HostClock, MarkClock
from freeride.training.free_memory import MemorySampler
from freeride.training.learned_slots import LEARNED_KIND, LearningConfig, Site, WaitLearner
from freeride.training.predictor import BubblePredictor, ComputeProfile
from freeride.training.rank_slots import RankPlan, ReceiveAt
from freeride.training.schedules import (
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    Action,
    IdleSlot,
)

log = logging.getLogger(__name__)

_now = time.monotonic_ns
#: A :class:`MeasuredBubble` made from a tuple of its fields without the named tuple's Python-level
#: ``__new__`` (a frame less for every wait on the training thread).
_new_tuple = tuple.__new__

ActionKey = tuple[str, int, int]  # (kind, model stage, micro-batch)

#: Costs (ns) the model assumes before any action was measured: the reference 1 : 2 ratio.
DEFAULT_COSTS_NS = {FORWARD: 1e6, BACKWARD: 2e6, BACKWARD_INPUT: 1e6, BACKWARD_WEIGHT: 1e6}


#: A modelled slot goes quiet when none of its last ``QUIET_WINDOW`` waits (at least ``QUIET_AFTER``; all
#: ``QUIET_WINDOW`` where they are measured from a ``wait_blocks`` mark, whose positions may wait only now
#: and then) reached ``report_min_ns`` (module doc).
QUIET_WINDOW = 16
QUIET_AFTER = 3
#: Once the model has profiled the rank, its waits are learned (the predictor, the quiet positions) every
#: ``LEARN_EVERY`` iterations, all at once: each slot's history is then touched cold once for that many
#: iterations instead of once each, on the training thread between compute actions
#: (``bench.hot_path_learning``, paired: 21-140 us an iteration less on five torch schedules, both ranks, 8
#: micro-batches). A slot's prediction, a 10th percentile of its last 16 waits, moves slowly anyway; a long
#: wait at a quiet position still wakes the others at once (:meth:`RankTracker.wake_quiet`).
LEARN_EVERY = 4
#: The iterations whose actions are checked against the planned order (a mismatch is logged once).
ORDER_CHECKED_ITERATIONS = 8


class BubbleSink(Protocol):
    """Where bubbles go: a :class:`freeride.training.reporter.BubbleReporter`, or a recorder in tests."""

    def bubble_start(
        self,
        iteration: int,
        slot: int,
        kind: str,
        predicted_ns: int,
        free_memory_bytes: int = UNKNOWN_MEMORY,
        start_ns: int | None = None,
        learned: bool = False,  # passed (True) only for a learned slot: a sink of modelled slots may omit it
    ) -> None: ...

    def bubble_end(self, iteration: int, slot: int, end_ns: int | None = None) -> None: ...


class MeasuredBubble(NamedTuple):
    """One wait at a slot, as the rank saw it; ``reported``: sent to the sink (module doc)."""

    iteration: int
    slot: int
    kind: str
    start_ns: int
    end_ns: int
    predicted_ns: int
    free_memory_bytes: int
    reported: bool = True
    #: How long the rank waited for another rank in it, from where the adapter saw it start waiting
    #: (:meth:`RankTracker.wait_blocks`; the host work before that excluded). -1: no such mark.
    waited_ns: int = -1
    #: On the host clock, what the rank then waited for its core before it ran again: it resumed at ``end_ns`` +
    #: this (:meth:`_Timeline.wait`). 0 elsewhere.
    core_wait_ns: int = 0

    @property
    def length_ns(self) -> int:
        return self.end_ns - self.start_ns


class MeasuredAction(NamedTuple):
    """One compute action as the rank ran it: ``kind`` of ``microbatch`` on model stage ``stage``."""

    kind: str
    stage: int
    microbatch: int
    start_ns: int
    end_ns: int

    @property
    def length_ns(self) -> int:
        return self.end_ns - self.start_ns


def default_clock(device: str | None, consumer: Callable[[Any, int], None]) -> MarkClock:
    """CUDA events on a CUDA device; the host clock everywhere else. A CUDA device that torch cannot use is
    refused: timed on the host clock, its marks would read kernel launches as compute (a trainer given
    ``cuda:0`` on a machine without a GPU was accepted without a word)."""
    if device and device.startswith("cuda"):
        import torch

        from freeride.training.device_clock import CudaEventClock

        if not torch.cuda.is_available():
            raise ConfigError(f"device {device}: torch sees no CUDA device here; name the rank's device as it "
                              "trains (cpu:N for a CPU core)")
        return CudaEventClock(consumer, int(device.split(":", 1)[1]) if ":" in device else 0)
    return HostClock(consumer)


def torch_device_name(device: Any) -> str | None:
    """A framework's ``torch.device`` as freeride names it, or None for None: ``cuda:N``; ``cuda`` without
    an index is the current CUDA device, where torch itself puts such a tensor (a rank that calls
    ``torch.cuda.set_device(local_rank)`` and builds its stage on ``"cuda"`` is on ``cuda:<local_rank>``, not
    ``cuda:0``); ``cpu:N``; ``cpu`` (no core named: the host clock). The one translation the tracker and
    every adapter share. ConfigError for another device type."""
    if device is None:
        return None
    kind, index = getattr(device, "type", None), getattr(device, "index", None)
    if kind == "cuda":
        if index is None:
            import torch  # a torch.device came from torch: it is loaded already

            index = torch.cuda.current_device()
        return f"cuda:{index}"
    if kind == "cpu":
        return "cpu" if index is None else f"cpu:{index}"
    raise ConfigError(f"device {device!r}: name the rank's device as freeride does, 'cpu:N' (its core) or 'cuda:N'")


def checked_device(device: Any) -> str | None:
    """``device`` as a device name (``cpu:N``, ``cuda:N``, or ``cpu``: the host clock, no core named), or
    None; a ``torch.device`` is taken by its name (:func:`torch_device_name`). ConfigError for anything
    else (``torch.device("cpu")`` raised an AttributeError from deep inside the tracker)."""
    if device is None:
        return None
    if not isinstance(device, str) and hasattr(device, "type") and hasattr(device, "index"):
        device = torch_device_name(device)
    if not isinstance(device, str):
        raise ConfigError(f"device must be a device name such as 'cpu:0' or 'cuda:1', got {type(device).__name__} "
                          f"{device!r}")
    return "cpu" if device == "cpu" else str(parse_device_name(device))


def check_sink(sink: Any, device: str | None) -> None:
    """A sink is None or takes ``bubble_start`` and ``bubble_end``; a reporter's device is the rank's.

    ``InstrumentedSchedule(schedule, "cpu:0")`` (the device where the sink goes) was accepted and failed the
    first bubble with an AttributeError, which took the peer rank down in its next receive.
    """
    if sink is None:
        return
    if not (callable(getattr(sink, "bubble_start", None)) and callable(getattr(sink, "bubble_end", None))):
        hint = " (the argument after the schedule is the sink: pass the device as device=...)" \
            if isinstance(sink, str) else ""
        raise ConfigError(f"sink must be a BubbleReporter, or any object with bubble_start and bubble_end; got "
                          f"{type(sink).__name__} {sink!r}{hint}")
    reports_for = getattr(sink, "device", None)
    if device is not None and isinstance(reports_for, str) and reports_for != device \
            and not (device == "cpu" and reports_for.startswith("cpu:")):
        raise ConfigError(f"the reporter reports bubbles of {reports_for}, and this rank's device is {device}: "
                          "give both the device the rank trains on")


def check_rank_device(device: str | None, rank: int, sink: Any, stage_device: Any = None) -> None:
    """ConfigError where the rank's device, or the reporter's stage, is not where this rank trains.

    A rank pinned to core 0 whose reporter said ``cpu:1`` reported without a word, and ``cpu:1``'s manager ran
    side tasks in its bubbles beside the other rank's compute. So: a ``cpu:N`` device whose core is not among
    the training thread's (where it is pinned at all); a ``cuda:N`` device whose stage's tensors are on another
    GPU (``stage_device``, the framework's ``torch.device``, where the adapter knows it); and a reporter whose
    ``stage`` is another pipeline rank's (its bubbles were listed as that stage's). A ``cpu:N`` rank that reports
    and may run on other cores too is warned about (one line): its waits are core N's idle time only while it
    computes there.
    """
    if device is not None and device.startswith("cpu:"):
        cores = os.sched_getaffinity(0)
        core = int(device.split(":")[1])
        listed = ", ".join(map(str, sorted(cores)))
        if core not in cores:
            raise ConfigError(f"this rank's device is {device}, and it runs on core(s) {listed} only: "
                              "name the core it trains on, as cpu:N (its bubbles are that core's idle time)")
        if len(cores) > 1 and sink is not None:  # accepted without a word: side tasks then ran beside its compute
            log.warning("this rank's device is %s, and its training thread may run on cores %s: its waits are %s's "
                        "idle time only while it computes on core %d, and side tasks there meet it when it moves. "
                        "Pin it to its core (os.sched_setaffinity(0, {%d}) before training)", device, listed, device,
                        core, core)
    if device is not None and device.startswith("cuda:") and getattr(stage_device, "type", None) == "cuda":
        stage_on = torch_device_name(stage_device)
        if stage_on != device:
            raise ConfigError(f"this rank's device is {device}, and its stage is on {stage_on}: name the GPU it "
                              "trains on")
    stage = getattr(sink, "stage", None)
    if isinstance(stage, int) and not isinstance(stage, bool) and stage != rank:
        raise ConfigError(f"the reporter stamps its bubbles stage {stage}, and this is pipeline rank {rank}: "
                          f"BubbleReporter(..., stage={rank}) (the rank's place in the pipeline)")


class RankTracker:
    """One rank's waits, mapped to slots, predicted, reported and learned (see the module doc).

    ``orders`` maps every pipeline rank to its compute actions of one iteration; ``rank`` is this
    one. ``sink`` receives the bubbles (None: measure only). ``device`` (``cpu:N``, ``cuda:N``) picks
    the clock and the free-memory samples; ``clock`` overrides the clock (a factory taking the
    consumer it must deliver to). ``waits_follow_compute`` and ``time_actions``: see the module doc.
    ``on_iteration(iteration, bubbles)`` is called on the training
    thread with each delivered iteration's reported bubbles; ``on_action_end(kind, stage, mb)`` at
    every ``compute_end``, before its mark (a measuring hook: it must return in microseconds).
    ``receive_at`` tells where a framework that receives ahead waits for an action's input, and
    ``sends_waited_at_end`` that it waits for all its posted sends after its last action
    (:mod:`freeride.training.rank_slots`). ``stage_device``, the framework's ``torch.device`` of the rank's
    stage where the adapter knows it, is checked against ``device`` (:func:`check_rank_device`). ``schedule``
    names the schedule (an adapter passes its class or
    function name): before the first iteration's first bubble, a sink that takes layouts (a
    :class:`~freeride.training.reporter.BubbleReporter`) is told the job's layout (the schedule, the model
    stages, the micro-batches of ``orders``), so that a manager that served an earlier job of another shape
    forgets that job's bubbles (``freeride bubbles`` then shows this job's only).
    """

    def __init__(
        self,
        orders: Mapping[int, Sequence[Action]],
        rank: int,
        sink: BubbleSink | None = None,
        *,
        num_stages: int | None = None,
        device: str | None = None,
        clock: Callable[[Callable[[Any, int], None]], MarkClock] | None = None,
        predictor: BubblePredictor | None = None,
        learning: LearningConfig | None = None,
        on_iteration: Callable[[int, list[MeasuredBubble]], None] | None = None,
        on_action_end: Callable[[str, int, int], None] | None = None,
        report_min_ns: int = 200_000,
        remodel_iterations: int = 5,
        time_actions: bool = False,
        waits_follow_compute: bool = False,
        receive_at: ReceiveAt | None = None,
        schedule: str | None = None,
        sends_waited_at_end: bool = False,
        stage_device: Any = None,
        run_delay: Callable[[], int] | None = None,
    ) -> None:
        if report_min_ns < 0:
            raise ConfigError(f"report_min_ns must be >= 0, got {report_min_ns}")
        device = checked_device(device)
        check_sink(sink, device)
        check_rank_device(device, rank, sink, stage_device)
        self.plan = RankPlan.from_orders(orders, rank, num_stages, receive_at, sends_waited_at_end)
        microbatches = 1 + max((a.microbatch for order in orders.values() for a in order), default=-1)
        #: (schedule, model stages, micro-batches), until it has been reported (class doc).
        self._layout_info: tuple[str, int, int] | None = (
            (schedule, self.plan.num_stages, microbatches) if schedule and hasattr(sink, "report_layout") else None)
        self._layout = self._layout_info
        self.rank = rank
        self.sink = sink
        self.on_iteration = on_iteration
        self.on_action_end = on_action_end
        self.report_min_ns = report_min_ns
        self.time_actions = time_actions
        self.iteration = 0
        self.profile = ComputeProfile()
        self.memory = MemorySampler(device)
        self.predictor = predictor or BubblePredictor(window=16, warmup=3, quantile=0.1)
        self._warm = self.predictor.warm
        self._model_ns: dict[int, float] = {}
        self.predictor.set_model(lambda stage, slot: self._model_ns.get(slot))
        self._remodel_left = remodel_iterations
        self._between_ns: float | None = None  # EWMA of the rank's time between iterations
        order = self.plan.order
        self._keys: list[ActionKey] = [(a.kind, a.stage, a.microbatch) for a in order]
        # The modelled slot of the first wait at each position (None where the rank has nothing to wait for).
        # As (slot id, kind): a wait reads two fields of a tuple where it would read a slot object's.
        self._modelled: list[tuple[int, str] | None] = [None] * (len(order) + 1)
        for k in self.plan.positions:
            modelled = self.plan.slot(k)
            self._modelled[k] = (modelled.index, modelled.kind)
        self._quiet: frozenset[int] = frozenset()  # modelled slots not reported (module doc)
        self._recent_waited: dict[int, collections.deque[int]] = {}  # per slot: its last waits (waited_ns)
        self._remodel()
        #: Recurring waits the model does not list, learned into slots (``learning``; max_slots=0: off).
        self.learned = WaitLearner(rank, order, learning)
        timeline = self._timeline = _Timeline(self)
        self._on_enter, self._on_leave, self._on_wait = timeline.enter, timeline.leave, timeline.wait
        self._on_wait_end, self._on_blocks = timeline.wait_end, timeline.blocks
        self._timed = time_actions or remodel_iterations > 0  # compute actions stamped (module doc)
        # Per position: whether its wait starts by itself where the action before it ends (module doc).
        self._follows = [False] * (len(order) + 1)
        if waits_follow_compute:
            last_stage = self.plan.num_stages - 1
            for k in self.plan.positions:
                before = order[k - 1] if k else None
                self._follows[k] = before is None or not (before.kind == FORWARD and before.stage == last_stage)
        self._cursor = 0  # compute actions begun in this iteration (training thread)
        self._ordinal = 0  # waits begun in the current gap
        self._waiting = False  # a wait is open
        #: Whether ``compute_begin`` still checks the framework's actions against the planned order: for the
        #: first :data:`ORDER_CHECKED_ITERATIONS`, until a mismatch is logged (a schedule's order does not change
        #: later; the check touches a key per action, cache-cold between compute actions).
        self._checks_order = True
        self._bubbles: list[MeasuredBubble] = []
        #: Once the model has profiled the rank, its waits are learned every ``learn_every`` delivered iterations
        #: (:data:`LEARN_EVERY`; 1: each), all at once; :meth:`flush` learns what is left.
        self.learn_every = LEARN_EVERY
        self._unlearned: list[list[MeasuredBubble]] = []  # delivered iterations' waits not learned yet
        self._actions: list[tuple[str, int, int, int, int]] = []
        self.clock: MarkClock = (clock or (lambda consumer: default_clock(device, consumer)))(timeline.handle)
        self._emit = _emitter(self.clock)
        timeline.host_time = self.clock.synchronous
        #: The training thread's run delay (ns; -1: unknown), read where each wait's bubble starts and ends on the
        #: host clock: what the rank waited for its core in a wait is no bubble (:meth:`_Timeline.wait`).
        if run_delay is None and isinstance(self.clock, HostClock):
            run_delay = thread_run_delay()
        timeline.run_delay = run_delay
        #: The host clock's marks call the timeline at once, with the time read at the call (the same thing
        #: as through :meth:`_emit`, one call less on the training thread's path, which runs cache-cold
        #: between compute actions: each frame there costs a microsecond or more).
        self._inline = isinstance(self.clock, HostClock)
        #: In the open wait, the rank now waits for another rank (the host work before is done): what follows
        #: decides whether the position is quiet (module doc). No wait open: nothing. An adapter calls it at
        #: every such point (torch's runtime: each receive it pops), so on the host clock it is one call.
        self.wait_blocks: Callable[[], None] = self._wait_blocks_marked
        if isinstance(self.clock, HostClock):
            self.wait_blocks = timeline.blocks_now

    # ---------------------------------------------------------------- marks (training thread)

    def iteration_begin(self) -> None:
        self._deliver()
        self.memory.refresh()
        if self._layout is not None:
            self._report_layout()
        self._cursor = 0
        self._ordinal = 0
        self._waiting = False
        if self.iteration == ORDER_CHECKED_ITERATIONS:
            self._checks_order = False
        self._emit(self._timeline.begin, self.iteration, None)
        if self._follows[0]:
            self.wait_begin()

    def _report_layout(self) -> None:
        assert self._layout is not None
        schedule, stages, microbatches = self._layout
        self._layout = None
        try:
            self.sink.report_layout(schedule, stages, microbatches,  # type: ignore[union-attr]
                                    free_memory_bytes=self.memory.free_bytes())
        except Exception:  # noqa: BLE001 - a sink's failure never reaches the training loop
            log.debug("layout not reported", exc_info=True)

    def relayout(self) -> None:
        """This tracker is the job's again after another's iterations (:class:`KeptShapes`): its layout is
        reported once more, before its next iteration's bubbles, so that the manager reads them in it."""
        if self._layout_info is not None:
            self._layout = self._layout_info

    def iteration_end(self) -> None:
        self._waiting = False
        self._emit(self._timeline.finish, self.iteration, None)
        self.iteration += 1
        if self.clock.synchronous:
            self._deliver()

    def compute_begin(self, kind: str, stage: int, microbatch: int) -> None:
        cursor = self._cursor
        if self._checks_order:
            keys = self._keys
            if cursor < len(keys) and keys[cursor] != (kind, stage, microbatch):
                self._order_mismatch((kind, stage, microbatch))
        self._cursor = cursor + 1
        self._ordinal = 0
        if self._timed:  # its start closes an open wait
            self._emit(self._on_enter, (kind, stage, microbatch), None)
        elif self._waiting:
            if self._inline:
                self._timeline.close_now()
            else:
                self._emit(self._on_wait_end, None, None)
        self._waiting = False

    def compute_end(self, kind: str, stage: int, microbatch: int) -> None:
        if self.on_action_end is not None:
            self.on_action_end(kind, stage, microbatch)
        if self._timed:
            self._emit(self._on_leave, (kind, stage, microbatch), None)
        try:
            follows = self._follows[self._cursor]
        except IndexError:  # the framework ran more actions than its order has
            return
        if follows:
            self.wait_begin()

    def wait_begin(self) -> None:
        if self._waiting:
            return  # still the same wait
        self._waiting = True
        cursor, ordinal = self._cursor, self._ordinal
        self._ordinal = ordinal + 1
        slot = None
        if ordinal == 0:
            try:
                slot = self._modelled[cursor]
            except IndexError:  # the framework ran more actions than its order has
                pass
        if slot is None and self.learned.opens:
            learned = self.learned.opens.get((cursor, ordinal))
            if learned is not None:
                slot = (learned.index, learned.kind)
        if slot is None:
            opens: _Opens = None
        else:
            index, kind = slot
            predicted = self._warm.get((self.rank, index))  # the predictor's, kept as it learns
            if predicted is None:
                predicted = self.predictor.predict_ns(self.rank, index)
            memory = self.memory
            opens = (index, kind, predicted, memory.free_bytes() if memory.live else memory.sampled,
                     index not in self._quiet)
        if self._inline:
            self._on_wait((cursor, ordinal), opens, _now())
        else:
            self._emit(self._on_wait, (cursor, ordinal), opens)

    def wait_end(self) -> None:
        if self._waiting:
            self._waiting = False
            if self._inline:
                self._timeline.close_now()
            else:
                self._emit(self._on_wait_end, None, None)

    def _wait_blocks_marked(self) -> None:
        if self._waiting:
            self._emit(self._on_blocks, None, None)

    @property
    def position(self) -> int:
        """The position of the gap the rank is in: compute actions begun since ``iteration_begin``."""
        return self._cursor

    def _order_mismatch(self, key: ActionKey) -> None:
        self._checks_order = False
        kind, stage, mb = self._keys[self._cursor]
        log.warning("[rank %d] the framework ran %s%s%d where the planned order has %s%s%d at position %d: "
                    "bubble slots may be misattributed", self.rank, key[1], key[0], key[2], stage, kind, mb,
                    self._cursor)

    # ---------------------------------------------------------------- model

    def cost_ns(self, action: Action) -> float:
        """An action's cost for the model: profiled on its own stage, else this rank's mean of its kind
        (a stage of another rank), else derived from the other kinds, else the reference default."""
        profile = self.profile
        for key in (f"{action.kind}{action.stage}", action.kind):
            if profile.samples(key):
                return profile.mean_ns(key)
        b, i, w = (profile.mean_ns(k) if profile.samples(k) else 0.0
                   for k in (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT))
        if action.kind == BACKWARD and i and w:
            return i + w
        if action.kind in (BACKWARD_INPUT, BACKWARD_WEIGHT) and b:
            return b / 2
        return DEFAULT_COSTS_NS[action.kind]

    def _remodel(self) -> None:
        """Re-simulate the steady state with the profiled costs; refresh the modelled slot lengths."""
        known: dict[tuple[str, int], float] = {}  # an action's cost depends on its kind and stage only

        def cost(action: Action) -> float:
            key = (action.kind, action.stage)
            found = known.get(key)
            if found is None:
                found = known[key] = self.cost_ns(action)
            return found

        try:
            self._model_ns = self.plan.modelled_lengths(cost, self._between_ns or 0.0)
        except ConfigError as exc:  # an order that deadlocks in the model: predictions fall back
            log.warning("[rank %d] the schedule's order cannot be simulated: %s", self.rank, exc)
            self._model_ns = {}

    @property
    def slots(self) -> tuple[IdleSlot, ...]:
        """The modelled slots, with their current modelled lengths (ns)."""
        return self.plan.slots(self._model_ns)

    # ---------------------------------------------------------------- delivery (training thread)

    def _deliver(self) -> None:
        """Learn from, and hand out, every iteration the clock has finished (training thread)."""
        done = self._timeline.done
        while done:  # (tested, not caught: an exception per call costs the training thread more)
            iteration, waits, actions, gaps, between_ns = done.popleft()
            unlearned = self._unlearned
            unlearned.append(waits)
            if self._remodel_left > 0 or len(unlearned) >= self.learn_every:
                self._observe_unlearned()
            if self._remodel_left > 0 and actions:
                for kind, stage, _mb, begin, end in actions:
                    self.profile.observe(kind, end - begin)
                    self.profile.observe(f"{kind}{stage}", end - begin)
                if between_ns is not None:
                    old = self._between_ns
                    self._between_ns = float(between_ns) if old is None else old + 0.2 * (between_ns - old)
                self._remodel_left -= 1
                self._remodel()
                self._timed = self.time_actions or self._remodel_left > 0
            if gaps or self.learned.active:
                self._learn(gaps, waits)
            bubbles = [b for b in waits if b.reported]
            self._bubbles, self._actions = bubbles, actions
            if self.on_iteration is not None:
                try:
                    self.on_iteration(iteration, bubbles)
                except Exception:  # noqa: BLE001 - a logging callback must not break training
                    log.exception("on_iteration callback failed")

    def _observe_unlearned(self) -> None:
        """Learn every delivered iteration not learned yet, oldest first (:data:`LEARN_EVERY`)."""
        unlearned = self._unlearned
        waits = unlearned[0] if len(unlearned) == 1 else [w for ws in unlearned for w in ws]
        unlearned.clear()
        self._observe(waits)

    def _observe(self, waits: list[MeasuredBubble]) -> None:
        """Learn each wait's length (the predictor) and whether its slot is still worth reporting (module doc:
        quiet slots). One pass, fields unpacked: on the training thread, once a learning batch."""
        quiet, least, recent = self._quiet, self.report_min_ns, self._recent_waited
        changed: set[int] | None = None  # the quiet set, once something changes it
        lengths = []
        for _iteration, slot, kind, start, end, predicted, _free, _reported, waited, _core_wait in waits:
            length = end - start
            lengths.append((slot, length, predicted))
            marked = waited >= 0
            if not marked:
                waited = length
            history = recent.get(slot)
            if history is None:
                history = recent[slot] = collections.deque(maxlen=QUIET_WINDOW)
            history.append(waited)
            if waited >= least:  # long enough (again): reported
                if changed is not None:
                    changed.discard(slot)
                elif slot in quiet:
                    changed = set(quiet)
                    changed.discard(slot)
            elif (slot not in quiet and kind != LEARNED_KIND
                  and len(history) >= (QUIET_WINDOW if marked else QUIET_AFTER) and max(history) < least):
                if changed is None:
                    changed = set(quiet)
                changed.add(slot)
        self.predictor.observe_all(self.rank, lengths)
        if changed is not None and changed != quiet:
            self._quiet = frozenset(changed)

    def wake_quiet(self) -> None:
        """A quiet position's wait, measured from its block mark, was long: the pipeline's timing moved (the
        other rank slowed, the machine got busy), and the other quiet positions may wait too. Every slot is
        reported again at once, from the rest of this iteration on, until each is short 16 times again."""
        self._quiet = frozenset()
        self._recent_waited.clear()

    def _learn(self, gaps: list[tuple[Site, int]], waits: list[MeasuredBubble]) -> None:
        learned = [(b.slot, b.length_ns) for b in waits if b.kind == LEARNED_KIND]
        for slot in self.learned.observe(gaps, learned):
            site = next(s for s, x in self.learned.opens.items() if x.index == slot.index)
            for length in self.learned.lengths(site):
                self.predictor.observe(self.rank, slot.index, length)  # its first prediction: what recurred
            log.info("[rank %d] a wait at position %d (wait %d of its gap) recurs (%.2f ms): learned slot %d",
                     self.rank, site[0], site[1], slot.length / 1e6, slot.index)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait for the clock to resolve every mark, then deliver (off the training path: at the end of
        training, or in a test). True when everything was delivered."""
        done = self.clock.flush(timeout_s)
        self._deliver()
        if self._unlearned:
            self._observe_unlearned()
        return done

    def close(self) -> None:
        """Deliver what the clock still holds and stop it (on CUDA this waits for the device)."""
        self.flush()
        self.clock.close()

    # ---------------------------------------------------------------- results

    @property
    def unplanned_waits(self) -> int:
        """Waits at sites that no slot names (module doc)."""
        return self._timeline.unplanned_waits

    @property
    def unplanned_wait_ns(self) -> int:
        return self._timeline.unplanned_wait_ns

    @property
    def last_bubbles(self) -> list[MeasuredBubble]:
        """The reported bubbles of the last iteration delivered (on CUDA, the last the device finished)."""
        return list(self._bubbles)

    @property
    def last_actions(self) -> list[MeasuredAction]:
        """The compute actions of the last iteration delivered, timed as the bubbles are (only while
        the model profiles them, or with ``time_actions``: see the module doc)."""
        return [MeasuredAction(*a) for a in self._actions]


_Opens = tuple[int, str, int, int, bool] | None  # slot id, its kind, predicted ns, free bytes, reported
_Handler = Callable[[Any, Any, int], None]


def _emitter(clock: MarkClock) -> Callable[[_Handler, Any, Any], None]:
    """How a mark reaches the timeline: through the clock (``(handler, a, b)`` stamped and delivered
    by it), or, for the host clock, at once with the time read here (the same thing, one call less on
    the training thread's path)."""
    if isinstance(clock, HostClock):
        now = time.monotonic_ns

        def emit_now(handler: _Handler, a: Any, b: Any) -> None:
            handler(a, b, now())

        return emit_now
    mark = clock.mark

    def emit(handler: _Handler, a: Any, b: Any) -> None:
        mark((handler, a, b))

    return emit
_Action = tuple[str, int, int, int, int]  # kind, stage, micro-batch, start ns, end ns


_Kept = TypeVar("_Kept")


def thread_run_delay() -> Callable[[], int]:
    """A reader of the calling thread's run delay (ns runnable without a core, ``/proc/thread-self/schedstat``;
    -1 where the kernel keeps none), bound to the thread of its first read: one ``pread`` a call (~0.6 us)."""
    field = ProcField(SCHEDSTAT_PATH, 1)

    def read() -> int:
        value = field.read()
        return -1 if value is None else value

    return read


class KeptShapes(Generic[_Kept]):
    """The trackers of the last pipeline shapes a job ran (each with what its adapter keeps beside it), most
    recent last; at most ``keep``, the oldest closed.

    An adapter makes a tracker per shape (the micro-batch count and the like fix the order and its slots).
    It made a new one at every change, so a job that alternated between two micro-batch counts (Megatron's
    ``num_microbatches`` call to call) started its slots afresh every call, and their predictions never left
    the model's defaults (1-2 ms against real waits of 0.5-17 ms). A shape seen again gets its tracker back,
    with what its slots learned, and its layout reported again (:meth:`RankTracker.relayout`).
    """

    def __init__(self, tracker_of: Callable[[_Kept], RankTracker], keep: int = 4) -> None:
        self._tracker_of = tracker_of
        self._keep = keep
        self._kept: collections.OrderedDict[Hashable, _Kept] = collections.OrderedDict()

    def get(self, shape: Hashable, make: Callable[[], _Kept]) -> _Kept:
        """The entry of ``shape``: the kept one, now the most recent and its layout re-armed, else ``make()``'s."""
        entry = self._kept.pop(shape, None)
        if entry is None:
            entry = make()
        else:
            self._tracker_of(entry).relayout()
        self._kept[shape] = entry
        while len(self._kept) > self._keep:
            self._tracker_of(self._kept.popitem(last=False)[1]).close()
        return entry

    def close(self) -> None:
        """Close every kept tracker (delivering what their clocks still hold)."""
        while self._kept:
            self._tracker_of(self._kept.popitem(last=False)[1]).close()


class _Timeline:
    """Turns the stamped marks of one rank, in order, into bubbles, actions and unplanned waits.

    A mark's payload is ``(handler, a, b)``: :meth:`handle` calls ``handler(a, b, time)``. It runs
    wherever the clock delivers (the training thread on CPU, the device clock's thread on CUDA); it
    reports to the sink as it goes and queues each finished iteration for the training thread.
    """

    __slots__ = ("_actions", "_between_ns", "_blocks_ns", "_blocking", "_delay0", "_entered", "_finished_ns", "_gaps",
                 "_iteration", "_open", "_owner", "_pending", "_waits", "done", "host_time", "run_delay",
                 "unplanned_wait_ns", "unplanned_waits")

    def __init__(self, owner: RankTracker) -> None:
        self._owner = owner
        self.done: collections.deque[
            tuple[int, list[MeasuredBubble], list[_Action], list[tuple[Site, int]], int | None]
        ] = collections.deque()
        self.unplanned_waits = 0
        self.unplanned_wait_ns = 0
        self._iteration = 0
        self._open: tuple[Site, _Opens, int] | None = None  # site, what it opens, start
        self._blocks_ns: int | None = None  # where the rank started waiting for another rank in the open wait
        #: Host clock: the sites whose waits the adapter marks where the rank blocks. From the next wait at such a
        #: site on, its bubble starts at that mark (module doc: the host's work is the device's).
        self._blocking: set[Site] = set()
        self._pending = False  # the open wait's bubble is reported once the rank blocks (a blocking site)
        self.host_time = False  # the clock is the host's (its owner sets it once the clock is made)
        self.run_delay: Callable[[], int] | None = None  # the training thread's run delay (its owner sets it)
        self._delay0 = -1  # that run delay where the open wait's bubble starts (-1: not read)
        self._entered: dict[ActionKey, int] = {}
        self._waits: list[MeasuredBubble] = []
        self._actions: list[_Action] = []
        self._gaps: list[tuple[Site, int]] = []
        self._finished_ns: int | None = None
        self._between_ns: int | None = None

    @staticmethod
    def handle(payload: tuple[Callable[[Any, Any, int], None], Any, Any], at_ns: int) -> None:
        payload[0](payload[1], payload[2], at_ns)

    def enter(self, key: ActionKey, _: None, at_ns: int) -> None:
        if self._open is not None:
            self._close(at_ns)
        self._entered[key] = at_ns

    def leave(self, key: ActionKey, _: None, at_ns: int) -> None:
        begin = self._entered.pop(key, at_ns)
        self._actions.append((key[0], key[1], key[2], begin, at_ns))

    def wait(self, site: Site, opens: _Opens, at_ns: int) -> None:
        """A wait opens at ``at_ns``. On the host clock, where the rank's thread is the device's only user, a wait ends
        where the other rank's data arrived, not where the rank got its core back to see it: the time it waited for
        the core meanwhile (its run delay's growth over the wait, :meth:`_close`) is no bubble. A stranger's
        DeepSpeed rank reported 1.15-1.25 ms waits beside its side task where its receives took 0.45 ms: the rest
        was the rank waiting for the core its manager and side task held, counted as bubble time (and so lengths
        the grants were sized to)."""
        if self._open is not None:
            self._close(at_ns)
        self._open = (site, opens, at_ns)
        if self.run_delay is not None:
            self._delay0 = self.run_delay()
        if opens is not None and opens[4]:
            if site in self._blocking:
                self._pending = True  # reported where the rank blocks (blocks_now)
                return
            self._report_start(opens, at_ns)

    def _report_start(self, opens: tuple[int, str, int, int, bool], at_ns: int) -> None:
        """The open wait's bubble starts at ``at_ns``: said to the sink (a learned slot marked as such)."""
        sink = self._owner.sink
        if sink is None:
            return
        index, kind, predicted, free, _ = opens
        if kind == LEARNED_KIND:
            sink.bubble_start(self._iteration, index, kind, predicted, free, at_ns, learned=True)
        else:
            sink.bubble_start(self._iteration, index, kind, predicted, free, at_ns)

    def wait_end(self, _a: None, _b: None, at_ns: int) -> None:
        if self._open is not None:
            self._close(at_ns)

    def close_now(self) -> None:
        """:meth:`wait_end` on the host clock, read here."""
        if self._open is not None:
            self._close(_now())

    def blocks(self, _a: None, _b: None, at_ns: int) -> None:
        if self._open is not None and self._blocks_ns is None:
            self._blocked(at_ns)

    def blocks_now(self) -> None:
        """:meth:`blocks` on the host clock, read here: the mark's one call."""
        if self._open is not None and self._blocks_ns is None:
            self._blocked(_now())

    def _blocked(self, at_ns: int) -> None:
        """The rank blocks in the open wait. Where the host's time is the device's, the host's work before is
        the device's too: a site so marked starts its waits here from its next wait on (the first taught it
        that the site is marked), and their bubbles are reported from here, not from the end of the action
        before (module doc)."""
        self._blocks_ns = at_ns
        site, opens, _ = self._open  # type: ignore[misc]  # the callers checked it is open
        if self._pending:
            self._pending = False
            self._open = (site, opens, at_ns)
            if self.run_delay is not None:  # the bubble starts here: its core waits count from here
                self._delay0 = self.run_delay()
            if opens is not None:
                self._report_start(opens, at_ns)
        elif self.host_time:
            self._blocking.add(site)

    def begin(self, iteration: int, _: None, at_ns: int) -> None:
        self._iteration, self._waits, self._actions, self._gaps = iteration, [], [], []
        self._entered.clear()
        self._between_ns = None if self._finished_ns is None else at_ns - self._finished_ns

    def finish(self, iteration: int, _: None, at_ns: int) -> None:
        if self._open is not None:
            self._close(at_ns)
        self._finished_ns = at_ns
        self.done.append((iteration, self._waits, self._actions, self._gaps, self._between_ns))
        self._waits, self._actions, self._gaps = [], [], []

    def _close(self, at_ns: int) -> None:
        opened = self._open
        if opened is None:
            return
        self._open = None
        site, opens, start = opened
        core_wait = 0
        if self._delay0 >= 0:
            waited_for_core = self.run_delay() - self._delay0  # type: ignore[misc]  # set where _delay0 was read
            self._delay0 = -1
            if waited_for_core > 0:
                core_wait = min(waited_for_core, at_ns - start)
                at_ns -= core_wait
        blocks, self._blocks_ns = self._blocks_ns, None
        unsent, self._pending = self._pending, False  # a blocking site's wait that never blocked: not reported
        if opens is None:
            self.unplanned_waits += 1
            self.unplanned_wait_ns += at_ns - start
            self._gaps.append((site, at_ns - start))
            return
        index, kind, predicted, free, reported = opens
        if unsent:  # the adapter no longer marks this site: its next wait is reported from its start again
            reported = False
            self._blocking.discard(site)
        if not reported and blocks is not None and at_ns - blocks >= self._owner.report_min_ns:
            self._owner.wake_quiet()  # host clock only (marks from wait_blocks): the training thread
        if reported:
            sink = self._owner.sink
            if sink is not None:
                sink.bubble_end(self._iteration, index, at_ns)
        self._waits.append(_new_tuple(MeasuredBubble, (self._iteration, index, kind, start, at_ns, predicted,
                                                       free, reported, -1 if blocks is None else at_ns - blocks,
                                                       core_wait)))
