"""``freeride bench``'s arithmetic, trial plan and input handling, on plain numbers and fakes."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import math
import random
from pathlib import Path

import pytest

from freeride._cli import bench
from freeride._cli.bench_figures import (
    ALONE,
    MANAGERS,
    TASKS,
    DeviceFigures,
    Run,
    TaskFigures,
    complete_trials,
    fmt_interval,
    overhead_intervals,
    render,
    summarize,
    trial_plan,
    work_s,
)
from freeride.cli import build_parser
from freeride.errors import ConfigError
from freeride.measure import SAVING_TEXT, CostInputs, cost_saving, t_quantile


def _device(device: str, bubble_s: float, harvested_s: float, progress: float = 0.0, name: str = "pr",
            state: str = "PARKED") -> DeviceFigures:
    tasks = (TaskFigures(name, device, state, 10, progress, "iterations", harvested_s),) if progress else ()
    return DeviceFigures(device, 100, bubble_s, harvested_s, harvested_s, 1, 0.2, 0.5, 0.1, tasks)


def _trial(trial: int, alone: float, managers: float, tasks: float, progress: float = 0.0) -> list[Run]:
    dev = ("cpu:0", "cpu:1")
    return [Run(trial, ALONE, alone),
            Run(trial, MANAGERS, managers, tuple(_device(d, 2.0, 0.0) for d in dev)),
            Run(trial, TASKS, tasks, tuple(_device(d, 2.0, 1.5, progress) for d in dev))]


def test_a_trial_runs_every_mode_once_in_a_seeded_random_order() -> None:
    plans = [trial_plan(True, random.Random(7)) for _ in range(2)]
    assert plans[0] == plans[1]  # the seed fixes it
    assert sorted(plans[0]) == sorted([ALONE, MANAGERS, TASKS])
    orders = {tuple(trial_plan(True, rng)) for rng in [random.Random(0)] for _ in range(40)}
    assert len(orders) > 1  # a fresh order every trial, from one generator
    assert sorted(trial_plan(False, random.Random(0))) == [ALONE, MANAGERS]


def test_the_overhead_is_the_mean_of_per_trial_ratios_with_a_t_interval() -> None:
    runs = _trial(0, 100.0, 101.0, 102.0) + _trial(1, 110.0, 110.0, 111.1)
    ivs = overhead_intervals(runs, with_tasks=True)
    ratios = [102.0 / 100.0, 111.1 / 110.0]
    mean = sum(ratios) / 2
    assert ivs[TASKS].estimate == pytest.approx(mean - 1)
    half = t_quantile(0.95, 1) * abs(ratios[0] - ratios[1]) / math.sqrt(2) / math.sqrt(2)
    assert ivs[TASKS].half_width == pytest.approx(half)
    assert ivs[MANAGERS].estimate == pytest.approx((1.01 + 1.0) / 2 - 1)


def test_a_trial_cut_short_counts_for_nothing_and_warm_up_runs_never_count() -> None:
    runs = [Run(-1, ALONE, 50.0), *_trial(0, 100.0, 101.0, 102.0), Run(1, ALONE, 10.0), Run(1, TASKS, 99.0)]
    assert list(complete_trials(runs, with_tasks=True)) == [0]
    doc = summarize(runs, {0: {"pr": 10.0}, 1: {"pr": 10.0}}, devices=2, price_ratios=(1.0,))
    assert doc["trials"] == 1 and doc["alone_s"] == 100.0


def test_side_work_is_progress_over_the_same_trials_standalone_rate_summed_over_devices() -> None:
    run = _trial(0, 100.0, 100.0, 100.0, progress=30.0)[2]
    assert work_s(run, {"pr": 10.0}) == {"pr": 6.0}  # 30 / 10 on each of two devices
    with pytest.raises(ValueError, match="no standalone throughput"):
        work_s(run, {})


def test_the_summary_gives_harvest_efficiency_and_the_saving_of_measure_per_trial() -> None:
    runs = _trial(0, 100.0, 100.5, 101.0, progress=30.0) + _trial(1, 100.0, 100.0, 100.0, progress=40.0)
    rates = {0: {"pr": 10.0}, 1: {"pr": 10.0}}
    doc = summarize(runs, rates, devices=2, price_ratios=(1.0, 22.0))
    # H per trial: work (6 s, then 8 s) over bubble time (2 devices x 2 s).
    assert doc["harvest_efficiency"]["estimate"] == pytest.approx((6 / 4 + 8 / 4) / 2)
    assert doc["harvested_share"]["estimate"] == pytest.approx(0.75)
    assert doc["bubble_s"] == pytest.approx(4.0)
    expected = [cost_saving(CostInputs(6.0, 101.0, 100.0, 2), 22.0),
                cost_saving(CostInputs(8.0, 100.0, 100.0, 2), 22.0)]
    assert doc["saving"]["22x"]["estimate"] == pytest.approx(sum(expected) / 2)
    assert doc["tasks"] == [{"name": "pr", "progress_unit": "iterations", "progress": 70.0, "work_s": 7.0,
                             "standalone_per_s": 10.0}]


def test_a_device_without_bubbles_and_a_task_that_finished_are_named() -> None:
    runs = _trial(0, 100.0, 100.0, 100.0, progress=3.0)
    runs[1] = Run(0, MANAGERS, 100.0, (_device("cpu:0", 2.0, 0.0), DeviceFigures("cpu:1", 0, 0.0, 0, 0, 0, 0, 0, 0)))
    tasks = runs[2]
    runs[2] = Run(0, TASKS, 100.0, (tasks.devices[0], _device("cpu:1", 2.0, 0.1, 3.0, state="FINISHED")))
    doc = summarize(runs, {0: {"pr": 1.0}}, devices=2, price_ratios=(1.0,))
    assert doc["no_bubbles"] == ["cpu:1"]
    assert doc["finished"] == ["pr on cpu:1"]
    text = "\n".join(render(doc, {"command_text": "train", "devices": ["cpu:0", "cpu:1"], "stop": "x",
                                  "loadavg": "1"}))
    assert "no bubble was reported on cpu:1" in text and "finished during a run" in text
    assert "its size, not the bubbles, bounded the side work and the saving below" in text


def test_the_report_defines_the_saving_and_every_price_ratio_where_it_prints_them() -> None:
    runs = _trial(0, 100.0, 100.5, 101.0, progress=30.0) + _trial(1, 100.0, 100.0, 100.0, progress=40.0)
    doc = summarize(runs, {0: {"pr": 10.0}, 1: {"pr": 10.0}}, devices=2, price_ratios=(1.0, 5.5, 22.0))
    text = "\n".join(render(doc, {"command_text": "train", "devices": ["cpu:0"], "stop": "s", "loadavg": "1"}))
    assert SAVING_TEXT in text
    for ratio, words in (("1x", "a second device of the same kind"), ("5.5x", "$0.99/h a GPU"),
                         ("22x", "a quarter of the 5.5x figure")):
        line = next(line for line in text.splitlines() if line.strip().startswith(ratio))
        assert words in line


def test_an_unresolved_overhead_is_said_beside_the_saving_with_what_the_work_alone_is_worth() -> None:
    # Stranger trial: a run with side tasks 17 s faster by chance read "+26.6%" at every price ratio, of which
    # the side work was worth under 1%; and "2.91 s harvested, 29.6%" sat under a bubble time of both modes.
    runs = _trial(0, 50.0, 50.0, 33.0, progress=10.0) + _trial(1, 49.0, 51.0, 51.0, progress=10.0)
    doc = summarize(runs, {0: {"pr": 10.0}, 1: {"pr": 10.0}}, devices=2, price_ratios=(1.0, 22.0))
    # W = 2 s a trial (10 iterations at 10/s on each of two devices), over n T = 2 x 50 and 2 x 49 s.
    assert doc["work_value"]["1x"] == pytest.approx((2 / 100 + 2 / 98) / 2)
    assert doc["work_value"]["22x"] == pytest.approx(doc["work_value"]["1x"] / 22)
    assert doc["task_bubble_s"] == pytest.approx(4.0)
    text = "\n".join(render(doc, {"command_text": "train", "devices": ["cpu:0", "cpu:1"], "stop": "s",
                                  "loadavg": "1"}))
    line = next(line for line in text.splitlines() if line.strip().startswith("not resolved:"))
    assert "+2.02% / +0.09% of the training cost at 1x / 22x" in line
    assert "of the 4.00 s of bubbles a run with side tasks had: 75.0%" in text
    resolved = _trial(0, 100.0, 100.0, 101.0, progress=10.0) + _trial(1, 100.0, 100.0, 101.1, progress=10.0)
    doc = summarize(resolved, {0: {"pr": 10.0}, 1: {"pr": 10.0}}, devices=2, price_ratios=(1.0,))
    text = "\n".join(render(doc, {"command_text": "t", "devices": ["cpu:0"], "stop": "s", "loadavg": "1"}))
    assert "not resolved" not in text


def test_without_side_tasks_only_the_managers_overhead_is_reported() -> None:
    runs = [r for t in (0, 1) for r in _trial(t, 100.0, 100.2, 0.0) if r.mode != TASKS]
    doc = summarize(runs, {}, devices=2, price_ratios=(1.0,))
    assert doc["trials"] == 2 and set(doc["overhead"]) == {MANAGERS}
    text = "\n".join(render(doc, {"command_text": "t", "devices": ["cpu:0"], "stop": "s", "loadavg": "1"}))
    assert "no side task given" in text


def test_a_latency_no_run_measured_reads_as_a_dash_not_as_zero() -> None:
    # Stranger trial: "grant p99 0.00 ms" where every grant went to a frozen worker: no grant latency was
    # measured (a distribution with no sample reads p99 0).
    runs = _trial(0, 100.0, 100.0, 100.0, progress=3.0)
    runs[2] = Run(0, TASKS, 100.0, tuple(dataclasses.replace(d, grant_p99_ms=None) for d in runs[2].devices))
    doc = summarize(runs, {0: {"pr": 10.0}}, devices=2, price_ratios=(1.0,))
    assert doc["grant_p99_ms"] is None and doc["overrun_p99_ms"] == 0.2
    text = "\n".join(render(doc, {"command_text": "t", "devices": ["cpu:0"], "stop": "s", "loadavg": "1"}))
    assert "p99 0.20 ms; grant p99 -, park p99 0.10 ms" in text
    assert Run.from_json(runs[2].to_json()) == runs[2]


def test_runs_survive_a_json_round_trip() -> None:
    run = _trial(0, 100.0, 100.0, 100.0, progress=3.0)[2]
    assert Run.from_json(run.to_json()) == run


def test_an_interval_of_one_trial_reads_as_one() -> None:
    assert fmt_interval({"estimate": 0.012, "low": None, "high": None}) == "+1.2% (one trial)"
    assert fmt_interval({"estimate": 0.8, "low": 0.75, "high": 0.85}, pct=False) == "0.80 (0.75 .. 0.85)"
    assert fmt_interval(None) == "-"


def test_a_share_reads_without_a_sign_and_its_interval_stays_within_0_and_100_percent() -> None:
    # Stranger trial: "+35.0% of the bubble time (-160.0 .. +270.0)".
    assert fmt_interval({"estimate": 0.35, "low": -1.6, "high": 2.7}, share=True) == "35.0% (0.0 .. 100.0)"
    assert fmt_interval({"estimate": 0.35, "low": 0.3, "high": 0.4}, share=True) == "35.0% (30.0 .. 40.0)"


def test_the_report_says_when_the_side_work_is_more_than_the_time_stepped_in_bubbles() -> None:
    # Stranger trial: H 0.89 against a harvested share of 0.55, printed without a word: the yardstick read low.
    meta = {"command_text": "train", "devices": ["cpu:0"], "stop": "s", "loadavg": "1"}
    runs = _trial(0, 100.0, 100.5, 101.0, progress=30.0) + _trial(1, 100.0, 100.0, 100.0, progress=40.0)
    over = summarize(runs, {0: {"pr": 10.0}, 1: {"pr": 10.0}}, devices=2, price_ratios=(1.0,))  # H 1.75, share 0.75
    assert "note: H (175.0%) is more than the share of the bubble time the tasks stepped in (75.0%)" in \
        "\n".join(render(over, meta))
    within = summarize(runs, {0: {"pr": 100.0}, 1: {"pr": 100.0}}, devices=2, price_ratios=(1.0,))  # H 0.175
    assert "note: H is more" not in "\n".join(render(within, meta))


def test_the_report_says_when_a_task_made_no_progress_in_any_run() -> None:
    # Stranger trial: a task whose setup() outlasted every run's bubbles showed "0 steps a run" and no word of why.
    meta = {"command_text": "train", "devices": ["cpu:0"], "stop": "s", "loadavg": "1"}
    frozen_in_setup = tuple(DeviceFigures(d, 100, 2.0, 1.5, 0.0, 1, 0.2, 0.5, 0.1,
                                          (TaskFigures("pr", d, "FROZEN", 0, 0.0, "steps", 0.0),))
                            for d in ("cpu:0", "cpu:1"))
    runs = [r if r.mode != TASKS else Run(r.trial, TASKS, r.wall_s, frozen_in_setup)
            for t in (0, 1) for r in _trial(t, 100.0, 100.0, 100.5)]
    stalled = summarize(runs, {0: {"pr": 10.0}, 1: {"pr": 10.0}}, devices=2, price_ratios=(1.0,))
    assert "note: pr made no progress in any run: a setup() longer than the bubbles" in "\n".join(render(stalled, meta))
    going = summarize(_trial(0, 100.0, 100.0, 100.5, progress=3.0), {0: {"pr": 10.0}}, devices=2, price_ratios=(1.0,))
    assert "made no progress" not in "\n".join(render(going, meta))


# ------------------------------------------------------------------ input


def _args(*words: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench", *words])


def test_task_options_bind_to_the_task_before_them_and_the_command_keeps_its_own() -> None:
    args = _args("--task", "a:B", "--arg", "x=1", "--memory", "1GiB", "--task", "c:D", "--name", "n", "--",
                 "python", "train.py", "--arg", "5", "--task", "z")
    assert args.task_words == [["a:B", "--arg=x=1", "--memory=1GiB"], ["c:D", "--name=n"]]
    assert args.command == ["--", "python", "train.py", "--arg", "5", "--task", "z"]


def test_a_task_option_before_any_task_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        _args("--arg", "x=1", "--", "true")
    assert exc.value.code == 2
    assert "belongs to a side task" in capsys.readouterr().err


def test_tasks_are_checked_as_submit_checks_them_and_get_unique_names(monkeypatch: pytest.MonkeyPatch,
                                                                       tmp_path: Path) -> None:
    (tmp_path / "mytasks.py").write_text(
        "from freeride import SideTask\n"
        "class Sum(SideTask):\n"
        "    def __init__(self, n: int = 1) -> None:\n"
        "        self.n = n\n"
        "    def setup(self, ctx): pass\n"
        "    def step(self): pass\n")
    monkeypatch.chdir(tmp_path)
    tasks = bench.parse_tasks([["mytasks:Sum", "--arg=n=3", "--memory=64MiB"], ["mytasks:Sum", "--memory=64MiB"],
                               ["mytasks:Sum", "--memory=64MiB", "--name=mine"]])
    assert [t.name for t in tasks] == ["sum", "sum-2", "mine"]
    assert tasks[0].spec.args == {"n": 3} and tasks[0].spec.memory_bytes == 64 * 2**20
    assert all(t.spec.name == t.name for t in tasks)
    with pytest.raises(ConfigError, match=r"side task mytasks:Sum: .*unknown argument 'm'"):
        bench.parse_tasks([["mytasks:Sum", "--arg=m=3", "--memory=64MiB"]])
    with pytest.raises(ConfigError, match="side task mytasks:Nope"):
        bench.parse_tasks([["mytasks:Nope", "--memory=64MiB"]])
    with pytest.raises(ConfigError, match="side task mytasks:Sum"):
        bench.parse_tasks([["mytasks:Sum", "--memory=lots"]])


def test_a_tasks_file_holds_one_task_a_line_and_refuses_options_that_are_not_a_tasks(tmp_path: Path) -> None:
    path = tmp_path / "tasks.txt"
    path.write_text("# graph work\nside_tasks.graphs:PageRank --arg graph=rmat:10 --memory 640MiB  # small\n\n"
                    "side_tasks.images:ImageWatermark --memory=768MiB\n")
    args = _args("--tasks-file", str(path), "--", "true")
    assert bench.task_word_lists(args) == [["side_tasks.graphs:PageRank", "--arg", "graph=rmat:10", "--memory",
                                            "640MiB"], ["side_tasks.images:ImageWatermark", "--memory=768MiB"]]
    path.write_text("side_tasks.graphs:PageRank --device cuda:1\n")
    with pytest.raises(ConfigError, match=r"tasks.txt:1: --device is not a task option here"):
        bench.task_word_lists(args)
    with pytest.raises(ConfigError, match="cannot read --tasks-file"):
        bench.task_word_lists(_args("--tasks-file", str(tmp_path / "missing"), "--", "true"))


@pytest.mark.parametrize(("words", "message"), [
    (("--min-trials", "1"), "--min-trials"),
    (("--max-trials", "2", "--min-trials", "3"), "--max-trials"),
    (("--target-pp", "0"), "--target-pp"),
    # Stranger trial: "--target-pp must be > 0, got -0.01" for -1 (the rule's fraction, not the option's value).
    (("--target-pp", "-1"), "--target-pp must be a positive number, got -1$"),
    (("--budget-min", "-1"), "--budget-min must be a positive number, got -1$"),
    (("--standalone-s", "0"), "--standalone-s"),
    (("--warmup-runs", "-1"), "--warmup-runs"),
    (("--run-timeout-s", "0"), "--run-timeout-s"),
])
def test_bad_trial_settings_are_refused_with_the_options_name(words: tuple[str, ...], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        bench._check_numbers(_args(*words, "--", "true"))


def test_price_ratios_parse_and_bad_ones_are_refused() -> None:
    assert bench.parse_ratios("1, 5.5,22") == (1.0, 5.5, 22.0)
    for text in ("", "x", "0", "-2", "inf"):
        with pytest.raises(ConfigError, match="--price-ratios"):
            bench.parse_ratios(text)


def test_a_runs_time_limit_is_three_times_the_longest_run_so_far_plus_a_minute() -> None:
    assert bench.run_timeout(None, []) == bench.FIRST_RUN_TIMEOUT_S
    assert bench.run_timeout(None, [Run(0, ALONE, 10.0), Run(0, MANAGERS, 20.0)]) == 120.0
    assert bench.run_timeout(5.0, [Run(0, ALONE, 10.0)]) == 5.0


def test_without_scipy_the_bench_says_which_extra_to_install_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "scipy" else real(name))
    with pytest.raises(ConfigError) as exc:
        bench.require_extra()
    assert "pip install 'freeride[bench]'" in str(exc.value) and "\n" not in str(exc.value)


def test_a_missing_command_is_bad_input() -> None:
    with pytest.raises(ConfigError, match="no command given"):
        bench.run(_args("--task", "a:B"))


def test_a_failed_torchrun_jobs_tail_shows_the_jobs_last_words_above_torchruns_summary(tmp_path: Path) -> None:
    # Stranger trial: a trainer that said "unknown schedule bogus" and exited 1 under torchrun; the bench showed the
    # last 20 lines, all of them torchrun's summary of the failure.
    from freeride._cli.bench_runs import log_tail

    stamp = "W1130 11:32:23.008000 776 torch/distributed/run.py:874]"
    summary = ["E1130 11:32:26.158000 776 torch/distributed/elastic/multiprocessing/api.py:1002] failed "
               "(exitcode: 1) local_rank: 0 (pid: 781) of binary: python", "Traceback (most recent call last):",
               *[f"  summary line {i}" for i in range(36)], "=" * 60]
    log = tmp_path / "command.log"
    log.write_text("\n".join([f"{stamp} ***", f"{stamp} Setting OMP_NUM_THREADS", "unknown schedule bogus",
                              "unknown schedule bogus", *summary]) + "\n")
    shown = log_tail(log).splitlines()
    assert shown[:3] == ["    unknown schedule bogus", "    unknown schedule bogus", "    ..."]
    assert shown[3:] == ["    " + line for line in summary[-20:]] and "OMP_NUM_THREADS" not in log_tail(log)
    log.write_text("\n".join(["loss 1.0", *summary[:5]]) + "\n")  # short: all of it, once
    assert log_tail(log).splitlines() == ["    loss 1.0", *("    " + line for line in summary[:5])]
    log.write_text("\n".join(f"line {i}" for i in range(40)) + "\n")  # no torchrun: the tail alone
    assert log_tail(log).splitlines() == [f"    line {i}" for i in range(20, 40)]
    assert log_tail(tmp_path / "missing.log") == ""
