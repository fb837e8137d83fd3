"""A DeepSpeed pipeline job for :mod:`freeride.training.deepspeed`'s end-to-end test and the bench.

One process per pipeline rank under torchrun (gloo on CPU; each rank pinned to one of the cores it may
use, in order of local rank, with one torch thread)::

    torchrun --standalone --nproc-per-node 2 -m freeride.workload.deepspeed_job \\
        --iterations 30 --slow-stage 1 --slow-ms 5 --report --iteration-log /tmp/ds.jsonl

The model is a stack of blocks (``Linear``, ``tanh``), one per model stage, trained on a synthetic
classification task; ``--slow-stage S --slow-ms X`` makes block S spin X ms more in every forward
(busy compute: :func:`freeride.workload.pipelines.slow_down`), so its neighbours wait by a known amount.
``--dualpipev`` runs DeepSpeed's ``DualPipeVEngine`` (two model stages per rank) instead of the
``PipelineEngine``. DeepSpeed's shared-memory op is not built (a pipeline-only job never uses it).

In order: build the engine (``--twin``: and a bare one with the same initial weights); install a
*probe* -- instance-level wrappers of its own, set before freeride's, which wrap them in turn -- that
times every instruction, the loss broadcast and the gradient clipping (``probe`` in each iteration
record), and with ``--idle-probe`` the idle gaps between compute instructions
(:mod:`freeride.workload.idle_probe`); instrument the engine (``--report``: a reporter to the rank's
manager) or run ``--snippet FILE``, user code executed with ``engine``, ``data_iter``, ``device`` and
``steps`` in scope (the documentation's snippet, tested as written); train; run one ``eval_batch``;
uninstrument and check that the hooked attributes are exactly those before; train the twin on the same
batches. The log (``--iteration-log``) is the reference trainer's: one record per iteration, then a
summary with those checks.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: The instance attributes freeride's hooks replace (on the engine, and on its grid).
HOOKED = ("_INSTRUCTION_MAP", "train_batch", "_aggregate_total_loss", "clip_fp32_gradients",
          "get_model_parallel_group")


def build_model(width: int, model_stages: int, slow_stage: int, slow_ms: float, dualpipev: bool,
                ranks: int) -> Any:
    """The pipeline module: one block per model stage; blocks are built only on their own rank."""
    import torch
    from deepspeed.pipe import LayerSpec, PipelineModule

    from freeride.workload.pipelines import slow_down

    class Block(torch.nn.Module):
        def __init__(self, spin_ms: float) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(width, width)
            if spin_ms > 0:
                slow_down(self, spin_ms)

        def forward(self, x: Any) -> Any:
            return torch.tanh(self.linear(x))

    layers = [LayerSpec(Block, slow_ms if s == slow_stage else 0.0) for s in range(model_stages)]
    kind: Any = PipelineModule
    if dualpipev:
        from deepspeed.runtime.pipe.dualpipev import DualPipeVModule

        kind = DualPipeVModule
    return kind(layers=layers, num_stages=ranks, loss_fn=torch.nn.CrossEntropyLoss(), partition_method="uniform")


def batches(width: int, micro_batch: int, seed: int) -> Iterator[tuple[Any, Any]]:
    """An endless, seeded stream of (inputs, labels) micro-batches, the same on every rank."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    while True:
        x = torch.randn(micro_batch, width, generator=gen)
        yield x, (x[:, : width // 2].sum(dim=1) > 0).long() * 3 + (x[:, 0] > 0).long()


def make_engine(model: Any, micro_batch: int, micro_batches: int, clipping: float) -> Any:
    import deepspeed
    import torch

    config = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": micro_batches,
              "gradient_clipping": clipping, "steps_per_print": 10**9}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


class Probe:
    """Instance-level timers of an engine, installed before freeride's hooks (which then wrap them)."""

    def __init__(self, engine: Any, idle: Any = None) -> None:
        self.events: list[list[Any]] = []
        clock, events = time.monotonic_ns, self.events

        def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
            def run(*args: Any, **kwargs: Any) -> Any:
                start = clock()
                try:
                    return fn(*args, **kwargs)
                finally:
                    events.append([name, start, clock()])

            return run

        table = {cls: timed(cls.__name__, fn) for cls, fn in type(engine)._INSTRUCTION_MAP.items()}
        if idle is not None:  # the idle probe measures the gaps before the compute instructions
            for cls in [c for c in table if c.__name__ in ("ForwardPass", "BackwardPass")]:
                table[cls] = idle.timed(table[cls])
        engine._INSTRUCTION_MAP = table
        engine._aggregate_total_loss = timed("LossBroadcast", engine._aggregate_total_loss)
        engine.clip_fp32_gradients = timed("ClipGradients", engine.clip_fp32_gradients)

    def take(self) -> list[list[Any]]:
        events, self.events[:] = list(self.events), []
        return events


def _hooked(obj: Any) -> dict[str, int]:
    own = vars(obj)
    return {name: id(own[name]) for name in HOOKED if name in own}


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    import deepspeed
    import deepspeed.ops
    import torch
    import torch.distributed as dist

    from freeride.training import deepspeed as fr_deepspeed
    from freeride.training.reporter import BubbleReporter
    from freeride.workload.jobs import IterationLog, pin_rank
    from freeride.workload.run import rank_endpoint

    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    device, given_cores = pin_rank(local_rank)
    # The shared-memory collective op: g++ builds it (~25 s) at init_distributed; a pipeline never uses it.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    model_stages = 2 * ranks if args.dualpipev else ranks

    def build() -> Any:
        torch.manual_seed(args.seed)
        model = build_model(args.width, model_stages, args.slow_stage, args.slow_ms, args.dualpipev, ranks)
        return make_engine(model, args.micro_batch, args.microbatches, args.clipping)

    engine = build()
    twin = build() if args.twin else None
    idle = None
    if args.idle_probe:
        from freeride.workload.idle_probe import IdleProbe

        idle = IdleProbe()
    probe = Probe(engine, idle)
    out = IterationLog(args.log, rank, device, args.warmup)
    pending: dict[int, dict[str, Any]] = {}  # records waiting for their bubbles
    losses: list[float] = []
    bare_train_batch = engine.train_batch

    def train_batch_logged(*a: Any, **k: Any) -> Any:  # below freeride's hook: one record per iteration
        start = time.monotonic_ns()
        loss = bare_train_batch(*a, **k)
        losses.append(float(loss))
        pending[len(losses) - 1] = out.record(len(losses) - 1, start, float(loss),
                                              idle.take() if idle is not None else None, probe=probe.take())
        return loss

    def delivered(iteration: int, bubbles: list[Any]) -> None:
        record = pending.pop(iteration, None)
        if record is not None:
            out.write(record, bubbles)

    engine.train_batch = train_batch_logged
    before = _hooked(engine), _hooked(engine.mpu), set(vars(engine.mpu))
    data_iter = batches(args.width, args.micro_batch, args.seed + 1)
    reporter = None
    if args.snippet:
        scope = {"engine": engine, "data_iter": data_iter, "device": device, "steps": args.iterations}
        own_instrument = fr_deepspeed.instrument

        def instrument_logged(*a: Any, **k: Any) -> Any:  # the snippet's call, its bubbles logged as above
            k.setdefault("on_iteration", delivered)
            return own_instrument(*a, **k)

        fr_deepspeed.instrument = instrument_logged  # what the snippet imports
        try:
            exec(compile(Path(args.snippet).read_text(), args.snippet, "exec"), scope)
        finally:
            fr_deepspeed.instrument = own_instrument
        handle = fr_deepspeed._installed.get(engine)
        reporter = scope.get("reporter")
    else:
        if args.report:
            # The sender thread may run on every core this rank was given, not only the training thread's.
            reporter = BubbleReporter(device, stage=engine.stage_id, rank=rank, cpu_affinity=given_cores,
                                      endpoint=rank_endpoint(args.endpoint_template, device, local_rank, rank))
        handle = fr_deepspeed.instrument(engine, reporter, device=device, on_iteration=delivered)
        for _ in range(args.iterations):
            engine.train_batch(data_iter)
    checks: dict[str, Any] = {"engine": type(engine).__name__, "instrumented": handle is not None}
    tracker = handle.tracker if handle is not None else None
    if handle is not None:
        handle.tracker.flush()
        iteration = handle.tracker.iteration
        engine.eval_batch(batches(args.width, args.micro_batch, args.seed + 2))
        checks["eval_marked_nothing"] = handle.tracker.iteration == iteration
    fr_deepspeed.uninstrument(engine)
    for record in pending.values():  # no instrumentation delivered them (a snippet that kept no callback)
        out.write(record, [])
    checks["restored"] = (_hooked(engine), _hooked(engine.mpu), set(vars(engine.mpu))) == before
    if twin is not None:
        twin_data = batches(args.width, args.micro_batch, args.seed + 1)
        checks["twin_losses"] = [float(twin.train_batch(twin_data)) for _ in range(args.iterations)]
        checks["losses"] = losses
        # What the engine holds beyond the bare twin: the probe's and this job's attributes only.
        checks["extra_attributes"] = sorted(set(vars(engine)) - set(vars(twin)))
        checks["weights_equal"] = all(
            torch.equal(a, b) for a, b in zip(engine.module.parameters(), twin.module.parameters(), strict=True))
    if reporter is not None:
        reporter.close()
    out.summary(tracker, reporter, **checks)
    out.close()
    dist.barrier()
    return out.records


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    from freeride.workload.jobs import add_job_arguments

    p = argparse.ArgumentParser(prog="python -m freeride.workload.deepspeed_job", description=__doc__.split("\n")[0])
    add_job_arguments(p)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--clipping", type=float, default=1.0, help="gradient clipping (DeepSpeed's default 1.0)")
    p.add_argument("--dualpipev", action="store_true")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    from freeride.workload.jobs import job_main

    return job_main(run, parse_args, argv)


if __name__ == "__main__":
    raise SystemExit(main())
