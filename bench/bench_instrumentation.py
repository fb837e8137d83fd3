"""Instrumentation overhead and bubble-prediction error of the reference trainer.

    python bench/bench_instrumentation.py [--iterations 480] [--ab-block 6] [--out bench/results/cpu]

What it measures, all in one run:

1. **End-to-end overhead.** ``freeride launch`` starts one manager per CPU core (no side tasks) and
   runs the reference trainer (2 stages, gloo, one core per stage) under torchrun with ``--report``
   and ``--ab-block B``: blocks of B iterations alternate between *instrumented + reporting* and
   *bare* (hooks detached), the order within each pair of blocks drawn at random. Overhead =
   mean instrumented iteration time / mean bare iteration time - 1, over pairs of blocks, with
   Student-t and BCa-bootstrap 95% intervals (``freeride.measure``). The first iteration of every
   block and the warm-up are left out. Both stages and the managers share the two cores here: the
   stress layout; ``bench/bench_modes.py``'s ``instrumented`` mode measures the same end to end in
   the layout that mirrors a GPU host (the stage on a core of its own).
2. **Hot-path cost.** The same instrumentation on 1F1B's order replayed with 1 ms of compute per
   action (:mod:`bench.hot_path`), every planned wait reported to a real reporter and manager: the
   training-thread time the instrumentation adds per iteration, on both routes (events to the
   reporter's sender thread, or sent on the manager's local socket). Divided by the measured
   iteration time it is the overhead's precise part. Two layouts: on a GPU host (and in the
   single-stage CPU layout) the reporter's sender thread has a core of its own, so only the
   training thread's own work is on the critical path; where the sender shares the stage's core,
   each bubble-end send is too (its CPU per event, measured with a paced reporter).
3. **Prediction error** of bubble lengths after warm-up: ``|predicted - measured| / measured`` of
   every reported bubble, from the trainer's own log and from the managers' Bubbles statistics.

Results: ``<out>/instrumentation.json`` and ``<out>/instrumentation.md`` (machine and versions
included).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.bench_schedules import side_task  # noqa: E402
from freeride.measure import bootstrap_interval, median, percentile, t_interval  # noqa: E402


def machine_info() -> dict[str, Any]:
    import psutil
    import torch

    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores_usable": len(os.sched_getaffinity(0)),
        "memory_bytes": psutil.virtual_memory().total,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "loadavg_at_start": os.getloadavg(),
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------- 1 + 3: the real run


def run_trainer(args: argparse.Namespace, work: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    log = work / "it.jsonl"
    dump = work / "managers.json"
    driver = work / "driver.py"
    trainer = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
        "--master-port", str(_free_port()), "-m", "freeride.workload", "--schedule", args.schedule,
        "--microbatches", str(args.microbatches), "--iterations", str(args.iterations),
        "--ab-block", str(args.ab_block), "--warmup", str(args.warmup), "--report",
        "--iteration-log", str(log), "--seed", str(args.seed),
    ]
    task = side_task(args.side_task) if args.side_task else None
    driver.write_text(textwrap.dedent(f"""
        import json, os, subprocess, sys, time
        from dataclasses import asdict
        from freeride._wire.client import ControlClient
        from freeride.endpoints import default_endpoint
        from freeride.messages import TaskSpec
        task = {task!r}

        def manager_cpu_s():  # every manager's CPU time so far (its process: all its threads)
            tick, total = os.sysconf("SC_CLK_TCK"), 0.0
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    cmd = open(f"/proc/{{pid}}/cmdline", "rb").read().split(b"\\0")
                    if b"manager" in cmd and b"--device" in cmd:
                        fields = open(f"/proc/{{pid}}/stat").read().rsplit(")", 1)[1].split()
                        total += (int(fields[11]) + int(fields[12])) / tick
                except OSError:
                    pass
            return total

        ids = {{}}
        for device in ("cpu:0", "cpu:1"):
            if task is not None:
                with ControlClient(default_endpoint(device)) as c:
                    ids[device] = c.submit(TaskSpec(target=task["target"], args=task["args"],
                                                    memory_bytes=task["memory_bytes"], name=task["name"])).task_id
        cpu_before = manager_cpu_s()
        rc = subprocess.call({trainer!r})
        cpu_s = manager_cpu_s() - cpu_before
        time.sleep(0.5)
        doc = {{"manager_cpu_s": cpu_s}}
        for device in ("cpu:0", "cpu:1"):
            with ControlClient(default_endpoint(device)) as c:
                doc[device] = {{"bubbles": [asdict(s) for s in c.bubbles()], "stats": asdict(c.stats())}}
                if device in ids:
                    doc[device]["task"] = asdict(c.get(ids[device]))
        json.dump(doc, open({str(dump)!r}, "w"), default=str)
        sys.exit(rc)
    """))
    env = dict(os.environ, XDG_RUNTIME_DIR=str(work), OMP_NUM_THREADS="1", FREERIDE_LOG_LEVEL="WARNING",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("FREERIDE_ENDPOINT", None)
    cmd = [sys.executable, "-m", "freeride.cli", "launch", "--devices", "cpu:0,cpu:1",
           "--state-dir", str(work / "state"), "--", sys.executable, str(driver)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"trainer run failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    records = []
    for rank in (0, 1):
        path = log.with_name(f"it.rank{rank}.jsonl")
        records += [json.loads(line) for line in path.read_text().splitlines()]
    return records, json.loads(dump.read_text())


def analyse_overhead(records: list[dict[str, Any]], block: int, warmup: int) -> dict[str, Any]:
    per_iter: dict[int, dict[str, Any]] = {}
    for r in records:
        if r.get("summary"):
            continue
        entry = per_iter.setdefault(r["iteration"], {"times": [], "on": r["reporting"]})
        entry["times"].append(r["time_ms"])
    # Iteration time: the mean over ranks (they are coupled by the pipeline).
    times = {it: statistics.fmean(e["times"]) for it, e in per_iter.items()}
    on = {it: e["on"] for it, e in per_iter.items()}
    pairs = []
    n_blocks = (max(times) + 1) // block
    for b in range(0, n_blocks - 1, 2):
        blocks = [list(range(k * block, (k + 1) * block)) for k in (b, b + 1)]
        kept = [[it for it in blk[1:] if it >= warmup] for blk in blocks]  # first of a block: transition
        if not all(kept):
            continue
        means = [statistics.fmean(times[it] for it in k) for k in kept]
        modes = [on[blk[0]] for blk in blocks]
        if modes[0] == modes[1]:
            continue
        t_on, t_off = (means[0], means[1]) if modes[0] else (means[1], means[0])
        pairs.append((t_on, t_off))
    ratios = [a / b - 1 for a, b in pairs]
    all_on = [times[it] for it in times if on[it] and it >= warmup and it % block]
    all_off = [times[it] for it in times if not on[it] and it >= warmup and it % block]
    boot = bootstrap_interval(ratios) if ratios else None
    t = t_interval(ratios) if ratios else None
    return {
        "pairs": len(pairs),
        "iteration_ms_instrumented_mean": statistics.fmean(all_on),
        "iteration_ms_bare_mean": statistics.fmean(all_off),
        "iteration_ms_instrumented_median": median(all_on),
        "iteration_ms_bare_median": median(all_off),
        "iteration_ms_bare_stdev": statistics.stdev(all_off),
        "overhead_mean_of_pairs": statistics.fmean(ratios) if ratios else 0.0,
        "overhead_median_of_pairs": median(ratios) if ratios else 0.0,
        "overhead_ci95": [boot.low, boot.high] if boot else [0.0, 0.0],
        "overhead_ci95_t": [t.low, t.high] if t else [0.0, 0.0],
        "overhead_ratio_of_means": statistics.fmean(all_on) / statistics.fmean(all_off) - 1,
    }


def analyse_prediction(records: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    errors: list[float] = []
    by_slot: dict[str, list[float]] = {}
    lengths: dict[str, list[float]] = {}
    for r in records:
        if r.get("summary") or r["iteration"] < warmup:
            continue
        for b in r["bubbles"]:
            if b["length_ms"] <= 0:
                continue
            err = abs(b["predicted_ms"] - b["length_ms"]) / b["length_ms"]
            key = f"stage{r['stage']}/slot{b['slot']}:{b['kind']}"
            errors.append(err)
            by_slot.setdefault(key, []).append(err)
            lengths.setdefault(key, []).append(b["length_ms"])
    # The noise floor: the error of an oracle that knows each slot's median over the whole run and
    # always predicts it. No per-slot predictor that ignores the noise of the moment can do better.
    floor: list[float] = []
    floor_by_slot: dict[str, list[float]] = {}
    for k, v in lengths.items():
        med = median(v)
        errs = [abs(med - x) / x for x in v]
        floor += errs
        floor_by_slot[k] = errs
    return {
        "bubbles": len(errors),
        "p50": percentile(errors, 50),
        "p90": percentile(errors, 90),
        "p99": percentile(errors, 99),
        "noise_floor_p50": percentile(floor, 50),
        "noise_floor_p90": percentile(floor, 90),
        "per_slot": {
            k: {
                "count": len(v),
                "length_ms_p50": percentile(lengths[k], 50),
                "length_ms_p90": percentile(lengths[k], 90),
                "error_p50": percentile(v, 50),
                "error_p90": percentile(v, 90),
                "noise_floor_p50": percentile(floor_by_slot[k], 50),
                "noise_floor_p90": percentile(floor_by_slot[k], 90),
            }
            for k, v in sorted(by_slot.items())
        },
    }


# ---------------------------------------------------------------- 2: hot-path cost


def hot_path_cost(microbatches: int, work: Path) -> dict[str, Any]:
    """Training-thread ns per iteration added by instrumentation + reporting (:mod:`bench.hot_path`), and
    the sender thread's CPU per event."""
    from bench.bench_schedules import _torch_case, _walker
    from bench.hot_path import costs_ns
    from freeride.endpoints import Endpoint
    from freeride.training.instrument import InstrumentedSchedule
    from freeride.training.reporter import BubbleReporter

    # (a) the training thread's cost, both routes: 1F1B's real order replayed with 1 ms of compute per
    # action, every planned wait reported to a real reporter and manager (bench.hot_path).
    costs = costs_ns(lambda rank: _torch_case("1f1b", rank, microbatches, work / "unused.csv"))
    out: dict[str, Any] = {}
    for rank in (0, 1):
        counted = InstrumentedSchedule(_walker("1f1b", rank, microbatches, work / "unused.csv"), sink=None,
                                       device="cpu:0")
        planned = counted.slots
        counted.close()
        out[f"stage{rank}"] = {
            "queue_ns_per_iteration": costs["queue"][rank],
            "local_ns_per_iteration": costs["local"][rank],
            "bubbles_per_iteration": len(planned),
        }
    # The manager runs in its own process, as in production: its work must not be billed here.
    endpoint = Endpoint("unix", str(work / "hot.sock"))
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    manager = subprocess.Popen(
        [sys.executable, "-m", "freeride.cli", "manager", "--device", "cpu:0", "--endpoint", str(endpoint),
         "--state-dir", str(work / "hot-state")],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not _serving(endpoint):
            if time.monotonic() > deadline or manager.poll() is not None:
                raise SystemExit("hot-path bench: the manager did not start")
            time.sleep(0.1)
        # (b) the sender thread's CPU per event (gRPC serialisation and write), paced like a trainer.
        # On a CPU device it shares the stage's core: bubble-end events are sent while the stage
        # computes again (on the critical path); bubble-start events while it waits (free).
        reporter = BubbleReporter("cpu:0", stage=0, rank=0, endpoint=endpoint, local_events=False)
        time.sleep(0.3)
        events = 2000
        # Pinned like a CPU stage: process CPU time then counts every thread's share on that core.
        idle_cpu = time.process_time()
        wall0 = time.monotonic()
        for _ in range(events):
            time.sleep(0.0005)
        idle_cpu = time.process_time() - idle_cpu
        idle_wall = time.monotonic() - wall0
        cpu0 = time.process_time()
        for i in range(events // 2):
            reporter.bubble_start(i, 0, "x", 1_000_000)
            time.sleep(0.0005)
            reporter.bubble_end(i, 0)
            time.sleep(0.0005)
        deadline = time.monotonic() + 10
        while reporter.sent < events and time.monotonic() < deadline:
            time.sleep(0.01)
        cpu = time.process_time() - cpu0 - idle_cpu
        reporter.close()
        out["sender_cpu_ns_per_event"] = cpu / events * 1e9
        out["sender_reporter"] = reporter.counters().__dict__
        out["pacing_wall_s"] = idle_wall
        for rank in (0, 1):
            st = out[f"stage{rank}"]
            own = st["queue_ns_per_iteration"]
            st["own_ns_per_iteration"] = own  # the sender on a core of its own (a GPU host)
            st["critical_path_ns_per_iteration"] = own + st["bubbles_per_iteration"] * out["sender_cpu_ns_per_event"]
            st["upper_bound_ns_per_iteration"] = own + 2 * st["bubbles_per_iteration"] * out["sender_cpu_ns_per_event"]
    finally:
        manager.terminate()
        manager.wait(30)
    return out


def _serving(endpoint: Any) -> bool:
    from freeride._wire.client import health_status
    from freeride.errors import FreerideError

    try:
        return health_status(endpoint, timeout_s=1.0) == "SERVING"
    except FreerideError:
        return False


# ---------------------------------------------------------------- report


def _task_text(spec: str) -> str:
    task = side_task(spec)
    return f"`{task['target']}` {task['args']}"


def _managers_cpu_lines(doc: dict[str, Any]) -> list[str]:
    """The managers' CPU over the trainer's run, per bubble they were told of: on these two cores it is taken from
    the ranks (no core is free of one)."""
    m, cpu_s = doc["managers"], doc.get("manager_cpu_s")
    if cpu_s is None:
        return []
    bubbles = sum(m[d]["stats"]["bubbles"] for d in ("cpu:0", "cpu:1"))
    harvested = sum(m[d]["stats"]["harvested_s"] for d in ("cpu:0", "cpu:1"))
    per = f", {1e6 * cpu_s / bubbles:.0f} us per bubble" if bubbles else ""
    return [f"Managers' CPU over the run (both, every thread): {cpu_s:.2f} s for {bubbles} bubbles{per}; "
            f"side tasks harvested {harvested:.2f} s."]


def write_markdown(path: Path, doc: dict[str, Any]) -> None:
    o, p, h, m = doc["overhead"], doc["prediction"], doc["hot_path"], doc["machine"]
    cfg = doc["config"]
    it_ms = o["iteration_ms_bare_mean"]
    crit_ns = max(h[s]["critical_path_ns_per_iteration"] for s in ("stage0", "stage1"))
    own_ns = max(h[s]["own_ns_per_iteration"] for s in ("stage0", "stage1"))
    upper_ns = max(h[s]["upper_bound_ns_per_iteration"] for s in ("stage0", "stage1"))
    lines = [
        "# Instrumentation overhead and bubble prediction error (CPU)",
        "",
        f"Machine: {m['cpu']}, {m['cores_usable']} usable cores, Python {m['python']}, torch {m['torch']}; "
        f"load average at start {tuple(round(x, 2) for x in m['loadavg_at_start'])}, "
        f"at end {tuple(round(x, 2) for x in doc['loadavg_at_end'])}.",
        f"Workload: reference GPT trainer, {cfg['schedule']}, 2 stages (gloo, one core each) x "
        f"{cfg['microbatches']} micro-batches, {cfg['iterations']} iterations, A/B blocks of "
        f"{cfg['ab_block']} (random order per pair), warm-up {cfg['warmup']} iterations excluded. "
        "One manager per core (freeride launch), "
        + (f"one side task each ({_task_text(cfg['side_task'])}: it runs in the instrumented blocks' bubbles; the "
           "bare blocks report none)." if cfg.get("side_task") else "no side tasks."),
        *_managers_cpu_lines(doc),
        "",
        "## Overhead (reporting on, manager up) vs bare, same run, interleaved",
        "",
        "| figure | value |",
        "|---|---|",
        f"| pairs of blocks | {o['pairs']} |",
        f"| iteration time, bare (mean / median / stdev) | {it_ms:.2f} / {o['iteration_ms_bare_median']:.2f} / "
        f"{o['iteration_ms_bare_stdev']:.2f} ms |",
        f"| iteration time, instrumented (mean / median) | {o['iteration_ms_instrumented_mean']:.2f} / "
        f"{o['iteration_ms_instrumented_median']:.2f} ms |",
        f"| overhead, mean of pair ratios | {o['overhead_mean_of_pairs']:+.3%} "
        f"(95% t interval {o['overhead_ci95_t'][0]:+.3%} .. {o['overhead_ci95_t'][1]:+.3%}; BCa bootstrap "
        f"{o['overhead_ci95'][0]:+.3%} .. {o['overhead_ci95'][1]:+.3%}) |",
        f"| overhead, median of pair ratios | {o['overhead_median_of_pairs']:+.3%} |",
        f"| training-thread cost per iteration, stage 0 / stage 1, events to the reporter's sender thread "
        f"on another core (queue) | {h['stage0']['queue_ns_per_iteration'] / 1e3:.1f} / "
        f"{h['stage1']['queue_ns_per_iteration'] / 1e3:.1f} us |",
        f"| ... events sent by the training thread on the manager's local socket (local, the default on one "
        f"host) | {h['stage0']['local_ns_per_iteration'] / 1e3:.1f} / "
        f"{h['stage1']['local_ns_per_iteration'] / 1e3:.1f} us |",
        f"| sender thread CPU per event (gRPC stream write) | {h['sender_cpu_ns_per_event'] / 1e3:.1f} us |",
        f"| **sender on a core of its own (GPU host, single-stage layout): training-thread cost / bare "
        f"iteration time (target <= 0.2%)** | **{own_ns / 1e6 / it_ms:.3%}** |",
        f"| critical-path cost per iteration (own + bubble-end sends on the shared core) | "
        f"{h['stage0']['critical_path_ns_per_iteration'] / 1e3:.1f} / "
        f"{h['stage1']['critical_path_ns_per_iteration'] / 1e3:.1f} us |",
        f"| sender sharing the stage's core (this stress layout): critical-path cost / bare iteration time | "
        f"{crit_ns / 1e6 / it_ms:.3%} |",
        f"| upper bound (every send on the critical path) / iteration time | "
        f"{upper_ns / 1e6 / it_ms:.3%} |",
        "",
        f"Reading: the end-to-end A/B interval is {o['overhead_ci95_t'][1] - o['overhead_ci95_t'][0]:.1%} wide "
        f"(bare iterations vary by {o['iteration_ms_bare_stdev'] / it_ms:.0%}, load average "
        f"{m['loadavg_at_start'][0]:.1f} on {m['cores_usable']} cores), so on this machine it bounds the "
        "overhead only coarsely; the hot-path rows are the precise figure (bench.hot_path: 1F1B's order replayed "
        "with 1 ms of compute per action, every planned wait reported to a real reporter and manager, the "
        "training thread pinned, the manager and the sender thread on the other core). The training thread "
        "pays its marks, which run cache-cold after each compute action (microseconds each), the events' "
        "hand-off, and on the queue route the GIL while the sender thread's Python writes a message; the "
        "sender's own CPU per message only costs training time where it shares the stage's core (the CPU "
        "device here; on a GPU host it runs on a core of its own).",
        "",
        "## Bubble length prediction error after warm-up (|predicted - measured| / measured)",
        "",
        f"All {p['bubbles']} reported bubbles: p50 {p['p50']:.1%}, p90 {p['p90']:.1%}, p99 {p['p99']:.1%} "
        "(target p90 <= 10%).",
        f"Noise floor (an oracle predicting each slot's whole-run median): p50 {p['noise_floor_p50']:.1%}, "
        f"p90 {p['noise_floor_p90']:.1%}.",
        "",
        "| stage/slot:kind | count | length p50 ms | length p90 ms | error p50 | error p90 | floor p50 | floor p90 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for k, v in p["per_slot"].items():
        lines.append(
            f"| {k} | {v['count']} | {v['length_ms_p50']:.2f} | {v['length_ms_p90']:.2f} | "
            f"{v['error_p50']:.1%} | {v['error_p90']:.1%} | {v['noise_floor_p50']:.1%} | "
            f"{v['noise_floor_p90']:.1%} |"
        )
    lines += ["", "Manager-side view (Control.Bubbles, whole run including warm-up):", "",
              "| device | stage | slot | kind | count | length p50 ms | predicted p50 ms | error p50 | error p90 |",
              "|---|---|---|---|---|---|---|---|---|"]
    for device, d in doc["managers"].items():
        for s in d["bubbles"]:
            lines.append(
                f"| {device} | {s['stage']} | {s['slot']} | {s['kind']} | {s['count']} | "
                f"{s['length_ms']['p50']:.2f} | {s['predicted_ms']['p50']:.2f} | "
                f"{s['abs_error_pct']['p50']:.1f}% | {s['abs_error_pct']['p90']:.1f}% |"
            )
    lines += ["", f"Command: `{doc['command']}`", ""]
    path.write_text("\n".join(lines))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=480)
    ap.add_argument("--ab-block", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=12)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "cpu"))
    ap.add_argument("--side-task", default="", help="a side task on each device while the trainer runs: pagerank or "
                    "spin:US (bench.bench_schedules); default none")
    ap.add_argument("--results-name", default="instrumentation", help="the results files' name")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="frb-", dir="/tmp"))
    work.chmod(0o700)
    try:
        machine = machine_info()
        hot = hot_path_cost(args.microbatches, work)
        records, managers = run_trainer(args, work)
        manager_cpu_s = managers.pop("manager_cpu_s", None)
        doc = {
            "command": " ".join(["python", "bench/bench_instrumentation.py", *sys.argv[1:]]),
            "unix_time": time.time(),
            "machine": machine,
            "loadavg_at_end": os.getloadavg(),
            "config": vars(args),
            "overhead": analyse_overhead(records, args.ab_block, args.warmup),
            "hot_path": hot,
            "prediction": analyse_prediction(records, args.warmup),
            "managers": managers,
            "manager_cpu_s": manager_cpu_s,
            "trainer_summaries": [r for r in records if r.get("summary")],
        }
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{args.results_name}.json").write_text(json.dumps(doc, indent=2) + "\n")
        write_markdown(out / f"{args.results_name}.md", doc)
        print((out / f"{args.results_name}.md").read_text())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
