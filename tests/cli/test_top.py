"""``freeride top``: the frame rendered from fixed data, the live loop on a fake screen and clock,
and the command against a real in-process manager (``--once``, the plain text mode, no manager)."""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import cpu_devices

from freeride._cli import top
from freeride._cli.tasks import render_stats
from freeride._cli.top import Snapshot, live_view, order_tasks, render
from freeride._manager.daemon import Manager
from freeride._wire.client import ControlClient
from freeride.cli import EXIT_BAD_INPUT, EXIT_NO_MANAGER, EXIT_OK, main
from freeride.endpoints import Endpoint
from freeride.errors import ManagerUnavailable
from freeride.messages import (
    BubbleSlotStats,
    FailureRecord,
    ManagerStats,
    Percentiles,
    QueueStats,
    TaskInfo,
    TaskProgress,
    TaskSpec,
)

DEVICE = cpu_devices(1)[0]  # a core this process may run on: tests never name core numbers

TESTS_DIR = Path(__file__).resolve().parent.parent


def stats(**changes: object) -> ManagerStats:
    fields: dict[str, object] = dict(
        device="cpu:3", uptime_s=3725.0, bubbles=1200, bubble_time_s=1000.0, granted_s=850.0, harvested_s=800.0,
        overruns=4, overrun_ms=Percentiles(4, 0.5, 0.8, 0.9, 1.2),
        grant_latency_ms=Percentiles(100, 0.4, 0.6, 0.72, 2.0), park_latency_ms=Percentiles(100, 0.3, 0.5, 0.58, 1.0),
        memory_budget_bytes=3 * 2**30,
        tasks_by_state={"RUNNING": 1, "PARKED": 1, "SUBMITTED": 1, "FAILED": 1}, events_received=2400,
        events_rejected=2, draining=False,
    )
    fields.update(changes)
    return ManagerStats(**fields)  # type: ignore[arg-type]


def task(task_id: str, state: str, submitted: float, steps: int = 10, progress: float = 10.0,
         harvested_s: float = 0.25, **changes: object) -> TaskInfo:
    fields: dict[str, object] = dict(
        task_id=task_id, spec=TaskSpec(target=f"side_tasks.x:{task_id.split('-')[0].title()}", memory_bytes=2**26),
        state=state, submitted_unix_s=submitted,
        figures=TaskProgress(steps=steps, progress=progress, progress_unit="ticks", step_p95_ms=1.5,
                             harvested_s=harvested_s),
    )
    fields.update(changes)
    return TaskInfo(**fields)  # type: ignore[arg-type]


TASKS = [
    task("failed-1", "FAILED", 1.0, failure=FailureRecord("MEMORY_LIMIT", "used 70 MiB over its 64 MiB cap\nmore")),
    task("parked-2", "PARKED", 2.0, waiting_reason="waiting for a bubble"),
    task("running-3", "RUNNING", 3.0),
    task("waiting-4", "SUBMITTED", 4.0, steps=0, progress=0.0, waiting_reason="needs 64 MiB; 0 B free"),
    task("done-5", "FINISHED", 5.0),
]
BUBBLES = [
    BubbleSlotStats(1, 1, 0, "warmup", 300, Percentiles(300, 12.0, 14.0, 15.5, 16.0),
                    Percentiles(300, 12.5, 13.0, 13.0, 13.0), Percentiles(300, 4.2, 8.0, 9.0, 9.5), 2**30),
    BubbleSlotStats(0, 0, 2, "cooldown", 300, Percentiles(300, 20.0, 22.0, 25.0, 30.0),
                    Percentiles(300, 20.0, 20.0, 20.0, 20.0), Percentiles(300, 2.5, 5.0, 6.0, 7.0), -1),
]


# ------------------------------------------------------------------ render (pure)


def test_header_shows_harvest_shares_overruns_and_latencies() -> None:
    frame = render(stats(), TASKS, BUBBLES, width=120)
    lines = frame.splitlines()
    assert lines[0].startswith("freeride top - cpu:3  up 1h02m05s")
    assert "bubbles 1200  bubble time 1000.000 s (26.8% of uptime)" in frame
    assert "harvested 800.000 s (80.0% of bubble time)" in frame
    assert "overruns 4 (p99 900 us)" in frame
    assert "grant p99 720 us" in frame and "park p99 580 us" in frame
    assert "memory budget 3.0 GiB" in frame
    assert "events 2400 (2 rejected)" in frame
    assert "now" not in frame  # no previous frame: no rate over the last interval


def test_a_manager_on_a_queue_shows_the_queues_figures_in_top_and_stats() -> None:
    queue = QueueStats(connected=True, lease_ms=2000, depth=12, set_aside=1, held=2, claims=5, reclaims=1,
                       renewals=300, set_aside_here=1)
    line = ("queue: connected  depth 12  held 2  claims 5  reclaims 1  renewals 300  lost 0  set aside 1 (1 here)  "
            "lease 2000 ms")
    assert line in render(stats(queue=queue), TASKS, BUBBLES, width=200).splitlines()
    assert "queue:" not in render(stats(), TASKS, BUBBLES, width=200)
    cut_off = dataclasses.replace(queue, connected=False, errors=3, last_error="cannot reach the queue")
    assert "queue:       UNREACHABLE (3 failed polls: cannot reach the queue)" in render_stats(stats(queue=cut_off))


def test_stats_shows_the_current_runs_figures_once_a_manager_has_followed_more_than_one() -> None:
    assert "this run:" not in render_stats(stats(layout_changes=1, layout="1f1b stages=2"))
    text = render_stats(stats(layout_changes=3, layout="1f1b stages=2", run_s=12.5, run_bubbles=40,
                              run_bubble_time_s=2.0, run_granted_s=1.5, run_harvested_s=1.0))
    assert ("this run:    40 bubbles, 2.000 s of bubble time, 1.500 s granted, 1.000 s harvested (50.0%), in the "
            "12.5 s since its layout was taken on") in text.splitlines()


def test_a_device_that_trainer_ranks_share_says_so_in_top_and_stats() -> None:
    shared = stats(shared_by_ranks=(2, 0), events_other_ranks=41)
    short = "SHARED by trainer ranks 0, 2: no grants (idle only while all of them wait)"
    assert short in render(shared, TASKS, BUBBLES, width=80).splitlines()  # whole in a narrow terminal
    line = ("trainer ranks 0, 2 share this device: nothing is granted while they do (it is idle only while all of "
            "them wait; the bubbles shown are rank 2's)")
    text = render_stats(shared)
    assert f"shared:      {line}" in text.splitlines()
    assert ", 41 from other trainer ranks (ignored)" in text
    assert "share this device" not in render(stats(), TASKS, BUBBLES, width=300) + render_stats(stats())


def test_ranks_quiet_for_a_second_or_more_are_said_to_have_shared_the_device() -> None:
    # Stranger trial: for up to 5 s after the job ended, `stats` and `top` said the ranks share the device, now.
    quiet = stats(shared_by_ranks=(2, 0), shared_quiet_s=3.4)
    assert "SHARED by trainer ranks 0, 2 until 3 s ago: no grants until 5 s quiet" in \
        render(quiet, TASKS, BUBBLES, width=80).splitlines()
    said = ("shared:      trainer ranks 0, 2 shared this device until 3 s ago (no event from them since): nothing is "
            "granted until it has been quiet for 5 s (the bubbles shown are rank 2's)")
    assert said in render_stats(quiet).splitlines()
    busy = stats(shared_by_ranks=(2, 0), shared_quiet_s=0.2)  # events still coming: the present tense
    assert "share this device:" in render_stats(busy) and "until" not in render_stats(busy)


def test_bubble_time_says_which_bubbles_it_leaves_out_after_ranks_shared_the_device() -> None:
    # Stranger trial: both ranks on one core; once the second rank had gone quiet, `stats` read "bubbles: 750,
    # bubble time: 0.000 s" with no word of why.
    after = stats(bubbles=750, bubble_time_s=0.0, bubbles_while_shared=750)
    line = ("bubble time: 0.000 s  (not counting 750 bubbles that ended while trainer ranks shared this device: it "
            "was idle only while all of them waited, which freeride does not follow)")
    assert line in render_stats(after).splitlines()
    assert "bubbles 750  bubble time 0.000 s" in render(after, TASKS, BUBBLES, width=200)
    assert "(750 while shared: not counted)" in render(after, TASKS, BUBBLES, width=200)
    assert "while shared" not in render_stats(stats()) + render(stats(), TASKS, BUBBLES, width=300)


def test_stats_says_how_many_events_were_read_late_on_purpose_and_nothing_when_none() -> None:
    text = render_stats(stats(events_received=900, events_rejected=0, events_late=640))
    assert ("events:      900 received, 0 rejected, 640 read late on purpose (bubbles no task could use: held back by "
            "the trainer for quiet slots, or read every --idle-read-ms; not in the event delay)") in text.splitlines()
    assert "late" not in render_stats(stats())


def test_json_says_null_for_a_p999_that_was_not_computed_not_zero() -> None:
    from freeride._cli.tasks import _to_json

    doc = _to_json(stats(overrun_ms=Percentiles(4, 1.0, 2.0, 3.0, 3.5), end_to_worker_ms=Percentiles(
        9, 0.1, 0.2, 0.3, 0.4, 0.35), park_latency_ms=Percentiles()))
    assert doc["overrun_ms"]["p999"] is None and doc["overrun_ms"]["p99"] == 3.0
    assert doc["end_to_worker_ms"]["p999"] == 0.35  # a whole-run histogram computes it
    assert doc["park_latency_ms"] == {"count": 0, "p50": 0.0, "p90": 0.0, "p99": 0.0, "max": 0.0, "p999": 0.0}


def test_task_table_lists_live_tasks_first_with_why_each_waits_or_failed() -> None:
    frame = render(stats(), TASKS, BUBBLES, width=160)
    rows = [line.split()[0] for line in frame.splitlines() if line.split() and "-" in line.split()[0]]
    assert rows[:5] == ["running-3", "parked-2", "waiting-4", "done-5", "failed-1"]
    assert "needs 64 MiB; 0 B free" in frame
    assert "MEMORY_LIMIT: used 70 MiB over its 64 MiB cap" in frame
    assert "more" not in frame.split("MEMORY_LIMIT")[1].splitlines()[0]  # a failure takes one line
    assert "10 ticks" in frame and "1.5 ms" in frame


def test_bubble_table_has_one_row_per_slot_in_stage_order() -> None:
    frame = render(stats(), TASKS, BUBBLES, width=120)
    section = frame.split("BUBBLES")[1].splitlines()[2:]
    assert section[0].split()[:5] == ["0", "0", "2", "cooldown", "300"]
    assert section[1].split()[:5] == ["1", "1", "0", "warmup", "300"]
    assert "?" in section[0]  # free memory never reported
    assert "1.0 GiB" in section[1] and "4.2%" in section[1]


def test_every_line_fits_the_width() -> None:
    long_name = task("verbose-6", "PARKED", 6.0, spec=TaskSpec(target="a:B", name="n" * 64, memory_bytes=1),
                     waiting_reason="w" * 300)
    frame = render(stats(draining=True), [*TASKS, long_name], BUBBLES, width=60)
    assert all(len(line) <= 60 for line in frame.splitlines())
    assert "DRAINING" in frame
    assert "..." in frame


def test_a_header_line_too_wide_is_broken_between_its_parts_not_cut() -> None:
    # Stranger trial: at 80 columns the header lost its "now" window and its "while shared" count at the edge.
    before = stats(uptime_s=100.0, bubble_time_s=40.0, harvested_s=30.0)
    after = stats(uptime_s=102.0, bubble_time_s=41.0, harvested_s=30.5, bubbles_while_shared=123)
    lines = render(after, [], [], width=80, previous=before).splitlines()
    head = lines[:lines.index("")]
    assert all(len(line) <= 80 for line in head)
    assert not any(line.endswith("...") for line in head)
    text = " ".join(line.strip() for line in head)
    assert "now: the last 2.0s)" in text and "(123 while shared: not counted)" in text
    assert "memory budget 3.0 GiB" in text
    assert head[1].startswith("  (totals since the manager started")  # a continuation is indented under its line
    wide = render(after, [], [], width=200, previous=before).splitlines()
    assert len(wide[:wide.index("")]) == len(head) - 3  # three lines broke at 80, none at 200


def test_a_narrow_screen_leaves_whole_bubble_columns_out_rather_than_cutting_rows() -> None:
    lines = render(stats(), [], BUBBLES, width=80).splitlines()
    table = lines[lines.index("BUBBLES (recent, per stage/rank/slot)") + 1:]
    assert table[0].split() == ["STAGE", "RANK", "SLOT", "KIND", "COUNT", "P50", "P99", "PREDICTED", "MIN", "FREE"]
    assert not any(line.endswith("...") for line in table)
    assert "25.0 ms" in table[1] and "30.0 ms" not in table[1]  # P99 kept, MAX left out
    full = render(stats(), [], BUBBLES, width=160).splitlines()
    assert "MAX" in full[full.index("BUBBLES (recent, per stage/rank/slot)") + 1]


def test_a_short_terminal_keeps_the_header_and_counts_the_rows_left_out() -> None:
    many = [task(f"t-{i}", "PARKED", float(i)) for i in range(40)]
    frame = render(stats(), many, BUBBLES, width=120, height=20)
    lines = frame.splitlines()
    assert len(lines) <= 20
    assert lines[0].startswith("freeride top")
    assert any(line.startswith("... ") and line.endswith("more tasks") for line in lines)
    assert "BUBBLES" in frame and "cooldown" in frame  # the bubbles keep their room


def test_previous_frame_adds_the_shares_of_the_last_interval() -> None:
    before = stats(uptime_s=100.0, bubble_time_s=40.0, harvested_s=30.0)
    after = stats(uptime_s=102.0, bubble_time_s=41.0, harvested_s=30.5)
    frame = render(after, [], [], width=120, previous=before)
    assert "50.0% now" in frame  # 1 s of bubbles in 2 s
    assert "(74.4% of bubble time, 50.0% now)" in frame  # 0.5 s harvested of that 1 s


def test_header_and_task_rows_name_their_windows_and_each_tasks_now_adds_up_to_the_headers() -> None:
    # Stranger trial: the header's shares and the task rows used different windows, and said neither.
    before = stats(uptime_s=100.0, bubble_time_s=40.0, harvested_s=30.0)
    after = stats(uptime_s=102.0, bubble_time_s=41.0, harvested_s=30.5)
    earlier = [task("a-1", "PARKED", 1.0, harvested_s=10.0), task("b-2", "PARKED", 2.0, harvested_s=20.0)]
    later = [task("a-1", "PARKED", 1.0, harvested_s=10.125), task("b-2", "PARKED", 2.0, harvested_s=20.375)]
    frame = render(after, later, [], width=160, previous=before, previous_tasks=earlier)
    lines = frame.splitlines()
    assert "totals since the manager started; now: the last 2.0s" in lines[0]
    assert "(74.4% of bubble time, 50.0% now)" in frame
    assert "TASKS (2; harvested since submitted, NOW over the header's now, step p95 over recent steps)" in frame
    header = next(line for line in lines if line.startswith("ID "))
    column = header.index("NOW")
    now = {line.split()[0]: line[column:].split()[0] for line in lines if line.startswith(("a-1", "b-2"))}
    assert now == {"a-1": "12.5%", "b-2": "37.5%"}  # 0.125 s and 0.375 s of the interval's 1 s: 50% in all


def test_a_drained_managers_waiting_tasks_show_as_drained() -> None:
    frame = render(stats(draining=True), [task("waiting-4", "SUBMITTED", 4.0)], [], width=120)
    row = next(line for line in frame.splitlines() if line.startswith("waiting-4"))
    assert row.split()[2] == "DRAINED" and "DRAINING" in frame.splitlines()[0]


def test_empty_manager_says_so_and_a_notice_is_shown() -> None:
    empty = stats(bubbles=0, bubble_time_s=0.0, harvested_s=0.0, tasks_by_state={}, memory_budget_bytes=-1,
                  overrun_ms=Percentiles(), grant_latency_ms=Percentiles(), park_latency_ms=Percentiles())
    frame = render(empty, [], [], width=100, notice="no manager answers at unix:/x.sock")
    assert "no tasks" in frame and "no bubbles reported yet" in frame
    assert "grant p99 -" in frame and "memory budget unknown yet" in frame and "of uptime" in frame
    assert "! no manager answers at unix:/x.sock" in frame


def test_order_tasks_puts_newest_ended_task_first() -> None:
    ended = [task("a-1", "FINISHED", 1.0), task("b-2", "CANCELLED", 2.0)]
    assert [t.task_id for t in order_tasks(ended)] == ["b-2", "a-1"]


# ------------------------------------------------------------------ the live loop on a fake screen


class FakeScreen:
    """Keys come from a script; waiting for a key with none pressed advances the fake clock."""

    def __init__(self, keys: list[int]) -> None:
        self.keys = keys
        self.now = 0.0
        self.delay_ms = 0
        self.frames: list[list[str]] = []

    def clock(self) -> float:
        return self.now

    def getmaxyx(self) -> tuple[int, int]:
        return (30, 100)

    def erase(self) -> None:
        self.frames.append([])

    def addnstr(self, y: int, x: int, text: str, n: int) -> None:
        assert x == 0 and n == 99 and len(text) <= n
        self.frames[-1].append(text)

    def refresh(self) -> None:
        pass

    def timeout(self, delay_ms: int) -> None:
        self.delay_ms = delay_ms

    def getch(self) -> int:
        key = self.keys.pop(0)
        if key == -1:
            self.now += self.delay_ms / 1000
        return key


NOKEY, QUIT, RESIZE = -1, ord("q"), 410


def snapshot(bubbles: int = 10) -> Snapshot:
    return Snapshot(stats(bubbles=bubbles, uptime_s=10.0 + bubbles), [], [])


def test_live_view_refreshes_every_interval_until_q() -> None:
    screen = FakeScreen([NOKEY, NOKEY, QUIT])
    answers = iter([snapshot(11), snapshot(12)])
    live_view(screen, lambda: next(answers), snapshot(10), interval_s=1.0, clock=screen.clock, resize_key=RESIZE)
    assert [frame[1].split()[1] for frame in screen.frames] == ["10", "11", "12"]
    assert "now" in screen.frames[-1][1]


def test_live_view_redraws_on_resize_without_asking_the_manager() -> None:
    screen = FakeScreen([RESIZE, QUIT])

    def refresh() -> Snapshot:
        raise AssertionError("a resize must not fetch")

    live_view(screen, refresh, snapshot(), interval_s=1.0, clock=screen.clock, resize_key=RESIZE)
    assert len(screen.frames) == 2


def test_live_view_shows_a_vanished_manager_and_recovers_when_it_returns() -> None:
    screen = FakeScreen([NOKEY, NOKEY, QUIT])
    answers: list[Snapshot | Exception] = [ManagerUnavailable("no manager answers at unix:/m.sock"), snapshot(12)]

    def refresh() -> Snapshot:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    live_view(screen, refresh, snapshot(10), interval_s=0.5, clock=screen.clock, resize_key=RESIZE)
    assert any(line.startswith("! no manager answers at unix:/m.sock") for line in screen.frames[1])
    assert screen.frames[1][1].split()[1] == "10"  # the last figures stay on screen
    assert not any(line.startswith("!") for line in screen.frames[2])
    assert screen.frames[2][1].split()[1] == "12"


def test_the_text_view_says_an_outage_once_and_when_the_manager_answers_again(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # Found by a stranger: without a terminal, every refresh of an outage printed its line (2,970 lines in 30 s).
    gone = ManagerUnavailable("no manager answers at unix:/m.sock")
    answers: list[Snapshot | Exception] = [gone, gone, gone, gone, snapshot(12)]

    def refresh() -> Snapshot:
        if not answers:
            raise KeyboardInterrupt
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(top, "sleep", lambda seconds: None)
    with pytest.raises(KeyboardInterrupt):
        top._text_main(refresh, snapshot(10), interval_s=0.2, width=100)
    out, err = capsys.readouterr()
    assert err.splitlines() == ["freeride top: no manager answers at unix:/m.sock; retrying every 0.2 s",
                                "freeride top: the manager answers again"]
    assert out.count("freeride top - ") == 2


# ------------------------------------------------------------------ the command against a real manager


@pytest.fixture
def short_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="frtop-"))  # unix socket paths are limited to about 100 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def manager(short_dir: Path, tmp_path: Path) -> Iterator[Manager]:
    m = Manager(DEVICE, endpoint=Endpoint("unix", str(short_dir / "m.sock")), state_dir=tmp_path / "state")
    m.start()
    try:
        yield m
    finally:
        m.stop()


def test_top_once_prints_one_frame_of_a_real_manager(manager: Manager, capsys: pytest.CaptureFixture[str]) -> None:
    with ControlClient(manager.endpoint) as client:
        info = client.submit(TaskSpec(target="sample_tasks:Counter", memory_bytes=2**26, name="ticker",
                                      working_dir=str(TESTS_DIR)))
    capsys.readouterr()
    code = main(["top", "--once", "--endpoint", str(manager.endpoint)])
    out, err = capsys.readouterr()
    assert code == EXIT_OK, err
    assert out.startswith("freeride top - cpu:0  up ")
    assert out.count("freeride top - ") == 1
    assert info.task_id in out and "ticker" in out
    assert "no bubbles reported yet" in out


def test_top_without_a_tty_prints_frames_one_after_another_until_ctrl_c_which_exits_130(
    manager: Manager, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    sleeps: list[float] = []

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        if len(sleeps) == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(top, "sleep", sleep)  # only the view's own waits
    capsys.readouterr()
    code = main(["top", "--interval", "0.25", "--endpoint", str(manager.endpoint)])
    out, _ = capsys.readouterr()
    assert code == 130  # Ctrl-C ends the view as it ends every command (it exited 0; the README says 130)
    assert out.count("freeride top - cpu:0") == 3  # never cleared: every frame stays in the output
    assert "\x1b" not in out  # no terminal control sequences in a pipe
    assert sleeps == [0.25, 0.25, 0.25]


def test_top_without_a_manager_exits_3_naming_the_endpoint(
    short_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    endpoint = f"unix:{short_dir}/nobody.sock"
    code = main(["top", "--once", "--endpoint", endpoint])
    out, err = capsys.readouterr()
    assert code == EXIT_NO_MANAGER
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and endpoint in lines[0] and "freeride manager --device cpu:0" in lines[0]


@pytest.mark.parametrize("interval", ["0", "-1", "nan", "1e9"])
def test_top_rejects_a_bad_interval(interval: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["top", "--once", "--interval", interval, "--endpoint", "unix:/nonexistent/m.sock"])
    assert code == EXIT_BAD_INPUT
    assert "--interval" in capsys.readouterr().err


def test_stats_says_what_each_latency_and_overrun_count_covers() -> None:
    # Stranger trial: grant latency n=117, park latency n=781 and 845 overruns, with no word of what each counts.
    lines = {line.split(":")[0]: line for line in render_stats(stats()).splitlines()}
    assert lines["overruns"].endswith("(grants whose side task still ran past the bubble's real end, by how much)")
    assert "(bubble start received -> first step; a bubble's first grant" in lines["grant lat."]
    assert "(end received -> parked" in lines["park lat."]
    quiet = render_stats(stats(overruns=0, overrun_ms=Percentiles(0, 0, 0, 0, 0)))
    assert "ran past the bubble's real end" not in quiet



def test_stats_says_how_many_overruns_were_of_a_step_that_looked_hung() -> None:
    # Sixth trial: a hung step's overruns, one at each of its turns, swamped the overrun line.
    line = next(ln for ln in render_stats(stats(overruns=5910, hung_overruns=5890)).splitlines()
                if ln.startswith("overruns"))
    assert line.split()[1] == "5910"
    assert line.endswith("; 5890 of a step that looked hung (thawed at its turns, not in the percentiles)")
    assert "looked hung" not in render_stats(stats())

# ------------------------------------------------------------------ reasons that do not fit

LONG_REASON = ("frozen in setup() after overrunning a bubble; its worker had no core for 10.9 s of the 10.9 s of "
               "bubbles granted since setup() began (the core is busy with other work, and a worker runs at the "
               "lowest CPU priority)")
STARVED = [task("starved-1", "FROZEN", 1.0, waiting_reason=LONG_REASON),
           task("parked-2", "PARKED", 2.0, waiting_reason="waiting for a bubble"),
           task("running-3", "RUNNING", 3.0)]


def test_ls_puts_a_reason_too_long_for_the_terminal_under_its_row_whole_and_keeps_a_column_where_it_fits() -> None:
    # Stranger trial: `ls` and `top` cut the WHY column, or the terminal broke it across the next row.
    from freeride._cli.tasks import render_task_table

    narrow = render_task_table(STARVED, width=100).splitlines()
    assert all(len(line) <= 100 for line in narrow)
    assert "WHY" not in narrow[0]
    assert narrow[1].startswith("starved-1") and narrow[2].startswith("    why: frozen in setup()")
    under = [line for line in narrow if line.startswith("    ")]
    assert " ".join(line.split(":", 1)[1] if line.startswith("    why:") else line for line in under[:-1]
                    ).split() == LONG_REASON.split()  # the whole reason, wrapped, nothing cut
    assert under[-1] == "    why: waiting for a bubble"
    assert [line.split()[0] for line in narrow if not line.startswith(" ")] == ["ID", "starved-1", "parked-2",
                                                                                 "running-3"]
    wide = render_task_table(STARVED, width=400).splitlines()
    assert wide[0].split()[-1] == "WHY" and wide[1].endswith(LONG_REASON) and len(wide) == 4
    assert render_task_table(STARVED).splitlines() == wide  # no width (a pipe): one line per task


def test_top_puts_a_long_reason_under_its_row_in_two_lines_at_most_and_counts_clipped_rows_not_lines() -> None:
    frame = render(stats(), STARVED, BUBBLES, width=100).splitlines()
    assert all(len(line) <= 100 for line in frame)
    row = next(i for i, line in enumerate(frame) if line.startswith("starved-1"))
    assert frame[row + 1].startswith("    why: frozen in setup()")
    assert frame[row + 2].startswith("         ") and frame[row + 2].endswith("...")
    assert frame[row + 3].startswith("parked-2")
    assert frame[row + 4] == "    why: waiting for a bubble"
    # a screen too short for every task: the last line counts the tasks left out, not their reasons' lines
    short = render(stats(), STARVED, BUBBLES, width=100, height=14).splitlines()
    assert "... 2 more tasks" in short


def test_the_queues_ls_puts_a_long_last_word_under_its_row() -> None:
    from freeride._cli.cluster import render_table
    from freeride._cluster.records import ClusterRecord, Submission

    aside = ("its submission cannot be read: args_json is not a JSON object (expected a mapping of argument "
             "names to values, got a list)")
    recs = [ClusterRecord("task-a", Submission(target="m:C", args_json="[]", memory_bytes=2**26), aside=aside),
            ClusterRecord("task-b", Submission(target="m:C", args_json="{}", memory_bytes=2**26), reason="claimed")]
    narrow = render_table(recs, width=90).splitlines()
    assert all(len(line) <= 90 for line in narrow) and "LAST" not in narrow[0]
    assert narrow[1].startswith("task-a") and narrow[2].startswith("    why: set aside: its submission")
    assert narrow[-2].startswith("task-b") and narrow[-1] == "    why: claimed"
    wide = render_table(recs).splitlines()
    assert wide[0].split()[-1] == "LAST" and wide[1].endswith(f"set aside: {aside}") and len(wide) == 3


def test_stats_says_where_granted_time_went_only_where_far_less_of_it_was_harvested() -> None:
    # Stranger trial: "granted: 2.506 s" beside "harvested: 0.217 s" and nothing said where the rest went.
    text = render_stats(stats(granted_s=2.5, harvested_s=0.2))
    assert "granted:     2.500 s  (bubble time handed to side tasks; harvested counts only what their steps ran" in text
    assert "waits for the rank's core" not in render_stats(stats(granted_s=1.0, harvested_s=0.8))


def test_stats_says_that_overruns_the_trainer_stopped_are_the_usual_end_of_a_grant_on_a_cpu_device() -> None:
    # Stranger trial: "overruns: 1105" beside a p50 of 19 us read as a problem.
    text = render_stats(stats(overruns=1105, trainer_stops=756))
    assert "; 756 stopped by the trainer at the end (on a cpu:N device the usual end of a grant" in text
    assert "stopped by the trainer" not in render_stats(stats())
