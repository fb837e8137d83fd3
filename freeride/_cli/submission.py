"""What ``freeride submit`` (and ``run-task``) check before anything is sent or run.

    --arg key=value       a JSON value when it parses; text otherwise, unless it looks like JSON
    --args-json '{...}'   all arguments as one JSON object (``--arg`` wins over it)

A submission is checked here: the class loads from the current directory, its constructor takes the
arguments and accepts their values (it is built once and dropped: the writing guide asks constructors
to be cheap and to check their inputs, so a missing data file is refused now, not at the first bubble),
and the memory cap is known (``--memory``, else the class's ``estimate_memory(**args)``) and is one a
worker can run in (:func:`freeride._validation.validate_spec`, the manager's own check).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

from freeride._loading import check_target, exit_raises
from freeride._validation import check_memory, validate_spec
from freeride.errors import ConfigError
from freeride.messages import TaskSpec
from freeride.units import parse_size

#: A value that starts like a JSON array, object or string is meant as JSON: one that does not parse is
#: a typo (``k=[1,2``), not text.
_JSON_OPENERS = ("[", "{", '"')


def parse_task_args(pairs: Sequence[str], args_json: str | None) -> dict[str, Any]:
    """Constructor arguments from ``--args-json`` and ``--arg key=value`` (the latter win)."""
    result: dict[str, Any] = {}
    if args_json is not None:
        try:
            loaded = json.loads(args_json)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--args-json is not valid JSON: {exc}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"--args-json must be a JSON object, got {type(loaded).__name__}")
        result.update(loaded)
    for pair in pairs:
        key, sep, text = pair.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise ConfigError(f"bad --arg {pair!r}: expected key=value with a Python identifier as key")
        try:
            result[key] = json.loads(text)
        except json.JSONDecodeError as exc:
            if text.lstrip().startswith(_JSON_OPENERS):
                quoted = json.dumps(text)
                raise ConfigError(f"bad --arg {pair!r}: the value starts like JSON but is not JSON ({exc.msg} at "
                                  f"character {exc.pos + 1}); to pass it as text, quote it: --arg '{key}={quoted}'"
                                  ) from None
            result[key] = text  # not JSON: a plain string
    for key in result:
        if not (isinstance(key, str) and key.isidentifier()):
            raise ConfigError(f"argument name {key!r} is not a Python identifier")
    return result


def _finite(name: str, value: float) -> float:
    if not math.isfinite(value) or value < 0:
        raise ConfigError(f"--{name} must be a finite number >= 0, got {value}")
    return value


class TaskCode:
    """Around task code run by the CLI (import, constructor, ``estimate_memory``): what it prints goes to
    stderr, not into the id or JSON on stdout; a Ctrl-C meanwhile is the user's (exit 130), not
    the task's ``KeyboardInterrupt`` (bad input, exit 2), whatever the task code made of it; and its
    ``os._exit()`` is the task's failure, said in a line (:func:`~freeride._loading.exit_raises`), not the
    CLI's silent end with the task's exit code."""

    def __init__(self) -> None:
        self.interrupted = False
        self._previous: Any = None
        self._redirect = contextlib.redirect_stdout(sys.stderr)
        self._exits = exit_raises()

    def _on_sigint(self, signum: int, frame: Any) -> None:
        self.interrupted = True
        raise KeyboardInterrupt

    def __enter__(self) -> TaskCode:
        with contextlib.suppress(ValueError):  # not the main thread: Ctrl-C keeps its usual handler
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
        self._redirect.__enter__()
        self._exits.__enter__()
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self._exits.__exit__(None, None, None)
        self._redirect.__exit__(None, None, None)
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
        if self.interrupted and not isinstance(exc, KeyboardInterrupt):  # one that says where goes on as it is
            raise KeyboardInterrupt


def build_spec(args: argparse.Namespace) -> TaskSpec:
    """The submission, checked locally (see the module doc); raises ConfigError or RequestRejected."""
    task_args = parse_task_args(args.arg, args.args_json)
    memory_bytes = parse_size(args.memory, "--memory") if args.memory is not None else None
    if memory_bytes is not None:
        check_memory(memory_bytes)  # before the task's module is imported, which may take seconds
    target = ""
    command: tuple[str, ...] = ()
    estimate = None
    if args.command:
        if not args.words:
            raise ConfigError("--command needs the program and its arguments after --, e.g. -- python run.py")
        command = tuple(args.words)
        if "/" in command[0] and not os.path.isabs(command[0]):
            # As a shell reads it: from the directory submitted from. It ran from the task's work directory, which
            # does not exist at submit: `./counter.sh` was accepted and failed in setup, "cannot run".
            command = (os.path.abspath(command[0]), *command[1:])
    else:
        if len(args.words) != 1:
            raise ConfigError(
                "give one task class as MODULE:CLASS (e.g. side_tasks.graphs:PageRank), "
                "or --command -- PROG ARGS for a program"
            )
        target = args.words[0]
        with TaskCode():
            estimate = check_target(target, task_args, os.getcwd())
    if memory_bytes is None:
        if not estimate:
            what = "a command" if command else f"{target} has no memory estimate; it"
            raise ConfigError(f"{what} needs a memory cap: pass --memory, e.g. --memory 2GiB")
        memory_bytes = estimate
    return validate_spec(TaskSpec(
        target=target,
        args=task_args,
        memory_bytes=memory_bytes,
        priority=args.priority,
        name=args.name,
        command=command,
        working_dir=os.path.abspath(os.getcwd()),
        checkpoint_interval_s=_finite("checkpoint-interval-s", args.checkpoint_interval_s),
        step_time_hint_ms=_finite("step-time-hint-ms", args.step_time_hint_ms),
    ))
