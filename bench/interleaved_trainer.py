"""A 4-stage Interleaved1F1B trainer for ``bench/managers_alone.sh``: what managers cost a trainer.

``torchrun --nproc-per-node 2 bench/interleaved_trainer.py [--freeride] [--iters N]``: 2 ranks x 2 model stages
(stage 1 three times deeper), 8 micro-batches, gloo, rank r pinned to the r-th allowed core; each rank prints its
iteration p50 and mean. ``--freeride`` instruments it (``InstrumentedSchedule`` + ``BubbleReporter`` to the
device's manager). A stranger's trial of freeride wrote it: beside managers with no side task it ran +17% slower.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B

WIDTH = 384


def block(depth: int) -> torch.nn.Sequential:
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--freeride", action="store_true")
    p.add_argument("--iters", type=int, default=100)
    args = p.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    cores = os.sched_getaffinity(0)
    core = sorted(cores)[local_rank]
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    device = f"cpu:{core}"
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    parts: list[torch.nn.Module] = []
    stages: list[Any] = []
    for s in (rank, rank + world):
        torch.manual_seed(100 + s)
        part = block(6 if s == 1 else 2)  # stage 1 is the slow one
        parts.append(part)
        stages.append(PipelineStage(part, stage_index=s, num_stages=2 * world, device=torch.device("cpu")))
    schedule = ScheduleInterleaved1F1B(stages, n_microbatches=8, loss_fn=torch.nn.functional.mse_loss)
    pipe: Any = schedule
    reporter = None
    if args.freeride:
        from freeride.training import BubbleReporter, InstrumentedSchedule

        reporter = BubbleReporter(device, stage=rank, rank=rank, cpu_affinity=cores)
        pipe = InstrumentedSchedule(schedule, sink=reporter, device=device)
    optimizer = torch.optim.SGD([q for m in parts for q in m.parameters()], lr=0.2)
    inputs = torch.randn(16, 64, WIDTH, generator=torch.Generator().manual_seed(0))
    times = []
    for it in range(args.iters):
        x = inputs[it % 16]
        y = 0.3 * torch.sign(x[:, :1]).expand_as(x)
        optimizer.zero_grad()
        t0 = time.perf_counter()
        losses: list[torch.Tensor] = []
        if rank == 0:
            pipe.step(x)
        else:
            pipe.step(target=y, losses=losses)
        optimizer.step()
        times.append(time.perf_counter() - t0)
    times = sorted(times[5:])
    print(f"rank {rank} iter p50 {1000 * times[len(times) // 2]:.1f} ms mean {1000 * sum(times) / len(times):.1f} ms",
          flush=True)
    if reporter is not None:
        pipe.close()
        reporter.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
