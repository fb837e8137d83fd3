"""The private manager <-> worker channel: typed messages over a SOCK_SEQPACKET socketpair.

Every message that crosses it is a frozen dataclass of this module, and both processes import it:
the manager sends :class:`Init`, :class:`Grant`, :class:`Park` and :class:`Stop`; a worker sends
:class:`Ready`, :class:`Parked`, :class:`Checkpointed`, :class:`CheckpointFailed`,
:class:`Finished`, :class:`Failed`, :class:`ProcessGroup` and :class:`Bye`. :func:`encode` is the
one encoder and :func:`decode` the one decoder: it checks the tag against what the receiving side
accepts and every field's presence and type, so a message that is not exactly one of these
(garbage, a wrong type in a field, a missing field, an unknown or misdirected tag) raises
:class:`ProtocolError`, which the manager turns into a PROTOCOL failure of that worker's task.
What only the receiver can judge (a checkpoint path inside the task's directory, a process group
the worker could have made) is the receiver's check, raised as the same error.

On the channel a message is a JSON object tagged ``"t"``. SEQPACKET keeps message boundaries (no
framing to write), delivers in order, and reports the peer's death as end-of-file, which is how a
worker notices that its manager is gone and how the manager notices a worker that closed its
channel. JSON rather than pickle: the manager never deserialises anything executable that comes
from side-task code. Fields a worker of an earlier version did not send have defaults here.

Standard library only: the worker imports this before it has imported anything heavy.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

#: Largest message; a parked report carries at most a bounded list of step durations.
MAX_MESSAGE_BYTES = 64 * 1024
#: A byte count is a non-negative integer below this.
MAX_BYTE_COUNT = 2**63


class ChannelClosed(Exception):
    """The peer closed the channel or died."""


class ChannelFull(Exception):
    """The peer is not reading (busy in a long step, or frozen) and its buffer is full."""


class ProtocolError(Exception):
    """The peer sent something that is not a well-formed message (or a message it may not send)."""


#: Field metadata: a grant's id travels as ``g``; a byte count is an int in [0, 2**63).
_GRANT_ID = {"key": "g"}
_BYTE_COUNT = {"byte_count": True}
#: A duration that is a sum: an int in [0, 2**63), checked as a byte count is.
_NS_TOTAL = _BYTE_COUNT


# ---------------------------------------------------------------- manager -> worker


@dataclass(frozen=True)
class Init:
    """The task a new worker runs, and where; the first message on every channel."""

    TAG: ClassVar[str] = "init"
    task_id: str
    device: str
    memory_limit_bytes: int
    work_dir: str
    checkpoint_dir: str
    target: str = ""
    args: dict[str, Any] = field(default_factory=dict)
    command: tuple[str, ...] = ()
    working_dir: str = ""
    resume_path: str = ""
    checkpoint_interval_s: float = 30.0
    step_time_hint_ms: float = 0.0
    #: The worker's step and ended-grant words (:class:`freeride._boards.WorkerBoard`); "": none.
    board_file: str = ""
    #: The trainer's end board (:class:`freeride._boards.EndBoard`); "": ends come by the manager only.
    end_board: str = ""
    #: ``paper``: the reference system's admission rule, for the bench's comparison; else ours.
    admission: str = "freeride"
    #: Granted time after which a step, setup or checkpoint that has not finished has its threads' stacks
    #: written to the log (:mod:`freeride._worker.stacks`).
    stack_report_ms: float = 2000.0


@dataclass(frozen=True)
class Grant:
    """Step until ``deadline_ns`` (keeping ``margin_ns``); a newer grant supersedes an older one."""

    TAG: ClassVar[str] = "grant"
    grant_id: int = field(metadata=_GRANT_ID)
    deadline_ns: int
    margin_ns: int
    #: Forget the step estimate and run at least one step.
    probe: bool = False
    #: The bubble, (rank, start), whose end on the trainer's end board stops the grant, when
    #: ``trainer_ends`` (the grant follows the trainer's real ends).
    rank: int = -1
    bubble_start_ns: int = 0
    trainer_ends: bool = False
    #: The recent lengths of the bubble's slot, sorted: while the bubble outlives ``deadline_ns`` and its end
    #: is not known, steps are sized to ``freeride._estimator.surviving_end_ns`` of them (only when
    #: ``trainer_ends``: the worker learns the real end).
    survival_ns: tuple[int, ...] = ()
    #: The manager's grace: a step whose high-percentile time is within it is sized to the longest of
    #: ``survival_ns`` (its overrun past an end it did not see coming stays within the grace).
    grace_ns: int = 0


@dataclass(frozen=True)
class Park:
    """The grant's bubble ended early: stop after the current step."""

    TAG: ClassVar[str] = "park"
    grant_id: int = field(metadata=_GRANT_ID)


@dataclass(frozen=True)
class Stop:
    """Stop for good, writing a checkpoint first when ``checkpoint``."""

    TAG: ClassVar[str] = "stop"
    checkpoint: bool = False


# ---------------------------------------------------------------- worker -> manager


@dataclass(frozen=True)
class Ready:
    """The task is imported and constructed."""

    TAG: ClassVar[str] = "ready"
    pid: int
    progress_unit: str = "steps"
    #: The CUDA context's size (0 on a CPU core).
    context_bytes: int = field(default=0, metadata=_BYTE_COUNT)
    #: What the cap does not cover: on a CPU core, the interpreter's and the libraries' resident set.
    baseline_bytes: int = field(default=0, metadata=_BYTE_COUNT)
    #: On a GPU, the worker's host resident set once the task is constructed (the host cap's baseline).
    host_baseline_bytes: int = field(default=0, metadata=_BYTE_COUNT)


@dataclass(frozen=True)
class Parked:
    """A grant is over: what ran in it. ``durations_ns`` and ``starts_ns`` are the last steps' (bounded)."""

    TAG: ClassVar[str] = "parked"
    grant_id: int = field(metadata=_GRANT_ID)
    steps: int
    durations_ns: tuple[int, ...]
    first_step_ns: int  # 0: no step ran in this grant, or its latency is not measured
    last_end_ns: int
    parked_ns: int
    #: "deadline", "park", "ended", "stop", "done"; "frozen": the steps of a grant a freeze ended, sent
    #: when the next grant thaws the worker (the manager counts them and changes no state).
    reason: str
    progress: float
    total_steps: int
    #: Each step's start; a worker of an earlier version sends none (its grant then has no spans).
    starts_ns: tuple[int, ...] = ()
    #: Leading durations that are no step-time samples (the process's first step).
    warmup_steps: int = 0
    #: ``ended``: the trainer's end of the bubble, read on the end board before the manager knew of it.
    end_ns: int = 0
    #: The worker process's CPU time (``CLOCK_PROCESS_CPUTIME_ID``) when its last listed step began; 0
    #: without one. With the CPU time the manager reads at a freeze it bounds what ran past a bubble's end.
    last_start_cpu_ns: int = 0
    #: The listed steps' costs, where they differ from ``durations_ns``: each less what the step waited for
    #: the device (a CPU core the trainer or the manager had). Step-time estimates learn these; a worker
    #: of an earlier version, or one whose steps never waited, sends none (the durations are the costs).
    costs_ns: tuple[int, ...] = ()
    #: Every step's cost in the grant, summed (the lists above keep only the last ones): the grant's harvested
    #: time. 0 from a worker of an earlier version: the manager sums the listed durations.
    worked_ns: int = field(default=0, metadata=_NS_TOTAL)


@dataclass(frozen=True)
class Usage:
    """What the device holds for the worker, as the worker measures it, sent right after a ``parked``.

    Apart from the report, so that measuring (on CUDA, NVML's process list: a driver call of a millisecond
    or so) never delays a park: the manager freezes a worker still ``RUNNING`` half a millisecond past the
    bubble's end. A worker whose device leaves the count to the manager (a CPU core) sends none."""

    TAG: ClassVar[str] = "usage"
    device_bytes: int = field(metadata=_BYTE_COUNT)


@dataclass(frozen=True)
class Checkpointed:
    """A checkpoint of ``step`` is on disk at ``path``."""

    TAG: ClassVar[str] = "checkpoint"
    step: int
    path: str
    progress: float


@dataclass(frozen=True)
class CheckpointFailed:
    """The disk refused a checkpoint; the last written one stands and the worker tries again later."""

    TAG: ClassVar[str] = "checkpoint_failed"
    step: int
    error: str


@dataclass(frozen=True)
class Finished:
    """The task is done."""

    TAG: ClassVar[str] = "finished"
    total_steps: int
    progress: float


@dataclass(frozen=True)
class Failed:
    """The task failed in the worker; ``durations_ns``: the steps of the grant it failed in."""

    TAG: ClassVar[str] = "failed"
    kind: str
    message: str
    traceback: str = ""
    step: int = -1
    total_steps: int = -1
    progress: float = -1.0  # -1: not reported
    durations_ns: tuple[int, ...] = ()
    #: Every step's cost in that grant, summed (as ``Parked.worked_ns``); 0: the manager sums the durations.
    worked_ns: int = field(default=0, metadata=_NS_TOTAL)


@dataclass(frozen=True)
class ProcessGroup:
    """A command task's own process group: the manager freezes and kills it with the worker."""

    TAG: ClassVar[str] = "pgroup"
    pgid: int


@dataclass(frozen=True)
class Bye:
    """The worker is about to exit: the end-of-file that follows is no protocol violation."""

    TAG: ClassVar[str] = "bye"
    code: int = 0


ManagerMessage = Init | Grant | Park | Stop
WorkerMessage = Ready | Parked | Usage | Checkpointed | CheckpointFailed | Finished | Failed | ProcessGroup | Bye
Message = ManagerMessage | WorkerMessage

MANAGER_MESSAGES: tuple[type[Any], ...] = (Init, Grant, Park, Stop)
WORKER_MESSAGES: tuple[type[Any], ...] = (Ready, Parked, Usage, Checkpointed, CheckpointFailed, Finished,
                                          Failed, ProcessGroup, Bye)


# ---------------------------------------------------------------- the codec


def _check_int(value: Any) -> int:
    if type(value) is not int:  # bool is an int to Python, not to this protocol
        raise TypeError(f"expected an integer, got {_shown(value)}")
    return value


def _check_float(value: Any) -> float:
    if type(value) is float:
        return value
    if type(value) is int:  # JSON writes 2.0 as 2.0, but a peer may well send 2
        return float(value)
    raise TypeError(f"expected a number, got {_shown(value)}")


def _check_str(value: Any) -> str:
    if type(value) is not str:
        raise TypeError(f"expected a string, got {_shown(value)}")
    return value


def _check_bool(value: Any) -> bool:
    if type(value) is not bool:
        raise TypeError(f"expected true or false, got {_shown(value)}")
    return value


def _check_ints(value: Any) -> tuple[int, ...]:
    if type(value) is not list or any(type(v) is not int for v in value):
        raise TypeError(f"expected a list of integers, got {_shown(value)}")
    return tuple(value)


def _check_strs(value: Any) -> tuple[str, ...]:
    if type(value) is not list or any(type(v) is not str for v in value):
        raise TypeError(f"expected a list of strings, got {_shown(value)}")
    return tuple(value)


def _check_object(value: Any) -> dict[str, Any]:
    if type(value) is not dict:
        raise TypeError(f"expected an object, got {_shown(value)}")
    return value


def _check_bytes(value: Any) -> int:
    if type(value) is not int or not 0 <= value < MAX_BYTE_COUNT:
        raise TypeError(f"expected a byte count (an integer in [0, 2**63)), got {_shown(value)}")
    return value


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


_CHECKS: dict[Any, Callable[[Any], Any]] = {
    int: _check_int,
    float: _check_float,
    str: _check_str,
    bool: _check_bool,
    tuple[int, ...]: _check_ints,
    tuple[str, ...]: _check_strs,
    dict[str, Any]: _check_object,
}


_MISSING = object()
#: Field types whose values pass as they come (the common case, checked with one comparison); others go
#: through their check function (which also turns a whole number into a float).
_AS_IS = (int, float, str, bool)

#: (attribute, key on the channel, the type a value passes as, else None; its check; required?)
_Field = tuple[str, str, Any, Callable[[Any], Any], bool]


def _fields_of(cls: type[Any]) -> tuple[_Field, ...]:
    hints = typing.get_type_hints(cls)
    table = []
    for f in dataclasses.fields(cls):
        byte_count = bool(f.metadata.get("byte_count"))
        check = _check_bytes if byte_count else _CHECKS[hints[f.name]]
        as_is = hints[f.name] if hints[f.name] in _AS_IS and not byte_count else None
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        table.append((f.name, f.metadata.get("key", f.name), as_is, check, required))
    return tuple(table)


#: tag -> (class, its fields), for every message.
_TABLE: dict[str, tuple[type[Any], tuple[_Field, ...]]] = {
    cls.TAG: (cls, _fields_of(cls)) for cls in (*MANAGER_MESSAGES, *WORKER_MESSAGES)
}
#: class -> ((attribute, key) of each field), for the encoder.
_KEYS: dict[type[Any], tuple[tuple[str, str], ...]] = {
    cls: tuple((attr, key) for attr, key, _, _, _ in fields) for cls, fields in _TABLE.values()
}


def encode(message: Message) -> bytes:
    """The message as it travels: a compact JSON object tagged ``"t"``."""
    data: dict[str, Any] = {"t": message.TAG}
    for attr, key in _KEYS[type(message)]:
        data[key] = getattr(message, attr)
    return json.dumps(data, separators=(",", ":"), allow_nan=False).encode()


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number this protocol carries")


def decode(data: bytes, accepted: tuple[type[Any], ...]) -> Message:
    """The message ``data`` holds, if it is a well-formed one of the ``accepted`` classes.

    Raises :class:`ProtocolError` saying what is wrong: bytes that are no JSON object, a missing or
    unknown tag, a tag the receiver does not accept, a missing field or one of the wrong type.
    Fields not named by the message class are ignored (a newer peer may add some).
    """
    try:
        # NaN and the infinities are no JSON: a NaN progress reached the manager's store, which refused it
        # and took the manager down.
        raw = json.loads(data, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:  # not JSON, an integer of 4,300+ digits, nesting too deep
        raise ProtocolError(f"malformed message: {type(exc).__name__}: {_shown(str(exc))}") from None
    if type(raw) is not dict or type(raw.get("t")) is not str:
        raise ProtocolError("message is not an object with a type field 't'")
    tag = raw["t"]
    entry = _TABLE.get(tag)
    if entry is None:
        raise ProtocolError(f"unknown message type {_shown(tag)}")
    if entry[0] not in accepted:
        raise ProtocolError(f"a {tag!r} message is not one this peer may send")
    cls, fields = entry
    values: dict[str, Any] = {}
    for attr, key, as_is, check, required in fields:
        value = raw.get(key, _MISSING)
        if value is _MISSING:
            if required:
                raise ProtocolError(f"malformed {tag!r}: field {key!r} is missing")
            continue
        if type(value) is not as_is:  # bool is no int here: type(), not isinstance()
            try:
                value = check(value)
            except TypeError as exc:
                raise ProtocolError(f"malformed {tag!r}: field {key!r}: {exc}") from None
        values[attr] = value
    message: Message = cls(**values)
    return message


# ---------------------------------------------------------------- the channel


def socketpair() -> tuple[socket.socket, socket.socket]:
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)


class Channel:
    """One end of the channel: sends any message, receives only those of ``accepts``.

    The manager's end accepts :data:`WORKER_MESSAGES` (the default) and a worker's end
    :data:`MANAGER_MESSAGES`.
    """

    def __init__(self, sock: socket.socket, accepts: tuple[type[Any], ...] = WORKER_MESSAGES) -> None:
        self.sock = sock
        self.accepts = accepts

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, message: Message) -> None:
        data = encode(message)
        if len(data) > MAX_MESSAGE_BYTES:
            raise ProtocolError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
        try:
            self.sock.send(data)
        except BlockingIOError:
            raise ChannelFull(f"peer's buffer is full; dropped a {message.TAG!r} message") from None
        except OSError as exc:
            raise ChannelClosed(str(exc)) from None

    def _decode(self, data: bytes) -> Message:
        if not data:
            raise ChannelClosed("peer closed the channel")
        return decode(data, self.accepts)

    def recv(self, timeout_s: float | None = None) -> Message | None:
        """The next message; None if ``timeout_s`` passed first. Raises ChannelClosed at EOF."""
        self.sock.settimeout(timeout_s)
        try:
            data = self.sock.recv(MAX_MESSAGE_BYTES)
        except TimeoutError:
            return None
        except ConnectionResetError:
            data = self._after_reset()
        except OSError as exc:
            raise ChannelClosed(str(exc)) from None
        return self._decode(data)

    def recv_nowait(self) -> Message | None:
        try:
            data = self.sock.recv(MAX_MESSAGE_BYTES, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return None
        except ConnectionResetError:
            data = self._after_reset()
        except OSError as exc:
            raise ChannelClosed(str(exc)) from None
        return self._decode(data)

    def _after_reset(self) -> bytes:
        """What the peer sent before it closed with messages of ours unread. Linux reports that once, as
        ECONNRESET, *ahead* of the messages still queued here: a worker frozen past grants it never read, then
        done, exited after its ``finished``, and taking the reset for the end lost that message (the task, all
        its work done, was FAILED "exited with code 0 without reporting an error"). Read on: the queued
        messages, then the end (b"")."""
        try:
            return self.sock.recv(MAX_MESSAGE_BYTES, socket.MSG_DONTWAIT)
        except OSError as exc:  # nothing queued and no end seen (cannot be after a reset): closed all the same
            raise ChannelClosed(str(exc)) from None

    def close(self) -> None:
        self.sock.close()
