"""End-to-end: the real manager loop, real worker processes on cpu:0, bubbles over a real stream."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import TESTS_DIR, ManagerHarness, cpu_devices, holds_for, read_steps, wait_for

from freeride.messages import BubbleEnd, BubbleStart, TaskSpec

pytestmark = pytest.mark.e2e


def work_dir(h: ManagerHarness, task_id: str) -> Path:
    return h.manager.loop.task_dir(task_id) / "work"


def test_task_steps_start_only_inside_bubbles(harness: ManagerHarness) -> None:
    task = harness.submit("sample_tasks:Counter", args={"step_ms": 1.0})
    harness.wait_state(task.task_id, "PARKED")
    holds_for(lambda: read_steps(work_dir(harness, task.task_id)) == [], 0.3, "no step runs while no bubble is open")
    feeder = harness.feeder()
    feeder.run(25, length_ms=25, gap_ms=15)
    # A step frozen at the last bubble's end (a loaded machine) finishes in a later bubble and its worker parks
    # there: until then the manager has not had the steps of that grant.
    feeder.run_until(lambda: harness.client.get(task.task_id).state == "PARKED", length_ms=25, gap_ms=15,
                     timeout_s=60)
    accepted, rejected = feeder.close()
    assert (accepted, rejected) == (2 * len(feeder.sent), 0)
    info = harness.client.get(task.task_id)
    steps = read_steps(work_dir(harness, task.task_id))
    assert len(steps) > 25, "the task should harvest several steps per bubble"
    assert info.steps == len(steps)
    for start, _end in steps:
        assert any(b.start_ns <= start <= b.predicted_end_ns for b in feeder.sent), (
            f"a step started at {start} outside every bubble"
        )
    holds_for(lambda: len(read_steps(work_dir(harness, task.task_id))) == len(steps), 0.2,
              "no step runs after the last bubble")
    stats = harness.client.stats()
    assert stats.bubbles == len(feeder.sent)
    assert 0 < stats.harvested_s <= stats.bubble_time_s


def test_crashing_task_fails_with_its_traceback_and_the_others_keep_running(harness: ManagerHarness) -> None:
    crasher = harness.submit("sample_tasks:Crasher", args={"crash_at": 3})
    counter = harness.submit("sample_tasks:Counter", args={"step_ms": 1.0})
    feeder = harness.feeder()
    feeder.run_until(lambda: harness.client.get(crasher.task_id).state == "FAILED")
    failed = harness.client.get(crasher.task_id)
    assert failed.failure is not None
    assert failed.failure.kind == "EXCEPTION"
    assert failed.failure.step == 3
    assert "ValueError: boom at step 3" in failed.failure.traceback
    assert failed.steps == 3 and failed.progress == 3.0  # the work of the grant it died in is counted
    before = harness.client.get(counter.task_id).steps
    # Progress, however long a loaded machine makes it take: a 1 ms step measured at tens of ms
    # (workers run at nice 19) fits only long bubbles, or waits for its re-probe.
    feeder.run_until(lambda: harness.client.get(counter.task_id).steps > before, length_ms=100, timeout_s=60)
    feeder.close()


def test_a_task_in_a_long_setup_leaves_bubbles_to_a_task_that_steps(harness: ManagerHarness) -> None:
    # On an H200 the demo's watermark task, setting up in grants, took every bubble for 23 s while the tasks past
    # their first steps ran none: a setup kept the first turn until it finished.
    slow = harness.submit("sample_tasks:SlowSetup", args={"setup_cpu_ms": 30_000})
    counter = harness.submit("sample_tasks:Counter", args={"step_ms": 1.0})
    feeder = harness.feeder()
    feeder.run_until(lambda: harness.client.get(counter.task_id).steps >= 20, length_ms=20, gap_ms=10,
                     timeout_s=90)
    feeder.close()
    assert harness.client.get(slow.task_id).steps == 0  # still in its setup: the counter's steps were its turns


def test_setup_error_is_a_failure_record(harness: ManagerHarness) -> None:
    task = harness.submit("sample_tasks:SetupCrasher")
    feeder = harness.feeder()
    feeder.run_until(lambda: harness.client.get(task.task_id).state == "FAILED")
    feeder.close()
    failure = harness.client.get(task.task_id).failure
    assert failure is not None and failure.kind == "EXCEPTION"
    assert "cannot set up" in failure.traceback
    assert "setup" in failure.message


def test_unknown_class_fails_at_load_with_import_record(harness: ManagerHarness) -> None:
    task = harness.submit("sample_tasks:NoSuchTask")
    info = harness.wait_state(task.task_id, "FAILED")
    assert info.failure is not None and info.failure.kind == "IMPORT"
    assert "NoSuchTask" in info.failure.message


def test_module_that_exits_at_import_is_an_import_record(harness: ManagerHarness) -> None:
    # Issue 13: SystemExit at import ended the worker without a record (and the CLI with the module's code).
    task = harness.submit("exits_at_import:Task")
    info = harness.wait_state(task.task_id, "FAILED")
    assert info.failure is not None and info.failure.kind == "IMPORT", info.failure
    assert "SystemExit: 7" in info.failure.message


def test_segfault_is_recorded_with_signal_and_log_tail(harness: ManagerHarness) -> None:
    task = harness.submit("sample_tasks:Segfaulter")
    feeder = harness.feeder()
    feeder.run_until(lambda: harness.client.get(task.task_id).state == "FAILED")
    feeder.close()
    failure = harness.client.get(task.task_id).failure
    assert failure is not None
    assert failure.kind == "SIGNAL" and failure.signal == signal.SIGSEGV
    assert "worker pid" not in failure.log_tail  # the tail is the worker's own output
    assert failure.step == 2


def test_small_cap_holds_a_task_that_imports_torch_on_a_cpu_core(harness: ManagerHarness) -> None:
    # The worker's interpreter and torch (~200 MiB resident) are its baseline, outside the cap.
    task = harness.submit("sample_tasks:TorchCounter", memory_mib=16, args={"step_ms": 1.0})
    feeder = harness.feeder()
    feeder.run_until(lambda: harness.client.get(task.task_id).steps >= 50, length_ms=50, timeout_s=60)
    feeder.close()
    info = harness.client.get(task.task_id)
    assert info.state != "FAILED", info.failure


def test_a_drain_counts_as_checkpointed_only_tasks_whose_checkpoint_holds_their_last_step(
    harness: ManagerHarness,
) -> None:
    # Stranger trial: a task drained while starting was reported "1 checkpointed" with no checkpoint.
    starting = harness.submit("sample_tasks:SlowInit", args={"init_s": 60.0})
    harness.wait_state(starting.task_id, "STARTING")
    assert harness.client.drain(timeout_s=30) == (1, 0, 0)
    assert harness.client.get(starting.task_id).checkpoint_step == -1


def test_a_drain_says_how_many_tasks_it_had_to_kill_past_the_stop_timeout(make_manager: object) -> None:
    # Stranger trial: a task hung in a step was killed after the stop timeout, and the drain read "1 parked".
    # The counter has the stop timeout to checkpoint and exit: at 300 ms, a loaded machine starved its worker
    # (nice 19) past it and the drain killed both.
    h: ManagerHarness = make_manager(stop_timeout_ns=3_000_000_000)  # type: ignore[operator]
    hanger = h.submit("sample_tasks:Hanger", args={"hang_at": 2})
    counter = h.submit("sample_tasks:Counter", args={"step_ms": 1.0})
    feeder = h.feeder()
    # Frozen in its hang (not in an earlier step a loaded machine starved past a bubble's end: that one finished
    # once the drain thawed it, and nothing was killed).
    hung = work_dir(h, hanger.task_id) / "fault_at"
    feeder.run_until(lambda: hung.exists() and h.client.get(hanger.task_id).state == "FROZEN", length_ms=20,
                     gap_ms=30)
    feeder.close()
    drained = h.client.drain(timeout_s=30)
    assert (drained.parked, drained.killed) == (2, 1)
    assert h.client.get(counter.task_id).state == "SUBMITTED"  # it went back: nothing lost


def test_a_task_that_grows_fast_is_failed_near_its_cap_not_a_watchdog_poll_past_it(harness: ManagerHarness) -> None:
    # Stranger trial: 2 MiB a step at a 40 MiB cap was failed at 82 MiB, 50 ms of steps after the cap (the manager's
    # watchdog poll). The worker now reads its own resident set between steps, every millisecond of them at most.
    hog = harness.submit("sample_tasks:MemoryHog", memory_mib=40, args={"mib_per_step": 2, "step_ms": 0.0})
    feeder = harness.feeder()
    feeder.run_until(lambda: harness.client.get(hog.task_id).state == "FAILED", length_ms=200, timeout_s=60)
    failure = harness.client.get(hog.task_id).failure
    assert failure is not None and failure.kind == "MEMORY_LIMIT", failure
    figures = re.search(r"used ([0-9.]+) MiB .* over its cap of ([0-9.]+) MiB", failure.message)
    assert figures is not None, failure.message
    # at most a millisecond of 2 MiB steps past the cap (a step writes its 2 MiB in a quarter of a millisecond or
    # more), where a 50 ms poll let it reach twice the cap
    assert 40 < float(figures[1]) < 60, failure.message


def test_task_over_its_memory_cap_fails_with_memory_limit(harness: ManagerHarness) -> None:
    hog = harness.submit("sample_tasks:MemoryHog", memory_mib=200, args={"mib_per_step": 16})
    other = harness.submit("sample_tasks:Counter", args={"step_ms": 1.0})
    feeder = harness.feeder()
    feeder.run_until(lambda: harness.client.get(hog.task_id).state == "FAILED", length_ms=100, timeout_s=60)
    failure = harness.client.get(hog.task_id).failure
    assert failure is not None and failure.kind == "MEMORY_LIMIT"
    # the figures have as many decimals as tell them apart, so a use just past the cap reads "200.05 ... 200.00"
    figures = re.search(r"used ([0-9.]+) MiB .* over its cap of ([0-9.]+) MiB", failure.message)
    assert figures is not None, failure.message
    assert float(figures[2]) == 200 and float(figures[1]) > 200
    before = harness.client.get(other.task_id).steps
    feeder.run_until(lambda: harness.client.get(other.task_id).steps > before, length_ms=100, timeout_s=60)
    feeder.close()


def test_a_step_hung_in_its_first_grant_leaves_other_tasks_bubbles_before_its_step_timeout(
    make_manager: object,
) -> None:
    # Stranger trial: steps 0-1 ran and step 2 hung inside one first grant; the hung task was
    # thawed first in every bubble until its step timeout, and the others made no progress.
    h: ManagerHarness = make_manager(step_timeout_ns=3_600 * 10**9)  # type: ignore[operator]
    hanger = h.submit("sample_tasks:Hanger", args={"hang_at": 2, "step_ms": 0.5})
    feeder = h.feeder()
    feeder.run_until(lambda: h.client.get(hanger.task_id).state == "FROZEN", length_ms=20, gap_ms=10)
    other = h.submit("sample_tasks:Counter", args={"step_ms": 1.0})
    feeder.run_until(lambda: h.client.get(other.task_id).steps >= 20, length_ms=20, gap_ms=10, timeout_s=60)
    feeder.close()
    info = h.client.get(hanger.task_id)
    assert info.state in ("FROZEN", "RUNNING")  # still stuck, not failed
    assert info.steps == 2  # steps 0-1, counted from its board if it never parked after them


def test_a_step_hung_in_a_busy_loop_on_a_core_a_rank_computes_on_between_bubbles_fails_on_its_step_timeout(
    make_manager: object,
) -> None:
    # Stranger trial: a busy-looping step on a rank's core ran through 10,000 freezes past a 60 s step timeout,
    # first in every bubble. Frozen mid-step, the worker (nice 19) waited for the core while the rank computed,
    # its stop landing at the next bubble, and that wait, outside any grant, came off the step's granted time.
    # Here a rival at the default nice computes on the manager's core between bubbles, as a rank does.
    h: ManagerHarness = make_manager(step_timeout_ns=1_000_000_000)  # type: ignore[operator]
    core = h.manager.device.name.index  # cpu:N: workers run on core N
    rival = subprocess.Popen([sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{core}}})\n"
                              "while True:\n    pass\n"])
    try:
        os.kill(rival.pid, signal.SIGSTOP)  # it computes only between bubbles
        task = h.submit("sample_tasks:Hanger", args={"hang_at": 2})
        h.wait_state(task.task_id, "PARKED")
        feeder = h.feeder()
        deadline = time.monotonic() + 30
        it = 0
        while h.client.get(task.task_id).state != "FAILED":
            assert time.monotonic() < deadline, f"not failed in 30 s of bubbles: {h.client.get(task.task_id)}"
            start = time.monotonic_ns()
            feeder.send(BubbleStart(0, 0, it, 0, "test", start, 10_000_000))
            time.sleep(0.01)
            os.kill(rival.pid, signal.SIGCONT)  # the rank computes from the bubble's end, before the end's event
            feeder.send(BubbleEnd(0, 0, it, 0, time.monotonic_ns()))
            time.sleep(0.15)  # far longer than its bubbles, as in training
            os.kill(rival.pid, signal.SIGSTOP)
            it += 1
        feeder.close()
    finally:
        rival.kill()
        rival.wait()
    info = h.client.get(task.task_id)
    assert info.failure is not None and info.failure.kind == "STEP_TIMEOUT", info


def test_step_that_ignores_the_bubble_end_is_frozen_then_fails_on_step_timeout(
    make_manager: object,
) -> None:
    h: ManagerHarness = make_manager(step_timeout_ns=400_000_000)  # type: ignore[operator]
    task = h.submit("sample_tasks:Hanger", args={"hang_at": 2})
    feeder = h.feeder()
    seen_frozen = False

    def frozen_or_failed() -> bool:
        nonlocal seen_frozen
        state = h.client.get(task.task_id).state
        seen_frozen |= state == "FROZEN"
        return state == "FAILED"

    feeder.run_until(frozen_or_failed, length_ms=20, gap_ms=30)
    feeder.close()
    info = h.client.get(task.task_id)
    assert seen_frozen
    assert info.failure is not None and info.failure.kind == "STEP_TIMEOUT"
    assert info.overruns >= 1
    overrun = h.client.stats().overrun_ms
    assert overrun.count >= 1


def test_step_longer_than_every_bubble_is_never_granted_again(harness: ManagerHarness) -> None:
    # 60 ms of CPU a step: spun on the wall clock, a step on a loaded core got a few ms of CPU, its cost (its time
    # less its wait for the core) fitted the 10 ms bubbles, and the estimate this test waits for never came.
    task = harness.submit("sample_tasks:Counter", args={"step_ms": 60.0, "cpu_time": True})
    feeder = harness.feeder()
    # Learned once its step time is known: the first step is a warm-up and no sample, so on a loaded
    # machine a second probe may run before the estimate exists. Wait for the estimate, not a count.
    feeder.run_until(lambda: "fits no bubble as predicted" in harness.client.get(task.task_id).waiting_reason,
                     length_ms=10, gap_ms=30)
    steps = harness.client.get(task.task_id).steps
    feeder.run(10, length_ms=10, gap_ms=10)
    feeder.close()
    info = harness.wait_state(task.task_id, "PARKED")
    assert info.steps == steps
    assert "fits no bubble as predicted" in info.waiting_reason


def test_worker_that_closes_its_channel_is_killed_with_protocol_record(harness: ManagerHarness) -> None:
    task = harness.submit("sample_tasks:ChannelCloser")
    feeder = harness.feeder()
    feeder.run_until(lambda: harness.client.get(task.task_id).state == "FAILED", gap_ms=20)
    feeder.close()
    failure = harness.client.get(task.task_id).failure
    assert failure is not None and failure.kind == "PROTOCOL"


def test_cancel_kills_the_worker_and_its_children(harness: ManagerHarness) -> None:
    task = harness.submit("sample_tasks:Spawner")
    feeder = harness.feeder()
    pid_file = work_dir(harness, task.task_id) / "child.pid"
    feeder.run_until(pid_file.exists)
    feeder.close()
    child = int(pid_file.read_text())
    worker = harness.client.get(task.task_id).pid
    assert psutil.pid_exists(child)
    assert harness.client.cancel(task.task_id).state == "CANCELLED"
    wait_for(lambda: not psutil.pid_exists(worker) and not _alive(child), 10)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_command_task_runs_only_in_slices_and_finishes(harness: ManagerHarness, tmp_path: Path) -> None:
    out = tmp_path / "count.txt"
    script = (
        "import time\n"
        f"open({str(out)!r}, 'w').write('started')\n"
        "t = time.monotonic()\n"
        "n = 0\n"
        "while n < 20000:\n    n += 1\n"
        f"open({str(out)!r}, 'w').write('done')\n"
    )
    import sys

    info = harness.client.submit(
        __import__("freeride").TaskSpec(command=(sys.executable, "-c", script), memory_bytes=512 * 2**20)
    )
    feeder = harness.feeder()
    harness.wait_state(info.task_id, "PARKED")  # its process exists, frozen until a bubble
    holds_for(lambda: not out.exists(), 0.5, "the command runs no instruction before a bubble")
    feeder.run_until(lambda: harness.client.get(info.task_id).state in ("FINISHED", "FAILED"), length_ms=30)
    feeder.close()
    final = harness.client.get(info.task_id)
    assert final.state == "FINISHED", final.failure
    assert out.read_text() == "done"


@pytest.mark.parametrize("argv", [("/bin/sh", "-c", "exit 7"),
                                  (sys.executable, "-c", "import time; time.sleep(0.1); raise SystemExit(7)")],
                         ids=["at-once", "after-slices"])
def test_a_command_task_that_exits_with_an_error_fails_with_its_exit_code(
    harness: ManagerHarness, argv: tuple[str, ...]
) -> None:
    # Stranger trial: `/bin/false` and `sh -c 'sleep 1; exit 7'` were FINISHED, with no failure record. (With
    # `sh -c 'sleep 0.1; exit 7'` here, one CI run of five left the task FROZEN in setup() for 30 s of bubbles:
    # its worker, at the lowest CPU priority, had no core beside the suite's processes in any of its grants;
    # reproduced beside two busy loops, and now said so in its waiting reason. A command that needs less CPU
    # time to reach its exit keeps the test clear of that; the unit tests cover that script's exit.)
    info = harness.client.submit(__import__("freeride").TaskSpec(command=argv, memory_bytes=64 * 2**20))
    feeder = harness.feeder()
    feeder.run_until(lambda: harness.client.get(info.task_id).state in ("FINISHED", "FAILED"), length_ms=30)
    feeder.close()
    final = harness.client.get(info.task_id)
    assert final.state == "FAILED" and final.failure is not None
    assert "exited with code 7" in final.failure.message


def test_malformed_bubble_events_are_counted_not_fatal(harness: ManagerHarness) -> None:
    from freeride.messages import BubbleEnd, BubbleStart

    feeder = harness.feeder()
    now = time.monotonic_ns()
    feeder.send(BubbleStart(0, 0, 0, 0, "x", now, -5, -1))  # negative length: refused by the servicer
    feeder.send(BubbleStart(0, 0, 1, 0, "x", 0, 5_000_000, -1))  # no start time: refused by the servicer
    feeder.send(BubbleEnd(0, 0, 9, 0, now))  # well-formed, but an end without its start: the core ignores it
    feeder.bubble(10)  # a good bubble after them, on the same stream
    feeder.send(None)  # type: ignore[arg-type]  # the trainer closes its stream
    summary = feeder.stream.summary(10)
    feeder.stream.close()
    assert (summary.accepted, summary.rejected) == (3, 2)
    assert "start_ns must be a positive monotonic time" in summary.last_error  # the last refused one's reason
    # The manager counts the well-formed but out-of-order end that the scheduler ignored apart.
    stats = harness.client.stats()
    assert (stats.events_rejected, stats.events_ignored, stats.events_received) == (2, 1, 3)
    # Only the good bubble was measured; the stream, and the manager, went on.
    assert stats.bubbles == 1
    [slot] = harness.client.bubbles()
    assert slot.count == 1 and slot.length_ms.count == 1 and slot.length_ms.p50 >= 10
    assert slot.predicted_ms.p50 == 10


def test_drain_checkpoints_every_task_and_they_resume_on_a_new_manager(make_manager: object) -> None:
    h: ManagerHarness = make_manager()  # type: ignore[operator]
    task = h.submit("sample_tasks:Counter", args={"step_ms": 1.0})
    feeder = h.feeder()
    feeder.run_until(lambda: h.client.get(task.task_id).steps >= 20)
    feeder.close()
    parked, _, _ = h.client.drain(timeout_s=20)
    assert parked == 1
    info = h.client.get(task.task_id)
    assert info.state == "SUBMITTED"
    assert info.checkpoint_step == info.steps >= 20
    assert h.client.stats().draining
    os.environ.pop("FREERIDE_ENDPOINT", None)


def test_ends_that_arrive_after_a_freeze_are_measured_and_every_bubble_is_counted(harness: ManagerHarness) -> None:
    # Issue 13: a step that overran its bubble's predicted end was frozen and the bubble closed with
    # it, so the trainer's real end, coming later, was counted as rejected and the bubble went missing
    # from `freeride bubbles`.
    task = harness.submit("sample_tasks:Counter", args={"step_ms": 60.0})
    harness.wait_state(task.task_id, "PARKED")
    feeder = harness.feeder()
    feeder.run(6, length_ms=80, predicted_ms=5, gap_ms=10)  # its first step (a probe) overruns 5 ms
    assert feeder.close() == (12, 0)
    stats = harness.client.stats()
    assert stats.events_rejected == 0
    assert sum(slot.count for slot in harness.client.bubbles()) == 6
    assert stats.overruns >= 1


def test_a_task_that_prints_without_end_keeps_a_bounded_log_and_its_last_words(tmp_path: Path) -> None:
    # Issue 13: a task that printed 50 MB left a 50 MB log. Now the log is rotated at its limit, and a
    # failure record still quotes the last lines before the crash.
    from conftest import cpu_devices

    from freeride._manager.daemon import Manager
    from freeride._wire.client import ControlClient
    from freeride.endpoints import Endpoint

    limit = 512 * 1024
    sock = Path(f"/tmp/fr-log-{os.getpid()}.sock")
    manager = Manager(cpu_devices(1)[0], endpoint=Endpoint("unix", str(sock)), state_dir=tmp_path / "state",
                      worker_log_max_bytes=limit, worker_log_backups=1)
    manager.start()
    h = ManagerHarness(manager, ControlClient(manager.endpoint), tmp_path)
    try:
        task = h.client.submit(TaskSpec(target="sample_tasks:Printer", args={"kib_per_step": 1024, "crash_at": 24},
                                        memory_bytes=2**28, working_dir=str(TESTS_DIR)))
        feeder = h.feeder()
        feeder.run_until(lambda: h.client.get(task.task_id).state == "FAILED", length_ms=100, timeout_s=60)
        feeder.close()
        failure = h.client.get(task.task_id).failure
        assert failure is not None and failure.kind == "SIGNAL" and failure.step == 24
        assert failure.log_tail.rstrip().endswith("last words at step 24"), failure.log_tail[-300:]
        logs = sorted(manager.loop.task_dir(task.task_id).glob("worker.log*"))
        assert [p.name for p in logs] == ["worker.log", "worker.log.1"]
        assert all(p.stat().st_size <= limit for p in logs), [p.stat().st_size for p in logs]
    finally:
        h.client.close()
        manager.stop()


def test_no_step_starts_after_the_trainers_end_even_when_the_end_reaches_the_manager_late(
    harness: ManagerHarness,
) -> None:
    # Issue 13: a worker learned of a bubble's end only from the manager's park message, so it kept
    # starting steps for as long as the end took to reach it. The trainer's end board stops it at once:
    # here each end reaches the manager 40 ms after the real end, and still at most the one step that
    # was deciding to start as the end was written begins after it.
    from freeride._boards import EndBoard, end_board_path
    from freeride.messages import BubbleEnd, BubbleStart

    task = harness.submit("sample_tasks:Counter", args={"step_ms": 0.5})
    harness.wait_state(task.task_id, "PARKED")
    ends = EndBoard.open(end_board_path(harness.endpoint.address), writable=True)
    feeder = harness.feeder()
    bubbles = []
    for it in range(30):
        start = time.monotonic_ns()
        feeder.send(BubbleStart(0, 0, it, 0, "test", start, 100 * 1_000_000, 8 * 2**30))
        time.sleep(0.02)
        end = time.monotonic_ns()
        ends.record_end(0, start, end)
        time.sleep(0.04)
        feeder.send(BubbleEnd(0, 0, it, 0, end))
        bubbles.append((start, end))
        time.sleep(0.005)
    assert feeder.close() == (60, 0)
    steps = read_steps(work_dir(harness, task.task_id))
    assert len(steps) > 30
    nexts = [start for start, _ in bubbles[1:]] + [time.monotonic_ns()]
    late = [sum(1 for s, _ in steps if end < s < following)
            for (_, end), following in zip(bubbles, nexts, strict=True)]
    assert max(late) <= 1, late
    assert harness.client.stats().events_rejected == 0


def test_the_loops_thread_runs_with_a_short_time_slice_and_its_worker_with_the_kernels_default(
    harness: ManagerHarness,
) -> None:
    from freeride.devices.time_slice import LOOP_TIME_SLICE_NS, time_slice_ns

    task = harness.submit("sample_tasks:Counter", args={"step_ms": 1.0})
    info = harness.wait_state(task.task_id, "PARKED")
    loop_thread = harness.manager._thread
    assert loop_thread is not None and loop_thread.native_id is not None
    default = time_slice_ns()  # the test's own thread: the kernel's default
    if not default:
        pytest.skip("the kernel has no custom time slices (< 6.12)")
    wait_for(lambda: time_slice_ns(loop_thread.native_id or 0) == LOOP_TIME_SLICE_NS, 10,
             what="the loop to take its short slice")
    assert info.pid and time_slice_ns(info.pid) == default


def test_a_task_left_frozen_when_the_bubbles_stop_says_so_in_its_reason(harness: ManagerHarness) -> None:
    # Stranger trial: left frozen when training ended, a task read "resumes at its next grant" long after the last
    # bubble, and looked broken.
    task = harness.submit("sample_tasks:Counter", args={"step_ms": 50.0})
    harness.wait_state(task.task_id, "PARKED")
    feeder = harness.feeder()
    feeder.run(1, length_ms=10, predicted_ms=10)  # its 50 ms step runs past the end: frozen
    harness.wait_state(task.task_id, "FROZEN")
    wait_for(lambda: "made no bubble" in harness.client.get(task.task_id).waiting_reason, 30,
             what="the reason to say that the trainer makes no bubbles")
    assert "until the next bubble" in harness.client.get(task.task_id).waiting_reason
    feeder.close()


def test_a_manager_pinned_off_its_core_serves_that_core_and_its_workers_run_there(tmp_path: Path) -> None:
    # Stranger trial: `taskset -c 0 freeride manager --device cpu:1`, as the manager's own warning advises (a core
    # no rank uses), exited 2: "unknown device cpu:1: this machine offers CPU cores cpu:0".
    from daemons import socket_path, start_daemon, stop_daemon

    from freeride._wire.client import ControlClient
    from freeride.endpoints import Endpoint

    manager_core, device = cpu_devices(2)
    allowed = os.sched_getaffinity(0)
    sock = socket_path("pinned-off")
    os.sched_setaffinity(0, {int(manager_core.split(":")[1])})  # the manager inherits it, as under taskset
    try:
        daemon = start_daemon(sock, tmp_path / "state", device=device)
    finally:
        os.sched_setaffinity(0, allowed)
    try:
        with ControlClient(Endpoint("unix", str(sock))) as client:
            info = client.submit(TaskSpec(target="sample_tasks:Counter", memory_bytes=256 * 2**20,
                                          working_dir=str(TESTS_DIR)))
            wait_for(lambda: client.get(info.task_id).state == "PARKED", 60, what="the worker to start")
            [worker] = psutil.Process(daemon.pid).children()
            assert worker.cpu_affinity() == [int(device.split(":")[1])]
            assert psutil.Process(daemon.pid).cpu_affinity() == [int(manager_core.split(":")[1])]
    finally:
        stop_daemon(daemon)


def test_a_drain_kills_a_task_in_its_setup_at_once_with_nothing_lost(make_manager: object) -> None:
    # A setup cannot read a stop: continued, it ran on outside every bubble (beside training) until it ended or the
    # stop timeout killed it, and either way its next start set up again. Killed at once, nothing is lost.
    h: ManagerHarness = make_manager(stop_timeout_ns=60_000_000_000)  # type: ignore[operator]
    slow = h.submit("sample_tasks:SlowSetup", args={"setup_cpu_ms": 120_000})
    feeder = h.feeder()
    feeder.run_until(lambda: h.client.get(slow.task_id).state in ("RUNNING", "FROZEN"), length_ms=20, gap_ms=10,
                     timeout_s=60)
    feeder.close()
    pid = h.client.get(slow.task_id).pid
    started = time.monotonic()
    drained = h.client.drain(timeout_s=50)
    assert time.monotonic() - started < 30  # not the 60 s stop timeout, nor the 120 s setup
    assert (drained.parked, drained.checkpointed, drained.killed) == (1, 0, 0), drained
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    info = h.client.get(slow.task_id)
    assert info.failure is None and info.steps == 0
