"""A DeepSpeed schedule replayed without a model or peers: freeride's hooks on an empty pipeline.

:class:`ReplayEngine` walks a real DeepSpeed schedule (``TrainSchedule``, ``DualPipeVSchedule``) for one
stage and dispatches every instruction exactly as ``PipelineEngine._exec_schedule`` does -- through
``self._INSTRUCTION_MAP``, binding the function with ``MethodType`` -- to functions that only count;
``train_batch`` then calls ``_aggregate_total_loss``, and ``OptimizerStep`` calls
``clip_fp32_gradients``, which asks ``self.mpu`` for its model-parallel group, as DeepSpeed's does.
So :func:`freeride.training.deepspeed.instrument`'s hooks see the call sequence of a real engine
and nothing else runs: the tests check the marks it makes, and ``bench/bench_schedules.py`` times
what the hooks cost the training thread per iteration (:func:`hot_path_ns`).
"""

from __future__ import annotations

import time
from types import MethodType
from typing import Any

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

    def __init__(self, schedule_type: Any, micro_batches: int, stages: int, stage_id: int, wait_s: float = 0.0) -> None:
        from deepspeed.runtime.pipe import schedule

        self._schedule_type = schedule_type
        self.micro_batches = micro_batches
        self.num_stages = stages
        self.stage_id = stage_id
        self.mpu = Grid()
        #: How long each waiting instruction, the loss broadcast and the clipping's all-reduce sleep: a
        #: sleep costs the thread no CPU time, so the hooks' own cost stays measurable beside it.
        self.wait_s = wait_s
        self.ran: list[tuple[str, dict[str, Any]]] = []  # every instruction run (cleared by the caller)
        self.losses = 0
        names = ["OptimizerStep", "ReduceGrads", "ReduceTiedGrads", "LoadMicroBatch", "ForwardPass", "BackwardPass",
                 "SendActivation", "RecvActivation", "SendGrad", "RecvGrad", "CommitP2P"]
        type(self)._INSTRUCTION_MAP = {getattr(schedule, n): self._instruction(n) for n in names}

    _INSTRUCTION_MAP: dict[type, Any] = {}

    @staticmethod
    def _instruction(name: str) -> Any:
        def run(self: ReplayEngine, **kwargs: Any) -> None:
            self.ran.append((name, kwargs))
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


def hot_path_ns(dualpipev: bool, micro_batches: int, batches: int = 30, per_batch: int = 200) -> list[float]:
    """Training-thread ns per iteration that ``freeride.training.deepspeed``'s hooks and tracker add, per
    rank of a two-rank pipeline: paired batches of replayed iterations, bare and instrumented, in random
    order, with a reporter that only enqueues (its sender thread has a core of its own); the median
    difference."""
    import random
    import time

    from deepspeed.runtime.pipe.schedule import DualPipeVSchedule, TrainSchedule

    from freeride.endpoints import Endpoint
    from freeride.measure import median
    from freeride.training import deepspeed as fds
    from freeride.training.reporter import BubbleReporter

    schedule_type = DualPipeVSchedule if dualpipev else TrainSchedule
    out = []
    for rank in (0, 1):
        bare = ReplayEngine(schedule_type, micro_batches, 2, rank)
        walked = ReplayEngine(schedule_type, micro_batches, 2, rank)
        offline = BubbleReporter("cpu:0", stage=rank, rank=rank, endpoint=Endpoint("unix", "/nonexistent"),
                                 start=False, queue_size=10**8)
        fds._install(walked, offline, device="cpu:0")
        samples: dict[str, list[float]] = {"bare": [], "inst": []}
        for _ in range(batches):
            pair = [("bare", bare), ("inst", walked)]
            random.shuffle(pair)
            for key, engine in pair:
                t0 = time.perf_counter_ns()
                for _ in range(per_batch):
                    engine.train_batch()
                samples[key].append((time.perf_counter_ns() - t0) / per_batch)
                engine.ran.clear()
        fds.uninstrument(walked)
        offline.close()
        out.append(median([i - b for i, b in zip(samples["inst"], samples["bare"], strict=True)]))
    return out
