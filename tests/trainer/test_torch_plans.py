"""The planner's schedules that only torch defines (interleaved zero-bubble, looped BFS, ZBV, DualPipeV): their
order is torch's own, their model stages sit where torch places them, torch's refusals and a missing torch are
one clear error, and ``freeride plan`` offers them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from freeride import _extras
from freeride.cli import EXIT_BAD_INPUT, EXIT_OK, main
from freeride.errors import ConfigError, MissingExtra
from freeride.training.instrument import torch_orders
from freeride.training.memory import PRECISIONS, RUNTIMES, MeasuredStages, chunk_memory, rank_memory
from freeride.training.planner import Candidate, Costs, MemoryInputs, PlanInputs, plan_config
from freeride.training.schedules import (
    TORCH_SCHEDULES,
    build_schedule,
    canonical_name,
    draw_grid,
    expected_bubble_fraction,
)
from freeride.training.torch_plans import StandInStage, csv_orders, placement
from freeride.workload.pipelines import write_csv

torch_schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
FP32 = PRECISIONS["fp32"]


@pytest.mark.parametrize("name", sorted(TORCH_SCHEDULES))
@pytest.mark.parametrize("ranks,microbatches", [(2, 4), (4, 8)])
def test_every_ranks_order_is_the_one_torch_builds_for_that_rank(name: str, ranks: int, microbatches: int) -> None:
    schedule = build_schedule(name, ranks, microbatches)
    cls = getattr(torch_schedules, TORCH_SCHEDULES[name])
    for rank in range(ranks):
        own = cls([StandInStage(s, 2 * ranks, ranks, rank) for s in placement(name, ranks, 2)[rank]], microbatches)
        assert list(schedule.orders[rank]) == torch_orders(own.pipeline_order_with_comms)[rank]
    assert sum(len(o) for o in schedule.orders.values()) == len(schedule.timeline[0]) + sum(
        len(schedule.timeline[r]) for r in range(1, ranks))


def test_v_shaped_schedules_place_stages_r_and_2p_minus_1_minus_r_on_rank_r() -> None:
    for name in ("zbv", "dualpipev"):
        schedule = build_schedule(name, 4, 8)
        assert schedule.virtual == 2
        assert schedule.placement == {0: 0, 7: 0, 1: 1, 6: 1, 2: 2, 5: 2, 3: 3, 4: 3}
    assert build_schedule("interleaved-zb", 2, 4, virtual=3).placement == {0: 0, 2: 0, 4: 0, 1: 1, 3: 1, 5: 1}


def test_zero_bubble_orders_idle_less_than_their_one_f_one_b_counterparts() -> None:
    def fraction(name: str, virtual: int = 1) -> float:
        return build_schedule(name, 4, 8, 1.0, 2.0, t_weight=1.0, virtual=virtual).bubble_fraction()

    assert fraction("zbv") < fraction("1f1b")
    assert fraction("interleaved-zb", 2) < fraction("interleaved-1f1b", 2)
    assert fraction("looped-bfs", 2) > 0


def test_a_v_shaped_ranks_memory_counts_its_own_two_stages() -> None:
    measured = MeasuredStages(weight_bytes=(400, 800), activation_bytes=(40, 80))
    schedule = build_schedule("zbv", 2, 4)
    chunks = chunk_memory(measured, 2, 2, FP32, schedule.placement)
    # rank 0 holds model stages 0 and 3, rank 1 stages 1 and 2: each half of its own rank's measurement
    assert [c.params * FP32.weight_bytes for c in chunks] == [200, 400, 400, 200]
    held = rank_memory(schedule, 0, chunks, FP32, "adam", RUNTIMES["lean"]).points[0]
    assert held.weights == 400
    plan = plan_config(PlanInputs(stages=2, memory=MemoryInputs(measured, FP32, "adam", RUNTIMES["lean"])),
                       Candidate("zbv", 4))
    assert [s.peak.weights for s in plan.stages if s.peak is not None] == [400, 800]


def test_torch_class_names_are_aliases_and_closed_forms_are_not_claimed_for_them() -> None:
    assert canonical_name("ScheduleZBVZeroBubble") == "zbv"
    assert canonical_name("scheduledualpipev") == "dualpipev"
    assert canonical_name("ScheduleInterleavedZeroBubble") == "interleaved-zb"
    with pytest.raises(ConfigError, match="no closed-form"):
        expected_bubble_fraction("interleaved-zb", 4, 8, 2)


def test_configurations_torch_or_the_shape_refuses_are_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="ScheduleDualPipeV refuses 4 ranks x 2 stages each and 6 micro-batches: "
                                          "DualPipeV requires at least as many microbatches as stages"):
        build_schedule("dualpipev", 4, 6)
    with pytest.raises(ConfigError, match="V-shaped: two model stages per rank, not 3"):
        build_schedule("zbv", 2, 4, virtual=3)
    with pytest.raises(ConfigError, match="t_weight"):
        build_schedule("zbv", 2, 4, t_backward=2.0, t_weight=2.0)
    # refused before torch's generator runs (minutes at this size)
    monkeypatch.setattr(torch_schedules, "ScheduleZBVZeroBubble", lambda *a: pytest.fail("torch's generator ran"))
    with pytest.raises(ConfigError, match="131072 forwards an iteration, more than torch's zbv order is built for"):
        build_schedule("zbv", 128, 512)


def test_without_torch_the_error_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_extras, "installed", lambda module: module != "torch")
    with pytest.raises(MissingExtra, match=r"freeride\[tasks\]"):
        build_schedule("zbv", 2, 4)
    assert build_schedule("zb-h1", 2, 4).bubble_fraction() > 0  # the planner's own schedules need no torch


def test_plan_prints_a_v_shaped_schedule(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--schedule", "zbv", "--stages", "2", "--microbatches", "4", "--t-forward", "1",
                 "--t-backward", "2", "--t-weight", "1"]) == EXIT_OK
    out = capsys.readouterr().out
    assert "schedule zbv: 2 stages x 4 micro-batches x 2 chunks" in out and "t_w=1 ms" in out
    # rank 0 warms up through its first stage, then takes micro-batch 0 back down its second (the V's turn)
    assert " stage 0 |F0.0 F1.0 F2.0 F0.1 I0.1 W0.1" in out


def test_plan_refuses_a_v_shaped_schedule_with_three_chunks(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--schedule", "dualpipev", "--stages", "2", "--microbatches", "4", "--virtual", "3"]) \
        == EXIT_BAD_INPUT
    assert "V-shaped: two model stages per rank, not 3" in capsys.readouterr().err


def test_a_sweep_covers_torchs_schedules_and_says_when_it_leaves_them_out(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["plan", "--stages", "2", "--sweep", "--microbatches", "4", "--json"]) == EXIT_OK
    doc = json.loads(capsys.readouterr().out)
    assert {c["schedule"] for c in doc["configs"]} >= set(TORCH_SCHEDULES)
    assert "left_out" not in doc

    monkeypatch.setattr("freeride._cli.plan.installed", lambda module: module != "torch")
    assert main(["plan", "--stages", "2", "--sweep", "--microbatches", "4"]) == EXIT_OK
    out = capsys.readouterr().out
    assert "zbv" not in out.split("left out:")[0]
    assert "left out: torch's schedules (interleaved-zb, looped-bfs, zbv, dualpipev)" in out
    # Installing torch through an extra would pull a CUDA build of several GB: torch's CPU build is named first.
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in out


# ------------------------------------------------------------------ an order of one's own (compute-only CSV)


@pytest.mark.parametrize("name", ["zbv", "dualpipev", "interleaved-zb"])
def test_a_csv_written_from_a_torch_order_plans_as_that_schedule_does(name: str, tmp_path: Path) -> None:
    built = build_schedule(name, 2, 4, 1.0, 2.0, t_weight=1.0)
    cls = getattr(torch_schedules, TORCH_SCHEDULES[name])
    path = tmp_path / "order.csv"
    write_csv(path, cls([StandInStage(s, 4, 2, 0) for s in placement(name, 2, 2)[0]], 4).pipeline_order)
    orders, virtual = csv_orders(path)
    assert virtual == 2 and {r: tuple(o) for r, o in orders.items()} == dict(built.orders)
    plan = plan_config(PlanInputs(stages=2, costs=Costs(1.0, 2.0, 1.0)), Candidate("csv", 4, virtual, orders))
    assert plan.schedule.makespan == built.makespan
    assert [s.idle_ms for s in plan.stages] == [sum(x.length for x in built.cyclic_slots(r)) for r in (0, 1)]


@pytest.mark.parametrize("text,message", [
    ("0F0,0B0\n1F0,1Q0\n", "'1Q0' is a Q action; a schedule's CSV holds F, B, I, W"),
    ("0F0,F0\n", "'F0' is no action"),
    ("0F0,0B0,0F0\n", "0F0 appears twice"),
    ("0F0,1F0,0B0\n1B0\n", "stage 1 is on rank 0 and rank 1"),
    ("0F0,0F1\n1F0,1B0,1F1,1B1\n", "stage 0 runs micro-batch 0 as F; each stage runs each micro-batch's F and "
                                   "either its B or its I and W"),
    ("0F0,0I0,0W0,0B0\n", "stage 0 runs micro-batch 0 as BFIW"),
    ("0F0,0B0,2F0,2B0\n1F0,1B0\n", "ranks hold different numbers of stages"),
    ("0F0,0B0\n2F0,2B0\n", r"the stages are \[0, 2\], not 0..1"),
    ("0F1,0B1\n", r"the micro-batches are \[1\], not 0..0"),
    ("\n\n", "needs one non-empty row per rank"),
])
def test_a_csv_that_is_no_complete_order_is_refused_naming_what_is_wrong(text: str, message: str,
                                                                          tmp_path: Path) -> None:
    path = tmp_path / "order.csv"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        csv_orders(path)


def test_plan_takes_an_order_from_a_csv_and_checks_it_against_the_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    path = tmp_path / "order.csv"
    path.write_text("0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n")
    base = ["plan", "--stages", "2", "--schedule-csv", str(path)]
    assert main(base) == EXIT_OK
    out = capsys.readouterr().out
    assert "schedule csv: 2 stages x 2 micro-batches" in out and "stage 0 |F0 F1" in out
    for extra, message in ((["--microbatches", "3"], f"--microbatches 3 does not match {path}, which has 2"),
                           (["--virtual", "2"], f"--virtual 2 does not match {path}, which has 1"),
                           (["--schedule", "zbv"], "--schedule-csv is the schedule; drop --schedule zbv"),
                           (["--sweep"], "--schedule-csv fixes the order: plan it without --sweep")):
        assert main([*base, *extra]) == EXIT_BAD_INPUT
        assert message in capsys.readouterr().err
    path.write_text("0F0,0B0\n1B0,1F0\n")
    assert main(base) == EXIT_BAD_INPUT
    assert "schedule deadlocks" in capsys.readouterr().err
    assert main(["plan", "--stages", "3", "--schedule-csv", str(path)]) == EXIT_BAD_INPUT
    assert "the order has 2 ranks; the pipeline has 3 stages" in capsys.readouterr().err


def test_a_weight_pass_before_its_own_input_pass_deadlocks(tmp_path: Path) -> None:
    path = tmp_path / "order.csv"
    path.write_text("0F0,0W0,0I0\n1F0,1I0,1W0\n")
    orders, virtual = csv_orders(path)
    with pytest.raises(ConfigError, match="schedule deadlocks: ranks wait on {0: '0W0'}"):
        plan_config(PlanInputs(stages=2), Candidate("csv", 1, virtual, orders))


def test_a_csv_dumped_with_torchs_transfers_plans_as_its_compute_alone(tmp_path: Path) -> None:
    with_transfers = tmp_path / "comms.csv"
    with_transfers.write_text("0UNSHARD,0F0,0SEND_F0,0RECV_B0,0B0,0RESHARD\n1RECV_F0,1F0,1B0,1SEND_B0,1REDUCE_GRAD\n")
    compute = tmp_path / "compute.csv"
    compute.write_text("0F0,0B0\n1F0,1B0\n")
    assert csv_orders(with_transfers) == csv_orders(compute)
    no_microbatch = tmp_path / "bad.csv"
    no_microbatch.write_text("0F,0B0\n")
    with pytest.raises(ConfigError, match="'0F' names no micro-batch"):
        csv_orders(no_microbatch)


def test_a_csv_larger_than_the_planner_simulates_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("freeride.training.torch_plans.MAX_CHUNK_MICROBATCHES", 2)
    path = tmp_path / "order.csv"
    path.write_text("0F0,0F1,0F2,0B0,0B1,0B2\n")
    with pytest.raises(ConfigError, match="3 forwards an iteration, more than the planner simulates"):
        csv_orders(path)
    path.write_text(",".join(f"0F{i}" for i in range(9)) + "\n")
    with pytest.raises(ConfigError, match="9 cells, more than the planner simulates"):
        csv_orders(path)


def test_plan_takes_its_stages_from_the_csv_and_asks_for_them_otherwise(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    path = tmp_path / "order.csv"
    path.write_text("0F0,0B0\n1F0,1B0\n2F0,2B0\n")
    assert main(["plan", "--schedule-csv", str(path)]) == EXIT_OK
    assert "schedule csv: 3 stages x 1 micro-batches" in capsys.readouterr().out
    assert main(["plan", "--microbatches", "4"]) == EXIT_BAD_INPUT
    assert "--stages is required (or --schedule-csv, whose rows are the stages)" in capsys.readouterr().err


def test_plan_refuses_one_chunk_for_a_looped_schedule_given_explicitly(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--schedule", "interleaved-zb", "--stages", "2", "--microbatches", "4", "--virtual", "1"]) \
        == EXIT_BAD_INPUT
    assert "interleaved-zb runs 2 or more model chunks per stage: --virtual 2 or more" in capsys.readouterr().err
    assert main(["plan", "--schedule", "interleaved-zb", "--stages", "2", "--microbatches", "4"]) == EXIT_OK
    assert "x 2 chunks" in capsys.readouterr().out


def test_the_grid_of_a_v_shaped_schedule_names_each_ranks_two_model_stages() -> None:
    grid = draw_grid(build_schedule("zbv", 2, 4)).splitlines()
    assert grid[-1].split("holds: ")[1] == "rank 0: 0 (.0), 3 (.1); rank 1: 1 (.0), 2 (.1)"
    assert "(F: a forward, I: a backward's input half, W: a backward's weight half)" in grid[-2]
