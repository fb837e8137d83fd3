"""The proto <-> message codec that the servicers and the client share: every message round-trips.

Each case is a message with every field away from its default: encoded, every field of its protobuf
message is set (a field the encoder forgot fails here), and decoded, it is the message again. A
message added to the proto fails the coverage test until the codec handles it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
from google.protobuf.message import Message as PbMessage

from freeride._validation import validate_submission
from freeride._wire import codec
from freeride._wire import freeride_pb2 as pb
from freeride.errors import ConfigError, RequestRejected
from freeride.messages import (
    BubbleEnd,
    BubbleSlotStats,
    BubbleStart,
    Drained,
    FailureRecord,
    ManagerStats,
    Percentiles,
    QueueStats,
    StreamSummary,
    TaskEvent,
    TaskInfo,
    TaskProgress,
    TaskSpec,
    TrainerLayout,
)

P = Percentiles(count=5, p50=1.5, p90=2.5, p99=3.5, max=4.5, p999=4.0)
START = BubbleStart(stage=1, rank=2, iteration=3, slot=4, kind="cooldown", start_ns=5_000, predicted_ns=6_000,
                    free_memory_bytes=7 * 2**20, learned=True)
END = BubbleEnd(stage=1, rank=2, iteration=3, slot=4, end_ns=9_000)
LAYOUT = TrainerLayout(schedule="1f1b", stages=2, microbatches=8, stage_devices=("n1/cuda:0", "cuda:1"), at_ns=100,
                       free_memory_bytes=2**30, job="run-7")
FAILURE = FailureRecord(kind="EXIT", message="exit 3", exit_code=3, signal=9, step=17, traceback="tb", log_tail="tail",
                        at_unix_s=1.25)
#: What a TaskInfo carries of its spec: all of it (the name as given). Stranger trial: `show --json` said
#: checkpoint_interval_s 0.0, working_dir "" and step_time_hint_ms 0.0 of a task submitted with them.
SPEC = TaskSpec(target="side_tasks.graph:PageRank", args={"graph": "rmat:10", "n": [1, 2.5]}, memory_bytes=2**28,
                priority=-3, name="pr", command=(), working_dir="/home/u/tasks", checkpoint_interval_s=5.0,
                step_time_hint_ms=1.5)
INFO = TaskInfo(
    task_id="pr-7", spec=SPEC, state="FAILED",
    figures=TaskProgress(steps=40, progress=4.5, progress_unit="iterations", harvested_s=2.5, overruns=3, restarts=1,
                         checkpoint_step=30, step_p95_ms=1.75),
    step_p50_ms=1.25, waiting_reason="needs 256 MiB", submitted_unix_s=10.5, updated_unix_s=11.5, failure=FAILURE,
    pid=4242, task_dir="/state/tasks/pr-7",
)
STATS = ManagerStats(
    device="cuda:0", uptime_s=1.5, bubbles=2, bubble_time_s=3.5, granted_s=4.5, harvested_s=5.5, overruns=6,
    overrun_ms=P, grant_latency_ms=P, park_latency_ms=P, memory_budget_bytes=7, tasks_by_state={"PARKED": 2},
    events_received=8, events_rejected=9, draining=True, event_delay_ms=P, events_dropped=10,
    device_info="NVIDIA H100 GPU-1234", device_problem="NVML: lost", layout_changes=11, layout="1f1b stages=2",
    end_to_worker_ms=P, queue=QueueStats(connected=True, lease_ms=2000, depth=1, set_aside=2, held=3, claims=4,
                                         reclaims=5, renewals=6, lost=7, handed_back=8, set_aside_here=9, errors=10,
                                         graces=11, last_error="cannot reach the queue"),
    shared_by_ranks=(0, 2), events_other_ranks=12, events_ignored=3, bubbles_while_shared=4, shared_quiet_s=2.5,
    trainer_stops=7, hung_overruns=13, events_late=14, run_s=15.5, run_bubbles=16, run_bubble_time_s=1.25,
    run_granted_s=0.75, run_harvested_s=0.5,
)
SLOT = BubbleSlotStats(stage=1, rank=2, slot=3, kind="tail", count=4, length_ms=P, predicted_ms=P, abs_error_pct=P,
                       min_free_memory_bytes=5, learned=True, length_mean_ms=2.5, shared=3)

COMMAND_INFO = TaskInfo(
    task_id="c-8", spec=TaskSpec(command=("python", "-c", "pass"), args={"x": 1}, memory_bytes=1, priority=2, name="c",
                                working_dir="/w", checkpoint_interval_s=1.0, step_time_hint_ms=2.0),
    state="PARKED", figures=TaskProgress(steps=1, progress=1.0, progress_unit="s", harvested_s=0.5, overruns=1,
                                         restarts=1, checkpoint_step=1, step_p95_ms=1.0),
    step_p50_ms=0.5, waiting_reason="w", submitted_unix_s=1.0, updated_unix_s=2.0, failure=FAILURE, pid=1,
    task_dir="/state/tasks/c-8",
)

# (name, message, encode, decode)
CASES: list[tuple[str, Any, Callable[[Any], PbMessage], Callable[[Any], Any]]] = [
    ("bubble start", START, codec.bubble_event_to_pb, codec.trainer_event_from_pb),
    ("bubble end", END, codec.bubble_event_to_pb, codec.trainer_event_from_pb),
    ("layout", LAYOUT, codec.bubble_event_to_pb, codec.trainer_event_from_pb),
    ("stream summary", StreamSummary(accepted=1, rejected=2, dropped=3, last_error="bad slot"), codec.summary_to_pb,
     codec.summary_from_pb),
    ("submission", TaskSpec(target="m:C", args={"a": {"b": [1, None, True]}}, memory_bytes=2**20, priority=5,
                            name="c", working_dir="/", checkpoint_interval_s=2.5, step_time_hint_ms=0.5),
     codec.spec_to_pb, lambda msg: validate_submission(codec.submission_from_pb(msg))),
    ("command submission", TaskSpec(command=("python", "-c", "pass"), args={"x": 1}, memory_bytes=2**21, priority=-1,
                                    name="c", working_dir="/", checkpoint_interval_s=1.0, step_time_hint_ms=2.0),
     codec.spec_to_pb, lambda msg: validate_submission(codec.submission_from_pb(msg))),
    ("task info", INFO, codec.task_info_to_pb, codec.task_info_from_pb),
    ("command task info", COMMAND_INFO, codec.task_info_to_pb, codec.task_info_from_pb),
    ("percentiles", P, codec.percentiles_to_pb, codec.percentiles_from_pb),
    ("stats", STATS, codec.stats_to_pb, codec.stats_from_pb),
    ("slot", SLOT, codec.slot_to_pb, codec.slot_from_pb),
    ("task event", TaskEvent(1.5, task=INFO), codec.event_to_pb, codec.event_from_pb),
    ("bubble start event", TaskEvent(2.5, bubble=START), codec.event_to_pb, codec.event_from_pb),
    ("bubble end event", TaskEvent(3.5, bubble=END), codec.event_to_pb, codec.event_from_pb),
    ("drain", (Drained(4, 3, 1), True), lambda d: codec.drain_to_pb(*d[0][:2], timed_out=d[1], killed=d[0][2]),
     codec.drain_from_pb),
]

#: Requests and replies built in place by the servicers and the client: empty, one scalar, or a list of a
#: message the codec handles.
BUILT_IN_PLACE = {"ListRequest", "GetRequest", "CancelRequest", "StatsRequest", "BubblesRequest", "WatchRequest",
                  "DrainRequest", "ListResponse", "BubblesResponse"}
#: A task is a target or a command, never both: the other one is left unset.
EXCLUSIVE = {"target", "command"}


def _unset_fields(msg: PbMessage) -> list[str]:
    """Fields the encoder left unset, but for a oneof's other choices and the other of target and command."""
    set_names = {f.name for f, _ in msg.ListFields()}
    unset = {f.name for f in msg.DESCRIPTOR.fields if f.containing_oneof is None and f.name not in set_names}
    if {f.name for f in msg.DESCRIPTOR.fields} >= EXCLUSIVE and len(unset & EXCLUSIVE) == 1:
        unset -= EXCLUSIVE
    return sorted(unset)


@pytest.mark.parametrize(("message", "encode", "decode"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_every_message_round_trips_and_its_encoding_sets_every_field(
    message: Any, encode: Callable[[Any], PbMessage], decode: Callable[[Any], Any]
) -> None:
    encoded = encode(message)
    assert _unset_fields(encoded) == [], f"the encoder leaves fields of {encoded.DESCRIPTOR.name} unset"
    assert decode(type(encoded).FromString(encoded.SerializeToString())) == message


def test_stats_of_a_manager_without_a_queue_come_back_without_one() -> None:
    alone = dataclasses.replace(STATS, queue=None)
    encoded = codec.stats_to_pb(alone)
    assert not encoded.HasField("queue") and codec.stats_from_pb(encoded) == alone


def test_every_message_of_the_proto_has_a_round_trip_or_is_built_in_place() -> None:
    covered: set[str] = set()

    def walk(msg: PbMessage) -> None:
        covered.add(msg.DESCRIPTOR.name)
        for field, value in msg.ListFields():
            if field.message_type is None or field.message_type.GetOptions().map_entry:
                continue
            for item in value if field.is_repeated else [value]:
                walk(item)

    for _, message, encode, _ in CASES:
        walk(encode(message))
    walk(codec.bubble_message_to_pb([START, END]))
    every = set(pb.DESCRIPTOR.message_types_by_name)
    assert every - covered - BUILT_IN_PLACE == set()


def test_a_batch_goes_out_in_order_and_one_event_goes_alone() -> None:
    batch = codec.bubble_message_to_pb([START, END, LAYOUT])
    assert [codec.trainer_event_from_pb(p) for p in codec.message_parts(batch)] == [START, END, LAYOUT]
    assert codec.bubble_message_to_pb([END]).WhichOneof("event") == "end"
    assert list(codec.message_parts(codec.bubble_message_to_pb(END))) == [codec.bubble_event_to_pb(END)]


def test_decoding_a_trainer_event_validates_it() -> None:
    with pytest.raises(ConfigError, match="start or an end"):
        codec.trainer_event_from_pb(pb.BubbleEvent())
    with pytest.raises(ConfigError, match="start or an end"):
        codec.trainer_event_from_pb(codec.bubble_message_to_pb([START, END]))  # a batch is no event
    with pytest.raises(ConfigError, match="ahead of this host"):
        codec.trainer_event_from_pb(codec.bubble_event_to_pb(END), latest_ns=END.end_ns - 1)


def test_a_live_view_event_of_a_kind_this_version_does_not_know_is_skipped() -> None:
    assert codec.event_from_pb(pb.ManagerEvent(at_unix_s=1.0)) is None


@pytest.mark.parametrize(("change", "says"), [
    ({"priority": -(2**40)}, "priority must be within"),  # int32 on the wire: protobuf's ValueError named no field
    ({"args": {"x": object()}}, "task arguments must be JSON"),
    ({"args": {"x": float("nan")}}, "task arguments must be JSON"),
    ({"memory_bytes": 2**70}, "the task's spec cannot be sent"),
], ids=["priority", "an-object-argument", "nan", "memory-past-int64"])
def test_a_spec_the_wire_cannot_carry_is_refused_as_the_manager_refuses_what_it_reads(
    change: dict[str, Any], says: str
) -> None:
    # Stranger trial: ControlClient.submit raised protobuf's bare ValueError for a large negative priority.
    spec = dataclasses.replace(TaskSpec(target="m:C", memory_bytes=2**26), **change)
    with pytest.raises(RequestRejected, match=says):
        codec.spec_to_pb(spec)
