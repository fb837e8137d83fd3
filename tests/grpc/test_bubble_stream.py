"""The trainer's bubble stream end to end on an in-process manager: batches, legacy messages, bad events.

What reaches the scheduler is observed by wrapping the manager's core: every bubble event it is
handed, in the order the loop hands them over.
"""

from __future__ import annotations

import grpc
import pytest
from conftest import ManagerHarness, cpu_devices, now_ns, wait_for

from freeride._manager import core as C
from freeride._wire import freeride_pb2 as pb
from freeride._wire import freeride_pb2_grpc as pb_grpc
from freeride._wire.client import BubbleStream, bubble_message_to_pb
from freeride.messages import BubbleEnd, BubbleEvent, BubbleStart
from freeride.training.reporter import MAX_BATCH_EVENTS, BubbleReporter

MS = 1_000_000


def pairs(n: int, first_iteration: int = 0) -> list[BubbleEvent]:
    """``n`` start/end pairs 1 us apart, all in the host clock's recent past (never ahead of it)."""
    t0 = now_ns() - (first_iteration + n) * 1000 - MS
    out: list[BubbleEvent] = []
    for it in range(first_iteration, first_iteration + n):
        out.append(BubbleStart(0, 0, it, it % 3, "test", t0 + it * 1000, 2 * MS, 2**30))
        out.append(BubbleEnd(0, 0, it, it % 3, t0 + it * 1000 + 500))
    return out


@pytest.fixture
def handed(harness: ManagerHarness) -> list[BubbleEvent]:
    """Every bubble event the manager's loop hands to its scheduler core, in order."""
    seen: list[BubbleEvent] = []
    core = harness.manager.loop.core
    original = core.on_event

    def recording(event: C.Event, now_ns: int) -> list[C.Action]:
        if isinstance(event, (C.BubbleStarted, C.BubbleEnded)):
            seen.append(event.bubble)
        return original(event, now_ns)

    core.on_event = recording  # type: ignore[method-assign]
    return seen


def raw_stream(harness: ManagerHarness, messages: list[pb.BubbleEvent]) -> pb.StreamSummary:
    with grpc.insecure_channel(harness.endpoint.grpc_target) as channel:
        return pb_grpc.TrainerStub(channel).StreamBubbles(iter(messages), timeout=30)


def test_batched_stream_events_are_all_accepted_in_order_and_counted_once(
    harness: ManagerHarness, handed: list[BubbleEvent]
) -> None:
    events = pairs(300)
    messages = [events[:1], events[1:200], events[200:201], events[201:]]  # batches and lone events
    stream = BubbleStream(harness.endpoint, messages)
    summary = stream.summary(timeout_s=30)
    stream.close()
    assert (summary.accepted, summary.rejected, summary.dropped) == (600, 0, 0)
    wait_for(lambda: len(handed) >= 600)
    assert handed == events
    assert harness.client.stats().events_received == 600


def test_legacy_single_event_messages_are_still_accepted(harness: ManagerHarness, handed: list[BubbleEvent]) -> None:
    t0 = now_ns() - MS
    start = pb.BubbleEvent(start=pb.BubbleStart(stage=1, rank=2, iteration=3, slot=4, kind="warmup",
                                                start_ns=t0, predicted_ns=MS, free_memory_bytes=-1))
    end = pb.BubbleEvent(end=pb.BubbleEnd(stage=1, rank=2, iteration=3, slot=4, end_ns=t0 + 10))
    summary = raw_stream(harness, [start, end])
    assert (summary.accepted, summary.rejected, summary.dropped) == (2, 0, 0)
    wait_for(lambda: len(handed) >= 2)
    assert handed == [BubbleStart(1, 2, 3, 4, "warmup", t0, MS, -1), BubbleEnd(1, 2, 3, 4, t0 + 10)]


def test_a_lone_event_goes_on_the_wire_in_the_legacy_form() -> None:
    event = BubbleEnd(0, 0, 1, 0, now_ns())
    assert bubble_message_to_pb([event]).WhichOneof("event") == "end"
    assert bubble_message_to_pb(event).WhichOneof("event") == "end"
    assert bubble_message_to_pb([event, event]).WhichOneof("event") == "batch"


def test_malformed_event_inside_a_batch_is_rejected_alone_and_its_neighbours_are_accepted(
    harness: ManagerHarness, handed: list[BubbleEvent]
) -> None:
    events = pairs(2)
    good = [bubble_message_to_pb(e) for e in events]
    zero_length = pb.BubbleEvent(start=pb.BubbleStart(iteration=9, start_ns=now_ns() - MS, predicted_ns=0))
    nested = pb.BubbleEvent(batch=pb.BubbleEventBatch(events=[good[0]]))
    empty = pb.BubbleEvent()
    batch = pb.BubbleEvent(batch=pb.BubbleEventBatch(events=[good[0], zero_length, good[1], nested, empty,
                                                             good[2], good[3]]))
    summary = raw_stream(harness, [batch])
    assert (summary.accepted, summary.rejected) == (4, 3)
    assert "start or an end" in summary.last_error
    wait_for(lambda: len(handed) >= 4)
    assert handed == events
    assert harness.client.stats().events_rejected == 3


def test_batch_larger_than_the_loop_bound_is_handed_over_whole_and_in_order(
    harness: ManagerHarness, handed: list[BubbleEvent]
) -> None:
    events = pairs(3 * harness.manager.loop.config.max_pending_events)
    summary = BubbleStream(harness.endpoint, [events]).summary(timeout_s=60)
    assert summary.accepted == len(events)
    wait_for(lambda: len(handed) >= len(events))
    assert handed == events


def test_reporter_sends_what_queued_before_it_connected_as_full_batches(
    harness: ManagerHarness, handed: list[BubbleEvent]
) -> None:
    # The wire's batching (end_board=False: on the manager's host the events would go as local messages,
    # tests/trainer/test_reporter.py).
    reporter = BubbleReporter(cpu_devices(1)[0], stage=0, rank=0, endpoint=harness.endpoint, start=False,
                              end_board=False)
    total = MAX_BATCH_EVENTS + 100
    t0 = now_ns() - MS
    for it in range(total // 2):
        reporter.bubble_start(it, 0, "test", 2 * MS, start_ns=t0 + it)
        reporter.bubble_end(it, 0, end_ns=t0 + it + 1)
    reporter._thread.start()
    wait_for(lambda: reporter.sent == total)
    reporter.close(timeout_s=10)
    counters = reporter.counters()
    assert counters.messages == 2  # one full batch, then the rest: never one message per event
    assert (counters.accepted, counters.rejected, counters.dropped) == (total, 0, 0)
    assert [e.iteration for e in handed] == [it for it in range(total // 2) for _ in (0, 1)]
