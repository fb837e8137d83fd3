"""``bench.bench_colocation``'s parts that need no timing: who gets a task, the overheads, the table, the options."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench.bench_colocation import _manager_cpu_s, _task_devices, main, overheads, write_markdown

DEVICES = ("cpu:0", "cpu:1")


def test_each_mode_gives_side_tasks_to_the_cores_it_names() -> None:
    assert _task_devices("none", DEVICES) == [] and _task_devices("managers", DEVICES) == []
    assert _task_devices("task-cpu:0", DEVICES) == ["cpu:0"] and _task_devices("task-cpu:1", DEVICES) == ["cpu:1"]
    assert _task_devices("tasks", DEVICES) == ["cpu:0", "cpu:1"]


def _run(mode: str, round_: int, iteration_ms: float, devices: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"schedule": "1f1b", "mode": mode, "round": round_, "iteration_ms_p50": iteration_ms,
            "devices": devices or {}, "loadavg_before": [1.0, 1.0, 1.0], "loadavg_after": [1.5, 1.0, 1.0]}


def _device(harvest: float | None, cpu_ms: float) -> dict[str, Any]:
    return {"harvest": harvest, "bubbles_per_iteration": 8.0, "manager_cpu_ms_per_iteration": cpu_ms}


def test_a_modes_overhead_is_against_the_none_run_of_its_own_round() -> None:
    runs = [_run("none", 0, 40.0), _run("tasks", 0, 44.0), _run("none", 1, 50.0), _run("tasks", 1, 50.0),
            _run("managers", 1, 55.0)]
    over = overheads(runs)
    assert over[("1f1b", "tasks")] == pytest.approx([0.10, 0.0])
    assert over[("1f1b", "managers")] == pytest.approx([0.10])
    assert ("1f1b", "none") not in over


def test_the_table_has_a_row_per_mode_with_each_rounds_figures_per_device(tmp_path: Path) -> None:
    both = {"cpu:0": _device(0.65, 6.1), "cpu:1": _device(None, 1.5)}
    doc = {"command": "python -m bench.bench_colocation", "machine": {"cpu": "a CPU", "cores": 2},
           "config": {"iterations": 150, "warmup": 20, "microbatches": 8, "slow_ms": 3.0, "side_task": "spin:200"},
           "runs": [_run("none", 0, 40.0), _run("task-cpu:0", 0, 44.0, both),
                    _run("none", 1, 50.0), _run("task-cpu:0", 1, 51.0, both)]}
    out = tmp_path / "colocation.md"
    write_markdown(doc, out)
    rows = {line.split(" | ")[1]: line for line in out.read_text().splitlines() if line.startswith("| 1f1b")}
    assert list(rows) == ["none", "task-cpu:0"]
    task = rows["task-cpu:0"]
    assert "| 44.0 / 51.0 |" in task and "| +10.0% / +2.0% |" in task
    assert "| 65% / -; 65% / - |" in task and "| 6.10 / 1.50; 6.10 / 1.50 |" in task
    assert rows["none"].count("| - ") >= 4


@pytest.mark.parametrize("argv", [["--modes", "tasks,managers"], ["--modes", "none,sometimes"],
                                  ["--schedules", "pipedream"], ["--rounds", "0"], ["--side-task", "spin:0"]])
def test_it_refuses_options_it_cannot_measure(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and "error:" in capsys.readouterr().err


def test_a_manager_it_cannot_find_used_no_cpu() -> None:
    assert _manager_cpu_s("/nonexistent/m.sock") == 0.0
