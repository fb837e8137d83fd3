"""The reference trainer's schedule CSV: every malformed file is one ConfigError line, never torch's traceback."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from freeride.errors import ConfigError
from freeride.training.torch_plans import StandInStage
from freeride.workload import pipelines

torch = pytest.importorskip("torch")


def _schedule(path: Path) -> Any:
    stages = [StandInStage(c, 4, 2, 0) for c in pipelines.local_chunks("csv", 0, 2, 2, str(path))]
    return pipelines.make_schedule("csv", stages, 4, lambda out, target: out, str(path))


def test_a_schedule_csv_cell_of_no_compute_action_is_one_config_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("0F0,0X3,2F0\n1F0,3F0,1B0\n")  # "0X3": a stage, then no action torch knows
    with pytest.raises(ConfigError, match=r"bad.csv: '0X3' is a X action; a schedule's CSV holds F, B, I, W"):
        _schedule(bad)


def test_a_cell_without_a_stage_or_a_missing_file_is_one_config_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("F0,0F1\n1F0,1F1\n")
    with pytest.raises(ConfigError, match=r"'F0' is no action"):
        _schedule(bad)
    with pytest.raises(ConfigError, match="cannot read the schedule CSV"):
        _schedule(tmp_path / "missing.csv")
