"""Single-device mode: one real stage, neighbours emulated from the bubble model.

The wait plan and the emulated peers are pure and checked against ``simulate`` with fixed numbers.
Real runs (a tiny GPT chunk on cpu:0) check behaviour only: which slots are reported, how often,
with which predictions, and the log's shape; timings are never asserted beyond "a real fraction".
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import cpu_devices, wait_for

from freeride.errors import ConfigError
from freeride.training.schedules import BACKWARD, FORWARD, Action, build_schedule
from freeride.workload.single_stage import (
    ActionCosts,
    EmulatedPeers,
    SingleStageConfig,
    jittered,
    main,
    parse_args,
    plan_waits,
    run,
    single_stage_command,
    sleep_until,
)

DEVICE = cpu_devices(1)[0]  # a core this process may run on: tests never name core numbers
UNUSABLE = f"cpu:{max(os.sched_getaffinity(0)) + 1}"  # past every core this process may use

TINY = ["--layers", "4", "--d-model", "32", "--heads", "2", "--seq-len", "16", "--vocab", "64",
        "--microbatch-size", "2"]
RUN_KEYS = {"iteration", "rank", "stage", "device", "warmup", "time_ms", "end_ns", "bubbles"}
BUBBLE_KEYS = {"slot", "kind", "start_ns", "length_ms", "predicted_ms", "free_memory_bytes", "core_wait_ms"}


def tiny_config(**kw: Any) -> SingleStageConfig:
    base: dict[str, Any] = dict(device=DEVICE, stages=4, stage_index=1, microbatches=4, iterations=6, warmup=2,
                                layers=4, d_model=32, heads=2, seq_len=16, vocab=64, microbatch_size=2)
    base.update(kw)
    return SingleStageConfig(**base)


class RecordingSink:
    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []

    def bubble_start(self, iteration: int, slot: int, kind: str, predicted_ns: int,
                     free_memory_bytes: int = -1, start_ns: int | None = None) -> None:
        self.events.append(("start", iteration, slot, kind, predicted_ns, free_memory_bytes, start_ns))

    def bubble_end(self, iteration: int, slot: int, end_ns: int | None = None) -> None:
        self.events.append(("end", iteration, slot, end_ns))


# ------------------------------------------------------------------ the plan (pure)


def test_stage_1_of_4_in_1f1b_waits_where_simulate_puts_its_idle_slots() -> None:
    plan = plan_waits("1f1b", 4, 4, 1, own=ActionCosts(1, 2), peers=ActionCosts(1, 2))
    # Stage 1 runs F0 F1 F2 B0 F3 B1 B2 B3: it waits 3 across the iteration boundary (tail 2 +
    # warm-up 1), 4 for the first gradient, then 1 before B2 and before B3.
    got = [(str(w.action), w.length, w.slot.kind if w.slot else None, w.slot.index if w.slot else None)
           for w in plan.waits]
    assert got == [("1F0", 3.0, "boundary", 0), ("1B0", 4.0, "turnaround", 3),
                   ("1B2", 1.0, "drain", 6), ("1B3", 1.0, "drain", 7)]
    model = build_schedule("1f1b", 4, 4, 1, 2)
    assert [(s.before, s.length) for s in model.cyclic_slots(1)] == [(w.action, w.length) for w in plan.waits]
    assert plan.period == model.makespan == 21.0
    assert plan.bubble_fraction == pytest.approx(3 / 7)


@pytest.mark.parametrize("schedule,p,m", [("1f1b", 4, 8), ("1f1b", 3, 7), ("gpipe", 4, 4), ("gpipe", 2, 5)])
@pytest.mark.parametrize("t_f,t_b", [(1.0, 2.0), (3.0, 4.0)])
def test_equal_costs_give_exactly_the_models_cyclic_slots_on_every_stage(
    schedule: str, p: int, m: int, t_f: float, t_b: float
) -> None:
    model = build_schedule(schedule, p, m, t_f, t_b)
    for rank in range(p):
        plan = plan_waits(schedule, p, m, rank, ActionCosts(t_f, t_b), ActionCosts(t_f, t_b))
        want = [(s.index, s.kind, s.before, pytest.approx(s.length)) for s in model.cyclic_slots(rank)]
        got = [(w.slot.index, w.slot.kind, w.action, w.length) for w in plan.waits if w.slot is not None]
        assert got == want, f"rank {rank}"
        assert all(w.slot is not None for w in plan.waits), "no wait outside the model's slots"
        assert plan.period == pytest.approx(model.makespan)


def test_slower_peers_open_waits_the_reference_layout_does_not_name() -> None:
    # GPipe, 2 stages, the last one real (F 1, B 2) with peers twice as slow: the first stage's
    # forward i ends at 2 (i + 1), so each of our forwards after the first waits 1; the boundary
    # is the first stage's four backwards (4 each, after ours) minus our last three: 12.
    plan = plan_waits("gpipe", 2, 4, 1, own=ActionCosts(1, 2), peers=ActionCosts(2, 4))
    got = [(str(w.action), w.length, w.slot.kind if w.slot else None) for w in plan.waits]
    assert got == [("1F0", 12.0, "boundary"), ("1F1", 1.0, None), ("1F2", 1.0, None), ("1F3", 1.0, None)]
    assert plan.period == 27.0 and plan.busy == 12.0


def test_overhead_between_iterations_lengthens_the_period_not_the_waits() -> None:
    bare = plan_waits("1f1b", 4, 4, 2, ActionCosts(1, 2), ActionCosts(1, 2))
    busy = plan_waits("1f1b", 4, 4, 2, ActionCosts(1, 2), ActionCosts(1, 2), overhead=5.0)
    assert [w.length for w in busy.waits] == [w.length for w in bare.waits]
    assert busy.period == bare.period + 5.0


# ------------------------------------------------------------------ the emulated peers (pure)


def _two_stage_peers(own_ends: dict[tuple[int, Action], float]) -> EmulatedPeers:
    orders = build_schedule("gpipe", 2, 1).orders
    return EmulatedPeers(orders, 2, 0, own_end=lambda it, a: own_ends.get((it, a)),
                         peer_cost=lambda it, q, a: 1.0 if a.kind == FORWARD else 2.0,
                         overhead=lambda it: 0.0, start=0.0)


def test_the_gradient_comes_back_later_when_the_real_forward_ends_later() -> None:
    b0 = Action(BACKWARD, 0, 0)
    on_time = _two_stage_peers({(0, Action(FORWARD, 0, 0)): 5.0})
    late = _two_stage_peers({(0, Action(FORWARD, 0, 0)): 10.0})
    # The next stage's F0 (1) and B0 (2) follow the real F0's end.
    assert on_time.release_time(0, b0) == 8.0
    assert late.release_time(0, b0) == 13.0
    assert on_time.release_time(0, Action(FORWARD, 0, 0)) is None  # the first stage's input is local


def test_a_peer_needing_a_real_action_that_has_not_run_is_an_error_not_a_guess() -> None:
    peers = _two_stage_peers({})
    with pytest.raises(RuntimeError, match="has not run"):
        peers.release_time(0, Action(BACKWARD, 0, 0))


def test_forgotten_iterations_are_refused() -> None:
    order = build_schedule("gpipe", 2, 1).orders[0]
    ends = {(it, a): float(10 * it + i) for it in range(3) for i, a in enumerate(order)}
    peers = _two_stage_peers(ends)
    peers.forget_before(2)
    with pytest.raises(RuntimeError, match="forgotten"):
        peers.release_time(1, Action(BACKWARD, 0, 0))


def test_jitter_is_seeded_bounded_and_independent_of_evaluation_order() -> None:
    a = Action(FORWARD, 2, 3)
    draws = [jittered(10.0, 20.0, seed=7, iteration=it, rank=2, action=a) for it in range(200)]
    assert draws == [jittered(10.0, 20.0, seed=7, iteration=it, rank=2, action=a) for it in range(200)]
    assert all(8.0 <= d <= 12.0 for d in draws) and len(set(draws)) > 100
    assert draws != [jittered(10.0, 20.0, seed=8, iteration=it, rank=2, action=a) for it in range(200)]
    assert jittered(10.0, 0.0, seed=7, iteration=0, rank=2, action=a) == 10.0


def test_sleep_until_returns_at_or_after_the_target() -> None:
    for spin_ns in (0, 200_000):
        target = time.monotonic_ns() + 2_000_000
        sleep_until(target, spin_ns)
        assert time.monotonic_ns() >= target
    sleep_until(time.monotonic_ns() - 1, 0)  # a target in the past returns at once


# ------------------------------------------------------------------ options


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--stages", "4", "--stage-index", "4"], "--stage-index 4 is out of range"),
        (["--stages", "4", "--stage-index", "-1"], "out of range"),
        (["--schedule", "1f1b", "--stages", "4", "--microbatches", "3"],
         "1f1b needs --microbatches (3) >= --stages (4)"),
        (["--device", "gpu0"], "unknown device 'gpu0'"),
        (["--device", UNUSABLE], f"unknown device {UNUSABLE}"),
        (["--stages", "1"], "--stages must be >= 2"),
        (["--stages", "8", "--microbatches", "8", "--layers", "4"], "--layers (4) must be >= --stages (8)"),
        (["--jitter-pct", "100"], "--jitter-pct"),
        (["--peer-forward-ms", "0"], "--peer-forward-ms must be > 0"),
    ],
)
def test_bad_options_exit_2_with_a_clear_message(argv: list[str], message: str,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    assert main(argv) == 2
    assert message in caplog.text


def test_an_unknown_schedule_is_refused_by_the_parser() -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(["--schedule", "zb-h1"])
    assert exc.value.code == 2


@pytest.mark.parametrize(
    "entry", [["-m", "freeride.workload.single_stage"], ["-m", "freeride.workload", "--single-stage"]]
)
def test_both_command_lines_exit_2_on_a_bad_stage_index(entry: list[str]) -> None:
    proc = subprocess.run([sys.executable, *entry, "--stages", "2", "--stage-index", "2"],
                          capture_output=True, text=True, timeout=60, cwd=Path(__file__).parents[2])
    assert proc.returncode == 2, proc.stderr
    assert "--stage-index 2 is out of range" in proc.stderr


def test_the_bench_command_parses_back_to_the_same_run() -> None:
    argv = single_stage_command("cpu:1", 2, 4, 8, 30, log=Path("/tmp/x.jsonl"), report=True,
                                endpoint="unix:/tmp/m.sock", extra=["--schedule", "gpipe", "--jitter-pct", "5"])
    assert argv[:3] == [sys.executable, "-m", "freeride.workload.single_stage"]
    cfg = parse_args(argv[3:])
    assert (cfg.device, cfg.stage_index, cfg.stages, cfg.microbatches, cfg.iterations) == ("cpu:1", 2, 4, 8, 30)
    assert (cfg.log, cfg.report, cfg.endpoint, cfg.schedule, cfg.jitter_pct) == (
        "/tmp/x.jsonl", True, "unix:/tmp/m.sock", "gpipe", 5.0)
    assert "--report" not in single_stage_command(DEVICE, 0, 2, 2, 1)


def test_validation_needs_no_device_for_a_bad_config() -> None:
    with pytest.raises(ConfigError, match="out of range"):
        tiny_config(stage_index=9).validate()


# ------------------------------------------------------------------ real runs on cpu:0


def _check_reports(cfg: SingleStageConfig, records: list[dict[str, Any]], sink: RecordingSink) -> None:
    layout = build_schedule(cfg.schedule, cfg.stages, cfg.microbatches).cyclic_slots(cfg.stage_index)
    want = [(s.index, s.kind) for s in layout]
    assert [r["iteration"] for r in records] == list(range(cfg.iterations))
    for record in records:
        it = record["iteration"]
        events = [e for e in sink.events if e[1] == it]
        # One start then its end, per modelled slot, in the layout's order.
        expected: list[tuple[str, int]] = []
        for index, _ in want:
            expected += [("start", index), ("end", index)]
        assert [(e[0], e[2]) for e in events] == expected, f"iteration {it}"
        starts = [e for e in events if e[0] == "start"]
        assert [(e[2], e[3]) for e in starts] == want
        # Predictions are the model's slot lengths for the costs this iteration's model used.
        m = record["model"]
        plan = plan_waits(cfg.schedule, cfg.stages, cfg.microbatches, cfg.stage_index,
                          ActionCosts(m["forward_ms"] * 1e6, m["backward_ms"] * 1e6),
                          ActionCosts(m["peer_forward_ms"] * 1e6, m["peer_backward_ms"] * 1e6))
        for e in starts:
            assert e[4] == pytest.approx(max(1, plan.slot_length(e[2])), rel=1e-6, abs=1000)
            assert e[5] > 0  # free memory of the device (host RAM on cpu:N)
        assert [b["slot"] for b in record["bubbles"]] == [i for i, _ in want]
        for b, start in zip(record["bubbles"], starts, strict=True):
            assert b["start_ns"] == start[6] and b["length_ms"] >= 0


def test_a_cpu_run_reports_every_modelled_slot_once_per_iteration(tmp_path: Path) -> None:
    cfg = tiny_config(log=str(tmp_path / "stage.jsonl"))
    sink = RecordingSink()
    affinity = os.sched_getaffinity(0)
    records, summary = run(cfg, sink=sink)
    assert os.sched_getaffinity(0) == affinity, "the run restores the caller's core affinity"
    _check_reports(cfg, records, sink)
    # Real idle time where the model has it, real compute elsewhere: a fraction, not 0 or 1.
    fraction = summary["bubble_fraction"]
    assert 0 < fraction["measured"] < 1
    assert 0 < fraction["model"] < 1
    assert summary["slots"] == [{"slot": s.index, "kind": s.kind}
                                for s in build_schedule("1f1b", 4, 4).cyclic_slots(1)]


def test_the_iteration_log_has_the_reference_trainers_shape(tmp_path: Path) -> None:
    log = tmp_path / "stage.jsonl"
    run(tiny_config(schedule="gpipe", stage_index=3, iterations=3, warmup=1, log=str(log)), sink=RecordingSink())
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    iterations, summary = lines[:-1], lines[-1]
    assert [r["iteration"] for r in iterations] == [0, 1, 2]
    for record in iterations:
        assert set(record) >= RUN_KEYS
        assert (record["rank"], record["stage"], record["device"]) == (3, 3, DEVICE)
        assert record["warmup"] == (record["iteration"] < 1)
        assert record["time_ms"] > 0 and record["end_ns"] > 0
        # On CPU the stage's own compute is known without a synchronize: less than the iteration.
        assert 0 < record["compute_ms"] < record["time_ms"]
        assert 0 <= record.get("runqueue_wait_ms", 0.0) <= record["time_ms"]
        assert record["loss"] is not None and record["loss"] > 0  # the last stage computes the loss
        assert record["bubbles"] and all(set(b) == BUBBLE_KEYS for b in record["bubbles"])
    assert summary["summary"] is True and summary["rank"] == 3
    assert {"slots", "unplanned_waits", "bubble_fraction", "prediction_error", "config"} <= set(summary)


def test_peers_given_slower_costs_lengthen_the_modelled_waits() -> None:
    cfg = tiny_config(iterations=3, warmup=1, peer_forward_ms=20.0, peer_backward_ms=40.0)
    sink = RecordingSink()
    records, summary = run(cfg, sink=sink)
    _check_reports(cfg, records, sink)
    assert records[-1]["model"]["peer_forward_ms"] == 20.0
    # The boundary and turnaround waits include several 20-40 ms peer actions: far above any
    # compute of this tiny chunk, so the fraction is well above zero even on a loaded machine.
    assert summary["bubble_fraction"]["measured"] > 0


@pytest.mark.slow
def test_a_real_manager_receives_every_slot_of_every_iteration(
    tmp_path: Path, make_manager: Callable[..., Any]
) -> None:
    harness = make_manager()
    iterations = 4
    log = tmp_path / "stage.jsonl"
    argv = single_stage_command(DEVICE, 2, 4, 4, iterations, log=log, report=True,
                                endpoint=str(harness.endpoint), extra=[*TINY, "--warmup", "1"])
    env = dict(os.environ, FREERIDE_LOG_LEVEL="WARNING", PYTHONPATH=str(Path(__file__).parents[2]))
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(log.read_text().splitlines()[-1])
    layout = build_schedule("1f1b", 4, 4).cyclic_slots(2)
    assert summary["reporter"]["enqueued"] == 2 * iterations * len(layout)
    assert summary["reporter"]["sent"] == summary["reporter"]["enqueued"]

    def all_counted() -> bool:
        stats = {s.slot: s for s in harness.client.bubbles() if s.stage == 2}
        return len(stats) == len(layout) and all(s.count == iterations for s in stats.values())

    wait_for(all_counted, timeout_s=10)
    stats = {s.slot: s for s in harness.client.bubbles() if s.stage == 2}
    assert {i: s.kind for i, s in stats.items()} == {s.index: s.kind for s in layout}


# ------------------------------------------------------------------ GPU


@pytest.mark.gpu
def test_a_cuda_run_reports_every_modelled_slot_once_per_iteration() -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    cfg = tiny_config(device="cuda:0", iterations=6, warmup=2, d_model=256, heads=4, seq_len=128,
                      microbatch_size=8)
    sink = RecordingSink()
    records, summary = run(cfg, sink=sink)
    _check_reports(cfg, records, sink)
    assert 0 < summary["bubble_fraction"]["measured"] < 1
