"""A trainer's layout report (``TrainerLayout``) end to end on an in-process manager: through the
reporter, in order with the bubbles around it, checked at the edge, reflected in Stats."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import ManagerHarness, cpu_devices, now_ns, wait_for

from freeride._manager.daemon import Manager
from freeride._wire.client import BubbleStream, ControlClient
from freeride.endpoints import Endpoint
from freeride.errors import ConfigError
from freeride.messages import BubbleEnd, BubbleStart, TrainerLayout
from freeride.training.reporter import BubbleReporter

MS = 1_000_000


def test_a_reported_layout_resets_the_managers_bubble_statistics(harness: ManagerHarness) -> None:
    device = str(harness.manager.device)
    with BubbleReporter(device, stage=0, rank=0, endpoint=harness.endpoint) as reporter:
        for it in range(3):
            reporter.bubble_start(it, 0, "old", 5 * MS, 2**30)
            reporter.bubble_end(it, 0)
        wait_for(lambda: [s.count for s in harness.client.bubbles()] == [3])
        reporter.report_layout("1f1b", 4, 8, ("n/cuda:0", "n/cuda:1", "n/cuda:2", "n/cuda:3"), 2**30)
        reporter.report_layout("1f1b", 4, 8, ("n/cuda:0", "n/cuda:1", "n/cuda:2", "n/cuda:3"), 2**30)  # again
        reporter.bubble_start(3, 1, "new", 5 * MS, 2**30)
        reporter.bubble_end(3, 1)
        wait_for(lambda: [(s.slot, s.count) for s in harness.client.bubbles()] == [(1, 1)])
    stats = harness.client.stats()
    assert stats.layout_changes == 1  # the same layout twice is one change
    assert stats.layout == "1f1b stages=4 microbatches=8 [n/cuda:0 n/cuda:1 n/cuda:2 n/cuda:3]"
    assert stats.bubbles == 4 and stats.events_rejected == 0


def test_a_trainer_run_again_with_the_same_shape_starts_the_managers_statistics_afresh(
        harness: ManagerHarness) -> None:
    device = str(harness.manager.device)
    for run, slot in enumerate((0, 1)):  # each run its own reporter, as each trainer process has
        with BubbleReporter(device, stage=0, rank=0, endpoint=harness.endpoint) as reporter:
            reporter.report_layout("1f1b", 2, 4, (), 2**30)
            for it in range(3):
                reporter.bubble_start(it, slot, "k", 5 * MS, 2**30)
                reporter.bubble_end(it, slot)
            seen = 3 * (run + 1)
            wait_for(lambda: harness.client.stats().bubbles == seen)  # noqa: B023 - waited for here, in the loop
        assert [(s.slot, s.count) for s in harness.client.bubbles()] == [(slot, 3)]  # this run's only
        # The run's own figures beside the totals (a manager kept up across 13 jobs showed only totals).
        stats = harness.client.stats()
        assert (stats.bubbles, stats.run_bubbles) == (seen, 3)
        assert 0 < stats.run_bubble_time_s <= stats.bubble_time_s and stats.run_s <= stats.uptime_s
        assert (stats.run_bubble_time_s < stats.bubble_time_s) == (run > 0)
    assert harness.client.stats().layout_changes == 2
    with BubbleReporter(device, stage=0, rank=0, endpoint=harness.endpoint, job="named-run") as a, \
            BubbleReporter(device, stage=1, rank=1, endpoint=harness.endpoint, job="named-run") as b:
        a.report_layout("1f1b", 2, 4, (), 2**30)
        b.report_layout("1f1b", 2, 4, (), 2**30)  # two ranks of one named job on one device
        a.bubble_start(9, 2, "k", 5 * MS, 2**30)
        a.bubble_end(9, 2)
        wait_for(lambda: harness.client.stats().bubbles == 7)
    assert harness.client.stats().layout_changes == 3


def test_a_manager_restarted_under_a_running_trainer_learns_its_layout_again_and_reads_no_delay_or_rejection_from_it(
        tmp_path: Path) -> None:
    # Stranger trial: after a manager was killed and restarted under a running trainer, `stats` read an event
    # delay of 6-19 s (the layout told again carries the time it took effect) and "1 rejected" with no reason
    # anywhere (an end whose start went to the dead manager, counted as rejected).
    device = cpu_devices(1)[0]
    endpoint = Endpoint("unix", f"/tmp/fr-relayout-{os.getpid()}.sock")
    first = Manager(device, endpoint=endpoint, state_dir=tmp_path / "a")
    first.start()
    # Over the wire: with no task resident, a local trainer's events are read late on purpose and not timed
    # (loop.LAZY_READ_NS), and this test times them.
    with BubbleReporter(device, stage=0, rank=0, endpoint=endpoint, backoff_initial_s=0.01,
                        backoff_max_s=0.05, local_events=False) as reporter:
        reporter.report_layout("1f1b", 2, 4, (), 2**30, at_ns=now_ns() - 30_000 * MS)  # training began long ago
        reporter.bubble_start(0, 0, "k", 5 * MS, 2**30)
        with ControlClient(endpoint) as client:
            wait_for(lambda: client.stats().bubbles == 1 and client.stats().layout.startswith("1f1b"))
        first.stop()
        second = Manager(device, endpoint=endpoint, state_dir=tmp_path / "b")
        second.start()
        try:
            with ControlClient(endpoint) as client:
                wait_for(lambda: client.stats().layout == "1f1b stages=2 microbatches=4", what="the layout told again")
                assert client.stats().layout_changes == 1
                reporter.bubble_end(0, 0)  # its start went to the first manager
                reporter.bubble_start(1, 0, "k", 5 * MS, 2**30)
                reporter.bubble_end(1, 0)
                wait_for(lambda: client.stats().bubbles == 1)
                stats = client.stats()
        finally:
            second.stop()
    assert (stats.events_rejected, stats.events_ignored) == (0, 1)
    assert stats.event_delay_ms.count == 3  # the two bubble events and the end out of order, not the layout
    assert stats.event_delay_ms.max < 10_000


def test_a_reporters_job_must_be_printable_text() -> None:
    for job in ("", "   ", "x" * 129, "run\n2", 123):
        with pytest.raises(ConfigError, match="job must be"):
            BubbleReporter("cpu:0", stage=0, rank=0, job=job, start=False)  # type: ignore[arg-type]


def test_a_malformed_layout_is_rejected_alone_and_the_stream_goes_on(harness: ManagerHarness) -> None:
    t = now_ns()
    events = [
        BubbleStart(0, 0, 0, 0, "k", t, 5 * MS),
        TrainerLayout("1f1b", 0, 8, (), t),  # no stages
        TrainerLayout("1f1b", 2, 8, ("cuda:0",), t),  # a map that does not cover the stages
        TrainerLayout("gpipe\x1b[2J", 2, 8, (), t),  # a kind that would reach a terminal
        TrainerLayout("gpipe", 2, 8, (), t, job="run\x1b[2J"),  # so would this job
        TrainerLayout("gpipe", 2, 4, (), t + 3600 * 10**9),  # ahead of this host's clock
        BubbleEnd(0, 0, 0, 0, t + MS),
    ]
    stream = BubbleStream(harness.endpoint, [events])
    summary = stream.summary(timeout_s=30)
    stream.close()
    assert (summary.accepted, summary.rejected) == (2, 5)
    assert "CLOCK_MONOTONIC" in summary.last_error
    assert harness.client.stats().layout_changes == 0


def test_a_reporter_over_the_wire_rejects_a_malformed_event_alone_and_keeps_its_stream(
    harness: ManagerHarness, caplog: pytest.LogCaptureFixture
) -> None:
    # Stranger trial: a negative iteration went out on the wire, failed the stream's serializer, and the reporter
    # said "the manager ... went away" and lost the events queued behind it; the local route counted it rejected.
    device = str(harness.manager.device)
    with caplog.at_level("INFO", logger="freeride.training.reporter"), \
            BubbleReporter(device, stage=0, rank=0, endpoint=harness.endpoint, local_events=False,
                           end_board=False) as reporter:
        reporter.bubble_start(-1, 0, "drain", 5 * MS)
        reporter.bubble_start(0, 2**40, "drain", 5 * MS)  # a slot past its field on the wire
        reporter.bubble_start(7, 0, "drain", 10**13)  # a prediction past any bubble: its end must not go alone
        reporter.bubble_end(7, 0)
        for it in range(5):
            reporter.bubble_start(it, 1, "drain", 5 * MS)
            reporter.bubble_end(it, 1)
        wait_for(lambda: [(s.slot, s.count) for s in harness.client.bubbles()] == [(1, 5)])
        counters = reporter.counters()
    assert counters.rejected >= 4 and counters.dropped == 0 and counters.connects == 1
    assert reporter.counters().rejected == 4 and reporter.counters().accepted == 10
    assert harness.client.stats().events_ignored == 0  # no end without its start reached the manager
    lines = [r.getMessage() for r in caplog.records]
    assert not any("went away" in line for line in lines), lines
    assert sum("rejected and not sent: bubble iteration must be >= 0, got -1" in line for line in lines) == 1, lines
    assert any("4 bubble events in all were rejected and not sent, the last: its start was rejected" in line
               for line in lines), lines
