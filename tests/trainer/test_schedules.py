"""The analytical bubble model against known formulas and hand-derived slot layouts."""

from __future__ import annotations

import argparse
import json

import pytest

from freeride._cli import plan as plan_cli
from freeride.errors import ConfigError
from freeride.training.schedules import (
    BOUNDARY,
    DRAIN,
    TAIL,
    TURNAROUND,
    WARMUP,
    Action,
    build_schedule,
    draw_grid,
    expected_bubble_fraction,
    schedule_from_orders,
)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(2, 2), (2, 4), (3, 5), (4, 4), (4, 8), (5, 16), (8, 8)])
@pytest.mark.parametrize("tf,tb", [(1.0, 2.0), (1.0, 1.0), (3.0, 7.0)])
def test_bubble_fraction_matches_formula(name: str, p: int, m: int, tf: float, tb: float) -> None:
    s = build_schedule(name, p, m, tf, tb)
    assert s.bubble_fraction() == pytest.approx((p - 1) / (m + p - 1))
    assert s.makespan == pytest.approx((m + p - 1) * (tf + tb))
    for r in range(p):
        # Every stage idles (p-1)(t_f+t_b) per iteration, only the placement differs.
        assert s.idle_time(r) == pytest.approx((p - 1) * (tf + tb))
        assert sum(s.length for s in s.cyclic_slots(r)) == pytest.approx((p - 1) * (tf + tb))


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (4, 8, 4), (3, 6, 3)])
def test_interleaved_fraction(p: int, m: int, v: int) -> None:
    s = build_schedule("interleaved-1f1b", p, m, 1.0, 2.0, virtual=v)
    assert s.bubble_fraction() == pytest.approx((p - 1) / (v * m + p - 1))
    assert s.bubble_fraction() == pytest.approx(expected_bubble_fraction("interleaved-1f1b", p, m, v))


def test_zero_bubble_beats_1f1b_and_is_zero_when_balanced() -> None:
    zb = build_schedule("zb-h1", 4, 8, 1.0, 2.0, t_weight=1.0)
    one = build_schedule("1f1b", 4, 8, 1.0, 2.0)
    assert zb.bubble_fraction() < one.bubble_fraction()
    # ZB-H1 with t_f = t_i = t_w removes the cool-down bubbles: only warm-up/turnaround remain.
    assert all(s.kind in (WARMUP, TURNAROUND) for r in range(4) for s in zb.slots(r))


def test_gpipe_layout_per_stage() -> None:
    # p=4, m=4, t_f=1, t_b=2: stage r waits r for its first activation, then between its last
    # forward and first backward 3 (p-1-r) (the gradient's trip down and back), then a tail of 2r.
    s = build_schedule("gpipe", 4, 4, 1.0, 2.0)
    for r in range(4):
        got = [(x.kind, x.start, x.length) for x in s.slots(r)]
        want = []
        if r:
            want.append((WARMUP, 0.0, float(r)))
        if r < 3:
            want.append((TURNAROUND, 4.0 + r, 3.0 * (3 - r)))
        if r:
            want.append((TAIL, 21.0 - 2 * r, 2.0 * r))
        assert got == want


def test_1f1b_layout_per_stage() -> None:
    # p=4, m=4, t_f=1, t_b=2 (the reference system's 4x4 shape): A warm-up on stages 1-3, B
    # turnaround on stages 0-2, D drain gaps between cool-down backwards, C tail on stages 1-3.
    s = build_schedule("1f1b", 4, 4, 1.0, 2.0)
    kinds = {r: [x.kind for x in s.slots(r)] for r in range(4)}
    assert kinds == {
        0: [TURNAROUND, DRAIN, DRAIN, DRAIN],
        1: [WARMUP, TURNAROUND, DRAIN, DRAIN, TAIL],
        2: [WARMUP, TURNAROUND, DRAIN, TAIL],
        3: [WARMUP, TAIL],
    }
    assert [x.length for x in s.slots(0)] == [6.0, 1.0, 1.0, 1.0]
    assert [x.length for x in s.slots(2)] == [2.0, 2.0, 1.0, 4.0]
    # A slot's index is the position of the action that ends it (the order's length for a tail).
    for r in range(4):
        order = s.orders[r]
        assert [x.index for x in s.slots(r)] == [order.index(x.before) if x.before else len(order)
                                                 for x in s.slots(r)]
    first = s.slots(0)[0]
    assert first.after == Action("F", 0, 3) and first.before == Action("B", 0, 0)


def test_cyclic_layout_merges_tail_and_warmup() -> None:
    s = build_schedule("1f1b", 4, 8, 1.0, 2.0)
    for r in range(1, 4):
        per_iter = s.slots(r)
        cyc = s.cyclic_slots(r)
        assert cyc[0].kind == BOUNDARY
        assert cyc[0].length == pytest.approx(per_iter[0].length + per_iter[-1].length)
        assert cyc[0].length == pytest.approx(r * 3.0)  # r (t_f + t_b)
        assert len(cyc) == len(per_iter) - 1
        assert [x.index for x in cyc] == [0] + [s.orders[r].index(x.before) for x in cyc[1:] if x.before]
    assert s.cyclic_slots(0) == s.slots(0)


def test_any_shape_runs() -> None:
    for p in range(1, 7):
        for m in range(p, p + 5):
            for name in ("gpipe", "1f1b", "zb-h1"):
                s = build_schedule(name, p, m, 1.5, 2.5)
                assert len(s.orders) == p
                assert all(len(o) == (3 if name == "zb-h1" else 2) * m for o in s.orders.values())
    assert build_schedule("1f1b", 1, 3).bubble_fraction() == 0.0


def test_orders_from_elsewhere_are_simulated_and_deadlocks_rejected() -> None:
    orders = {0: [Action("F", 0, 0), Action("B", 0, 0)], 1: [Action("F", 1, 0), Action("B", 1, 0)]}
    s = schedule_from_orders("custom", orders, 2, 1.0, 2.0)
    assert [x.kind for x in s.slots(0)] == [TURNAROUND]
    bad = {0: [Action("B", 0, 0), Action("F", 0, 0)], 1: [Action("F", 1, 0), Action("B", 1, 0)]}
    with pytest.raises(ConfigError, match="deadlock"):
        schedule_from_orders("bad", bad, 2, 1.0, 2.0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"name": "pipedream", "stages": 2, "microbatches": 2},
        {"name": "1f1b", "stages": 0, "microbatches": 2},
        {"name": "1f1b", "stages": 4, "microbatches": 2},
        {"name": "gpipe", "stages": 2, "microbatches": 2, "t_forward": -1},
        {"name": "interleaved-1f1b", "stages": 4, "microbatches": 6, "virtual": 2},
        {"name": "gpipe", "stages": 2, "microbatches": 2, "virtual": 2},
    ],
)
def test_bad_input_is_config_error(kwargs: dict) -> None:
    with pytest.raises(ConfigError):
        build_schedule(**kwargs)


def test_grid_and_text_form() -> None:
    s = build_schedule("1f1b", 2, 3, 1.0, 2.0)
    grid = draw_grid(s).splitlines()
    assert grid[1].split("|")[1].split() == ["F0", "F1", "..", "..", "B0", "~~", "F2", "B1", "~~", "..", "B2", "~~"]
    assert grid[2].split("|")[1].split() == ["..", "F0", "B0", "~~", "F1", "B1", "~~", "F2", "B2", "~~", "..", ".."]
    assert s.text_form() == "0: F0 F1 B0 F2 B1 B2\n1: F0 B0 F1 B1 F2 B2"
    assert grid[3].split() == ["F3", "=", "micro-batch", "3's", "forward", "(F:", "a", "forward,", "B:", "a",
                               "backward);", "~", "it", "goes", "on;", ".", "idle"]
    assert len(grid) == 4  # one rank per model stage: no chunks to name


def test_the_grid_says_which_model_stage_each_ranks_chunk_is() -> None:
    # A row is a rank; ``F3.1`` runs through its chunk 1, which is model stage 2 on a looped rank 0 and model stage 3
    # on a V-shaped one (the slot tables name model stages).
    looped = draw_grid(build_schedule("interleaved-1f1b", 2, 4, 1.0, 2.0, virtual=2)).splitlines()
    assert looped[-1].split("holds: ")[1] == "rank 0: 0 (.0), 2 (.1); rank 1: 1 (.0), 3 (.1)"
    assert "through the row's chunk 1" in looped[-2]


def _plan(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    parser = argparse.ArgumentParser()
    plan_cli.register(parser.add_subparsers())
    args = parser.parse_args(["plan", *argv])
    code = args.func(args)
    return code, capsys.readouterr().out


def test_plan_cli_table_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = _plan(["--schedule", "1f1b", "--stages", "4", "--microbatches", "8"], capsys)
    assert code == 0
    assert "bubble fraction 27.3%" in out and "stage 3" in out and "turnaround" in out
    code, out = _plan(["--schedule", "gpipe", "--stages", "4", "--microbatches", "4", "--json",
                       "--t-forward", "2", "--t-backward", "4"], capsys)
    data = json.loads(out)
    assert data["bubble_fraction"] == pytest.approx(3 / 7, abs=1e-6)
    assert data["iteration_ms"] == pytest.approx(42.0)
    assert [len(s["slots"]) for s in data["per_stage"]] == [1, 3, 3, 2]


def test_plan_cli_bad_input_raises_config_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match="unknown schedule"):
        _plan(["--schedule", "nope", "--stages", "2", "--microbatches", "2"], capsys)


def test_stage_costs_override_the_uniform_costs_per_model_stage() -> None:
    # GPipe p=2 m=2; stage 1 twice as slow as stage 0. Rank 0: F0 [0,1] F1 [1,2], then B0 waits for
    # rank 1's B0 (rank 1: F0 [1,3] F1 [3,5] B0 [5,9] B1 [9,13]): B0 [9,11], B1 [13,15].
    orders = build_schedule("gpipe", 2, 2).orders
    s = schedule_from_orders("gpipe", orders, 2, 1.0, 2.0, stage_costs={1: (2.0, 4.0, 2.0)})
    assert s.makespan == 15.0
    assert [(x.kind, x.start, x.length) for x in s.slots(0)] == [(TURNAROUND, 2.0, 7.0), (DRAIN, 11.0, 2.0)]
    assert s.cost(Action("B", 1, 0)) == 4.0 and s.cost(Action("B", 0, 0)) == 2.0
    with pytest.raises(ConfigError, match="model stage 2"):
        schedule_from_orders("gpipe", orders, 2, 1.0, 2.0, stage_costs={2: (1.0, 2.0, 1.0)})
    with pytest.raises(ConfigError, match="exceeds t_backward"):
        schedule_from_orders("gpipe", orders, 2, 1.0, 2.0, stage_costs={0: (1.0, 2.0, 3.0)})
