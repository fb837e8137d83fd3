"""The ``freeride`` command line.

Each subcommand lives in a module under ``freeride._cli`` that defines
``register(subparsers) -> None``; the parser it adds sets ``func`` to a callable taking the parsed
arguments and returning the exit code.

Exit codes (documented in the README):
    0  success
    1  the operation failed (a task failed, a command's own failure)
    2  bad input: unparsable size, unknown device, unknown module or class (a module that fails to
       import, ``sys.exit()`` at import included), bad arguments or values the task refuses, a request
       the manager refuses (a submit to a draining manager), an extra that is not installed
    3  no manager is running at the endpoint (or it died, or is stopping), or the cluster queue's Redis
       cannot be reached
    4  no such task
    5  the manager refused the credentials
  130  interrupted (Ctrl-C)
  141  the reader of stdout went away (``freeride top | head``)
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import re
import sys
from collections.abc import Sequence
from typing import NoReturn

from freeride.errors import (
    ConfigError,
    FreerideError,
    ManagerUnavailable,
    QueueUnavailable,
    RequestRejected,
    TaskNotFound,
    Unauthenticated,
)

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_NO_MANAGER = 3
EXIT_NOT_FOUND = 4
EXIT_UNAUTHENTICATED = 5

#: Modules that contribute subcommands, in help order.
COMMAND_MODULES = (
    "freeride._cli.demo",
    "freeride._cli.manager",
    "freeride._cli.tasks",
    "freeride._cli.top",
    "freeride._cli.plan",
    "freeride._cli.bubbles",
    "freeride._cli.launch",
    "freeride._cli.run_task",
    "freeride._cli.bench",
)


#: ``scheme://user:password@``: a URL's credentials, wherever an error message repeats the command line.
_CREDENTIALS = re.compile(r"(?P<scheme>[A-Za-z][\w+.-]*://)(?P<user>[^:/@\s]*):[^@\s]*@")


def redact_credentials(text: str) -> str:
    """``text`` with every URL's password as ``***`` (``redis://:***@host``)."""
    return _CREDENTIALS.sub(lambda m: f"{m['scheme']}{m['user']}:***@", text)


class BadArguments(SystemExit):
    """argparse's exit 2 for a command line it cannot take, with its (redacted) message for ``--json``."""

    def __init__(self, message: str) -> None:
        super().__init__(EXIT_BAD_INPUT)
        self.message = message


class _Parser(argparse.ArgumentParser):
    """argparse's parser whose errors never print a password: ``stats --queue redis://:pw@host`` (``stats``
    takes no ``--queue``) printed the URL whole in "unrecognized arguments", where every message of
    freeride's own prints :attr:`~freeride._cluster.url.QueueURL.redacted`."""

    def error(self, message: str) -> NoReturn:
        message = redact_credentials(message)
        self.print_usage(sys.stderr)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise BadArguments(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="freeride",
        description="Run side tasks inside the bubbles of pipeline-parallel training.",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (repeatable)")
    # Not dest="command": `bench` and `launch` take a `command` (the job after --) and `submit` a --command flag,
    # which overwrote the name of the command given, and a misspelt option of theirs crashed on the list.
    sub = parser.add_subparsers(dest="_command", metavar="COMMAND")
    sub.required = True
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    for each in (parser, *sub.choices.values()):
        _take_negative_values(each)
    return parser


def _command_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the command (and subcommand) ``args`` ran, else ``parser``."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            chosen = action.choices.get(getattr(args, action.dest, None) or "")
            if chosen is not None:
                return _command_parser(chosen, args)
    return parser


def _take_negative_values(parser: argparse.ArgumentParser) -> None:
    """Let an option's value start with ``-`` and a digit (``--memory -5MiB``, ``--headroom=-1GiB``).

    argparse takes such a token for an unknown option unless it is a plain number, so ``--memory -5MiB``
    failed with "expected one argument" instead of saying what is wrong with the size. Python 3.13
    widened its own pattern the same way; no freeride option looks like a negative number.
    """
    parser._negative_number_matcher = re.compile(r"-\.?\d")


def exit_code_for(exc: FreerideError) -> int:
    """The documented exit code for an error of the tree."""
    if isinstance(exc, TaskNotFound):
        return EXIT_NOT_FOUND
    if isinstance(exc, (ConfigError, RequestRejected)):
        return EXIT_BAD_INPUT
    if isinstance(exc, (ManagerUnavailable, QueueUnavailable)):
        return EXIT_NO_MANAGER
    if isinstance(exc, Unauthenticated):
        return EXIT_UNAUTHENTICATED
    return EXIT_FAILED


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    words = list(sys.argv[1:] if argv is None else argv)
    try:
        args, unknown = parser.parse_known_args(words)
        if unknown:  # said by the command's parser, with its usage (the top level's said "freeride [-h] ...")
            hint = ""
            if getattr(args, "command", False) is True and "--" not in words:
                # `submit --command sh -c '...'`: the program's own options read as freeride's (a stranger's).
                hint = "; a command's own options follow `--`: freeride submit --command [options] -- PROGRAM ARGS..."
            _command_parser(parser, args).error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
    except BadArguments as exc:
        if "--json" in words:
            print(json.dumps({"error": exc.message, "exit_code": EXIT_BAD_INPUT}))
        raise
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args))
    except FreerideError as exc:
        print(f"freeride: error: {exc}", file=sys.stderr)
        code = exit_code_for(exc)
        if getattr(args, "json", False):
            # A script reading the JSON finds the error there too, not an empty stdout.
            print(json.dumps({"error": str(exc), "exit_code": code}))
        return code
    except KeyboardInterrupt as exc:
        if str(exc):  # where it was (run-task: the task's step it stopped)
            print(f"freeride: {exc}", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return _reader_went_away()


def _reader_went_away() -> int:
    """stdout's reader closed it (``freeride top | head``): stop quietly, as a shell tool would.

    Python would otherwise flush stdout again at exit and print a second BrokenPipeError; pointing
    the descriptor at /dev/null makes that flush a no-op. Exit 141, the status of a process ended by
    SIGPIPE, so a pipeline with ``pipefail`` still sees that output was cut short.
    """
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 141


if __name__ == "__main__":
    sys.exit(main())
