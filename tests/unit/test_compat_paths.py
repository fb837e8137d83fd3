"""The trainer side moved to ``freeride.training`` and the reference trainer to ``freeride.workload``:
the old import paths keep working, say where things went, and give the very same modules."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

OLD_TO_NEW = {
    "freeride.schedules": "freeride.training.schedules",
    "freeride.predictor": "freeride.training.predictor",
    "freeride.pipelining": "freeride.training.instrument",
    "freeride.reporter": "freeride.training.reporter",
    "freeride.memory": "freeride.training.memory",
    "freeride.planner": "freeride.training.planner",
    "freeride.trainer.run": "freeride.workload.run",
    "freeride.trainer.single_stage": "freeride.workload.single_stage",
    "freeride.trainer.model": "freeride.workload.model",
}


@pytest.mark.parametrize(("old", "new"), OLD_TO_NEW.items())
def test_an_old_import_path_warns_and_gives_the_new_module(old: str, new: str) -> None:
    code = (f"import warnings; warnings.simplefilter('error', DeprecationWarning)\n"
            f"try:\n    import {old}\nexcept DeprecationWarning as w:\n    print(w)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert f"freeride.{new.split('.')[1]}" in out.stdout  # the warning names where it went
    with pytest.warns(DeprecationWarning):
        sys.modules.pop(old, None)
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)


def test_python_m_freeride_trainer_still_runs_the_reference_workload() -> None:
    out = subprocess.run([sys.executable, "-m", "freeride.trainer", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "--microbatches" in out.stdout
    assert "now `python -m freeride.workload`" in out.stderr


def test_python_m_of_a_moved_module_runs_the_new_one_instead_of_doing_nothing() -> None:
    # Stranger trial: `python -m freeride.trainer.single_stage` exited 0 having done nothing.
    out = subprocess.run([sys.executable, "-m", "freeride.trainer.single_stage", "--help"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "usage: python -m freeride.workload.single_stage" in out.stdout
    assert "now `python -m freeride.workload.single_stage`" in out.stderr
