"""Every control call answers before its deadline in every state of a manager: serving, draining,
drained and stopping; a drain is idempotent.

Regressions of issue 13: a second ``freeride drain`` waited out its timeout and exited 3 ("no
manager answers") because the drain's completion was announced only once; a drain that ran past its
timeout read as a dead manager; and calls that reached a manager whose loop had stopped waited for
the client's deadline.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest
from conftest import ManagerHarness, wait_for

from freeride._manager.requests import Shutdown
from freeride._wire.client import ControlClient, health_status
from freeride.errors import DrainIncomplete, ManagerUnavailable, RequestRejected, TaskNotFound
from freeride.messages import TaskSpec

#: Far longer than any answer takes; a call that waited for it would read as "no manager answers".
CLIENT_TIMEOUT_S = 8.0


def every_query(client: ControlClient) -> None:
    """The read-only calls, each of which must answer."""
    client.stats()
    client.list()
    client.bubbles()
    with pytest.raises(TaskNotFound):
        client.get("no-such-task-1")
    with pytest.raises(TaskNotFound):
        client.cancel("no-such-task-1")


def stopping(call: Callable[[], object]) -> str:
    with pytest.raises(ManagerUnavailable) as caught:
        call()
    return str(caught.value)


def test_every_call_answers_while_serving_draining_drained_and_stopping(
    harness: ManagerHarness, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="freeride")
    h = harness
    client = ControlClient(h.endpoint, timeout_s=CLIENT_TIMEOUT_S)
    task = h.submit("sample_tasks:SlowCheckpoint")
    feeder = h.feeder()
    feeder.run_until(lambda: client.get(task.task_id).steps >= 1)  # set up: a drain will checkpoint it
    feeder.close()
    every_query(client)

    # Draining: the worker is inside state_dict() and will stay there until released.
    with pytest.raises(DrainIncomplete, match="did not finish within 0.5 s"):
        client.drain(timeout_s=0.5)
    work = h.manager.loop.task_dir(task.task_id) / "work"
    wait_for(lambda: (work / "checkpointing").exists(), what="the worker to begin its checkpoint")
    every_query(client)
    assert client.stats().draining
    with pytest.raises(RequestRejected, match="draining .* submit once a manager is started on this device again"):
        client.submit(TaskSpec(target="sample_tasks:Counter", memory_bytes=2**20))
    with pytest.raises(DrainIncomplete):
        client.drain(timeout_s=0.2)  # a second waiter while the first drain is under way
    assert health_status(h.endpoint) == "NOT_SERVING"

    # Drained: the first waiter's drain completes; asking again answers at once.
    (work / "release").touch()
    assert client.drain(timeout_s=CLIENT_TIMEOUT_S / 2)[0] == 1
    assert client.get(task.task_id).state == "SUBMITTED"
    assert client.get(task.task_id).checkpoint_step >= 1
    assert client.drain(timeout_s=CLIENT_TIMEOUT_S / 2) == (0, 0, 0)
    # Said in the log, once each (a stranger found nothing there of a drain): begun, and over.
    said = [r.getMessage() for r in caplog.records]
    assert sum("draining (`freeride drain`): parking and checkpointing 1 resident task(s)" in m for m in said) == 1
    assert sum("drained: no task is resident" in m for m in said) == 1
    assert client.drain(timeout_s=CLIENT_TIMEOUT_S / 2) == (0, 0, 0)
    every_query(client)

    # Stopping: the loop has stopped (a drained manager stops at once) but the server still answers.
    h.manager.loop.post(Shutdown())
    thread = h.manager._thread
    assert thread is not None
    wait_for(lambda: not thread.is_alive(), what="the loop to stop")
    for call in (client.stats, client.list, client.bubbles, lambda: client.get(task.task_id),
                 lambda: client.drain(timeout_s=CLIENT_TIMEOUT_S / 2)):
        assert "the manager is stopping" in stopping(call)
    assert list(client.watch()) == []  # a live view of a stopped manager ends at once
    client.close()
