"""The reporter against a real in-process manager, and ``freeride bubbles`` on what it saw."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import cpu_devices, now_ns, wait_for

from freeride._cli import bubbles as bubbles_cli
from freeride._manager import daemon
from freeride._wire.client import ControlClient
from freeride.endpoints import Endpoint
from freeride.errors import ManagerUnavailable
from freeride.training.reporter import BubbleReporter

DEVICE = cpu_devices(1)[0]  # a core this process may run on: tests never name core numbers

MS = 1_000_000


def _start_manager(tmp_path: Path, endpoint: Endpoint) -> Any:
    manager = daemon.Manager(DEVICE, endpoint=endpoint, state_dir=tmp_path / "state")
    manager.start()
    return manager


@pytest.fixture
def endpoint(tmp_path: Path) -> Endpoint:
    return Endpoint("unix", str(tmp_path / "m.sock"))


@pytest.fixture
def manager(tmp_path: Path, endpoint: Endpoint) -> Iterator[Any]:
    m = _start_manager(tmp_path, endpoint)
    try:
        yield m
    finally:
        m.stop()


def _feed(reporter: BubbleReporter, iterations: range, stage_slots: list[tuple[int, str, int]]) -> None:
    """Each iteration's slots, laid out back to back in the host clock's recent past."""
    span_ns = sum(2 * length_ms * MS for _, _, length_ms in stage_slots)
    for it in iterations:
        t = now_ns() - span_ns
        for slot, kind, length_ms in stage_slots:
            reporter.bubble_start(it, slot, kind, predicted_ns=length_ms * MS, free_memory_bytes=2**30, start_ns=t)
            reporter.bubble_end(it, slot, end_ns=t + int(length_ms * MS * 1.05))
            t += 2 * length_ms * MS


def _wait_count(endpoint: Endpoint, want: int, timeout_s: float = 10.0) -> list[Any]:
    """The manager's slot telemetry once it has counted ``want`` bubbles; fails at the deadline."""
    slots: list[Any] = []

    def counted() -> bool:
        nonlocal slots
        with ControlClient(endpoint, timeout_s=2) as client:
            slots = client.bubbles()
        return sum(s.count for s in slots) >= want

    wait_for(counted, timeout_s)
    return slots


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    parser = argparse.ArgumentParser()
    bubbles_cli.register(parser.add_subparsers())
    args = parser.parse_args(["bubbles", *argv])
    code = args.func(args)
    return code, capsys.readouterr().out


def test_reported_bubbles_reach_the_manager_and_the_cli(
    manager: Any, endpoint: Endpoint, capsys: pytest.CaptureFixture[str]
) -> None:
    with BubbleReporter(DEVICE, stage=1, rank=1, endpoint=endpoint) as reporter:
        _feed(reporter, range(6), [(0, "turnaround", 4), (1, "drain", 1)])
        slots = _wait_count(endpoint, 12)
    assert {(s.stage, s.slot, s.kind, s.count) for s in slots} == {(1, 0, "turnaround", 6), (1, 1, "drain", 6)}
    assert reporter.sent == 24 and reporter.dropped == 0

    code, out = _cli(["--endpoint", str(endpoint)], capsys)
    assert code == 0
    assert "turnaround" in out and "drain" in out and "bubble time per iteration, mean (median)" in out
    assert out.splitlines()[-1].startswith("pred: the trainer's prediction, by default the 10th percentile")
    code, out = _cli(["--endpoint", str(endpoint), "--json"], capsys)
    doc = json.loads(out)
    assert list(doc["devices"]) == [DEVICE]  # the manager's device, not the endpoint it was reached by
    (rows,) = doc["devices"].values()
    assert sorted((r["slot"], r["count"]) for r in rows) == [(0, 6), (1, 6)]
    # --summary applies to --json too (a stranger found it ignored there)
    code, out = _cli(["--endpoint", str(endpoint), "--json", "--summary"], capsys)
    (summary,) = json.loads(out)["devices"].values()
    assert code == 0 and (summary["slots"], summary["measured"], summary["learned"]) == (2, 2, 0)
    assert list(summary["bubble_ms_per_iteration"]) == ["1"]
    assert summary["bubble_ms_per_iteration"]["1"]["modelled"] == pytest.approx(
        sum(r["length_mean_ms"] for r in rows))
    assert summary["bubble_ms_per_iteration"]["1"]["modelled_median"] == pytest.approx(
        sum(r["length_ms"]["p50"] for r in rows))
    assert all(r["length_mean_ms"] > 0 for r in rows)


def test_reporter_reconnects_after_the_manager_restarts(tmp_path: Path, endpoint: Endpoint) -> None:
    first = _start_manager(tmp_path, endpoint)
    reporter = BubbleReporter(DEVICE, stage=0, rank=0, endpoint=endpoint, backoff_initial_s=0.02,
                              backoff_max_s=0.1)
    try:
        _feed(reporter, range(2), [(0, "boundary", 2)])
        assert _wait_count(endpoint, 2)
        first.stop()
        # The manager is gone: reporting goes on without blocking or raising.
        _feed(reporter, range(2, 4), [(0, "boundary", 2)])
        second = _start_manager(tmp_path, endpoint)
        try:
            wait_for(lambda: reporter.counters().connected and reporter.counters().connects >= 2, 10)
            _feed(reporter, range(4, 7), [(0, "boundary", 2)])
            slots = _wait_count(endpoint, 3)
            assert sum(s.count for s in slots) >= 3
        finally:
            second.stop()
    finally:
        reporter.close()
    assert reporter.reconnects >= 1


def test_bubbles_cli_without_manager_is_unavailable(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ManagerUnavailable):
        _cli(["--endpoint", f"unix:{tmp_path}/none.sock", "--timeout-s", "1"], capsys)


def test_learned_slots_reach_the_manager_flagged_and_the_cli_shows_them_apart(
    manager: Any, endpoint: Endpoint, capsys: pytest.CaptureFixture[str]
) -> None:
    # Issue 13: waits the schedule model does not list were never reported at all; now a learned slot
    # travels with learned=True and every view keeps it apart from the modelled ones.
    from freeride.training.learned_slots import LEARNED_SLOT_BASE

    learned_id = LEARNED_SLOT_BASE + 5
    with BubbleReporter(DEVICE, stage=0, rank=0, endpoint=endpoint) as reporter:
        for it in range(3):
            t = now_ns() - 20 * MS
            reporter.bubble_start(it, 0, "turnaround", predicted_ns=4 * MS, start_ns=t)
            reporter.bubble_end(it, 0, end_ns=t + 4 * MS)
            reporter.bubble_start(it, learned_id, "learned", predicted_ns=2 * MS, start_ns=t + 8 * MS, learned=True)
            reporter.bubble_end(it, learned_id, end_ns=t + 10 * MS)
        slots = _wait_count(endpoint, 6)
    assert {(s.slot, s.learned) for s in slots} == {(0, False), (learned_id, True)}
    code, out = _cli(["--endpoint", str(endpoint)], capsys)
    rows = {cells[3]: cells[4] for cells in map(str.split, out.splitlines()[1:])
            if len(cells) > 5 and cells[4] in ("model", "learned")}
    assert rows == {"0": "model", str(learned_id): "learned"}
    assert "stage 0: 4.00 ms (4.00) + 2.00 ms (2.00) learned" in out
    code, out = _cli(["--endpoint", str(endpoint), "--json"], capsys)
    (rows_json,) = json.loads(out)["devices"].values()
    assert sorted((r["slot"], r["learned"]) for r in rows_json) == [(0, False), (learned_id, True)]


def test_a_slot_seen_but_never_measured_shows_dashes_not_zero_lengths() -> None:
    # Stranger trial: rows of count 0 read "0.00 ms" in every column, as if the slot's bubbles were empty.
    from freeride.messages import BubbleSlotStats, Percentiles

    measured = BubbleSlotStats(stage=0, rank=0, slot=3, kind="steady", count=2,
                               length_ms=Percentiles(2, 1.5, 1.5, 1.5, 1.5),
                               predicted_ms=Percentiles(2, 1.0, 1.0, 1.0, 1.0),
                               abs_error_pct=Percentiles(2, 33.3, 33.3, 33.3, 33.3), min_free_memory_bytes=-1)
    unmeasured = BubbleSlotStats(stage=0, rank=0, slot=11, kind="steady", count=0, length_ms=Percentiles(),
                                 predicted_ms=Percentiles(), abs_error_pct=Percentiles(), min_free_memory_bytes=-1)
    rows = bubbles_cli.render({"cpu:0": [measured, unmeasured]}, {}).splitlines()
    (never,) = [r for r in rows if r.split()[:4] == ["cpu:0", "0", "0", "11"]]
    assert never.split()[6:] == ["0", "-", "-", "-", "-", "-", "-", "-", "?"]
    (seen,) = [r for r in rows if r.split()[:4] == ["cpu:0", "0", "0", "3"]]
    assert seen.split()[6:9] == ["2", "1.50", "1.50"]


def test_counts_measured_while_ranks_shared_the_device_are_marked_and_said_under_the_devices_rows() -> None:
    # Stranger trial: rows measured while two ranks shared a device read as its idle time, with no mark.
    from freeride.messages import BubbleSlotStats, Percentiles

    def slot(index: int, count: int, shared: int) -> BubbleSlotStats:
        return BubbleSlotStats(stage=0, rank=0, slot=index, kind="steady", count=count,
                               length_ms=Percentiles(count, 2.0, 2.0, 2.0, 2.0), predicted_ms=Percentiles(),
                               abs_error_pct=Percentiles(), min_free_memory_bytes=-1, length_mean_ms=2.0, shared=shared)

    rows = bubbles_cli.render({"cpu:0": [slot(1, 10, 7), slot(2, 10, 0)], "cpu:1": [slot(1, 5, 0)]}, {}).splitlines()
    counts = {r.split()[3]: r.split()[6] for r in rows if r.startswith("cpu:0")}
    assert counts == {"1": "10*", "2": "10"}
    said = [r for r in rows if "*: " in r]
    assert len(said) == 1 and said[0].split()[:2] == ["*:", "7"] and "not the device's idle time" in said[0]
    assert rows.index(said[0]) < next(i for i, r in enumerate(rows) if r.startswith("cpu:1"))  # under cpu:0's rows
    summary = bubbles_cli.render({"cpu:0": [slot(1, 10, 7)]}, {}, summary=True)
    assert "; 7 of these bubbles ended while other trainer ranks shared the device" in summary
    assert bubbles_cli.summary_doc([slot(1, 10, 7), slot(2, 3, 1)])["shared"] == 8


def test_the_summary_is_one_line_per_device_with_its_slots_and_bubble_time_per_stage() -> None:
    from freeride.messages import BubbleSlotStats, Percentiles

    def slot(stage: int, index: int, count: int, p50: float, mean: float, learned: bool = False) -> BubbleSlotStats:
        return BubbleSlotStats(stage=stage, rank=stage, slot=index, kind="steady", count=count,
                               length_ms=Percentiles(count, p50, p50, p50, p50), predicted_ms=Percentiles(),
                               abs_error_pct=Percentiles(), min_free_memory_bytes=-1, learned=learned,
                               length_mean_ms=mean)

    # a slot mostly short and now and then long: its mean is its share of the bubble time, not its median
    stats = {"cpu:0": [slot(0, 1, 5, 1.5, 6.0), slot(0, 2, 0, 0.0, 0.0), slot(0, 65536, 4, 0.5, 0.75, learned=True)],
             "cpu:1": []}
    text = bubbles_cli.render(stats, {"cpu:2": "no manager answers"}, summary=True)
    assert text.splitlines() == [
        "cpu:0    3 slots (2 measured, 1 learned); bubble time per iteration, mean (median): stage 0: 6.00 ms "
        "(1.50) + 0.75 ms (0.50) learned",
        "cpu:1    (no bubbles reported yet)",
        "cpu:2    unavailable: no manager answers",
    ]


def _interleave(first: BubbleReporter, second: BubbleReporter, iterations: int) -> None:
    """Two reporters' waits of slot 1, interleaved as on a device both wait on: ``second``'s starts and ends a
    millisecond after ``first``'s."""
    for it in range(iterations):
        t = now_ns() - 20 * MS
        first.bubble_start(it, 1, "steady", predicted_ns=4 * MS, start_ns=t)
        second.bubble_start(it, 1, "steady", predicted_ns=4 * MS, start_ns=t + MS)
        first.bubble_end(it, 1, end_ns=t + 3 * MS)
        second.bubble_end(it, 1, end_ns=t + 4 * MS)


@pytest.mark.parametrize("local_events", [True, False], ids=["local", "wire"])
def test_two_jobs_rank_0_at_once_on_one_manager_are_told_apart_by_their_layouts_job(
    manager: Any, endpoint: Endpoint, local_events: bool,
) -> None:
    # A stranger ran two jobs at once on the same managers: their rank 0s were taken for one rank, their slots
    # mixed, 290 ends counted out of order, and the device granted while the other job computed.
    route = {"endpoint": endpoint, "local_events": local_events}
    with BubbleReporter(DEVICE, stage=0, rank=0, job="job-i", **route) as first, \
            BubbleReporter(DEVICE, stage=0, rank=0, job="job-j", **route) as second:
        wait_for(lambda: first.connected and second.connected, 10)
        first.report_layout("GPipe", 2, 8, (DEVICE, "cpu:99"))
        second.report_layout("1F1B", 2, 4, (DEVICE, "cpu:99"))
        with ControlClient(endpoint, timeout_s=2) as client:  # each job's layout taken on (a new run starts afresh)
            wait_for(lambda: client.stats().layout_changes == 2, 10)
        _interleave(first, second, 6)
        seen: list[Any] = []
        with ControlClient(endpoint, timeout_s=2) as client:
            wait_for(lambda: seen.append(client.stats()) or seen[-1].events_other_ranks == 12, 10)
        stats = seen[-1]
    assert stats.events_rejected == 0 and stats.events_ignored == 0 and stats.bubbles == 6
    assert list(stats.shared_by_ranks) == [0, 0]


def test_two_ranks_reporting_to_one_manager_are_told_apart_end_to_end(
    manager: Any, endpoint: Endpoint, capsys: pytest.CaptureFixture[str]
) -> None:
    # Stranger trial: 4 ranks on 2 CPU devices; a quarter of the events were counted as rejected.
    with BubbleReporter(DEVICE, stage=0, rank=0, endpoint=endpoint, job="two") as first, \
            BubbleReporter(DEVICE, stage=2, rank=2, endpoint=endpoint, job="two") as second:
        # Both streams are open before either rank waits: the manager follows the first rank it hears, and a
        # stream that connects later than RANK_LEFT_NS (5 s, a loaded machine) would arrive after the first
        # rank counts as gone, which is a rank taking over, not two ranks sharing a device.
        wait_for(lambda: first.connected and second.connected, 10)
        _interleave(first, second, 6)
        _wait_count(endpoint, 6)
        seen: list[Any] = []
        with ControlClient(endpoint, timeout_s=2) as client:
            # The figures of the read that saw all 12, not of a later one: sharing ends 5 s after the last event.
            wait_for(lambda: seen.append(client.stats()) or seen[-1].events_other_ranks == 12, 10)
        stats = seen[-1]
    assert (first.dropped, second.dropped) == (0, 0)
    assert stats.events_rejected == 0 and stats.bubbles == 6
    assert {s.rank for s in _wait_count(endpoint, 6)} == {stats.shared_by_ranks[0]}
    assert sorted(stats.shared_by_ranks) == [0, 2]
    code, out = _cli(["--endpoint", str(endpoint)], capsys)
    assert code == 0 and " 6 " in out


def test_a_cpu_device_this_machine_does_not_offer_is_named_as_such_not_advised_a_manager(endpoint: Endpoint) -> None:
    import os

    missing = f"cpu:{max(os.sched_getaffinity(0)) + 1}"
    stats, errors = bubbles_cli.collect([(missing, Endpoint("unix", f"{endpoint.address}.none"))], None, 1.0)
    assert stats == {} and list(errors) == [missing]
    assert errors[missing].startswith(f"no manager answers, and none can run on {missing} here: unknown device")
    assert "start one" not in errors[missing]


def test_a_device_this_machine_lacks_and_a_timeout_that_is_not_positive_are_bad_input(
    manager: Any, endpoint: Endpoint, capsys: pytest.CaptureFixture[str]
) -> None:
    # Stranger trial: `bubbles --timeout-s 0` said "no manager answers" of a serving manager and exited 3, and
    # `bubbles --device cpu:7` (a core this host lacks) exited 3 where the README puts a bad device under 2.
    import os

    from freeride.errors import ConfigError, ManagerUnavailable

    for timeout in ("0", "-1", "nan"):
        with pytest.raises(ConfigError, match="--timeout-s must be a positive number"):
            _cli(["--endpoint", str(endpoint), "--timeout-s", timeout], capsys)
    missing = f"cpu:{max(os.sched_getaffinity(0)) + 1}"
    with pytest.raises(ConfigError, match=f"none can run on {missing} here"):
        _cli(["--device", missing], capsys)
    with pytest.raises(ManagerUnavailable):  # a manager that is down is still that (exit 3)
        _cli(["--endpoint", f"unix:{endpoint.address}.none"], capsys)
