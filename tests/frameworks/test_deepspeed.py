"""freeride.training.deepspeed on DeepSpeed's own classes, without torchrun.

Three layers: the plan read off the real schedule classes (pure); the hooks on an engine that replays
a real schedule with empty instructions (``bench/deepspeed_replay.py``), checked mark by mark; and real
one-rank ``PipelineEngine`` / ``DualPipeVEngine`` objects in this process (a one-rank gloo group on a
file store), checked for the order they run, evaluation passing through, and being restored exactly.
The two-rank run with waits, a manager and a side task is ``test_deepspeed_torchtitan_e2e.py``.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from framework_support import REPO, deepspeed_one_rank, require_framework

from freeride.errors import ConfigError, FrameworkNotInstalled
from freeride.training.schedules import build_schedule

require_framework("deepspeed")

from deepspeed.runtime.pipe.schedule import DualPipeVSchedule, TrainSchedule  # noqa: E402

from bench.deepspeed_replay import ReplayEngine  # noqa: E402
from freeride.training import deepspeed as fds  # noqa: E402


class Marks:
    """Records the tracker's marks, as names and arguments."""

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []

    def iteration_begin(self) -> None:
        self.log.append(("begin",))

    def iteration_end(self) -> None:
        self.log.append(("end",))

    def compute_begin(self, kind: str, stage: int, mb: int) -> None:
        self.log.append(("compute", f"{stage}{kind}{mb}"))

    def compute_end(self, kind: str, stage: int, mb: int) -> None:
        self.log.append(("done", f"{stage}{kind}{mb}"))

    def wait_begin(self) -> None:
        self.log.append(("wait",))

    def wait_end(self) -> None:
        self.log.append(("waited",))


def _hook(engine: ReplayEngine) -> tuple[fds._Hooks, Marks]:
    marks = Marks()
    plan = fds.planned_orders(type(engine._train_schedule()), engine.micro_batches, engine.num_stages)
    hooks = fds._Hooks(engine, marks, plan, lambda: None)
    hooks.install()
    return hooks, marks


# ------------------------------------------------------------------ the plan


@pytest.mark.parametrize("stages,micro_batches", [(2, 2), (2, 4), (3, 5), (4, 8)])
def test_the_train_schedule_is_planned_as_freerides_1f1b(stages: int, micro_batches: int) -> None:
    plan = fds.planned_orders(TrainSchedule, micro_batches, stages)
    model = build_schedule("1f1b", stages, micro_batches)
    assert plan.num_stages == stages and not plan.v_shaped
    assert {r: list(o) for r, o in plan.orders.items()} == {r: list(o) for r, o in model.orders.items()}


@pytest.mark.parametrize("stages,micro_batches", [(2, 4), (2, 6), (3, 6), (4, 8)])
def test_dualpipev_is_planned_on_a_v_with_the_micro_batches_of_its_buffers(stages: int, micro_batches: int) -> None:
    plan = fds.planned_orders(DualPipeVSchedule, micro_batches, stages)
    assert plan.v_shaped and plan.num_stages == 2 * stages
    for rank in range(stages):
        order = plan.orders[rank]
        # Rank r holds stage r (phase 0) and its mirror (phase 1); every micro-batch once each way.
        assert {a.stage for a in order} == {rank, 2 * stages - 1 - rank}
        assert sorted((a.kind, a.stage, a.microbatch) for a in order) == sorted(
            (k, s, mb) for k in "FB" for s in (rank, 2 * stages - 1 - rank) for mb in range(micro_batches))
        # The schedule's own buffer ids say the same: buffer = phase * micro_batches + micro-batch.
        buffers = [(type(c).__name__[0], c.kwargs["phase"], c.buffer_id)
                   for step in DualPipeVSchedule(micro_batches, stages, rank).steps() for c in step
                   if type(c).__name__ in ("ForwardPass", "BackwardPass")]
        assert [(a.kind, a.stage, a.microbatch) for a in order] == [
            (k, rank if phase == 0 else 2 * stages - 1 - rank, b - phase * micro_batches) for k, phase, b in buffers]


# ------------------------------------------------------------------ the hooks, mark by mark


def test_a_receive_and_the_send_beside_it_are_one_wait_before_the_backward() -> None:
    engine = ReplayEngine(TrainSchedule, 4, 2, 0)
    hooks, marks = _hook(engine)
    engine.train_batch()
    log = marks.log
    assert log[0] == ("begin",) and log[-1] == ("end",)
    # Stage 0 of 2: F0 F1 B0 F2 B1 F3 B2 B3; before each backward RecvGrad then SendActivation: one wait,
    # ended by the backward itself (compute_begin ends an open wait).
    computes = [m[1] for m in log if m[0] == "compute"]
    assert computes == ["0F0", "0F1", "0B0", "0F2", "0B1", "0F3", "0B2", "0B3"]
    for b in ("0B0", "0B1", "0B2", "0B3"):
        i = log.index(("compute", b))
        assert log[i - 1] == ("wait",), (b, log[i - 3:i + 1])
    # The first forward's send, alone between two loads: a wait ended by the next load.
    first_send = log.index(("wait",))
    assert log[first_send - 1] == ("done", "0F0") and log[first_send + 1] == ("waited",)
    # The tail: the gradient-norm all-reduce inside OptimizerStep, then the loss broadcast.
    assert log[-5:] == [("wait",), ("waited",), ("wait",), ("waited",), ("end",)]
    assert engine.mpu.lookups == 1
    hooks.remove()


def test_the_last_stage_waits_for_each_activation_and_for_its_last_gradient_send() -> None:
    engine = ReplayEngine(TrainSchedule, 4, 2, 1)
    hooks, marks = _hook(engine)
    engine.train_batch()
    log = marks.log
    # Stage 1 of 2: RecvActivation, load (ends the wait), F; later SendGrad + RecvActivation: one wait.
    assert log[:4] == [("begin",), ("wait",), ("waited",), ("compute", "1F0")]
    i = log.index(("compute", "1F1"))
    assert log[i - 3:i] == [("done", "1B0"), ("wait",), ("waited",)]
    # The tail: the last SendGrad (ended by the reductions), the clip's all-reduce, the loss broadcast.
    assert log[-8:] == [("done", "1B3"), ("wait",), ("waited",), ("wait",), ("waited",), ("wait",), ("waited",),
                        ("end",)]
    hooks.remove()


def test_on_dualpipev_only_the_commit_waits() -> None:
    engine = ReplayEngine(DualPipeVSchedule, 4, 2, 0)
    hooks, marks = _hook(engine)
    engine.train_batch()
    # Sends and receives only queue here: a run of commits with nothing but queueing between is one wait.
    runs, open_run = 0, False
    for name, _ in engine.ran:
        if name == "CommitP2P":
            runs, open_run = runs + (not open_run), True
        elif name not in ("SendActivation", "RecvActivation", "SendGrad", "RecvGrad"):
            open_run = False
    assert 0 < runs < sum(1 for name, _ in engine.ran if name == "CommitP2P")
    tail_waits = 2  # the clip's all-reduce and the loss broadcast
    assert sum(1 for m in marks.log if m == ("wait",)) == runs + tail_waits
    assert [m[1] for m in marks.log if m[0] == "compute"] == [str(a) for a in hooks.plan.orders[0]]
    hooks.remove()


def test_outside_train_batch_the_hooks_pass_through() -> None:
    engine = ReplayEngine(TrainSchedule, 4, 2, 0)
    hooks, marks = _hook(engine)
    engine._exec_schedule(engine._train_schedule())  # what eval_batch does: the schedule, no train_batch
    engine._aggregate_total_loss()
    engine.clip_fp32_gradients()
    assert marks.log == []
    assert len(engine.ran) == len([c for s in engine._train_schedule() for c in s])
    hooks.remove()


def test_the_hooks_count_micro_batches_afresh_each_iteration() -> None:
    engine = ReplayEngine(TrainSchedule, 3, 2, 1)
    hooks, marks = _hook(engine)
    for _ in range(3):
        marks.log.clear()
        engine.train_batch()
        assert [m[1] for m in marks.log if m[0] == "compute"] == ["1F0", "1B0", "1F1", "1B1", "1F2", "1B2"]
    hooks.remove()


def test_removing_the_hooks_restores_the_replay_engine_and_its_grid() -> None:
    engine = ReplayEngine(TrainSchedule, 4, 2, 0)
    before = dict(vars(engine)), dict(vars(engine.mpu))
    hooks, _ = _hook(engine)
    assert "_INSTRUCTION_MAP" in vars(engine) and "get_model_parallel_group" in vars(engine.mpu)
    hooks.remove()
    assert (dict(vars(engine)), dict(vars(engine.mpu))) == before


# ------------------------------------------------------------------ import and errors


def test_importing_the_adapters_imports_no_framework() -> None:
    code = ("import sys, freeride.training.deepspeed, freeride.training.torchtitan; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('deepspeed', 'torchtitan')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]"


def test_without_deepspeed_instrument_names_the_extra_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "deepspeed.runtime.pipe", None)  # what an absent package looks like
    with pytest.raises(FrameworkNotInstalled) as info:
        fds.instrument(object())
    message = str(info.value)
    assert "pip install 'freeride[deepspeed]'" in message and "\n" not in message
    assert isinstance(info.value, ImportError)


def test_an_engine_instrumented_twice_is_refused() -> None:
    engine = ReplayEngine(TrainSchedule, 4, 2, 0)
    handle = fds._install(engine, None, device="cpu")
    try:
        with pytest.raises(ConfigError, match="instrumented already"):
            fds._install(engine, None, device="cpu")
    finally:
        fds.uninstrument(engine)
    assert "_INSTRUCTION_MAP" not in vars(engine)
    fds.uninstrument(engine)  # a second time: nothing to undo
    assert handle.tracker.iteration == 0


def test_uninstrument_takes_the_handle_too_and_anything_else_is_left_alone() -> None:
    # Stranger trial: uninstrument(handle) did nothing and the engine stayed hooked; uninstrument(None) raised
    # "TypeError: cannot create weak reference to 'NoneType' object".
    engine = ReplayEngine(TrainSchedule, 4, 2, 0)
    handle = fds._install(engine, None, device="cpu")
    fds.uninstrument(handle)
    assert "_INSTRUCTION_MAP" not in vars(engine)
    fds._install(engine, None, device="cpu").close()  # closed, it may be instrumented again
    assert "_INSTRUCTION_MAP" not in vars(engine)
    fds.uninstrument(None)
    fds.uninstrument(object())


def test_anything_but_a_pipeline_engine_is_refused() -> None:
    with pytest.raises(ConfigError, match="PipelineEngine"):
        fds.instrument(ReplayEngine(TrainSchedule, 4, 2, 0))


def test_moved_internals_are_named() -> None:
    engine = ReplayEngine(TrainSchedule, 4, 2, 0)
    del engine.micro_batches
    with pytest.raises(fds.DeepSpeedInternalsChanged, match="micro_batches"):
        fds._install(engine, None, device="cpu")


# ------------------------------------------------------------------ real one-rank engines


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A one-rank gloo group on a file store (no port), and DeepSpeed initialised on it."""
    with deepspeed_one_rank(tmp_path_factory.mktemp("store") / "store", "gloo"):
        yield


def _engine(dualpipev: bool = False, micro_batches: int = 4) -> Any:
    import torch

    from freeride.workload.deepspeed_job import build_model, make_engine

    torch.manual_seed(0)
    model = build_model(8, 2 if dualpipev else 1, -1, 0.0, dualpipev, 1)
    return make_engine(model, 2, micro_batches, 1.0)


def _data() -> Any:
    from freeride.workload.deepspeed_job import batches

    return batches(8, 2, 1)


@pytest.mark.parametrize("dualpipev", [False, True], ids=["PipelineEngine", "DualPipeVEngine"])
def test_a_real_engine_runs_the_planned_order_and_eval_marks_nothing(one_rank: None, dualpipev: bool) -> None:
    engine = _engine(dualpipev)
    handle = fds.instrument(engine, None, device="cpu")
    try:
        data = _data()
        for _ in range(2):
            engine.train_batch(data)
        assert handle.tracker.iteration == 2
        ran = [f"{a.stage}{a.kind}{a.microbatch}" for a in handle.tracker.last_actions]
        assert ran == [str(a) for a in handle.plan.orders[0]]
        engine.eval_batch(_data())
        handle.tracker.flush()
        assert handle.tracker.iteration == 2
    finally:
        fds.uninstrument(engine)


@pytest.mark.parametrize("dualpipev", [False, True], ids=["PipelineEngine", "DualPipeVEngine"])
def test_uninstrument_restores_a_real_engine_exactly(one_rank: None, dualpipev: bool) -> None:
    engine = _engine(dualpipev)
    engine.train_batch(_data())  # the engine's own first-run attributes exist before the snapshot
    before = dict(vars(engine)), dict(vars(engine.mpu))
    fds.instrument(engine, None, device="cpu")
    fds.uninstrument(engine)
    assert (dict(vars(engine)), dict(vars(engine.mpu))) == before
    assert engine._INSTRUCTION_MAP is type(engine)._INSTRUCTION_MAP


def test_an_instance_map_set_before_is_wrapped_and_put_back(one_rank: None) -> None:
    engine = _engine()
    seen: list[str] = []

    def counting(fn: Any, name: str) -> Any:
        def run(self: Any, **kwargs: Any) -> Any:
            seen.append(name)
            return fn(self, **kwargs)

        return run

    own = {cls: counting(fn, cls.__name__) for cls, fn in type(engine)._INSTRUCTION_MAP.items()}
    engine._INSTRUCTION_MAP = own
    handle = fds.instrument(engine, None, device="cpu")
    engine.train_batch(_data())
    assert seen.count("ForwardPass") == 4 and len(handle.tracker.last_actions) == 8
    fds.uninstrument(engine)
    assert engine._INSTRUCTION_MAP is own


def test_losses_and_weights_match_an_uninstrumented_twin(one_rank: None) -> None:
    import torch

    engine, twin = _engine(), _engine()
    fds.instrument(engine, None, device="cpu")
    data, twin_data = _data(), _data()
    try:
        losses = [float(engine.train_batch(data)) for _ in range(3)]
    finally:
        fds.uninstrument(engine)
    assert losses == [float(twin.train_batch(twin_data)) for _ in range(3)]
    assert all(torch.equal(a, b) for a, b in zip(engine.module.parameters(), twin.module.parameters(), strict=True))


def test_a_changed_micro_batch_count_is_planned_again(one_rank: None) -> None:
    engine = _engine(micro_batches=4)
    handle = fds.instrument(engine, None, device="cpu")
    try:
        data = _data()
        engine.train_batch(data)
        engine.set_train_batch_size(2 * 6)  # micro-batch 2, one data-parallel rank: 6 micro-batches
        engine.train_batch(data)
        assert handle.plan.micro_batches == 6
        assert len(handle.tracker.last_actions) == 12
        # Back to 4: that count's tracker, with what its slots learned (a new one started them afresh).
        first = handle.tracker
        engine.set_train_batch_size(2 * 4)
        engine.train_batch(data)
        assert handle.plan.micro_batches == 4 and handle.tracker.iteration == 2 and handle.tracker is not first
    finally:
        fds.uninstrument(engine)


def test_on_cuda_the_marks_take_the_devices_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    # The tracker picks CUDA events for a cuda:N device (freeride.training.device_clock): the adapter
    # hands it the reporter's device unless told another.
    from freeride.training import tracker as tracker_module
    from freeride.training.device_clock import HostClock

    asked: list[str | None] = []

    def clock(device: str | None, consumer: Any) -> HostClock:
        asked.append(device)
        return HostClock(consumer)

    monkeypatch.setattr(tracker_module, "default_clock", clock)

    class Reporter:
        device = "cuda:3"

        def bubble_start(self, *args: Any, **kwargs: Any) -> None: ...

        def bubble_end(self, *args: Any, **kwargs: Any) -> None: ...

    class Recorder:  # a sink that names no device
        def bubble_start(self, *args: Any, **kwargs: Any) -> None: ...

        def bubble_end(self, *args: Any, **kwargs: Any) -> None: ...

    engine = ReplayEngine(TrainSchedule, 4, 2, 0)
    fds._install(engine, Reporter(), device=None)
    fds.uninstrument(engine)
    other = ReplayEngine(TrainSchedule, 4, 2, 1)
    fds._install(other, Recorder(), device="cuda:1")
    fds.uninstrument(other)
    assert asked == ["cuda:3", "cuda:1"]
    # A reporter of another device than the rank's would run side tasks there in this rank's bubbles.
    with pytest.raises(ConfigError, match="the reporter reports bubbles of cuda:3, and this rank's device is cuda:1"):
        fds._install(ReplayEngine(TrainSchedule, 4, 2, 1), Reporter(), device="cuda:1")
