"""``freeride.testing``: what a task author tests a task with, without a manager or a GPU. It must pass a
task that keeps the worker's contract and catch each way of breaking it."""

from __future__ import annotations

import random
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from freeride.task import SideTask, TaskContext
from freeride.testing import (
    MemoryCapExceeded,
    ResumeMismatch,
    check_resume,
    checkpoint_roundtrip,
    run_steps,
    task_context,
)

REPO = Path(__file__).resolve().parents[2]


class Walk(SideTask):
    """``total`` seeded random moves folded into ``position`` in order (so that two different sequences of
    moves end in different positions): everything that evolves is in its state."""

    progress_unit = "moves"

    def __init__(self, total: int = 20, seed: int = 1) -> None:
        self.total = total
        self.seed = seed
        self.position = 0
        self.moves = 0
        self.rng = random.Random(seed)
        self.work_dir: Path | None = None

    def setup(self, ctx: TaskContext) -> None:
        self.work_dir = ctx.work_dir

    def step(self) -> None:
        self.position = (self.position * 3 + self.rng.randrange(3)) % (1 << 61)
        self.moves += 1

    def done(self) -> bool:
        return self.moves >= self.total

    def progress(self) -> float:
        return float(self.moves)

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "moves": self.moves, "rng": self.rng.getstate()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = state["position"]
        self.moves = state["moves"]
        self.rng.setstate(state["rng"])


class ForgetsPosition(Walk):
    """The classic bug: load_state_dict restores all but one field."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.moves = state["moves"]
        self.rng.setstate(state["rng"])


class DoesNotSaveItsRng(Walk):
    """Loads all it saves, but saves too little: a resumed walk draws the seed's moves again."""

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "moves": self.moves}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = state["position"]
        self.moves = state["moves"]


class Unsaveable(Walk):
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "callback": lambda: None}


class Hoarder(Walk):
    """Keeps 8 MiB more, touched (resident), after every step."""

    def __init__(self) -> None:
        super().__init__(total=1000)
        self.hoard: list[bytearray] = []

    def step(self) -> None:
        super().step()
        self.hoard.append(bytearray(b"\x01" * (8 << 20)))


def test_task_context_is_a_cpu_workers(tmp_path: Path) -> None:
    ctx = task_context(tmp_path / "w", memory_limit_bytes=64 << 20)
    assert (ctx.device, ctx.memory_limit_bytes, ctx.work_dir) == ("cpu", 64 << 20, tmp_path / "w")
    assert ctx.work_dir.is_dir() and ctx.device_name.startswith("cpu:")
    with pytest.raises(ValueError, match="memory_limit_bytes"):
        task_context(tmp_path, memory_limit_bytes=0)


def test_run_steps_sets_up_runs_n_steps_and_stops_when_done(tmp_path: Path) -> None:
    task = Walk(total=5)
    run = run_steps(task, 3, work_dir=tmp_path)
    assert (run.steps, run.done, len(run.step_s)) == (3, False, 3) and task.work_dir == tmp_path
    again = run_steps(task, 10, setup=False)
    assert (again.steps, again.done, task.moves) == (2, True, 5)


def test_run_steps_on_a_task_set_up_already_makes_no_directory(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # Stranger trial: our own test runs left a /tmp/freeride-test-* directory for each such call.
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    task = Walk(total=5)
    run_steps(task, 2, work_dir=tmp_path / "w")
    assert run_steps(task, 10, setup=False).done
    assert list(temp.iterdir()) == []
    run_steps(Walk(total=1), 1)  # set up without a directory given: a fresh temporary one, as documented
    assert len(list(temp.iterdir())) == 1
    with pytest.raises(ValueError, match="memory_limit_bytes"):
        run_steps(Walk(total=1), 1, setup=False, memory_limit_bytes=-1)


def test_run_steps_fails_a_task_over_its_cap_as_a_worker_would(tmp_path: Path) -> None:
    # The cap in the unit that tells it apart from the use: a use a page over 32 MiB reads in bytes.
    with pytest.raises(MemoryCapExceeded, match=r"Hoarder's step \d+ took the resident set .* over the cap of "
                                                r"(32(\.0+)? MiB|33554432 B): a worker would fail it with "
                                                r"MEMORY_LIMIT"):
        run_steps(Hoarder(), 20, memory_limit_bytes=32 << 20, work_dir=tmp_path)


def test_checkpoint_roundtrip_gives_back_the_state_and_refuses_what_cannot_be_saved() -> None:
    task = Walk()
    task.step()
    assert checkpoint_roundtrip(task) == task.state_dict()
    with pytest.raises(Exception, match="lambda|pickle|local object"):
        checkpoint_roundtrip(Unsaveable())


def test_a_state_that_cannot_be_saved_names_its_entry() -> None:
    # Stranger trial: "AttributeError: Can't pickle local object 'Unpicklable.state_dict.<locals>.<lambda>'" named
    # no key; a worker failed the task CHECKPOINT with it after 276 steps.
    class Nested(Walk):
        def state_dict(self) -> dict[str, Any]:
            return {"moves": self.moves, "inner": {"ok": 1, "f": lambda: 0}}

    with pytest.raises(TypeError, match=r"state_dict\(\)\['inner'\]\['f'\] cannot be saved \((AttributeError|"
                                        r"PicklingError).*\): keep only data in state_dict"):
        checkpoint_roundtrip(Nested())


def test_run_steps_reads_progress_as_a_worker_does_and_check_resume_refuses_a_task_that_never_finishes(
    tmp_path: Path,
) -> None:
    # Stranger trial: a NaN progress() passed run_steps and failed the task in the worker; check_resume without
    # steps= ran a task whose done() is SideTask's 100000 steps (2 min 20 s at 1 ms) before saying so.
    class NanProgress(Walk):
        def progress(self) -> float:
            return float("nan")

    with pytest.raises(ValueError, match="progress\\(\\) returned nan: it must be a finite number"):
        run_steps(NanProgress(), 3, work_dir=tmp_path)

    class Forever(SideTask):
        def step(self) -> None:
            pass

    with pytest.raises(ValueError, match="Forever never finishes \\(its done\\(\\) is SideTask's\\): pass steps=N"):
        check_resume(Forever, stop_after=2, work_dir=tmp_path)
    check_resume(Forever, stop_after=2, steps=4, work_dir=tmp_path)


class DoneOnce(Walk):
    """done() is true the first time it is asked once ``total`` moves are made, and false after."""

    def __init__(self, total: int = 20, seed: int = 1) -> None:
        super().__init__(total, seed)
        self.asked_when_done = 0

    def done(self) -> bool:
        if self.moves >= self.total:
            self.asked_when_done += 1
        return self.asked_when_done == 1


def test_run_steps_stops_at_the_first_true_done_and_says_done_as_a_worker_would(tmp_path: Path) -> None:
    # Stranger trial: such a task ran 2500 steps, then run_steps said done=False (done() asked again) and
    # check_resume failed it as "not done after 100000 steps".
    run = run_steps(DoneOnce(total=5), 100, work_dir=tmp_path)
    assert (run.steps, run.done) == (5, True)
    text = repr(run)
    assert text.startswith("StepsRun(steps=5, done=True, peak_bytes=") and "step_s=<5 step times, p50 " in text


def test_check_resume_passes_a_task_that_keeps_the_contract(tmp_path: Path) -> None:
    resumed = check_resume(lambda: Walk(total=20, seed=7), stop_after=6, work_dir=tmp_path)
    assert isinstance(resumed, Walk) and resumed.moves == 20
    assert (tmp_path / "resumed").is_dir() and (tmp_path / "whole").is_dir()


def test_check_resume_catches_a_load_state_dict_that_loses_state(tmp_path: Path) -> None:
    with pytest.raises(ResumeMismatch, match=r"right after load_state_dict, the resumed task's state_dict\(\) "
                                             r"differs from the checkpointed one's: \['position'\]"):
        check_resume(lambda: ForgetsPosition(total=20, seed=7), stop_after=6, work_dir=tmp_path)


def test_check_resume_catches_state_that_is_never_saved(tmp_path: Path) -> None:
    with pytest.raises(ResumeMismatch, match=r"at the end, the resumed task's state_dict\(\) differs from an "
                                             r"uninterrupted run's: \['position'\]"):
        check_resume(lambda: DoesNotSaveItsRng(total=40, seed=7), stop_after=10, work_dir=tmp_path)


class SavesNothing(SideTask):
    """Sums squares to ``total`` and keeps no checkpoint at all (the default state_dict)."""

    def __init__(self, total: int = 50) -> None:
        self.total, self.i, self.acc = total, 0, 0

    def step(self) -> None:
        self.acc += self.i * self.i
        self.i += 1

    def done(self) -> bool:
        return self.i >= self.total

    def progress(self) -> float:
        return float(self.i)


def test_check_resume_catches_a_task_that_saves_nothing_and_redoes_every_step(tmp_path: Path) -> None:
    # A stranger's task without state_dict caught up by redoing all its steps, and passed.
    with pytest.raises(ResumeMismatch, match=r"the resumed task took 50 steps to the end, an uninterrupted run 50 in "
                                             r"all, less the 20 done before the stop, 30 \(it redid work"):
        check_resume(lambda: SavesNothing(total=50), stop_after=20, work_dir=tmp_path)


def test_check_resume_bounds_a_task_that_never_finishes(tmp_path: Path) -> None:
    class Endless(Walk):
        def done(self) -> bool:
            return False

    check_resume(lambda: Endless(), stop_after=3, steps=8, work_dir=tmp_path)
    with pytest.raises(ValueError, match="stop_after <= steps"):
        check_resume(lambda: Endless(), stop_after=9, steps=8, work_dir=tmp_path)


def test_check_resume_compares_tensor_state_element_by_element(tmp_path: Path) -> None:
    sys.path.insert(0, str(REPO / "examples"))
    try:
        from monte_carlo_pi import MonteCarloPi
    finally:
        sys.path.remove(str(REPO / "examples"))
    resumed = check_resume(lambda: MonteCarloPi(total_samples=10_000, batch=1_000, seed=3), stop_after=4,
                           work_dir=tmp_path)
    assert resumed.progress() == 10_000


def test_run_steps_turns_a_tasks_os_exit_into_an_error_not_the_end_of_the_test_session(tmp_path: Path) -> None:
    import os

    from freeride._loading import ProcessExitCalled

    class Exits(SideTask):
        def step(self) -> None:
            os._exit(9)

    with pytest.raises(ProcessExitCalled, match=r"the task called os\._exit\(9\)"):
        run_steps(Exits(), 3, work_dir=tmp_path)
