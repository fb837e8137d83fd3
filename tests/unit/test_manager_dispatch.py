"""The loop's dispatch, with a scripted core and fake workers: each action goes to its component, and
events a component answers with are fed only after every action of the current event is applied."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import cpu_devices

from freeride import _channel as W
from freeride._manager import core as C
from freeride._manager.loop import LoopConfig, ManagerLoop
from freeride._manager.requests import SubmitTask
from freeride.devices import open_device
from freeride.messages import TaskSpec
from freeride.states import TaskState

LOG: list[str] = []


class ScriptedCore:
    """Answers each event with the actions the test gave for its type; logs what it was fed."""

    def __init__(self, script: dict[type, list[Any]], freeze_at_ns: int | None = None) -> None:
        self.script = script
        self.tasks: dict[str, Any] = {}
        self.freeze_at_ns = freeze_at_ns

    def on_event(self, event: Any, now_ns: int) -> list[Any]:
        LOG.append(f"core <- {type(event).__name__}")
        return self.script.get(type(event), [])

    def next_timer_ns(self) -> None:
        return None

    def next_freeze_ns(self) -> int | None:
        return self.freeze_at_ns


class FakeWorkers:
    workers: dict[str, Any] = {}

    def send(self, task_id: str, message: W.ManagerMessage) -> None:
        LOG.append(f"send {type(message).__name__} to {task_id}")

    def signal(self, task_id: str, sig: int) -> None:
        LOG.append(f"signal {int(sig)} to {task_id}")

    def freeze(self, task_id: str) -> list[Any]:
        LOG.append(f"freeze {task_id}")
        return [C.WorkerStepsSeen(task_id, 3)]

    def board(self, task_id: str) -> None:
        return None


@pytest.fixture
def loop(tmp_path: Path) -> Iterator[ManagerLoop]:
    loop = ManagerLoop(open_device(cpu_devices(1)[0]), LoopConfig(state_dir=tmp_path / "state"))
    LOG.clear()
    yield loop
    loop.stop()


def test_events_a_component_answers_with_wait_until_every_action_is_applied(loop: ManagerLoop) -> None:
    loop.core = ScriptedCore({C.Tick: [C.Freeze("a-1"), C.Grant("b-2", 7, 100, 1, thaw=True), C.Kill("c-3")]})
    loop.workers = FakeWorkers()  # type: ignore[assignment]
    loop._feed(C.Tick(), 0)
    assert ["core <- Tick", "freeze a-1", "send Grant to b-2", f"signal {int(signal.SIGCONT)} to b-2",
                   f"signal {int(signal.SIGKILL)} to c-3", "core <- WorkerStepsSeen"] == LOG


def test_an_action_that_fails_to_apply_is_logged_and_the_others_still_are(loop: ManagerLoop,
                                                                           caplog: pytest.LogCaptureFixture) -> None:
    class Broken(FakeWorkers):
        def send(self, task_id: str, message: W.ManagerMessage) -> None:
            raise RuntimeError("boom")

    loop.core = ScriptedCore({C.Tick: [C.Park("a-1", 1), C.Kill("b-2")]})
    loop.workers = Broken()  # type: ignore[assignment]
    loop.workers.workers = {"a-1": object()}
    loop._feed(C.Tick(), 0)
    assert ["core <- Tick", f"signal {int(signal.SIGKILL)} to b-2"] == LOG
    assert "failed to apply" in caplog.text


def test_a_request_is_answered_after_the_events_it_causes_are_fed(loop: ManagerLoop) -> None:
    future = loop.call_async(SubmitTask(TaskSpec(target="m:C", memory_bytes=2**20, name="c")))
    loop._take_inbox()
    info = future.result(0)
    assert info.task_id == "c-1" and info.state in ("SUBMITTED", "STARTING")
    assert loop.core.tasks["c-1"].spec.name == "c"


class Records:
    """Stands for the trace: logs each record as it is written."""

    def event(self, event: Any) -> None:
        LOG.append(f"record {type(event).__name__}")

    def sent(self, grant: C.Grant) -> dict[str, int]:
        LOG.append(f"stamp {grant.task_id}")
        return {"at_ns": 1}

    def action(self, action: Any, sent: dict[str, int] | None = None) -> None:
        LOG.append(f"record {type(action).__name__}" + (" as sent" if sent else ""))


def test_a_grant_after_records_only_goes_out_first_and_the_records_keep_their_order(loop: ManagerLoop) -> None:
    # A bubble's start: the core says PARKED -> RUNNING, then the grant. The worker gets the grant before the
    # loop applies the state change and writes any record; the trace still reads start, state, grant.
    changed = C.StateChanged("a-1", TaskState.PARKED, TaskState.RUNNING, "granted")
    loop.core = ScriptedCore({C.Tick: [changed, C.Grant("a-1", 7, 100, 1, thaw=False)]})
    loop.workers = FakeWorkers()  # type: ignore[assignment]
    loop.trace = Records()  # type: ignore[assignment]
    applied = loop._apply_by_type[C.StateChanged]
    loop._apply_by_type[C.StateChanged] = lambda action: LOG.append("apply StateChanged")  # type: ignore[func-returns-value]
    try:
        loop._feed(C.Tick(), 0)
    finally:
        loop._apply_by_type[C.StateChanged] = applied
    assert LOG == ["core <- Tick", "stamp a-1", "send Grant to a-1", "record Tick", "apply StateChanged",
                   "record StateChanged", "record Grant as sent"]


def test_a_grant_after_an_action_on_a_worker_keeps_its_place_and_is_stamped_before_it_goes(
        loop: ManagerLoop) -> None:
    # Stamped once sent, a grant's time could follow the trainer's stop of its worker (a loop that lost its core
    # between the two), and the trace's reader gave that stop to the grant before.
    loop.core = ScriptedCore({C.Tick: [C.Kill("b-2"), C.Grant("a-1", 7, 100, 1, thaw=False)]})
    loop.workers = FakeWorkers()  # type: ignore[assignment]
    loop.trace = Records()  # type: ignore[assignment]
    loop._feed(C.Tick(), 0)
    assert ["core <- Tick", "record Tick", f"signal {int(signal.SIGKILL)} to b-2", "record Kill", "stamp a-1",
            "send Grant to a-1", "record Grant as sent"] == LOG


class StoppingEnds:
    """Stands for the end path: the trainer stopped the armed worker at its end, once."""

    def __init__(self) -> None:
        self.seen = [C.TrainerEndSeen("a-1", 7, 900, stopped_ns=910)]

    def stopped_before_freeze(self) -> list[C.TrainerEndSeen]:
        LOG.append("read the trainer's stop")
        seen, self.seen = self.seen, []
        return seen


def test_an_event_fed_while_a_freeze_is_due_comes_after_the_trainers_stop_read_off_its_board(
        loop: ManagerLoop) -> None:
    # A manager that waited 14 ms for a core woke to a worker's message: fed first, it fired the freeze timer, booked
    # at that wake, although the trainer had stopped the worker at its end (the end's message still unread).
    loop.core = ScriptedCore({}, freeze_at_ns=1_000)
    loop.ends = StoppingEnds()  # type: ignore[assignment]
    loop._feed(C.Tick(), 5_000)
    loop._feed(C.Tick(), 6_000)  # the stop was read once: the record is spent
    assert LOG == ["read the trainer's stop", "core <- TrainerEndSeen", "core <- Tick", "read the trainer's stop",
                   "core <- Tick"]
    LOG.clear()
    loop.core = ScriptedCore({}, freeze_at_ns=9_000)  # not due yet: the board is not read
    loop._feed(C.Tick(), 6_000)
    assert LOG == ["core <- Tick"]
