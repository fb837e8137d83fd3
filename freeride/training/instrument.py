"""Instrumentation of ``torch.distributed.pipelining``: every idle slot of a stage, as it happens.

Wrap a schedule and call :meth:`InstrumentedSchedule.step` instead of ``schedule.step``::

    schedule = Schedule1F1B(stage, n_microbatches=8, loss_fn=loss_fn)
    reporter = BubbleReporter(device="cuda:0", stage=pp_rank, rank=dist.get_rank())
    instrumented = InstrumentedSchedule(schedule, sink=reporter, device="cuda:0")
    for batch in data:
        instrumented.step(...)          # same arguments as schedule.step
        optimizer.step()

**Where the waits are.** A pipeline stage is idle exactly between the end of one compute action
(a forward, backward, input- or weight-gradient of one micro-batch) and the start of the next: all
that runs in between is the posting of P2P sends and the ``Work.wait()`` on the receives that the
next action needs (``_wait_batch_p2p`` in torch's schedules). So the instrumentation wraps the
stage's compute entry points -- ``forward_one_chunk``, ``backward_one_chunk`` and
``backward_weight_one_chunk`` of every ``PipelineStage`` the schedule drives -- on the stage
*instance* (no class or module is patched; :meth:`InstrumentedSchedule.close` restores them). The end
of an action starts a bubble and the entry of the next ends it, with the receive wait in between.
The bubble across iterations (``boundary``: a stage's tail plus the next iteration's warm-up)
starts when :meth:`step` is entered, after the user's optimizer step, and ends at the first action.

**Which gaps are bubbles.** The schedule's action order -- read off ``pipeline_order`` for torch's
runtime schedules (interleaved, zero-bubble, any ``_PipelineScheduleRuntime``), and from
:mod:`freeride.training.schedules` for ``ScheduleGPipe`` and ``Schedule1F1B`` (whose ``pipeline_order`` is a
drawing only, and in torch 2.13 misnumbers the last rank's forwards) -- is simulated with the model's
reference cost ratio (``t_forward : t_backward``, default 1 : 2) to find each rank's idle slots in
the cyclic layout. Those slots are reported, with the slot's index as its stable identity. Any other
gap (stage imbalance, communication latency where the model has none) is measured per position in
the order and counted as *unplanned* (``unplanned_waits``); one that recurs with a stable length
becomes a *learned* slot and is reported from then on, with an id of its own and ``learned=True``
(:mod:`freeride.training.learned_slots`).

**Predicted lengths** come from :class:`freeride.training.predictor.BubblePredictor`: the model evaluated
with online-profiled action times until a slot has been measured a few times, then the recent
median of that slot's measured lengths. **Free memory** is sampled once per iteration on entry to
:meth:`step` (CPU: ``psutil.virtual_memory().available``; CUDA: ``torch.cuda.mem_get_info``, which
does not synchronise the device) and adjusted per bubble by the caching allocator's host-side
``memory_reserved`` counter. Nothing here calls ``torch.cuda.synchronize``.

**Device time on CUDA.** Compute entry points return once kernels are queued, and with NCCL the
receive wait makes the stream wait, not the host, so host timestamps around actions would measure
launch overhead, not the idle GPU. On CUDA every hook therefore records a CUDA event on the stage's
stream instead of reading the host clock (:mod:`freeride.training.device_clock`); a thread resolves
the events in order to host ``CLOCK_MONOTONIC`` times and reports each bubble's start and end as soon
as the device reaches them. The predictor and the compute profile learn these device times; the
results of an iteration (its bubbles for the predictor, ``on_iteration``, :attr:`last_bubbles`) are
delivered on the training thread at the next :meth:`InstrumentedSchedule.step` (or :meth:`flush`)
after the device finished them: the training thread never waits for the device. On ``cpu:N`` the host
clock is the device's and everything is delivered as it happens.

**Internals relied upon** (checked at construction; :class:`PipeliningInternalsChanged` names what
is missing): ``schedule._stage`` (single-stage schedules) or ``schedule._stages``, ``.rank``,
``.pp_group_size`` and ``.pipeline_order`` (runtime schedules); ``stage.stage_index``,
``stage.num_stages``, ``stage.group_rank`` and the three compute methods with their first argument
the micro-batch index and ``full_backward`` the third of ``backward_one_chunk``.
"""

from __future__ import annotations

import collections
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from freeride.errors import FreerideError
from freeride.messages import UNKNOWN_MEMORY
from freeride.training.device_clock import CudaEventClock, HostClock, MarkClock
from freeride.training.learned_slots import LEARNED_KIND, LearningConfig, WaitLearner
from freeride.training.predictor import BubblePredictor, ComputeProfile
from freeride.training.schedules import (
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    BOUNDARY,
    FORWARD,
    Action,
    IdleSlot,
    Schedule,
    build_schedule,
    schedule_from_orders,
)

log = logging.getLogger(__name__)

_ActionKey = tuple[str, int, int]  # (kind, stage index, micro-batch)


class PipeliningInternalsChanged(FreerideError):
    """The installed torch no longer has the pipelining internals this module hooks into."""


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


@dataclass(frozen=True)
class MeasuredBubble:
    """One bubble as the stage saw it."""

    iteration: int
    slot: int
    kind: str
    start_ns: int
    end_ns: int
    predicted_ns: int
    free_memory_bytes: int

    @property
    def length_ns(self) -> int:
        return self.end_ns - self.start_ns


@dataclass(frozen=True)
class MeasuredAction:
    """One compute action as the stage ran it: ``kind`` of ``microbatch`` on model stage ``stage``."""

    kind: str
    stage: int
    microbatch: int
    start_ns: int
    end_ns: int

    @property
    def length_ns(self) -> int:
        return self.end_ns - self.start_ns


class MemorySampler:
    """Free device memory for bubble reports, never synchronising the device.

    :meth:`refresh` (called between iterations) takes one real sample at most every
    ``refresh_interval_s`` (a host memory query costs tens of microseconds, too much for every
    iteration of a fast pipeline); :meth:`free_bytes` (called at each bubble start) adjusts the
    sample by how much the caching allocator reserved since (CUDA), or returns it (CPU).
    """

    def __init__(self, device: str | None, refresh_interval_s: float = 0.5) -> None:
        self._interval_ns = int(refresh_interval_s * 1e9)
        self._last_ns = -self._interval_ns
        self._cuda_index: int | None = None
        if device and device.startswith("cuda"):
            self._cuda_index = int(device.split(":", 1)[1]) if ":" in device else 0
        self._free = UNKNOWN_MEMORY
        self._reserved_at_sample = 0
        self._enabled = device is not None

    def refresh(self) -> None:
        if not self._enabled:
            return
        now = time.monotonic_ns()
        if now - self._last_ns < self._interval_ns and self._free >= 0:
            return
        self._last_ns = now
        try:
            if self._cuda_index is None:
                import psutil

                self._free = int(psutil.virtual_memory().available)
            else:
                import torch

                self._free = int(torch.cuda.mem_get_info(self._cuda_index)[0])
                self._reserved_at_sample = int(torch.cuda.memory_reserved(self._cuda_index))
        except Exception:  # noqa: BLE001 - a missing figure is reported as unknown, never raised
            self._free = UNKNOWN_MEMORY

    def free_bytes(self) -> int:
        if self._cuda_index is None or self._free < 0:
            return self._free
        try:
            import torch

            grown = int(torch.cuda.memory_reserved(self._cuda_index)) - self._reserved_at_sample
        except Exception:  # noqa: BLE001
            return self._free
        return max(0, self._free - grown)


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


def _orders_from_torch(pipeline_order: dict[int, list[Any]]) -> dict[int, list[Action]]:
    """Compute actions per rank from torch's schedule IR (communication and None dropped)."""
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


def gap_length(schedule: Schedule, rank: int, slot: IdleSlot) -> float:
    """The length of the gap ``slot`` delimits, in ``schedule``'s (re-simulated) timeline."""
    times = {t.action: t for t in schedule.timeline[rank]}
    if slot.kind == BOUNDARY:
        timeline = schedule.timeline[rank]
        if not timeline:
            return 0.0
        return (schedule.makespan - timeline[-1].end) + timeline[0].start
    if slot.before is None or slot.after is None or slot.before not in times or slot.after not in times:
        return 0.0
    return max(0.0, times[slot.before].start - times[slot.after].end)


class InstrumentedSchedule:
    """A torch pipeline schedule whose idle slots are measured, predicted and reported.

    ``sink`` receives the bubbles (None: measure only). ``device`` is the stage's device name
    (``cpu:0``, ``cuda:1``) for free-memory samples. ``t_forward`` and ``t_backward`` fix the cost
    ratio of the slot layout (any unit); ``on_iteration`` is called after each :meth:`step` with the
    iteration's measured bubbles; ``on_action_end`` (kind, model stage, micro-batch) at the end of
    every compute action, on the training thread, before the bubble it may open starts (a measuring
    hook such as the trainer's memory probe: it must return in microseconds). ``clock`` makes the clock
    that stamps the hooks from the consumer it must deliver to (default: CUDA events on ``cuda:N``, the
    host clock otherwise; see the module doc).
    """

    def __init__(
        self,
        schedule: Any,
        sink: BubbleSink | None = None,
        *,
        device: str | None = None,
        t_forward: float = 1.0,
        t_backward: float = 2.0,
        t_weight: float | None = None,
        predictor: BubblePredictor | None = None,
        on_iteration: Callable[[int, list[MeasuredBubble]], None] | None = None,
        remodel_iterations: int = 5,
        on_action_end: Callable[[str, int, int], None] | None = None,
        clock: Callable[[Callable[[Any, int], None]], MarkClock] | None = None,
        learning: LearningConfig | None = None,
    ) -> None:
        self.schedule = schedule
        self.sink = sink
        self.on_iteration = on_iteration
        self.on_action_end = on_action_end
        self.iteration = 0
        self.profile = ComputeProfile()
        self.memory = MemorySampler(device)
        self._remodel_left = remodel_iterations
        self._stages, self.rank, orders, num_stages, virtual, name = self._inspect(schedule)
        self._t_weight = t_weight
        self.layout = schedule_from_orders(
            name, orders, num_stages, t_forward, t_backward,
            t_backward / 2 if t_weight is None else t_weight, virtual=virtual,
        )
        self._orders = orders
        self._num_stages = num_stages
        self._virtual = virtual
        self.slots: tuple[IdleSlot, ...] = self.layout.cyclic_slots(self.rank)
        self._order_keys: list[_ActionKey] = [(a.kind, a.stage, a.microbatch) for a in orders[self.rank]]
        # Lookups for the hot path: the slot a finished action opens, and the boundary slot.
        self._opens: dict[_ActionKey, IdleSlot] = {}
        self._boundary: IdleSlot | None = None
        for slot in self.slots:
            if slot.kind == BOUNDARY:
                self._boundary = slot
            elif slot.after is not None:
                self._opens[(slot.after.kind, slot.after.stage, slot.after.microbatch)] = slot
        self._model_ns: dict[int, float] = {}
        self.predictor = predictor or BubblePredictor()
        self.predictor.set_model(lambda stage, slot: self._model_ns.get(slot))
        self._remodel(default_ns=True)
        #: Recurring waits the model does not list, learned into slots (``learning``; max_slots=0: off).
        self.learned = WaitLearner(self.rank, self._order_keys, learning)

        # What the hooks stamp and the clock delivers, in order (the timeline's own thread on CUDA).
        self._timeline = _Timeline(self)
        self._cursor = 0  # position in the schedule's order (training thread)
        self._order_warned = False
        self._bubbles: list[MeasuredBubble] = []  # of the last delivered iteration
        self._actions: list[MeasuredAction] = []
        self.clock: MarkClock = (clock or functools.partial(_default_clock, device))(self._timeline.handle)
        self._restore: list[tuple[object, str]] = []
        self.attach()

    # ---------------------------------------------------------------- construction

    @staticmethod
    def _inspect(schedule: Any) -> tuple[list[Any], int, dict[int, list[Action]], int, int, str]:
        if hasattr(schedule, "_stages"):
            stages = list(schedule._stages)
            rank = int(_require(schedule, "rank", type(schedule).__name__))
            pipeline_order = _require(schedule, "pipeline_order", type(schedule).__name__)
            if not pipeline_order:
                raise PipeliningInternalsChanged(f"{type(schedule).__name__}.pipeline_order is empty")
            orders = _orders_from_torch(pipeline_order)
            num_stages = int(_require(stages[0], "num_stages", "PipelineStage"))
            pp = int(_require(schedule, "pp_group_size", type(schedule).__name__))
            name = type(schedule).__name__
            virtual = max(1, num_stages // pp)
        else:
            stage = _require(schedule, "_stage", type(schedule).__name__)
            stages = [stage]
            num_stages = int(_require(stage, "num_stages", "PipelineStage"))
            rank = int(_require(stage, "stage_index", "PipelineStage"))
            microbatches = int(_require(schedule, "_n_microbatches", type(schedule).__name__))
            name = _single_schedule_name(schedule)
            orders = {r: list(a) for r, a in build_schedule(name, num_stages, microbatches).orders.items()}
            virtual = 1
        for stage in stages:
            for method in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                _require(stage, method, "PipelineStage")
            _require(stage, "stage_index", "PipelineStage")
        if rank not in orders:
            raise PipeliningInternalsChanged(f"rank {rank} has no actions in the schedule's order")
        return stages, rank, orders, num_stages, virtual, name

    def _wrap(self, stage: Any) -> None:
        index = int(stage.stage_index)
        fwd = stage.forward_one_chunk
        bwd = stage.backward_one_chunk
        wgt = stage.backward_weight_one_chunk
        enter, leave = self._enter, self._leave

        def forward_one_chunk(fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            enter(FORWARD, index, fwd_chunk_id)
            try:
                return fwd(fwd_chunk_id, *args, **kwargs)
            finally:
                leave(FORWARD, index, fwd_chunk_id)

        def backward_one_chunk(bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            full = kwargs.get("full_backward", args[1] if len(args) > 1 else True)
            kind = BACKWARD if full else BACKWARD_INPUT
            enter(kind, index, bwd_chunk_id)
            try:
                return bwd(bwd_chunk_id, *args, **kwargs)
            finally:
                leave(kind, index, bwd_chunk_id)

        def backward_weight_one_chunk(bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            enter(BACKWARD_WEIGHT, index, bwd_chunk_id)
            try:
                return wgt(bwd_chunk_id, *args, **kwargs)
            finally:
                leave(BACKWARD_WEIGHT, index, bwd_chunk_id)

        for attr, fn in (
            ("forward_one_chunk", forward_one_chunk),
            ("backward_one_chunk", backward_one_chunk),
            ("backward_weight_one_chunk", backward_weight_one_chunk),
        ):
            had_instance_attr = attr in vars(stage)
            setattr(stage, attr, fn)
            if not had_instance_attr:
                self._restore.append((stage, attr))

    @property
    def attached(self) -> bool:
        return bool(self._restore)

    def attach(self) -> None:
        """Hook the stages' compute methods (done at construction; again after :meth:`detach`)."""
        if not self._restore:
            for stage in self._stages:
                self._wrap(stage)

    def detach(self) -> None:
        """Restore the stages' own methods: :meth:`step` then runs the bare schedule.

        Used by A/B measurements (instrumented and bare iterations interleaved in one run).
        """
        for stage, attr in self._restore:
            try:
                delattr(stage, attr)
            except AttributeError:
                pass
        self._restore.clear()

    def close(self) -> None:
        """Deliver what the device clock still holds, stop it, and restore the stages' own methods (the
        schedule keeps working, uninstrumented). On CUDA this waits for the device's pending work."""
        self.flush()
        self.clock.close()
        self.detach()

    # ---------------------------------------------------------------- model

    def _remodel(self, default_ns: bool = False) -> None:
        """Re-simulate the order with profiled action times; refresh the modelled slot lengths."""
        scale = 1_000_000.0  # 1 ms per unit of the layout's costs until measured
        tf = self.profile.mean_ns(FORWARD, 0.0)
        tb = self.profile.mean_ns(BACKWARD, 0.0) or (
            self.profile.mean_ns(BACKWARD_INPUT, 0.0) + self.profile.mean_ns(BACKWARD_WEIGHT, 0.0)
        )
        if default_ns or tf <= 0 or tb <= 0:
            model = self.layout
            factor = scale
        else:
            # Profiled times are per chunk; the model counts a rank's whole share of the model.
            tw = self.profile.mean_ns(BACKWARD_WEIGHT, 0.0) or tb / 2
            try:
                model = schedule_from_orders(
                    self.layout.name, self._orders, self._num_stages,
                    tf * self._virtual, tb * self._virtual, min(tw * self._virtual, tb * self._virtual * 0.99),
                    virtual=self._virtual,
                )
            except FreerideError:
                return
            factor = 1.0
        self._model_ns = {s.index: gap_length(model, self.rank, s) * factor for s in self.slots}

    # ---------------------------------------------------------------- hot path (training thread)

    def _enter(self, kind: str, stage: int, microbatch: int) -> None:
        key = (kind, stage, microbatch)
        if self._cursor < len(self._order_keys) and self._order_keys[self._cursor] != key:
            self._order_mismatch(key)
        self._cursor += 1
        self.clock.mark((_ENTER, key, None))

    def _leave(self, kind: str, stage: int, microbatch: int) -> None:
        if self.on_action_end is not None:
            self.on_action_end(kind, stage, microbatch)
        key = (kind, stage, microbatch)
        slot = self._opens.get(key) or self.learned.opens.get(key)
        opens = None if slot is None else (slot, self.predictor.predict_ns(self.rank, slot.index),
                                           self.memory.free_bytes())
        self.clock.mark((_LEAVE, key, opens))

    def _order_mismatch(self, key: _ActionKey) -> None:
        if not self._order_warned:
            self._order_warned = True
            log.warning(
                "[rank %d] torch ran %s%s%d where the schedule's order has %s at position %d: bubble "
                "slots may be misattributed (torch pipelining changed?)",
                self.rank, key[1], key[0], key[2], self._order_keys[self._cursor], self._cursor,
            )

    # ---------------------------------------------------------------- iteration

    def step(self, *args: Any, **kwargs: Any) -> Any:
        """Run one iteration of the wrapped schedule (same arguments as its ``step``)."""
        self._deliver()
        if not self._restore:  # detached: the bare schedule, nothing measured or reported
            self._bubbles = []
            self._actions = []
            return self.schedule.step(*args, **kwargs)
        self.memory.refresh()
        self._cursor = 0
        boundary = None
        if self._boundary is not None:
            boundary = (self._boundary, self.predictor.predict_ns(self.rank, self._boundary.index),
                        self.memory.free_bytes())
        self.clock.mark((_BEGIN, self.iteration, boundary))
        try:
            return self.schedule.step(*args, **kwargs)
        finally:
            self.clock.mark((_FINISH, self.iteration, None))
            self.iteration += 1
            if self.clock.synchronous:
                self._deliver()

    def _deliver(self) -> None:
        """Learn from, and hand out, every iteration the clock has finished (training thread)."""
        while True:
            try:
                iteration, bubbles, actions, gaps = self._timeline.done.popleft()
            except IndexError:
                return
            for b in bubbles:
                self.predictor.observe(self.rank, b.slot, b.length_ns, b.predicted_ns)
            self._learn(gaps, bubbles)
            for a in actions:
                self.profile.observe(a.kind, a.length_ns)
            if self._remodel_left > 0 and self.profile.samples(FORWARD):
                self._remodel_left -= 1
                self._remodel()
            self._bubbles, self._actions = bubbles, actions
            if self.on_iteration is not None:
                try:
                    self.on_iteration(iteration, list(bubbles))
                except Exception:  # noqa: BLE001 - a logging callback must not break training
                    log.exception("on_iteration callback failed")

    def _learn(self, gaps: list[tuple[_ActionKey, int]], bubbles: list[MeasuredBubble]) -> None:
        learned = [(b.slot, b.length_ns) for b in bubbles if b.kind == LEARNED_KIND]
        for slot in self.learned.observe(gaps, learned):
            assert slot.after is not None
            for length in self.learned.lengths((slot.after.kind, slot.after.stage, slot.after.microbatch)):
                self.predictor.observe(self.rank, slot.index, length)  # its first prediction: what recurred
            log.info("[rank %d] a wait after %s%d of micro-batch %d recurs (%.2f ms): learned slot %d",
                     self.rank, slot.after.kind, slot.after.stage, slot.after.microbatch, slot.length / 1e6,
                     slot.index)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait for the device clock to resolve every mark, then deliver (off the training path: at the
        end of training, or in a test). True when everything was delivered."""
        done = self.clock.flush(timeout_s)
        self._deliver()
        return done

    @property
    def unplanned_waits(self) -> int:
        """Gaps between compute actions that no modelled slot names (see the module doc)."""
        return self._timeline.unplanned_waits

    @property
    def unplanned_wait_ns(self) -> int:
        return self._timeline.unplanned_wait_ns

    @property
    def last_bubbles(self) -> list[MeasuredBubble]:
        """The bubbles of the last iteration delivered (on CUDA, the last the device finished)."""
        return list(self._bubbles)

    @property
    def last_actions(self) -> list[MeasuredAction]:
        """The compute actions of the last iteration delivered, timed as the bubbles are."""
        return list(self._actions)


_BEGIN, _ENTER, _LEAVE, _FINISH = "begin", "enter", "leave", "finish"
_Opens = tuple[IdleSlot, int, int] | None  # slot, predicted ns, free bytes


def _default_clock(device: str | None, consumer: Callable[[Any, int], None]) -> MarkClock:
    """CUDA events on a CUDA device that torch can use; the host clock everywhere else."""
    if device and device.startswith("cuda"):
        import torch

        if torch.cuda.is_available():
            return CudaEventClock(consumer, int(device.split(":", 1)[1]) if ":" in device else 0)
    return HostClock(consumer)


class _Timeline:
    """Turns the stamped hooks of one stage, in order, into bubbles, actions and unplanned waits.

    Runs wherever the clock delivers (the training thread on CPU, the device clock's thread on CUDA);
    it reports to the sink as it goes and queues each finished iteration for the training thread.
    """

    def __init__(self, owner: InstrumentedSchedule) -> None:
        self._owner = owner
        self.done: collections.deque[
            tuple[int, list[MeasuredBubble], list[MeasuredAction], list[tuple[_ActionKey, int]]]
        ] = collections.deque()
        self.unplanned_waits = 0
        self.unplanned_wait_ns = 0
        self._gaps: list[tuple[_ActionKey, int]] = []  # unplanned waits of this iteration, by opening action
        self._last_key: _ActionKey | None = None
        self._iteration = 0
        self._open: tuple[IdleSlot, int, int, int] | None = None  # slot, start, predicted, free
        self._last_end_ns: int | None = None
        self._entered: dict[_ActionKey, int] = {}
        self._bubbles: list[MeasuredBubble] = []
        self._actions: list[MeasuredAction] = []

    def handle(self, payload: tuple[str, Any, Any], at_ns: int) -> None:
        what, key, opens = payload
        if what == _ENTER:
            self._close(at_ns, unplanned=True)
            self._entered[key] = at_ns
        elif what == _LEAVE:
            begin = self._entered.pop(key, at_ns)
            self._actions.append(MeasuredAction(key[0], key[1], key[2], begin, at_ns))
            if opens is not None:
                self._start(opens, at_ns)
                self._last_end_ns = None
            else:
                self._last_end_ns = at_ns
                self._last_key = key
        elif what == _BEGIN:
            self._iteration, self._bubbles, self._actions, self._gaps = key, [], [], []
            self._last_end_ns = None
            self._entered.clear()
            if opens is not None:
                self._start(opens, at_ns)
        else:  # _FINISH: the schedule ended (inside a slot only on an exception or an odd order)
            self._close(at_ns, unplanned=False)
            self.done.append((key, self._bubbles, self._actions, self._gaps))
            self._bubbles, self._actions, self._gaps = [], [], []

    def _start(self, opens: tuple[IdleSlot, int, int], at_ns: int) -> None:
        slot, predicted, free = opens
        self._open = (slot, at_ns, predicted, free)
        sink = self._owner.sink
        if sink is not None:
            if slot.kind == LEARNED_KIND:
                sink.bubble_start(self._iteration, slot.index, slot.kind, predicted, free, at_ns, learned=True)
            else:
                sink.bubble_start(self._iteration, slot.index, slot.kind, predicted, free, at_ns)

    def _close(self, at_ns: int, unplanned: bool) -> None:
        opened = self._open
        if opened is not None:
            slot, start, predicted, free = opened
            self._open = None
            sink = self._owner.sink
            if sink is not None:
                sink.bubble_end(self._iteration, slot.index, at_ns)
            self._bubbles.append(MeasuredBubble(self._iteration, slot.index, slot.kind, start, at_ns, predicted, free))
        elif unplanned and self._last_end_ns is not None:
            self.unplanned_waits += 1
            self.unplanned_wait_ns += at_ns - self._last_end_ns
            if self._last_key is not None:
                self._gaps.append((self._last_key, at_ns - self._last_end_ns))
            self._last_end_ns = None
