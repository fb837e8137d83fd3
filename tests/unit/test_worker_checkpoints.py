"""The worker's checkpoints under faults: a refusing disk is retried, an unserialisable state fails the task."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from conftest import cpu_devices
from sample_tasks import Counter, UnpicklableState

from freeride._channel import Channel, Checkpointed, CheckpointFailed, Init, Message
from freeride._checkpoints import checkpoint_files
from freeride._estimator import StepEstimator
from freeride._worker.runtime import CHECKPOINT_OVERDUE_INTERVALS, WorkerRuntime, _TaskError

DEVICE = cpu_devices(1)[0]  # a core this process may run on: tests never name core numbers


def runtime(worker: Channel, checkpoint_dir: Path, task: Any, interval_s: float = 30.0) -> WorkerRuntime:
    rt = WorkerRuntime(worker, Init(
        task_id="t-1", memory_limit_bytes=2**28, work_dir=str(checkpoint_dir.parent / "work"),
        checkpoint_dir=str(checkpoint_dir), device=DEVICE, checkpoint_interval_s=interval_s,
    ))
    rt.task = task
    rt.setup_done = True
    return rt


@pytest.fixture
def checkpoints(tmp_path: Path) -> Path:
    """An existing checkpoint directory."""
    path = tmp_path / "checkpoints"
    path.mkdir()
    return path


def messages(manager: Channel) -> list[Message]:
    out = []
    while (msg := manager.recv_nowait()) is not None:
        out.append(msg)
    return out


def test_checkpoint_the_disk_refuses_is_reported_and_retried_an_interval_later(
    tmp_path: Path, channels: tuple[Channel, Channel]
) -> None:
    manager, worker = channels
    (tmp_path / "not-a-dir").write_text("")
    rt = runtime(worker, tmp_path / "not-a-dir" / "checkpoints", Counter(), interval_s=30.0)
    rt.steps = 7
    assert rt._checkpoint() is False  # NotADirectoryError: as a full or read-only disk would refuse it
    [msg] = messages(manager)
    assert isinstance(msg, CheckpointFailed) and msg.step == 7 and "Not a directory" in msg.error
    assert rt.checkpointed_steps == 0  # nothing acknowledged
    rt.steps = 8
    rt._maybe_checkpoint(deadline=time.monotonic_ns() + 10**9, margin=0)
    assert messages(manager) == [], "retried at once instead of an interval later"


def test_no_checkpoint_is_written_before_the_first_step_and_one_is_after_it(
    checkpoints: Path, channels: tuple[Channel, Channel]
) -> None:
    # Stranger trial: a first grant after a setup longer than the interval checkpointed step 0 (what setup
    # makes, which a restart makes again), so a hang in state_dict() was failed as a hang in setup().
    manager, worker = channels
    calls: list[int] = []

    class Watched(Counter):
        def state_dict(self) -> dict[str, Any]:
            calls.append(self.count)
            return super().state_dict()

    rt = runtime(worker, checkpoints, Watched(log_steps=False), interval_s=1.0)
    rt.last_checkpoint_ns -= 60 * 10**9  # setup took a minute: the interval is long past
    rt._maybe_checkpoint(deadline=time.monotonic_ns() + 10**9, margin=0)
    assert calls == [] and messages(manager) == []
    rt.task.step()  # type: ignore[union-attr]
    rt.steps = 1
    rt._maybe_checkpoint(deadline=time.monotonic_ns() + 10**9, margin=0)
    assert calls == [1]
    assert [m.step for m in messages(manager) if isinstance(m, Checkpointed)] == [1]


def test_state_that_does_not_serialise_fails_the_task_with_a_checkpoint_record(
    tmp_path: Path, checkpoints: Path, channels: tuple[Channel, Channel]
) -> None:
    _, worker = channels
    rt = runtime(worker, checkpoints, UnpicklableState())
    rt.task.work_dir = str(tmp_path)  # type: ignore[union-attr]
    rt.steps = 3
    with pytest.raises(_TaskError) as err:
        rt._checkpoint()
    assert err.value.kind == "CHECKPOINT"
    assert "saving the checkpoint of step 3" in str(err.value) and "pickle" in str(err.value)
    assert list(checkpoints.iterdir()) == [], "a partial file was left behind"


def test_regression_overdue_checkpoint_is_written_although_its_estimate_fits_no_grant(
    checkpoints: Path, channels: tuple[Channel, Channel]
) -> None:
    """One slow write under load used to keep every later checkpoint out for good."""
    manager, worker = channels
    rt = runtime(worker, checkpoints, Counter(), interval_s=0.05)
    rt.checkpoint_estimator.add(10**9)  # a 1 s write once seen
    rt.steps = 5
    now = time.monotonic_ns()
    rt.last_checkpoint_ns = now - int(0.06e9)  # due, not overdue: the estimate rules
    rt._maybe_checkpoint(deadline=now + 20_000_000, margin=0)
    assert checkpoint_files(checkpoints) == []
    rt.last_checkpoint_ns = now - int(CHECKPOINT_OVERDUE_INTERVALS * 0.05e9) - 1
    rt._maybe_checkpoint(deadline=now + 20_000_000, margin=0)
    assert [p.name for p in checkpoint_files(checkpoints)] == ["ckpt-5.pt"]
    assert [type(m) for m in messages(manager)] == [Checkpointed]
    assert isinstance(rt.checkpoint_estimator, StepEstimator) and rt.checkpoint_estimator.count == 1


def test_a_killed_writers_temporary_checkpoint_goes_at_the_next_write_and_a_newer_ones_stays(tmp_path: Path) -> None:
    # A manager killed with -9 mid-checkpoint left a 160 MB ckpt-393.tmp behind for good.
    from freeride._checkpoints import write

    (tmp_path / "ckpt-393.tmp").write_bytes(b"half a checkpoint")
    (tmp_path / "ckpt-900.tmp").write_bytes(b"someone's newer one, being written")
    write(tmp_path, "t-1", 400, {"x": 1})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-400.pt", "ckpt-900.tmp"]
    assert (tmp_path / "ckpt-400.pt").stat().st_mode & 0o777 == 0o600  # owner-only, whatever the umask


class LoadsTheWrongKey(Counter):
    def load_state_dict(self, state: Any) -> None:
        self.count = state["no such key"]


def test_a_load_state_dict_that_raises_fails_the_task_with_its_own_traceback_and_tries_no_older_file(
    checkpoints: Path, channels: tuple[Channel, Channel]
) -> None:
    # A stranger's KeyError read "no checkpoint is readable" with no frame of their code, after falling back.
    from freeride._checkpoints import write

    _, worker = channels
    write(checkpoints, "t-1", 3, {"count": 3})
    write(checkpoints, "t-1", 5, {"count": 5})
    rt = runtime(worker, checkpoints, LoadsTheWrongKey())
    with pytest.raises(_TaskError) as info:
        rt._restore()
    assert info.value.kind == "EXCEPTION"
    assert str(info.value) == "load_state_dict() of ckpt-5.pt: KeyError: 'no such key'"
    assert "in load_state_dict" in info.value.tb and __file__ in info.value.tb
    assert rt.steps == 0


def test_a_task_that_keeps_no_state_writes_no_checkpoint(checkpoints: Path, channels: tuple[Channel, Channel]) -> None:
    # A command task's empty checkpoint read "resumed from ckpt-310.pt" of a program started again from its beginning.
    class Stateless(Counter):
        checkpoints = False

    manager, worker = channels
    rt = runtime(worker, checkpoints, Stateless())
    rt.steps = 7
    assert rt._checkpoint() is True
    assert checkpoint_files(checkpoints) == [] and messages(manager) == []
