"""freeride.training.torchtitan on real torch schedules in this process (a one-rank gloo group).

torchtitan's trainer holds a plain torch pipeline schedule; these tests wrap real ones (single-stage
1F1B, and a looped schedule with two stages on the rank) in a stand-in trainer and check what the
adapter promises: ``step`` instrumented with the same results as the bare schedule, ``eval`` and
attributes passing through, the stage hooks off outside ``step`` (torchtitan's validator evaluates
through its own reference to the raw schedule), and ``uninstrument`` putting the schedule back. The
two-rank run, built by torchtitan's own ``pipeline_llm``, is ``test_deepspeed_torchtitan_e2e.py``.
The README's framework snippets are the documentation's, word for word (the documentation's run as
written in each framework's end-to-end test), and the README's torch pipelining one runs here as written.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from conftest import cpu_devices
from framework_support import README, docs_snippet
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

from freeride.errors import ConfigError
from freeride.training import torchtitan as ftt


class Sink:
    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []

    def bubble_start(self, iteration: int, slot: int, kind: str, predicted_ns: int, free_memory_bytes: int = -1,
                     start_ns: int | None = None, learned: bool = False) -> None:
        self.events.append(("start", iteration, slot))

    def bubble_end(self, iteration: int, slot: int, end_ns: int | None = None) -> None:
        self.events.append(("end", iteration, slot))


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out, target)


def _schedule(looped: bool) -> Any:
    torch.manual_seed(0)
    if looped:
        stages = [PipelineStage(torch.nn.Linear(4, 4), i, 2, torch.device("cpu")) for i in range(2)]
        return ScheduleInterleaved1F1B(stages, n_microbatches=2, loss_fn=_loss, scale_grads=False)
    stage = PipelineStage(torch.nn.Linear(4, 4), 0, 1, torch.device("cpu"))
    return Schedule1F1B(stage, n_microbatches=2, loss_fn=_loss, scale_grads=False)


def _stages(schedule: Any) -> list[Any]:
    return list(getattr(schedule, "_stages", None) or [schedule._stage])


def _hooks(schedule: Any) -> list[set[str]]:
    """The functions set on each stage instance: where the instrumentation's hooks go."""
    return [{n for n, v in vars(s).items() if isinstance(v, types.FunctionType)} for s in _stages(schedule)]


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(4, 4, generator=gen), torch.randn(4, 4, generator=gen)


@pytest.mark.parametrize("looped", [False, True], ids=["Schedule1F1B", "ScheduleInterleaved1F1B"])
def test_step_is_instrumented_and_gives_the_bare_schedules_results(one_rank: None, looped: bool) -> None:
    trainer, twin = types.SimpleNamespace(pp_schedule=_schedule(looped)), _schedule(looped)
    wrapper = ftt.instrument(trainer, Sink(), device="cpu")
    assert trainer.pp_schedule is wrapper
    x, y = _batch()
    for _ in range(2):
        losses: list[torch.Tensor] = []
        twin_losses: list[torch.Tensor] = []
        wrapper.step(x, target=y, losses=losses)
        twin.step(x, target=y, losses=twin_losses)
        assert [float(v.detach()) for v in losses] == [float(v.detach()) for v in twin_losses]
        assert _hooks(wrapper.schedule) == _hooks(twin)  # the stage hooks are on only inside step
    wrapper.instrumented.flush()
    assert wrapper.instrumented.iteration == 2
    assert len(wrapper.instrumented.last_actions) == 2 * len(_stages(wrapper.schedule)) * 2  # F and B, 2 mbs
    ftt.uninstrument(trainer)


def test_eval_through_either_reference_runs_the_bare_stages(one_rank: None) -> None:
    # Single-stage only: torch 2.13's eval of a looped schedule with both stages on one rank fails bare
    # ("can't steal_bwd_input"); the looped case's hooks-off-after-step is checked above.
    raw = _schedule(False)
    bare = _hooks(raw)
    trainer = types.SimpleNamespace(pp_schedule=raw)
    sink = Sink()
    wrapper = ftt.instrument(trainer, sink, device="cpu")
    x, y = _batch()
    wrapper.step(x, target=y, losses=[])
    assert _hooks(raw) == bare  # hooked only while step ran
    wrapper.instrumented.flush()
    before, iteration = list(sink.events), wrapper.instrumented.iteration
    for schedule in (raw, wrapper):  # torchtitan's validator holds the raw one
        losses: list[torch.Tensor] = []
        schedule.eval(x, target=y, losses=losses)
        assert losses
    wrapper.instrumented.flush()
    assert sink.events == before and wrapper.instrumented.iteration == iteration
    ftt.uninstrument(trainer)


def test_attributes_pass_through_both_ways(one_rank: None) -> None:
    raw = _schedule(False)
    wrapper = ftt.instrument(types.SimpleNamespace(pp_schedule=raw), None, device="cpu")
    assert wrapper._n_microbatches == raw._n_microbatches == 2
    wrapper.some_flag = True
    assert raw.some_flag is True and "some_flag" not in vars(wrapper)
    assert "Schedule1F1B" in repr(wrapper)


def test_the_wrapper_passes_a_trainers_isinstance_checks_of_the_schedule(one_rank: None) -> None:
    # An earlier stranger trial: a trainer's isinstance(pp_schedule, PipelineScheduleMulti) turned False once wrapped.
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

    for looped, kind in ((False, PipelineScheduleSingle), (True, PipelineScheduleMulti)):
        trainer = types.SimpleNamespace(pp_schedule=_schedule(looped))
        wrapper = ftt.instrument(trainer, None, device="cpu")
        assert isinstance(wrapper, kind) and isinstance(wrapper, type(wrapper.schedule))
        assert isinstance(wrapper, ftt.InstrumentedPipelineSchedule)
        assert type(wrapper) is ftt.InstrumentedPipelineSchedule
        ftt.uninstrument(trainer)


def test_torch_2_14_keywords_reach_the_schedule_unchanged(one_rank: None) -> None:
    # torchtitan calls step(arg_mbs=..., kwarg_mbs=..., target_mbs=..., losses=..., loss_kwargs=...,
    # return_outputs=False): torch 2.14's form. Here the schedule only records what it was given.
    raw = _schedule(False)
    seen: dict[str, Any] = {}
    raw.step = lambda *args, **kwargs: seen.update(args=args, kwargs=kwargs)
    wrapper = ftt.instrument(types.SimpleNamespace(pp_schedule=raw), None, device="cpu")
    keywords = {"arg_mbs": [(1,)], "kwarg_mbs": [{}], "target_mbs": None, "losses": None,
                "loss_kwargs": {"global_valid_tokens": 3}, "return_outputs": False}
    wrapper.step(**keywords)
    assert seen == {"args": (), "kwargs": keywords}


def test_uninstrument_puts_the_raw_schedule_back(one_rank: None) -> None:
    raw = _schedule(True)
    bare = _hooks(raw)
    trainer = types.SimpleNamespace(pp_schedule=raw)
    ftt.instrument(trainer, None, device="cpu")
    trainer.pp_schedule.step(*_batch()[:1], target=_batch()[1], losses=[])
    ftt.uninstrument(trainer)
    assert trainer.pp_schedule is raw and _hooks(raw) == bare
    ftt.uninstrument(trainer)  # nothing left to undo


def test_uninstrument_of_the_wrapper_puts_the_raw_schedule_back_in_its_trainer(one_rank: None) -> None:
    # Stranger trial: uninstrument(wrapper) returned quietly and the trainer stayed wrapped.
    raw = _schedule(False)
    trainer = types.SimpleNamespace(pp_schedule=raw)
    wrapper = ftt.instrument(trainer, None, device="cpu")
    ftt.uninstrument(wrapper)
    assert trainer.pp_schedule is raw
    ftt.uninstrument(wrapper)  # nothing left to undo
    assert trainer.pp_schedule is raw


def test_the_wrong_objects_are_refused_saying_what_to_pass(one_rank: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from freeride.errors import FrameworkNotInstalled
    from freeride.training import InstrumentedSchedule

    raw = _schedule(False)
    # Stranger trial: instrument(schedule) said "pp_schedule is missing ... pipeline_parallel_degree > 1".
    with pytest.raises(ConfigError, match=r"takes the trainer that holds the schedule as pp_schedule, got the "
                                          r"schedule itself \(Schedule1F1B\): pass the trainer"):
        ftt.instrument(raw)
    # ... and the wrapper in InstrumentedSchedule blamed torch's internals.
    wrapper = ftt.instrument(types.SimpleNamespace(pp_schedule=raw), None, device="cpu")
    with pytest.raises(ConfigError, match="is instrumented already"):
        InstrumentedSchedule(wrapper)
    wrapper.close()
    # Without torch: one line naming what to install, as the other adapters say it (it was a ModuleNotFoundError).
    monkeypatch.setitem(sys.modules, "torch.distributed.pipelining.schedules", None)
    with pytest.raises(FrameworkNotInstalled, match="needs torch") as info:
        ftt.instrument(types.SimpleNamespace(pp_schedule=raw), None, device="cpu")
    assert "\n" not in str(info.value)


def test_a_trainer_without_pipeline_parallelism_is_refused() -> None:
    with pytest.raises(ConfigError, match="pp_schedule is None"):
        ftt.instrument(types.SimpleNamespace(pp_schedule=None))
    with pytest.raises(ConfigError, match="pp_schedule is missing"):
        ftt.instrument(object())


def test_a_trainer_instrumented_twice_is_refused(one_rank: None) -> None:
    trainer = types.SimpleNamespace(pp_schedule=_schedule(False))
    ftt.instrument(trainer, None, device="cpu")
    with pytest.raises(ConfigError, match="instrumented already"):
        ftt.instrument(trainer, None, device="cpu")
    ftt.uninstrument(trainer)


# ------------------------------------------------------------------ the documented snippets


@pytest.mark.parametrize("name", ["megatron", "deepspeed", "torchtitan"])
def test_the_readme_shows_the_documented_snippets_word_for_word(name: str) -> None:
    assert docs_snippet(name, README) == docs_snippet(name)


def test_the_torch_pipelining_snippet_runs_as_written(one_rank: None) -> None:
    # The README's short form (docs/bubbles.md has a whole script, run under torchrun by
    # test_schedules_e2e.py): it needs only a schedule, here a real one-rank 1F1B, and nobody listening.
    schedule = _schedule(False)
    model = _stages(schedule)[0].submod
    x, y = _batch()
    scope: dict[str, Any] = {"schedule": schedule, "device": cpu_devices(1)[0], "pp_rank": 0, "steps": 3,
                             "x": x, "y": y, "losses": [],
                             "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}
    before = [p.detach().clone() for p in model.parameters()]
    exec(compile(docs_snippet("torch", README), "README.md#torch", "exec"), scope)
    try:
        instrumented = scope["instrumented"]
        instrumented.flush()
        assert instrumented.iteration == 3 and len(scope["losses"]) == 2  # the last step's, one per micro-batch
        assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))  # it trained
    finally:
        scope["instrumented"].close()
        scope["reporter"].close()


def test_on_cuda_the_wrapper_takes_the_devices_clock(one_rank: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from freeride.training import tracker as tracker_module
    from freeride.training.device_clock import HostClock

    asked: list[str | None] = []

    def clock(device: str | None, consumer: Any) -> HostClock:
        asked.append(device)
        return HostClock(consumer)

    monkeypatch.setattr(tracker_module, "default_clock", clock)
    sink = Sink()
    sink.device = "cuda:2"  # type: ignore[attr-defined]
    trainer = types.SimpleNamespace(pp_schedule=_schedule(False))
    ftt.instrument(trainer, sink)
    ftt.uninstrument(trainer)
    assert asked == ["cuda:2"]
