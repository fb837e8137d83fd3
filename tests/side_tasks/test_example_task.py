"""The guide's example task (examples/monte_carlo_pi.py) behaves as the guide says, tested as the guide
tells authors to test theirs: with ``freeride.testing``."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from freeride.errors import ConfigError
from freeride.testing import check_resume, run_steps, task_context

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from monte_carlo_pi import MonteCarloPi  # noqa: E402


def test_monte_carlo_pi_estimates_pi(tmp_path: Path) -> None:
    task = MonteCarloPi(total_samples=200_000, batch=50_000)
    run = run_steps(task, 100, work_dir=tmp_path, memory_limit_bytes=64 << 20)
    assert (run.steps, run.done, task.progress()) == (4, True, 200_000)
    assert task.estimate() == pytest.approx(math.pi, abs=0.02)


def test_monte_carlo_pi_resumes_to_the_same_estimate(tmp_path: Path) -> None:
    resumed = check_resume(lambda: MonteCarloPi(total_samples=10_000, batch=1_000, seed=3), stop_after=4,
                           work_dir=tmp_path)
    assert isinstance(resumed, MonteCarloPi) and resumed.samples == 10_000


def test_monte_carlo_pi_refuses_a_batch_over_its_limit(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="lower batch"):
        MonteCarloPi(batch=10_000_000).setup(task_context(tmp_path, memory_limit_bytes=1 << 20))
