"""A DeepSpeed pipeline job for :mod:`freeride.training.deepspeed`'s end-to-end test and bench.

Run one process per pipeline rank under torchrun (gloo on CPU; each rank pinned to one of the cores
it may use, in order of local rank, and to one torch thread)::

    torchrun --standalone --nproc-per-node 2 -m freeride.workload.deepspeed_job \\
        --iterations 30 --slow-stage 1 --slow-ms 5 --report --result-file /tmp/ds.json

The model is a stack of blocks (``Linear``, ``tanh``), one per model stage, trained on a synthetic
classification task; the block of ``--slow-stage`` spins ``--slow-ms`` more in every forward and
every backward (compute, not idle: the core stays busy), so its neighbours wait by a known amount.
``--dualpipev`` runs DeepSpeed's ``DualPipeVEngine`` (two model stages per rank) instead of the
``PipelineEngine``. DeepSpeed's shared-memory op is not built (a pipeline-only job never uses it).

What the job does, in order: builds the engine (and with ``--twin`` a second, bare one with the same
initial weights); installs a *probe* -- instance-level wrappers of its own, set before freeride's
(which wrap them in turn) -- that times every instruction, ``train_batch``, the loss broadcast and the
gradient clipping, independently of freeride; instruments the engine (``--report``: a
:class:`~freeride.training.reporter.BubbleReporter` to the device's manager) or runs ``--snippet
FILE`` instead, user code executed with ``engine``, ``data_iter``, ``device`` and ``steps`` in scope
(the documentation's snippet, tested as written); trains ``--iterations`` batches; runs one
``eval_batch``; uninstruments and checks that the engine's attributes are exactly those before; trains
the twin on the same batches; writes one JSON document per rank to ``--result-file`` (``{rank}`` substituted,
else ``.rank<N>`` added): the losses of both, whether their weights ended equal, the probe's timeline
per iteration and the bubbles freeride measured.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def build_model(width: int, model_stages: int, slow_stage: int, slow_ms: float, dualpipev: bool,
                ranks: int) -> Any:
    """The pipeline module: one block per model stage; blocks are built only on their own rank."""
    import torch
    from deepspeed.pipe import LayerSpec, PipelineModule

    from freeride.workload.slowdown import Spin

    class Block(torch.nn.Module):
        def __init__(self, spin_ms: float) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(width, width)
            self.spin = Spin(spin_ms)

        def forward(self, x: Any) -> Any:
            return self.spin(torch.tanh(self.linear(x)))

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


class Probe:
    """Instance-level timers of an engine, installed before freeride's hooks (which then wrap them)."""

    def __init__(self, engine: Any) -> None:
        self.iterations: list[dict[str, Any]] = []
        self._events: list[list[Any]] = []
        clock = time.monotonic_ns
        events = self._events

        def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
            def run(*args: Any, **kwargs: Any) -> Any:
                start = clock()
                try:
                    return fn(*args, **kwargs)
                finally:
                    events.append([name, start, clock()])

            return run

        engine._INSTRUCTION_MAP = {cls: timed(cls.__name__, fn)
                                   for cls, fn in type(engine)._INSTRUCTION_MAP.items()}
        engine._aggregate_total_loss = timed("LossBroadcast", engine._aggregate_total_loss)
        engine.clip_fp32_gradients = timed("ClipGradients", engine.clip_fp32_gradients)
        train_batch = engine.train_batch

        def train_batch_probed(*args: Any, **kwargs: Any) -> Any:
            events.clear()
            start = clock()
            loss = train_batch(*args, **kwargs)
            self.iterations.append({"start_ns": start, "end_ns": clock(), "loss": float(loss),
                                    "probe": list(events)})
            return loss

        engine.train_batch = train_batch_probed


_HOOKED = ("_INSTRUCTION_MAP", "train_batch", "_aggregate_total_loss", "clip_fp32_gradients",
           "get_model_parallel_group")


def _hooked(obj: Any) -> dict[str, int]:
    """The identity of the instance attributes freeride's hooks replace (training changes many others)."""
    own = vars(obj)
    return {name: id(own[name]) for name in _HOOKED if name in own}


def _engine(model: Any, micro_batch: int, micro_batches: int, clipping: float) -> Any:
    import deepspeed
    import torch

    config = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": micro_batches,
              "gradient_clipping": clipping, "steps_per_print": 10**9}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def run(args: argparse.Namespace) -> dict[str, Any]:
    import deepspeed
    import deepspeed.ops
    import torch
    import torch.distributed as dist

    from freeride.training import deepspeed as fr_deepspeed
    from freeride.training.reporter import BubbleReporter
    from freeride.workload.slowdown import pin_rank

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
        return _engine(model, args.micro_batch, args.microbatches, args.clipping)

    engine = build()
    twin = build() if args.twin else None
    probe = Probe(engine)
    before = _hooked(engine), _hooked(engine.mpu), set(vars(engine.mpu))
    bubbles: dict[int, list[list[Any]]] = {}
    data_iter = batches(args.width, args.micro_batch, args.seed + 1)
    reporter = None
    if args.snippet:
        scope = {"engine": engine, "data_iter": data_iter, "device": device, "steps": args.iterations}
        exec(compile(Path(args.snippet).read_text(), args.snippet, "exec"), scope)
        handle = fr_deepspeed._installed.get(engine)
        reporter = scope.get("reporter")
    else:
        if args.report:
            # The sender thread may run on every core this rank was given, not only the training thread's.
            reporter = BubbleReporter(device, stage=engine.stage_id, rank=rank, cpu_affinity=given_cores)
        handle = fr_deepspeed.instrument(
            engine, reporter, device=device,
            on_iteration=lambda it, found: bubbles.__setitem__(
                it, [[b.slot, b.kind, b.start_ns, b.end_ns, b.predicted_ns] for b in found]))
        for _ in range(args.iterations):
            engine.train_batch(data_iter)
    result: dict[str, Any] = {"rank": rank, "stage": int(engine.stage_id), "device": device,
                              "engine": type(engine).__name__, "instrumented": handle is not None}
    if handle is not None:
        handle.tracker.flush()
        iteration = handle.tracker.iteration
        engine.eval_batch(batches(args.width, args.micro_batch, args.seed + 2))
        result["eval_marked_nothing"] = handle.tracker.iteration == iteration
        result["slots"] = [[s.index, s.kind] for s in handle.tracker.slots]
        result["learned_slots"] = [[s.index, s.kind] for s in handle.tracker.learned.opens.values()]
        result["unplanned_waits"] = handle.tracker.unplanned_waits
    fr_deepspeed.uninstrument(engine)
    if reporter is not None:
        reporter.close()
        result["reporter"] = asdict(reporter.counters())
    result["restored"] = (_hooked(engine), _hooked(engine.mpu), set(vars(engine.mpu))) == before
    result["iterations"] = probe.iterations
    result["bubbles"] = {str(k): v for k, v in sorted(bubbles.items())}
    if twin is not None:
        twin_data = batches(args.width, args.micro_batch, args.seed + 1)
        result["twin_losses"] = [float(twin.train_batch(twin_data)) for _ in range(args.iterations)]
        # What the engine holds beyond the bare twin: the probe's attributes only (training adds the same).
        result["extra_attributes"] = sorted(set(vars(engine)) - set(vars(twin)))
        result["weights_equal"] = all(
            torch.equal(a, b) for a, b in zip(engine.module.parameters(), twin.module.parameters(), strict=True))
    dist.barrier()
    return result


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m freeride.workload.deepspeed_job", description=__doc__.split("\n")[0])
    p.add_argument("--iterations", type=int, default=30)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--slow-stage", type=int, default=1, help="model stage that spins --slow-ms more (-1: none)")
    p.add_argument("--slow-ms", type=float, default=5.0)
    p.add_argument("--clipping", type=float, default=1.0, help="gradient clipping (DeepSpeed's default 1.0)")
    p.add_argument("--dualpipev", action="store_true")
    p.add_argument("--twin", action="store_true", help="also train a bare twin engine and compare")
    p.add_argument("--report", action="store_true", help="report to the device's manager (default endpoint)")
    p.add_argument("--snippet", default="", help="user code to run instead of the built-in loop")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-file", dest="log", default="", help="JSON file per rank ({rank} substituted)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=os.environ.get("FREERIDE_LOG_LEVEL", "WARNING"),
                        format=f"%(asctime)s rank{os.environ.get('RANK', '0')} %(levelname)s %(name)s: %(message)s")
    from freeride.workload.run import rank_log_path

    args = parse_args(argv)
    result = run(args)
    if args.log:
        path = rank_log_path(args.log, result["rank"])
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
