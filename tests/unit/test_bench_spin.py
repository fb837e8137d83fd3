"""``bench.bench_spin``'s parts that need no timing: the busy neighbours it starts and stops, and its table."""

from __future__ import annotations

import os
from pathlib import Path

import psutil
from conftest import wait_for

from bench.bench_spin import competitors, write_markdown


def test_the_competitors_are_busy_on_the_cores_named_and_gone_after() -> None:
    core = min(os.sched_getaffinity(0))
    with competitors({core}) as procs:
        (proc,) = procs
        wait_for(lambda: psutil.Process(proc.pid).cpu_affinity() == [core], what="the competitor pinned")
        wait_for(lambda: psutil.Process(proc.pid).cpu_times().user > 0.05, what="the competitor computing")
    assert proc.poll() is not None


def test_the_table_has_a_row_per_condition_and_manager_with_the_delays_and_costs(tmp_path: Path) -> None:
    delay = {"count": 960, "p50": 0.032, "p90": 0.05, "p99": 0.16, "p999": 2.7, "max": 9.7}
    doc = {"command": "python -m bench.bench_spin", "machine": {"cpu": "a CPU", "cores": 2},
           "results": {"alone": {"asleep": {"us_per_iteration": [811.0, 870.0], "event_delay_ms": delay},
                                 "awake": {"us_per_iteration": [306.0, 376.0], "event_delay_ms": delay}}}}
    out = tmp_path / "spin.md"
    write_markdown(doc, out)
    rows = [line for line in out.read_text().splitlines() if line.startswith("| alone")]
    assert rows == ["| alone | asleep | 811, 870 | 960 | 0.032 | 0.050 | 0.160 | 2.700 | 9.700 |",
                    "| alone | awake | 306, 376 | 960 | 0.032 | 0.050 | 0.160 | 2.700 | 9.700 |"]
