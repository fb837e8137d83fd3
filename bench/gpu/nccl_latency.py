"""A neighbour's receive beside a side task, with and without MPS.

Without MPS, a side task's context time-slices with the trainer's on the GPU, NCCL's kernels included:
a side task with work queued can hold back the kernel a pipeline stage's receive runs in. This
measures by how much, in four configurations: the receiver alone, beside a side task that keeps
matrix products queued (as a worker does inside a grant), and both again with every process an MPS
client (the side task at freeride's client priority and SM share).

* **Two GPUs or more** (``nccl``): two processes, NCCL ranks on GPUs 0 and 1, ping-pong a 4 KiB tensor
  (send, then receive the echo); the figure is half the round trip. The side task runs on GPU 1, the
  receiver's.
* **One GPU** (``single``): NCCL refuses two ranks on one GPU, so the receive is stood for by what it
  waits on there: the trainer launching a tiny kernel after an idle gap (as a stage does once its
  receive returns) and waiting for it; the figure is launch to completion. No NCCL kernel runs: the
  result says which of the two was measured.

Every probe and side task is a process of its own, so that each configuration's processes join (or
not) an MPS daemon started for the MPS half (:class:`~bench.gpu.mps_daemon.MpsDaemon`).

    python -m bench.gpu.nccl_latency [--samples 300] [--mode auto|nccl|single]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.gpu.common import pct, write_results
from bench.gpu.mps_daemon import MpsDaemon
from freeride.devices.mps import DEFAULT_SM_PERCENT, SIDE_TASK_CLIENT_PRIORITY

CONFIGS = (("alone", False, False), ("beside a side task", True, False),
           ("alone, MPS", False, True), ("beside a side task, MPS", True, True))
GAP_S = 0.001  # the idle wait before each single-GPU probe: a stage waiting for its neighbour


def summarise(samples: dict[str, list[float]]) -> dict[str, Any]:
    """Percentiles per configuration, and each side-task configuration's added latency (p50 and p99,
    us) against the one alone under the same MPS setting."""
    stats = {name: pct(values) for name, values in samples.items()}
    added = {}
    for name, side, mps in CONFIGS:
        base = "alone, MPS" if mps else "alone"
        if side and name in stats and base in stats:
            added[name] = {q: stats[name][q] - stats[base][q] for q in ("p50", "p99")}
    return {"us": stats, "added_us": added}


# ---------------------------------------------------------------------- child processes


def _probe_single(samples: int) -> list[float]:
    import torch

    x = torch.zeros(1, device="cuda:0")
    stream = torch.cuda.current_stream()
    out = []
    for i in range(samples + 20):
        time.sleep(GAP_S)
        t0 = time.perf_counter()
        x.add_(1)
        stream.synchronize()
        if i >= 20:
            out.append((time.perf_counter() - t0) * 1e6)
    return out


def _probe_rank(rank: int, init: str, samples: int) -> list[float]:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=2)
    x = torch.zeros(1024, device=f"cuda:{rank}")
    out = []
    try:
        for i in range(samples + 20):
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(x, 1)
                dist.recv(x, 1)
            else:
                dist.recv(x, 0)
                dist.send(x, 0)
            torch.cuda.synchronize()
            if i >= 20 and rank == 0:
                out.append((time.perf_counter() - t0) * 1e6 / 2)
    finally:
        dist.destroy_process_group()
    return out


def _side_task(device: int) -> None:
    """Matrix products back to back, each step waited for, as a worker runs steps inside a long grant."""
    import torch

    a = torch.randn(8192, 8192, device=f"cuda:{device}", dtype=torch.bfloat16)
    c = torch.empty_like(a)
    first = True
    while True:
        for _ in range(16):
            torch.matmul(a, a, out=c)
        torch.cuda.synchronize(device)
        if first:
            print("ready", flush=True)
            first = False


# ---------------------------------------------------------------------- one configuration


def _child(args: list[str], env: dict[str, str], **kw: Any) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "bench.gpu.nccl_latency", *args], env=env, text=True, **kw)


def run_config(mode: str, side: bool, mps_env: dict[str, str] | None, samples: int) -> list[float]:
    env = {**os.environ, **(mps_env or {})}
    hog = None
    if side:
        hog_env = dict(env)
        if mps_env:  # as freeride's MPS plan makes a side task's worker
            hog_env.update({"CUDA_MPS_CLIENT_PRIORITY": str(SIDE_TASK_CLIENT_PRIORITY),
                            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(DEFAULT_SM_PERCENT)})
        hog = _child(["--side-task", "1" if mode == "nccl" else "0"], hog_env, stdout=subprocess.PIPE)
        assert hog.stdout is not None
        if hog.stdout.readline().strip() != "ready":
            hog.kill()
            raise RuntimeError("the side task did not start")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            if mode == "single":
                probes = [_child(["--probe", "single", "--samples", str(samples), "--out", f"{tmp}/0.json"], env)]
            else:
                init = f"file://{tmp}/rendezvous"
                probes = [_child(["--probe", "nccl", "--rank", str(r), "--init", init, "--samples", str(samples),
                                  "--out", f"{tmp}/{r}.json"], env) for r in (0, 1)]
            for p in probes:
                if p.wait(300) != 0:
                    raise RuntimeError(f"a probe exited {p.returncode}")
            return list(json.loads(Path(f"{tmp}/0.json").read_text()))
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=300)
    ap.add_argument("--mode", choices=("auto", "nccl", "single"), default="auto")
    ap.add_argument("--probe", choices=("nccl", "single"), help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--init", default="", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    ap.add_argument("--side-task", type=int, default=None, help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    if ns.side_task is not None:
        _side_task(ns.side_task)
        return 0
    if ns.probe:
        values = _probe_single(ns.samples) if ns.probe == "single" else _probe_rank(ns.rank, ns.init, ns.samples)
        if ns.probe == "single" or ns.rank == 0:
            Path(ns.out).write_text(json.dumps(values))
        return 0

    import torch

    mode = ns.mode if ns.mode != "auto" else ("nccl" if torch.cuda.device_count() >= 2 else "single")
    samples: dict[str, list[float]] = {}
    notes = []
    for name, side, mps in CONFIGS:
        if not mps:
            samples[name] = run_config(mode, side, None, ns.samples)
    daemon = MpsDaemon(Path(f"/tmp/freeride-mps-nccl-{os.getpid()}"))
    why = daemon.start()
    if why:
        notes.append(f"no MPS here ({why}): the MPS rows are missing")
    else:
        try:
            for name, side, mps in CONFIGS:
                if mps:
                    samples[name] = run_config(mode, side, daemon.env(), ns.samples)
        finally:
            daemon.stop()
    data = {"mode": mode, "samples_per_config": ns.samples, **summarise(samples), "notes": notes,
            "samples_us": samples}
    what = ("NCCL send/recv between GPUs 0 and 1, half the round trip; side task on GPU 1" if mode == "nccl" else
            "one GPU, no NCCL (two ranks cannot share a GPU): a tiny kernel's launch to completion after a 1 ms "
            "idle gap")
    lines = [f"Measured: {what}.", *notes, "", "| configuration | p50 us | p99 us | added p50 / p99 us |",
             "|---|---|---|---|"]
    for name, _, _ in CONFIGS:
        if name in data["us"]:
            s = data["us"][name]
            add = data["added_us"].get(name)
            added = "-" if add is None else f"{add['p50']:.1f} / {add['p99']:.1f}"
            lines.append(f"| {name} | {s['p50']:.1f} | {s['p99']:.1f} | {added} |")
    write_results("nccl_latency", data, "\n".join(lines), "python -m bench.gpu.nccl_latency " + " ".join(sys.argv[1:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
