"""Instrumentation of DeepSpeed's pipeline engine, from outside: no fork, no patched module.

After ``deepspeed.initialize`` returns a ``PipelineEngine`` (or a ``DualPipeVEngine``)::

    from freeride.training import BubbleReporter
    from freeride.training.deepspeed import instrument

    reporter = BubbleReporter(device, stage=engine.stage_id, rank=dist.get_rank())
    instrument(engine, reporter)
    for _ in range(steps):
        engine.train_batch(data_iter)

:func:`uninstrument` gives the engine back exactly as it was. Importing this module does not import
DeepSpeed; :func:`instrument` does, and says which extra to install when it is missing.

**Hooks.** ``PipelineEngine._exec_schedule`` runs each instruction of its schedule through
``self._INSTRUCTION_MAP[type(cmd)]``, a dict of plain functions it binds to the engine at each call.
The lookup goes through the instance, so an instance-level map of wrapped functions sees every
instruction while the class (and every other engine) stays untouched; the same holds for
``train_batch``, ``_aggregate_total_loss`` and ``clip_fp32_gradients``, which the engine calls
through ``self``. (Wrapping ``engine._exec_forward_pass`` on the instance would do nothing: the
dispatch binds the map's function, not the attribute.) An instance-level map someone set before is
wrapped in turn and put back by :func:`uninstrument`.

**Marks** go to a :class:`freeride.training.tracker.RankTracker`, which maps waits to the planned
idle slots, predicts, reports and learns:

* ``train_batch`` is one iteration (``iteration_begin`` / ``iteration_end``); ``eval_batch`` and
  anything else run outside it pass through unmarked.
* ``ForwardPass`` / ``BackwardPass`` are the compute actions. An instruction carries only a cycling
  ``buffer_id``, so the micro-batch is counted: the k-th forward (backward) of a model stage in an
  iteration is micro-batch k, as in ``TrainSchedule._step_to_micro_batch`` and DualPipeV's per-phase
  counters. On a DualPipeV engine an instruction's ``phase`` names the model stage: ``stage_id`` for
  phase 0, ``2 * num_stages - 1 - stage_id`` for phase 1.
* Waits: the blocking ``SendActivation``, ``RecvActivation``, ``SendGrad`` and ``RecvGrad`` of the
  ``TrainSchedule`` (on DualPipeV those only queue operations, and ``CommitP2P`` waits for them). A
  run of such instructions with nothing else between them is one wait: it starts at the first and
  ends where the next other instruction (the micro-batch load, a compute action, the reductions)
  begins, so a receive and the send the schedule places beside it (``RecvGrad`` then
  ``SendActivation`` on a stage that is not the last) make one bubble, the one the model plans there.
* The two waits outside the instructions, both synchronising every stage of the pipe at the end of
  an iteration: the loss broadcast of ``_aggregate_total_loss`` (the whole call: a few tensor
  operations around one broadcast), and with gradient clipping on fp32 the gradient-norm all-reduce
  in ``OptimizerStep``: from the moment ``clip_grad_norm_`` asks the engine's grid for its
  model-parallel group (right before it all-reduces) to the return of ``clip_fp32_gradients``, so
  the wait's end includes the clip's own scaling of the gradients (one pass over them). With fp16,
  bf16 or ZeRO the clipping runs inside DeepSpeed's optimizer wrappers, and that wait is not seen: it
  is then part of ``OptimizerStep``'s time, as on a data-parallel group ``ReduceGrads`` is.

The tracker knows these as waits at the tail of the order (after the last action) and across the
boundary: the last stage's final ``SendGrad`` is its planned tail wait; the gradient-norm and loss
waits come after it in the same gap, and become learned slots once they recur with stable lengths;
the next ``train_batch``'s first receive is the ``boundary`` slot.

**Plan.** The order of every rank comes from the engine's own schedule class (the ``TrainSchedule``,
or DualPipeV's), instantiated for each ``stage_id`` and walked once (:func:`planned_orders`). If the
number of micro-batches changes (``set_train_batch_size``), the next ``train_batch`` plans again.

**Device time.** The tracker stamps marks with the device's clock: CUDA events on ``cuda:N`` (nothing
on the training thread waits for the device), the host clock on CPU.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from freeride.errors import ConfigError, FrameworkNotInstalled, FreerideError
from freeride.training.learned_slots import LearningConfig
from freeride.training.schedules import BACKWARD, FORWARD, Action
from freeride.training.tracker import (
    BubbleSink,
    KeptShapes,
    MeasuredBubble,
    RankTracker,
    torch_device_name,
)

log = logging.getLogger(__name__)

#: Instructions that wait for another rank on a ``PipelineEngine`` (blocking point-to-point).
BLOCKING_P2P = ("SendActivation", "RecvActivation", "SendGrad", "RecvGrad")
#: The one that waits on a DualPipeV engine (its sends and receives only queue operations).
COMMIT_P2P = "CommitP2P"
_COMPUTE = {"ForwardPass": FORWARD, "BackwardPass": BACKWARD}


class DeepSpeedInternalsChanged(FreerideError):
    """The installed DeepSpeed lacks the pipeline-engine internals this module hooks into."""


class _Marks(Protocol):
    """What the hooks call: :class:`~freeride.training.tracker.RankTracker`'s marks."""

    def iteration_begin(self) -> None: ...
    def iteration_end(self) -> None: ...
    def compute_begin(self, kind: str, stage: int, microbatch: int) -> None: ...
    def compute_end(self, kind: str, stage: int, microbatch: int) -> None: ...
    def wait_begin(self) -> None: ...
    def wait_end(self) -> None: ...


def _deepspeed_schedule() -> Any:
    try:
        from deepspeed.runtime.pipe import schedule
    except ImportError as exc:
        raise FrameworkNotInstalled(
            f"freeride.training.deepspeed needs DeepSpeed ({exc}): pip install 'freeride[deepspeed]'"
        ) from exc
    return schedule


# ------------------------------------------------------------------ the plan


@dataclass(frozen=True)
class PlannedOrders:
    """Every pipeline rank's compute actions of one ``train_batch``, and how the engine names them."""

    orders: Mapping[int, tuple[Action, ...]]
    num_stages: int  #: model stages: the pipe's stages, twice that on a V-shaped (DualPipeV) engine
    micro_batches: int
    v_shaped: bool
    #: The schedule commits queued sends and receives (``CommitP2P``): only the commit waits.
    commits: bool = False

    def model_stage(self, rank: int, phase: int) -> int:
        """The model stage ``rank`` runs in ``phase`` (DualPipeV; always ``rank`` otherwise)."""
        return self.num_stages - 1 - rank if self.v_shaped and phase else rank


def planned_orders(schedule_type: Any, micro_batches: int, stages: int) -> PlannedOrders:
    """Walk ``schedule_type(micro_batches, stages, stage_id)`` for every stage and name its actions.

    ``schedule_type`` is a DeepSpeed ``PipeSchedule`` class (``TrainSchedule``, ``DualPipeVSchedule``).
    """
    walked: dict[int, list[tuple[str, int]]] = {}
    v_shaped = commits = False
    for rank in range(stages):
        steps = schedule_type(micro_batches=micro_batches, stages=stages, stage_id=rank).steps()
        walked[rank] = []
        for cmd in (cmd for step in steps for cmd in step):
            name = type(cmd).__name__
            commits = commits or name == COMMIT_P2P
            if name in _COMPUTE:
                phase = int(cmd.kwargs.get("phase", 0))
                v_shaped = v_shaped or "phase" in cmd.kwargs
                walked[rank].append((_COMPUTE[name], phase))
    num_stages = 2 * stages if v_shaped else stages
    orders: dict[int, tuple[Action, ...]] = {}
    for rank, actions in walked.items():
        taken: dict[tuple[str, int], int] = {}  # the k-th forward (backward) of a stage is micro-batch k
        order = []
        for kind, phase in actions:
            stage = num_stages - 1 - rank if v_shaped and phase else rank
            mb = taken.get((kind, stage), 0)
            taken[(kind, stage)] = mb + 1
            order.append(Action(kind, stage, mb))
        orders[rank] = tuple(order)
    return PlannedOrders(orders, num_stages, micro_batches, v_shaped, commits)


# ------------------------------------------------------------------ the hooks


class _Hooks:
    """The instance-level wrappers of one engine, and what they share (training thread only)."""

    def __init__(self, engine: Any, marks: _Marks, plan: PlannedOrders, on_train_batch: Callable[[], None]) -> None:
        self.engine = engine
        self.marks = marks
        self.plan = plan
        self._on_train_batch = on_train_batch
        self.active = False  # inside train_batch
        self.waiting = False  # a run of waiting instructions is open
        self.clip_waiting = False
        self._in_clip = False
        self._stage_id = int(engine.stage_id)
        #: Per (kind, phase): the next micro-batch (the k-th forward or backward is micro-batch k).
        self._counts = [0, 0, 0, 0]
        self._restore: list[tuple[object, str, bool, Any]] = []

    # -- installing

    def install(self) -> None:
        engine = self.engine
        base_map = dict(engine._INSTRUCTION_MAP)  # an instance-level map set before ours, or the class's
        waits = {COMMIT_P2P} if self.plan.commits else set(BLOCKING_P2P)
        wrapped: dict[type, Callable[..., Any]] = {}
        for cls, fn in base_map.items():
            name = cls.__name__
            if name in _COMPUTE:
                wrapped[cls] = self._compute(fn, _COMPUTE[name])
            elif name in waits:
                wrapped[cls] = self._wait(fn)
            elif name in BLOCKING_P2P:
                wrapped[cls] = fn  # DualPipeV: queues an operation; CommitP2P waits for it
            else:
                wrapped[cls] = self._closing(fn)
        self._set(engine, "_INSTRUCTION_MAP", wrapped)
        self._set(engine, "train_batch", self._train_batch(engine.train_batch))
        self._set(engine, "_aggregate_total_loss", self._whole_wait(engine._aggregate_total_loss))
        mpu: Any = getattr(engine, "mpu", None)
        if hasattr(engine, "clip_fp32_gradients") and hasattr(mpu, "get_model_parallel_group"):
            self._set(engine, "clip_fp32_gradients", self._clip(engine.clip_fp32_gradients))
            self._set(mpu, "get_model_parallel_group", self._group_lookup(mpu.get_model_parallel_group))

    def _set(self, obj: object, name: str, value: Any) -> None:
        had = name in vars(obj)
        self._restore.append((obj, name, had, vars(obj).get(name)))
        setattr(obj, name, value)

    def remove(self) -> None:
        for obj, name, had, old in reversed(self._restore):
            if had:
                setattr(obj, name, old)
            else:
                delattr(obj, name)
        self._restore.clear()

    # -- wrappers

    def _end_wait(self) -> None:
        if self.waiting:
            self.waiting = False
            self.marks.wait_end()

    def _train_batch(self, train_batch: Callable[..., Any]) -> Callable[..., Any]:
        def train_batch_instrumented(*args: Any, **kwargs: Any) -> Any:
            if self.active:  # re-entered from inside (never by DeepSpeed itself): mark once
                return train_batch(*args, **kwargs)
            self._on_train_batch()
            marks = self.marks  # the plan may have changed above
            self._counts = [0, 0, 0, 0]
            self.waiting = self.clip_waiting = False
            marks.iteration_begin()
            self.active = True
            try:
                return train_batch(*args, **kwargs)
            finally:
                self.active = False
                self._end_wait()
                marks.iteration_end()

        return train_batch_instrumented

    def _compute(self, fn: Callable[..., Any], kind: str) -> Callable[..., Any]:
        base = 0 if kind == FORWARD else 2
        stages = (self.plan.model_stage(self._stage_id, 0), self.plan.model_stage(self._stage_id, 1))

        def compute(engine: Any, *args: Any, **kwargs: Any) -> Any:
            if not self.active:
                return fn(engine, *args, **kwargs)
            phase = 1 if kwargs.get("phase") else 0
            counts = self._counts
            mb = counts[base + phase]
            counts[base + phase] = mb + 1
            stage = stages[phase]
            self.waiting = False  # compute_begin ends an open wait
            marks = self.marks
            marks.compute_begin(kind, stage, mb)
            try:
                return fn(engine, *args, **kwargs)
            finally:
                marks.compute_end(kind, stage, mb)

        return compute

    def _wait(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def waiting(engine: Any, *args: Any, **kwargs: Any) -> Any:
            if self.active and not self.waiting:
                self.waiting = True
                self.marks.wait_begin()
            return fn(engine, *args, **kwargs)

        return waiting

    def _closing(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def closing(engine: Any, *args: Any, **kwargs: Any) -> Any:
            self._end_wait()
            return fn(engine, *args, **kwargs)

        return closing

    def _whole_wait(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def whole_wait(*args: Any, **kwargs: Any) -> Any:
            if not self.active:
                return fn(*args, **kwargs)
            self._end_wait()
            marks = self.marks
            marks.wait_begin()
            try:
                return fn(*args, **kwargs)
            finally:
                marks.wait_end()

        return whole_wait

    def _clip(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def clip_fp32_gradients(*args: Any, **kwargs: Any) -> Any:
            self._in_clip = True
            try:
                return fn(*args, **kwargs)
            finally:
                self._in_clip = False
                if self.clip_waiting:
                    self.clip_waiting = False
                    self.marks.wait_end()

        return clip_fp32_gradients

    def _group_lookup(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def get_model_parallel_group(*args: Any, **kwargs: Any) -> Any:
            # clip_grad_norm_ asks for the group as the argument of its all-reduce: the wait starts here.
            if self._in_clip and self.active and not self.clip_waiting:
                self._end_wait()
                self.clip_waiting = True
                self.marks.wait_begin()
            return fn(*args, **kwargs)

        return get_model_parallel_group


# ------------------------------------------------------------------ the public surface


class Instrumentation:
    """What :func:`instrument` installed on one engine: its hooks and its :attr:`tracker`."""

    def __init__(self, engine: Any, make_tracker: Callable[[PlannedOrders], RankTracker],
                 plan: PlannedOrders, schedule_type: Any) -> None:
        self._make_tracker = make_tracker
        self._schedule_type = schedule_type
        #: The trackers of the last micro-batch counts the engine ran, with their plans: one that alternates
        #: keeps what each count's slots learned (:class:`~freeride.training.tracker.KeptShapes`).
        self._kept: KeptShapes[tuple[RankTracker, PlannedOrders]] = KeptShapes(lambda kept: kept[0])
        self.tracker, self.plan = self._kept.get(plan.micro_batches, lambda: (make_tracker(plan), plan))
        self._hooks = _Hooks(engine, self.tracker, plan, self._check_plan)

    def _check_plan(self) -> None:
        """Before each ``train_batch``: plan again if the engine's micro-batch count changed."""
        engine = self._hooks.engine
        micro_batches = int(engine.micro_batches)
        if micro_batches == self.plan.micro_batches:
            return
        log.info("[stage %d] the engine now runs %d micro-batches (was %d): its slots for that count",
                 self._hooks._stage_id, micro_batches, self.plan.micro_batches)

        def new() -> tuple[RankTracker, PlannedOrders]:
            plan = planned_orders(self._schedule_type, micro_batches, int(engine.num_stages))
            return self._make_tracker(plan), plan

        self.tracker, self.plan = self._kept.get(micro_batches, new)
        self._hooks.plan = self.plan
        self._hooks.marks = self.tracker

    @property
    def last_bubbles(self) -> list[MeasuredBubble]:
        """The bubbles of the last iteration delivered (on CUDA, the last the device finished)."""
        return self.tracker.last_bubbles

    def close(self) -> None:
        """Restore the engine (see :func:`uninstrument`) and deliver what the tracker still holds."""
        engine = self._hooks.engine
        if _installed.get(engine) is self:
            del _installed[engine]  # it may be instrumented again
        self._hooks.remove()
        self._kept.close()


_installed: weakref.WeakKeyDictionary[Any, Instrumentation] = weakref.WeakKeyDictionary()


def _require(engine: Any, names: Iterable[str]) -> None:
    missing = [n for n in names if not hasattr(engine, n)]
    if missing:
        import deepspeed

        raise DeepSpeedInternalsChanged(
            f"{type(engine).__name__} has no {', '.join(missing)}: this DeepSpeed ({deepspeed.__version__}) "
            "changed the pipeline-engine internals freeride.training.deepspeed hooks into"
        )


def instrument(
    engine: Any,
    reporter: BubbleSink | None = None,
    *,
    device: str | None = None,
    on_iteration: Callable[[int, list[MeasuredBubble]], None] | None = None,
    learning: LearningConfig | None = None,
) -> Instrumentation:
    """Hook ``engine`` (a DeepSpeed ``PipelineEngine`` or ``DualPipeVEngine``) to report its bubbles.

    ``reporter`` receives them (a :class:`~freeride.training.reporter.BubbleReporter`; None: measure
    only). ``device`` (``cuda:N``, ``cpu:N``) picks the clock and the free-memory samples: by default the
    reporter's device, else the engine's. ``on_iteration(iteration, bubbles)`` is called on the training
    thread with each iteration's bubbles once they are known (on CUDA an iteration or so later);
    ``learning`` configures learned slots. Returns the :class:`Instrumentation` (also undone by
    :func:`uninstrument`). Raises :class:`~freeride.errors.FrameworkNotInstalled` without DeepSpeed,
    :class:`~freeride.errors.ConfigError` for anything but a pipeline engine or one instrumented
    already, :class:`DeepSpeedInternalsChanged` if DeepSpeed's internals moved.
    """
    _deepspeed_schedule()
    from deepspeed.runtime.pipe.engine import PipelineEngine

    if not isinstance(engine, PipelineEngine):
        raise ConfigError(
            f"freeride.training.deepspeed.instrument takes a DeepSpeed PipelineEngine (deepspeed.initialize with "
            f"a PipelineModule), got {type(engine).__name__}"
        )
    device = device or getattr(reporter, "device", None) or torch_device_name(getattr(engine, "device", None)) or "cpu"
    return _install(engine, reporter, device=device, on_iteration=on_iteration, learning=learning)


def _install(
    engine: Any,
    reporter: BubbleSink | None,
    *,
    device: str | None,
    on_iteration: Callable[[int, list[MeasuredBubble]], None] | None = None,
    learning: LearningConfig | None = None,
) -> Instrumentation:
    """:func:`instrument` on anything that runs DeepSpeed's schedules as its engine does (the tests and
    the bench replay them on an engine without a model)."""
    schedule = _deepspeed_schedule()
    if engine in _installed:
        raise ConfigError("this engine is instrumented already: uninstrument(engine) first")
    _require(engine, ("_INSTRUCTION_MAP", "_train_schedule", "_aggregate_total_loss", "train_batch",
                      "stage_id", "num_stages", "micro_batches"))
    schedule_type = type(engine._train_schedule())
    if not issubclass(schedule_type, schedule.PipeSchedule):
        raise DeepSpeedInternalsChanged(f"{type(engine).__name__}._train_schedule() is not a PipeSchedule")
    plan = planned_orders(schedule_type, int(engine.micro_batches), int(engine.num_stages))
    rank = int(engine.stage_id)
    device = getattr(reporter, "device", None) if device is None else device

    def make_tracker(p: PlannedOrders) -> RankTracker:
        return RankTracker(p.orders, rank, reporter, num_stages=p.num_stages, device=device,
                           stage_device=getattr(engine, "device", None),
                           on_iteration=on_iteration, learning=learning,
                           schedule=f"deepspeed-{schedule_type.__name__}")

    handle = Instrumentation(engine, make_tracker, plan, schedule_type)
    handle._hooks.install()
    _installed[engine] = handle
    return handle


def uninstrument(engine: Any) -> None:
    """Undo :func:`instrument`: the engine's own attributes, exactly as they were, and the tracker's last
    bubbles delivered. ``engine`` may also be the :class:`Instrumentation` that :func:`instrument` returned (it
    was taken for an engine never instrumented, and the engine stayed hooked). Does nothing on anything that is
    not instrumented (``None`` raised a TypeError)."""
    if isinstance(engine, Instrumentation):
        engine.close()
        return
    try:
        handle = _installed.get(engine)
    except TypeError:  # no weak reference to it: nothing of freeride's can be on it
        return
    if handle is not None:
        handle.close()
