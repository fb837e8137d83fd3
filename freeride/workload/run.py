"""The training loop of the reference trainer (one process = one pipeline rank).

Rank layout comes from torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``); the
pipeline has one rank per process (``--stages`` must match the world size) and, for multi-stage
schedules, ``--virtual-stages`` model chunks per rank (every schedule torch offers:
:mod:`freeride.workload.pipelines`). Iteration time is measured on every rank around
``schedule.step`` and the optimizer step; the first ``--warmup`` iterations are marked in the log so
that consumers can leave them out. ``--slow-stage``/``--slow-ms`` make one model chunk slower by a
known amount; ``--idle-probe`` logs every idle gap between compute actions, measured apart from the
instrumentation (:mod:`freeride.workload.idle_probe`), for the bench.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from freeride.devices import parse_device_name
from freeride.endpoints import default_endpoint, parse_endpoint, read_token
from freeride.errors import ConfigError
from freeride.training.tracker import MeasuredBubble
from freeride.workload import pipelines

log = logging.getLogger(__name__)

SCHEDULES = pipelines.SCHEDULES


@dataclass
class TrainerConfig:
    stages: int = 0  # 0: the world size
    microbatches: int = 4
    microbatch_size: int = 4
    iterations: int = 20
    warmup: int = 3
    schedule: str = "1f1b"
    virtual: int = 2
    report: bool = False
    measure: bool = False
    memory_probe: bool = False
    device: str = "cpu"
    log: str = ""
    endpoint_template: str = ""
    token_file: str = ""
    vocab: int = 256
    d_model: int = 128
    heads: int = 4
    layers: int = 4
    seq_len: int = 64
    seed: int = 0
    lr: float = 1e-3
    ab_block: int = 0
    schedule_csv: str = ""
    slow_stage: int = -1
    slow_ms: float = 0.0
    idle_probe: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def validate(self, world: int) -> None:
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"unknown schedule {self.schedule!r}: expected one of {', '.join(SCHEDULES)}")
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"--device must be cpu or cuda, got {self.device!r}")
        if self.stages and self.stages != world:
            raise ConfigError(f"--stages {self.stages} but torchrun started {world} processes (one per stage)")
        if self.schedule == "1f1b" and self.microbatches < world:
            raise ConfigError(f"1f1b needs --microbatches ({self.microbatches}) >= stages ({world})")
        if (self.schedule == "csv") != bool(self.schedule_csv):
            raise ConfigError("--schedule csv and --schedule-csv FILE go together")
        if self.slow_ms < 0 or (self.slow_ms > 0 and self.slow_stage < 0):
            raise ConfigError("--slow-ms must be >= 0, and needs --slow-stage (a model chunk index)")
        if self.iterations < 1 or self.microbatches < 1 or self.microbatch_size < 1:
            raise ConfigError("--iterations, --microbatches and --microbatch-size must be >= 1")


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """Options every trainer shares (this one and ``freeride.workload.single_stage``): model size,
    batch, iterations, optimizer and token file, with :class:`TrainerConfig`'s defaults."""
    d = TrainerConfig()
    p.add_argument("--microbatches", type=int, default=d.microbatches)
    p.add_argument("--microbatch-size", type=int, default=d.microbatch_size)
    p.add_argument("--iterations", type=int, default=d.iterations)
    p.add_argument("--warmup", type=int, default=d.warmup, help="iterations marked as warm-up in the log")
    p.add_argument("--token-file", default=d.token_file)
    p.add_argument("--vocab", type=int, default=d.vocab)
    p.add_argument("--d-model", type=int, default=d.d_model)
    p.add_argument("--heads", type=int, default=d.heads)
    p.add_argument("--layers", type=int, default=d.layers)
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--lr", type=float, default=d.lr)


def bubble_record(b: MeasuredBubble) -> dict[str, Any]:
    """One measured bubble as it appears in an iteration log record's ``bubbles`` list."""
    return {"slot": b.slot, "kind": b.kind, "start_ns": b.start_ns, "length_ms": b.length_ns / 1e6,
            "predicted_ms": b.predicted_ns / 1e6, "free_memory_bytes": b.free_memory_bytes,
            "core_wait_ms": b.core_wait_ns / 1e6}


def parse_args(argv: Sequence[str] | None = None) -> TrainerConfig:
    p = argparse.ArgumentParser(prog="python -m freeride.workload", description=__doc__)
    p.add_argument("--stages", type=int, default=0, help="pipeline stages (default: torchrun's world size)")
    add_model_arguments(p)
    p.add_argument("--schedule", default="1f1b", choices=SCHEDULES)
    # Option names must not be prefixes of torchrun's own (argparse rejects ambiguous prefixes).
    p.add_argument("--virtual-stages", dest="virtual", type=int, default=2,
                   help="model chunks per rank (looped multi-stage schedules; V-shaped ones hold 2)")
    p.add_argument("--schedule-csv", default="", help="with --schedule csv: torch's compute-only schedule CSV")
    p.add_argument("--slow-stage", type=int, default=-1, help="model chunk made slower by --slow-ms")
    p.add_argument("--slow-ms", type=float, default=0.0, help="busy milliseconds added to each of its forwards")
    p.add_argument("--idle-probe", action=argparse.BooleanOptionalAction, default=False,
                   help="log every idle gap between compute actions (the bench's yardstick)")
    p.add_argument("--report", action=argparse.BooleanOptionalAction, default=False,
                   help="stream bubbles to the device's freeride manager")
    p.add_argument("--measure", action=argparse.BooleanOptionalAction, default=False,
                   help="instrument and log bubbles without reporting (implied by --report)")
    p.add_argument("--memory-probe", action=argparse.BooleanOptionalAction, default=False,
                   help="log the memory held at every bubble start and after each step (implies --measure; "
                   "see freeride.workload.memory_probe)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--iteration-log", dest="log", default="", help="JSON-lines file per rank ({rank} is substituted, "
                   "else .rank<N> is added before the suffix)")
    p.add_argument("--endpoint-template", default="",
                   help="manager endpoint per rank, e.g. unix:/tmp/m-{slug}.sock "
                   "({device}, {slug}, {local_rank}, {rank} are substituted)")
    p.add_argument("--ab-block", type=int, default=0,
                   help="A/B measurement: alternate blocks of N instrumented and bare iterations (order "
                   "within each pair of blocks drawn from --seed); 0 = always instrumented")
    ns = p.parse_args(argv)
    return TrainerConfig(**{k: v for k, v in vars(ns).items()})


def rank_log_path(template: str, rank: int) -> Path:
    if "{rank}" in template:
        return Path(template.format(rank=rank))
    path = Path(template)
    return path.with_name(f"{path.stem}.rank{rank}{path.suffix or '.jsonl'}")


def rank_endpoint(template: str, device: str, local_rank: int, rank: int) -> Any:
    """The endpoint of this rank's manager: ``template`` with ``{device}``, ``{slug}``, ``{local_rank}``
    and ``{rank}`` filled in, or the device's default endpoint when the template is empty."""
    if template:
        slug = parse_device_name(device).slug
        return parse_endpoint(template.format(device=device, slug=slug, local_rank=local_rank, rank=rank))
    return default_endpoint(device)


def _ab_modes(iterations: int, block: int, seed: int) -> list[bool]:
    """Per iteration: instrumented (True) or bare; blocks of ``block``, each pair in random order.

    Every rank draws the same sequence (same seed), so all stages switch at the same iteration.
    """
    if block <= 0:
        return []
    import random

    rng = random.Random(seed * 7919 + 17)
    modes: list[bool] = []
    while len(modes) < iterations:
        first = rng.random() < 0.5
        modes += [first] * block + [not first] * block
    return modes[:iterations]


def _write_complete(pending: list[tuple[dict[str, Any], int]],
                    delivered: dict[int, tuple[list[MeasuredBubble], list[Any]]], out: IO[str] | None,
                    wait: bool) -> None:
    """Write the records at the head of ``pending`` whose bubbles were delivered (all of them unless
    ``wait``): iteration records go out in order, each with its own iteration's device times."""
    while pending:
        record, t0 = pending[0]
        found = delivered.pop(record["iteration"], None)
        if found is None and wait and record.get("instrumented"):
            return
        bubbles, actions = found or ([], [])
        record["bubbles"] = [bubble_record(b) for b in bubbles]
        if actions:
            record["actions"] = [[a.kind, a.stage, a.microbatch, (a.start_ns - t0) / 1e6, a.length_ns / 1e6]
                                 for a in actions]
        pending.pop(0)
        if out is not None:
            out.write(json.dumps(record) + "\n")
            out.flush()


def train(cfg: TrainerConfig) -> list[dict[str, Any]]:
    """Run the training loop in this process (a torchrun rank); returns the iteration records."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage

    from freeride.training.instrument import InstrumentedSchedule
    from freeride.training.reporter import BubbleReporter
    from freeride.workload.memory_probe import MemoryProbe, peak_rss_bytes, prime_memory
    from freeride.workload.model import GPTConfig, build_chunk, lm_loss, synthetic_batch

    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfg.validate(world)

    given_cores = set(os.sched_getaffinity(0))
    if cfg.device == "cpu":
        cores = sorted(given_cores)
        # One core per stage: the stage's bubbles are then real idle time of that core (cpu:N). The
        # local rank indexes the cores this job was given, never a core number: with cores {1, 3},
        # mapping "rank 1 -> core 1" would put both ranks on core 1.
        core = cores[local_rank % len(cores)]
        os.sched_setaffinity(0, {core})
        torch.set_num_threads(1)
        device_name = f"cpu:{core}"
        torch_device = torch.device("cpu")
        backend = "gloo"
    else:
        torch.cuda.set_device(local_rank)
        device_name = f"cuda:{local_rank}"
        torch_device = torch.device("cuda", local_rank)
        backend = "nccl"
    if world > 1 or not dist.is_initialized():
        dist.init_process_group(backend=backend)
    gpt = GPTConfig(cfg.vocab, cfg.d_model, cfg.heads, cfg.layers, cfg.seq_len, cfg.seed)
    probe = None
    if cfg.memory_probe:
        # The probe's baseline: everything but this stage's state -- the interpreter, torch, the
        # process group, and the framework's one-time allocations (kernel caches, modules imported on
        # first use), made here by one training step of a throwaway one-block model.
        prime_memory(gpt, cfg.microbatch_size, torch_device)
        probe = MemoryProbe(device_name)
    baseline_rss = 0
    if probe is not None:
        import psutil

        baseline_rss = int(psutil.Process().memory_info().rss)

    virtual = pipelines.virtual_stages(cfg.schedule, cfg.virtual)
    chunks = pipelines.total_chunks(cfg.schedule, world, virtual, cfg.schedule_csv)
    local_chunks = pipelines.local_chunks(cfg.schedule, rank, world, virtual, cfg.schedule_csv)
    modules = [build_chunk(gpt, c, chunks).to(torch_device) for c in local_chunks]
    for module, c in zip(modules, local_chunks, strict=True):
        if c == cfg.slow_stage and cfg.slow_ms > 0:
            pipelines.slow_down(module, cfg.slow_ms)
    stages = [PipelineStage(m, c, chunks, torch_device) for m, c in zip(modules, local_chunks, strict=True)]
    idle_probe = None
    if cfg.idle_probe:
        from freeride.workload.idle_probe import IdleProbe

        idle_probe = IdleProbe()
        for stage in stages:  # before the instrumentation: its marks then count as the gaps' busy time
            idle_probe.wrap(stage)
    schedule = pipelines.make_schedule(cfg.schedule, stages, cfg.microbatches, lm_loss, cfg.schedule_csv)
    params = [p for m in modules for p in m.parameters()]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr)

    reporter = None
    runner: Any = schedule
    instrumented = None
    # Bubbles and actions per iteration, as the instrumentation delivers them: at once on CPU; on CUDA
    # once the device has finished the iteration (an iteration or so later), so a record is written
    # when its iteration's device times are known.
    delivered: dict[int, tuple[list[MeasuredBubble], list[Any]]] = {}
    pending: list[tuple[dict[str, Any], int]] = []
    if cfg.report or cfg.measure or probe is not None:
        if cfg.report:
            token = read_token(cfg.token_file or None)
            endpoint = rank_endpoint(cfg.endpoint_template, device_name, local_rank, rank)
            reporter = BubbleReporter(device_name, stage=rank, rank=rank, endpoint=endpoint, token=token,
                                      cpu_affinity=given_cores)
        sink: Any = reporter
        if probe is not None:
            probe.inner = reporter
            sink = probe
        instrumented = InstrumentedSchedule(schedule, sink=sink, device=device_name, time_actions=bool(cfg.log),
                                            on_action_end=probe.action_end if probe is not None else None,
                                            on_iteration=lambda it, bubbles: delivered.__setitem__(
                                                it, (bubbles, instrumented.last_actions if instrumented else [])))
        runner = instrumented

    out = None
    if cfg.log:
        path = rank_log_path(cfg.log, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        out = path.open("w")
    modes = _ab_modes(cfg.iterations, cfg.ab_block, cfg.seed) if instrumented is not None else []
    holds_first = 0 in local_chunks
    holds_last = chunks - 1 in local_chunks
    batch = cfg.microbatches * cfg.microbatch_size
    records: list[dict[str, Any]] = []
    log.info("[rank %d %s] %s, %d stages x %d micro-batches, report=%s", rank, device_name,
             cfg.schedule, world, cfg.microbatches, cfg.report)
    try:
        for it in range(cfg.iterations):
            x, y = synthetic_batch(gpt, batch, it)
            x, y = x.to(torch_device), y.to(torch_device)
            losses: list[Any] = []
            if modes and instrumented is not None:
                if modes[it] and not instrumented.attached:
                    instrumented.attach()
                elif not modes[it] and instrumented.attached:
                    instrumented.detach()
            t0 = time.monotonic_ns()
            optimizer.zero_grad(set_to_none=True)
            t_schedule = time.monotonic_ns()
            if holds_first and holds_last:
                runner.step(x, target=y, losses=losses)
            elif holds_first:
                runner.step(x)
            elif holds_last:
                runner.step(target=y, losses=losses)
            else:
                runner.step()
            schedule_ns = time.monotonic_ns() - t_schedule
            held_after_step = probe.sample() if probe is not None else None
            optimizer.step()
            # No torch.cuda.synchronize: on CUDA this is host time, which can lead the device by the
            # launch queue within an iteration but not across many (the pipeline's receives and the
            # last stage's loss readout below hold the host back), so means over iterations hold.
            elapsed = time.monotonic_ns() - t0
            record: dict[str, Any] = {
                "iteration": it,
                "rank": rank,
                "stage": rank,
                "device": device_name,
                "warmup": it < cfg.warmup,
                "instrumented": bool(instrumented is not None and instrumented.attached),
                "reporting": bool(reporter is not None and instrumented is not None and instrumented.attached),
                "time_ms": elapsed / 1e6,
                "end_ns": t0 + elapsed,
                "loss": float(torch.stack([x.detach() for x in losses]).mean()) if losses else None,
                "bubbles": [],
            }
            if instrumented is not None and instrumented.attached:
                record["schedule_ms"] = schedule_ns / 1e6
            if idle_probe is not None:
                record["idle_gaps"] = [list(gap) for gap in idle_probe.take()]
            if probe is not None:
                slot_samples, action_samples = probe.take()
                record["memory"] = {"slots": {str(k): v for k, v in sorted(slot_samples.items())},
                                    "after_actions": action_samples, "after_step": held_after_step,
                                    "after_optimizer": probe.sample()}
            records.append(record)
            pending.append((record, t0))
            _write_complete(pending, delivered, out, instrumented is not None)
            log.info("[rank %d] iteration %d: %.1f ms%s", rank, it, elapsed / 1e6,
                     f", loss {record['loss']:.4f}" if record["loss"] is not None else "")
        if instrumented is not None:
            instrumented.flush()  # the device's last iterations (CUDA); at once on CPU
        _write_complete(pending, delivered, out, False)
        summary: dict[str, Any] = {"summary": True, "rank": rank, "config": asdict(cfg)}
        if instrumented is not None:
            err = instrumented.predictor.prediction_error()
            summary.update(
                slots=[{"slot": s.index, "kind": s.kind} for s in instrumented.slots],
                learned_slots=[{"slot": s.index, "after": s.after.label() if s.after else None,
                                "length_ms": s.length / 1e6} for s in instrumented.learned.opens.values()],
                unplanned_waits=instrumented.unplanned_waits,
                unplanned_wait_ms=instrumented.unplanned_wait_ns / 1e6,
                prediction_error={"count": err.count, "p50": err.p50, "p90": err.p90, "max": err.max},
            )
        if reporter is not None:
            reporter.close()
            summary["reporter"] = asdict(reporter.counters())
        if probe is not None:
            summary["memory_probe"] = {"available": probe.available, "baseline_bytes": probe.baseline_bytes,
                                       "baseline_rss_bytes": baseline_rss, "peak_rss_bytes": peak_rss_bytes(),
                                       "local_chunks": local_chunks}
        if out is not None:
            out.write(json.dumps(summary) + "\n")
    finally:
        if reporter is not None:
            reporter.close()
        if instrumented is not None:
            instrumented.close()
        if out is not None:
            out.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    return records


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(
        level=os.environ.get("FREERIDE_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s rank{os.environ.get('RANK', '0')} %(levelname)s %(name)s: %(message)s",
    )
    try:
        cfg = parse_args(argv)
        train(cfg)
    except ConfigError as exc:
        logging.getLogger(__name__).error("%s", exc)
        return 2
    return 0
