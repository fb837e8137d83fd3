"""Where one pipeline rank waits, and for how long, from any schedule's action order.

**Where.** A rank waits only before a compute action that needs another rank's output: a forward
whose previous model stage is held by another rank (the activation), a backward (``B`` or ``I``)
whose next model stage is (the gradient). Everything else a rank's order holds is local: the first
stage's forwards, the loss on the last stage, a weight pass (``W``) after its own ``I``, and, in
V-shaped placements (rank ``r`` holds stages ``r`` and ``2p-1-r``: ZBV, DualPipeV), the hand-over
between a rank's two stages at the bottom of the V. One more wait follows the last action: a rank
whose last action sends to another rank waits, before its iteration ends, for that send to be taken
(gloo's sends complete once the receiver has posted its receive; DeepSpeed's are blocking); in torch's
runtime schedules, which wait for every posted send once the last action is done, so does a rank any
of whose actions sends (``sends_waited_at_end``). So the
order alone gives the *wait positions*: position ``k`` is the gap before the rank's ``k``-th action,
position 0 is the wait across the iteration boundary, and the order's length is the tail
(:class:`RankPlan`). The model's transfers are free, so it gives the tail no length: its length is
measured. The torch runtime lowers the same facts into its ``pipeline_order_with_comms`` (a
``RECV_F``/``RECV_B`` for exactly these actions), which the tests check.

A framework that receives ahead says so with ``receive_at`` (per rank: action position -> the
position where the rank waits for that action's input; a position it omits, or whose input the rank
makes itself, waits where its action is): the waits are then at those positions, and the simulation
blocks the rank there. Megatron's interleaved schedule, for one, receives after each forward-backward
pair the gradient for the next pair's backward, before that pair's forward.

**How long.** :func:`steady_state` simulates back-to-back iterations of all ranks' orders (list
scheduling, as :func:`freeride.training.schedules.simulate`, with free transfers) from a cost per
action and each rank's time between iterations (the optimizer step, the next batch), and returns
every rank's gap before every position in the last, steady iteration. A running trainer sees this
layout: its ranks do not start an iteration together; each starts when its own previous iteration
and optimizer step are done. With equal costs everywhere and no time between iterations, GPipe's and
1F1B's steady gaps are the one-iteration model's (``Schedule.cyclic_slots``; tested).

**Slot ids** are the positions (as in :class:`freeride.training.schedules.IdleSlot`): the slot of
the wait before the rank's ``k``-th action is ``k``. They do not depend on the costs.

Pure: no torch, no clock. :class:`freeride.training.tracker.RankTracker` evaluates it with
online-profiled costs to predict a slot's length until the slot has been measured.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from freeride.errors import ConfigError
from freeride.training.schedules import (
    BACKWARD,
    BACKWARD_INPUT,
    BOUNDARY,
    FORWARD,
    Action,
    IdleSlot,
    Schedule,
    gap_kind,
    input_dependency,
)


def stage_ranks(orders: Mapping[int, Sequence[Action]]) -> dict[int, int]:
    """Which rank holds each model stage, read off the orders (ConfigError if two ranks run one stage)."""
    owner: dict[int, int] = {}
    for rank, order in orders.items():
        for action in order:
            held = owner.setdefault(action.stage, rank)
            if held != rank:
                raise ConfigError(f"model stage {action.stage} runs on ranks {held} and {rank}")
    return owner


def consumer_stage(action: Action, num_stages: int) -> int | None:
    """The model stage that consumes ``action``'s output, or None (a last forward, a first backward, W)."""
    if action.kind == FORWARD:
        return action.stage + 1 if action.stage < num_stages - 1 else None
    if action.kind in (BACKWARD, BACKWARD_INPUT):
        return action.stage - 1 if action.stage > 0 else None
    return None


#: Per rank, action position -> the position where the rank waits for that action's input (module doc).
ReceiveAt = Mapping[int, Mapping[int, int]]


def _check_receive_at(orders: Mapping[int, Sequence[Action]], receive_at: ReceiveAt | None
                      ) -> dict[int, dict[int, int]]:
    checked: dict[int, dict[int, int]] = {}
    for rank, moves in (receive_at or {}).items():
        if rank not in orders:
            raise ConfigError(f"receive_at names rank {rank}; the orders have ranks {sorted(orders)}")
        length = len(orders[rank])
        for k, at in moves.items():
            if not (0 <= at <= k < length):
                raise ConfigError(f"receive_at[{rank}][{k}] = {at}: a rank receives for its action {k} at a "
                                  f"position from 0 to {k} (its order has {length} actions)")
        checked[rank] = dict(moves)
    return checked


def wait_positions(orders: Mapping[int, Sequence[Action]], rank: int, num_stages: int,
                   receive_at: ReceiveAt | None = None, sends_waited_at_end: bool = False) -> tuple[int, ...]:
    """Positions in ``rank``'s order where it may wait: where it receives each action's input from
    another rank (before the action itself, unless ``receive_at`` moves it), and the tail (the order's
    length) when its last action sends to another rank, or with ``sends_waited_at_end`` (a framework that
    waits for all its posted sends once its last action is done: torch's runtime schedules) when any of its
    actions does: ZB's rank 1 ends ``I3, SEND_B3, W2, W3`` and waits for the send past its last W."""
    owner = stage_ranks(orders)
    order = orders[rank]
    moved = (receive_at or {}).get(rank, {})
    positions = set()
    for k, action in enumerate(order):
        dep = input_dependency(action, num_stages)
        if dep is not None and owner.get(dep.stage, rank) != rank:
            positions.add(moved.get(k, k))
    senders = order if sends_waited_at_end else order[-1:]
    for action in senders:
        consumer = consumer_stage(action, num_stages)
        if consumer is not None and owner.get(consumer, rank) != rank:
            positions.add(len(order))
            break
    return tuple(sorted(positions))


def gap_length(schedule: Schedule, rank: int, slot: IdleSlot) -> float:
    """The length of the gap ``slot`` delimits in ``schedule``'s one-iteration timeline (a ``boundary``
    slot: the rank's tail plus its warm-up). The planner's validation feeds it measured costs."""
    timeline = schedule.timeline[rank]
    if slot.kind == BOUNDARY:
        return (schedule.makespan - timeline[-1].end) + timeline[0].start if timeline else 0.0
    times = {t.action: t for t in timeline}
    if slot.before not in times or slot.after not in times:
        return 0.0
    return max(0.0, times[slot.before].start - times[slot.after].end)


@dataclass(frozen=True)
class SteadyState:
    """Back-to-back iterations simulated: each rank's gap before each position in a steady iteration
    (``gaps[r][0]`` is the wait across the boundary, after the rank's time between iterations), and
    the iteration period."""

    gaps: Mapping[int, tuple[float, ...]]
    period: float


@dataclass(frozen=True)
class _Numbered:
    """The cost-free part of :func:`steady_state`'s simulation, worked out once per set of orders.

    Every action is numbered once: the simulation's tables are lists indexed by number (an Action's hash
    is a frozen dataclass's, Python code: keyed by Action, it was most of a large schedule's simulation).
    ``needs[r][k]``: the inputs rank ``r`` waits for before its action at position ``k`` (an input from the
    rank itself is never moved: its own order provides it), each as (its number, the number of the action
    that stands in for it: a B for an I and the reverse; -1: none, or not in any order).
    """

    orders: Mapping[int, Sequence[Action]]
    actions: tuple[Action, ...]
    numbered: Mapping[int, tuple[int, ...]]
    needs: Mapping[int, tuple[tuple[tuple[int, int], ...], ...]]

    @classmethod
    def of(cls, orders: Mapping[int, Sequence[Action]], num_stages: int, receive_at: ReceiveAt | None) -> _Numbered:
        moved = _check_receive_at(orders, receive_at)
        owner = stage_ranks(orders) if moved else {}
        number: dict[Action, int] = {}
        for order in orders.values():
            for action in order:
                number.setdefault(action, len(number))
        needs = {}
        for r, order in orders.items():
            at: list[list[tuple[int, int]]] = [[] for _ in order]
            for k, action in enumerate(order):
                dep = input_dependency(action, num_stages)
                if dep is not None:
                    other = -1
                    if dep.kind in (BACKWARD, BACKWARD_INPUT):
                        swapped = BACKWARD_INPUT if dep.kind == BACKWARD else BACKWARD
                        other = number.get(Action(swapped, dep.stage, dep.microbatch), -1)
                    at[moved.get(r, {}).get(k, k) if owner.get(dep.stage, r) != r else k].append(
                        (number.get(dep, -1), other))
            needs[r] = tuple(tuple(x) for x in at)
        return cls(orders, tuple(number), {r: tuple(number[a] for a in o) for r, o in orders.items()}, needs)


def steady_state(
    orders: Mapping[int, Sequence[Action]],
    num_stages: int,
    cost: Callable[[Action], float],
    between: Mapping[int, float] | float = 0.0,
    iterations: int = 3,
    receive_at: ReceiveAt | None = None,
) -> SteadyState:
    """Simulate ``iterations`` back-to-back iterations (see the module doc); ConfigError on a deadlock.

    ``cost(action)`` is an action's duration (asked once per action); ``between`` what each rank spends
    between two iterations (one figure for all, or per rank). Three iterations reach the steady state of
    every schedule torch offers (the warm-up of iteration ``k+1`` overlaps only the cool-down of ``k``).
    ``receive_at`` blocks a rank, before its action at a position, on the inputs it receives there.
    """
    if iterations < 2:
        raise ConfigError("steady_state needs at least 2 iterations")
    return _simulate(_Numbered.of(orders, num_stages, receive_at), cost, between, iterations)


def _simulate(tables: _Numbered, cost: Callable[[Action], float], between: Mapping[int, float] | float,
              iterations: int = 3) -> SteadyState:
    orders, numbered, needs = tables.orders, tables.numbered, tables.needs
    gap_of = {r: float(between) for r in orders} if isinstance(between, (int, float)) else dict(between)
    ranks = list(orders)
    length = {r: len(orders[r]) for r in ranks}
    cost_of = [cost(action) for action in tables.actions]
    ends: list[list[float | None]] = [[None] * len(cost_of) for _ in range(iterations)]  # [iteration][number]
    starts = {r: [0.0] * (length[r] * iterations) for r in ranks}  # per rank, over iterations * positions
    cursor = {r: 0 for r in ranks}  # over iterations * positions
    free_at = {r: 0.0 for r in ranks}
    total = sum(length.values()) * iterations
    placed = 0
    while placed < total:
        progressed = False
        for r in ranks:
            ids, rank_needs, rank_starts, between_r = numbered[r], needs[r], starts[r], gap_of.get(r, 0.0)
            n, end_of = length[r], length[r] * iterations
            c = cursor[r]
            while c < end_of:
                it, k = divmod(c, n)
                ends_it = ends[it]
                ready = free_at[r] + (between_r if k == 0 and it > 0 else 0.0)
                blocked = False
                for dep, other in rank_needs[k]:
                    done = ends_it[dep] if dep >= 0 else None
                    if done is None and other >= 0:
                        done = ends_it[other]
                    if done is None:
                        blocked = True
                        break
                    if done > ready:
                        ready = done
                if blocked:
                    break
                rank_starts[c] = ready
                action = ids[k]
                free_at[r] = ends_it[action] = ready + cost_of[action]
                c += 1
                placed += 1
                progressed = True
            cursor[r] = c
        if not progressed:
            stuck = {r: str(orders[r][cursor[r] % length[r]]) for r in ranks if cursor[r] < length[r] * iterations}
            raise ConfigError(f"schedule deadlocks: ranks wait on {stuck}")
    last = iterations - 1
    gaps: dict[int, tuple[float, ...]] = {}
    for r in ranks:
        ids, n = numbered[r], length[r]
        row = []
        for k in range(n):
            prev = ends[last][ids[k - 1]] if k else ends[last - 1][ids[-1]]
            assert prev is not None  # every action of every iteration was placed
            prev_end = prev if k else prev + gap_of.get(r, 0.0)
            row.append(max(0.0, starts[r][last * n + k] - prev_end))
        gaps[r] = tuple(row)
    first = next(r for r in ranks if length[r])
    period = starts[first][last * length[first]] - starts[first][(last - 1) * length[first]]
    return SteadyState(gaps, period)


@dataclass(frozen=True)
class RankPlan:
    """One rank's order and the positions where it may wait (module doc); pure data.

    ``order`` is the rank's compute actions of one iteration, every model stage it holds merged in
    the order it runs them; ``orders`` every rank's (the simulation needs them all).
    """

    rank: int
    orders: Mapping[int, tuple[Action, ...]]
    num_stages: int
    positions: tuple[int, ...]
    #: Where each rank receives ahead (module doc); empty: every input is waited for before its action.
    receive_at: ReceiveAt = field(default_factory=dict)

    @classmethod
    def from_orders(cls, orders: Mapping[int, Sequence[Action]], rank: int, num_stages: int | None = None,
                    receive_at: ReceiveAt | None = None, sends_waited_at_end: bool = False) -> RankPlan:
        if rank not in orders or not orders[rank]:
            raise ConfigError(f"rank {rank} has no actions in the schedule's order (ranks: {sorted(orders)})")
        frozen = {int(r): tuple(o) for r, o in orders.items()}
        stages = max(a.stage for o in frozen.values() for a in o) + 1
        if num_stages is None:
            num_stages = stages
        elif num_stages < stages:
            raise ConfigError(f"the orders name model stage {stages - 1} but num_stages is {num_stages}")
        moved = _check_receive_at(frozen, receive_at)
        return cls(rank, frozen, num_stages, wait_positions(frozen, rank, num_stages, moved, sends_waited_at_end),
                   moved)

    @property
    def order(self) -> tuple[Action, ...]:
        return self.orders[self.rank]

    @cached_property
    def _numbered(self) -> _Numbered:
        """The simulation's cost-free tables, worked out at the first :meth:`modelled_lengths` (a tracker
        remodels the same orders at each of its first iterations)."""
        return _Numbered.of(self.orders, self.num_stages, self.receive_at)

    @property
    def stages(self) -> tuple[int, ...]:
        """The model stages this rank holds."""
        return tuple(sorted({a.stage for a in self.order}))

    def kind(self, position: int) -> str:
        """The slot kind of the wait before ``position`` (``boundary`` at 0, ``tail`` past the end)."""
        order = self.order
        if position == 0:
            return BOUNDARY
        first_backward = next((a for a in order if a.is_backward), None)
        return gap_kind(order[position - 1], order[position] if position < len(order) else None, first_backward)

    def slot(self, position: int, length: float = 0.0, start: float = 0.0, kind: str | None = None) -> IdleSlot:
        """The :class:`IdleSlot` of the wait before ``position`` (id ``position``)."""
        order = self.order
        before = order[position] if position < len(order) else None
        after = order[position - 1] if position else order[-1]
        return IdleSlot(self.rank, position, start, length, kind or self.kind(position), before, after)

    def slots(self, lengths: Mapping[int, float] | None = None) -> tuple[IdleSlot, ...]:
        """Every wait position's slot, with its modelled length where ``lengths`` has one."""
        lengths = lengths or {}
        return tuple(self.slot(k, lengths.get(k, 0.0)) for k in self.positions)

    def modelled_lengths(self, cost: Callable[[Action], float], between: Mapping[int, float] | float = 0.0
                         ) -> dict[int, float]:
        """The steady-state gap before each wait position for these costs (see :func:`steady_state`)."""
        gaps = _simulate(self._numbered, cost, between).gaps[self.rank]
        return {k: gaps[k] if k < len(gaps) else 0.0 for k in self.positions}
