"""torchtitan: the trainer's pipeline schedule, instrumented.

torchtitan builds a plain ``torch.distributed.pipelining`` schedule (``pipeline_llm``), keeps it as
``Trainer.pp_schedule`` and calls ``pp_schedule.step(...)`` once per training step; its validator
keeps a reference of its own and calls ``eval(...)``. So after the trainer is built::

    from freeride.training import BubbleReporter
    from freeride.training.torchtitan import instrument

    reporter = BubbleReporter(device, stage=trainer.parallel_dims.get_mesh("pp").get_local_rank(),
                              rank=dist.get_rank())
    instrument(trainer, reporter)
    trainer.train()

:func:`instrument` replaces ``trainer.pp_schedule`` with an :class:`InstrumentedPipelineSchedule`:
its ``step`` runs through :class:`~freeride.training.instrument.InstrumentedSchedule` (the torch
pipelining instrumentation: the schedule's own action order, the real receive waits, the device's
clock on CUDA), and everything else -- ``eval``, attributes, ``isinstance`` -- is the schedule's own. The stage hooks
are attached only while a ``step`` runs, so an ``eval`` through the validator's reference (the raw
schedule, on the same stages) runs bare and reports nothing. :func:`uninstrument` puts the raw
schedule back. Nothing here imports torchtitan: the schedule is torch's.

torchtitan's trainer passes ``step`` the keywords of torch 2.14 (``arg_mbs``, ``kwarg_mbs``,
``target_mbs``, ``loss_kwargs``, ``return_outputs``); they reach the schedule unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from freeride.errors import ConfigError
from freeride.training.instrument import InstrumentedSchedule
from freeride.training.learned_slots import LearningConfig
from freeride.training.tracker import BubbleSink, MeasuredBubble, torch_device_name


class InstrumentedPipelineSchedule:
    """A torch pipeline schedule whose ``step`` reports its bubbles; everything else passes through.

    ``sink``, ``device``, ``on_iteration`` and ``learning`` are those of
    :class:`~freeride.training.instrument.InstrumentedSchedule`; ``device`` defaults to the sink's
    device, else the stages' (``cuda:N`` picks the device clock).
    """

    def __init__(
        self,
        schedule: Any,
        sink: BubbleSink | None = None,
        *,
        device: str | None = None,
        on_iteration: Callable[[int, list[MeasuredBubble]], None] | None = None,
        learning: LearningConfig | None = None,
    ) -> None:
        device = device or getattr(sink, "device", None) or _stage_device(schedule)
        instrumented = InstrumentedSchedule(schedule, sink, device=device, on_iteration=on_iteration,
                                            learning=learning)
        instrumented.detach()  # attached by step() only: see the module doc
        # Set through __dict__: __getattr__ forwards every other name to the schedule.
        self.__dict__.update(schedule=schedule, instrumented=instrumented, sink=sink)

    schedule: Any
    instrumented: InstrumentedSchedule
    sink: BubbleSink | None

    def step(self, *args: Any, **kwargs: Any) -> Any:
        """One training step: the schedule's ``step``, instrumented (same arguments)."""
        instrumented = self.instrumented
        instrumented.attach()
        try:
            return instrumented.step(*args, **kwargs)
        finally:
            instrumented.detach()

    def eval(self, *args: Any, **kwargs: Any) -> Any:
        """The schedule's own ``eval``: validation is not training, and its waits are not reported."""
        return self.schedule.eval(*args, **kwargs)

    def close(self) -> None:
        """Deliver the last bubbles and stop the clock (the schedule itself is untouched)."""
        self.instrumented.close()

    @property
    def last_bubbles(self) -> list[MeasuredBubble]:
        return self.instrumented.last_bubbles

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["schedule"], name)

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # noqa: D105
        """The schedule's class: a trainer's ``isinstance(pp_schedule, PipelineScheduleMulti)`` (or any
        schedule class) holds as it did before the wrap, and so does ``isinstance(.., InstrumentedPipelineSchedule)``
        (``isinstance`` asks the real type first). ``type()`` still says what this is."""
        return type(self.__dict__["schedule"])

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.schedule, name, value)

    def __repr__(self) -> str:
        return f"InstrumentedPipelineSchedule({self.schedule!r})"


def _stage_device(schedule: Any) -> str | None:
    stages = getattr(schedule, "_stages", None) or [getattr(schedule, "_stage", None)]
    return torch_device_name(getattr(stages[0], "device", None))


def instrument(
    trainer: Any,
    reporter: BubbleSink | None = None,
    *,
    device: str | None = None,
    on_iteration: Callable[[int, list[MeasuredBubble]], None] | None = None,
    learning: LearningConfig | None = None,
) -> InstrumentedPipelineSchedule:
    """Wrap ``trainer.pp_schedule`` (a torchtitan ``Trainer``'s, or any object's that holds one) so
    that its steps report their bubbles to ``reporter``; returns the wrapper, now ``trainer.pp_schedule``.

    Raises :class:`~freeride.errors.ConfigError` when the trainer has no pipeline schedule (pipeline
    parallelism off) or is instrumented already, and
    :class:`~freeride.training.instrument.PipeliningInternalsChanged` for a schedule freeride cannot read.
    """
    schedule = getattr(trainer, "pp_schedule", None)
    if schedule is None and callable(getattr(trainer, "step", None)) and (
            hasattr(trainer, "_stages") or hasattr(trainer, "_stage")):
        raise ConfigError(f"instrument() takes the trainer that holds the schedule as pp_schedule, got the schedule "
                          f"itself ({type(trainer).__name__}): pass the trainer, or wrap a schedule of your own with "
                          "freeride.training.InstrumentedSchedule")
    if schedule is None:
        raise ConfigError(
            f"{type(trainer).__name__}.pp_schedule is {'missing' if not hasattr(trainer, 'pp_schedule') else 'None'}:"
            " freeride.training.torchtitan instruments pipeline parallelism (parallelism.pipeline_parallel_degree > 1)"
        )
    if isinstance(schedule, InstrumentedPipelineSchedule):
        raise ConfigError("this trainer's pp_schedule is instrumented already: uninstrument(trainer) first")
    wrapper = InstrumentedPipelineSchedule(schedule, reporter, device=device, on_iteration=on_iteration,
                                           learning=learning)
    wrapper.__dict__["owner"] = trainer  # for uninstrument(wrapper)
    trainer.pp_schedule = wrapper
    return wrapper


def uninstrument(trainer: Any) -> None:
    """Put the raw schedule back in ``trainer.pp_schedule`` and deliver the last bubbles; does nothing
    if it is not instrumented. ``trainer`` may also be the wrapper :func:`instrument` returned (it did
    nothing then, and the trainer stayed wrapped)."""
    if type(trainer) is InstrumentedPipelineSchedule:
        given: InstrumentedPipelineSchedule = trainer
        given.close()
        owner = given.__dict__.get("owner")
        if owner is not None and getattr(owner, "pp_schedule", None) is given:
            owner.pp_schedule = given.schedule
        return
    wrapper = getattr(trainer, "pp_schedule", None)
    if type(wrapper) is InstrumentedPipelineSchedule:
        wrapper.close()
        trainer.pp_schedule = wrapper.schedule
