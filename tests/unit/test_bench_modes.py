"""The modes bench's bookkeeping on fixed inputs: layouts, trial plans, paired statistics, reports."""

from __future__ import annotations

import dataclasses
import random
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import cpu_devices

from bench.bench_modes import (
    SingleStageLayout,
    make_layout,
    parse_args,
    pin_threads,
    single_stage_cpu,
    single_stage_device,
    trial_plan,
    two_stage_cpu,
)
from bench.modes_presets import PRESETS, REFERENCE_SIZED
from bench.modes_report import (
    README_BEGIN,
    README_END,
    RunResult,
    gated_intervals,
    headline,
    interfered,
    plot,
    readme_block,
    readme_markers,
    saving_note,
    summarize,
    targets,
    update_readme,
    write_markdown,
)
from freeride.harvest import CATEGORIES
from freeride.measure import t_quantile


def test_the_single_stage_cpu_layout_gives_the_stage_the_last_core_and_the_host_the_others() -> None:
    layout = single_stage_cpu([5, 2, 9])
    assert layout.devices == ("cpu:9",)
    assert layout.host_cores == frozenset({2, 5})
    assert not layout.stress
    with pytest.raises(SystemExit, match="2 cores"):
        single_stage_cpu([3])


def test_the_two_stage_layout_is_the_stress_case_on_the_first_two_cores() -> None:
    layout = two_stage_cpu([4, 1, 7])
    assert layout.devices == ("cpu:1", "cpu:4")
    assert layout.stress and not layout.host_cores
    argv = layout.trainer_argv(10, 2, Path("/tmp/it.jsonl"), [], "unix:/x/{slug}.sock")
    assert "--report" in argv and "--nproc-per-node" in argv


def test_a_gpu_single_stage_layout_pins_nothing() -> None:
    layout = single_stage_device("cuda:0", (1, 4, 8), [0, 1])
    assert layout.name == "single-stage cuda" and layout.devices == ("cuda:0",)
    assert layout.host_cores == frozenset()


def test_calibration_fixes_the_emulated_neighbours_for_every_run() -> None:
    layout = single_stage_cpu([0, 1])
    records = {0: [{"iteration": 5, "model": {"forward_ms": 6.5, "backward_ms": 13.25}}]}
    calibrated = layout.calibrated(records)
    assert isinstance(calibrated, SingleStageLayout)
    argv = calibrated.trainer_argv(20, 4, Path("/tmp/it.jsonl"), ["--d-model", "256"], None)
    assert argv[argv.index("--peer-forward-ms") + 1] == "6.5000"
    assert argv[argv.index("--peer-backward-ms") + 1] == "13.2500"
    assert argv[argv.index("--device") + 1] == "cpu:1"
    assert "--report" not in argv
    assert layout.calibrated({0: []}) is layout


def test_pinned_threads_of_a_child_stay_on_the_given_cores() -> None:
    core = int(cpu_devices(1)[0].split(":")[1])
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        assert pin_threads(child.pid, frozenset({core})) >= 1
        import os

        assert os.sched_getaffinity(child.pid) == {core}
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(30)


def test_a_trial_runs_every_mode_once_and_naive_after_instrumented_when_it_needs_its_bubbles() -> None:
    modes = ["none", "instrumented", "naive", "freeride-paper", "freeride"]
    for seed in range(20):
        plan = trial_plan(modes, ["pagerank", "mix"], random.Random(seed), naive_needs_instrumented=True)
        assert sorted(plan) == sorted([("none", "-"), ("instrumented", "-")] +
                                      [(m, s) for s in ("pagerank", "mix") for m in modes[2:]])
        first_naive = min(i for i, (m, _) in enumerate(plan) if m == "naive")
        assert plan.index(("instrumented", "-")) < first_naive
    orders = {tuple(trial_plan(modes, ["pagerank"], random.Random(s), False)) for s in range(20)}
    assert len(orders) > 1  # a fresh order per trial


def breakdown(bubble_s: float, work_s: float) -> dict:
    seconds = dict.fromkeys(CATEGORIES, 0.0)
    seconds["work"] = work_s
    seconds["idle"] = bubble_s - work_s
    return {"bubbles": 10, "bubble_s": bubble_s, "work_s": work_s, "efficiency": work_s / bubble_s,
            "seconds": seconds, "work_past_end_s": 0.0, "overrun_s": 0.0, "overruns_ms": [0.0], "steps": {}}


def run(mode: str, trial: int, iteration_ms: float, task_set: str = "-", work_s: float = 0.0,
        bubble_s: float = 0.0, compute_ms: float | None = None) -> RunResult:
    return RunResult(mode, task_set, trial, iteration_ms, iterations=10, bubble_s=bubble_s, work_s=work_s,
                     compute_ms=compute_ms, runqueue_wait_ms=1.0,
                     harvest=breakdown(bubble_s, work_s) if mode.startswith("freeride") else {})


RUNS = [run("none", 0, 100.0, compute_ms=50.0), run("none", 1, 200.0, compute_ms=100.0),
        run("none", 2, 100.0, compute_ms=50.0),
        run("instrumented", 0, 100.0), run("instrumented", 1, 202.0), run("instrumented", 2, 99.0),
        run("freeride", 0, 101.0, "pagerank", work_s=0.8, bubble_s=1.0, compute_ms=51.0),
        run("freeride", 1, 206.0, "pagerank", work_s=0.9, bubble_s=1.0, compute_ms=102.0),
        run("freeride", 2, 99.0, "pagerank", work_s=0.7, bubble_s=1.0, compute_ms=50.0),
        run("freeride-paper", 0, 100.0, "pagerank", work_s=0.4, bubble_s=1.0),
        run("freeride-paper", 1, 200.0, "pagerank", work_s=0.45, bubble_s=1.0),
        run("freeride-paper", 2, 100.0, "pagerank", work_s=0.35, bubble_s=1.0)]


def test_overhead_is_the_mean_per_trial_ratio_with_a_t_interval() -> None:
    table = summarize(RUNS, ["pagerank"], devices=1)
    row = table["pagerank/freeride"]
    # Ratios 1.01, 1.03, 0.99: mean 1.01, s = 0.02, t(0.975, 2) = 4.303.
    assert row["overhead"]["estimate"] == pytest.approx(0.01)
    assert row["overhead"]["half_width"] == pytest.approx(t_quantile(0.95, 2) * 0.02 / 3 ** 0.5)
    assert row["compute_overhead"]["estimate"] == pytest.approx((0.02 + 0.02 + 0.0) / 3)
    assert row["harvest_efficiency"]["estimate"] == pytest.approx(0.8)
    assert row["runqueue_wait_share"] == pytest.approx((1 / 101 + 1 / 206 + 1 / 99) / 3)
    assert row["vs_paper"]["estimate"] == pytest.approx(2.0)  # 0.8 / 0.4, 0.9 / 0.45, 0.7 / 0.35
    assert table["pagerank/none"]["overhead"]["estimate"] == 0.0
    shares = row["breakdown"]["shares"]
    assert sum(shares.values()) == pytest.approx(1.0) and shares["work"] == pytest.approx(0.8)
    # Saving at 1x: (W - n dT) / (n T_base) per trial, then the mean (T = 10 iterations x iteration time).
    per_trial = [(0.8 - 0.01) / 1.0, (0.9 - 0.06) / 2.0, (0.7 + 0.01) / 1.0]
    assert row["saving"]["1x"] == pytest.approx(sum(per_trial) / 3)


def test_the_stopping_rule_watches_instrumented_and_freeride_per_task_set() -> None:
    intervals = gated_intervals(RUNS, ["pagerank"])
    assert set(intervals) == {"instrumented", "pagerank/freeride"}
    assert intervals["instrumented"].n == 3


def test_targets_say_when_an_interval_straddles_the_target() -> None:
    table = summarize(RUNS, ["pagerank"], devices=1)
    lines = targets(table)
    assert any("overhead" in line and "not resolved" in line for line in lines)  # -4% .. +6% holds 0.5%
    assert any("harvest / paper harvest" in line and ": met" in line for line in lines)
    assert any("H 0.80" in line for line in lines)


def meta() -> dict:
    return {"label": "validation run", "loadavg": {"min": 0.5, "median": 1.0, "max": 2.0}, "trials": 3,
            "layout": {"name": "single-stage cpu", "stress": False},
            "stop": {"reason": "not resolved: stopped at the trial limit (3)"}}


def test_the_readme_block_is_generated_from_the_results_and_replaced_in_place(tmp_path: Path) -> None:
    table = summarize(RUNS, ["pagerank"], devices=1)
    lines = headline(meta(), table)
    assert any(line.startswith("managers up and reporting") for line in lines)
    block = readme_block(meta(), table, "bench/results/cpu/modes.md")
    assert block.startswith(README_BEGIN) and block.endswith(README_END)
    assert "validation run" in block and "+1.00%" in block
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n## Results\n\n{README_BEGIN}\nold\n{README_END}\n- other result\n")
    assert update_readme(readme, block)
    text = readme.read_text()
    assert "old" not in text and "- other result" in text and text.count(README_BEGIN) == 1
    (tmp_path / "plain.md").write_text("no markers")
    assert not update_readme(tmp_path / "plain.md", block)


def test_runs_whose_stage_waited_for_its_core_are_flagged_not_dropped() -> None:
    quiet = run("none", 0, 100.0)  # 1 ms of 100 ms
    busy = RunResult("instrumented", "-", 0, 200.0, 10, runqueue_wait_ms=80.0)
    assert interfered([quiet, busy]) == ["trial 0 instrumented: 40% of 200 ms"]


def test_the_gpu_bench_sizes_its_side_tasks_by_the_gpu_plan() -> None:
    from bench.bench_modes import task_plan

    cpu, gpu = task_plan("cpu"), task_plan("cuda")
    assert set(gpu) == {"pagerank", "image", "training"}
    assert set(cpu) == {"pagerank", "image", "training", *REFERENCE_SIZED}  # the reference-sized ones: CPU only
    assert all(t.memory_bytes <= 768 * 2**20 for t in cpu.values())
    assert all(t.memory_bytes >= 2 * 2**30 for t in gpu.values())  # a CUDA context and the data
    assert gpu["pagerank"].args != cpu["pagerank"].args


def test_the_comparison_with_the_reference_policy_shows_both_harvests_and_where_its_time_went() -> None:
    table = summarize(RUNS, ["pagerank"], devices=1)
    lines = headline(meta(), table)
    line = next(line for line in lines if line.startswith("harvest efficiency H, freeride vs the reference"))
    assert "pagerank 0.80 vs 0.40 (2.0x" in line
    went = next(line for line in lines if line.startswith("where the reference policy's bubble time went"))
    assert "pagerank: work 40%; no grant 60%" in went
    assert not any("harvested under 5%" in line for line in lines)  # 0.40 is no small denominator


def test_a_ratio_over_a_tiny_reference_harvest_is_explained_not_printed_bare() -> None:
    tiny = [r if r.mode != "freeride-paper" else run("freeride-paper", r.trial, r.iteration_ms, "pagerank",
                                                     work_s=0.002, bubble_s=1.0) for r in RUNS]
    lines = headline(meta(), summarize(tiny, ["pagerank"], devices=1))
    assert any("pagerank 0.80 vs 0.00 (" in line for line in lines)
    note = next(line for line in lines if "harvested under 5% of the bubble time (pagerank)" in line)
    assert "not how the two policies compare at the reference's own bubble scale" in note


def test_the_bubble_scale_of_the_runs_heads_the_headline() -> None:
    runs = [dataclasses.replace(r, bubble_ms={"count": 16, "min": 550.0 + r.trial, "p50": 566.0, "max": 806.0})
            for r in RUNS]
    lines = headline(meta(), summarize(runs, ["pagerank"], devices=1))
    assert lines[0] == "bubbles of the real stage: median 566 ms, 550 .. 806 ms, 16 a run after the warm-up"


def full_meta() -> dict:
    return {**meta(), "machine": {"cpu": "x", "cores": 2, "python": "3", "versions": {}}, "trainer": "t",
            "trainer_args": "", "iterations": 10, "warmup": 2, "wall_s": 60.0, "command": "c", "devices": ["cpu:1"],
            "layout": {"name": "single-stage cpu", "description": "d"},
            "stop": {"reason": "r", "target_half_width": 0.01, "min_trials": 3, "max_trials": 3, "budget_s": 60},
            "tasks": {"pagerank": {"target": "side_tasks.graphs:PageRank", "args": {}, "memory_bytes": 2**29}},
            "standalone_step_ms": [{"pagerank": 1.5}, {"pagerank": 1.7}]}


def test_the_markdown_defines_the_saving_column_under_its_table(tmp_path: Path) -> None:
    table = summarize(RUNS, ["pagerank"], devices=1)
    doc = full_meta()
    write_markdown(tmp_path / "m.md", doc, table)
    text = (tmp_path / "m.md").read_text()
    table_at = text.index("saving 1x / 5.5x / 22x |")
    assert text.index(saving_note(), table_at) > table_at
    assert "**22x**: the reference's own ratio" in saving_note() and "**1x**" in saving_note()
    assert "median step alone: 1.5 .. 1.7 ms" in text


def test_every_results_stem_has_its_own_readme_block(tmp_path: Path) -> None:
    assert readme_markers("modes") == (README_BEGIN, README_END)
    begin, end = readme_markers("modes_reference")
    readme = tmp_path / "README.md"
    readme.write_text(f"{begin}\nold ref\n{end}\n{README_BEGIN}\nold short\n{README_END}\n")
    table = summarize(RUNS, ["pagerank"], devices=1)
    assert update_readme(readme, readme_block(meta(), table, "x/modes_reference.md", "modes_reference"),
                         "modes_reference")
    text = readme.read_text()
    assert "old ref" not in text and "old short" in text and "[modes_reference.md](x/modes_reference.md)" in text


def test_presets_set_the_defaults_and_explicit_options_win() -> None:
    _, full = parse_args([])
    assert (full.stem, full.task_sets, full.peer_forward_ms) == ("modes", "pagerank,image,training,mix", None)
    _, short = parse_args(["--preset", "short"])
    assert (short.stem, short.task_sets, short.max_trials) == ("modes_short", "pagerank,mix", 3)
    _, ref = parse_args(["--preset", "reference-scale", "--max-trials", "5"])
    assert (ref.peer_forward_ms, ref.peer_backward_ms, ref.stage, ref.max_trials) == (200.0, 400.0, "1/4/4", 5)
    assert ref.task_sets.split(",") == list(REFERENCE_SIZED) and "naive" not in ref.modes
    assert set(PRESETS) == {"full", "short", "reference-scale"}


def test_given_peer_costs_survive_the_calibration(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    p, args = parse_args(["--preset", "reference-scale"])
    layout = make_layout(args, p)
    assert isinstance(layout, SingleStageLayout) and layout.microbatches == 4
    records = {0: [{"model": {"forward_ms": 6.0, "backward_ms": 12.0}}]}
    assert layout.calibrated(records) == layout  # 200/400 ms stay: the bubbles are the reference's scale
    p, args = parse_args([])
    assert make_layout(args, p).calibrated(records).peer_forward_ms == 6.0


def test_the_figure_is_written_for_any_set_of_modes(tmp_path: Path) -> None:
    no_naive = [r for r in RUNS if r.mode != "instrumented"]
    assert plot(tmp_path / "f.png", summarize(no_naive, ["pagerank"], devices=1)) == ["f.png"]
    assert (tmp_path / "f.png").stat().st_size > 0


def test_older_results_count_the_savings_time_over_the_measured_iterations_once(tmp_path: Path) -> None:
    """Runs written before they recorded their measured iterations hold the total, warm-up included: the
    saving's T then covered iterations whose work H never counted (the saving read too low)."""
    from bench.bench_modes import render

    doc = {"meta": full_meta(), "runs": [dataclasses.asdict(r) for r in RUNS]}  # iterations 10, warm-up 2
    _, table = render(tmp_path, doc, None)
    assert {r["iterations"] for r in doc["runs"]} == {8} and doc["meta"]["run_iterations"] == "measured"
    per_trial = [(0.8 - 0.008) / 0.8, (0.9 - 0.048) / 1.6, (0.7 + 0.008) / 0.8]  # T = 8 x iteration time
    assert table["pagerank/freeride"]["saving"]["1x"] == pytest.approx(sum(per_trial) / 3)
    _, again = render(tmp_path, doc, None)  # a second render changes nothing
    assert again["pagerank/freeride"]["saving"] == table["pagerank/freeride"]["saving"]
    assert (tmp_path / "modes.md").exists() and (tmp_path / "modes.png").exists()


def test_a_presets_render_keeps_its_own_readme_markers(tmp_path: Path) -> None:
    """A preset's results rewrote its README block with the default block's markers: the next default run
    would then have found two blocks of its own, and the preset's run none."""
    from bench.bench_modes import render

    begin, end = readme_markers("modes_reference")
    readme = tmp_path / "README.md"
    readme.write_text(f"{begin}\nold ref\n{end}\n{README_BEGIN}\nold full\n{README_END}\n")
    doc = {"meta": full_meta(), "runs": [dataclasses.asdict(r) for r in RUNS]}
    render(tmp_path, doc, readme, "modes_reference")
    render(tmp_path, doc, readme, "modes_reference")  # the second finds its block again
    text = readme.read_text()
    assert text.count(begin) == 1 and text.count(end) == 1 and text.count(README_BEGIN) == 1
    assert "old ref" not in text and "old full" in text
