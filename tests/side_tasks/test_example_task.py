"""The guide's example task (examples/monte_carlo_pi.py) behaves as the guide says."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
from side_task_helpers import make_ctx, run_interrupted, run_to_end

from freeride.errors import ConfigError

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from monte_carlo_pi import MonteCarloPi  # noqa: E402


def test_monte_carlo_pi_estimates_pi(tmp_path: Path) -> None:
    task = MonteCarloPi(total_samples=200_000, batch=50_000)
    task.setup(make_ctx(tmp_path))
    assert run_to_end(task) == 4 and task.progress() == 200_000
    assert task.estimate() == pytest.approx(math.pi, abs=0.02)


def test_monte_carlo_pi_resumes_to_the_same_estimate(tmp_path: Path) -> None:
    def factory() -> MonteCarloPi:
        return MonteCarloPi(total_samples=10_000, batch=1_000, seed=3)

    whole = factory()
    whole.setup(make_ctx(tmp_path / "whole"))
    run_to_end(whole)
    resumed = run_interrupted(factory, tmp_path / "resumed", stop_after=4)
    assert isinstance(resumed, MonteCarloPi)
    assert (resumed.inside, resumed.samples) == (whole.inside, whole.samples)


def test_monte_carlo_pi_refuses_a_batch_over_its_limit(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="lower batch"):
        MonteCarloPi(batch=10_000_000).setup(make_ctx(tmp_path, memory_limit_bytes=1 << 20))
