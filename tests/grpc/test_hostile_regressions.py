"""Regression tests for what hostile input broke, each named after the failure it pins down.

Found by the property tests in ``test_hostile.py`` and by probing the real server with the raw
generated stubs (the friendly client refuses most of these inputs before they are sent).
"""

from __future__ import annotations

import gc
import json
import time

import grpc
import pytest
from conftest import TESTS_DIR, ManagerHarness, cpu_devices, wait_for
from grpc_health.v1 import health_pb2

from freeride._manager import requests as L
from freeride._validation import MAX_ARGS_JSON_BYTES
from freeride._wire import freeride_pb2 as pb
from freeride._wire import freeride_pb2_grpc as pb_grpc
from freeride.endpoints import MAX_MESSAGE_BYTES, Endpoint
from freeride.messages import TaskSpec

DEVICE = cpu_devices(1)[0]  # a core this process may run on: tests never name core numbers

#: gRPC clients refuse trailers (where error details travel) beyond 16 KiB.
MAX_DETAILS_CHARS = 1024


def _submit_error(endpoint: Endpoint, **fields: object) -> grpc.RpcError:
    with grpc.insecure_channel(endpoint.grpc_target) as channel, pytest.raises(grpc.RpcError) as info:
        pb_grpc.ControlStub(channel).Submit(pb.SubmitRequest(**fields), timeout=10)  # type: ignore[arg-type]
    return info.value


def _assert_rejected(error: grpc.RpcError, *words: str) -> None:
    details = error.details() or ""
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (error.code(), details[:200])
    assert len(details) < MAX_DETAILS_CHARS
    for word in words:
        assert word in details, details


def _start(**fields: object) -> pb.BubbleEvent:
    values: dict[str, object] = {"start_ns": time.monotonic_ns(), "predicted_ns": 1_000_000, "kind": "test"}
    values.update(fields)
    return pb.BubbleEvent(start=pb.BubbleStart(**values))  # type: ignore[arg-type]


def _stream(endpoint: Endpoint, events: list[pb.BubbleEvent]) -> pb.StreamSummary:
    with grpc.insecure_channel(endpoint.grpc_target) as channel:
        return pb_grpc.TrainerStub(channel).StreamBubbles(iter(events), timeout=10)


def test_target_with_a_trailing_newline_is_a_bad_reference(harness: ManagerHarness) -> None:
    # The pattern ended in "$", which also matches before a final newline.
    _assert_rejected(_submit_error(harness.endpoint, target="os:system\n", memory_bytes=1), "bad task reference")
    _assert_rejected(_submit_error(harness.endpoint, target="a" * 300 + ":B", memory_bytes=1), "at most 256")


def test_deeply_nested_args_are_invalid_argument_not_a_recursion_error(harness: ManagerHarness) -> None:
    # Nesting beyond the recursion limit broke json.loads; a few hundred levels broke the store's
    # dataclasses.asdict later, on the loop thread. Both came back as UNKNOWN.
    for depth in (16_000, 500, 33):  # 16k levels fit the size limit and still exceed the recursion limit
        error = _submit_error(harness.endpoint, target="a:B", memory_bytes=1,
                              args_json='{"a": ' + "[" * depth + "]" * depth + "}")
        _assert_rejected(error, "task arguments", "nest deeper")
    assert harness.client.list() == []


def test_integer_with_too_many_digits_is_invalid_argument_not_unknown(harness: ManagerHarness) -> None:
    # int() refuses more than 4300 digits with a ValueError that json.loads lets through.
    error = _submit_error(harness.endpoint, target="a:B", memory_bytes=1, args_json='{"a": ' + "9" * 5000 + "}")
    _assert_rejected(error, "task arguments", "too large")


@pytest.mark.parametrize("text", ['{"a": NaN}', '{"a": -Infinity}', '{"a": 1e400}'])
def test_non_finite_numbers_in_args_are_rejected(harness: ManagerHarness, text: str) -> None:
    _assert_rejected(_submit_error(harness.endpoint, target="a:B", memory_bytes=1, args_json=text), "task arguments")


def test_args_too_large_for_the_worker_channel_are_rejected_at_submit(harness: ManagerHarness) -> None:
    # Up to 256 KiB was accepted, but the worker's init message holds 64 KiB: the task then sat in
    # STARTING for good. Escaped characters count as encoded: 8 Ki astral characters are 96 KiB.
    for args in ({"a": "x" * 100_000}, {"a": "\U0001F600" * 8192}):
        text = json.dumps(args, ensure_ascii=False)
        error = _submit_error(harness.endpoint, target="a:B", memory_bytes=1, args_json=text)
        _assert_rejected(error, "task arguments", str(MAX_ARGS_JSON_BYTES))
    assert harness.client.list() == []


def test_task_whose_init_cannot_be_sent_fails_instead_of_hanging_in_starting(harness: ManagerHarness) -> None:
    # Bypass validation (as a future field or a bug would) with arguments over the channel's limit.
    spec = TaskSpec(target="sample_tasks:Counter", args={"pad": "x" * 100_000}, memory_bytes=64 * 2**20,
                    working_dir=str(TESTS_DIR))
    info = harness.manager.loop.call(L.SubmitTask(spec))
    final = harness.wait_state(info.task_id, "FAILED", timeout_s=30)
    assert final.failure is not None and final.failure.kind == "SPAWN"
    assert "exceeds" in final.failure.message
    assert harness.client.stats().device == DEVICE


@pytest.mark.parametrize(
    ("fields", "word"),
    [
        ({"target": "a:B", "memory_bytes": 1, "working_dir": "/x" * 1_000_000}, "working directory"),
        ({"target": "a:B", "memory_bytes": 1, "working_dir": "/nope" + "\x01" * 3000}, "working directory"),
        ({"target": "a" * 2_000_000 + ":B", "memory_bytes": 1}, "task reference"),
        ({"target": "a:B", "memory_bytes": 1, "args_json": "{" * 100_000}, "task arguments"),
    ],
)
def test_huge_value_gets_invalid_argument_not_a_trailer_overflow(
    harness: ManagerHarness, fields: dict[str, object], word: str
) -> None:
    # The error echoed the whole value; over 16 KiB of details, the client saw RESOURCE_EXHAUSTED
    # ("received metadata size exceeds hard limit") instead of the reason.
    _assert_rejected(_submit_error(harness.endpoint, **fields), word)


@pytest.mark.parametrize("method", ["Get", "Cancel"])
def test_huge_or_empty_task_id_gets_a_bounded_invalid_argument(harness: ManagerHarness, method: str) -> None:
    request = pb.GetRequest if method == "Get" else pb.CancelRequest
    with grpc.insecure_channel(harness.endpoint.grpc_target) as channel:
        call = getattr(pb_grpc.ControlStub(channel), method)
        for task_id, word in (("x" * 3_000_000, "at most"), ("", "give a task id")):
            with pytest.raises(grpc.RpcError) as info:
                call(request(task_id=task_id), timeout=10)
            _assert_rejected(info.value, word)


def test_bubble_kind_with_terminal_escapes_is_rejected(harness: ManagerHarness) -> None:
    # `freeride bubbles` prints the kind: escape sequences would reach the user's terminal.
    summary = _stream(harness.endpoint, [_start(kind="\x1b[2J\x1b[31mred"), _start(kind="tab\there")])
    assert (summary.accepted, summary.rejected) == (0, 2)
    assert "kind" in summary.last_error and "printable" in summary.last_error


def test_bubble_times_ahead_of_the_host_clock_are_rejected(harness: ManagerHarness) -> None:
    # A start or end far ahead of CLOCK_MONOTONIC (another host's clock, microseconds sent as
    # nanoseconds * 1000) held a grant open, or delayed the freeze of an overrunning task, until then.
    ahead = time.monotonic_ns() + 3600 * 10**9
    summary = _stream(harness.endpoint, [_start(start_ns=ahead)])
    assert summary.rejected == 1 and "start_ns" in summary.last_error and "ahead" in summary.last_error
    summary = _stream(harness.endpoint, [pb.BubbleEvent(end=pb.BubbleEnd(end_ns=2**63 - 1))])
    assert summary.rejected == 1 and "end_ns" in summary.last_error
    # A time just taken is never ahead.
    assert _stream(harness.endpoint, [_start(start_ns=time.monotonic_ns())]).accepted == 1


def test_listing_many_large_tasks_still_answers(make_manager: object) -> None:
    # 17 tasks with 250 KiB of arguments each made every List exceed 4 MiB, for good.
    h: ManagerHarness = make_manager(headroom_bytes=2**62)  # type: ignore[operator]
    big = {"a": "x" * (MAX_ARGS_JSON_BYTES - 100)}
    count = MAX_MESSAGE_BYTES // MAX_ARGS_JSON_BYTES + 8
    ids = [h.client.submit(TaskSpec(target="a:B", args=big, memory_bytes=2**20)).task_id for _ in range(count)]
    listed = h.client.list()
    assert [t.task_id for t in listed] == ids
    assert all(t.spec.args == {} for t in listed)  # summaries: the arguments are left out
    assert h.client.get(ids[0]).spec.args == big  # Get still has them


def test_bubbles_of_ever_new_slots_do_not_grow_the_slot_table(make_manager: object) -> None:
    h: ManagerHarness = make_manager(max_slots=16)  # type: ignore[operator]
    now = time.monotonic_ns()
    events = [_start(stage=i, slot=i, start_ns=now) for i in range(40)]
    assert _stream(h.endpoint, events).accepted == 40
    wait_for(lambda: h.client.stats().bubbles == 40)
    assert len(h.client.bubbles()) == 16


#: Every method the manager serves, with whether it streams requests and responses.
_METHODS = [
    (f"/{service.full_name}/{method.name}", method.client_streaming, method.server_streaming)
    for module, name in ((pb, "Trainer"), (pb, "Control"), (health_pb2, "Health"))
    for service in (module.DESCRIPTOR.services_by_name[name],)
    for method in service.methods
]


def _raw_call(channel: grpc.Channel, path: str, client_streaming: bool, server_streaming: bool,
              raw: bytes) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        if client_streaming:
            stream_unary = channel.stream_unary(path, request_serializer=None, response_deserializer=None)
            stream_unary(iter([raw]), timeout=10)
        elif server_streaming:
            list(channel.unary_stream(path, request_serializer=None, response_deserializer=None)(raw, timeout=10))
        else:
            channel.unary_unary(path, request_serializer=None, response_deserializer=None)(raw, timeout=10)
    return info.value


@pytest.mark.parametrize(("path", "client_streaming", "server_streaming"), _METHODS)
def test_undecodable_request_is_invalid_argument_not_internal(
    harness: ManagerHarness, path: str, client_streaming: bool, server_streaming: bool,
) -> None:
    # gRPC's own deserialiser answered INTERNAL "Exception deserializing request!" (issue 13).
    with grpc.insecure_channel(harness.endpoint.grpc_target) as channel:
        # Not protobuf at all; a length that runs past the end; 100 KB of an endless varint.
        for raw in (b"\xff\xff\xff\xff", b"\x0a\xff\xff\x03" + b"x" * 10, b"\xff" * 100_000):
            error = _raw_call(channel, path, client_streaming, server_streaming, raw)
            _assert_rejected(error, "is not a valid", f"({len(raw)} bytes)")


def test_undecodable_requests_leave_no_call_state_behind(harness: ManagerHarness) -> None:
    # Each undecodable request left its call's state in gRPC for good (4-19 KiB): any client could grow
    # the manager without bound (issue 13). Counted as objects, not as RSS: exact, and timing-free.
    from grpc._server import _RPCState

    def call_states() -> int:
        gc.collect()
        return sum(1 for obj in gc.get_objects() if type(obj) is _RPCState)

    with grpc.insecure_channel(harness.endpoint.grpc_target) as channel:
        for path, client_streaming, server_streaming in _METHODS * 2:  # warm every path first
            _raw_call(channel, path, client_streaming, server_streaming, b"\xff\xff")
        before = call_states()
        for _ in range(10):
            for path, client_streaming, server_streaming in _METHODS:
                _raw_call(channel, path, client_streaming, server_streaming, b"\xff\xff")
        wait_for(lambda: call_states() <= before + 2, timeout_s=10, what="the refused calls' state to be freed")
    assert harness.client.stats().events_received == 0  # and the bytes never reached the loop
