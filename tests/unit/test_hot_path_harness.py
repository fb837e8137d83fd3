"""The instrumentation-cost harness (``bench/hot_path.py``) measures what a real run reports.

Regression: the replays used to report nothing after their second iteration (no wait lasts in a
replay, so the tracker took every planned position for one whose waits are all too short to report),
and the published "instrumentation cost" held the hooks and the bookkeeping but no event. Each case
here must keep reporting every planned wait, iteration after iteration, as a real run with long waits
does. Timings are not asserted (bench/results holds them).
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench import hot_path  # noqa: E402

ITERATIONS = 8


class Recorder:
    """A sink that counts, per iteration, the bubbles started and ended."""

    device = "cpu:0"

    def __init__(self) -> None:
        self.starts: collections.Counter[int] = collections.Counter()
        self.ends: collections.Counter[int] = collections.Counter()

    def bubble_start(self, iteration: int, slot: int, kind: str, predicted_ns: int, free_memory_bytes: int = -1,
                     start_ns: int | None = None, learned: bool = False) -> None:
        self.starts[iteration] += 1

    def bubble_end(self, iteration: int, slot: int, end_ns: int | None = None) -> None:
        self.ends[iteration] += 1


def _reported(case: hot_path.Case) -> Recorder:
    recorder = Recorder()
    step, undo = case.instrument(recorder)
    try:
        for _ in range(ITERATIONS):
            step()
    finally:
        undo()
    return recorder


def _every_iteration(recorder: Recorder) -> None:
    """As many bubbles reported in every iteration as in the first (where no position can have gone quiet)."""
    planned = recorder.starts[0]
    assert planned > 0
    for iteration in range(ITERATIONS):
        assert recorder.starts[iteration] == planned, f"iteration {iteration}: {dict(recorder.starts)}"
        assert recorder.ends[iteration] == planned


@pytest.mark.parametrize("name", ["1f1b", "interleaved-1f1b", "torchtitan"])
def test_torch_replay_reports_every_planned_wait_of_every_iteration(name: str, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch")
    from bench import bench_schedules

    monkeypatch.setattr(hot_path, "COMPUTE_US", 0.0)
    csv_path = tmp_path / "order.csv"
    bench_schedules.write_csv_order(csv_path, 4)
    for rank in (0, 1):
        _every_iteration(_reported(bench_schedules._torch_case(name, rank, 4, csv_path)))


@pytest.mark.parametrize("dualpipev", [False, True])
def test_deepspeed_replay_reports_every_planned_wait_of_every_iteration(dualpipev: bool,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("deepspeed")
    from bench import deepspeed_replay

    monkeypatch.setattr(hot_path, "COMPUTE_US", 0.0)
    for rank in (0, 1):
        _every_iteration(_reported(deepspeed_replay.deepspeed_case(dualpipev, 4, rank)))


def test_replayed_compute_is_counted_apart_from_the_gaps() -> None:
    """``paired_ns`` subtracts the time spent in :func:`hot_path.compute`: the counter it reads grows by each
    compute action's own time, and only there."""
    before = hot_path._computed_ns
    hot_path.compute(200.0)
    grown = hot_path._computed_ns - before
    assert grown > 0
    hot_path.compute(0.0)
    assert hot_path._computed_ns - before == grown


def test_an_unknown_route_is_refused_before_any_manager_starts() -> None:
    def no_case(rank: int) -> hot_path.Case:
        raise AssertionError("no case is built for a refused route")

    with pytest.raises(ValueError, match=r"unknown route\(s\) \['wire'\]: pick from queue, local, awake, tracker"):
        hot_path.costs_ns(no_case, routes=("queue", "wire"))


def test_the_parts_table_gives_each_route_per_iteration_and_as_a_share_of_the_last_runs_iteration(
        tmp_path: Path) -> None:
    doc = {"command": "python -m bench.hot_path --routes tracker,queue", "compute_us": 1000.0, "microbatches": 8,
           "machine": {"cpu": "a CPU", "cores": 2}, "routes": ["tracker", "queue"],
           "rows": [{"schedule": "1f1b", "rank": 0, "us_per_iteration": {"tracker": 300.0, "queue": 450.0},
                     "last_iteration_ms_p50": 150.0},
                    {"schedule": "zbv", "rank": 1, "us_per_iteration": {"tracker": 80.0, "queue": 95.0},
                     "last_iteration_ms_p50": None}]}
    hot_path.write_markdown(doc, tmp_path / "parts.md")
    text = (tmp_path / "parts.md").read_text()
    assert "| schedule | rank | tracker us/it | queue us/it | tracker share | queue share |" in text
    assert "| 1f1b | 0 | 300 | 450 | 0.200% | 0.300% |" in text
    assert "| zbv | 1 | 80 | 95 | - | - |" in text
