"""A two-rank Megatron Core pipeline on CPU, trained bare and then through freeride (run under torchrun).

Each rank pins itself to one of the cores it was given (``cpu:N``: its bubbles are that core's idle
time), builds a small model of linear chunks (``1f1b``: one chunk per rank; ``interleaved``: two), and
trains it twice from the same seed and data: ``--bare-iterations`` with Megatron's own
``forward_backward_func``, then ``--iterations`` through :func:`freeride.training.megatron.instrument`.
Each forward of ``--slow-rank`` computes ``--slow-ms`` longer (a busy loop: a stage slower by a known
amount), so its neighbour waits. The trainer sets timers of its own, as Megatron-LM does (:class:`RecordingTimers`),
which the instrumentation must chain to; they record every interval Megatron times.

Writes ``<out>/rank<R>.json``: per phase, the losses (last stage), the order the schedule really ran
(forwards from ``forward_step_func``, backwards from a gradient hook on each chunk's output), the
trainer timers' intervals, the idle time of every gap between compute actions (measured apart from
freeride: :class:`~freeride.workload.idle_probe.IdleProbe`), and for the freeride phase the tracker's
bubbles per iteration. Used by
``tests/frameworks/test_megatron_e2e.py`` and ``bench/bench_megatron.py``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))  # megatron_cpu, as a user copies it

import megatron_cpu  # noqa: E402 (before any Megatron import)

megatron_cpu.install()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


class RecordingTimers:
    """A trainer's timers, Megatron-LM style: ``timers(name, log_level=None, barrier=False)`` returns the
    timer of that name, whose ``start``/``stop`` are recorded as ``(name, start_ns, stop_ns)``. Its compute
    timers also drive ``probe`` (:class:`freeride.workload.idle_probe.IdleProbe`: each gap's idle time,
    measured apart from freeride)."""

    def __init__(self, probe: Any = None) -> None:
        self.intervals: list[tuple[str, int, int]] = []
        self.calls = 0
        self.probe = probe
        self._timers: dict[str, RecordingTimers._Timer] = {}

    class _Timer:
        def __init__(self, owner: RecordingTimers, name: str) -> None:
            self.owner, self.name, self.started = owner, name, 0
            self.compute = name in ("forward-compute", "backward-compute")

        def start(self, barrier: bool = False) -> None:
            if self.compute and self.owner.probe is not None:
                self.owner.probe.enter()
            self.started = time.monotonic_ns()

        def stop(self, barrier: bool = False) -> None:
            self.owner.intervals.append((self.name, self.started, time.monotonic_ns()))
            if self.compute and self.owner.probe is not None:
                self.owner.probe.leave()

    def __call__(self, name: str, log_level: int | None = None, barrier: bool = False) -> RecordingTimers._Timer:
        self.calls += 1
        timer = self._timers.get(name)
        if timer is None:
            timer = self._timers[name] = RecordingTimers._Timer(self, name)
        return timer

    def log(self, names: list[str]) -> str:  # an attribute beyond the call, as Megatron-LM's timers have
        return ",".join(names)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--schedule", choices=["1f1b", "interleaved"], default="1f1b")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--warmup", type=int, default=0, help="the first iterations, marked as warm-up in the records")
    p.add_argument("--bare-iterations", type=int, default=4)
    p.add_argument("--slow-rank", type=int, default=1)
    p.add_argument("--slow-ms", type=float, default=10.0)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--report", action="store_true", help="report bubbles to the manager of each rank's core")
    p.add_argument("--endpoint-template", default="", help="each rank's manager, e.g. unix:/tmp/m-{slug}.sock "
                   "({device}, {slug}: cpu-N, {rank}); default: the device's default socket")
    p.add_argument("--overlap", action="store_true", help="overlap_p2p_comm (interleaved only)")
    p.add_argument("--snippet", default="", help="the freeride phase runs this file's code (the documentation's "
                   "snippet) with device, steps, optimizer, forward_step, data_iterator, model, num_microbatches, "
                   "seq_length and micro_batch_size in scope")
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    logging.basicConfig(level=os.environ.get("FREERIDE_LOG_LEVEL", "WARNING"))
    from megatron.core import parallel_state
    from megatron.core.enums import ModelType
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.transformer_config import TransformerConfig

    from freeride.training import megatron as freeride_megatron
    from freeride.training.reporter import BubbleReporter

    local_rank = int(os.environ["LOCAL_RANK"])
    given_cores = set(os.sched_getaffinity(0))
    core = sorted(given_cores)[local_rank % len(given_cores)]
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    device = f"cpu:{core}"
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    virtual = 2 if args.schedule == "interleaved" else 1
    parallel_state.initialize_model_parallel(
        pipeline_model_parallel_size=world, virtual_pipeline_model_parallel_size=virtual if virtual > 1 else None
    )
    hidden, seq, micro = args.hidden, 8, 2
    # Interleaved on two ranks: no batched transfers on gloo (megatron_cpu says why); overlapped ones are not batched.
    overrides = megatron_cpu.cpu_config_overrides(virtual)
    if args.overlap:
        overrides["batch_p2p_comm"] = False
    config = TransformerConfig(
        num_layers=world * virtual, hidden_size=hidden, num_attention_heads=1, pipeline_dtype=torch.float32,
        pipeline_model_parallel_size=world, virtual_pipeline_model_parallel_size=virtual if virtual > 1 else None,
        overlap_p2p_comm=args.overlap, **overrides,
    )
    seen: list[tuple[str, int, int]] = []
    slow_s = args.slow_ms / 1000 if rank == args.slow_rank else 0.0

    class Chunk(torch.nn.Module):
        def __init__(self, vp_stage: int) -> None:
            super().__init__()
            self.config, self.model_type, self.vp_stage = config, ModelType.encoder_or_decoder, vp_stage
            self.stage = vp_stage * world + rank
            self.first, self.last = self.stage == 0, self.stage == world * virtual - 1
            self.linear = torch.nn.Linear(hidden, hidden)
            self.input: torch.Tensor | None = None
            self.forwards = 0

        def set_input_tensor(self, tensor: Any) -> None:
            self.input = tensor[0] if isinstance(tensor, list) else tensor

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if slow_s:  # busy, as compute is: the core is not free for anything else meanwhile
                until = time.perf_counter() + slow_s
                while time.perf_counter() < until:
                    pass
            h = x if self.first else self.input
            assert h is not None
            out = torch.tanh(self.linear(h))
            mb, stage = self.forwards, self.stage
            self.forwards += 1
            seen.append(("F", stage, mb))
            out.register_hook(lambda g: seen.append(("B", stage, mb)) or g)
            return out

    def build() -> tuple[list[Chunk], torch.optim.Optimizer]:
        chunks = []
        for vp in range(virtual):
            torch.manual_seed(1000 + vp * world + rank)  # the same weights in both phases
            chunks.append(Chunk(vp))
        return chunks, torch.optim.SGD([p for c in chunks for p in c.parameters()], lr=0.05)

    def data() -> Any:
        g = torch.Generator().manual_seed(7)
        w = torch.randn(hidden, hidden, generator=g) / hidden**0.5
        while True:
            x = torch.randn(seq, micro, hidden, generator=g)
            yield x, torch.tanh(x @ w)

    iteration_losses: list[float] = []

    def forward_step(iterator: Any, model: Chunk) -> tuple[torch.Tensor, Any]:
        x, target = next(iterator)
        out = model(x)

        def loss_func(output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            loss = torch.nn.functional.mse_loss(output, target)
            iteration_losses.append(float(loss))  # before Megatron divides it in place
            return loss, {"loss": loss.detach().clone()}

        return out, loss_func

    from freeride.workload.idle_probe import IdleProbe

    probe = IdleProbe(min_gap_ns=0)
    trainer_timers = RecordingTimers(probe)
    config.timers = trainer_timers  # the trainer's own timers, as Megatron-LM sets them
    record: dict[str, Any] = {"rank": rank, "device": device, "schedule": args.schedule, "virtual": virtual,
                              "microbatches": args.microbatches, "phases": {}}

    class RecordingOptimizer:
        """The phase's optimizer; its ``zero_grad`` and ``step`` bound an iteration, which it records."""

        def __init__(self, optimizer: torch.optim.Optimizer, chunks: list[Chunk], scope: dict[str, Any]) -> None:
            self.optimizer, self.chunks, self.scope = optimizer, chunks, scope
            self.phase: dict[str, list[Any]] = {k: [] for k in ("losses", "orders", "timers", "times", "idle_gaps",
                                                                "bubbles")}
            self.begin = 0

        def zero_grad(self) -> None:
            self.optimizer.zero_grad()
            seen.clear()
            iteration_losses.clear()
            trainer_timers.intervals = []
            probe.take()
            for c in self.chunks:
                c.forwards = 0
            self.begin = time.monotonic_ns()

        def step(self) -> None:
            self.optimizer.step()
            phase = self.phase
            phase["times"].append((self.begin, time.monotonic_ns()))
            assert config.timers is trainer_timers, "the trainer's timers were not restored"
            phase["losses"].append(sum(iteration_losses) if iteration_losses else None)
            phase["orders"].append(list(seen))
            phase["timers"].append(list(trainer_timers.intervals))
            phase["idle_gaps"].append(probe.take())  # this iteration's gaps, the boundary gap included
            instrumented = instrumented_in(self.scope)
            # On CPU the tracker delivers an iteration as it ends: its bubbles are known here.
            phase["bubbles"].append([] if instrumented is None or instrumented.tracker is None else [
                {"slot": b.slot, "kind": b.kind, "start_ns": b.start_ns, "end_ns": b.end_ns,
                 "predicted_ns": b.predicted_ns, "core_wait_ns": b.core_wait_ns}
                for b in instrumented.tracker.last_bubbles])

    def instrumented_in(scope: dict[str, Any]) -> Any:
        return next((v for v in scope.values() if isinstance(v, freeride_megatron.InstrumentedForwardBackward)), None)

    raw = get_forward_backward_func()
    for phase in ("bare", "freeride"):
        chunks, real_optimizer = build()
        iterators = [data() for _ in chunks]
        scope: dict[str, Any] = {
            "device": device, "steps": args.bare_iterations if phase == "bare" else args.iterations,
            "forward_step": forward_step, "data_iterator": iterators if virtual > 1 else iterators[0],
            "model": chunks if virtual > 1 else chunks[0], "num_microbatches": args.microbatches,
            "seq_length": seq, "micro_batch_size": micro,
        }
        optimizer = scope["optimizer"] = RecordingOptimizer(real_optimizer, chunks, scope)
        if phase == "freeride" and args.snippet:
            exec(compile(Path(args.snippet).read_text(), args.snippet, "exec"), scope)  # the docs' code, as written
        else:
            function: Any = raw
            if phase == "freeride":
                endpoint = args.endpoint_template.format(device=device, slug=device.replace(":", "-"), rank=rank)
                reporter = BubbleReporter(device, stage=rank, rank=rank, endpoint=endpoint or None,
                                          cpu_affinity=given_cores) if args.report else None
                deadline = time.monotonic() + 30  # the first events would be dropped before it connects
                while reporter is not None and not reporter.counters().connected and time.monotonic() < deadline:
                    time.sleep(0.01)
                function = scope["forward_backward"] = freeride_megatron.instrument(raw, reporter, device=device)
                scope["reporter"] = reporter
            for _ in range(scope["steps"]):
                optimizer.zero_grad()
                function(forward_step_func=forward_step, data_iterator=scope["data_iterator"], model=scope["model"],
                         num_microbatches=args.microbatches, seq_length=seq, micro_batch_size=micro)
                optimizer.step()
        record["phases"][phase] = dict(optimizer.phase, warmup=args.warmup)
    instrumented = instrumented_in(scope)
    tracker = instrumented.tracker if instrumented is not None else None
    if instrumented is not None:
        freeride_megatron.uninstrument(instrumented)
    counts: dict[int, int] = {}
    for bubbles in record["phases"]["freeride"]["bubbles"]:
        for b in bubbles:
            counts[b["slot"]] = counts.get(b["slot"], 0) + 1
    record["reported_counts"] = counts
    record["unplanned_waits"] = tracker.unplanned_waits if tracker is not None else 0
    record["wait_positions"] = list(tracker.plan.positions) if tracker is not None else []
    record["trainer_timer_calls"] = trainer_timers.calls
    reporter = next((v for v in scope.values() if isinstance(v, BubbleReporter)), None)
    if reporter is not None:
        reporter.close()
        record["reporter"] = reporter.counters().__dict__
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
