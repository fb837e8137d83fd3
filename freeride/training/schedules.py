"""The analytical bubble model: a pipeline schedule as data.

A schedule is, for each pipeline rank, the ordered list of compute :class:`Action` s it runs in one
iteration (``F`` forward, ``B`` full backward, and for zero-bubble schedules ``I`` input-gradient
backward and ``W`` weight-gradient backward), each for one micro-batch and one model stage.
:func:`simulate` places the actions in time from per-action costs and the data dependencies of a
pipeline (a forward needs the previous stage's forward of the same micro-batch; a backward needs the
next stage's backward, or on the last stage the micro-batch's own forward). Every gap in a rank's
timeline is an :class:`IdleSlot`: a bubble, with a start offset, a length, a kind and an index.

Two layouts of the slots are offered:

* :meth:`Schedule.slots` -- one iteration alone, every rank starting at 0 and the iteration ending
  when the last action ends (``warmup`` before a rank's first action, ``tail`` after its last).
  The bubble fraction of GPipe and 1F1B comes out as ``(p-1)/(m+p-1)``.
* :meth:`Schedule.cyclic_slots` -- back-to-back iterations: a rank's ``tail`` and the next
  iteration's ``warmup`` are one wait (kind ``boundary``), because in a real run the stage finishes
  its last backward, runs its optimizer step and then waits for the next iteration's first
  activation. This is the layout an instrumented trainer observes, and what it reports.

The model counts costs in any unit (the instrumented trainer uses nanoseconds). ``t_forward`` and
``t_backward`` are the costs of one micro-batch through one rank's whole share of the model; with
``virtual`` model chunks per rank each chunk costs ``1/virtual`` of that. ``t_backward`` is the full
backward; zero-bubble schedules split it into ``I = t_backward - t_weight`` and ``W = t_weight``.
Stages that cost differently (the first holds the embedding, the last the head and the loss) take
``stage_costs``: per model stage, the ``(t_forward, t_backward, t_weight)`` of one micro-batch through
that one chunk, used as given (not divided by ``virtual``).

The module is pure (no I/O; torch only for the schedules torch alone defines, whose order
:mod:`freeride.training.torch_plans` reads off torch's own classes when one is asked for): the same
simulator feeds ``freeride plan``, the predictor in the trainer, the tests and the benchmarks.
:func:`schedule_from_orders` builds a :class:`Schedule` from any action order, e.g. one read off
``torch.distributed.pipelining`` at run time.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from freeride.errors import ConfigError

FORWARD = "F"
BACKWARD = "B"
BACKWARD_INPUT = "I"
BACKWARD_WEIGHT = "W"
ACTION_KINDS = (FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)

#: Schedules whose order this module builds itself.
OWN_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")
#: Schedules whose order comes from ``torch.distributed.pipelining``'s own class (torch needed; see
#: :mod:`freeride.training.torch_plans`), by the name :func:`build_schedule` knows them by.
TORCH_SCHEDULES = {
    "interleaved-zb": "ScheduleInterleavedZeroBubble",
    "looped-bfs": "ScheduleLoopedBFS",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
#: Schedules :func:`build_schedule` knows, with accepted aliases.
SCHEDULE_NAMES = OWN_SCHEDULES + tuple(TORCH_SCHEDULES)
#: V-shaped schedules: two model stages per rank, rank ``r`` holding stages ``r`` and ``2p - 1 - r``.
V_SHAPED = ("zbv", "dualpipev")
#: Schedules of several model chunks per rank placed round-robin (rank ``r`` holds ``r, r + p, ...``).
LOOPED = ("interleaved-1f1b", "interleaved-zb", "looped-bfs")
#: Schedules that split a backward into ``I`` and ``W`` (``t_weight`` must be less than ``t_backward``).
ZERO_BUBBLE = ("zb-h1", "interleaved-zb", "zbv", "dualpipev")
_ALIASES = {
    "gpipe": "gpipe",
    "1f1b": "1f1b",
    "interleaved-1f1b": "interleaved-1f1b",
    "interleaved": "interleaved-1f1b",
    "interleaved1f1b": "interleaved-1f1b",
    "zb-h1": "zb-h1",
    "zero-bubble": "zb-h1",
    "zbh1": "zb-h1",
    "interleaved-zb": "interleaved-zb",
    "interleaved-zero-bubble": "interleaved-zb",
    "interleavedzerobubble": "interleaved-zb",
    "looped-bfs": "looped-bfs",
    "loopedbfs": "looped-bfs",
    "zbv": "zbv",
    "zbv-zero-bubble": "zbv",
    "zbvzerobubble": "zbv",
    "dualpipev": "dualpipev",
    "dualpipe-v": "dualpipev",
}
#: torch's class names (``ScheduleZBVZeroBubble``, any case) are aliases of the names above too.
_ALIASES.update({cls.lower(): key for key, cls in TORCH_SCHEDULES.items()})

# Slot kinds, in the vocabulary of the reference system's 4x4 1F1B where one exists (A, B, C, D).
WARMUP = "warmup"  # before the rank's first action: waiting for the first activation (A)
FILL = "fill"  # between forwards: waiting for the next activation
TURNAROUND = "turnaround"  # before the rank's first backward: waiting for the first gradient (B)
STEADY = "steady"  # before a forward that follows a backward
DRAIN = "drain"  # before a later backward: gaps between cool-down backwards (D)
TAIL = "tail"  # after the rank's last action, until the iteration ends (C)
BOUNDARY = "boundary"  # cyclic layout: tail of one iteration + warm-up of the next

#: Gaps shorter than this fraction of the smallest action cost are rounding noise, not bubbles.
_EPS_FRACTION = 1e-9


@dataclass(frozen=True, order=True)
class Action:
    """One compute action: ``kind`` of micro-batch ``microbatch`` on model stage ``stage``."""

    kind: str
    stage: int
    microbatch: int

    def __post_init__(self) -> None:
        if self.kind not in ACTION_KINDS:
            raise ConfigError(f"unknown action kind {self.kind!r}: expected one of {', '.join(ACTION_KINDS)}")
        if self.stage < 0 or self.microbatch < 0:
            raise ConfigError(f"action stage and micro-batch must be >= 0, got {self.stage}, {self.microbatch}")

    @property
    def is_backward(self) -> bool:
        return self.kind in (BACKWARD, BACKWARD_INPUT)

    def label(self, virtual: int = 1, ranks: int = 1) -> str:
        """Short text: ``F3`` (micro-batch 3), or ``F3.1`` (chunk 1) with virtual stages."""
        if virtual > 1:
            return f"{self.kind}{self.microbatch}.{self.stage // ranks}"
        return f"{self.kind}{self.microbatch}"

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"


@dataclass(frozen=True)
class TimedAction:
    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class IdleSlot:
    """One bubble of one rank per iteration.

    ``index`` is the slot's identity: the position, in the rank's action order, of the action that
    ends the wait (0 for the ``warmup`` or the cyclic ``boundary``; the order's length for a ``tail``).
    It does not depend on the action costs, so a slot keeps its id when the profiled costs change
    which gaps the model finds, and every layout (this model, the trainer's instrumentation, the
    planner) names a slot alike. ``start`` is the offset from the iteration's start (negative for a
    cyclic ``boundary`` slot, which begins in the previous iteration); ``before`` is the action that
    ends the wait (None for a ``tail``), ``after`` the action whose end begins it (None for a
    ``warmup``).
    """

    rank: int
    index: int
    start: float
    length: float
    kind: str
    before: Action | None
    after: Action | None

    @property
    def end(self) -> float:
        return self.start + self.length


@dataclass(frozen=True)
class Schedule:
    """A simulated schedule: actions in time and idle slots for every rank."""

    name: str
    ranks: int
    microbatches: int
    virtual: int
    t_forward: float
    t_backward: float
    t_weight: float
    orders: Mapping[int, tuple[Action, ...]]
    timeline: Mapping[int, tuple[TimedAction, ...]]
    makespan: float
    _slots: Mapping[int, tuple[IdleSlot, ...]] = field(repr=False)
    _cyclic: Mapping[int, tuple[IdleSlot, ...]] = field(repr=False)
    #: Per model stage ``(t_forward, t_backward, t_weight)`` of one chunk, where given (see module doc).
    stage_costs: Mapping[int, tuple[float, float, float]] = field(default_factory=dict)

    @property
    def placement(self) -> dict[int, int]:
        """The rank holding each model stage, as the orders place them."""
        return {a.stage: r for r, order in self.orders.items() for a in order}

    def cost(self, action: Action) -> float:
        """The simulated cost of one action of this schedule."""
        return action_cost(action, self.t_forward, self.t_backward, self.t_weight, self.virtual, self.stage_costs)

    def slots(self, rank: int) -> tuple[IdleSlot, ...]:
        """The rank's idle slots of one isolated iteration (``warmup`` ... ``tail``)."""
        return self._slots[self._check_rank(rank)]

    def cyclic_slots(self, rank: int) -> tuple[IdleSlot, ...]:
        """The rank's idle slots between back-to-back iterations (what a running trainer sees)."""
        return self._cyclic[self._check_rank(rank)]

    def _check_rank(self, rank: int) -> int:
        if rank not in self._slots:
            raise ConfigError(f"rank {rank} is not in this {self.ranks}-rank schedule")
        return rank

    def idle_time(self, rank: int) -> float:
        return sum(s.length for s in self.slots(rank))

    def bubble_fraction(self, rank: int | None = None) -> float:
        """Idle share of the iteration, for one rank or averaged over all ranks."""
        if self.makespan <= 0:
            return 0.0
        if rank is not None:
            return self.idle_time(rank) / self.makespan
        return sum(self.idle_time(r) for r in range(self.ranks)) / (self.ranks * self.makespan)

    def text_form(self) -> str:
        """The action order, one line per rank: ``0: F0 F1 B0 F2 B1 B2``."""
        return "\n".join(
            f"{r}: " + " ".join(a.label(self.virtual, self.ranks) for a in self.orders[r])
            for r in range(self.ranks)
        )


# ------------------------------------------------------------------ building orders


def _check_positive_int(name: str, value: int, minimum: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def _check_cost(name: str, value: float, allow_zero: bool = False) -> float:
    if not isinstance(value, (int, float)) or math.isnan(value) or math.isinf(value):
        raise ConfigError(f"{name} must be a finite number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value}")
    return float(value)


def _gpipe_orders(p: int, m: int) -> dict[int, list[Action]]:
    return {
        r: [Action(FORWARD, r, i) for i in range(m)] + [Action(BACKWARD, r, i) for i in range(m)]
        for r in range(p)
    }


def _one_f_one_b(r: int, p: int, m: int, bwd: str = BACKWARD) -> list[Action]:
    # Rank r runs min(m, p - r) forwards, then alternates one backward and one forward, then drains
    # the remaining backwards: the order torch.distributed.pipelining.Schedule1F1B runs.
    warmup = min(m, p - r)
    order = [Action(FORWARD, r, i) for i in range(warmup)]
    fwd, bwd_i = warmup, 0
    while bwd_i < m:
        order.append(Action(bwd, r, bwd_i))
        bwd_i += 1
        if fwd < m:
            order.append(Action(FORWARD, r, fwd))
            fwd += 1
    return order


def _interleaved_orders(p: int, m: int, v: int) -> dict[int, list[Action]]:
    # Megatron-LM's interleaved 1F1B: micro-batches in groups of p, each group through chunk 0, then
    # chunk 1, ...; backwards walk the chunks in reverse; rank r warms up with
    # 2 (p - r - 1) + (v - 1) p forwards (capped), then alternates forward and backward.
    if m % p:
        raise ConfigError(f"interleaved-1f1b needs micro-batches ({m}) to be a multiple of stages ({p})")
    total = m * v

    def fwd_action(r: int, k: int) -> Action:
        group, within = divmod(k, p * v)
        chunk, lane = divmod(within, p)
        return Action(FORWARD, chunk * p + r, group * p + lane)

    def bwd_action(r: int, k: int) -> Action:
        group, within = divmod(k, p * v)
        chunk, lane = divmod(within, p)
        return Action(BACKWARD, (v - 1 - chunk) * p + r, group * p + lane)

    orders: dict[int, list[Action]] = {}
    for r in range(p):
        warmup = min(total, 2 * (p - r - 1) + (v - 1) * p)
        order = [fwd_action(r, k) for k in range(warmup)]
        fwd, bwd = warmup, 0
        while fwd < total:
            order.append(fwd_action(r, fwd))
            fwd += 1
            order.append(bwd_action(r, bwd))
            bwd += 1
        order.extend(bwd_action(r, k) for k in range(bwd, total))
        orders[r] = order
    return orders


def _zb_h1_orders(p: int, m: int) -> dict[int, list[Action]]:
    # ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism"): the 1F1B order with each backward split
    # into I (input gradient, on the critical path) and W (weight gradient, deferrable). Rank r
    # defers its first r weight passes into what would be the cool-down bubbles.
    orders: dict[int, list[Action]] = {}
    for r in range(p):
        base = _one_f_one_b(r, p, m, bwd=BACKWARD_INPUT)
        deferred = min(r, m)
        order: list[Action] = []
        pending: list[int] = []
        for a in base:
            order.append(a)
            if a.kind == BACKWARD_INPUT:
                pending.append(a.microbatch)
                if len(pending) > deferred:
                    order.append(Action(BACKWARD_WEIGHT, r, pending.pop(0)))
        order.extend(Action(BACKWARD_WEIGHT, r, i) for i in pending)
        orders[r] = order
    return orders


def canonical_name(name: str) -> str:
    """The name :func:`build_schedule` knows ``name`` (or an alias of it) by; ConfigError if none."""
    key = _ALIASES.get(name.strip().lower()) if isinstance(name, str) else None
    if key is None:
        raise ConfigError(f"unknown schedule {name!r}: expected one of {', '.join(SCHEDULE_NAMES)}")
    return key


#: The most forwards an iteration (stages x micro-batches x chunks) a schedule is built for: the simulation
#: grows with it (1024 stages x 1024 micro-batches took 32 s and 766 MB; 100,000 of each never ended).
MAX_CHUNK_MICROBATCHES = 2**18


def build_schedule(
    name: str,
    stages: int,
    microbatches: int,
    t_forward: float = 1.0,
    t_backward: float = 2.0,
    t_weight: float | None = None,
    virtual: int = 1,
) -> Schedule:
    """Build and simulate a named schedule for ``stages`` pipeline ranks and ``microbatches``.

    ``virtual`` is the number of model chunks per rank (interleaved schedules only);
    ``t_weight`` defaults to half the backward (zero-bubble schedules only).
    """
    key = canonical_name(name)
    p = _check_positive_int("stages", stages)
    m = _check_positive_int("microbatches", microbatches)
    v = _check_positive_int("virtual", virtual)
    if p * m * v > MAX_CHUNK_MICROBATCHES:
        raise ConfigError(f"{p} stages x {m} micro-batches x {v} chunks is {p * m * v} forwards an iteration, more "
                          f"than the model simulates ({MAX_CHUNK_MICROBATCHES}; 1024 x 1024 took half a minute)")
    v = chunks_per_rank(key, v)
    if key == "1f1b" and m < p:
        raise ConfigError(f"1f1b needs micro-batches ({m}) >= stages ({p})")
    tf = _check_cost("t_forward", t_forward)
    tb = _check_cost("t_backward", t_backward)
    tw = tb / 2 if t_weight is None else _check_cost("t_weight", t_weight, allow_zero=True)
    if key in ZERO_BUBBLE and not tw < tb:
        raise ConfigError(f"t_weight ({tw}) must be less than t_backward ({tb})")

    if key == "gpipe":
        orders = _gpipe_orders(p, m)
    elif key == "1f1b":
        orders = {r: _one_f_one_b(r, p, m) for r in range(p)}
    elif key == "interleaved-1f1b":
        orders = _interleaved_orders(p, m, v)
    elif key == "zb-h1":
        orders = _zb_h1_orders(p, m)
    else:
        from freeride.training.torch_plans import torch_schedule_orders  # torch, only for these

        orders = torch_schedule_orders(key, p, m, v)
    return schedule_from_orders(key, orders, p * v, tf, tb, tw, virtual=v, microbatches=m)


def chunks_per_rank(name: str, virtual: int = 1) -> int:
    """The model chunks per rank a schedule runs with ``virtual`` asked for (1 meaning "not given").

    Looped schedules take 2 or more (2 when not given); V-shaped ones exactly 2; the rest 1. ConfigError
    for a number the schedule cannot run with.
    """
    key = canonical_name(name)
    v = _check_positive_int("virtual", virtual)
    if key in LOOPED:
        return max(v, 2)
    if key in V_SHAPED:
        if v not in (1, 2):
            raise ConfigError(f"schedule {key} is V-shaped: two model stages per rank, not {v}")
        return 2
    if v != 1:
        raise ConfigError(f"schedule {key} has one model chunk per stage; --virtual applies to "
                          f"{', '.join(LOOPED)}")
    return 1


# ------------------------------------------------------------------ simulation


def action_cost(
    action: Action,
    t_forward: float,
    t_backward: float,
    t_weight: float,
    virtual: int,
    stage_costs: Mapping[int, tuple[float, float, float]] | None = None,
) -> float:
    """Cost of one action: a chunk costs ``1/virtual`` of the rank's share of the model, unless
    ``stage_costs`` gives its model stage's own costs (used as given)."""
    own = stage_costs.get(action.stage) if stage_costs else None
    if own is not None:
        t_forward, t_backward, t_weight = own
        virtual = 1
    if action.kind == FORWARD:
        cost = t_forward
    elif action.kind == BACKWARD:
        cost = t_backward
    elif action.kind == BACKWARD_INPUT:
        cost = t_backward - t_weight
    else:
        cost = t_weight
    return cost / virtual


def _check_stage_costs(
    stage_costs: Mapping[int, tuple[float, float, float]] | None, num_stages: int
) -> dict[int, tuple[float, float, float]]:
    checked: dict[int, tuple[float, float, float]] = {}
    for stage, costs in (stage_costs or {}).items():
        if not isinstance(stage, int) or not 0 <= stage < num_stages:
            raise ConfigError(f"stage_costs names model stage {stage!r}; the schedule has stages 0..{num_stages - 1}")
        if len(costs) != 3:
            raise ConfigError(f"stage_costs[{stage}] must be (t_forward, t_backward, t_weight), got {costs!r}")
        tf = _check_cost(f"stage_costs[{stage}] t_forward", costs[0])
        tb = _check_cost(f"stage_costs[{stage}] t_backward", costs[1])
        tw = _check_cost(f"stage_costs[{stage}] t_weight", costs[2], allow_zero=True)
        if tw > tb:
            raise ConfigError(f"stage_costs[{stage}] t_weight ({tw}) exceeds t_backward ({tb})")
        checked[stage] = (tf, tb, tw)
    return checked


def input_dependency(action: Action, num_stages: int) -> Action | None:
    """The action whose output ``action`` consumes, or None (a first stage's forward).

    A weight pass ``W`` consumes its own ``I`` (the gradient at its stage's output), on its own rank: an order
    that runs a ``W`` before its ``I`` deadlocks, as torch's runtime refuses it."""
    if action.kind == FORWARD:
        return Action(FORWARD, action.stage - 1, action.microbatch) if action.stage > 0 else None
    if action.kind == BACKWARD_WEIGHT:
        return Action(BACKWARD_INPUT, action.stage, action.microbatch)
    if action.stage == num_stages - 1:
        return Action(FORWARD, action.stage, action.microbatch)
    return Action(action.kind, action.stage + 1, action.microbatch)


def simulate(
    orders: Mapping[int, Sequence[Action]],
    num_stages: int,
    t_forward: float,
    t_backward: float,
    t_weight: float = 0.0,
    virtual: int = 1,
    stage_costs: Mapping[int, tuple[float, float, float]] | None = None,
) -> tuple[dict[int, tuple[TimedAction, ...]], float]:
    """Place every rank's actions in time (list scheduling in the given order, free transfers).

    A zero-bubble order mixes ``I`` and ``B``: a ``B`` satisfies a dependency on ``I`` and the
    reverse. Raises :class:`ConfigError` if the orders deadlock or miss a dependency.
    """
    ends: dict[Action, float] = {}
    cursor = {r: 0 for r in orders}
    free_at = {r: 0.0 for r in orders}
    placed: dict[int, list[TimedAction]] = {r: [] for r in orders}
    remaining = sum(len(o) for o in orders.values())
    while remaining:
        progressed = False
        for r, order in orders.items():
            while cursor[r] < len(order):
                action = order[cursor[r]]
                dep = input_dependency(action, num_stages)
                ready = 0.0
                if dep is not None:
                    done = ends.get(dep)
                    if done is None and dep.kind in (BACKWARD, BACKWARD_INPUT):
                        other = BACKWARD_INPUT if dep.kind == BACKWARD else BACKWARD
                        done = ends.get(Action(other, dep.stage, dep.microbatch))
                    if done is None:
                        break
                    ready = done
                start = max(free_at[r], ready)
                end = start + action_cost(action, t_forward, t_backward, t_weight, virtual, stage_costs)
                ends[action] = end
                free_at[r] = end
                placed[r].append(TimedAction(action, start, end))
                cursor[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: str(orders[r][cursor[r]]) for r in orders if cursor[r] < len(orders[r])}
            raise ConfigError(f"schedule deadlocks: ranks wait on {stuck}")
    makespan = max((t[-1].end for t in placed.values() if t), default=0.0)
    return {r: tuple(t) for r, t in placed.items()}, makespan


def gap_kind(prev: Action | None, nxt: Action | None, first_backward: Action | None) -> str:
    """The kind of the wait between ``prev`` and ``nxt`` (None: the iteration's start or end)."""
    if prev is None:
        return WARMUP
    if nxt is None:
        return TAIL
    if nxt.kind == FORWARD:
        return STEADY if prev.kind != FORWARD else FILL
    if nxt == first_backward:
        return TURNAROUND
    return DRAIN


def _find_slots(
    rank: int, timeline: Sequence[TimedAction], makespan: float, eps: float
) -> tuple[tuple[IdleSlot, ...], tuple[IdleSlot, ...]]:
    first_backward = next((t.action for t in timeline if t.action.is_backward), None)
    # (start, length, position of the action that ends the gap, that action, the one before it)
    gaps: list[tuple[float, float, int, Action | None, Action | None]] = []
    prev_end, prev = 0.0, None
    for position, t in enumerate(timeline):
        if t.start - prev_end > eps:
            gaps.append((prev_end, t.start - prev_end, position, t.action, prev))
        prev_end, prev = t.end, t.action
    tail = makespan - prev_end
    if tail > eps:
        gaps.append((prev_end, tail, len(timeline), None, prev))

    slots = tuple(
        IdleSlot(rank, position, start, length, gap_kind(after, before, first_backward), before, after)
        for start, length, position, before, after in gaps
    )
    # Cyclic layout: the tail joins the next iteration's warm-up into one boundary wait (position 0).
    inner = [s for s in slots if s.kind not in (WARMUP, TAIL)]
    lead = next((s for s in slots if s.kind == WARMUP), None)
    end = next((s for s in slots if s.kind == TAIL), None)
    cyclic: list[IdleSlot] = []
    if lead is not None or end is not None:
        length = (lead.length if lead else 0.0) + (end.length if end else 0.0)
        first = timeline[0].action if timeline else None
        last = timeline[-1].action if timeline else None
        cyclic.append(IdleSlot(rank, 0, -end.length if end else 0.0, length, BOUNDARY, first, last))
    cyclic.extend(inner)
    return slots, tuple(cyclic)


def schedule_from_orders(
    name: str,
    orders: Mapping[int, Sequence[Action]],
    num_stages: int,
    t_forward: float,
    t_backward: float,
    t_weight: float = 0.0,
    virtual: int = 1,
    microbatches: int | None = None,
    stage_costs: Mapping[int, tuple[float, float, float]] | None = None,
) -> Schedule:
    """Simulate arbitrary per-rank action orders (e.g. read off a torch schedule at run time).

    ``stage_costs`` overrides the costs of the model stages it names (see the module doc).
    """
    if not orders:
        raise ConfigError("a schedule needs at least one rank")
    own = _check_stage_costs(stage_costs, num_stages)
    timeline, makespan = simulate(orders, num_stages, t_forward, t_backward, t_weight, virtual, own)
    costs = [c / virtual for c in (t_forward, t_backward, t_weight, t_backward - t_weight)]
    costs += [c for tf, tb, tw in own.values() for c in (tf, tb, tw, tb - tw)]
    smallest = min((c for c in costs if c > 0), default=1.0)
    eps = smallest * _EPS_FRACTION * max(1, len(timeline))
    slots: dict[int, tuple[IdleSlot, ...]] = {}
    cyclic: dict[int, tuple[IdleSlot, ...]] = {}
    for r, t in timeline.items():
        slots[r], cyclic[r] = _find_slots(r, t, makespan, eps)
    if microbatches is None:
        microbatches = len({a.microbatch for o in orders.values() for a in o})
    return Schedule(
        name=name,
        ranks=len(orders),
        microbatches=microbatches,
        virtual=virtual,
        t_forward=t_forward,
        t_backward=t_backward,
        t_weight=t_weight,
        orders={r: tuple(o) for r, o in orders.items()},
        timeline=timeline,
        makespan=makespan,
        _slots=slots,
        _cyclic=cyclic,
        stage_costs=own,
    )


def expected_bubble_fraction(name: str, stages: int, microbatches: int, virtual: int = 1) -> float:
    """The textbook fraction of GPipe, 1F1B and interleaved 1F1B: ``(p-1)/(v m + p-1)``.

    It holds for any ``t_f``, ``t_b`` when every chunk costs the same; zero-bubble schedules have no
    closed form here (simulate them).
    """
    key = canonical_name(name)
    if key not in ("gpipe", "1f1b", "interleaved-1f1b"):
        raise ConfigError(f"{key} has no closed-form bubble fraction here; simulate it")
    p, m = stages, microbatches
    v = virtual if key == "interleaved-1f1b" else 1
    return (p - 1) / (v * m + p - 1)


# ------------------------------------------------------------------ printing


def draw_grid(schedule: Schedule, max_columns: int = 160) -> str:
    """Draw the step x stage grid: one row per rank, one column per time quantum.

    An action shows its label in its first column and ``~`` after; idle columns show ``.``.
    The quantum is the greatest common step of the action costs when they are commensurable,
    else ``makespan / max_columns``.
    """
    costs = sorted({schedule.cost(t.action) for ts in schedule.timeline.values() for t in ts})
    quantum = _common_step(costs) or (schedule.makespan / max_columns if schedule.makespan else 1.0)
    columns = max(1, round(schedule.makespan / quantum))
    if columns > max_columns:
        quantum = schedule.makespan / max_columns
        columns = max_columns
    labels = [t.action.label(schedule.virtual, schedule.ranks) for ts in schedule.timeline.values() for t in ts]
    width = max([len(s) for s in labels] + [2]) + 1
    lines = []
    header = "".join(f"{i:<{width}d}" if i % 5 == 0 else " " * width for i in range(columns))
    lines.append(f"{'step':>8} |{header.rstrip()}")
    for r in range(schedule.ranks):
        cells = ["." * (width - 1) + " "] * columns
        for t in schedule.timeline[r]:
            first = min(columns - 1, round(t.start / quantum))
            last = max(first + 1, min(columns, round(t.end / quantum)))
            cells[first] = f"{t.action.label(schedule.virtual, schedule.ranks):<{width}}"
            for c in range(first + 1, last):
                cells[c] = "~" * (width - 1) + " "
        lines.append(f"{'stage ' + str(r):>8} |{''.join(cells).rstrip()}")
    return "\n".join([*lines, *grid_legend(schedule)])


_KIND_NAMES = {FORWARD: "a forward", BACKWARD: "a backward", BACKWARD_INPUT: "a backward's input half",
               BACKWARD_WEIGHT: "a backward's weight half"}


def grid_legend(schedule: Schedule) -> list[str]:
    """What the grid's labels say: the kinds it shows, and with virtual stages which model stage each rank's chunk is
    (a row is a rank, ``.c`` its chunk ``c``, where the slot tables name model stages)."""
    present = {t.action.kind for ts in schedule.timeline.values() for t in ts}
    kinds = [k for k in _KIND_NAMES if k in present] or [FORWARD]
    virtual = schedule.virtual > 1
    label = f"{kinds[0]}3" + (".1" if virtual else "")
    through = " through the row's chunk 1" if virtual else ""
    others = "".join(f", {k}: {_KIND_NAMES[k]}" for k in kinds[1:])
    lines = [f"{'':>8}  {label} = micro-batch 3's {_KIND_NAMES[kinds[0]].removeprefix('a ')}{through} "
             f"({kinds[0]}: {_KIND_NAMES[kinds[0]]}{others}); ~ it goes on; . idle"]
    if virtual:
        held: dict[int, list[int]] = {}
        for stage, rank in sorted(schedule.placement.items()):
            held.setdefault(rank, []).append(stage)
        ranks = "; ".join(f"rank {r}: " + ", ".join(f"{s} (.{s // schedule.ranks})" for s in stages)
                          for r, stages in sorted(held.items()))
        lines.append(f"{'':>8}  rows are ranks, the model stages each holds: {ranks}")
    return lines


def _common_step(costs: Sequence[float]) -> float | None:
    """The largest q such that every cost is (nearly) an integer multiple of q, or None."""
    positive = [c for c in costs if c > 0]
    if not positive:
        return None
    base = min(positive)
    for divisor in range(1, 13):
        q = base / divisor
        if all(abs(c / q - round(c / q)) < 1e-6 for c in positive):
            return q
    return None
