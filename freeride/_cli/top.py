"""``freeride top``: a live view of one manager.

    freeride top [--device cpu:0 | --endpoint unix:/p.sock] [--token-file FILE] [--interval 1] [--once]

Every ``--interval`` seconds it asks the manager for its Stats, its tasks (List, finished ones
included) and its Bubbles, and draws one frame: a header (device, uptime, bubbles, bubble time and
its share of wall time, harvested time and its share of bubble time, overruns, grant and park p99),
the tasks (live ones first, then ended ones, newest first, with why each waits or failed), and the
recent bubbles of each (stage, rank, slot).

The frame is a pure function of the fetched data (:func:`render`), tested without a terminal. On a
terminal it is drawn with curses (``q`` quits, exit 0; Ctrl-C exits 130 as every command does);
otherwise (a pipe, a log file) frames are printed one after another, never cleared; ``--once`` prints
one frame and exits. Two windows, each named on screen: the header's totals and every task's
HARVESTED count since the manager started and since the task was submitted; what is marked "now"
(the header's shares, each task's NOW) compares two successive frames, so it shows the last interval.

No manager at the endpoint exits 3, as every command does. A manager that goes away *while* the
view runs is shown as a notice and asked again at the next refresh: restarting a manager should
not also need restarting its viewer.
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from time import monotonic, sleep
from typing import Any, Protocol

from freeride._cli.cluster import queue_line
from freeride._cli.tasks import (
    SHARED_QUIET_S,
    _endpoint,
    _manager_hint,
    aligned,
    display_state,
    why,
    with_reasons,
)
from freeride._wire.client import ControlClient
from freeride.endpoints import TOKEN_ENV, read_token
from freeride.errors import ConfigError, ManagerUnavailable
from freeride.messages import RANK_LEFT_S, BubbleSlotStats, ManagerStats, TaskInfo
from freeride.states import TaskState
from freeride.units import format_ms, format_progress, format_size

_EXIT_OK = 0
_EXIT_INTERRUPTED = 130
#: Narrower than this, a frame is not worth drawing; lines are cut to this at the least.
MIN_WIDTH = 40
#: At most this many lines of a task's reason under its row where the reasons do not fit as a column.
REASON_LINES = 2
#: The longest refresh interval accepted (an hour); longer is a unit mistake.
MAX_INTERVAL_S = 3600.0

# Live tasks by how interesting they are right now; ended ones follow, newest first.
_LIVE_ORDER = {
    TaskState.RUNNING.value: 0,
    TaskState.FROZEN.value: 1,
    TaskState.PARKED.value: 2,
    TaskState.STARTING.value: 3,
    TaskState.SUBMITTED.value: 4,
    TaskState.EVICTED.value: 5,
}


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "top",
        help="live view of one manager: harvest, latencies, tasks and bubbles",
        description="A live view of one manager, refreshed every --interval seconds (curses on a terminal, "
        "plain frames otherwise).",
    )
    parser.add_argument("--device", default="cpu:0", help="the manager's device, cpu:N or cuda:N (default cpu:0)")
    parser.add_argument("--endpoint", default=None, help="unix:/path.sock or tcp://host:port (default: the device's)")
    parser.add_argument("--token-file", default=None, help=f"token for a TCP endpoint (else ${TOKEN_ENV})")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default 1)")
    parser.add_argument("--once", action="store_true", help="print one frame and exit")
    parser.set_defaults(func=run)


# ------------------------------------------------------------------ data


@dataclass(frozen=True)
class Snapshot:
    """What one frame shows: the manager's answers to Stats, List and Bubbles."""

    stats: ManagerStats
    tasks: list[TaskInfo]
    bubbles: list[BubbleSlotStats]


def fetch(client: ControlClient) -> Snapshot:
    return Snapshot(client.stats(), client.list(include_finished=True), client.bubbles())


# ------------------------------------------------------------------ rendering (pure)


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    whole = int(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


def _share(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%" if whole > 0 else "-"


def _wrap(line: str, width: int) -> list[str]:
    """A header line of ``width`` or less as it is; a longer one broken where its parts are (two spaces apart),
    each further line indented by two, a part longer than a line cut by :func:`_fit`. A header line cut at the
    terminal's edge lost what it ended with (a stranger's 80 columns lost the figures "now" and "while shared")."""
    if len(line) <= width:
        return [line]
    out: list[str] = []
    current = ""
    for part in line.split("  "):
        if not part:
            continue
        joined = f"{current}  {part}" if current else part
        if len(joined) <= width or not current:
            current = joined
            continue
        out.append(current)
        current = "  " + part
    out.append(current)
    return [_fit(text, width) for text in out]


def _fit(text: str, width: int) -> str:
    """Cut ``text`` to ``width`` characters, marking the cut."""
    if len(text) <= width:
        return text
    return text[: width - 3] + "..." if width > 3 else text[:width]


def _progress(info: TaskInfo) -> str:
    return format_progress(info.progress, info.steps, info.progress_unit)


def order_tasks(tasks: Sequence[TaskInfo]) -> list[TaskInfo]:
    """Live tasks first (running, frozen, parked, starting, waiting), then ended ones, newest first."""
    live = [t for t in tasks if t.state in _LIVE_ORDER]
    ended = [t for t in tasks if t.state not in _LIVE_ORDER]
    live.sort(key=lambda t: (_LIVE_ORDER[t.state], t.submitted_unix_s, t.task_id))
    ended.sort(key=lambda t: (-t.submitted_unix_s, t.task_id))
    return live + ended


def _shared_header(stats: ManagerStats) -> str:
    """The header's line for a device that trainer ranks share, in the past tense once they fell quiet."""
    ranks = ", ".join(str(r) for r in sorted(stats.shared_by_ranks))
    if stats.shared_quiet_s >= SHARED_QUIET_S:
        return (f"SHARED by trainer ranks {ranks} until {stats.shared_quiet_s:.0f} s ago: no grants until "
                f"{RANK_LEFT_S} s quiet")
    return f"SHARED by trainer ranks {ranks}: no grants (idle only while all of them wait)"


def _header(stats: ManagerStats, previous: ManagerStats | None) -> list[str]:
    now_bubble = now_harvest = ""
    if previous is not None and stats.uptime_s > previous.uptime_s:
        d_bubble = stats.bubble_time_s - previous.bubble_time_s
        now_bubble = f", {_share(d_bubble, stats.uptime_s - previous.uptime_s)} now"
        if d_bubble > 0:
            now_harvest = f", {_share(stats.harvested_s - previous.harvested_s, d_bubble)} now"
    counts = ", ".join(
        f"{stats.tasks_by_state[s]} {s}" for s in sorted(stats.tasks_by_state, key=lambda s: (s not in _LIVE_ORDER, s))
    )
    budget = format_size(stats.memory_budget_bytes) if stats.memory_budget_bytes >= 0 else "unknown yet"
    overrun_p99 = f" (p99 {format_ms(stats.overrun_ms.p99)})" if stats.overrun_ms.count else ""
    window = ""
    if previous is not None and stats.uptime_s > previous.uptime_s:
        window = f"  (totals since the manager started; now: the last {_duration(stats.uptime_s - previous.uptime_s)})"
    return [
        f"freeride top - {stats.device}  up {_duration(stats.uptime_s)}" + ("  DRAINING" if stats.draining else "")
        + window,
        f"bubbles {stats.bubbles}  bubble time {stats.bubble_time_s:.3f} s "
        f"({_share(stats.bubble_time_s, stats.uptime_s)} of uptime{now_bubble})"
        + (f"  ({stats.bubbles_while_shared} while shared: not counted)" if stats.bubbles_while_shared else ""),
        f"harvested {stats.harvested_s:.3f} s ({_share(stats.harvested_s, stats.bubble_time_s)} of bubble time"
        f"{now_harvest})  granted {stats.granted_s:.3f} s",
        f"overruns {stats.overruns}{overrun_p99}  grant p99 {format_ms(stats.grant_latency_ms.p99)}  "
        f"park p99 {format_ms(stats.park_latency_ms.p99)}  memory budget {budget}",
        f"tasks: {counts or 'none'}  events {stats.events_received} ({stats.events_rejected} rejected)",
        *([f"queue: {queue_line(stats.queue)}"] if stats.queue is not None else []),
        # Short enough for a narrow terminal (a cut line loses its point): `stats` says it in full.
        *([_shared_header(stats)] if stats.shared_by_ranks else []),
    ]


def _task_lines(tasks: Sequence[TaskInfo], draining: bool, previous: Sequence[TaskInfo],
                bubble_delta_s: float, width: int | None = None) -> list[str]:
    """One row per task. HARVESTED is since the task was submitted; NOW, its share of the bubble time of
    the last interval: the header's "now" window, so the tasks' NOW add up to the header's harvested now."""
    if not tasks:
        return ["no tasks (submit one with `freeride submit`)"]
    before = {t.task_id: t.harvested_s for t in previous}
    rows = [["ID", "NAME", "STATE", "PROGRESS", "STEPS", "STEP P95", "HARVESTED", *(["NOW"] if previous else [])]]
    ordered = order_tasks(tasks)
    for t in ordered:
        now = (_share(t.harvested_s - before[t.task_id], bubble_delta_s)
               if t.task_id in before and bubble_delta_s > 0 else "-")
        rows.append([
            _fit(t.task_id, 24), _fit(t.spec.display_name, 20), display_state(t, draining), _progress(t),
            str(t.steps), format_ms(t.step_p95_ms), f"{t.harvested_s:.2f} s", *([now] if previous else []),
        ])
    # A reason cut at the screen's edge lost its point (a stranger's top): under its row, two lines at most.
    return with_reasons(rows, [why(t) for t in ordered], width, reason_lines=REASON_LINES)


#: The bubble table's columns a narrow screen loses first, in order (the slot, its count and lengths stay).
_BUBBLE_COLUMNS_DROPPED = ("MAX", "ERR P50", "MIN FREE", "P99", "PREDICTED")


def _bubble_lines(bubbles: Sequence[BubbleSlotStats], width: int | None = None) -> list[str]:
    """The bubble table; where it is wider than ``width``, whole columns are left out
    (:data:`_BUBBLE_COLUMNS_DROPPED`) rather than the right end of every row cut mid-figure."""
    if not bubbles:
        return ["no bubbles reported yet"]
    rows = [["STAGE", "RANK", "SLOT", "KIND", "COUNT", "P50", "P99", "MAX", "PREDICTED", "ERR P50", "MIN FREE"]]
    for b in sorted(bubbles, key=lambda s: (s.stage, s.rank, s.slot)):
        rows.append([
            str(b.stage), str(b.rank), str(b.slot), _fit(b.kind, 12), str(b.count), format_ms(b.length_ms.p50),
            format_ms(b.length_ms.p99), format_ms(b.length_ms.max), format_ms(b.predicted_ms.p50),
            f"{b.abs_error_pct.p50:.1f}%" if b.abs_error_pct.count else "-",
            format_size(b.min_free_memory_bytes) if b.min_free_memory_bytes >= 0 else "?",
        ])
    lines = aligned(rows)
    for name in _BUBBLE_COLUMNS_DROPPED:
        if width is None or all(len(line) <= width for line in lines):
            break
        column = rows[0].index(name)
        rows = [row[:column] + row[column + 1:] for row in rows]
        lines = aligned(rows)
    return lines


def _clip(lines: list[str], room: int, what: str) -> list[str]:
    """At most ``room`` lines; the last one says how many rows were left out (a task's reason, indented under
    its row, is not a row of its own)."""
    if len(lines) <= room:
        return lines
    if room <= 0:
        return []
    kept = max(0, room - 1)
    left_out = sum(1 for line in lines[kept:] if not line.startswith(" "))
    return lines[:kept] + [f"... {left_out} more {what}"]


def render(
    stats: ManagerStats,
    tasks: Sequence[TaskInfo],
    bubbles: Sequence[BubbleSlotStats],
    width: int,
    height: int | None = None,
    previous: ManagerStats | None = None,
    notice: str = "",
    previous_tasks: Sequence[TaskInfo] = (),
) -> str:
    """One frame of ``freeride top``, as text of lines at most ``width`` long.

    ``height`` (a terminal's rows) trims the task and bubble tables to fit, each ending with a
    line that counts what was left out; without it every row is shown. ``previous`` (the stats of
    the frame before) adds the shares of the last interval, and ``previous_tasks`` (its tasks) each
    task's share of that interval's bubble time. ``notice`` is shown under the header, e.g. that the
    manager stopped answering and the figures are the last ones it gave.
    """
    width = max(MIN_WIDTH, width)
    head = [wrapped for line in _header(stats, previous) for wrapped in _wrap(line, width)]
    if notice:
        head.append(f"! {notice}")
    bubble_delta_s = stats.bubble_time_s - previous.bubble_time_s if previous is not None else 0.0
    task_lines = _task_lines(tasks, stats.draining, previous_tasks, bubble_delta_s, width)
    bubble_lines = _bubble_lines(bubbles, width)
    if height is not None:
        room = max(0, height - len(head) - 4)  # two blank lines and two titles
        # Bubbles get what they need up to a third of the room; tasks get the rest.
        bubble_room = min(len(bubble_lines), max(2, room // 3))
        task_lines = _clip(task_lines, room - bubble_room, "tasks")
        bubble_room = max(bubble_room, room - len(task_lines))
        bubble_lines = _clip(bubble_lines, bubble_room, "bubble slots")
    windows = "harvested since submitted" + (", NOW over the header's now" if previous_tasks else "")
    lines = [*head, "", f"TASKS ({len(tasks)}; {windows}, step p95 over recent steps)", *task_lines, "",
             "BUBBLES (recent, per stage/rank/slot)",
             *bubble_lines]
    if height is not None:
        lines = lines[:height]
    return "\n".join(_fit(line, width) for line in lines)


# ------------------------------------------------------------------ drawing


class Screen(Protocol):
    """The part of a curses window the live view uses (tests pass a fake)."""

    def getmaxyx(self) -> tuple[int, int]: ...

    def erase(self) -> None: ...

    def addnstr(self, y: int, x: int, text: str, n: int) -> None: ...

    def refresh(self) -> None: ...

    def timeout(self, delay_ms: int) -> None: ...

    def getch(self) -> int: ...


_QUIT_KEYS = frozenset({ord("q"), ord("Q")})


def live_view(
    screen: Screen,
    refresh: Callable[[], Snapshot],
    first: Snapshot,
    interval_s: float,
    clock: Callable[[], float] = monotonic,
    resize_key: int = -2,
) -> None:
    """Draw frames on ``screen`` until ``q``; fetch with ``refresh`` every ``interval_s``.

    Keys are read with a timeout equal to the time left until the next refresh, so a key is acted
    on at once and a resize (``resize_key``) redraws without asking the manager again.
    """
    current: Snapshot = first
    previous: Snapshot | None = None
    notice = ""
    next_refresh = clock() + interval_s
    while True:
        rows, cols = screen.getmaxyx()
        frame = render(current.stats, current.tasks, current.bubbles, cols - 1, rows,
                       previous.stats if previous else None, notice, previous.tasks if previous else ())
        screen.erase()
        for y, line in enumerate(frame.splitlines()[:rows]):
            screen.addnstr(y, 0, line, max(0, cols - 1))  # never the last column: curses errs there
        screen.refresh()
        screen.timeout(max(1, int((next_refresh - clock()) * 1000)))
        key = screen.getch()
        if key in _QUIT_KEYS:
            return
        if key == resize_key or clock() < next_refresh:
            continue
        next_refresh = clock() + interval_s
        try:
            fresh = refresh()
        except ManagerUnavailable as exc:
            notice = f"{exc} (showing the last figures; retrying every {interval_s:g} s)"
            continue
        previous, current, notice = current, fresh, ""


def _curses_main(refresh: Callable[[], Snapshot], first: Snapshot, interval_s: float) -> None:
    import curses

    def body(window: Any) -> None:
        try:
            curses.curs_set(0)
        except curses.error:  # a terminal without cursor control
            pass
        live_view(window, refresh, first, interval_s, resize_key=curses.KEY_RESIZE)

    curses.wrapper(body)


def _text_main(refresh: Callable[[], Snapshot], first: Snapshot, interval_s: float, width: int) -> None:
    current: Snapshot = first
    previous: Snapshot | None = None
    while True:
        before = previous.stats if previous else None
        print(render(current.stats, current.tasks, current.bubbles, width, previous=before,
                     previous_tasks=previous.tasks if previous else ()), end="\n\n", flush=True)
        told = ""  # the outage said already: once, not once a refresh (a log of a long outage stays readable)
        while True:
            sleep(interval_s)
            try:
                fresh = refresh()
                break
            except ManagerUnavailable as exc:
                if str(exc) != told:
                    told = str(exc)
                    print(f"freeride top: {exc}; retrying every {interval_s:g} s", file=sys.stderr, flush=True)
        if told:
            print("freeride top: the manager answers again", file=sys.stderr, flush=True)
        previous, current = current, fresh


def _interval(value: float) -> float:
    if not math.isfinite(value) or not 0 < value <= MAX_INTERVAL_S:
        raise ConfigError(f"--interval must be a number of seconds in (0, {MAX_INTERVAL_S:.0f}], got {value}")
    return value


def run(args: argparse.Namespace) -> int:
    interval_s = _interval(args.interval)
    endpoint = _endpoint(args)
    token = read_token(args.token_file)
    # Each RPC waits at most a few seconds: a view that hangs on a stuck manager helps nobody.
    with ControlClient(endpoint, token=token, timeout_s=min(10.0, max(2.0, interval_s))) as client:
        with _manager_hint(args, endpoint):
            first = fetch(client)  # no manager: exit 3 before drawing anything

        def refresh() -> Snapshot:
            with _manager_hint(args, endpoint):
                return fetch(client)

        width = shutil.get_terminal_size(fallback=(120, 24)).columns
        try:
            if args.once:
                print(render(first.stats, first.tasks, first.bubbles, width))
            elif sys.stdout.isatty():
                _curses_main(refresh, first, interval_s)
            else:
                _text_main(refresh, first, interval_s, width)
        except KeyboardInterrupt:  # Ctrl-C ends a live view, as an interruption: 130, like every command
            return _EXIT_INTERRUPTED
    return _EXIT_OK
