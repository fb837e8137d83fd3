"""Task management commands: ``submit``, ``ls``, ``show``, ``cancel``, ``stats``, ``drain``, ``health``.

    freeride submit MODULE:CLASS [--arg key=value ...] [--args-json JSON] [--memory 2GiB]
                    [--priority N] [--name NAME] [--checkpoint-interval-s S] [--step-time-hint-ms MS]
    freeride submit --command [--memory 1GiB ...] -- prog args...
    freeride ls [--all]
    freeride show ID
    freeride cancel ID
    freeride stats
    freeride drain [--timeout-s S]
    freeride health

Each takes ``--device`` (default cpu:0; picks the default endpoint), ``--endpoint``,
``--token-file`` and ``--json`` (one stable JSON document, dataclasses as ``dataclasses.asdict``).
``submit``, ``ls``, ``show`` and ``cancel`` also take ``--queue URL``: they then act on the cluster
queue instead of one manager (see :mod:`freeride._cli.cluster`).

A submission is checked before it is sent (:mod:`freeride._cli.submission`: the class loads from
the current directory, its constructor takes the arguments and their values, the cap is known and
one a worker can run in). ``health`` exits 0 when the manager is ``SERVING`` and 1 for any other
status.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import math
import os
import shutil
import signal
import sys
import textwrap
import time
from collections.abc import Iterator, Sequence
from typing import Any

from freeride._cli.submission import build_spec
from freeride._manager.state_lock import default_state_dir_of, lock_holder
from freeride._wire.client import ControlClient, health_status
from freeride.devices import check_cpu_device, parse_device_name
from freeride.endpoints import TOKEN_ENV, Endpoint, read_token, resolve_endpoint
from freeride.errors import ConfigError, ManagerUnavailable
from freeride.messages import RANK_LEFT_S, SHARED_QUIET_NS, FailureRecord, ManagerStats, Percentiles, TaskInfo
from freeride.states import TaskState
from freeride.units import counts_steps, format_ms, format_progress, format_size, format_steps

_EXIT_OK = 0
_EXIT_FAILED = 1
#: The device a command acts on when ``--device`` is not given.
_DEVICE = "cpu:0"


# ------------------------------------------------------------------ registration


def _common() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--device", default=None, help=f"the manager's device, cpu:N or cuda:N (default {_DEVICE})")
    common.add_argument("--endpoint", default=None, help="unix:/path.sock or tcp://host:port (default: the device's)")
    common.add_argument("--token-file", default=None, help=f"token for a TCP endpoint (else ${TOKEN_ENV})")
    common.add_argument("--json", action="store_true", help="one machine-readable JSON document")
    return common


def _queue_option(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--queue", default=None, metavar="URL",
                        help=f"{what} the cluster queue at this Redis URL instead of one manager "
                        "(redis://[:password@]host[:port][/db], rediss://..., unix:///path/redis.sock)")


def register(subparsers: Any) -> None:
    common = _common()

    p = subparsers.add_parser(
        "submit",
        parents=[common],
        help="submit a side task (MODULE:CLASS, or --command -- prog args...)",
        description="Submit a side task to a device's manager; prints the new task id.",
    )
    p.add_argument(
        "words",
        nargs="*",
        metavar="MODULE:CLASS | -- PROG ARGS",
        help="the task class, or with --command the program and its arguments after --",
    )
    p.add_argument("--command", action="store_true", help="run a program (argv, never a shell) as the task")
    p.add_argument(
        "--arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a constructor argument; VALUE is JSON when it parses, else a string, unless it starts like JSON "
        "([, { or \") (repeatable)",
    )
    p.add_argument("--args-json", default=None, metavar="JSON", help="constructor arguments as one JSON object")
    p.add_argument("--memory", default=None, help="memory cap, e.g. 2GiB (default: the class's estimate)")
    p.add_argument("--priority", type=int, default=0, help="higher is granted first (default 0)")
    p.add_argument("--name", default="", help="a display name")
    p.add_argument("--checkpoint-interval-s", type=float, default=0.0,
                   help="seconds between checkpoints (default 30; 0 means the default)")
    p.add_argument("--step-time-hint-ms", type=float, default=0.0, help="expected step time before one is measured")
    _queue_option(p, "put the task on")
    p.set_defaults(func=cmd_submit)

    p = subparsers.add_parser("ls", parents=[common], help="list tasks", description="List the manager's tasks.")
    p.add_argument("--all", action="store_true", help="include finished, failed and cancelled tasks")
    _queue_option(p, "list every task of")
    p.set_defaults(func=cmd_ls)

    p = subparsers.add_parser("show", parents=[common], help="everything about one task")
    p.add_argument("task_id", metavar="ID")
    _queue_option(p, "show a task of")
    p.set_defaults(func=cmd_show)

    p = subparsers.add_parser("cancel", parents=[common], help="cancel a task")
    p.add_argument("task_id", metavar="ID")
    _queue_option(p, "cancel a task of")
    p.set_defaults(func=cmd_cancel)

    p = subparsers.add_parser("stats", parents=[common], help="bubbles harvested, overruns, latencies, memory")
    p.set_defaults(func=cmd_stats)

    p = subparsers.add_parser("drain", parents=[common], help="park and checkpoint every task; accept no new ones")
    p.add_argument("--timeout-s", type=float, default=30.0, help="how long to wait for the drain (default 30)")
    p.set_defaults(func=cmd_drain)

    p = subparsers.add_parser("health", parents=[common], help="the manager's grpc.health.v1 status")
    p.set_defaults(func=cmd_health)


# ------------------------------------------------------------------ plumbing


def _device(args: argparse.Namespace) -> str:
    return args.device or _DEVICE


def _endpoint(args: argparse.Namespace) -> Endpoint:
    parse_device_name(_device(args))  # a mistyped device is bad input even with an explicit endpoint
    return resolve_endpoint(args.endpoint, _device(args))


def _queue_url(args: argparse.Namespace) -> str | None:
    """``--queue``'s URL, or None; with it, the options that name one manager are refused, never ignored (the
    queue holds every device's tasks: its DEVICE column says where each one runs)."""
    if args.queue is None:
        return None
    given = [flag for flag, value in (("--device", args.device), ("--endpoint", args.endpoint),
                                      ("--token-file", args.token_file)) if value is not None]
    if given:
        raise ConfigError(f"{', '.join(given)} names one manager, and --queue acts on the cluster queue of every "
                          f"device: give one or the other (the queue's DEVICE column says where each task runs)")
    return str(args.queue)


def cannot_run_here(name: str) -> str:
    """Why no manager can run on device ``name`` on this machine (a CPU core it does not offer), or "" where one
    could. Behind a unix socket a manager would be on this host, so such a device is the user's bad input (exit
    2); over TCP another host's device may be meant."""
    try:
        device = parse_device_name(name)
        if device.kind == "cpu":
            check_cpu_device(device)
    except ConfigError as exc:
        return str(exc)
    return ""


@contextlib.contextmanager
def _manager_hint(args: argparse.Namespace, endpoint: Endpoint) -> Iterator[None]:
    """Reword "no manager" with the command that starts one for this device and endpoint."""
    try:
        yield
    except ManagerUnavailable as exc:
        if not str(exc).startswith("no manager answers"):
            raise  # a manager answered: it is stopping, or its loop is stuck; it says which
        name = _device(args)
        why = cannot_run_here(name)
        if why:  # advising a manager on a core that is not there helps nobody
            message = f"no manager answers at {endpoint}, and none can run on {name} here: {why}"
            if endpoint.kind == "unix":  # its manager would be on this host: the device is the bad input
                raise ConfigError(message) from None
            raise ManagerUnavailable(message) from None  # over TCP, another host's device may be meant
        start = f"freeride manager --device {_device(args)}" + (f" --endpoint {endpoint}" if args.endpoint else "")
        running = _running_manager(name, endpoint)
        if running:
            raise ManagerUnavailable(f"no manager answers at {endpoint}, but {running}") from None
        # "Or it is stopping": a manager that is draining or exiting answers no call either, and starting a second
        # one then would be the wrong advice without it.
        raise ManagerUnavailable(f"no manager answers at {endpoint} (none runs there, or it is stopping); start one "
                                 f"with `{start}`") from None


def _running_manager(name: str, endpoint: Endpoint) -> str:
    """What to say where a manager of device ``name`` runs on this host (it holds the device's default state
    directory) and does not answer at ``endpoint``: its socket was removed under it (a sweep of /tmp took it,
    and "start one" led a stranger to a second manager on the same device), or it is stopping; "" otherwise."""
    if endpoint.kind != "unix":
        return ""
    try:
        state_dir = default_state_dir_of(parse_device_name(name))
    except ConfigError:
        return ""
    holder = lock_holder(state_dir)
    if not holder:
        return ""
    if holder.endswith(f"endpoint {endpoint}") and not os.path.exists(endpoint.address):
        return (f"a manager of {name} runs here ({holder}) and its socket {endpoint.address} is gone (removed "
                "under it: its log says so); stop it (SIGTERM drains its tasks) and start it again, rather than "
                "a second manager beside it")
    return (f"a manager of {name} runs here ({holder}, state in {state_dir}): it is stopping, or serves another "
            "endpoint")


@contextlib.contextmanager
def _client(args: argparse.Namespace) -> Iterator[ControlClient]:
    endpoint = _endpoint(args)
    token = read_token(args.token_file)
    with ControlClient(endpoint, token=token) as client, _manager_hint(args, endpoint):
        yield client


_PERCENTILE_KEYS = frozenset(f.name for f in dataclasses.fields(Percentiles))


def uncomputed_as_null(value: Any) -> Any:
    """JSON-ready ``value`` (made of dicts and lists) with each percentile block's ``p999`` null where it was not
    computed (:class:`~freeride.messages.Percentiles`: 0 beside a non-zero max), not a 0.0 that reads as a
    measured figure."""
    if isinstance(value, dict):
        if value.keys() == _PERCENTILE_KEYS and not value["p999"] and value["max"]:
            return {**value, "p999": None}
        return {k: uncomputed_as_null(v) for k, v in value.items()}
    if isinstance(value, list):
        return [uncomputed_as_null(v) for v in value]
    return value


def _to_json(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return uncomputed_as_null(dataclasses.asdict(value))
    if isinstance(value, list):
        return [_to_json(v) for v in value]
    return value


def _print_json(value: Any) -> None:
    print(json.dumps(_to_json(value), indent=2, sort_keys=True))


# ------------------------------------------------------------------ submit


def cmd_submit(args: argparse.Namespace) -> int:
    queue = _queue_url(args)
    spec = build_spec(args)
    if queue is not None:
        from freeride._cli import cluster

        record = cluster.submit(queue, spec)
        if args.json:
            cluster.print_json(cluster.to_json(record))
        else:
            print(record.task_id)
        return _EXIT_OK
    with _client(args) as client:
        info = client.submit(spec)
    if args.json:
        _print_json(info)
    else:
        print(info.task_id)
    return _EXIT_OK


# ------------------------------------------------------------------ ls, show, cancel


def _progress(info: TaskInfo) -> str:
    return format_progress(info.progress, info.steps, info.progress_unit)


def aligned(rows: list[list[str]]) -> list[str]:
    """Rows of cells as lines of left-aligned columns two spaces apart."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]


#: Where a reason goes under its row: indented, so that the rows stand out.
_REASON_FIRST = "    why: "
_REASON_NEXT = " " * len(_REASON_FIRST)


def with_reasons(rows: list[list[str]], reasons: Sequence[str], width: int | None = None,
                 reason_lines: int | None = None, header: str = "WHY") -> list[str]:
    """A table whose last column is a sentence (why a task waits or failed): ``rows`` are the header and one row
    per item without it, ``reasons`` each item's ("" for none).

    Where every line fits in ``width`` (None: any width fits), the reasons are the last column, as before.
    Otherwise a column of sentences would be cut by the screen (``top``) or broken across the next row by the
    terminal (``ls``): each reason goes under its row instead, indented and wrapped to the width, at most
    ``reason_lines`` lines (None: all of it), the last one then ending in "...".
    """
    full = aligned([[*rows[0], header], *([*row, reason or "-"] for row, reason in zip(rows[1:], reasons,
                                                                                          strict=True))])
    if width is None or all(len(line) <= width for line in full):
        return full
    room = max(len(_REASON_FIRST) + 10, width)
    lines = aligned(rows)
    out = [lines[0]]
    for line, reason in zip(lines[1:], reasons, strict=True):
        out.append(line)
        if not reason:
            continue
        wrapped = textwrap.wrap(reason, room, initial_indent=_REASON_FIRST, subsequent_indent=_REASON_NEXT,
                                break_on_hyphens=False)
        if reason_lines is not None and len(wrapped) > reason_lines:
            wrapped = wrapped[:reason_lines]
            last = wrapped[-1]
            wrapped[-1] = (last if len(last) + 3 <= room else last[:room - 3]) + "..."
        out.extend(wrapped)
    return out


def reason_width() -> int | None:
    """The width ``ls`` fits its reasons in: the terminal's; None when the output is not a terminal (a pipe or a
    file keeps one line per task, for grep)."""
    if not sys.stdout.isatty():
        return None
    return shutil.get_terminal_size(fallback=(120, 24)).columns


#: What ``ls`` and ``top`` show for a SUBMITTED task of a draining manager: it is not waiting to start.
DRAINED = "DRAINED"
_DRAINED_NOTE = ("DRAINED: the manager was told to drain; these tasks are stopped (checkpointed if they had begun) "
                 "and start again when a manager starts on this state directory (a drained one stays up until it is "
                 "stopped)")


def display_state(info: TaskInfo, draining: bool) -> str:
    """The state as a person reads it: a drained manager's SUBMITTED tasks are DRAINED, not about to start.

    The lifecycle has no such state: a drain stops every task, and a stopped task goes back to
    SUBMITTED, from where the next manager on the state directory places it again.
    """
    return DRAINED if draining and info.state == TaskState.SUBMITTED.value else info.state


def is_terminal(info: TaskInfo) -> bool:
    return info.state in TaskState.__members__ and TaskState(info.state).is_terminal


def why(info: TaskInfo) -> str:
    """Why a task waits, or how it failed: one line."""
    if info.failure is not None:
        first_line = info.failure.message.strip().splitlines()[0] if info.failure.message.strip() else ""
        return f"{info.failure.kind}: {first_line}" if first_line else info.failure.kind
    return info.waiting_reason


def render_task_table(infos: Sequence[TaskInfo], draining: bool = False, width: int | None = None) -> str:
    """``ls``: one row per task; why each waits or failed as a last column, or under its row where the
    sentences would not fit in ``width`` (:func:`with_reasons`)."""
    rows = [["ID", "NAME", "STATE", "PRIO", "MEMORY", "PROGRESS", "STEP P95", "HARVESTED"]]
    for i in infos:
        rows.append(
            [
                i.task_id,
                i.spec.display_name,
                display_state(i, draining),
                str(i.spec.priority),
                format_size(i.spec.memory_bytes),
                _progress(i),
                format_ms(i.step_p95_ms),
                f"{i.harvested_s:.2f} s",
            ]
        )
    return "\n".join(with_reasons(rows, [why(i) for i in infos], width))


def hidden_note(hidden: Sequence[TaskInfo]) -> str:
    """One line for the ended tasks ``ls`` leaves out, so that a failed one never vanishes unnoticed."""
    if not hidden:
        return ""
    counts = collections.Counter(i.state.lower() for i in hidden)
    listed = ", ".join(f"{n} {state}" for state, n in sorted(counts.items()))
    failed = [i.task_id for i in hidden if i.state == TaskState.FAILED.value]
    why_failed = f"; `freeride show {failed[-1]}` says why it failed" if failed else ""
    return f"not shown: {listed} (`freeride ls --all` lists them{why_failed})"


def cmd_ls(args: argparse.Namespace) -> int:
    queue = _queue_url(args)
    if queue is not None:
        from freeride._cli import cluster

        every = cluster.records(queue, include_finished=True)  # one fetch either way
        records = every if args.all else [r for r in every if not (r.terminal or r.aside)]
        if args.json:
            cluster.print_json([cluster.to_json(r) for r in records])
            return _EXIT_OK
        print(cluster.render_table(records, reason_width()) if records else "no tasks in the queue" if args.all
              else "no active tasks in the queue (--all shows finished and set-aside ones)")
        note = cluster.unusable_note(every, args.all)
        if note:  # never let a record that cannot be used go unnoticed
            print(note)
        return _EXIT_OK
    with _client(args) as client:
        infos = client.list(include_finished=True)
        draining = False if args.json else client.stats().draining
    shown = infos if args.all else [i for i in infos if not is_terminal(i)]
    if args.json:
        _print_json(shown)
        return _EXIT_OK
    note = hidden_note([i for i in infos if is_terminal(i)] if not args.all else [])
    if shown:
        print(render_task_table(shown, draining, reason_width()))
        if note:
            print(note)
    else:
        print(("no active tasks; " + note) if note else "no tasks")
    if draining and any(display_state(i, draining) == DRAINED for i in shown):
        print(_DRAINED_NOTE)
    return _EXIT_OK


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _indent(text: str, prefix: str = "    ") -> str:
    return "\n".join(prefix + line for line in text.rstrip("\n").splitlines())


#: Failure kinds the user fixes by changing the task's input (a missing or malformed file, a size that
#: cannot fit its cap, arguments it refuses): shown as their one line; ``show --json`` keeps the traceback.
USER_FIXABLE_KINDS = frozenset({"CONFIG"})


def render_failure(failure: FailureRecord) -> str:
    """A failure record, once and plainly; one line for what the user can fix."""
    lines = [f"failure:    {failure.kind}: {failure.message}"]
    if failure.kind in USER_FIXABLE_KINDS:
        return lines[0]
    if failure.signal:
        lines.append(f"  killed by: {_signal_name(failure.signal)} ({failure.signal})")
    elif failure.exit_code is not None:
        lines.append(f"  exit code: {failure.exit_code}")
    if failure.step >= 0:
        lines.append(f"  after:     {format_steps(failure.step)} finished")
    if failure.at_unix_s:
        lines.append(f"  at:        {_when(failure.at_unix_s)}")
    if failure.traceback.strip():
        lines.append("  traceback:")
        lines.append(_indent(failure.traceback))
    log_tail = failure.log_tail
    if failure.traceback.strip() and failure.traceback.strip() in log_tail:
        # The worker logs the same traceback it reports: show it once.
        log_tail = log_tail.replace(failure.traceback.strip(), "(the traceback above)")
    if log_tail.strip():
        lines.append("  log tail:")
        lines.append(_indent(log_tail))
    return "\n".join(lines)


def _when(unix_s: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(unix_s)) if unix_s else "-"


def _progress_line(info: TaskInfo) -> str:
    """Progress and steps as the worker last reported them (at its last park or checkpoint). A worker frozen
    mid-grant never reported the steps it finished in that grant, so a failure's step (read from its board)
    may be further on: say so rather than show two counts that disagree without a word."""
    counted = f"{_progress(info)} ({info.steps} steps)"
    # Steps counted from the worker's board, no progress in the task's own unit: it never parked to say it.
    unreported = not info.progress and (not info.steps or not counts_steps(info.progress_unit))
    if info.progress_unit == "steps" and info.progress == info.steps > 0:
        counted = _progress(info)  # "396 steps (396 steps)" said it twice
    elif unreported and info.steps:
        counted = f"none reported in {info.progress_unit} ({format_steps(info.steps)} finished)"
    failure = info.failure
    if failure is not None and failure.step > info.steps:
        if unreported:  # "- (0 steps), as last reported: ... 9 steps" read as a contradiction
            return (f"none reported (it never parked); its worker had finished {format_steps(failure.step)} when it "
                    "failed")
        return f"{counted} as last reported; its worker had finished {format_steps(failure.step)} when it failed"
    return counted


def render_task(info: TaskInfo, draining: bool = False) -> str:
    """One task, field by field; its state as ``ls`` shows it (:func:`display_state`)."""
    spec = info.spec
    what = spec.target or " ".join(spec.command)
    fields = [
        ("task", info.task_id),
        ("name", spec.display_name),
        ("state", display_state(info, draining)),
        ("command" if spec.command else "target", what),
        ("args", json.dumps(spec.args, sort_keys=True) if spec.args else "-"),
        ("memory", format_size(spec.memory_bytes)),
        ("priority", str(spec.priority)),
        ("progress", _progress_line(info)),
        ("step p50", format_ms(info.step_p50_ms)),
        ("step p95", format_ms(info.step_p95_ms)),
        ("harvested", f"{info.harvested_s:.3f} s"),
        ("overruns", str(info.overruns) + (_TASK_OVERRUN_NOTE if info.overruns else "")),
        ("checkpoint", f"step {info.checkpoint_step}" if info.checkpoint_step >= 0 else "-"),
        ("ckpt every", f"{spec.checkpoint_interval_s:g} s" if spec.checkpoint_interval_s else "the manager's default"),
        ("restarts", str(info.restarts)),
        ("pid", str(info.pid) if info.pid else "-"),
        ("submitted", _when(info.submitted_unix_s)),
        ("updated", _when(info.updated_unix_s)),
    ]
    if spec.working_dir:
        fields.insert(4, ("directory", spec.working_dir))
    if spec.step_time_hint_ms:
        fields.append(("step hint", format_ms(spec.step_time_hint_ms)))
    if info.task_dir:  # there was no way from the CLI to find a task's outputs or its log
        fields += [("outputs", f"{info.task_dir}/work"), ("log", f"{info.task_dir}/worker.log")]
    if info.waiting_reason:
        fields.append(("running" if info.state == TaskState.RUNNING.value else "waiting", info.waiting_reason))
    text = "\n".join(f"{key + ':':<11} {value}" for key, value in fields)
    if info.failure is not None:
        text += "\n" + render_failure(info.failure)
    return text


def cmd_show(args: argparse.Namespace) -> int:
    queue = _queue_url(args)
    if queue is not None:
        from freeride._cli import cluster

        record = cluster.record(queue, args.task_id)
        print(json.dumps(cluster.to_json(record), indent=2, sort_keys=True) if args.json
              else cluster.render_record(record))
        return _EXIT_OK
    with _client(args) as client:
        info = client.get(args.task_id)
        # As ``ls`` shows it: a draining manager's SUBMITTED task is DRAINED. JSON keeps the lifecycle's state.
        draining = False if args.json else client.stats().draining
    print(json.dumps(_to_json(info), indent=2, sort_keys=True) if args.json else render_task(info, draining))
    if display_state(info, draining) == DRAINED:
        print(_DRAINED_NOTE)
    return _EXIT_OK


def cmd_cancel(args: argparse.Namespace) -> int:
    queue = _queue_url(args)
    if queue is not None:
        from freeride._cli import cluster

        outcome = cluster.cancel(queue, args.task_id)
        if args.json:
            cluster.print_json({"task_id": args.task_id, "outcome": outcome})
        else:
            note = (" (its manager stops it)" if outcome == "REQUESTED" else "" if outcome == "CANCELLED"
                    else " (set aside as unreadable: nothing to cancel; `ls --queue --all` says why)"
                    if outcome == "SET_ASIDE" else " (over already: nothing to cancel)")
            print(f"{args.task_id} {'CANCEL REQUESTED' if outcome == 'REQUESTED' else outcome}{note}")
        return _EXIT_OK
    with _client(args) as client:
        info = client.cancel(args.task_id)
    if args.json:
        _print_json(info)
    else:
        terminal = TaskState(info.state).is_terminal if info.state in TaskState.__members__ else False
        # Stranger trial: cancelling a task that had failed printed "spinner-5 FAILED", which read as the cancel's.
        note = (" (stopping)" if not terminal else "" if info.state == TaskState.CANCELLED.value
                else " (over already: nothing to cancel)")
        print(f"{info.task_id} {info.state}{note}")
    return _EXIT_OK


# ------------------------------------------------------------------ stats, drain, health


_PARK_NOTE = "  (end received -> parked; 0 when the worker saw the trainer's end first)"
# Stranger trial: "grant latency n=117, park latency n=781, overruns 845" with no word of what each counts.
_OVERRUN_NOTE = "  (grants whose side task still ran past the bubble's real end, by how much)"
#: Stranger trial: "overruns: 60" for a task of 15 us steps read as its steps running long.
_TASK_OVERRUN_NOTE = ("  (its worker still held a bubble after the end and was frozen until a later one: on a GPU a "
                      "step that ran past the grace; on a cpu:N device one the trainer stopped at the end, its step or "
                      "its park report not done when the rank took the core back)")
_GRANT_NOTE = "  (bubble start received -> first step; a bubble's first grant, when its worker was parked)"
#: Where granted time is far more than harvested (a stranger read 2.5 s granted beside 0.2 s harvested and found
#: nothing saying where the rest went).
_GRANTED_NOTE = ("  (bubble time handed to side tasks; harvested counts only what their steps ran: the rest went "
                 "to starting and parking, tails of bubbles no step fitted, and on a cpu:N core waits for the rank's "
                 "core)")


def _pct_line(p: Percentiles) -> str:
    if not p.count:
        return "-"
    return (
        f"p50 {format_ms(p.p50)}  p90 {format_ms(p.p90)}  p99 {format_ms(p.p99)}  max {format_ms(p.max)}  (n={p.count})"
    )


def render_stats(s: ManagerStats) -> str:
    ratio = f"{100 * s.harvested_s / s.bubble_time_s:.1f}%" if s.bubble_time_s > 0 else "-"
    by_state = ", ".join(f"{k} {v}" for k, v in sorted(s.tasks_by_state.items())) or "none"
    fields = [
        ("device", (s.device_info or s.device) + ("  (draining)" if s.draining else "")),
        *([("PROBLEM", f"the device cannot be read, nothing is admitted: {s.device_problem}")]
          if s.device_problem else []),
        ("uptime", f"{s.uptime_s:.1f} s"),
        ("bubbles", str(s.bubbles)),
        ("bubble time", f"{s.bubble_time_s:.3f} s" + (f"  {shared_bubbles_note(s.bubbles_while_shared)}"
                                                      if s.bubbles_while_shared else "")),
        ("granted", f"{s.granted_s:.3f} s" + (_GRANTED_NOTE if s.harvested_s < s.granted_s / 2 else "")),
        ("harvested", f"{s.harvested_s:.3f} s ({ratio} of bubble time)"),
        ("overruns", f"{s.overruns}  {_pct_line(s.overrun_ms)}" + (_OVERRUN_NOTE if s.overruns else "")
         # "1105 overruns" beside a p50 of 17 us read as a problem to a stranger: on cpu:N most grants end so.
         + (f"; {s.trainer_stops} stopped by the trainer at the end (on a cpu:N device the usual end of a grant "
            "whose task still stepped: counted from the end to that stop)" if s.trainer_stops else "")
         + (f"; {s.hung_overruns} of a step that looked hung (thawed at its turns, not in the percentiles)"
            if s.hung_overruns else "")),
        ("grant lat.", _pct_line(s.grant_latency_ms) + (_GRANT_NOTE if s.grant_latency_ms.count else "")),
        ("park lat.", _pct_line(s.park_latency_ms) + (_PARK_NOTE if s.park_latency_ms.count else "")),
        ("end->worker", _pct_line(s.end_to_worker_ms)),
        ("mem budget", format_size(s.memory_budget_bytes) if s.memory_budget_bytes >= 0 else "unknown yet"),
        ("tasks", by_state),
        ("events", f"{s.events_received} received, {s.events_rejected} rejected"
                   + (f", {s.events_late} read late on purpose (bubbles no task could use: held back by the trainer "
                      "for quiet slots, or read every --idle-read-ms; not in the event delay)" if s.events_late else "")
                   + (f", {s.events_ignored} out of order (ignored: an end without its start, as after a manager "
                      "restart under a running trainer, or a new layout or job mid-bubble)" if s.events_ignored else "")
                   + (f", {s.events_dropped} dropped" if s.events_dropped else "")
                   + (f", {s.events_other_ranks} from other trainer ranks (ignored)" if s.events_other_ranks else "")),
        ("event delay", _pct_line(s.event_delay_ms)),
    ]
    if s.queue is not None:
        from freeride._cli.cluster import queue_line

        fields.append(("queue", queue_line(s.queue)))
    if s.shared_by_ranks:
        fields.append(("shared", shared_line(s.shared_by_ranks, s.shared_quiet_s)))
    if s.layout_changes > 1:
        # A manager kept up across jobs showed totals since it started only (a stranger's service ran 13 jobs):
        # the figures of the run whose layout it follows now.
        run_ratio = f"{100 * s.run_harvested_s / s.run_bubble_time_s:.1f}%" if s.run_bubble_time_s > 0 else "-"
        fields.append(("this run", f"{s.run_bubbles} bubbles, {s.run_bubble_time_s:.3f} s of bubble time, "
                                   f"{s.run_granted_s:.3f} s granted, {s.run_harvested_s:.3f} s harvested "
                                   f"({run_ratio}), in the {s.run_s:.1f} s since its layout was taken on"))
    if s.layout:
        # A stranger read "(1 change)" after its first job, and a change for each run of one shape: each is a layout
        # the manager took on (the first, and each run's: a run's bubbles are its own).
        fields.append(("layout", f"{s.layout}  ({s.layout_changes} layout{'s' if s.layout_changes != 1 else ''} "
                                 "taken on: one a run, and each change within one)"))
    return "\n".join(f"{key + ':':<12} {value}" for key, value in fields)


def shared_bubbles_note(count: int) -> str:
    """Why ``bubble time`` is less than the bubbles counted: some ended while trainer ranks shared the device."""
    return (f"(not counting {count} bubble{'s' if count != 1 else ''} that ended while trainer ranks shared this "
            "device: it was idle only while all of them waited, which freeride does not follow)")


SHARED_QUIET_S = SHARED_QUIET_NS / 1e9


def shared_line(ranks: Sequence[int], quiet_s: float = 0.0) -> str:
    """What ``stats`` says of a device that trainer ranks share (the followed one first), ``quiet_s`` after the
    last event of any of them: in the past tense once they fell quiet (a stranger's job had ended for seconds
    while "share" still read as now)."""
    names = ", ".join(str(r) for r in sorted(ranks))
    if quiet_s >= SHARED_QUIET_S:
        return (f"trainer ranks {names} shared this device until {quiet_s:.0f} s ago (no event from them since): "
                f"nothing is granted until it has been quiet for {RANK_LEFT_S} s (the bubbles shown are rank "
                f"{ranks[0]}'s)")
    return (f"trainer ranks {names} share this device: nothing is granted while they do (it is idle only while "
            f"all of them wait; the bubbles shown are rank {ranks[0]}'s)")


def cmd_stats(args: argparse.Namespace) -> int:
    with _client(args) as client:
        stats = client.stats()
    if args.json:
        doc = _to_json(stats)
        doc["harvested_ratio"] = stats.harvested_s / stats.bubble_time_s if stats.bubble_time_s > 0 else None
        _print_json(doc)
    else:
        print(render_stats(stats))
    return _EXIT_OK


def cmd_drain(args: argparse.Namespace) -> int:
    timeout_s = args.timeout_s
    if not math.isfinite(timeout_s) or not 0 < timeout_s <= 3600:
        raise ConfigError(f"--timeout-s must be in (0, 3600], got {timeout_s}")
    with _client(args) as client:
        already = client.stats().draining
        parked, checkpointed, killed = client.drain(timeout_s)
    if args.json:
        _print_json({"parked": parked, "checkpointed": checkpointed, "killed": killed, "already_draining": already})
    elif already:
        print("already drained by an earlier drain: its tasks are parked and checkpointed; the manager accepts "
              "no new tasks")
    else:
        gone = (f", {killed} of them killed after ignoring the stop for the manager's --stop-timeout-s (they lost "
                "the work since their checkpoint)" if killed else "")
        print(f"drained: {parked} task(s) parked, {checkpointed} checkpointed{gone}; the manager accepts no new tasks")
    return _EXIT_OK


def cmd_health(args: argparse.Namespace) -> int:
    endpoint = _endpoint(args)
    with _manager_hint(args, endpoint):
        status = health_status(endpoint, token=read_token(args.token_file))
    if args.json:
        _print_json({"endpoint": str(endpoint), "status": status})
    else:
        print(status)
    return _EXIT_OK if status == "SERVING" else _EXIT_FAILED
