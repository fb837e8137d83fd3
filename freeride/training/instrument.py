"""Instrumentation of ``torch.distributed.pipelining``: every wait of a rank, as it happens.

Wrap a schedule and call :meth:`InstrumentedSchedule.step` (or the schedule's own ``step``, which the
wrapper hooks while attached)::

    schedule = ScheduleInterleaved1F1B(stages, n_microbatches=8, loss_fn=loss_fn)
    reporter = BubbleReporter(device="cuda:0", stage=pp_rank, rank=dist.get_rank())
    instrumented = InstrumentedSchedule(schedule, sink=reporter, device="cuda:0")
    for batch in data:
        instrumented.step(...)          # same arguments as schedule.step
        optimizer.step()

This module is the torch adapter of :class:`freeride.training.tracker.RankTracker`, which maps the
waits to slots, predicts and reports them (see there). What the adapter adds is where torch
computes and where it waits, hooked on *instances* (no class is patched, and one module function only
while a single-stage schedule on the host clock is attached; :meth:`InstrumentedSchedule.close` restores
them):

* **Compute.** ``forward_one_chunk``, ``backward_one_chunk`` (``full_backward=False`` is an ``I``)
  and ``backward_weight_one_chunk`` of every ``PipelineStage`` the schedule drives.
* **Iterations.** The schedule's ``step``: one iteration, whichever of the two a trainer calls. Its
  ``eval`` (forward only, through ``step``) runs bare: validation is not training.
* **Waits.** From torch's source (``schedules.py``): a runtime schedule (``ScheduleInterleaved1F1B``,
  ``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``,
  ``ScheduleLoopedBFS``, any ``_PipelineScheduleRuntime`` with an order loaded from CSV) walks
  ``pipeline_order_with_comms``, where ``SEND_*``/``RECV_*`` only post the transfer; it waits in
  ``_wait_batch_p2p(self.fwd_recv_ops.pop((stage, mb)))`` (or ``bwd_recv_ops``) right before the
  forward or backward that needs the data, and for every send at the end of ``step`` (``while
  send_ops: ...``). ``ScheduleGPipe`` and ``Schedule1F1B`` make each receive's ops with
  ``stage.get_fwd_recv_ops(mb)`` / ``get_bwd_recv_ops(mb)`` and wait for them at once (1F1B batches
  a send with it); GPipe also waits for all its forward sends after the last forward (a gloo send
  completes only once the peer has posted its receive). Between a compute action and such a wait
  there is only the posting of transfers (and, after a last stage's forward, its loss), so the
  rank's waits start where the action before a wait position ends (the tracker's
  ``waits_follow_compute``; the planned order says which positions:
  :mod:`freeride.training.rank_slots`), after a last stage's forward where
  ``schedule._maybe_compute_loss`` returns, and at :meth:`InstrumentedSchedule.step`'s entry for
  the wait of the iteration's first action; the compute entry that follows ends each. Posting is
  host work: on a GPU the device is idle from the action's end, and on a loaded CPU a posting that
  blocks on gloo's lock is idle too. The tail after a rank's last action is a wait where that
  action sends to another rank, and in a runtime schedule where any action does: the runtime waits for
  every send it posted once its last action is done, and a send the peer takes late (interleaved
  zero-bubble's rank 1 ends ``I3, SEND_B3, W2, W3``) is a wait of milliseconds past a last action that
  sends nothing. Actions the runtime hands to a ``register_custom_function``
  bypass these hooks.

**The orders.** Every rank's compute actions come from the schedule itself: for runtime schedules
``pipeline_order_with_comms`` (what ``_step_microbatches`` runs; ``OVERLAP_F_B`` is its sub-actions
in order), else ``pipeline_order``; for ``ScheduleGPipe`` and ``Schedule1F1B``, whose
``pipeline_order`` is a drawing (and in torch 2.13 numbers the last rank's forwards from 1), from
:func:`freeride.training.schedules.build_schedule`. A runtime check logs once if torch runs an action
the order did not predict (in the first 8 iterations: a schedule's order does not change once it ran).

**Device time on CUDA**: every mark is a CUDA event, resolved off the training thread
(:mod:`freeride.training.device_clock`); results of an iteration are delivered at a later
:meth:`InstrumentedSchedule.step` (or :meth:`flush`). Nothing here calls ``torch.cuda.synchronize``.

**Internals relied upon** (checked at construction; :class:`PipeliningInternalsChanged` names what
is missing): ``schedule._stage`` (single-stage schedules) or ``schedule._stages``, ``.rank`` and
``.pipeline_order`` or ``.pipeline_order_with_comms`` (multi-stage ones), and
``_maybe_compute_loss`` on a rank holding the last stage; ``stage.stage_index``,
``stage.num_stages``, and the three compute methods with their first argument the micro-batch index
and ``full_backward`` the third of ``backward_one_chunk``. On the host clock, a runtime schedule's
``fwd_recv_ops`` / ``bwd_recv_ops`` instance dicts, where present: their ``pop`` is where the rank
starts waiting for a receive (``RankTracker.wait_blocks``): the bubbles there start at the pop, not at the
end of the action before, and a position where the rank only does host work (posting, the runtime's own
Python) goes quiet however long that takes (docs/bubbles.md). For ``ScheduleGPipe`` and ``Schedule1F1B``
on the host clock, the module function ``torch.distributed.pipelining.schedules._wait_batch_p2p`` (their
waits, for receives and sends alike, call it as a module global): while such a schedule is attached it is
a pass-through that marks the same point on the thread in that schedule's ``step`` (``_WaitWatch``); a
torch without it leaves those waits starting at the action's end.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from freeride.errors import ConfigError, FrameworkNotInstalled, FreerideError
from freeride.training.device_clock import MarkClock
from freeride.training.free_memory import MemorySampler
from freeride.training.learned_slots import LearningConfig, WaitLearner
from freeride.training.predictor import BubblePredictor, ComputeProfile
from freeride.training.schedules import (
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    Action,
    IdleSlot,
    build_schedule,
)
from freeride.training.tracker import (
    BubbleSink,
    MeasuredAction,
    MeasuredBubble,
    RankTracker,
)

__all__ = [
    "BubbleSink",
    "InstrumentedSchedule",
    "MeasuredAction",
    "MeasuredBubble",
    "MemorySampler",
    "PipeliningInternalsChanged",
    "torch_orders",
]


class PipeliningInternalsChanged(FreerideError):
    """The installed torch no longer has the pipelining internals this module hooks into."""


def _require(obj: object, name: str, what: str) -> Any:
    if not hasattr(obj, name):
        raise PipeliningInternalsChanged(
            f"{what} has no attribute {name!r}: this torch ({_torch_version()}) changed the "
            "torch.distributed.pipelining internals freeride.training.instrument hooks into"
        )
    return getattr(obj, name)


def _torch_version() -> str:
    try:
        import torch

        return str(torch.__version__)
    except ImportError:  # pragma: no cover
        return "unknown"


_TORCH_KINDS = {"F": FORWARD, "B": BACKWARD, "I": BACKWARD_INPUT, "W": BACKWARD_WEIGHT}


def torch_orders(pipeline_order: dict[int, list[Any]]) -> dict[int, list[Action]]:
    """Compute actions per rank from torch's schedule IR (``pipeline_order`` or
    ``pipeline_order_with_comms``): communication, resharding and None dropped, ``OVERLAP_F_B``
    replaced by its sub-actions in order."""
    orders: dict[int, list[Action]] = {}
    for rank, actions in pipeline_order.items():
        out: list[Action] = []
        for action in actions:
            if action is None:
                continue
            subs = getattr(action, "sub_actions", None) or (action,)
            for sub in subs:
                kind = _TORCH_KINDS.get(str(getattr(sub.computation_type, "value", sub.computation_type)))
                if kind is not None and sub.microbatch_index is not None:
                    out.append(Action(kind, int(sub.stage_index), int(sub.microbatch_index)))
        orders[int(rank)] = out
    return orders


def _single_schedule_name(schedule: object) -> str:
    names = [cls.__name__ for cls in type(schedule).__mro__]
    if "Schedule1F1B" in names:
        return "1f1b"
    if "ScheduleGPipe" in names:
        return "gpipe"
    raise PipeliningInternalsChanged(
        f"{type(schedule).__name__} is a single-stage schedule freeride has no model for "
        "(supported: ScheduleGPipe, Schedule1F1B, and every schedule with a pipeline_order)"
    )


log = logging.getLogger(__name__)
_ABSENT = object()
#: The attribute that names, on a stage's hooked ``forward_one_chunk``, the InstrumentedSchedule that hooked it.
_OWNER = "_freeride_instrumented_by"
_RECV_OPS = ("fwd_recv_ops", "bwd_recv_ops")


class _WaitWatch:
    """torch's ``schedules._wait_batch_p2p``, replaced by a pass-through while a single-stage schedule on the
    host clock is attached: where ``ScheduleGPipe`` and ``Schedule1F1B`` call it, the rank has posted the
    gap's transfers and now waits for another rank (:meth:`RankTracker.wait_blocks`).

    The single module function this adapter replaces (everything else is hooked on instances): those
    schedules look it up as a module global, so no instance attribute reaches it. The replacement marks only
    on a thread that is inside an attached schedule's ``step`` (:meth:`entered`), and calls whatever the module
    held before; the last :meth:`release` puts that back, unless something replaced it after us (then ours
    stays, passing through). Measured why (``bench.bench_schedules``, 1F1B, two CPU ranks): the last rank's
    gaps between its backward and the next forward were 0.2 ms of posting (gloo) with no wait, reported from
    the backward's end; each woke its manager, which took the rank's core from its host work for 0.35 ms, and
    the gap so stretched stayed over the reporting threshold.
    """

    _lock = threading.Lock()
    _users = 0
    _own: Callable[..., Any] | None = None
    _local = threading.local()  # .blocks: the wait_blocks of the schedule stepping on this thread, or None

    @classmethod
    def acquire(cls) -> bool:
        """Install the pass-through (once for all attached schedules); False where this torch has no such
        function (the waits then start where the action before them ends, as on a GPU)."""
        try:
            from torch.distributed.pipelining import schedules
        except ImportError:  # pragma: no cover - the schedule came from this torch
            return False
        with cls._lock:
            if cls._users == 0:
                own = getattr(schedules, "_wait_batch_p2p", None)
                if not callable(own):
                    log.debug("torch %s has no schedules._wait_batch_p2p: single-stage waits start where the "
                              "action before them ends", _torch_version())
                    return False
                if own is not _watched_wait_batch_p2p:
                    cls._own = own
                    schedules._wait_batch_p2p = _watched_wait_batch_p2p
            cls._users += 1
            return True

    @classmethod
    def release(cls) -> None:
        from torch.distributed.pipelining import schedules

        with cls._lock:
            cls._users -= 1
            if cls._users == 0 and schedules._wait_batch_p2p is _watched_wait_batch_p2p and cls._own is not None:
                schedules._wait_batch_p2p = cls._own

    @classmethod
    def entered(cls, step: Callable[..., Any], blocks: Callable[[], None]) -> Callable[..., Any]:
        """``step`` with ``blocks`` the mark of this thread's waits while it runs (nested steps: the inner's)."""
        local = cls._local

        def call(*args: Any, **kwargs: Any) -> Any:
            outer = getattr(local, "blocks", None)
            local.blocks = blocks
            try:
                return step(*args, **kwargs)
            finally:
                local.blocks = outer

        return call


def _watched_wait_batch_p2p(*args: Any, **kwargs: Any) -> Any:
    """torch's ``_wait_batch_p2p`` with the stepping schedule's wait marked first (:class:`_WaitWatch`)."""
    blocks = getattr(_WaitWatch._local, "blocks", None)
    if blocks is not None:
        blocks()
    own = _WaitWatch._own
    assert own is not None  # installed only once it was kept
    return own(*args, **kwargs)


class _RecvOps(dict):
    """The runtime's dict of posted receives, on the instance: where it pops one to wait for it, the rank's
    host work of the gap is done and its wait for the other rank begins (:meth:`RankTracker.wait_blocks`)."""

    def __init__(self, own: dict[Any, Any], blocks: Callable[[], None]) -> None:
        super().__init__(own)
        self.own = own
        self._blocks = blocks

    def pop(self, key: Any, *default: Any) -> Any:
        self._blocks()
        return dict.pop(self, key, *default)


def _between(before: Callable[[], None], fn: Callable[..., Any], after: Callable[[], None]) -> Callable[..., Any]:
    """``fn``, with ``before()`` ahead of each call and ``after()`` behind it, whatever it raises."""

    def call(*args: Any, **kwargs: Any) -> Any:
        before()
        try:
            return fn(*args, **kwargs)
        finally:
            after()

    return call


def _refuse_hooked(stages: list[Any], me: object) -> None:
    """ConfigError if another attached InstrumentedSchedule hooks one of ``stages``: hooks over its hooks report
    every wait twice, and the manager rejects the second of each (a schedule wrapped twice ran on with "12
    rejected" events and no word in the trainer)."""
    for stage in stages:
        owner = getattr(vars(stage).get("forward_one_chunk"), _OWNER, None)
        if owner is not None and owner is not me and owner.attached:
            raise ConfigError(f"model stage {int(stage.stage_index)} is instrumented already, by another "
                              "InstrumentedSchedule: close() that one first")


class InstrumentedSchedule:
    """A torch pipeline schedule whose waits are measured, predicted and reported.

    ``sink`` receives the bubbles (None: measure only); ``device`` is the rank's device name
    (``cpu:0``, ``cuda:1``: the clock and free-memory samples). ``on_iteration`` is called after each
    :meth:`step` with the iteration's reported bubbles; ``on_action_end`` (kind, model stage,
    micro-batch) at the end of every compute action, on the training thread (a measuring hook such as
    the trainer's memory probe: it must return in microseconds). ``clock``, ``predictor``,
    ``learning``, ``report_min_ns``, ``remodel_iterations`` and ``time_actions`` are
    :class:`RankTracker`'s.
    """

    def __init__(
        self,
        schedule: Any,
        sink: BubbleSink | None = None,
        *,
        device: str | None = None,
        predictor: BubblePredictor | None = None,
        on_iteration: Callable[[int, list[MeasuredBubble]], None] | None = None,
        remodel_iterations: int = 5,
        on_action_end: Callable[[str, int, int], None] | None = None,
        clock: Callable[[Callable[[Any, int], None]], MarkClock] | None = None,
        learning: LearningConfig | None = None,
        report_min_ns: int = 200_000,
        time_actions: bool = False,
    ) -> None:
        self.schedule = schedule
        self._stages, rank, orders, num_stages = self._inspect(schedule)
        _refuse_hooked(self._stages, self)  # before the tracker (and a device clock's thread) is made
        # The runtime waits for every send it posted once its last action is done (module doc).
        runtime = hasattr(schedule, "_stages") and hasattr(schedule, "pipeline_order_with_comms")
        self.tracker = RankTracker(
            orders, rank, sink, num_stages=num_stages, device=device, clock=clock, predictor=predictor,
            learning=learning, on_iteration=on_iteration, on_action_end=on_action_end,
            report_min_ns=report_min_ns, remodel_iterations=remodel_iterations, time_actions=time_actions,
            waits_follow_compute=True, schedule=type(schedule).__name__, sends_waited_at_end=runtime,
            stage_device=getattr(self._stages[0], "device", None),
        )
        self.rank = rank
        self._closed = self._said_closed = False
        self._restore: list[tuple[object, str, Any]] = []  # (object, attribute, its own value or _ABSENT)
        #: Whether the pops of posted receives are watched (a runtime schedule on the host clock: module doc).
        self.watches_receives = self.tracker.clock.synchronous and all(
            isinstance(vars(schedule).get(name), dict) for name in _RECV_OPS)
        #: Whether torch's ``_wait_batch_p2p`` marks this single-stage schedule's waits (the host clock:
        #: :class:`_WaitWatch`); set while attached.
        self.watches_waits = False
        self.attach()

    # ---------------------------------------------------------------- construction

    @staticmethod
    def _inspect(schedule: Any) -> tuple[list[Any], int, dict[int, list[Action]], int]:
        name = type(schedule).__name__
        try:
            from torch.distributed.pipelining.schedules import _PipelineSchedule
        except ImportError as exc:
            raise FrameworkNotInstalled(f"freeride's torch pipelining instrumentation needs torch ({exc}): install "
                                        "the training job's torch (its own build: a bare torch requirement pulls "
                                        "a CUDA build of several GB)") from exc
        if isinstance(schedule, InstrumentedSchedule):
            raise ConfigError(f"this {type(schedule.schedule).__name__} is instrumented already (it is an "
                              "InstrumentedSchedule): use it as it is")
        if isinstance(getattr(schedule, "__dict__", {}).get("instrumented"), InstrumentedSchedule):
            raise ConfigError(f"this {type(schedule).__name__} is instrumented already (freeride.training.torchtitan's "
                              "wrapper): use it as it is, or uninstrument it first")
        # A model, a stage or a wrapper passed by mistake read as a torch release that changed the internals
        # this hooks into: the wrong object is named as such (the internals check is for real schedules).
        if not isinstance(schedule, _PipelineSchedule) and not hasattr(schedule, "_stage") \
                and not hasattr(schedule, "_stages"):
            raise ConfigError(f"InstrumentedSchedule takes a torch.distributed.pipelining schedule (ScheduleGPipe, "
                              f"Schedule1F1B, ScheduleInterleaved1F1B, ...), got {name}")
        if hasattr(schedule, "_stages"):
            stages = list(schedule._stages)
            rank = int(_require(schedule, "rank", name))
            runtime = hasattr(schedule, "pipeline_order_with_comms")
            ir = schedule.pipeline_order_with_comms if runtime else _require(schedule, "pipeline_order", name)
            if not ir:
                raise PipeliningInternalsChanged(f"{name} has no pipeline order (is its CSV loaded?)")
            orders = torch_orders(ir)
            num_stages = int(_require(stages[0], "num_stages", "PipelineStage"))
        else:
            stage = _require(schedule, "_stage", name)
            stages = [stage]
            num_stages = int(_require(stage, "num_stages", "PipelineStage"))
            rank = int(_require(stage, "stage_index", "PipelineStage"))
            microbatches = int(_require(schedule, "_n_microbatches", name))
            model = build_schedule(_single_schedule_name(schedule), num_stages, microbatches)
            orders = {r: list(a) for r, a in model.orders.items()}
        for stage in stages:
            for method in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                _require(stage, method, "PipelineStage")
            _require(stage, "stage_index", "PipelineStage")
        if rank not in orders or not orders[rank]:
            raise PipeliningInternalsChanged(f"rank {rank} has no actions in the schedule's order")
        return stages, rank, orders, num_stages

    def _set(self, obj: object, attr: str, value: Any) -> None:
        """Set an instance attribute, remembering what :meth:`detach` restores."""
        own = attr in vars(obj)
        self._restore.append((obj, attr, vars(obj)[attr] if own else _ABSENT))
        setattr(obj, attr, value)

    def _wrap(self, stage: Any) -> None:
        index = int(stage.stage_index)
        fwd = stage.forward_one_chunk
        bwd = stage.backward_one_chunk
        wgt = stage.backward_weight_one_chunk
        begin, end = self.tracker.compute_begin, self.tracker.compute_end

        def forward_one_chunk(fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            begin(FORWARD, index, fwd_chunk_id)
            try:
                return fwd(fwd_chunk_id, *args, **kwargs)
            finally:
                end(FORWARD, index, fwd_chunk_id)

        def backward_one_chunk(bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            full = kwargs.get("full_backward", args[1] if len(args) > 1 else True)
            kind = BACKWARD if full else BACKWARD_INPUT
            begin(kind, index, bwd_chunk_id)
            try:
                return bwd(bwd_chunk_id, *args, **kwargs)
            finally:
                end(kind, index, bwd_chunk_id)

        def backward_weight_one_chunk(bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            begin(BACKWARD_WEIGHT, index, bwd_chunk_id)
            try:
                return wgt(bwd_chunk_id, *args, **kwargs)
            finally:
                end(BACKWARD_WEIGHT, index, bwd_chunk_id)

        setattr(forward_one_chunk, _OWNER, self)
        self._set(stage, "forward_one_chunk", forward_one_chunk)
        self._set(stage, "backward_one_chunk", backward_one_chunk)
        self._set(stage, "backward_weight_one_chunk", backward_weight_one_chunk)

    def _then_waiting(self, compute_loss: Callable[..., Any]) -> Callable[..., Any]:
        """After a last stage's forward and its loss: a wait starts if the rank waits here."""
        tracker = self.tracker
        positions = frozenset(tracker.plan.positions)

        def maybe_compute_loss(*args: Any, **kwargs: Any) -> Any:
            result = compute_loss(*args, **kwargs)
            if tracker.position in positions:
                tracker.wait_begin()
            return result

        return maybe_compute_loss

    @property
    def attached(self) -> bool:
        return bool(self._restore)

    def attach(self) -> None:
        """Hook the stages' methods and the schedule's ``step`` (done at construction; again after
        :meth:`detach`)."""
        if self._restore:
            return
        _refuse_hooked(self._stages, self)
        for stage in self._stages:
            self._wrap(stage)
        if self.watches_receives:
            for name in _RECV_OPS:
                self._set(self.schedule, name, _RecvOps(getattr(self.schedule, name), self.tracker.wait_blocks))
        # The schedule's own ``step`` is measured too: a trainer that calls ``schedule.step`` while the wrapper is
        # attached (a loop written before freeride, a library's) had its stages' marks fall outside any iteration,
        # and half its iterations went unreported.
        tracker = self.tracker
        step = _between(tracker.iteration_begin, self.schedule.step, tracker.iteration_end)
        if tracker.clock.synchronous and not self.watches_receives and hasattr(self.schedule, "_stage"):
            self.watches_waits = _WaitWatch.acquire()
            if self.watches_waits:
                step = _WaitWatch.entered(step, tracker.wait_blocks)
        self._set(self.schedule, "step", step)
        own_eval = getattr(self.schedule, "eval", None)
        if callable(own_eval):
            # torch's ``eval`` runs ``self.step`` forward only: validation is not training, and measured, its
            # forward-only iterations would be read against the training order. It runs bare.
            self._set(self.schedule, "eval", _between(self.detach, own_eval, self.attach))
        holds_last = any(int(stage.stage_index) == self.tracker.plan.num_stages - 1 for stage in self._stages)
        if holds_last:  # the loss follows the last stage's forwards: the wait after one starts after it
            compute_loss = _require(self.schedule, "_maybe_compute_loss", type(self.schedule).__name__)
            self._set(self.schedule, "_maybe_compute_loss", self._then_waiting(compute_loss))

    def detach(self) -> None:
        """Restore the stages' own methods: :meth:`step` then runs the bare schedule.

        Used by A/B measurements (instrumented and bare iterations interleaved in one run).
        """
        if self.watches_waits:
            self.watches_waits = False
            _WaitWatch.release()
        for obj, attr, saved in reversed(self._restore):
            watched = vars(obj).get(attr)
            if isinstance(watched, _RecvOps):  # receives posted meanwhile stay the runtime's
                watched.own.clear()
                watched.own.update(watched)
            if saved is not _ABSENT:
                setattr(obj, attr, saved)
            else:
                vars(obj).pop(attr, None)
        self._restore.clear()

    def close(self) -> None:
        """Deliver what the device clock still holds, stop it, and restore the stages' own methods (the
        schedule keeps working, uninstrumented). On CUDA this waits for the device's pending work."""
        self.tracker.close()
        self.detach()
        self._closed = True

    # ---------------------------------------------------------------- iteration

    def step(self, *args: Any, **kwargs: Any) -> Any:
        """Run one iteration of the wrapped schedule (same arguments as its ``step``): the schedule's ``step``,
        measured while attached (:meth:`attach` hooks it), bare once detached."""
        if not self._restore and self._closed and not self._said_closed:
            self._said_closed = True  # a step after close() went on unmeasured without a word
            log.warning("InstrumentedSchedule.step() after close(): the schedule runs, and its bubbles are no "
                        "longer measured or reported")
        return self.schedule.step(*args, **kwargs)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait for the device clock to resolve every mark, then deliver (off the training path)."""
        return self.tracker.flush(timeout_s)

    def eval(self, *args: Any, **kwargs: Any) -> Any:
        """A forward-only pass of the wrapped schedule (same arguments as its ``eval``), run bare: validation is
        not training, and its iterations would be read against the training order (:meth:`attach`)."""
        return self.schedule.eval(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        """Any other attribute is the wrapped schedule's, as if the trainer held the schedule itself (a stranger's
        trainer, the wrapper in the schedule's place, failed at its ``eval``). Reading only: what a trainer sets
        lands on the wrapper."""
        schedule = self.__dict__.get("schedule")
        if schedule is None or name.startswith("__"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(schedule, name)

    # ---------------------------------------------------------------- the tracker's results

    @property
    def iteration(self) -> int:
        return self.tracker.iteration

    @property
    def on_iteration(self) -> Callable[[int, list[MeasuredBubble]], None] | None:
        return self.tracker.on_iteration

    @on_iteration.setter
    def on_iteration(self, callback: Callable[[int, list[MeasuredBubble]], None] | None) -> None:
        self.tracker.on_iteration = callback

    @property
    def slots(self) -> tuple[IdleSlot, ...]:
        """The modelled slots of this rank (slot id = position in its order), modelled lengths in ns."""
        return self.tracker.slots

    @property
    def learned(self) -> WaitLearner:
        return self.tracker.learned

    @property
    def predictor(self) -> BubblePredictor:
        return self.tracker.predictor

    @property
    def profile(self) -> ComputeProfile:
        return self.tracker.profile

    @property
    def clock(self) -> MarkClock:
        return self.tracker.clock

    @property
    def unplanned_waits(self) -> int:
        return self.tracker.unplanned_waits

    @property
    def unplanned_wait_ns(self) -> int:
        return self.tracker.unplanned_wait_ns

    @property
    def last_bubbles(self) -> list[MeasuredBubble]:
        return self.tracker.last_bubbles

    @property
    def last_actions(self) -> list[MeasuredAction]:
        return self.tracker.last_actions
