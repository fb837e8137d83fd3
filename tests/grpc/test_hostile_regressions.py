"""Regression tests for what hostile input broke, each named after the failure it pins down.

Found by the property tests in ``test_hostile.py`` and by probing the real server with the raw
generated stubs (the friendly client refuses most of these inputs before they are sent).
"""

from __future__ import annotations

import json
import time

import grpc
import pytest
from conftest import TESTS_DIR, ManagerHarness, wait_for

from freeride._manager import loop as L
from freeride._manager.servicers import MAX_ARGS_JSON_BYTES
from freeride._wire import freeride_pb2 as pb
from freeride._wire import freeride_pb2_grpc as pb_grpc
from freeride.endpoints import MAX_MESSAGE_BYTES, Endpoint
from freeride.messages import TaskSpec

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
