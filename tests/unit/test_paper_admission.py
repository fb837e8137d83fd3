"""The worker side of the reference policy: its step admission rule, on plain numbers."""

from __future__ import annotations

from freeride._worker.timing import paper_step_fits

MS = 1_000_000


def test_first_step_with_unknown_time_runs_while_any_time_is_left() -> None:
    assert paper_step_fits(None, 1)
    assert not paper_step_fits(None, 0)


def test_median_is_rounded_up_to_10ms_then_scaled_by_1_2() -> None:
    # A 3 ms median counts as 10 ms; a step needs more than 12 ms left.
    assert not paper_step_fits(3 * MS, 12 * MS)
    assert paper_step_fits(3 * MS, 12 * MS + 1)
    # 10 ms exactly stays 10 ms; 10.1 ms becomes 20 ms (24 ms needed).
    assert paper_step_fits(10 * MS, 13 * MS)
    assert not paper_step_fits(10 * MS + 100_000, 24 * MS)
