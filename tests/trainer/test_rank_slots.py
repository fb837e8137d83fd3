"""The wait model against torch's own schedules: for every schedule class torch offers, the waits the
model reads off the planned order are exactly where torch's lowered order receives, and the
steady-state simulation finds idle time only there.

The schedules are torch's real classes, built on stand-in stages (no process group is needed to
build a schedule's order); nothing here runs a pipeline.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from freeride.errors import ConfigError
from freeride.training.instrument import torch_orders
from freeride.training.rank_slots import RankPlan, gap_length, stage_ranks, steady_state, wait_positions
from freeride.training.schedules import BOUNDARY, Action, build_schedule
from freeride.training.torch_plans import StandInStage

torch_schedules = pytest.importorskip("torch.distributed.pipelining.schedules")


MULTI = {  # torch class -> placement of rank r's stages (p ranks, 2 stages each)
    "ScheduleInterleaved1F1B": lambda r, p: [r, r + p],
    "ScheduleInterleavedZeroBubble": lambda r, p: [r, r + p],
    "ScheduleLoopedBFS": lambda r, p: [r, r + p],
    "ScheduleZBVZeroBubble": lambda r, p: [r, 2 * p - 1 - r],
    "ScheduleDualPipeV": lambda r, p: [r, 2 * p - 1 - r],
}


def torch_schedule(name: str, rank: int, ranks: int, microbatches: int, csv: Path | None = None) -> Any:
    if csv is not None:
        rows = csv.read_text().split()
        stages = sorted({int(cell.split("F")[0]) for cell in rows[rank].split(",") if "F" in cell})
        sched = torch_schedules._PipelineScheduleRuntime(
            [StandInStage(s, 2 * ranks, ranks, rank) for s in stages], microbatches)
        sched._load_csv(str(csv), format="compute_only")
        return sched
    cls = getattr(torch_schedules, name)
    return cls([StandInStage(s, 2 * ranks, ranks, rank) for s in MULTI[name](rank, ranks)], microbatches)


def receives(schedule: Any, rank: int) -> set[int]:
    """Positions (in the rank's compute order) of the actions torch's lowered order receives for, and
    the tail where the rank posts any send: the runtime waits for every posted send after its last action
    (``while send_ops: _wait_batch_p2p(send_ops.pop())``)."""
    positions, recv, k = set(), set(), 0
    sends: set[tuple[str, int, int]] = set()
    for action in schedule.pipeline_order_with_comms[rank]:
        for sub in action.sub_actions or (action,):
            kind = sub.computation_type.value
            key = (sub.stage_index, sub.microbatch_index)
            if kind in ("RECV_F", "RECV_B"):
                recv.add((kind[-1], *key))
            elif kind in ("SEND_F", "SEND_B"):
                sends.add((kind[-1], *key))
            elif kind in ("F", "B", "I", "W"):
                direction = "F" if kind == "F" else "B"
                if kind != "W" and (direction, *key) in recv:
                    positions.add(k)
                k += 1
    if sends:
        positions.add(k)
    return positions


CASES = [(name, p, m) for name in MULTI for p, m in ((2, 4), (4, 8))]


@pytest.mark.parametrize("name,ranks,microbatches", CASES)
def test_the_model_waits_exactly_where_torch_receives(name: str, ranks: int, microbatches: int) -> None:
    schedules = {r: torch_schedule(name, r, ranks, microbatches) for r in range(ranks)}
    orders = torch_orders(schedules[0].pipeline_order_with_comms)
    for rank in range(ranks):
        assert torch_orders(schedules[rank].pipeline_order_with_comms) == orders  # every rank sees one plan
        assert set(wait_positions(orders, rank, 2 * ranks, sends_waited_at_end=True)) == receives(
            schedules[rank], rank), rank


def test_a_runtime_rank_whose_last_action_sends_nothing_still_waits_for_its_earlier_sends() -> None:
    # Stranger trial: interleaved zero-bubble's rank 1 ends I3, SEND_B3, W2, W3, and waited up to 11 ms past
    # its last W for rank 0 to take the gradient of I3: a wait no bubble reported.
    orders = torch_orders(torch_schedule("ScheduleInterleavedZeroBubble", 1, 2, 4).pipeline_order_with_comms)
    assert orders[1][-1].kind == "W"
    tail = len(orders[1])
    assert tail not in wait_positions(orders, 1, 4)  # a framework whose sends are waited where they are made
    assert tail in wait_positions(orders, 1, 4, sends_waited_at_end=True)
    assert tail in RankPlan.from_orders(orders, 1, sends_waited_at_end=True).positions


@pytest.mark.parametrize("name,ranks,microbatches", CASES)
def test_the_steady_state_of_every_torch_order_idles_only_where_it_waits(name: str, ranks: int,
                                                                        microbatches: int) -> None:
    orders = torch_orders(torch_schedule(name, 0, ranks, microbatches).pipeline_order_with_comms)
    costs = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
    state = steady_state(orders, 2 * ranks, lambda a: costs[a.kind] * (1.5 if a.stage == 1 else 1.0), between=0.5)
    busy = {r: sum(costs[a.kind] * (1.5 if a.stage == 1 else 1.0) for a in orders[r]) + 0.5 for r in orders}
    for rank in range(ranks):
        plan = RankPlan.from_orders(orders, rank)
        idle_at = {k for k, gap in enumerate(state.gaps[rank]) if gap > 1e-9}
        assert idle_at <= set(plan.positions), rank
        # Busy plus idle fill the period: nothing is lost or counted twice.
        assert busy[rank] + sum(state.gaps[rank]) == pytest.approx(state.period)


def test_an_order_loaded_from_csv_is_modelled_like_any_other(tmp_path: Path) -> None:
    # Megatron's interleaved order (not torch's): torch's runtime runs it as given.
    megatron = build_schedule("interleaved-1f1b", 2, 4, virtual=2)
    csv = tmp_path / "order.csv"
    csv.write_text("\n".join(",".join(str(a) for a in megatron.orders[r]) for r in (0, 1)) + "\n")
    for rank in (0, 1):
        sched = torch_schedule("", rank, 2, 4, csv)
        orders = torch_orders(sched.pipeline_order_with_comms)
        assert orders == {r: list(o) for r, o in megatron.orders.items()}
        assert set(wait_positions(orders, rank, 4, sends_waited_at_end=True)) == receives(sched, rank)


def test_v_shaped_placements_hand_over_between_a_ranks_own_stages_without_a_wait() -> None:
    # ZBV on 2 ranks: rank 1 holds stages 1 and 2, so stage 2's forwards and stage 1's input
    # gradients come from rank 1 itself; rank 0 holds 0 and 3 (the loss), so 3's backwards are local.
    orders = torch_orders(torch_schedule("ScheduleZBVZeroBubble", 0, 2, 4).pipeline_order_with_comms)
    assert stage_ranks(orders) == {0: 0, 3: 0, 1: 1, 2: 1}
    for rank, local in ((1, {("F", 2), ("I", 1), ("B", 1)}), (0, {("I", 3), ("B", 3), ("F", 0)})):
        plan = RankPlan.from_orders(orders, rank)
        for k, a in enumerate(plan.order):
            if (a.kind, a.stage) in local or a.kind == "W":
                assert k not in plan.positions, (rank, str(a))


def test_slot_ids_kinds_and_neighbours_of_a_rank() -> None:
    orders = build_schedule("1f1b", 2, 4).orders
    plan = RankPlan.from_orders(orders, 1)  # F0 B0 F1 B1 F2 B2 F3 B3: every forward received
    assert plan.positions == (0, 2, 4, 6, 8)
    slot = plan.slot(0)
    assert (slot.index, slot.kind, slot.before, slot.after) == (0, BOUNDARY, Action("F", 1, 0), Action("B", 1, 3))
    tail = plan.slot(8)
    assert (tail.kind, tail.before, tail.after) == ("tail", None, Action("B", 1, 3))
    assert plan.kind(2) == "steady" and plan.stages == (1,)


def test_gap_length_is_a_slots_length_in_the_simulated_timeline() -> None:
    s = build_schedule("1f1b", 4, 8, 1.0, 2.0)
    for r in range(4):
        for slot in s.cyclic_slots(r):  # a boundary slot joins the tail and the warm-up
            assert gap_length(s, r, slot) == pytest.approx(slot.length)


def test_orders_that_cannot_be_modelled_are_refused() -> None:
    with pytest.raises(ConfigError, match="deadlocks"):
        steady_state({0: [Action("B", 0, 0), Action("F", 0, 0)], 1: [Action("F", 1, 0), Action("B", 1, 0)]}, 2,
                     lambda a: 1.0)
    with pytest.raises(ConfigError, match="num_stages is 1"):
        RankPlan.from_orders({0: [Action("F", 0, 0)], 1: [Action("F", 1, 0)]}, 0, num_stages=1)
    with pytest.raises(ConfigError, match="at least 2 iterations"):
        steady_state({0: [Action("F", 0, 0)]}, 1, lambda a: 1.0, iterations=1)


def test_the_simulation_asks_each_actions_cost_once_and_a_plan_remodels_as_a_fresh_simulation_would() -> None:
    orders = build_schedule("interleaved-1f1b", 4, 8).orders
    asked: list[Action] = []

    def cost(action: Action) -> float:
        asked.append(action)
        return 1.0 + action.stage / 10 + (1.0 if action.is_backward else 0.0)

    steady_state(orders, 8, cost, 0.5)
    assert sorted(asked, key=str) == sorted({a for o in orders.values() for a in o}, key=str)

    plan = RankPlan.from_orders(orders, 1)
    for scale, between in ((1.0, 0.0), (3.0, 2.0), (0.5, 0.25)):  # the plan's tables, reused with new costs
        def scaled(action: Action, scale: float = scale) -> float:
            return scale * cost(action)

        fresh = steady_state(orders, 8, scaled, between).gaps[1]
        assert plan.modelled_lengths(scaled, between) == {
            k: fresh[k] if k < len(fresh) else 0.0 for k in plan.positions}
