"""Bubbles reported and harvested on every torch pipeline schedule and framework: two CPU ranks.

    python -m bench.bench_schedules            # every torch schedule, 200 iterations each
    python -m bench.bench_schedules --quick    # every torch schedule, 40 iterations each (a smoke run)
    python -m bench.bench_schedules --schedules deepspeed,deepspeed-dualpipev,torchtitan --results-name frameworks

For each schedule -- ``ScheduleGPipe`` and ``Schedule1F1B`` (one stage per rank), and
``ScheduleInterleaved1F1B``, ``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``,
``ScheduleDualPipeV`` and ``_PipelineScheduleRuntime`` with an order loaded from CSV (two model
stages per rank; the CSV holds Megatron's interleaved order, which differs from torch's) -- it
starts one freeride manager per core, submits a PageRank side task (``rmat:12``) to each, and runs
the reference trainer (``python -m freeride.workload``) under ``torchrun --standalone
--nproc-per-node 2`` (gloo, one rank per core) with ``--report`` and ``--idle-probe``. Model stage 1
is made ``--slow-ms`` slower per forward (busy compute), so that the ranks wait a known amount.

**Frameworks**, when ``--schedules`` names them, run the same way, each through its adapter:
``deepspeed`` (DeepSpeed's ``PipelineEngine``, one stage per rank, :mod:`freeride.training.deepspeed`),
``deepspeed-dualpipev`` (its ``DualPipeVEngine``, two model stages per rank) -- both
``python -m freeride.workload.deepspeed_job`` -- and ``torchtitan`` (the schedule torchtitan's
``pipeline_llm`` builds, through :mod:`freeride.training.torchtitan`;
``python -m freeride.workload.torchtitan_job``). Their jobs write
the trainer's log format and idle probe (DeepSpeed's probe times the gaps before its ``ForwardPass``
and ``BackwardPass`` instructions), slow model stage 1 the same way, and are measured alike.

Per rank (the trainer's logs, iterations after the warm-up):

* **reported / idle**: the share of the rank's idle time in gaps of 0.5 ms or more that its
  reported bubbles cover. The idle probe measures each gap between two compute actions apart from
  the instrumentation (wall time minus the thread's CPU time and its run delay:
  :mod:`freeride.workload.idle_probe`); a gap counts as covered up to the bubbles reported inside it,
  at most its idle time (a bubble also holds the wait for the core once the data is there, which the
  probe does not count as idle).
* **idle / reported**: the rank's idle time (every gap) over its reported bubble time: on a CPU core,
  the most of the bubble time a side task could harvest. A reported bubble runs from the action's end
  to the next action's start; on a core, the framework's host work in it (a runtime schedule's
  bookkeeping, posting gloo transfers) and the trainer's wait for the core once its data is there are
  no idle time (on a GPU the device is idle from the action's end, whatever the host does).
* **slots**: modelled slots reported at least once, and learned ones.
* **predicted past the end**: the share of bubbles whose predicted length exceeded the real one.

Per device (the manager's trace, from the first side-task step after the warm-up): **harvest
efficiency** (:func:`freeride.harvest.harvest`: standalone-equivalent side-task work / bubble time), and
**of the idle**: that over the rank's idle / reported (what a side task ran of the time the rank's core was
free; on these CPU ranks idle / reported is the ceiling of the harvest), **freezes** (workers stopped with
SIGSTOP because a step outlived its bubble), **overrun** past the
real end p50/p99 (per granted bubble) twice: as the time a step stayed unfrozen past the end ("held"),
and with a frozen step's part past the end bounded by the worker's CPU time from its start to the
freeze ("ran", :attr:`freeride.harvest.BubbleAccount.cpu_overrun_ms`). They differ on these cores: at
the end the trainer's wake takes the core from the worker (nice 19), which then waited, idle and
unfrozen, until its manager got a core to freeze it (now the trainer stops it at the end itself; the
managers' ``--no-trainer-stops``, ``--manager-arg``, measures the old way); "ran" is what competed with the
trainer. Then
the side task's step time against the typical bubble.

**Instrumentation cost** per iteration on the training thread, twice: with the events streamed by the
reporter's sender thread on another core (``queue``) and sent by the training thread on the manager's
local socket (``local``, the default on one host). :mod:`bench.hot_path` replays the rank's real order
(torch's ``pipeline_order_with_comms`` walked as the runtime walks it, a single-stage schedule's loop,
DeepSpeed's instruction stream: :func:`bench.deepspeed_replay.deepspeed_case`; torchtitan: its 1F1B
through the torchtitan wrapper) with 1 ms of compute per action, bare and instrumented with every planned
wait reported to a real reporter and manager; the median difference per iteration, over the real run's
median iteration time.

Results: ``<out>/schedules.json`` (everything) and ``<out>/schedules.md``, with the machine and the
load average before and after each schedule's run.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import hot_path  # noqa: E402
from bench.bench_modes import _wait_resident, managers, two_stage_cpu  # noqa: E402
from bench.hot_path import ROUTES, Case, compute, costs_ns  # noqa: E402
from bench.machine import machine_info  # noqa: E402
from freeride._manager.trace import read_trace  # noqa: E402
from freeride._wire.client import ControlClient  # noqa: E402
from freeride.harvest import harvest, measurement_window, standalone_step_s, steady_window  # noqa: E402
from freeride.measure import median, percentile  # noqa: E402
from freeride.messages import TaskSpec  # noqa: E402
from freeride.training.tracker import BubbleSink  # noqa: E402

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "interleaved-zb", "zbv", "dualpipev", "csv")
#: Frameworks, each through its adapter (module doc), and the job that runs it.
FRAMEWORKS = {"deepspeed": ("freeride.workload.deepspeed_job",),
              "deepspeed-dualpipev": ("freeride.workload.deepspeed_job", "--dualpipev"),
              "torchtitan": ("freeride.workload.torchtitan_job", "--builder", "torchtitan")}
PAGERANK = {"name": "pagerank", "target": "side_tasks.graphs:PageRank",
            "args": {"graph": "rmat:12", "tol": 0.0, "max_iterations": 2**31 - 1}, "memory_bytes": 512 << 20}


def side_task(spec: str) -> dict[str, Any]:
    """``pagerank`` (``rmat:12``, steps of ~1-1.8 ms here), ``spin:US`` (busy steps of US microseconds: the
    issue's harvest target is for a task whose steps are under a third of the typical bubble) or ``command:MS``
    (a command task, :mod:`freeride.command`: a program that computes forever, run in slices of MS
    milliseconds, as ``freeride submit --command`` runs one)."""
    if spec == "pagerank":
        return PAGERANK
    if spec.startswith("command:"):
        try:
            slice_ms = float(spec.split(":", 1)[1])
        except ValueError:
            raise ValueError(f"command:MS needs the slice's milliseconds, got {spec!r}") from None
        if not 0.1 <= slice_ms <= 1000:
            raise ValueError(f"command slices of {slice_ms} ms: give 0.1 <= MS <= 1000")
        return {"name": f"command-{slice_ms:g}ms", "target": "freeride.command:CommandTask",
                "args": {"argv": [sys.executable, "-c", "while True: pass"], "slice_ms": slice_ms},
                "memory_bytes": 64 << 20}
    if spec.startswith("spin:"):
        try:
            step_us = float(spec.split(":", 1)[1])
        except ValueError:
            raise ValueError(f"spin:US needs the step's microseconds, got {spec!r}") from None
        if not 0 < step_us <= 1e6:
            raise ValueError(f"spin steps of {step_us} us: give 0 < US <= 1,000,000")
        return {"name": f"spin-{step_us:g}us", "target": "bench.bench_tasks:SpinStep", "args": {"step_us": step_us},
                "memory_bytes": 64 << 20}
    raise ValueError(f"unknown side task {spec!r}: pagerank, spin:US or command:MS")


def side_task_option(parser: argparse.ArgumentParser, default: str) -> None:
    """Add ``--side-task`` (:func:`side_task`'s specs) to ``parser``, checked as it is parsed: a bad spec is the
    parser's usage error."""

    def checked(spec: str) -> str:
        try:
            side_task(spec)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return spec

    parser.add_argument("--side-task", default=default, type=checked,
                        help="pagerank (rmat:12), spin:US (busy steps of US us) or command:MS (a command task "
                             "computing forever, in slices of MS ms)")


MODEL = ["--layers", "4", "--d-model", "64", "--seq-len", "32", "--vocab", "128", "--microbatch-size", "4"]
GAP_NS = 500_000


# ---------------------------------------------------------------- one schedule, for real


def trainer_argv(name: str, args: argparse.Namespace, log: Path, endpoint_template: str, csv_path: Path) -> list[str]:
    if name in FRAMEWORKS:
        module, *extra = FRAMEWORKS[name]
        size = (["--microbatches", str(args.microbatches)] if module.endswith("deepspeed_job")
                else ["--local-batch", str(2 * args.microbatches)])  # micro-batches of 2
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", module,
                *extra, *size, "--iterations", str(args.iterations), "--warmup", str(args.warmup),
                "--seed", str(args.seed), "--iteration-log", str(log), "--slow-stage", "1",
                "--slow-ms", str(args.slow_ms), "--idle-probe"]
        return argv + (["--report", "--endpoint-template", endpoint_template] if endpoint_template else [])
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "-m", "freeride.workload", "--schedule", name, "--virtual-stages", "2",
            "--microbatches", str(args.microbatches), "--iterations", str(args.iterations),
            "--warmup", str(args.warmup), "--seed", str(args.seed), "--iteration-log", str(log),
            "--slow-stage", "1", "--slow-ms", str(args.slow_ms), "--idle-probe", *MODEL]
    if name == "csv":
        argv += ["--schedule-csv", str(csv_path)]
    if endpoint_template:
        argv += ["--report", "--endpoint-template", endpoint_template]
    return argv


def standalone_rate(device: str, seconds: float, run_dir: Path, task: dict[str, Any] = PAGERANK) -> float:
    """The side task's progress per second alone on ``device`` (the demo's yardstick, ``freeride._demo.probe``)."""
    request, result = run_dir / "standalone-request.json", run_dir / "standalone.json"
    request.write_text(json.dumps({"device": device, "seconds": seconds, "tasks": [task]}))
    with (run_dir / "standalone.log").open("wb") as log:
        subprocess.call([sys.executable, "-m", "freeride._demo.probe", str(request), str(result)], cwd=REPO,
                        stdout=log, stderr=subprocess.STDOUT, timeout=300,
                        start_new_session=True)  # its autogroup at nice 19, like a worker's, not the bench's
    entries = json.loads(result.read_text()) if result.exists() else []
    rate = next((float(e["report"]["progress_per_s"]) for e in entries if "report" in e), 0.0)
    if rate <= 0:
        raise SystemExit(f"the standalone {task['name']} measurement failed; see {run_dir}")
    return rate


def run_schedule(name: str, args: argparse.Namespace, run_dir: Path, rates: dict[str, float],
                 csv_path: Path) -> dict[str, Any]:
    run_dir.mkdir(parents=True, exist_ok=True)
    layout = two_stage_cpu(sorted(os.sched_getaffinity(0)))
    log = run_dir / "it.jsonl"
    sock_dir = Path(tempfile.mkdtemp(prefix="frs-", dir="/tmp"))
    load_before = os.getloadavg()
    step_s: dict[str, float] = {}
    states: dict[str, str] = {}
    t0 = time.monotonic()
    try:
        with managers(layout, run_dir, sock_dir, "freeride", None, args.manager_arg) as endpoints:
            ids: dict[str, str] = {}
            for dev, ep in endpoints.items():
                with ControlClient(ep) as client:
                    task = side_task(args.side_task)
                    info = client.submit(TaskSpec(target=task["target"], args=task["args"],
                                                  memory_bytes=task["memory_bytes"], name=task["name"],
                                                  working_dir=str(REPO)))
                    ids[dev] = info.task_id
                    _wait_resident(client, [info.task_id], timeout_s=900)  # a loaded machine starts workers slowly
            argv = trainer_argv(name, args, log, f"unix:{sock_dir}/{{slug}}.sock", csv_path)
            env = dict(os.environ, OMP_NUM_THREADS="1", FREERIDE_LOG_LEVEL="WARNING",
                       PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
            with (run_dir / "trainer.log").open("wb") as out:
                code = subprocess.call(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=3600)
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
    logs = layout.rank_logs(log)
    ranks = [analyse_rank([json.loads(line) for line in path.read_text().splitlines()]) for path in logs]
    window = measurement_window(logs)
    devices = {}
    for dev in layout.devices:
        trace = read_trace(run_dir / f"trace-{dev.replace(':', '-')}.jsonl")
        devices[dev] = analyse_device(trace, step_s, window, states.get(dev, "?"))
    return {"schedule": name, "ranks": ranks, "devices": devices, "wall_s": wall_s,
            "loadavg_before": load_before, "loadavg_after": os.getloadavg()}


def analyse_rank(records: list[dict[str, Any]]) -> dict[str, Any]:
    """One rank's log: what it reported against what its idle probe measured, after the warm-up."""
    summary = next(r for r in records if r.get("summary"))
    its = [r for r in records if not r.get("summary") and not r["warmup"]]
    bubbles = [b for r in its for b in r["bubbles"]]
    reported = sum(b["length_ms"] for b in bubbles)
    learned = sum(b["length_ms"] for b in bubbles if b["kind"] == "learned")
    gaps = [g for r in its for g in r.get("idle_gaps", []) if g[2] >= GAP_NS]
    idle = sum(g[2] for g in gaps) / 1e6
    covered = coverage(gaps, [b for r in records if not r.get("summary") for b in r["bubbles"]]) / 1e6
    past = [b for b in bubbles if b["predicted_ms"] > b["length_ms"]]
    n = max(1, len(its))
    return {
        "rank": summary["rank"],
        "iterations": len(its),
        "iteration_ms_p50": median([r["time_ms"] for r in its]) if its else 0.0,
        "idle_ms_per_iteration": sum(g[2] for r in its for g in r.get("idle_gaps", [])) / 1e6 / n,
        "idle_in_gaps_ms_per_iteration": idle / n,
        "reported_ms_per_iteration": reported / n,
        "learned_ms_per_iteration": learned / n,
        "reported_over_idle": covered / idle if idle > 0 else None,
        "bubbles_per_iteration": len(bubbles) / n,
        "wait_positions": len(summary.get("slots", [])),
        "modelled_slots_reported": len({b["slot"] for b in bubbles if b["kind"] != "learned"}),
        "learned_slots": len(summary.get("learned_slots", [])),
        "unplanned_wait_ms_per_iteration": summary.get("unplanned_wait_ms", 0.0) / max(1, len(records) - 1),
        "predicted_past_end": len(past) / len(bubbles) if bubbles else None,
        "bubble_ms_p50": median([b["length_ms"] for b in bubbles]) if bubbles else 0.0,
        "loss_last": next((r["loss"] for r in reversed(its) if r.get("loss") is not None), None),
    }


def coverage(gaps: list[list[int]], bubbles: list[dict[str, Any]]) -> int:
    """Idle ns of ``gaps`` ([start, wall, idle]) covered by the bubbles reported inside them."""
    starts = sorted((b["start_ns"], b["length_ms"] * 1e6) for b in bubbles)
    keys = [s for s, _ in starts]
    total = 0
    for start, wall, idle in gaps:
        lo, hi = bisect.bisect_left(keys, start), bisect.bisect_left(keys, start + wall)
        total += int(min(idle, sum(length for _, length in starts[lo:hi])))
    return total


def analyse_device(trace: list[dict[str, Any]], step_s: dict[str, float], window: tuple[int, int],
                   state: str) -> dict[str, Any]:
    steady = steady_window([trace], window)
    h = harvest([trace], step_s, steady)
    bubbles = [b for b in _bubbles(trace) if steady[0] <= b["start_ns"] <= steady[1]]
    freezes = sum(1 for r in trace if r.get("ev") == "freeze" and steady[0] <= r.get("at_ns", 0) <= steady[1])
    spans = [(b - a) / 1e6 for r in trace if r.get("ev") == "steps" for a, b in r.get("spans", [])]
    lengths = [(b["end_ns"] - b["start_ns"]) / 1e6 for b in bubbles]
    # Past the real end, per granted bubble: its last step's end, or the freeze that stopped a step still
    # running in it (harvest's; 0: stopped before the end).
    overruns = list(h.overruns_ms)
    ran = list(h.cpu_overruns_ms)
    return {
        "task_state": state,
        "window_s": (steady[1] - steady[0]) / 1e9,
        "bubble_s": h.bubble_s,
        "harvest_efficiency": h.efficiency if h.bubble_s else None,
        "breakdown_s": dict(h.seconds),
        "granted_bubbles": len(h.overruns_ms),
        "freezes": freezes,
        "overrun_ms_p50": percentile(overruns, 50) if overruns else None,
        "overrun_ms_p99": percentile(overruns, 99) if overruns else None,
        "cpu_overrun_ms_p50": percentile(ran, 50) if ran else None,
        "cpu_overrun_ms_p99": percentile(ran, 99) if ran else None,
        "step_ms_p50": median(spans) if spans else None,
        "step_ms_p95": percentile(spans, 95) if spans else None,
        "bubble_ms_p50": median(lengths) if lengths else None,
    }


def _bubbles(trace: list[dict[str, Any]]) -> list[dict[str, Any]]:
    starts = {(r["iteration"], r["slot"], r.get("stage")): r for r in trace if r.get("ev") == "bubble_start"}
    out = []
    for r in trace:
        if r.get("ev") == "bubble_end":
            s = starts.get((r["iteration"], r["slot"], r.get("stage")))
            if s is not None:
                out.append({"start_ns": s["start_ns"], "end_ns": r["end_ns"]})
    return out


# ---------------------------------------------------------------- the hot path (bench.hot_path)


class _FakeStage:
    """What torch's schedule constructors and InstrumentedSchedule read of a stage; compute is replayed
    (:func:`bench.hot_path.compute`)."""

    def __init__(self, index: int, stages: int, rank: int, compute_us: float = 0.0) -> None:
        import torch

        self.stage_index, self.num_stages, self.group_size, self.group_rank = index, stages, 2, rank
        self.is_first, self.is_last = index == 0, index == stages - 1
        self.submod = torch.nn.Linear(1, 1)
        self.stage_index_to_group_rank: dict[int, int] = {}
        self.compute_us = compute_us

    def forward_one_chunk(self, mb: int, *args: Any, **kwargs: Any) -> None:
        compute(self.compute_us)

    def backward_one_chunk(self, mb: int, *args: Any, **kwargs: Any) -> None:
        compute(self.compute_us)

    def backward_weight_one_chunk(self, mb: int, *args: Any, **kwargs: Any) -> None:
        compute(self.compute_us)


class _RuntimeWalk:
    """A runtime schedule's ``_step_microbatches`` loop over the real ``pipeline_order_with_comms``,
    communication replaced by dict entries, the loss by a no-op."""

    def __init__(self, real: Any) -> None:
        self._stages, self.rank = real._stages, real.rank
        self.pipeline_order_with_comms = real.pipeline_order_with_comms
        self.fwd_recv_ops: dict[tuple[int, int], list[Any]] = {}
        self.bwd_recv_ops: dict[tuple[int, int], list[Any]] = {}
        self._by_index = {s.stage_index: s for s in self._stages}

    def _maybe_compute_loss(self, *args: Any) -> None:
        pass

    def step(self) -> None:
        for action in self.pipeline_order_with_comms[self.rank]:
            for a in action.sub_actions or (action,):
                kind, key = a.computation_type.value, (a.stage_index, a.microbatch_index)
                if kind == "RECV_F":
                    self.fwd_recv_ops[key] = []
                elif kind == "RECV_B":
                    self.bwd_recv_ops[key] = []
                elif kind == "F":
                    if key in self.fwd_recv_ops:
                        self.fwd_recv_ops.pop(key)
                    stage = self._by_index[a.stage_index]
                    stage.forward_one_chunk(a.microbatch_index)
                    self._maybe_compute_loss(stage, None, None, a.microbatch_index)
                elif kind in ("B", "I"):
                    if key in self.bwd_recv_ops:
                        self.bwd_recv_ops.pop(key)
                    self._by_index[a.stage_index].backward_one_chunk(a.microbatch_index, None, kind == "B")
                elif kind == "W":
                    self._by_index[a.stage_index].backward_weight_one_chunk(a.microbatch_index)


class _SingleWalk:
    """A single-stage schedule's loop: receive ops, the compute, the loss, in the model's order."""

    def __init__(self, name: str, stage: _FakeStage, microbatches: int) -> None:
        from freeride.training.schedules import build_schedule

        self._stage, self._n_microbatches = stage, microbatches
        self.order = build_schedule(name, 2, microbatches).orders[stage.stage_index]

    def _maybe_compute_loss(self, *args: Any) -> None:
        pass

    def step(self) -> None:
        from torch.distributed.pipelining import schedules

        stage = self._stage
        for a in self.order:
            if not (stage.is_first if a.kind == "F" else stage.is_last):
                schedules._wait_batch_p2p([])  # as torch's: its receive's wait (InstrumentedSchedule marks it)
            if a.kind == "F":
                self._stage.forward_one_chunk(a.microbatch)
                self._maybe_compute_loss()
            else:
                self._stage.backward_one_chunk(a.microbatch, None, True)


def _walker(name: str, rank: int, microbatches: int, csv_path: Path, compute_us: float = 0.0) -> Any:
    from torch.distributed.pipelining import schedules as torch_schedules

    from freeride.workload import pipelines

    if name in pipelines.SINGLE:
        named = type("Schedule1F1B" if name == "1f1b" else "ScheduleGPipe", (_SingleWalk,), {})
        return named(name, _FakeStage(rank, 2, rank, compute_us), microbatches)
    chunks = pipelines.local_chunks(name, rank, 2, 2, str(csv_path))
    stages = [_FakeStage(c, 4, rank, compute_us) for c in chunks]
    cls = getattr(torch_schedules, pipelines._CLASSES[name])
    real = cls(stages, microbatches)
    if name == "csv":
        real._load_csv(str(csv_path), format="compute_only")
    return _RuntimeWalk(real)


def _torch_case(name: str, rank: int, microbatches: int, csv_path: Path) -> Case:
    """A torch schedule's rank (torchtitan: its 1F1B through the torchtitan wrapper), replayed (bench.hot_path)."""
    from freeride.training.instrument import InstrumentedSchedule
    from freeride.training.torchtitan import InstrumentedPipelineSchedule

    walked_name = "1f1b" if name == "torchtitan" else name

    def instrument(reporter: BubbleSink) -> tuple[Callable[[], object], Callable[[], None]]:
        walked = _walker(walked_name, rank, microbatches, csv_path, hot_path.COMPUTE_US)
        if name == "torchtitan":
            wrapped = InstrumentedPipelineSchedule(walked, sink=reporter, device="cpu:0")
            wrapped.instrumented.tracker.report_min_ns = 0
            return wrapped.step, wrapped.close
        inst = InstrumentedSchedule(walked, sink=reporter, device="cpu:0", report_min_ns=0)
        return inst.step, inst.close

    return Case(_walker(walked_name, rank, microbatches, csv_path, hot_path.COMPUTE_US).step, instrument)


def hot_path_ns(name: str, microbatches: int, csv_path: Path,
                routes: tuple[str, ...] = ROUTES) -> dict[str, list[float]]:
    """Per route, the training-thread ns per iteration the instrumentation adds, per rank (module doc)."""
    if name.startswith("deepspeed"):
        from bench.deepspeed_replay import deepspeed_case

        return costs_ns(lambda rank: deepspeed_case(name.endswith("dualpipev"), microbatches, rank), routes=routes)
    return costs_ns(lambda rank: _torch_case(name, rank, microbatches, csv_path), routes=routes)


# ---------------------------------------------------------------- report


def side_label(spec: str) -> str:
    if spec == "pagerank":
        return "a PageRank `rmat:12`"
    return f"a task of busy steps of {float(spec.split(':', 1)[1]):g} us (`bench.bench_tasks:SpinStep`)"


def write_markdown(doc: dict[str, Any], path: Path) -> None:
    m = doc["machine"]
    lines = [
        "# Bubbles on every pipeline schedule and framework (2 CPU ranks)",
        "",
        f"`{doc['command']}` on {m['cpu']} ({m['cores']} cores), torch {m['versions'].get('torch')}; "
        f"{doc['config']['iterations']} iterations ({doc['config']['warmup']} warm-up), "
        f"{doc['config']['microbatches']} micro-batches, model stage 1 {doc['config']['slow_ms']} ms slower per "
        "forward; one manager and one side task per core: "
        f"{side_label(doc['config'].get('side_task', 'pagerank'))}. Load average (1 min) before/after each run "
        "in the last column: figures from a loaded machine are noisy.",
        "",
    ]
    path.write_text("\n".join(lines + results_table(doc)) + "\n")


def results_table(doc: dict[str, Any]) -> list[str]:
    """The per-rank table of a results document, then the issue's targets (here and in bench_megatron)."""
    routes = next((list(run["hot_path_ns"]) for run in doc["runs"] if isinstance(run.get("hot_path_ns"), dict)),
                  ["-"])  # a results file from before bench.hot_path has one figure
    lines = [
        "| schedule | rank | reported / idle in gaps >= 0.5 ms | idle ms/it | idle / reported "
        "| slots modelled + learned | predicted past end | harvest eff. | of the idle | freezes "
        "| overrun held p50 / p99 ms | overrun ran p50 / p99 ms | step p95 / bubble p50 ms "
        f"| instr. cost: {' / '.join(routes)} | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in doc["runs"]:
        for rank, dev in zip(run["ranks"], run["devices"].values(), strict=True):
            ratio = rank["reported_over_idle"]
            over = (f"{dev['overrun_ms_p50']:.2f} / {dev['overrun_ms_p99']:.2f}"
                    if dev["overrun_ms_p50"] is not None else "-")
            ran = (f"{dev['cpu_overrun_ms_p50']:.2f} / {dev['cpu_overrun_ms_p99']:.2f}"
                   if dev.get("cpu_overrun_ms_p50") is not None else "-")
            eff = f"{100 * dev['harvest_efficiency']:.1f}%" if dev["harvest_efficiency"] is not None else "-"
            steps = (f"{dev['step_ms_p95']:.2f} / {dev['bubble_ms_p50']:.2f}"
                     if dev["step_ms_p95"] is not None and dev["bubble_ms_p50"] is not None else "-")
            past = f"{100 * rank['predicted_past_end']:.0f}%" if rank["predicted_past_end"] is not None else "-"
            cost = instrumentation_cost(run["hot_path_ns"], rank["rank"], rank["iteration_ms_p50"])
            reported = rank.get("reported_ms_per_iteration") or 0.0
            ceiling = f"{100 * rank['idle_ms_per_iteration'] / reported:.0f}%" if reported else "-"
            # The harvest over the idle share: what a side task ran of the time the rank's core was free.
            idle_share = rank["idle_ms_per_iteration"] / reported if reported else 0.0
            of_idle = (f"{100 * dev['harvest_efficiency'] / idle_share:.0f}%"
                       if dev["harvest_efficiency"] is not None and idle_share > 0 else "-")
            lines.append(
                f"| {run['schedule']} | {rank['rank']} | {ratio:.2f} | {rank['idle_in_gaps_ms_per_iteration']:.1f} "
                f"| {ceiling} | {rank['modelled_slots_reported']} + {rank['learned_slots']} | {past} | {eff} "
                f"| {of_idle} "
                f"| {dev['freezes']} | {over} | {ran} | {steps} | {cost} "
                f"| {run['loadavg_before'][0]:.1f} / {run['loadavg_after'][0]:.1f} |"
                if ratio is not None else f"| {run['schedule']} | {rank['rank']} | no idle measured |" + " |" * 12)
    for name, error in doc.get("failed", {}).items():
        lines.append(f"| {name} | - | failed: {error.splitlines()[0][:120]} |" + " |" * 12)
    lines += ["", "Targets (issue 21): reported >= 90% of the idle in gaps >= 0.5 ms on each rank; harvest >= 50% "
              "where the side task's steps are under a third of the typical bubble; overrun p99 <= 1 ms (ran: what "
              "competed with the trainer; held: until frozen); "
              "instrumentation cost <= 0.2% where the sender has its own core (queue: the reporter's sender thread "
              "on another core streams the events; local, the default on the manager's host: the training thread "
              "sends each event on the manager's local socket; awake: the same to a manager kept awake between events, "
              "--event-spin-us; every planned wait reported: bench.hot_path).", ""]
    return lines


def instrumentation_cost(hot_path_ns: dict[str, list[float]] | list[float], rank: int, iteration_ms: float) -> str:
    """The training thread's instrumentation cost of ``rank`` over its median iteration, per route
    (:mod:`bench.hot_path`; a results file from before it holds one figure, without the events)."""
    if not iteration_ms:
        return "-"
    routes = hot_path_ns.values() if isinstance(hot_path_ns, dict) else [hot_path_ns]
    return " / ".join(f"{100 * ns[rank] / 1e6 / iteration_ms:.3f}%" for ns in routes)


def write_csv_order(path: Path, microbatches: int) -> None:
    """The order the ``csv`` schedule loads: Megatron's interleaved one (2 ranks, 2 model stages each)."""
    from freeride.training.schedules import build_schedule

    megatron = build_schedule("interleaved-1f1b", 2, microbatches, virtual=2)
    path.write_text("\n".join(",".join(str(a) for a in megatron.orders[r]) for r in (0, 1)) + "\n")


def temporary_csv_order(microbatches: int, prefix: str = "fr-csv-") -> Path:
    """:func:`write_csv_order` into a fresh temporary folder, removed when this process exits (the replays read
    it to the end; each run of a bench that made one and kept it left a folder in /tmp)."""
    import atexit

    folder = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, folder, True)
    path = folder / "order.csv"
    write_csv_order(path, microbatches)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bench_schedules", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="40 iterations per schedule, a shorter standalone probe")
    choices = (*SCHEDULES, *FRAMEWORKS)
    p.add_argument("--schedules", default=",".join(SCHEDULES),
                   help="comma-separated, of: " + ", ".join(choices) + " (default: the torch schedules)")
    p.add_argument("--iterations", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--slow-ms", type=float, default=3.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "cpu")
    p.add_argument("--results-name", default="schedules", help="results go to <out>/<name>.json and .md")
    side_task_option(p, "pagerank")
    p.add_argument("--manager-arg", action="append", default=[], metavar="ARG",
                   help="one more option for every manager (repeat it; e.g. --manager-arg=--no-trainer-stops)")
    args = p.parse_args(argv)
    if args.quick:
        args.iterations, args.warmup = 40, 10
    names = [n.strip() for n in args.schedules.split(",") if n.strip()]
    unknown = sorted(set(names) - set(choices))
    if unknown:
        p.error(f"unknown schedule(s): {', '.join(unknown)}")
    work = Path(tempfile.mkdtemp(prefix="bench-schedules-"))
    csv_path = work / "megatron-interleaved.csv"
    write_csv_order(csv_path, args.microbatches)
    devices = two_stage_cpu(sorted(os.sched_getaffinity(0))).devices
    rates = {}
    for i, dev in enumerate(devices):
        (work / f"standalone-{i}").mkdir()
        rates[dev] = standalone_rate(dev, 3.0 if args.quick else 10.0, work / f"standalone-{i}",
                                     side_task(args.side_task))
    runs: list[dict[str, Any]] = []
    command = "python -m bench.bench_schedules" + (" --quick" if args.quick else "")
    if names != list(SCHEDULES):
        command += f" --schedules {','.join(names)}"
    if args.results_name != "schedules":
        command += f" --results-name {args.results_name}"
    if args.side_task != "pagerank":
        command += f" --side-task {args.side_task}"
    command += "".join(f" --manager-arg={arg}" for arg in args.manager_arg)
    doc: dict[str, Any] = {"command": command,
           "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
           "machine": machine_info(), "standalone_progress_per_s": rates, "runs": runs, "failed": {},
           "work_dir": str(work)}
    args.out.mkdir(parents=True, exist_ok=True)
    for name in names:
        print(f"[bench_schedules] {name} ...", flush=True)
        try:
            run = run_schedule(name, args, work / name, rates, csv_path)
        except (RuntimeError, SystemExit, subprocess.TimeoutExpired, OSError) as exc:
            print(f"[bench_schedules] {name} failed: {exc}", flush=True)
            doc["failed"][name] = str(exc)
            continue
        run["hot_path_ns"] = hot_path_ns(name, args.microbatches, csv_path)
        runs.append(run)
        # After every schedule: a later failure or an interrupted bench keeps what was measured.
        results = json.dumps(doc, indent=2, default=lambda o: asdict(o)) + "\n"
        (args.out / f"{args.results_name}.json").write_text(results)
        write_markdown(doc, args.out / f"{args.results_name}.md")
    print((args.out / f"{args.results_name}.md").read_text() if runs else "no schedule ran")
    return 0 if not doc["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
