"""The benches' side-task specs (``--side-task``): each names a task the manager can run, and a bad one is refused
with what it takes."""

from __future__ import annotations

import argparse

import pytest

from bench.bench_schedules import PAGERANK, side_task, side_task_option


def test_each_spec_names_its_task_class_or_command_with_its_step() -> None:
    assert side_task("pagerank") is PAGERANK
    spin = side_task("spin:250")
    assert (spin["target"], spin["args"], spin["name"]) == ("bench.bench_tasks:SpinStep", {"step_us": 250.0},
                                                            "spin-250us")
    command = side_task("command:1.5")
    assert command["target"] == "freeride.command:CommandTask" and command["name"] == "command-1.5ms"
    assert command["args"]["slice_ms"] == 1.5 and command["args"]["argv"][-1] == "while True: pass"


@pytest.mark.parametrize(("spec", "message"), [
    ("spin:x", "needs the step's microseconds"), ("spin:0", "give 0 < US"), ("command:", "needs the slice's"),
    ("command:0.01", "give 0.1 <= MS <= 1000"), ("sleep:3", "pagerank, spin:US or command:MS"),
])
def test_a_bad_spec_is_the_parsers_usage_error_saying_what_it_takes(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        side_task(spec)
    parser = argparse.ArgumentParser()
    side_task_option(parser, "spin:200")
    with pytest.raises(SystemExit):
        parser.parse_args(["--side-task", spec])
