"""The core's language: its config is validated at construction, its policies are named, and every event
type has a handler."""

from __future__ import annotations

import pytest
from core_sim import MS

from freeride._manager.core import (
    CoreConfig,
)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"headroom_bytes": -1},
        {"grace_ns": -1},
        {"step_timeout_ns": 0},
        {"stop_timeout_ns": 0},
        {"memory_window_iterations": 0},
        {"margin_ns": 5 * MS, "max_margin_ns": 1 * MS},
    ],
)
def test_config_rejects_negative_zero_or_inconsistent_values(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        CoreConfig(**kwargs)


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="policy"):
        CoreConfig(policy="fastest")
