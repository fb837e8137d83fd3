"""Validation of a task submission: the one check shared by every way a task comes in; and task ids.

Plain data in (:class:`Submission`, the fields of a ``SubmitRequest`` as they travel), a
:class:`~freeride.messages.TaskSpec` out, or :class:`~freeride.errors.RequestRejected` with a
precise message that echoes at most 80 characters of the input. No protobuf here: the manager's
servicer converts its request at the protocol edge and calls :func:`validate_submission`;
``freeride submit --queue`` calls :func:`validate_spec` before a task reaches the cluster queue.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any

from freeride._loading import check_target, check_target_syntax
from freeride.errors import ConfigError, RequestRejected
from freeride.messages import TaskSpec
from freeride.units import format_size

#: Limits on what a submission may carry. The worker receives the task's arguments, command and
#: working directory in one message over a channel that holds at most 64 KiB
#: (``freeride._channel.MAX_MESSAGE_BYTES``), so these, measured as they are encoded for that
#: channel, sum to well under it: a task that passed validation can always be started.
MAX_ARGS_JSON_BYTES = 32 * 1024
MAX_ARGS_DEPTH = 32
MAX_COMMAND_ARGS = 1024
MAX_COMMAND_BYTES = 16 * 1024
MAX_WORKING_DIR_BYTES = 4096
MAX_PRIORITY = 1_000_000
#: The smallest memory cap a task can run in. On a CPU core a cap covers what ``setup`` and the steps
#: add to the worker's resident set, which grows by pages and by allocator arenas (CPython's are 1 MiB):
#: under 1 MiB a task fails with MEMORY_LIMIT at its first allocation. On a GPU a cap also covers the
#: CUDA context, hundreds of MiB, which the manager checks once a worker has measured it there.
MIN_MEMORY_BYTES = 2**20
#: Longest echo of a client's value in an error message: details travel in gRPC trailers, which a
#: client refuses beyond 16 KiB, so echoing a 4 MiB value would hide the error behind another one.
_ECHO_CHARS = 80


#: What every task id a manager or the cluster queue makes looks like: safe as a directory name.
TASK_ID_RE = re.compile(r"[a-z0-9][a-z0-9-]*")


def slug(text: str) -> str:
    """A task id's stem, made from its name: ``[a-z0-9-]``, at most 32 characters, never empty."""
    slug = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    return slug[:32] or "task"


def shown(value: object) -> str:
    """``repr(value)``, cut to a length that fits any error message."""
    text = repr(value)
    return text if len(text) <= _ECHO_CHARS else f"{text[:_ECHO_CHARS - 3]}..."


@dataclass(frozen=True)
class Submission:
    """A submission's fields as they travel: the arguments still JSON text, nothing checked yet."""

    target: str = ""
    args_json: str = ""
    memory_bytes: int = 0
    priority: int = 0
    name: str = ""
    command: tuple[str, ...] = ()
    working_dir: str = ""
    checkpoint_interval_s: float = 0.0
    step_time_hint_ms: float = 0.0


def _encoded_len(value: object) -> int:
    """Bytes ``value`` takes in the worker channel's JSON (ASCII-escaped, so never less than its length)."""
    return len(json.dumps(value, separators=(",", ":")))


def _reject_constant(name: str) -> Any:
    raise RequestRejected(f"task arguments must be standard JSON: {name} is not a JSON value")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise RequestRejected(f"task arguments hold a number that overflows a float: {shown(text)}")
    return value


def _depth(value: Any) -> int:
    """Nesting depth of parsed JSON, without recursion (a hostile value must not exhaust the stack)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
    return deepest


def parse_args_json(text: str) -> dict[str, Any]:
    """The task's keyword arguments: a JSON object of identifiers, bounded in size and depth.

    Rejected with a precise message, never with an internal error: nesting deeper than Python's
    recursion limit, integers beyond ``int``'s string-conversion limit (4300 digits), ``NaN`` and
    ``Infinity`` (not JSON, and not portable to the CLI's ``--json`` output), floats that overflow.
    """
    if not text:
        return {}
    if len(text) > MAX_ARGS_JSON_BYTES:
        raise RequestRejected(f"task arguments exceed {MAX_ARGS_JSON_BYTES} bytes ({len(text)} characters)")
    try:
        args = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except json.JSONDecodeError as exc:
        raise RequestRejected(f"task arguments are not valid JSON: {exc}") from None
    except RecursionError:
        raise RequestRejected(f"task arguments nest deeper than {MAX_ARGS_DEPTH} levels") from None
    except ValueError as exc:  # int() refuses more than sys.get_int_max_str_digits() digits
        raise RequestRejected(f"task arguments hold a number that is too large: {shown(str(exc))}") from None
    if not isinstance(args, dict) or not all(isinstance(k, str) and k.isidentifier() for k in args):
        raise RequestRejected("task arguments must be a JSON object whose keys are Python identifiers")
    if _depth(args) > MAX_ARGS_DEPTH:
        raise RequestRejected(f"task arguments nest deeper than {MAX_ARGS_DEPTH} levels")
    encoded = _encoded_len(args)
    if encoded > MAX_ARGS_JSON_BYTES:
        raise RequestRejected(
            f"task arguments exceed {MAX_ARGS_JSON_BYTES} bytes once encoded for the worker ({encoded} bytes)"
        )
    return args


def _check_command(command: tuple[str, ...]) -> None:
    if len(command) > MAX_COMMAND_ARGS:
        raise RequestRejected(f"a command has at most {MAX_COMMAND_ARGS} arguments, got {len(command)}")
    for arg in command:
        if not arg or "\x00" in arg:
            raise RequestRejected("command arguments must be non-empty and contain no NUL byte")
    encoded = _encoded_len(command)
    if encoded > MAX_COMMAND_BYTES:
        raise RequestRejected(f"a command takes at most {MAX_COMMAND_BYTES} bytes encoded, got {encoded}")


def _check_working_dir(path: str) -> None:
    """An existing absolute directory. ``..`` is allowed: the kernel resolves it, and the directory
    only says where the user's own code runs; it grants nothing the submitter does not have."""
    if not path:
        return
    if "\x00" in path:
        raise RequestRejected("working directory contains a NUL byte")
    if _encoded_len(path) > MAX_WORKING_DIR_BYTES:
        raise RequestRejected(f"working directory is longer than {MAX_WORKING_DIR_BYTES} bytes")
    if not os.path.isabs(path) or not os.path.isdir(path):
        raise RequestRejected(f"working directory {shown(path)} is not an existing absolute path")


def validate_submission(sub: Submission) -> TaskSpec:
    """Validate a submission as it came in; raises :class:`RequestRejected` with a precise message.

    The one check every way into freeride goes through: the manager's ``Submit`` (from its protobuf
    request) and ``freeride submit --queue`` (before the task is put on the cluster queue), and a
    manager again when it claims a task from the queue, whose record anyone with access to Redis
    could have written.
    """
    try:
        return _validate(sub)
    except ConfigError as exc:
        raise RequestRejected(str(exc)) from None


def validate_spec(spec: TaskSpec) -> TaskSpec:
    """:func:`validate_submission` of a spec built locally (its arguments encoded as a client sends them)."""
    return validate_submission(submission_of(spec))


def checked_spec(spec: TaskSpec) -> TaskSpec:
    """``spec`` checked in this process as ``freeride submit`` checks a submission
    (``ControlClient.submit(check=True)``): its class loads (from ``working_dir`` first, else the current
    directory), takes its arguments, and a cap of 0 becomes the class's memory estimate; then the manager's
    own checks. The spec to send, with its cap and working directory filled in."""
    working_dir = os.path.abspath(spec.working_dir or os.getcwd())
    memory_bytes = spec.memory_bytes
    if memory_bytes:
        check_memory(memory_bytes)  # before the task's module is imported, which may take seconds
    estimate = check_target(spec.target, dict(spec.args), working_dir) if spec.target else None
    if not memory_bytes:
        if not estimate:
            what = "a command" if spec.command else f"{spec.target or 'a task'} has no memory estimate; it"
            raise ConfigError(f"{what} needs a memory cap: set memory_bytes, e.g. 2 * 2**30")
        memory_bytes = estimate
    return validate_spec(dataclasses.replace(spec, memory_bytes=memory_bytes, working_dir=working_dir))


def submission_of(spec: TaskSpec) -> Submission:
    """The wire form of ``spec``: its arguments as the JSON text a client sends."""
    return Submission(
        target=spec.target,
        args_json=json.dumps(spec.args),
        memory_bytes=spec.memory_bytes,
        priority=spec.priority,
        name=spec.name,
        command=tuple(spec.command),
        working_dir=spec.working_dir,
        checkpoint_interval_s=spec.checkpoint_interval_s,
        step_time_hint_ms=spec.step_time_hint_ms,
    )


def check_memory(memory_bytes: int) -> None:
    """RequestRejected unless a task can run in a cap of ``memory_bytes`` (see :data:`MIN_MEMORY_BYTES`)."""
    if memory_bytes < MIN_MEMORY_BYTES:
        raise RequestRejected(f"memory {format_size(memory_bytes) if memory_bytes > 0 else memory_bytes} is below "
                              f"what a task can run in: at least {format_size(MIN_MEMORY_BYTES)} (a cap covers what "
                              "the task allocates, e.g. --memory 64MiB)")


def _validate(msg: Submission) -> TaskSpec:
    target = msg.target
    command = tuple(msg.command)
    if bool(target) == bool(command):
        raise RequestRejected("give exactly one of a task target (module:Class) or a command")
    if target:
        check_target_syntax(target)
    _check_command(command)
    args = parse_args_json(msg.args_json)
    if abs(msg.priority) > MAX_PRIORITY:
        raise RequestRejected(f"priority must be within +-{MAX_PRIORITY}, got {msg.priority}")
    if len(msg.name) > 64:
        raise RequestRejected(f"a task name has at most 64 characters, got {len(msg.name)}")
    if not msg.name.isprintable():
        bad = next(ch for ch in msg.name if not ch.isprintable())
        raise RequestRejected(f"a task name has only printable characters, got {bad!r} in {msg.name!r}")
    _check_working_dir(msg.working_dir)
    for name in ("checkpoint_interval_s", "step_time_hint_ms"):
        value = getattr(msg, name)
        if not math.isfinite(value) or value < 0 or value > 1e7:
            raise RequestRejected(f"{name} must be a finite number in [0, 1e7], got {value}")
    check_memory(msg.memory_bytes)
    return TaskSpec(
        target=target,
        args=args,
        memory_bytes=msg.memory_bytes,
        priority=msg.priority,
        name=msg.name,
        command=command,
        working_dir=msg.working_dir,
        checkpoint_interval_s=msg.checkpoint_interval_s,
        step_time_hint_ms=msg.step_time_hint_ms,
    )
