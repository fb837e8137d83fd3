"""The DeepSpeed adapter on a two-rank CPU pipeline: what it reports, what a side task harvests, what it costs.

    python -m bench.bench_deepspeed [--quick] [--iterations 150] [--out bench/results/cpu]

One run of ``python -m freeride.workload.deepspeed_job`` under torchrun (2 ranks, gloo, one core each;
model stage 1 spins ``--slow-ms`` more per forward and backward), reporting to a real manager per core,
each with one PageRank side task (``rmat:12``: steps of about a millisecond, under a third of the
bubbles here). Figures, each against the issue's target:

1. **Reported bubble time vs idle time** per rank, after the warm-up. The idle time is measured apart
   from freeride, by the job's probes (instance-level wrappers set *before* freeride's): the runs of
   waiting instructions (``Send*``/``Recv*`` with nothing else between), the loss broadcast and the
   gradient clipping (all of ``clip_fp32_gradients``, its norm computation included: an upper bound of
   that wait). The figure is the share of the idle time in gaps of 0.5 ms or more that reported
   bubbles cover (target >= 90%), with the plain ratio of all reported to all idle time beside it.
2. **Harvest** H = standalone-equivalent side-task work / bubble time, from the managers' traces
   (``freeride.harvest.harvest``, the demo's and ``bench_modes``' function; standalone throughput
   measured first by the demo's probe), over the bubbles after the warm-up and every task's first
   step (target >= 50%).
3. **Overrun** past the real bubble end, p50 / p99 / max over granted bubbles (target p99 <= 1 ms).
4. **Instrumentation cost on the training thread** per iteration: the CPU time (``thread_time``) the
   hooks and the tracker add to ``train_batch`` on :class:`bench.deepspeed_replay.ReplayEngine` -- a
   real ``TrainSchedule`` dispatched as the engine does, with empty instructions and 0.3 ms sleeps
   where it waits -- with a real reporter streaming to a manager, its sender on another core; divided
   by the two-rank run's median iteration time (target <= 0.2%). Bare and instrumented blocks
   alternate.

Results: ``<out>/deepspeed.json`` and ``<out>/deepspeed.md``, with the machine, the versions and the
load average. ``--quick`` runs fewer iterations and a shorter cost measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.machine import machine_info  # noqa: E402
from freeride.measure import median, percentiles  # noqa: E402

WAITING = {"SendActivation", "RecvActivation", "SendGrad", "RecvGrad", "CommitP2P"}
OUTSIDE = {"LossBroadcast", "ClipGradients"}  # waits outside the instructions, timed whole
TASK = {"target": "side_tasks.graphs:PageRank", "args": {"graph": "rmat:12", "tol": 0.0, "max_iterations": 10**9},
        "memory_bytes": 640 * 2**20}
GAP_NS = 500_000


def idle_gaps(probe: Sequence[Sequence[Any]]) -> list[tuple[int, int]]:
    """One iteration's idle intervals from the probe's ``[name, start_ns, end_ns]`` records: each run of
    waiting instructions with nothing else between them, and each wait outside the instructions."""
    gaps: list[tuple[int, int]] = []
    run: list[int] | None = None
    for name, start, end in sorted(probe, key=lambda e: (e[1], -e[2])):
        if name in WAITING:
            if run is None:
                run = [start, end]
                gaps.append((start, end))
            else:
                run[1] = end
                gaps[-1] = (run[0], end)
        else:
            run = None
            if name in OUTSIDE:
                gaps.append((start, end))
    return gaps


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> int:
    return max(0, min(a[1], b[1]) - max(a[0], b[0]))


def coverage(result: dict[str, Any], warmup: int) -> dict[str, Any]:
    """Idle time, reported bubble time and how much of the idle time in gaps >= 0.5 ms bubbles cover."""
    idle = long = covered = reported = 0
    times = []
    for i, it in enumerate(result["iterations"]):
        if i < warmup:
            continue
        times.append((it["end_ns"] - it["start_ns"]) / 1e6)
        bubbles = [(b[2], b[3]) for b in result["bubbles"].get(str(i), [])]
        reported += sum(e - s for s, e in bubbles)
        for gap in idle_gaps(it["probe"]):
            length = gap[1] - gap[0]
            idle += length
            if length >= GAP_NS:
                long += length
                covered += sum(_overlap(gap, b) for b in bubbles)
    n = max(1, len(times))
    return {"iterations": len(times), "iteration_ms_median": median(times),
            "idle_ms_per_iteration": idle / n / 1e6, "idle_in_long_gaps_ms_per_iteration": long / n / 1e6,
            "reported_ms_per_iteration": reported / n / 1e6,
            "covered_share_of_long_gaps": covered / long if long else None,
            "reported_over_idle": reported / idle if idle else None,
            "slots": result.get("slots"), "learned_slots": result.get("learned_slots"),
            "unplanned_waits": result.get("unplanned_waits")}


def standalone_rate(device: str, seconds: float, run_dir: Path) -> float:
    """PageRank's progress per second alone on ``device`` (the demo's probe, pinned, normal priority)."""
    request, out = run_dir / "standalone-request.json", run_dir / "standalone.json"
    request.write_text(json.dumps({"device": device, "seconds": seconds, "tasks": [{"name": "pagerank", **TASK}]}))
    subprocess.run([sys.executable, "-m", "freeride._demo.probe", str(request), str(out)], cwd=REPO, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120 + 4 * seconds)
    return float(json.loads(out.read_text())[0]["report"]["progress_per_s"])


def two_rank_run(args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    """The job beside a manager and a PageRank task per core; the job's results and the harvest."""
    from bench.bench_modes import Layout, _wait_resident, managers
    from freeride._manager.trace import read_trace
    from freeride._wire.client import ControlClient
    from freeride.harvest import harvest, standalone_step_s, steady_window
    from freeride.messages import TaskSpec

    cores = sorted(os.sched_getaffinity(0))[:2]
    devices = tuple(f"cpu:{c}" for c in cores)
    rate = standalone_rate(devices[0], args.standalone_s, run_dir)
    runtime = Path(tempfile.mkdtemp(prefix="frd-", dir="/tmp"))
    (runtime / "freeride").mkdir(mode=0o700)
    step_s: dict[str, float] = {}
    try:
        with managers(Layout("deepspeed-two-stage-cpu", devices), run_dir, runtime / "freeride", "freeride",
                      None) as endpoints:
            tasks = {}
            for dev, ep in endpoints.items():
                with ControlClient(ep) as client:
                    tasks[dev] = client.submit(TaskSpec(name="pagerank", working_dir=str(REPO), **TASK)).task_id
                    _wait_resident(client, [tasks[dev]])  # set up before training starts, as in bench_modes
            env = dict(os.environ, XDG_RUNTIME_DIR=str(runtime), OMP_NUM_THREADS="1")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                   "-m", "freeride.workload.deepspeed_job", "--report", "--iterations", str(args.iterations),
                   "--slow-ms", str(args.slow_ms), "--width", str(args.width),
                   "--result-file", str(run_dir / "result.json")]
            with (run_dir / "job.log").open("wb") as log:
                subprocess.run(cmd, env=env, cwd=REPO, check=True, stdout=log, stderr=subprocess.STDOUT)
            time.sleep(0.3)  # the last ends reach the managers
            for dev, ep in endpoints.items():
                with ControlClient(ep) as client:
                    info = client.get(tasks[dev])
                    step_s[tasks[dev]] = standalone_step_s(info.progress, info.steps, rate)
    finally:
        shutil.rmtree(runtime, ignore_errors=True)
    results = [json.loads((run_dir / f"result.rank{r}.json").read_text()) for r in (0, 1)]
    traces = [read_trace(run_dir / f"trace-{d.replace(':', '-')}.jsonl") for d in devices]
    start = max(r["iterations"][args.warmup]["start_ns"] for r in results)
    end = max(r["iterations"][-1]["end_ns"] for r in results)
    h = harvest(traces, step_s, steady_window(traces, (start, end)))
    p50, p99, top = percentiles(h.overruns_ms, (50, 99, 100)) if h.overruns_ms else (None, None, None)
    return {"devices": devices, "standalone_progress_per_s": rate,
            "ranks": [coverage(r, args.warmup) for r in results],
            "restored": all(r.get("restored") for r in results),
            "harvest": {"efficiency": h.efficiency, "bubble_s": h.bubble_s, "work_s": h.work_s,
                        "bubbles": h.bubbles, "shares": h.shares(), "steps": sum(h.steps.values())},
            "overrun_ms": {"p50": p50, "p99": p99, "max": top, "granted_bubbles": len(h.overruns_ms)}}


def hot_path_cost(iterations: int, blocks: int, run_dir: Path) -> dict[str, Any]:
    """CPU time the hooks add to the training thread per iteration, on the replayed schedule (module doc)."""
    from deepspeed.runtime.pipe.schedule import TrainSchedule

    from bench.deepspeed_replay import ReplayEngine
    from freeride._manager.daemon import Manager
    from freeride.endpoints import Endpoint
    from freeride.training import deepspeed as fds
    from freeride.training.reporter import BubbleReporter

    cores = sorted(os.sched_getaffinity(0))
    train_core, other = cores[0], set(cores[1:]) or {cores[0]}
    sock = Path(tempfile.mkdtemp(prefix="frc-", dir="/tmp")) / "m.sock"
    device = f"cpu:{train_core}"
    manager = Manager(device, endpoint=Endpoint("unix", str(sock)), state_dir=run_dir / "cost-state")
    manager.start()
    out: dict[str, Any] = {}
    try:
        os.sched_setaffinity(0, {train_core})
        for stage in (0, 1):
            reporter = BubbleReporter(device, stage=stage, rank=stage, endpoint=Endpoint("unix", str(sock)),
                                      cpu_affinity=other)
            engine = ReplayEngine(TrainSchedule, 4, 2, stage, wait_s=0.0003)
            per_block: dict[str, list[float]] = {"bare": [], "instrumented": []}
            for block in range(2 * blocks):
                instrumented = block % 2 == 1
                if instrumented:
                    fds._install(engine, reporter, device=device)
                t0 = time.thread_time_ns()
                for _ in range(iterations):
                    engine.train_batch()
                spent = (time.thread_time_ns() - t0) / iterations
                if instrumented:
                    fds.uninstrument(engine)
                engine.ran.clear()
                per_block["instrumented" if instrumented else "bare"].append(spent)
            reporter.close()
            bare, inst = median(per_block["bare"]), median(per_block["instrumented"])
            out[f"stage{stage}"] = {"bare_us": bare / 1e3, "instrumented_us": inst / 1e3,
                                    "cost_us_per_iteration": (inst - bare) / 1e3,
                                    "reporter": asdict(reporter.counters())}
    finally:
        os.sched_setaffinity(0, set(cores))
        manager.stop()
        shutil.rmtree(sock.parent, ignore_errors=True)
    return out


def write_markdown(doc: dict[str, Any], path: Path) -> None:
    run, cost = doc["run"], doc["cost"]
    lines = [
        "# The DeepSpeed adapter on a two-rank CPU pipeline",
        "",
        f"`{doc['command']}` -- {doc['when']}; load average before / after: {doc['loadavg_before']} / "
        f"{doc['loadavg_after']} on {doc['machine']['cores']} cores ({doc['machine']['cpu']}); "
        f"torch {doc['machine']['versions'].get('torch')}, DeepSpeed {doc['deepspeed']}.",
        "",
        f"Job: 2 ranks x 1 model stage (`PipelineEngine`, `TrainSchedule`, 4 micro-batches), stage 1 "
        f"{doc['args']['slow_ms']} ms slower per forward and backward, {doc['args']['iterations']} iterations "
        f"({doc['args']['warmup']} warm-up); one PageRank `rmat:12` task per core.",
        "",
        "| rank | iteration (ms, median) | idle / it (ms) | in gaps >= 0.5 ms | reported / it | "
        "covered of gaps >= 0.5 ms (target >= 90%) | reported / idle |",
        "|---|---|---|---|---|---|---|",
    ]
    for rank, r in enumerate(run["ranks"]):
        cov = r["covered_share_of_long_gaps"]
        ratio = r["reported_over_idle"]
        lines.append(f"| {rank} | {r['iteration_ms_median']:.1f} | {r['idle_ms_per_iteration']:.2f} | "
                     f"{r['idle_in_long_gaps_ms_per_iteration']:.2f} | {r['reported_ms_per_iteration']:.2f} | "
                     f"{'-' if cov is None else f'{cov:.1%}'} | {'-' if ratio is None else f'{ratio:.1%}'} |")
    h, o = run["harvest"], run["overrun_ms"]
    eff = h["efficiency"]
    lines += [
        "",
        f"Harvest: H = {'-' if eff is None else f'{eff:.1%}'} (target >= 50%) of {h['bubble_s']:.2f} s of bubbles "
        f"({h['bubbles']} bubbles, {h['steps']} steps); overrun past the real end p50 / p99 / max = "
        f"{_ms(o['p50'])} / {_ms(o['p99'])} / {_ms(o['max'])} ms over {o['granted_bubbles']} granted bubbles "
        "(target p99 <= 1 ms).",
        "",
        "Training-thread cost per iteration (replayed schedule, sender on another core; target <= 0.2%):",
        "",
        "| stage | bare (us) | instrumented (us) | added (us) | of the run's median iteration |",
        "|---|---|---|---|---|",
    ]
    for stage in (0, 1):
        c = cost[f"stage{stage}"]
        it_ms = run["ranks"][stage]["iteration_ms_median"]
        lines.append(f"| {stage} | {c['bare_us']:.1f} | {c['instrumented_us']:.1f} | {c['cost_us_per_iteration']:.1f} |"
                     f" {c['cost_us_per_iteration'] / 1e3 / it_ms:.3%} |")
    lines += ["", "Method: see the docstring of `bench/bench_deepspeed.py`."]
    path.write_text("\n".join(lines) + "\n")


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a short run (fewer iterations, shorter cost blocks)")
    p.add_argument("--iterations", type=int, default=0, help="training iterations (default 150, quick 40)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--slow-ms", type=float, default=3.0)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--standalone-s", type=float, default=3.0)
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "cpu"))
    args = p.parse_args(argv)
    args.iterations = args.iterations or (40 if args.quick else 150)
    if args.quick:
        args.standalone_s = min(args.standalone_s, 2.0)
    import deepspeed

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix="bench-deepspeed-"))
    before = os.getloadavg()
    run = two_rank_run(args, run_dir)
    cost = hot_path_cost(100 if args.quick else 400, 3 if args.quick else 7, run_dir)
    doc = {"command": "python -m bench.bench_deepspeed" + (" --quick" if args.quick else ""),
           "when": time.strftime("%Y-%m-%d %H:%M"), "machine": machine_info(), "deepspeed": deepspeed.__version__,
           "loadavg_before": [round(x, 2) for x in before], "loadavg_after": [round(x, 2) for x in os.getloadavg()],
           "args": vars(args), "run": run, "cost": cost, "run_dir": str(run_dir)}
    (out / "deepspeed.json").write_text(json.dumps(doc, indent=2) + "\n")
    write_markdown(doc, out / "deepspeed.md")
    print((out / "deepspeed.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
