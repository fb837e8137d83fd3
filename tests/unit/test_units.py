"""Sizes in messages (``freeride.units``)."""

from __future__ import annotations

from freeride.units import format_mib_apart, format_progress

MiB = 2**20


def test_a_use_over_its_cap_reads_as_more_than_the_cap_however_little_it_is_over() -> None:
    # Stranger trial: "used 64 MiB ..., over its limit of 64 MiB".
    assert format_mib_apart(268 * MiB, 256 * MiB) == ("268 MiB", "256 MiB")
    assert format_mib_apart(64 * MiB + 300_000, 64 * MiB) == ("64.3 MiB", "64.0 MiB")
    assert format_mib_apart(64 * MiB + 3, 64 * MiB) == ("67108867 B", "67108864 B")
    assert format_mib_apart(64 * MiB, 64 * MiB) == ("64 MiB", "64 MiB")
    assert format_mib_apart(500, 400) == ("500 B", "400 B")


def test_progress_reads_plainly_and_huge_values_in_three_figures() -> None:
    # Stranger trial: `ls` printed "178795000000000000000 bytes".
    assert format_progress(1.78795e20, 3, "bytes") == "1.79e+20 bytes"
    assert format_progress(9_999_999.0, 3, "rows") == "9999999 rows"
    assert format_progress(2.5, 3, "epochs") == "2.50 epochs"
    assert format_progress(0.0, 42, "") == "42 steps"  # no progress reported: the steps
    assert format_progress(0.0, 0, "steps") == "-"  # nothing done yet: its unit may not be known (a queued task)
