"""Sizes in messages (``freeride.units``)."""

from __future__ import annotations

import pytest

from freeride.errors import ConfigError
from freeride.units import format_mib_apart, format_progress, format_rate, parse_size

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
    assert format_progress(0.0, 42, "steps") == "42 steps"
    # Stranger trial: a task hung before its first park read "29 numbers" for 1,450,000: steps are not its unit.
    assert format_progress(0.0, 29, "numbers") == "-"
    assert format_progress(0.0, 0, "steps") == "-"  # nothing done yet: its unit may not be known (a queued task)


def test_a_device_list_given_where_one_device_goes_says_how_to_name_several() -> None:
    # Stranger trial: `freeride bubbles --device cpu:0,cpu:5` answered only "unknown device 'cpu:0,cpu:5'".
    from freeride.devices import parse_device_name

    with pytest.raises(ConfigError, match=r"one device per --device \(repeat it\), or --devices cpu:0,cpu:1"):
        parse_device_name("cpu:0,cpu:5")
    with pytest.raises(ConfigError) as plain:
        parse_device_name("gpu:0")
    assert "repeat" not in str(plain.value)


def test_the_size_units_named_in_an_error_are_those_accepted() -> None:
    with pytest.raises(ConfigError) as bad:
        parse_size("12QB", "--memory")
    named = str(bad.value).split("(")[1].split(")")[0].split(", ")
    for unit in named:
        assert parse_size(f"1{unit}") > 0
    assert {"TB", "TiB"} <= set(named)


def test_a_rate_is_whole_and_grouped_from_a_hundred_up_and_never_in_exponent_form() -> None:
    # Stranger trial: run-task printed "3e+04 iterations/s" for 30.6k.
    assert format_rate(30_412.4) == "30,412"
    assert format_rate(1_234_567.0) == "1,234,567"
    assert format_rate(123.6) == "124"
    assert format_rate(20.0) == "20" and format_rate(2.345) == "2.35" and format_rate(0.0123) == "0.0123"
