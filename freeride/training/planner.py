"""Choosing a pipeline configuration for side tasks: the core of ``freeride plan`` and its ``--sweep``.

A configuration (:class:`Candidate`: schedule, micro-batches ``m``, virtual stages ``v``, for a given
number of stages ``p``) is evaluated by :func:`plan_config` into a :class:`ConfigPlan`: the
iteration time and bubble fraction from the schedule simulator (:mod:`freeride.training.schedules`), and,
when a memory model is given, what every stage holds in each of its idle slots
(:mod:`freeride.training.memory`), hence the memory free there on a device of ``device_memory_bytes``.

**The frontier.** :func:`sweep` evaluates many candidates and marks the Pareto-optimal ones
(:func:`pareto_flags`) on the objectives that the inputs make known:

* bubble fraction (minimise): the idle share of the iteration, which is the iteration time relative
  to the pipeline's work;
* peak memory per stage (minimise): the largest memory any stage holds between actions;
* harvest capacity (maximise): the sum over stages and idle slots of the slot's length times the
  memory free during it, per second of training -- the average amount of memory that sits idle and
  free, i.e. the byte-seconds of bubble a side task could use for each second the pipeline trains.

A configuration whose peak does not fit the device is kept in the table, marked, and never Pareto.

**Fitting side tasks** (:func:`fit_tasks`) follows the manager's rules (``freeride._manager.core``):
a step is admitted only while its (high-percentile) step time plus the margin fits the time left in
the bubble, so a task can use a slot only if ``step_ms + margin_ms <= slot length``; and a task's
memory cap counts against the device's budget for the whole iteration (a parked task keeps its
memory), which the manager sets to the *minimum* free memory over recent iterations minus a
headroom. The memory test is therefore against the stage's budget, ``device - peak - headroom``,
not against one slot's free memory (which the plan still shows, and the harvest capacity uses).
Tasks are tested one at a time; several tasks on one stage share its budget.

**Fixed work per iteration** (``global_batch``): with it, ``m`` micro-batches have ``global_batch /
m`` samples each, and the forward and backward times (given for ``microbatch_size`` samples) and the
activation memory scale linearly with that size. Without it the micro-batch size is fixed, so an
iteration with more micro-batches does more work. Linear scaling is an approximation: small
micro-batches use a GPU less efficiently.

Pure: dataclasses in, dataclasses out; ``freeride._cli.plan`` prints them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from freeride.errors import ConfigError
from freeride.training.memory import (
    OPTIMIZER_STATES,
    HeldMemory,
    MeasuredStages,
    MemorySource,
    Precision,
    Runtime,
    TransformerDims,
    chunk_memory,
    rank_memory,
)
from freeride.training.schedules import (
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    LOOPED,
    SCHEDULE_NAMES,
    Action,
    Schedule,
    build_schedule,
    canonical_name,
    chunks_per_rank,
    schedule_from_orders,
)
from freeride.units import parse_size

#: The manager's default admission margin and memory headroom (``freeride manager`` options; the trainer
#: side never imports the manager: ``tests/unit/test_planner.py`` checks that these are its defaults).
DEFAULT_MARGIN_MS = 0.2
DEFAULT_HEADROOM_BYTES = 256 * 2**20
_TASK_EXAMPLE = "name=pagerank,memory=2GiB,step_ms=3.5"


# ------------------------------------------------------------------ inputs


@dataclass(frozen=True)
class Costs:
    """Action times of one micro-batch of ``microbatch_size`` samples through one stage (ms).

    ``t_weight_ms`` is the weight-gradient part of the backward (zero-bubble; default half);
    ``t_step_ms`` is the time per iteration outside the schedule (optimizer step, zeroing).
    """

    t_forward_ms: float = 1.0
    t_backward_ms: float = 2.0
    t_weight_ms: float | None = None
    t_step_ms: float = 0.0

    def __post_init__(self) -> None:
        for name in ("t_forward_ms", "t_backward_ms", "t_weight_ms", "t_step_ms"):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ConfigError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.t_forward_ms <= 0 or self.t_backward_ms <= 0:
            raise ConfigError("t_forward_ms and t_backward_ms must be > 0")

    def scaled(self, factor: float) -> Costs:
        tw = None if self.t_weight_ms is None else self.t_weight_ms * factor
        return Costs(self.t_forward_ms * factor, self.t_backward_ms * factor, tw, self.t_step_ms)


@dataclass(frozen=True)
class SideTaskDemand:
    """A side task's declared memory cap and measured (high-percentile) step time."""

    name: str
    memory_bytes: int
    step_ms: float

    def __post_init__(self) -> None:
        if not self.name:
            raise ConfigError("a side task needs a name")
        if not isinstance(self.memory_bytes, int) or self.memory_bytes <= 0:
            raise ConfigError(f"task {self.name}: memory must be a positive size, got {self.memory_bytes!r}")
        if not isinstance(self.step_ms, (int, float)) or not math.isfinite(self.step_ms) or self.step_ms <= 0:
            raise ConfigError(f"task {self.name}: step_ms must be a number > 0, got {self.step_ms!r}")

    @classmethod
    def from_mapping(cls, fields: Mapping[str, object], where: str = "task") -> SideTaskDemand:
        """From ``{"name": ..., "memory": "2GiB" | bytes, "step_ms": 3.5}`` (unknown keys rejected)."""
        allowed = {"name", "memory", "step_ms"}
        unknown = set(fields) - allowed
        if unknown:
            raise ConfigError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}; expected name, memory, step_ms")
        missing = allowed - set(fields)
        if missing:
            raise ConfigError(f"{where}: missing {', '.join(sorted(missing))} (e.g. {_TASK_EXAMPLE})")
        memory = fields["memory"]
        step = fields["step_ms"]
        try:
            step_ms = float(step)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: step_ms must be a number, got {step!r}") from None
        if not isinstance(memory, (str, int)) or isinstance(memory, bool):
            raise ConfigError(f"{where}: memory must be a size such as 2GiB, got {memory!r}")
        return cls(str(fields["name"]).strip(), parse_size(memory), step_ms)

    @classmethod
    def parse(cls, text: str) -> SideTaskDemand:
        """From ``name=pagerank,memory=2GiB,step_ms=3.5``."""
        fields: dict[str, object] = {}
        for part in text.split(","):
            key, sep, value = part.partition("=")
            if not sep:
                raise ConfigError(f"--task {text!r}: expected key=value pairs, e.g. {_TASK_EXAMPLE}")
            fields[key.strip()] = value.strip()
        return cls.from_mapping(fields, where=f"--task {text!r}")


@dataclass(frozen=True)
class MemoryInputs:
    """The memory model's inputs: model dimensions or measurements, and how state is kept."""

    source: MemorySource
    precision: Precision
    optimizer: str
    runtime: Runtime

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZER_STATES:
            raise ConfigError(f"unknown optimizer {self.optimizer!r}: expected one of {', '.join(OPTIMIZER_STATES)}")


@dataclass(frozen=True)
class PlanInputs:
    """Everything that is the same for every candidate of a sweep."""

    stages: int
    costs: Costs = Costs()
    memory: MemoryInputs | None = None
    device_memory_bytes: int | None = None
    headroom_bytes: int = DEFAULT_HEADROOM_BYTES
    margin_ms: float = DEFAULT_MARGIN_MS
    tasks: tuple[SideTaskDemand, ...] = ()
    #: Samples per iteration held fixed across candidates (None: the micro-batch size is fixed).
    global_batch: int | None = None
    #: Samples per micro-batch that ``costs`` (and measured activation bytes) are given for.
    microbatch_size: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.stages, int) or self.stages < 1:
            raise ConfigError(f"stages must be an integer >= 1, got {self.stages!r}")
        if self.device_memory_bytes is not None and self.device_memory_bytes <= 0:
            raise ConfigError(f"device memory must be positive, got {self.device_memory_bytes}")
        if self.headroom_bytes < 0:
            raise ConfigError(f"headroom must be >= 0 bytes, got {self.headroom_bytes}")
        if not math.isfinite(self.margin_ms) or self.margin_ms < 0:
            raise ConfigError(f"margin_ms must be >= 0, got {self.margin_ms}")
        if self.microbatch_size < 1:
            raise ConfigError(f"microbatch_size must be >= 1, got {self.microbatch_size}")
        if self.global_batch is not None and self.global_batch < 1:
            raise ConfigError(f"global_batch must be >= 1, got {self.global_batch}")
        if self.memory is not None and isinstance(self.memory.source, TransformerDims) and (
            self.memory.source.microbatch_size != self.microbatch_size
        ):
            raise ConfigError(
                f"the model dimensions have micro-batch size {self.memory.source.microbatch_size}, "
                f"the costs are given for {self.microbatch_size}"
            )
        names = [t.name for t in self.tasks]
        if len(set(names)) != len(names):
            raise ConfigError(f"side task names must be unique, got {', '.join(names)}")


@dataclass(frozen=True, order=True)
class Candidate:
    """One configuration to evaluate (``virtual`` > 1 only for looped and V-shaped schedules)."""

    schedule: str
    microbatches: int
    virtual: int = 1
    #: An order of one's own (``schedule`` ``"csv"``): every rank's actions, e.g. as
    #: :func:`freeride.training.torch_plans.csv_orders` reads them from torch's compute-only CSV.
    orders: Mapping[int, Sequence[Action]] | None = field(default=None, compare=False, repr=False)

    @property
    def label(self) -> str:
        return f"{self.schedule} m={self.microbatches}" + (f" v={self.virtual}" if self.virtual > 1 else "")


# ------------------------------------------------------------------ results


@dataclass(frozen=True)
class SlotPlan:
    """One idle slot of a stage (cyclic layout: what a running trainer reports)."""

    index: int
    kind: str
    start_ms: float
    length_ms: float
    held_bytes: int | None
    free_bytes: int | None


@dataclass(frozen=True)
class StagePlan:
    """One stage of a configuration: its bubbles and, with a memory model, its memory."""

    rank: int
    idle_ms: float
    bubble_fraction: float
    slots: tuple[SlotPlan, ...]
    peak: HeldMemory | None
    peak_in_flight: int | None
    #: The manager's memory budget for side tasks: device - peak - headroom (None: unknown).
    budget_bytes: int | None
    #: Sum over slots of length (s) x free memory (bytes), per iteration.
    harvest_byte_seconds: float | None


@dataclass(frozen=True)
class TaskFit:
    """Where one side task fits on one stage."""

    task: str
    rank: int
    #: Slots whose length holds the task's step plus the margin.
    slots: tuple[int, ...]
    #: The task's memory fits the stage's budget (None: no memory figures to tell).
    memory_fits: bool | None
    #: Time per iteration in the slots the step fits (ms).
    usable_ms: float

    @property
    def fits(self) -> bool:
        return bool(self.slots) and self.memory_fits is not False


@dataclass(frozen=True)
class ConfigPlan:
    """A configuration evaluated."""

    candidate: Candidate
    microbatch_size: int
    schedule: Schedule
    iteration_ms: float
    bubble_fraction: float
    stages: tuple[StagePlan, ...]
    fits: tuple[TaskFit, ...]
    device_memory_bytes: int | None
    pareto: bool = False

    @property
    def peak_bytes(self) -> int | None:
        """The largest memory any stage holds (None without a memory model)."""
        peaks = [s.peak.total_bytes for s in self.stages if s.peak is not None]
        return max(peaks) if peaks else None

    @property
    def fits_device(self) -> bool | None:
        peak = self.peak_bytes
        if peak is None or self.device_memory_bytes is None:
            return None
        return peak <= self.device_memory_bytes

    @property
    def harvest_rate_bytes(self) -> float | None:
        """Harvest capacity: byte-seconds of free memory in bubbles per second of training."""
        parts = [s.harvest_byte_seconds for s in self.stages]
        if any(p is None for p in parts) or self.iteration_ms <= 0:
            return None
        return sum(p for p in parts if p is not None) / (self.iteration_ms / 1e3)

    def fitting_stages(self, task: str) -> tuple[int, ...]:
        return tuple(f.rank for f in self.fits if f.task == task and f.fits)


# ------------------------------------------------------------------ evaluation


def candidates(
    stages: int,
    schedules: Iterable[str] = SCHEDULE_NAMES,
    microbatches: Iterable[int] = (),
    virtuals: Iterable[int] = (2,),
) -> list[Candidate]:
    """Every (schedule, m, v) combination; ``virtuals`` apply to looped schedules only (V-shaped ones take 2).

    No ``microbatches``: ``p, 2p, 4p, 8p``.
    """
    ms = sorted(set(microbatches)) or [stages * k for k in (1, 2, 4, 8)]
    out: list[Candidate] = []
    for name in schedules:
        key = canonical_name(name)
        vs = sorted(set(virtuals)) if key in LOOPED else [chunks_per_rank(key)]
        out += [Candidate(key, m, v) for m in ms for v in vs]
    return out


def _microbatch_size(inputs: PlanInputs, microbatches: int) -> int:
    if inputs.global_batch is None:
        return inputs.microbatch_size
    if inputs.global_batch % microbatches:
        raise ConfigError(f"global batch {inputs.global_batch} does not split into {microbatches} micro-batches")
    return inputs.global_batch // microbatches


def _scaled_source(source: MemorySource, microbatch_size: int, reference: int) -> MemorySource:
    if isinstance(source, TransformerDims):
        return source.with_microbatch_size(microbatch_size)
    if isinstance(source, MeasuredStages) and microbatch_size != reference:
        return source.scaled(microbatch_size / reference)
    return source


def plan_config(inputs: PlanInputs, candidate: Candidate) -> ConfigPlan:
    """Evaluate one configuration (ConfigError when it is not a valid one, saying why)."""
    mbs = _microbatch_size(inputs, candidate.microbatches)
    costs = inputs.costs.scaled(mbs / inputs.microbatch_size)
    if candidate.orders is not None:
        key = candidate.schedule
        schedule = _own_order(inputs.stages, candidate, costs)
    else:
        key = canonical_name(candidate.schedule)
        if key in LOOPED and candidate.virtual < 2:
            raise ConfigError(f"{key} needs virtual stages >= 2")
        schedule = build_schedule(
            key, inputs.stages, candidate.microbatches, costs.t_forward_ms, costs.t_backward_ms,
            costs.t_weight_ms, virtual=candidate.virtual,
        )
    iteration_ms = schedule.makespan + costs.t_step_ms
    chunks = None
    mem = inputs.memory
    if mem is not None:
        source = _scaled_source(mem.source, mbs, inputs.microbatch_size)
        chunks = chunk_memory(source, inputs.stages, schedule.virtual, mem.precision, schedule.placement)
    device = inputs.device_memory_bytes
    stages: list[StagePlan] = []
    for r in range(inputs.stages):
        rank_mem = None
        if mem is not None and chunks is not None:
            rank_mem = rank_memory(schedule, r, chunks, mem.precision, mem.optimizer, mem.runtime)
        slots = []
        harvest = 0.0
        for slot in schedule.cyclic_slots(r):
            held = rank_mem.during(slot).total_bytes if rank_mem is not None else None
            free = max(0, device - held) if device is not None and held is not None else None
            if free is not None:
                harvest += slot.length / 1e3 * free
            slots.append(SlotPlan(slot.index, slot.kind, slot.start, slot.length, held, free))
        idle = sum(s.length_ms for s in slots)
        peak = rank_mem.peak if rank_mem is not None else None
        budget = None
        if peak is not None and device is not None:
            budget = device - peak.total_bytes - inputs.headroom_bytes
        stages.append(StagePlan(
            rank=r,
            idle_ms=idle,
            bubble_fraction=idle / iteration_ms if iteration_ms > 0 else 0.0,
            slots=tuple(slots),
            peak=peak,
            peak_in_flight=rank_mem.peak_in_flight if rank_mem is not None else None,
            budget_bytes=budget,
            harvest_byte_seconds=harvest if device is not None and rank_mem is not None else None,
        ))
    total_idle = sum(s.idle_ms for s in stages)
    return ConfigPlan(
        candidate=Candidate(key, candidate.microbatches, schedule.virtual, candidate.orders),
        microbatch_size=mbs,
        schedule=schedule,
        iteration_ms=iteration_ms,
        bubble_fraction=total_idle / (inputs.stages * iteration_ms) if iteration_ms > 0 else 0.0,
        stages=tuple(stages),
        fits=fit_tasks(stages, inputs.tasks, inputs.margin_ms),
        device_memory_bytes=device,
    )


def _own_order(stages: int, candidate: Candidate, costs: Costs) -> Schedule:
    """Simulate a candidate's own order (ConfigError where it does not match the pipeline or the costs)."""
    assert candidate.orders is not None
    if len(candidate.orders) != stages:
        raise ConfigError(f"the order has {len(candidate.orders)} ranks; the pipeline has {stages} stages (--stages)")
    tb = costs.t_backward_ms
    tw = tb / 2 if costs.t_weight_ms is None else costs.t_weight_ms
    split = any(a.kind in (BACKWARD_INPUT, BACKWARD_WEIGHT) for o in candidate.orders.values() for a in o)
    if split and not tw < tb:
        raise ConfigError(f"t_weight ({tw}) must be less than t_backward ({tb}): the order splits backwards "
                          "into I and W")
    return schedule_from_orders(candidate.schedule, candidate.orders, stages * candidate.virtual, costs.t_forward_ms,
                                tb, tw, virtual=candidate.virtual, microbatches=candidate.microbatches)


def fit_tasks(stages: Sequence[StagePlan], tasks: Sequence[SideTaskDemand], margin_ms: float) -> tuple[TaskFit, ...]:
    """Where each task fits, stage by stage (the rules are in the module doc)."""
    out = []
    for task in tasks:
        for stage in stages:
            slots = tuple(s.index for s in stage.slots if task.step_ms + margin_ms <= s.length_ms)
            usable = sum(s.length_ms for s in stage.slots if s.index in slots)
            memory_fits = None if stage.budget_bytes is None else task.memory_bytes <= stage.budget_bytes
            out.append(TaskFit(task.name, stage.rank, slots, memory_fits, usable))
    return tuple(out)


def pareto_flags(points: Sequence[Sequence[float]]) -> list[bool]:
    """For each point (every objective minimised), whether no other point dominates it.

    ``a`` dominates ``b`` when ``a`` is no worse in every objective and better in one; equal points
    do not dominate each other, so ties are all on the front.
    """

    def dominates(a: Sequence[float], b: Sequence[float]) -> bool:
        pairs = list(zip(a, b, strict=True))
        return all(x <= y for x, y in pairs) and any(x < y for x, y in pairs)

    return [not any(dominates(b, a) for j, b in enumerate(points) if j != i) for i, a in enumerate(points)]


#: Objective names, in the order :func:`objectives` gives them.
OBJECTIVES = ("bubble_fraction", "peak_bytes", "harvest_rate_bytes")


def objectives(plan: ConfigPlan) -> dict[str, float]:
    """The known objectives of a plan, each to be minimised (the harvest capacity negated)."""
    out = {"bubble_fraction": plan.bubble_fraction}
    if plan.peak_bytes is not None:
        out["peak_bytes"] = float(plan.peak_bytes)
    if plan.harvest_rate_bytes is not None:
        out["harvest_rate_bytes"] = -plan.harvest_rate_bytes
    return out


@dataclass(frozen=True)
class SweepResult:
    plans: tuple[ConfigPlan, ...]
    #: Candidates that are not valid configurations, with the reason.
    rejected: tuple[tuple[Candidate, str], ...]
    #: The objectives the Pareto marking used.
    objectives: tuple[str, ...]

    @property
    def pareto(self) -> tuple[ConfigPlan, ...]:
        return tuple(p for p in self.plans if p.pareto)


def sweep(inputs: PlanInputs, cands: Iterable[Candidate]) -> SweepResult:
    """Evaluate every candidate and mark the Pareto front among those that fit the device."""
    plans: list[ConfigPlan] = []
    rejected: list[tuple[Candidate, str]] = []
    for cand in cands:
        try:
            plans.append(plan_config(inputs, cand))
        except ConfigError as exc:
            rejected.append((cand, str(exc)))
    names = tuple(n for n in OBJECTIVES if plans and all(n in objectives(p) for p in plans))
    eligible = [i for i, p in enumerate(plans) if p.fits_device is not False]
    flags = pareto_flags([[objectives(plans[i])[n] for n in names] for i in eligible])
    on_front = {i for i, flag in zip(eligible, flags, strict=True) if flag}
    marked = tuple(
        ConfigPlan(p.candidate, p.microbatch_size, p.schedule, p.iteration_ms, p.bubble_fraction, p.stages, p.fits,
                   p.device_memory_bytes, pareto=i in on_front)
        for i, p in enumerate(plans)
    )
    return SweepResult(marked, tuple(rejected), names)
