"""Bubbles reported and harvested on Megatron Core's pipeline schedules: two CPU ranks.

    python -m bench.bench_megatron            # 1F1B and interleaved (2 chunks per rank), 200 iterations each
    python -m bench.bench_megatron --quick    # 40 iterations each (a smoke run)

For each schedule it starts one freeride manager per core, submits a PageRank side task
(``rmat:12``, as ``bench.bench_schedules`` does; ``--side-task spin:US`` for busy steps of US us) to
each, and runs ``tests/frameworks/megatron_job.py``
(Megatron Core 0.19.2 on CPU needs a test-only shim for its CUDA literals, which stays in the tests)
under ``torchrun --standalone --nproc-per-node 2`` (gloo, one rank per core), trained through
:func:`freeride.training.megatron.instrument` with ``--report``. Each forward of rank 1 computes
``--slow-ms`` longer (busy), so that rank 0 waits a known amount.

Per rank (iterations after the warm-up): **reported / idle**, the rank's idle time in gaps of 0.5 ms or
more that the bubbles it reported inside them cover, over that idle time, as an idle probe driven by
the trainer's own timers measured it apart from freeride (wall time minus the thread's CPU time and run
delay between two compute actions: :mod:`freeride.workload.idle_probe`); the slots reported (modelled
+ learned); the share of bubbles predicted longer than they were.

Per device (the manager's trace, from the first side-task step after the warm-up): **harvest
efficiency** (:func:`freeride.harvest.harvest`), **freezes**, **overrun** past the real end p50/p99 (held
/ ran, as in ``bench.bench_schedules``),
the side task's step time against the typical bubble (``bench.bench_schedules.analyse_device``).

**Instrumentation cost** per iteration on the training thread, per route (``queue``: the reporter's
sender thread on another core streams the events; ``local``: the training thread sends them on the
manager's local socket): the timer calls Megatron's real schedule function makes in one iteration of
each rank (recorded in process: ``tests/frameworks/megatron_sim.py``) replayed with 1 ms of compute per
compute timer, bare (skipped, as Megatron does without trainer timers) and through the instrumentation,
every planned wait reported to a real reporter and manager (:mod:`bench.hot_path`); the median
difference over the real run's median iteration time.

Results: ``<out>/<results-name>.json`` and ``.md`` (``megatron`` by default), with the machine and the load average
before and after each run.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
FRAMEWORK_TESTS = REPO / "tests" / "frameworks"
sys.path.insert(0, str(REPO))

from bench import hot_path  # noqa: E402
from bench.bench_modes import _wait_resident, managers, two_stage_cpu  # noqa: E402
from bench.bench_schedules import (  # noqa: E402
    GAP_NS,
    analyse_device,
    coverage,
    results_table,
    side_label,
    side_task,
    side_task_option,
    standalone_rate,
)
from bench.hot_path import ROUTES, Case, compute, costs_ns  # noqa: E402
from bench.machine import machine_info  # noqa: E402
from freeride._manager.trace import read_trace  # noqa: E402
from freeride._wire.client import ControlClient  # noqa: E402
from freeride.harvest import standalone_step_s, window_of  # noqa: E402
from freeride.measure import median  # noqa: E402
from freeride.messages import TaskSpec  # noqa: E402
from freeride.training.learned_slots import LEARNED_SLOT_BASE  # noqa: E402
from freeride.training.tracker import BubbleSink  # noqa: E402

SCHEDULES = ("1f1b", "interleaved")


def run_schedule(name: str, args: argparse.Namespace, run_dir: Path, rates: dict[str, float]) -> dict[str, Any]:
    run_dir.mkdir(parents=True, exist_ok=True)
    layout = two_stage_cpu(sorted(os.sched_getaffinity(0)))
    sock_dir = Path(tempfile.mkdtemp(prefix="frm-", dir="/tmp"))
    out = run_dir / "job"
    load_before = os.getloadavg()
    step_s: dict[str, float] = {}
    states: dict[str, str] = {}
    t0 = time.monotonic()
    try:
        with managers(layout, run_dir, sock_dir, "freeride", None) as endpoints:
            ids: dict[str, str] = {}
            for dev, ep in endpoints.items():
                with ControlClient(ep) as client:
                    task = side_task(args.side_task)
                    info = client.submit(TaskSpec(target=task["target"], args=task["args"],
                                                  memory_bytes=task["memory_bytes"], name=task["name"],
                                                  working_dir=str(REPO)))
                    ids[dev] = info.task_id
                    _wait_resident(client, [info.task_id])
            argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                    str(FRAMEWORK_TESTS / "megatron_job.py"), "--schedule", name,
                    "--microbatches", str(args.microbatches), "--iterations", str(args.iterations),
                    "--warmup", str(args.warmup), "--bare-iterations", "0", "--slow-rank", "1",
                    "--slow-ms", str(args.slow_ms), "--report", "--endpoint-template",
                    f"unix:{sock_dir}/{{slug}}.sock", "--out", str(out)]
            env = dict(os.environ, OMP_NUM_THREADS="1", FREERIDE_LOG_LEVEL="WARNING",
                       PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
            with (run_dir / "trainer.log").open("wb") as log:
                code = subprocess.call(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=3600)
            if code != 0:
                raise SystemExit(f"{name}: the trainer failed ({code}); see {run_dir / 'trainer.log'}")
            time.sleep(0.3)  # the last ends and parks reach the managers
            for dev, ep in endpoints.items():
                with ControlClient(ep) as client:
                    info = client.get(ids[dev])
                    states[dev] = info.state
                    step_s[ids[dev]] = standalone_step_s(info.progress, info.steps, rates[dev])
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)
    wall_s = time.monotonic() - t0
    docs = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    ranks = [analyse_rank(doc, args.warmup) for doc in docs]
    window = window_of([iteration_records(doc, args.warmup) for doc in docs])
    devices = {}
    for dev in layout.devices:
        trace = read_trace(run_dir / f"trace-{dev.replace(':', '-')}.jsonl")
        devices[dev] = analyse_device(trace, step_s, window, states.get(dev, "?"))
    return {"schedule": name, "ranks": ranks, "devices": devices, "wall_s": wall_s,
            "loadavg_before": load_before, "loadavg_after": os.getloadavg()}


def iteration_records(doc: dict[str, Any], warmup: int) -> list[dict[str, Any]]:
    """A rank's iterations in the shape :func:`freeride.harvest.window_of` reads."""
    return [{"iteration": i, "warmup": i < warmup, "end_ns": end, "time_ms": (end - begin) / 1e6}
            for i, (begin, end) in enumerate(doc["phases"]["freeride"]["times"])]


def analyse_rank(doc: dict[str, Any], warmup: int) -> dict[str, Any]:
    """One rank's run: what it reported against what its idle probe measured, after the warm-up."""
    phase = doc["phases"]["freeride"]
    its = range(warmup, len(phase["times"]))
    n = max(1, len(its))
    bubbles = [{**b, "length_ms": (b["end_ns"] - b["start_ns"]) / 1e6} for i in its for b in phase["bubbles"][i]]
    lengths = [b["length_ms"] for b in bubbles]
    reported = sum(lengths)
    learned = sum(b["length_ms"] for b in bubbles if b["slot"] >= LEARNED_SLOT_BASE)
    all_gaps = [g for i in its for g in phase["idle_gaps"][i]]  # [start, wall, idle] ns
    gaps = [g for g in all_gaps if g[2] >= GAP_NS]
    idle = sum(g[2] for g in gaps) / 1e6
    covered = coverage(gaps, bubbles) / 1e6
    past = [b for b in bubbles if b["predicted_ns"] > b["end_ns"] - b["start_ns"]]
    times = [(end - begin) / 1e6 for begin, end in (phase["times"][i] for i in its)]
    return {
        "rank": doc["rank"],
        "iterations": len(its),
        "iteration_ms_p50": median(times) if times else 0.0,
        "idle_ms_per_iteration": sum(g[2] for g in all_gaps) / 1e6 / n,
        "gap_wall_ms_per_iteration": sum(g[1] for g in gaps) / 1e6 / n,
        "idle_in_gaps_ms_per_iteration": idle / n,
        "reported_ms_per_iteration": reported / n,
        "learned_ms_per_iteration": learned / n,
        # The idle time of gaps >= 0.5 ms that bubbles reported inside them cover (bench_schedules.coverage).
        "reported_over_idle": covered / idle if idle > 0 else None,
        "bubbles_per_iteration": len(bubbles) / n,
        "wait_positions": len(doc["wait_positions"]),
        "modelled_slots_reported": len({b["slot"] for b in bubbles if b["slot"] < LEARNED_SLOT_BASE}),
        "learned_slots": len({b["slot"] for b in bubbles if b["slot"] >= LEARNED_SLOT_BASE}),
        "unplanned_waits": doc["unplanned_waits"],
        "predicted_past_end": len(past) / len(bubbles) if bubbles else None,
        "bubble_ms_p50": median(lengths) if lengths else 0.0,
    }


class _Recorder:
    """Timers that record the sequence of Megatron's timer calls of one iteration."""

    def __init__(self) -> None:
        self.events: list[tuple[str, bool]] = []

    def __call__(self, name: str, *args: Any, **kwargs: Any) -> Any:
        events = self.events

        class Timer:
            def start(self, *a: Any, **kw: Any) -> None:
                events.append((name, True))

            def stop(self, *a: Any, **kw: Any) -> None:
                events.append((name, False))

        return Timer()


def _timer_calls(virtual: int, rank: int, microbatches: int) -> list[tuple[str, bool]]:
    """What Megatron's real schedule function times in one iteration of one rank, in order."""
    sys.path.insert(0, str(FRAMEWORK_TESTS))
    import megatron_sim

    recorder = _Recorder()
    simulated = megatron_sim.Rank(2, rank, microbatches, virtual, timers=recorder)
    simulated.step(megatron_sim.schedule_function(virtual))
    return recorder.events


def _megatron_case(name: str, microbatches: int, rank: int) -> Case:
    """Megatron's timer calls of one iteration of ``rank`` (recorded from its real schedule function, run in
    process) replayed by a function under Megatron's name, each compute timer ``hot_path.COMPUTE_US`` of busy time
    (:mod:`bench.hot_path`): bare, it skips the timers as Megatron does when the trainer set none;
    instrumented, every call goes through the chained timers and the tracker's marks to the reporter."""
    sys.path.insert(0, str(FRAMEWORK_TESTS))
    import megatron_sim

    from freeride.training.megatron import instrument

    virtual = 2 if name == "interleaved" else 1
    calls = _timer_calls(virtual, rank, microbatches)
    compute_us = hot_path.COMPUTE_US

    def replay_function(config: Any) -> Callable[..., None]:
        def replay(**kwargs: Any) -> None:
            timers = config.timers
            for timer_name, start in calls:
                if timers is not None:
                    if start:
                        timers(timer_name, log_level=2).start()
                    else:
                        timers(timer_name).stop()
                if start and timer_name.endswith("-compute"):
                    compute(compute_us)

        replay.__name__ = megatron_sim.schedule_function(virtual).__name__
        return replay

    def call_of(function: Callable[..., None], config: Any) -> Callable[[], object]:
        model = [types.SimpleNamespace(config=config) for _ in range(virtual)]
        return functools.partial(function, model=model if virtual > 1 else model[0], num_microbatches=microbatches,
                                 p2p_communicator=types.SimpleNamespace(pp_group=megatron_sim.Group(rank, 2)))

    def instrumented(reporter: BubbleSink) -> tuple[Callable[[], object], Callable[[], None]]:
        config = megatron_sim.make_config(2, virtual)
        wrapped = instrument(replay_function(config), reporter, device="cpu:0", report_min_ns=0)
        return call_of(wrapped, config), wrapped.close

    config = megatron_sim.make_config(2, virtual)
    return Case(call_of(replay_function(config), config), instrumented)


def hot_path_ns(name: str, microbatches: int, routes: tuple[str, ...] = ROUTES) -> dict[str, list[float]]:
    """Per route, the training-thread ns per iteration the instrumentation adds, per rank (bench.hot_path)."""
    sys.path.insert(0, str(FRAMEWORK_TESTS))
    from framework_support import one_process_group

    with one_process_group():
        return costs_ns(lambda rank: _megatron_case(name, microbatches, rank), routes=routes)


def write_markdown(doc: dict[str, Any], path: Path) -> None:
    m = doc["machine"]
    c = doc["config"]
    lines = [
        "# Bubbles on Megatron Core's pipeline schedules (2 CPU ranks)",
        "",
        f"`{doc['command']}` on {m['cpu']} ({m['cores']} cores), torch {m['versions'].get('torch')}, "
        f"megatron-core {doc['megatron_core']}; {c['iterations']} iterations ({c['warmup']} warm-up), "
        f"{c['microbatches']} micro-batches, rank 1 {c['slow_ms']} ms slower per forward; interleaved: 2 model "
        f"chunks per rank; one manager and one side task per core: {side_label(c.get('side_task', 'pagerank'))}. "
        "Load average (1 min) before/after each run in the last column: figures from a loaded machine are noisy.",
        "",
    ]
    path.write_text("\n".join(lines + results_table(doc)) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bench_megatron", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="40 iterations per schedule, a shorter standalone probe")
    p.add_argument("--schedules", default=",".join(SCHEDULES), help="comma-separated, of: " + ", ".join(SCHEDULES))
    p.add_argument("--iterations", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--slow-ms", type=float, default=6.0,
                   help="ms more per forward of rank 1 (6: rank 0's waits are ~3x a 2 ms step)")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "cpu")
    p.add_argument("--results-name", default="megatron", help="results go to <out>/<name>.json and .md")
    side_task_option(p, "pagerank")
    args = p.parse_args(argv)
    if args.quick:
        args.iterations, args.warmup = 40, 10
    names = [n.strip() for n in args.schedules.split(",") if n.strip()]
    unknown = sorted(set(names) - set(SCHEDULES))
    if unknown:
        p.error(f"unknown schedule(s): {', '.join(unknown)}")
    from importlib import metadata

    try:
        megatron_core = metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        raise SystemExit("Megatron Core is not installed (scripts/setup.sh installs megatron-core 0.19.2)") from None
    work = Path(tempfile.mkdtemp(prefix="bench-megatron-"))
    devices = two_stage_cpu(sorted(os.sched_getaffinity(0))).devices
    rates = {}
    for i, dev in enumerate(devices):
        (work / f"standalone-{i}").mkdir()
        rates[dev] = standalone_rate(dev, 3.0 if args.quick else 10.0, work / f"standalone-{i}",
                                     side_task(args.side_task))
    runs = []
    for name in names:
        print(f"[bench_megatron] {name} ...", flush=True)
        run = run_schedule(name, args, work / name, rates)
        run["hot_path_ns"] = hot_path_ns(name, args.microbatches)
        runs.append(run)
    command = "python -m bench.bench_megatron" + (" --quick" if args.quick else "")
    if args.side_task != "pagerank":
        command += f" --side-task {args.side_task} --results-name {args.results_name}"
    doc = {"command": command,
           "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
           "machine": machine_info(), "megatron_core": megatron_core, "standalone_progress_per_s": rates,
           "runs": runs, "work_dir": str(work)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.results_name}.json").write_text(json.dumps(doc, indent=2, default=lambda o: asdict(o)) + "\n")
    write_markdown(doc, args.out / f"{args.results_name}.md")
    print((args.out / f"{args.results_name}.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
