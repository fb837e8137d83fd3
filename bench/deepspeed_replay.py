"""A DeepSpeed schedule replayed without a model or peers: freeride's hooks on an empty pipeline.

:class:`ReplayEngine` walks a real DeepSpeed schedule (``TrainSchedule``, ``DualPipeVSchedule``) for one
stage and dispatches every instruction exactly as ``PipelineEngine._exec_schedule`` does -- through
``self._INSTRUCTION_MAP``, binding the function with ``MethodType`` -- to functions that only count;
``train_batch`` then calls ``_aggregate_total_loss``, and ``OptimizerStep`` calls
``clip_fp32_gradients``, which asks ``self.mpu`` for its model-parallel group, as DeepSpeed's does.
So :func:`freeride.training.deepspeed.instrument`'s hooks see the call sequence of a real engine
and nothing else runs: the tests check the marks it makes, and ``bench/bench_schedules.py`` times
what the hooks cost the training thread per iteration (:func:`deepspeed_case`, :mod:`bench.hot_path`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from types import MethodType
from typing import Any

from bench import hot_path
from bench.hot_path import Case, compute
from freeride.training.tracker import BubbleSink

_WAITING = ("SendActivation", "RecvActivation", "SendGrad", "RecvGrad", "CommitP2P")


class Grid:
    """The engine's ``mpu``: only what gradient clipping asks of it."""

    def __init__(self) -> None:
        self.lookups = 0

    def get_model_parallel_group(self) -> str:
        self.lookups += 1
        return "model-parallel"


class ReplayEngine:
    """One stage of a DeepSpeed pipeline with empty instructions (module doc); not an ``nn.Module``."""

    def __init__(self, schedule_type: Any, micro_batches: int, stages: int, stage_id: int, wait_s: float = 0.0,
                 compute_us: float = 0.0, record: bool = True) -> None:
        from deepspeed.runtime.pipe import schedule

        self._schedule_type = schedule_type
        self.micro_batches = micro_batches
        self.num_stages = stages
        self.stage_id = stage_id
        self.mpu = Grid()
        #: How long each waiting instruction, the loss broadcast and the clipping's all-reduce sleep: a
        #: sleep costs the thread no CPU time, so the hooks' own cost stays measurable beside it.
        self.wait_s = wait_s
        #: Busy time of each ``ForwardPass`` and ``BackwardPass`` (:mod:`bench.hot_path`).
        self.compute_us = compute_us
        #: Every instruction run (cleared by the caller), where ``record``: a benchmark records none (a list
        #: growing by thousands of tuples made the garbage collector's passes most of its noise).
        self.ran: list[tuple[str, dict[str, Any]]] = []
        self.record = record
        self.losses = 0
        names = ["OptimizerStep", "ReduceGrads", "ReduceTiedGrads", "LoadMicroBatch", "ForwardPass", "BackwardPass",
                 "SendActivation", "RecvActivation", "SendGrad", "RecvGrad", "CommitP2P"]
        type(self)._INSTRUCTION_MAP = {getattr(schedule, n): self._instruction(n) for n in names}

    _INSTRUCTION_MAP: dict[type, Any] = {}

    @staticmethod
    def _instruction(name: str) -> Any:
        computes = name in ("ForwardPass", "BackwardPass")

        def run(self: ReplayEngine, **kwargs: Any) -> None:
            if self.record:
                self.ran.append((name, kwargs))
            if computes and self.compute_us:
                compute(self.compute_us)
            if name in _WAITING and self.wait_s:
                time.sleep(self.wait_s)
            if name == "OptimizerStep":
                self.clip_fp32_gradients()

        return run

    def _train_schedule(self) -> Any:
        return self._schedule_type(micro_batches=self.micro_batches, stages=self.num_stages, stage_id=self.stage_id)

    def _exec_schedule(self, pipe_schedule: Any) -> None:
        for step_cmds in pipe_schedule:
            for cmd in step_cmds:
                self._exec_instr = MethodType(self._INSTRUCTION_MAP[type(cmd)], self)
                self._exec_instr(**cmd.kwargs)

    def train_batch(self, data_iter: Any = None) -> float:
        self._exec_schedule(self._train_schedule())
        return self._aggregate_total_loss()

    def _aggregate_total_loss(self) -> float:
        self.losses += 1
        if self.wait_s:
            time.sleep(self.wait_s)
        return 0.0

    def clip_fp32_gradients(self) -> None:
        self.mpu.get_model_parallel_group()
        if self.wait_s:
            time.sleep(self.wait_s)


def deepspeed_case(dualpipev: bool, micro_batches: int, rank: int) -> Case:
    """One rank of a two-rank DeepSpeed pipeline, replayed for :mod:`bench.hot_path`: its compute spins, its
    instructions are not recorded, and instrumented it reports every planned position."""
    from deepspeed.runtime.pipe.schedule import DualPipeVSchedule, TrainSchedule

    from freeride.training import deepspeed as fds

    schedule_type = DualPipeVSchedule if dualpipev else TrainSchedule

    def replay() -> ReplayEngine:
        return ReplayEngine(schedule_type, micro_batches, 2, rank, compute_us=hot_path.COMPUTE_US, record=False)

    def instrument(reporter: BubbleSink) -> tuple[Callable[[], object], Callable[[], None]]:
        engine = replay()
        fds._install(engine, reporter, device="cpu:0").tracker.report_min_ns = 0
        return engine.train_batch, lambda: fds.uninstrument(engine)

    return Case(replay().train_batch, instrument)
