"""A torchtitan-built pipeline job for :mod:`freeride.training.torchtitan`'s end-to-end test and bench.

torchtitan's ``Trainer`` needs a GPU (it picks ``cuda`` and NCCL) and torch 2.14's ``step`` keywords;
this job keeps everything of it that runs on a CPU with torch 2.13 and stands in for the rest. Under
torchrun (gloo; each rank pinned to one of its cores)::

    torchrun --standalone --nproc-per-node 2 -m freeride.workload.torchtitan_job \\
        --iterations 30 --slow-stage 1 --slow-ms 5 --iteration-log /tmp/tt.jsonl

* **The schedule is torchtitan's.** ``torchtitan.distributed.pipeline_parallel.pipeline_llm`` -- the
  function the trainer calls -- splits a small model laid out the torchtitan way (``tok_embeddings``,
  ``layers``, ``norm``, ``lm_head``) into stages and builds the schedule from a ``ParallelismConfig``
  (``--schedule``, default 1F1B; micro-batches = local batch / micro-batch size). Its ``ParallelDims``
  is torchtitan's own, given a CPU ``pp`` mesh (its own mesh builder asks for CUDA). Without
  torchtitan installed (``--builder torch``, or ``auto`` when it cannot be imported) the stages and
  schedule are built the same way with torch alone.
* **The trainer is a stand-in** (:class:`Trainer`) with torchtitan's attribute names: ``pp_schedule``,
  ``parallel_dims``, ``pp_has_first_stage`` / ``pp_has_last_stage``, a ``train()`` loop of
  ``train_step`` (``pp_schedule.step`` in torch 2.13's form, then the optimizer) and a ``validator``
  that keeps the raw schedule and calls ``eval`` on it, as torchtitan's does.
* ``--slow-stage S --slow-ms X``: model stage S (0: the embedding's, 1: the norm's) spins X ms more in
  each forward (:func:`freeride.workload.pipelines.slow_down`).

The job instruments the trainer (``--report``: a reporter to the rank's manager) or runs ``--snippet
FILE`` with ``trainer`` and ``device`` in scope (the documentation's snippet, as written), trains
``--iterations`` steps, validates once through the validator's raw schedule and once through the
wrapper, uninstruments, and trains a bare twin (``--twin``, same initial weights and batches). Its log
(``--iteration-log``, ``--idle-probe``) is the reference trainer's
(:class:`freeride.workload.jobs.IterationLog`), the checks in the summary record.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)

VOCAB = 64
SEQ = 16


class TitanStyleModel(nn.Module):
    """A small model with torchtitan's module names; its forward tolerates the modules a stage lacks
    (torchtitan's split sets them to None or empties them)."""

    def __init__(self, width: int, layers: int, slow_stage: int, slow_ms: float) -> None:
        from freeride.workload.pipelines import slow_down

        super().__init__()
        self.tok_embeddings: nn.Module | None = nn.Embedding(VOCAB, width)
        self.layers = nn.ModuleDict({str(i): nn.Sequential(nn.Linear(width, width), nn.Tanh()) for i in range(layers)})
        self.norm: nn.Module | None = nn.LayerNorm(width)
        self.lm_head: nn.Module | None = nn.Linear(width, VOCAB)
        # The first stage holds the embedding, the last the norm: a forward hook there slows that stage.
        if slow_ms > 0 and slow_stage in (0, 1):
            slow_down(self.tok_embeddings if slow_stage == 0 else self.norm, slow_ms)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for layer in self.layers.values():
            h = layer(h)
        if self.norm is not None:
            h = self.norm(h)
        return self.lm_head(h) if self.lm_head is not None else h


def loss_fn(pred: torch.Tensor, labels: torch.Tensor, **_: Any) -> tuple[torch.Tensor, None]:
    """torchtitan's loss shape: (loss, extra); its schedule builder keeps the first."""
    return nn.functional.cross_entropy(pred.flatten(0, 1), labels.flatten(0, 1)), None


class Validator:
    """Keeps the raw schedule, as torchtitan's validator does, and evaluates one batch with it."""

    def __init__(self, trainer: Trainer) -> None:
        self.pp_schedule = trainer.pp_schedule
        self._trainer = trainer

    def validate(self, x: torch.Tensor, y: torch.Tensor) -> float | None:
        losses: list[torch.Tensor] = []
        with torch.no_grad():
            if self._trainer.pp_has_first_stage:
                self.pp_schedule.eval(x)
            else:
                self.pp_schedule.eval(target=y, losses=losses)
        return float(torch.stack(losses).sum()) if losses else None


class Trainer:
    """The parts of ``torchtitan.trainer.Trainer`` that the adapter and the snippet touch (module doc)."""

    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        torch.manual_seed(args.seed)
        model = TitanStyleModel(args.width, args.layers, args.slow_stage, args.slow_ms)
        builder = build_with_torchtitan if _use_torchtitan(args.builder) else build_with_torch
        self.pp_schedule, self.model_parts, self.pp_has_first_stage, self.pp_has_last_stage, self.parallel_dims = (
            builder(model, args, device))
        self.optimizer = torch.optim.AdamW([p for m in self.model_parts for p in m.parameters()], lr=1e-2)
        self.validator = Validator(self)
        self.steps = args.iterations
        self.batch = args.local_batch
        self.seed = args.seed
        self.losses: list[float] = []
        self.on_step: Callable[[int, int, float | None], None] | None = None  # (step, its start ns, loss)

    def batch_of(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed * 7919 + step)
        tokens = torch.randint(0, VOCAB, (self.batch, SEQ + 1), generator=gen)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def train_step(self, step: int) -> None:
        start = time.monotonic_ns()
        x, y = self.batch_of(step)
        losses: list[torch.Tensor] = []
        if self.pp_has_first_stage:
            self.pp_schedule.step(x)
        else:
            self.pp_schedule.step(target=y, losses=losses)
        self.optimizer.step()
        self.optimizer.zero_grad()
        loss = float(torch.stack([loss.detach() for loss in losses]).sum()) if losses else None
        self.losses.append(float("nan") if loss is None else loss)
        if self.on_step is not None:
            self.on_step(step, start, loss)

    def train(self) -> None:
        for step in range(self.steps):
            self.train_step(step)


def _use_torchtitan(builder: str) -> bool:
    if builder != "auto":
        return builder == "torchtitan"
    try:
        import torchtitan.distributed.pipeline_parallel  # noqa: F401
    except ImportError:
        return False
    return True


def build_with_torchtitan(model: nn.Module, args: argparse.Namespace, device: torch.device) -> tuple[Any, ...]:
    """``pipeline_llm`` as torchtitan's trainer calls it, with a CPU ``pp`` mesh (module doc)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.pipeline_parallel import pipeline_llm

    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    parallel_dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=ranks, ep=1, world_size=ranks)
    parallel_dims._single_axis_meshes["pp"] = init_device_mesh("cpu", (ranks,), mesh_dim_names=("pp",))

    class ModelConfig:  # what pipeline_llm reads of the model's config: the number of layers
        layers = [None] * args.layers

    schedule, parts, first, last = pipeline_llm(
        model, parallel_dims=parallel_dims, training=TrainingConfig(local_batch_size=args.local_batch),
        parallelism=ParallelismConfig(pipeline_parallel_degree=ranks, pipeline_parallel_schedule=args.schedule,
                                      pipeline_parallel_microbatch_size=args.micro_batch),
        compile_config=CompileConfig(), ac_config=None, dump_folder=args.dump_folder, device=device,
        model_config=ModelConfig(), parallelize_fn=lambda m, **_: m, loss_fn=loss_fn,
    )
    return schedule, parts, first, last, parallel_dims


def build_with_torch(model: nn.Module, args: argparse.Namespace, device: torch.device) -> tuple[Any, ...]:
    """The same split and schedule with torch alone (single-stage schedules: one chunk per rank)."""
    import copy

    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import get_schedule_class

    rank, ranks = dist.get_rank(), dist.get_world_size()
    chunk: Any = copy.deepcopy(model)
    per = args.layers // ranks
    keep = {str(i) for i in range(rank * per, (rank + 1) * per)}
    for name in list(chunk.layers.keys()):
        if name not in keep:
            del chunk.layers[name]
    if rank != 0:
        chunk.tok_embeddings = None
    if rank != ranks - 1:
        chunk.norm = chunk.lm_head = None
    stage = PipelineStage(chunk, rank, ranks, device)

    def scalar_loss(*a: Any, **k: Any) -> torch.Tensor:
        return loss_fn(*a, **k)[0]

    schedule = get_schedule_class(args.schedule)(stage, n_microbatches=args.local_batch // args.micro_batch,
                                                 loss_fn=scalar_loss, scale_grads=False)
    return schedule, [chunk], rank == 0, rank == ranks - 1, None


def _functions(obj: Any) -> dict[str, int]:
    """The functions set on an instance (where hooks go), by identity."""
    return {name: id(value) for name, value in vars(obj).items() if isinstance(value, types.FunctionType)}


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch.distributed as dist

    from freeride.training import torchtitan as fr_torchtitan
    from freeride.training.reporter import BubbleReporter
    from freeride.workload.jobs import IterationLog, pin_rank
    from freeride.workload.run import rank_endpoint

    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    device, given_cores = pin_rank(local_rank)
    dist.init_process_group("gloo")
    torch_device = torch.device("cpu")
    trainer = Trainer(args, torch_device)
    twin = Trainer(args, torch_device) if args.twin else None
    raw = trainer.pp_schedule
    stages = list(getattr(raw, "_stages", None) or [raw._stage])
    idle = None
    if args.idle_probe:
        from freeride.workload.idle_probe import IdleProbe

        idle = IdleProbe()
        for stage in stages:  # before the instrumentation: its marks then count as the gaps' busy time
            idle.wrap(stage)
    own_methods = [_functions(s) for s in stages]
    out = IterationLog(args.log, rank, device, args.warmup)
    delivered: dict[int, list[Any]] = {}  # the instrumentation's bubbles, per step, until it is logged
    trainer.on_step = lambda step, start, loss: out.write(
        out.record(step, start, loss, idle.take() if idle is not None else None), delivered.pop(step, []))
    reporter: Any = None
    if args.snippet:
        exec(compile(Path(args.snippet).read_text(), args.snippet, "exec"), {"trainer": trainer, "device": device})
        if isinstance(trainer.pp_schedule, fr_torchtitan.InstrumentedPipelineSchedule):
            reporter = trainer.pp_schedule.sink
    else:
        if args.report:
            reporter = BubbleReporter(device, stage=rank, rank=rank, cpu_affinity=given_cores,
                                      endpoint=rank_endpoint(args.endpoint_template, device, local_rank, rank))
        fr_torchtitan.instrument(trainer, reporter, on_iteration=lambda it, found: delivered.__setitem__(it, found))
        trainer.train()
    wrapper = trainer.pp_schedule
    checks: dict[str, Any] = {"builder": "torchtitan" if trainer.parallel_dims else "torch",
                              "schedule": type(raw).__name__,
                              "instrumented": isinstance(wrapper, fr_torchtitan.InstrumentedPipelineSchedule)}
    tracker = None
    x, y = trainer.batch_of(10_000)
    if isinstance(wrapper, fr_torchtitan.InstrumentedPipelineSchedule):
        tracker = wrapper.instrumented.tracker
        tracker.flush()
        checks["attribute_passes_through"] = wrapper._n_microbatches == raw._n_microbatches
        checks["hooks_off_between_steps"] = not wrapper.instrumented.attached
        start = time.monotonic_ns()
        checks["validation_loss"] = trainer.validator.validate(x, y)  # the raw schedule, as torchtitan's does
        trainer.validator.pp_schedule = wrapper  # and through the wrapper
        checks["validation_loss_through_wrapper"] = trainer.validator.validate(x, y)
        trainer.validator.pp_schedule = raw
        checks["eval_window_ns"] = [start, time.monotonic_ns()]
    fr_torchtitan.uninstrument(trainer)
    checks["restored"] = trainer.pp_schedule is raw and [_functions(s) for s in stages] == own_methods
    if twin is not None:
        twin.train()
        checks["losses"], checks["twin_losses"] = trainer.losses, twin.losses
        checks["weights_equal"] = all(
            torch.equal(a, b) for m, n in zip(trainer.model_parts, twin.model_parts, strict=True)
            for a, b in zip(m.parameters(), n.parameters(), strict=True))
    if reporter is not None:
        reporter.close()
    out.summary(tracker, reporter, **checks)
    out.close()
    dist.barrier()
    dist.destroy_process_group()
    return out.records


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    from freeride.workload.jobs import add_job_arguments

    p = argparse.ArgumentParser(prog="python -m freeride.workload.torchtitan_job", description=__doc__.split("\n")[0])
    add_job_arguments(p)
    p.add_argument("--schedule", default="1F1B", help="torchtitan's pipeline_parallel_schedule (single-stage ones)")
    p.add_argument("--local-batch", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--builder", choices=("auto", "torchtitan", "torch"), default="auto")
    p.add_argument("--dump-folder", default="/tmp/freeride-torchtitan-job")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    from freeride.workload.jobs import job_main

    return job_main(run, parse_args, argv)


if __name__ == "__main__":
    raise SystemExit(main())
