"""Frameworks that receive ahead (``receive_at``): the wait positions move, the model blocks there, and
a tracker reports the early wait as that position's modelled slot. Pure: no torch, no clock."""

from __future__ import annotations

from typing import Any

import pytest

from freeride.errors import ConfigError
from freeride.training.megatron import megatron_orders, megatron_receive_at
from freeride.training.rank_slots import RankPlan, steady_state, wait_positions
from freeride.training.schedules import BACKWARD, FORWARD, Action
from freeride.training.tracker import RankTracker

MS = 1_000_000

# Two ranks, GPipe with two micro-batches: rank 0 runs F0 F1 B0 B1, rank 1 the same on stage 1.
ORDERS = {r: [Action(FORWARD, r, 0), Action(FORWARD, r, 1), Action(BACKWARD, r, 0), Action(BACKWARD, r, 1)]
          for r in (0, 1)}
EAGER = {0: {3: 2}}  # rank 0 waits for B1's gradient where it waits for B0's, before B0


def _cost(action: Action) -> float:
    return 1.0 if action.kind == FORWARD else 2.0


def test_receiving_ahead_moves_the_wait_positions() -> None:
    assert wait_positions(ORDERS, 0, 2) == (2, 3)
    assert wait_positions(ORDERS, 0, 2, EAGER) == (2,)
    assert wait_positions(ORDERS, 1, 2, EAGER) == wait_positions(ORDERS, 1, 2)  # a rank it does not name


def test_the_model_blocks_the_rank_where_it_receives() -> None:
    # Rank 1 runs F0 [1, 2], F1 [2, 3], B0 [3, 5], B1 [5, 7]. Waiting lazily, rank 0 starts B0 at 5 and
    # B1 at 7: gaps of 3 and 0. Receiving B1's gradient before B0, it starts B0 only at 7: a gap of 5.
    lazy = steady_state(ORDERS, 2, _cost, iterations=2).gaps[0]
    eager = steady_state(ORDERS, 2, _cost, iterations=2, receive_at=EAGER).gaps[0]
    assert lazy[2:] == (3.0, 0.0)
    assert eager[2:] == (5.0, 0.0)
    assert RankPlan.from_orders(ORDERS, 0, receive_at=EAGER).modelled_lengths(_cost) == {2: 5.0}


@pytest.mark.parametrize(("receive_at", "why"), [({0: {2: 3}}, "from 0 to 2"), ({0: {9: 0}}, "from 0 to 9"),
                                                 ({5: {}}, "names rank 5")])
def test_a_receive_after_its_action_or_off_the_order_is_refused(receive_at: Any, why: str) -> None:
    with pytest.raises(ConfigError, match=why):
        RankPlan.from_orders(ORDERS, 0, receive_at=receive_at)


class _Clock:
    synchronous = True

    def __init__(self, consumer: Any) -> None:
        self.consumer, self.now = consumer, 10**12

    def mark(self, payload: Any) -> None:
        self.consumer(payload, self.now)

    def flush(self, timeout_s: float = 30.0) -> bool:
        return True

    def close(self) -> None:
        pass


class _Sink:
    def __init__(self) -> None:
        self.starts: list[tuple[int, int, str]] = []

    def bubble_start(self, iteration: int, slot: int, kind: str, *args: Any, **kwargs: Any) -> None:
        self.starts.append((iteration, slot, kind))

    def bubble_end(self, iteration: int, slot: int, end_ns: int | None = None) -> None:
        pass


def test_a_tracker_reports_the_early_wait_as_its_positions_modelled_slot() -> None:
    sink = _Sink()
    clocks: list[_Clock] = []
    tracker = RankTracker(ORDERS, 0, sink, receive_at=EAGER, report_min_ns=0,
                          clock=lambda consumer: clocks.append(_Clock(consumer)) or clocks[-1])
    clock = clocks[0]
    tracker.iteration_begin()
    for k, action in enumerate(ORDERS[0]):
        if k == 2:  # the one wait: both gradients, before B0
            tracker.wait_begin()
            clock.now += 5 * MS
            tracker.wait_end()
        tracker.compute_begin(action.kind, action.stage, action.microbatch)
        clock.now += MS
        tracker.compute_end(action.kind, action.stage, action.microbatch)
    tracker.iteration_end()
    assert [(s[1], s[2]) for s in sink.starts] == [(2, "turnaround")]
    assert tracker.unplanned_waits == 0


def test_megatron_receives_ahead_only_in_the_interleaved_steady_state() -> None:
    assert megatron_receive_at(4, 8) == {}
    orders = megatron_orders(2, 4, 2)
    moved = megatron_receive_at(2, 4, 2)
    for rank, moves in moved.items():
        assert moves  # every rank has forward-backward pairs here
        for k, at in moves.items():  # each pair's backward, received at the pair's forward
            assert at == k - 1 and orders[rank][k].kind == BACKWARD and orders[rank][at].kind == FORWARD
    # Rank 0 holds stages 0 and 2: four warm-up forwards, then pairs at positions 4-5, ..., 10-11.
    assert moved[0] == {5: 4, 7: 6, 9: 8, 11: 10}


@pytest.mark.parametrize(("ranks", "microbatches", "virtual"), [(2, 4, 2), (2, 8, 2), (2, 6, 3), (3, 6, 2), (4, 8, 2)])
def test_megatrons_interleaved_orders_simulate_with_its_receives(ranks: int, microbatches: int, virtual: int) -> None:
    # The last stage's backward needs only its own forward: moving "its receive" must not block the rank on
    # the action it is about to run (that deadlocked the model, and predictions fell back to nothing).
    orders = megatron_orders(ranks, microbatches, virtual)
    receive_at = megatron_receive_at(ranks, microbatches, virtual)
    for rank in orders:
        lengths = RankPlan.from_orders(orders, rank, receive_at=receive_at).modelled_lengths(_cost)
        assert set(lengths) == set(wait_positions(orders, rank, ranks * virtual, receive_at))
