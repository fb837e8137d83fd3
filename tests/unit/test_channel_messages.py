"""The worker <-> manager messages: one encoder, one validating decoder, both sides of the channel.

Every message round-trips exactly; anything else a peer could send (garbage, a wrong type in a
field, a missing field, an unknown tag, a message meant for the other side) is a ProtocolError
that says what is wrong, never another exception: the manager turns exactly that error into a
PROTOCOL failure of the task (``tests/e2e/test_faults_e2e.py`` drives it through a real worker).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from freeride._channel import (
    MANAGER_MESSAGES,
    MAX_MESSAGE_BYTES,
    WORKER_MESSAGES,
    Bye,
    Channel,
    ChannelClosed,
    Checkpointed,
    CheckpointFailed,
    Failed,
    Finished,
    Grant,
    Init,
    Message,
    Park,
    Parked,
    ProcessGroup,
    ProtocolError,
    Ready,
    Stop,
    Usage,
    decode,
    encode,
    socketpair,
)

#: One of every message, every field away from its default.
EVERY_MESSAGE: list[Message] = [
    Init(task_id="pagerank-3", device="cuda:0", memory_limit_bytes=2**30, work_dir="/s/w", checkpoint_dir="/s/c",
         target="side_tasks.graph:PageRank", args={"n": 3, "nested": {"a": [1, 2.5, None, "x"]}},
         command=("python", "-c", "pass"), working_dir="/src", resume_path="/s/c/ckpt-4.pt",
         checkpoint_interval_s=2.5, step_time_hint_ms=1.5, board_file="/s/board", end_board="/run/x.ends",
         admission="paper"),
    Grant(7, deadline_ns=123_456_789, margin_ns=200_000, probe=True, rank=3, bubble_start_ns=99, trainer_ends=True),
    Park(7),
    Stop(checkpoint=True),
    Ready(pid=4242, progress_unit="edges", context_bytes=480 * 2**20, baseline_bytes=2**27, host_baseline_bytes=2**28),
    Parked(grant_id=7, steps=3, durations_ns=(10, 20, 30), first_step_ns=5, last_end_ns=65, parked_ns=70,
           reason="ended", progress=3.5, total_steps=40, starts_ns=(5, 15, 35), warmup_steps=1, end_ns=66,
           last_start_cpu_ns=12, costs_ns=(8, 20, 11), worked_ns=39),
    Usage(device_bytes=2**31),
    Checkpointed(step=40, path="/s/c/ckpt-40.pt", progress=0.25),
    CheckpointFailed(step=41, error="No space left on device"),
    Finished(total_steps=100, progress=1.0),
    Failed(kind="EXCEPTION", message="boom", traceback="Traceback ...", step=5, total_steps=5, progress=0.5,
           durations_ns=(1, 2), worked_ns=3),
    ProcessGroup(pgid=31337),
    Bye(code=2),
]


def test_the_list_holds_every_message_of_both_sides() -> None:
    assert {type(m) for m in EVERY_MESSAGE} == set(MANAGER_MESSAGES) | set(WORKER_MESSAGES)


@pytest.mark.parametrize("message", EVERY_MESSAGE, ids=lambda m: type(m).__name__)
def test_every_message_round_trips_exactly(message: Message) -> None:
    side = MANAGER_MESSAGES if type(message) in MANAGER_MESSAGES else WORKER_MESSAGES
    assert decode(encode(message), side) == message
    defaults = type(message)(**{f.name: getattr(message, f.name) for f in dataclasses.fields(message)
                                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING})
    assert decode(encode(defaults), side) == defaults


def test_on_the_channel_a_message_is_a_json_object_tagged_t_with_the_grant_id_as_g() -> None:
    assert json.loads(encode(Park(7))) == {"t": "park", "g": 7}
    assert json.loads(encode(Stop())) == {"t": "stop", "checkpoint": False}


def test_a_parked_report_of_an_earlier_worker_without_the_later_fields_decodes_with_their_defaults() -> None:
    legacy = {"t": "parked", "g": 1, "steps": 2, "durations_ns": [3, 4], "first_step_ns": 0, "last_end_ns": 9,
              "parked_ns": 10, "reason": "deadline", "progress": 2.0, "total_steps": 2, "added_later": "ignored",
              "device_bytes": 2**30}  # an earlier worker's memory figure: a ``usage`` of its own now
    msg = decode(json.dumps(legacy).encode(), WORKER_MESSAGES)
    assert msg == Parked(1, 2, (3, 4), 0, 9, 10, "deadline", 2.0, 2)
    assert (msg.starts_ns, msg.warmup_steps, msg.end_ns, msg.costs_ns, msg.worked_ns) == ((), 0, 0, (), 0)


def test_a_whole_number_travels_as_a_float_where_a_float_is_expected() -> None:
    msg = decode(b'{"t":"finished","total_steps":3,"progress":3}', WORKER_MESSAGES)
    assert msg == Finished(3, 3.0) and type(msg.progress) is float


MALFORMED: list[tuple[str, bytes, str]] = [
    ("garbage", b"\x00\xffnot json", "malformed message"),
    ("nesting past the parser's depth", b"[" * 60_000, "malformed message: RecursionError"),
    ("an integer past the parser's digits", b"1" * 5000, "malformed message: ValueError"),
    ("not an object", b"[1, 2]", "not an object with a type field"),
    ("no tag", b'{"g": 1}', "not an object with a type field"),
    ("a tag that is no string", b'{"t": 5}', "not an object with a type field"),
    ("an unknown tag", b'{"t": "reboot"}', "unknown message type 'reboot'"),
    ("a missing field", b'{"t": "finished", "progress": 1.0}', "field 'total_steps' is missing"),
    ("a string for an int", b'{"t": "ready", "pid": "12"}', "field 'pid': expected an integer"),
    ("a bool for an int", b'{"t": "ready", "pid": true}', "field 'pid': expected an integer"),
    ("a float for an int", b'{"t": "ready", "pid": 1.5}', "field 'pid': expected an integer"),
    ("a string for a float", b'{"t": "finished", "total_steps": 1, "progress": "1"}', "expected a number"),
    ("a number for a string", b'{"t": "failed", "kind": 1, "message": "m"}', "field 'kind': expected a string"),
    ("a list with a string", b'{"t": "failed", "kind": "K", "message": "m", "durations_ns": [1, "2"]}',
     "expected a list of integers"),
    ("a negative byte count", b'{"t": "ready", "pid": 1, "context_bytes": -1}', "expected a byte count"),
    ("a byte count past 2**63", b'{"t": "ready", "pid": 1, "baseline_bytes": 9223372036854775808}',
     "expected a byte count"),
    ("a negative harvested time", b'{"t": "failed", "kind": "K", "message": "m", "worked_ns": -5}',
     "expected a byte count"),
    ("a manager's message", b'{"t": "park", "g": 1}', "'park' message is not one this peer may send"),
    ("a NaN", b'{"t": "finished", "total_steps": 1, "progress": NaN}', "NaN is not a number this protocol"),
    ("an infinity", b'{"t": "finished", "total_steps": 1, "progress": -Infinity}', "-Infinity is not a number"),
]


@pytest.mark.parametrize(("data", "says"), [(d, s) for _, d, s in MALFORMED], ids=[n for n, _, _ in MALFORMED])
def test_a_malformed_worker_message_is_a_protocol_error_that_says_what_is_wrong(data: bytes, says: str) -> None:
    with pytest.raises(ProtocolError, match=says):
        decode(data, WORKER_MESSAGES)


def test_a_worker_refuses_a_workers_message_and_malformed_manager_messages() -> None:
    with pytest.raises(ProtocolError, match="not one this peer may send"):
        decode(encode(Bye()), MANAGER_MESSAGES)
    with pytest.raises(ProtocolError, match="'deadline_ns' is missing"):
        decode(b'{"t": "grant", "g": 1, "margin_ns": 0}', MANAGER_MESSAGES)
    with pytest.raises(ProtocolError, match="'args': expected an object"):
        decode(b'{"t": "init", "task_id": "a-1", "device": "cpu:0", "memory_limit_bytes": 1, "work_dir": "w",'
               b' "checkpoint_dir": "c", "args": [1]}', MANAGER_MESSAGES)


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
                     max_leaves=12)


@given(st.dictionaries(st.sampled_from(["t", "g", "pid", "steps", "progress", "kind", "message", "total_steps",
                                        "durations_ns", "path", "step", "pgid", "code", "error"]),
                       _JSON | st.sampled_from([m.TAG for m in WORKER_MESSAGES]), max_size=8)
       | _JSON)
def test_whatever_a_worker_sends_decodes_to_one_of_its_messages_or_is_a_protocol_error(raw: Any) -> None:
    try:
        msg = decode(json.dumps(raw).encode(), WORKER_MESSAGES)
    except ProtocolError:
        return
    assert type(msg) in WORKER_MESSAGES


def test_the_channel_carries_typed_messages_and_refuses_to_send_an_oversized_one() -> None:
    a, b = socketpair()
    manager, worker = Channel(a), Channel(b, accepts=MANAGER_MESSAGES)
    try:
        manager.send(Grant(1, deadline_ns=2, margin_ns=3))
        assert worker.recv(timeout_s=5) == Grant(1, deadline_ns=2, margin_ns=3)
        worker.send(Bye(0))
        assert manager.recv_nowait() == Bye(0)
        assert manager.recv_nowait() is None
        with pytest.raises(ProtocolError, match="exceeds"):
            worker.send(Failed(kind="EXCEPTION", message="x" * MAX_MESSAGE_BYTES))
        worker.close()
        with pytest.raises(ChannelClosed):
            manager.recv(timeout_s=5)
    finally:
        manager.close()
        worker.close()


@pytest.mark.parametrize("wait", [False, True], ids=["recv_nowait", "recv"])
def test_what_a_worker_sent_before_it_closed_with_grants_unread_is_still_read(wait: bool) -> None:
    # Stranger trial: a worker frozen past grants it never read finished, sent "finished" and exited; Linux
    # reported ECONNRESET ahead of its messages, the manager took it for the end, and the task was FAILED
    # "exited with code 0 without reporting an error".
    from freeride._channel import socketpair

    manager_end, worker_end = socketpair()
    manager, worker = Channel(manager_end), Channel(worker_end, accepts=MANAGER_MESSAGES)
    manager.send(Grant(7, 10**12, 0))  # never read
    worker.send(Finished(total_steps=3, progress=3.0))
    worker.send(Bye(code=0))
    worker_end.close()

    def receive() -> Any:
        return manager.recv(1.0) if wait else manager.recv_nowait()

    assert receive() == Finished(total_steps=3, progress=3.0)
    assert receive() == Bye(code=0)
    with pytest.raises(ChannelClosed):
        receive()
    manager_end.close()
