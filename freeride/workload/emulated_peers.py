"""The emulated neighbours of the single-device mode (:mod:`freeride.workload.single_stage`): pure, no torch.

:class:`EmulatedPeers` places every other stage's actions in time the way
:func:`freeride.training.schedules.simulate` does (list scheduling in each rank's order: an action
starts when its rank is free and its input has arrived), except that the real stage's own actions are
not modelled: their real end times are fed in as they happen. A receive waits until the emulated
peer's action that produces it ends, so the neighbours react to the real stage like real ones would
(a slow forward here delays the gradient that comes back), and with equal costs everywhere the waits
are exactly the model's idle slots (tested). :func:`plan_waits` runs the same emulation ahead on
fixed costs: where and how long the real stage waits in a steady iteration, the predictions the mode
reports. :func:`jittered` draws the seeded noise of ``--jitter-pct``; :func:`sleep_until` is how a
CPU stage waits (sleep, then spin the last microseconds).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from freeride.errors import ConfigError
from freeride.training.schedules import FORWARD, Action, IdleSlot, build_schedule, input_dependency

_Key = tuple[int, Action]  # (iteration, action)


@dataclass(frozen=True)
class ActionCosts:
    """Cost of one micro-batch's forward and full backward through one stage (any unit)."""

    forward: float
    backward: float

    def of(self, action: Action) -> float:
        return self.forward if action.kind == FORWARD else self.backward


class EmulatedPeers:
    """The other stages of the pipeline, simulated as they would run around the real one.

    ``orders`` is every rank's action order of one iteration (repeated for every iteration);
    ``rank`` is the real stage. A peer action starts when its rank has finished the previous action
    (for a rank's first action of iteration ``k > 0``: its last action of ``k - 1`` plus
    ``overhead(k - 1)``; of iteration 0: ``start``) and its input has arrived, and ends
    ``peer_cost(iteration, rank, action)`` later. An input produced by the real stage arrives at
    ``own_end(iteration, action)``, the real end time. Times are evaluated on demand and memoized,
    so a query touches only what it depends on; a deadlock-free order never needs a real action
    that has not run yet (it would deadlock a real pipeline too).
    """

    def __init__(
        self,
        orders: Mapping[int, Sequence[Action]],
        num_stages: int,
        rank: int,
        *,
        own_end: Callable[[int, Action], float | None],
        peer_cost: Callable[[int, int, Action], float],
        overhead: Callable[[int], float],
        start: float,
    ) -> None:
        if rank not in orders:
            raise ConfigError(f"stage {rank} is not in the {num_stages}-stage schedule")
        self.rank = rank
        self.num_stages = num_stages
        self._orders = {q: tuple(o) for q, o in orders.items()}
        self._position = {a: i for o in self._orders.values() for i, a in enumerate(o)}
        self._own_end = own_end
        self._peer_cost = peer_cost
        self._overhead = overhead
        self._start = start
        self._ends: dict[_Key, float] = {}
        self._horizon = 0  # iterations before this one are forgotten

    def release_time(self, iteration: int, action: Action) -> float | None:
        """When the input of the real stage's ``action`` arrives; None if no neighbour sends it."""
        dep = input_dependency(action, self.num_stages)
        if dep is None or dep.stage == self.rank:
            return None
        return self._end((iteration, dep))

    def forget_before(self, iteration: int) -> None:
        """Drop the times of iterations before ``iteration`` (keep two back: a peer's first action
        of an iteration depends on its last of the previous one)."""
        if iteration > self._horizon:
            self._horizon = iteration
            self._ends = {k: v for k, v in self._ends.items() if k[0] >= iteration}

    def _end(self, key: _Key) -> float:
        stack = [key]
        on_stack = {key}
        while stack:
            it, action = stack[-1]
            if (it, action) in self._ends:
                on_stack.discard(stack.pop())
                continue
            if it < self._horizon:
                raise RuntimeError(f"emulated pipeline: iteration {it} is already forgotten (needed for {key})")
            needed: _Key | None = None
            ready: list[float] = []
            order = self._orders[action.stage]
            pos = self._position[action]
            if pos > 0:
                prev: _Key | None = (it, order[pos - 1])
            elif it > 0:
                prev = (it - 1, order[-1])
            else:
                prev = None
                ready.append(self._start)
            if prev is not None:
                if prev in self._ends:
                    ready.append(self._ends[prev] + (self._overhead(it - 1) if pos == 0 else 0.0))
                else:
                    needed = prev
            dep = input_dependency(action, self.num_stages)
            if dep is not None and needed is None:
                if dep.stage == self.rank:
                    own = self._own_end(it, dep)
                    if own is None:
                        raise RuntimeError(
                            f"emulated pipeline: stage {action.stage}'s {action.kind}{action.microbatch} of "
                            f"iteration {it} needs the real stage's {dep.kind}{dep.microbatch}, which has not run"
                        )
                    ready.append(own)
                elif (it, dep) in self._ends:
                    ready.append(self._ends[(it, dep)])
                else:
                    needed = (it, dep)
            if needed is not None:
                if needed in on_stack:
                    raise ConfigError(f"the schedule's orders deadlock at {needed[1]} of iteration {needed[0]}")
                stack.append(needed)
                on_stack.add(needed)
                continue
            self._ends[(it, action)] = max(ready) + self._peer_cost(it, action.stage, action)
            on_stack.discard(stack.pop())
        return self._ends[key]


@dataclass(frozen=True)
class PlannedWait:
    """The real stage's wait before ``action`` in a steady iteration: ``length`` from ``start``
    (offset from the end of the stage's previous iteration plus its overhead); ``slot`` is the
    reference layout's slot ending there, or None for a wait the layout does not name."""

    action: Action
    start: float
    length: float
    slot: IdleSlot | None


@dataclass(frozen=True)
class WaitPlan:
    """Where and how long the real stage waits in one steady (cyclic) iteration."""

    slots: tuple[IdleSlot, ...]
    waits: tuple[PlannedWait, ...]
    period: float
    busy: float

    @property
    def idle(self) -> float:
        return sum(w.length for w in self.waits)

    @property
    def bubble_fraction(self) -> float:
        return self.idle / self.period if self.period > 0 else 0.0

    def slot_length(self, index: int) -> float:
        return next((w.length for w in self.waits if w.slot is not None and w.slot.index == index), 0.0)

    def wait_before(self, action: Action) -> PlannedWait | None:
        return next((w for w in self.waits if w.action == action), None)


def reference_layout(schedule: str, stages: int, microbatches: int, stage_index: int) -> tuple[IdleSlot, ...]:
    """The stage's cyclic slots at the reference 1 : 2 cost ratio: the reference trainer's slot ids."""
    return build_schedule(schedule, stages, microbatches).cyclic_slots(stage_index)


def plan_waits(
    schedule: str,
    stages: int,
    microbatches: int,
    stage_index: int,
    own: ActionCosts,
    peers: ActionCosts,
    overhead: float = 0.0,
) -> WaitPlan:
    """The real stage's waits in steady state, from the emulation run with fixed costs.

    The stage itself costs ``own``, every peer ``peers``, and every stage spends ``overhead``
    between iterations. Two iterations are emulated; the second is the steady one (in GPipe and
    1F1B the first stage's last backward is the last action of an iteration, so iteration 1 is
    iteration 0 shifted, plus the wait across the boundary). With ``own == peers`` the waits are
    :meth:`freeride.training.schedules.Schedule.cyclic_slots` of ``simulate``. Every slot of the reference
    layout is in ``waits`` (with length 0 if it closes), plus any other wait longer than zero.
    """
    model = build_schedule(schedule, stages, microbatches)
    slots = model.cyclic_slots(stage_index)
    by_action = {s.before: s for s in slots}
    order = model.orders[stage_index]
    own_ends: dict[_Key, float] = {}
    engine = EmulatedPeers(
        model.orders, stages, stage_index,
        own_end=lambda it, a: own_ends.get((it, a)),
        peer_cost=lambda it, q, a: peers.of(a),
        overhead=lambda it: overhead,
        start=0.0,
    )
    eps = 1e-9 * (own.forward + own.backward + peers.forward + peers.backward)
    free = 0.0
    waits: list[PlannedWait] = []
    busy = 0.0
    for it in (0, 1):
        iteration_start = free
        for action in order:
            release = engine.release_time(it, action)
            begin = free if release is None else max(free, release)
            slot = by_action.get(action)
            if it == 1 and (slot is not None or begin - free > eps):
                waits.append(PlannedWait(action, free - iteration_start, begin - free, slot))
            free = begin + own.of(action)
            own_ends[(it, action)] = free
            if it == 1:
                busy += own.of(action)
        free += overhead
    busy += overhead
    return WaitPlan(slots, tuple(waits), busy + sum(w.length for w in waits), busy)


def jittered(cost: float, jitter_pct: float, seed: int, iteration: int, rank: int, action: Action) -> float:
    """``cost`` times a factor drawn uniformly from ``1 +- jitter_pct/100``, the same for the same
    (seed, iteration, rank, action) whatever order the emulation evaluates them in."""
    if jitter_pct <= 0:
        return cost
    draw = random.Random(f"{seed}/{iteration}/{rank}/{action}").random()
    return cost * (1.0 + jitter_pct / 100.0 * (2.0 * draw - 1.0))


def sleep_until(target_ns: int, spin_ns: int) -> None:
    """Block until ``time.monotonic_ns() >= target_ns``: sleep to ``spin_ns`` before it, then spin."""
    while True:
        left = target_ns - time.monotonic_ns()
        if left <= 0:
            return
        if left > spin_ns:
            time.sleep((left - spin_ns) / 1e9)
        else:
            while time.monotonic_ns() < target_ns:
                pass
            return
