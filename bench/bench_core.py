"""The scheduler core's cost per event, this tree's core against an older one, in one run.

The core sits on the latency-critical path (a bubble's start reaches a worker as a grant only after
``SchedulerCore.on_event`` returns), so a redesign must not make it slower. This bench records one
event sequence by running a simulated device in closed loop against the *baseline* core (workers that
step until their deadline or the bubble's end, overrun now and then and get frozen, finish, fail; tasks
queued behind a memory budget that moves; with ``--chaos``, also out-of-order bubbles, cancels,
drains, layout changes and events for unknown tasks), then replays that sequence into fresh
instances of both cores, trials interleaved, and reports nanoseconds per event (all events, and by
event type). Before timing it checks that both cores returned the same actions for every event
(apart from :class:`Note` actions, which are log lines): a replay is only a fair comparison
of two cores that decide alike, and the check doubles as a differential test of the redesign.

The baseline core is read from git (``--baseline REV``, default ``HEAD``: this tree's core against the one
committed, a change's cost before it lands): the package ``freeride/_manager/core/``, or at a revision
before the redesign the single module ``freeride/_manager/core.py`` (the committed ``core.md`` compares the
redesign with it; the policy has changed since, so that comparison no longer replays on this tree).

Run: ``python -m bench.bench_core [--bubbles 4000] [--trials 7] [--seeds 1,2,3] [--chaos]
[--baseline REV] [--out bench/results/cpu]``.
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import heapq
import importlib.util
import itertools
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from bench.machine import machine_info
from freeride._manager import core as C
from freeride.messages import BubbleEnd, BubbleStart, FailureRecord, TaskSpec, TrainerLayout

REPO = Path(__file__).resolve().parents[1]
OLD_PATH = "freeride/_manager/core.py"
NEW_PATH = "freeride/_manager/core"
MS = 1_000_000
MiB = 2**20
T0 = 1_000_000 * MS


# ====================================================================== the baseline core


def baseline_rev() -> str:
    """The last commit: this tree's core against the one committed (a change's cost, before it lands)."""
    return "HEAD"


def _git_show(rev: str, path: str) -> str:
    return subprocess.run(["git", "show", f"{rev}:{path}"], cwd=REPO, check=True, capture_output=True,
                          text=True).stdout


def _load_source(name: str, source: str, folder: Path) -> ModuleType:
    path = folder / f"{name.replace('.', '_')}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def load_baseline(rev: str) -> ModuleType:
    """The core of ``rev``, as the module ``baseline_core``: the package ``freeride/_manager/core/`` (its modules'
    imports of one another renamed), or before the redesign the single module ``core.py``. A freeride module
    the single module imports that this tree no longer has (its step estimator moved out of
    ``freeride._manager``) is loaded from ``rev`` too, under its old name. Everything else (messages, states)
    is this tree's: a baseline far older than it may not run, and :func:`check_same` says where two cores
    decide differently."""
    folder = Path(tempfile.mkdtemp(prefix="freeride-core-baseline-"))
    # Its modules are imported by the end of this call, but a traceback reads their source: gone at exit, not
    # before (each test run left one of these in /tmp: a stranger counted 98).
    atexit.register(shutil.rmtree, folder, True)
    listed = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}:{NEW_PATH}"], cwd=REPO, capture_output=True,
                            text=True)
    if listed.returncode == 0:
        package = folder / "baseline_core"
        package.mkdir()
        for name in listed.stdout.split():
            if name.endswith(".py"):
                source = _git_show(rev, f"{NEW_PATH}/{name}")
                (package / name).write_text(re.sub(r"\bfreeride\._manager\.core\b", "baseline_core", source))
        sys.path.insert(0, str(folder))
        try:
            return importlib.import_module("baseline_core")
        finally:
            sys.path.remove(str(folder))
    source = _git_show(rev, OLD_PATH)
    for name in re.findall(r"^from (freeride[\w.]*) import", source, re.MULTILINE):
        if name not in sys.modules and importlib.util.find_spec(name) is None:
            _load_source(name, _git_show(rev, name.replace(".", "/") + ".py"), folder)
    return _load_source("baseline_core", source, folder)


# ====================================================================== a simulated device


@dataclasses.dataclass
class _Worker:
    step_ns: int
    grant_id: int = 0
    steps: int = 0
    total: int = 0
    frozen_left_ns: int = 0  # what is left of the step a freeze interrupted
    plan: tuple[int, ...] = ()  # step end times of the current grant
    begun_ns: int = 0
    deadline_ns: int = 0


class Device:
    """A trainer's bubbles and the workers of one device, run against a core in closed loop.

    Every event goes through :meth:`feed`, which passes it to the core at its time and turns the
    actions back into future events (a grant into steps and a park, a spawn into a ready, a stop into
    an exit). ``record`` keeps ``(event, now_ns)`` for the replay.
    """

    def __init__(self, core_module: ModuleType, seed: int, chaos: bool, policy: str = "freeride") -> None:
        self.M = core_module
        self.rng = random.Random(seed)
        self.chaos = chaos
        self.core = core_module.SchedulerCore(core_module.CoreConfig(headroom_bytes=0, policy=policy))
        self.now = T0
        self.queue: list[tuple[int, int, Callable[[], Any]]] = []
        self.counter = itertools.count()
        self.workers: dict[str, _Worker] = {}
        self.record: list[tuple[Any, int]] = []
        self.iteration = 0
        self.open: BubbleStart | None = None
        self.end_ns = 0
        self.tasks = 0

    # -- plumbing

    def at(self, when_ns: int, fn: Callable[[], Any]) -> None:
        heapq.heappush(self.queue, (max(when_ns, self.now), next(self.counter), fn))

    def feed(self, event: Any) -> None:
        self.record.append((event, self.now))
        for action in self.core.on_event(event, self.now):
            self.act(action)

    def run_until(self, until_ns: int) -> None:
        while self.queue and self.queue[0][0] <= until_ns:
            when, _, fn = heapq.heappop(self.queue)
            self.now = max(self.now, when)
            fn()
        self.now = max(self.now, until_ns)
        timer = self.core.next_timer_ns()
        if timer is not None and timer <= self.now:
            self.feed(self.M.Tick())

    # -- the workers

    def act(self, action: Any) -> None:
        name = type(action).__name__
        tid = getattr(action, "task_id", "")
        if name == "Spawn":
            self.workers[tid] = _Worker(step_ns=self.rng.choice([1, 2, 3, 5, 8, 30]) * MS // 2)
            host = self.rng.choice([0, 0, 300 * MiB]) if self.chaos else 0  # a GPU worker's host baseline
            self.at(self.now + self.rng.randint(1, 20) * MS,
                    lambda: self.feed(self.M.WorkerReady(tid, 4000, host_baseline_bytes=host)))
        elif name == "Grant":
            self.grant(action)
        elif name == "Park":
            self.park_asked(tid, action.grant_id)
        elif name == "Freeze":
            self.freeze(tid)
        elif name == "Stop":
            self.workers.pop(tid, None)
            if action.checkpoint:
                self.at(self.now + MS, lambda: self.feed(self.M.WorkerCheckpointed(tid, 1, f"/ck/{tid}", 0.5)))
            self.at(self.now + 2 * MS, lambda: self.feed(self.M.WorkerExited(tid, 0, 0)))
        elif name == "Kill":
            self.workers.pop(tid, None)
            self.at(self.now + MS, lambda: self.feed(self.M.WorkerExited(tid, None, 9)))

    def grant(self, g: Any) -> None:
        w = self.workers.get(g.task_id)
        if w is None:
            return
        w.grant_id, w.steps, w.begun_ns, w.deadline_ns = g.grant_id, 0, self.now, g.deadline_ns
        t, plan = self.now, []
        if w.frozen_left_ns:
            t += w.frozen_left_ns
            plan.append(t)
            w.frozen_left_ns = 0
        long_step = self.rng.random() < 0.03  # now and then a step far longer than its estimate
        while True:
            step = w.step_ns * (20 if long_step and not plan else 1) + self.rng.randint(0, w.step_ns // 4)
            if plan and t + w.step_ns + g.margin_ns > g.deadline_ns:
                break
            if g.trainer_ends and self.end_ns and t >= self.end_ns:
                break
            t += step
            plan.append(t)
            if not g.probe and t + w.step_ns + g.margin_ns > g.deadline_ns:
                break
        w.plan = tuple(plan)
        grant_id = g.grant_id
        self.at(t, lambda: self.parked(g.task_id, grant_id, "deadline", len(plan)))

    def park_asked(self, tid: str, grant_id: int) -> None:
        w = self.workers.get(tid)
        if w is None or w.grant_id != grant_id or not w.plan:
            return
        done = [t for t in w.plan if t <= self.now]
        current = next((t for t in w.plan if t > self.now), self.now)
        w.plan = tuple(done) + ((current,) if current > self.now else ())
        self.at(current, lambda: self.parked(tid, grant_id, "park", len(w.plan)))

    def parked(self, tid: str, grant_id: int, reason: str, steps: int) -> None:
        w = self.workers.get(tid)
        if w is None or w.grant_id != grant_id or not w.plan:
            return
        plan = w.plan[:steps]
        durations = tuple(b - a for a, b in zip((w.begun_ns, *plan[:-1]), plan, strict=True))
        w.plan = ()
        w.total += len(durations)
        if self.rng.random() < 0.01:
            failure = FailureRecord(kind="EXCEPTION", message="boom", step=w.total)
            self.feed(self.M.WorkerFailed(tid, failure, durations, 0.5, w.total))
            self.workers.pop(tid, None)
            self.at(self.now + MS, lambda: self.feed(self.M.WorkerExited(tid, 1, 0)))
            return
        if w.total > 400 and self.rng.random() < 0.02:
            self.feed(self.M.WorkerFinished(tid, w.total, 1.0))
            self.workers.pop(tid, None)
            self.at(self.now + MS, lambda: self.feed(self.M.WorkerExited(tid, 0, 0)))
            return
        self.feed(self.M.WorkerParked(
            tid, grant_id, len(durations), durations, w.begun_ns + 1000 if durations else 0,
            plan[-1] if plan else self.now, self.now, reason, w.total / 1000, w.total,
        ))

    def freeze(self, tid: str) -> None:
        w = self.workers.get(tid)
        if w is None:
            return
        current = next((t for t in w.plan if t > self.now), 0)
        w.frozen_left_ns = max(1000, current - self.now) if current else 0
        done = w.total + sum(1 for t in w.plan if t <= self.now)
        w.plan = ()
        self.at(self.now + MS, lambda: self.feed(self.M.WorkerStepsSeen(tid, done, done == 0)))

    # -- the trainer and the user

    def add_task(self, priority: int | None = None) -> None:
        self.tasks += 1
        spec = TaskSpec(target="m:C", name=f"t{self.tasks}", memory_bytes=self.rng.choice([100, 200, 400, 3000]) * MiB,
                        priority=self.rng.randint(0, 2) if priority is None else priority,
                        step_time_hint_ms=self.rng.choice([0.0, 0.0, 2.0]))
        self.feed(self.M.TaskAdded(f"t{self.tasks}", spec, self.tasks, from_queue=self.rng.random() < 0.2))

    def bubble(self) -> None:
        self.iteration += 1
        predicted = self.rng.choice([3, 5, 8, 12, 20, 40]) * MS
        real = max(MS // 2, int(predicted * self.rng.uniform(0.85, 1.1)))
        free = self.rng.choice([-1, 2000, 2000, 2000, 1500, 1200]) * MiB if self.rng.random() < 0.5 else -1
        start = BubbleStart(0, 0, self.iteration, self.iteration % 4, "fwd", self.now, predicted, free)
        self.open, self.end_ns = start, 0
        self.feed(self.M.BubbleStarted(start, self.now))
        end_at = self.now + real

        def end() -> None:
            self.end_ns = end_at
            self.feed(self.M.BubbleEnded(BubbleEnd(0, 0, start.iteration, start.slot, end_at), self.now))

        self.at(end_at + self.rng.choice([0, 0, 50_000, 200_000]), end)

    def chaos_event(self) -> None:
        ids = list(self.core.tasks)
        roll = self.rng.random()
        if roll < 0.15 and self.open is not None:
            self.feed(self.M.BubbleStarted(self.open, self.now))  # a duplicate start
        elif roll < 0.3:
            self.feed(self.M.BubbleEnded(BubbleEnd(0, 0, 10**9, 0, self.now), self.now))  # an end without start
        elif roll < 0.4 and ids:
            self.feed(self.M.CancelRequested(self.rng.choice(ids)))
        elif roll < 0.5 and ids:
            self.feed(self.M.ReleaseRequested(self.rng.choice(ids), "lost", self.rng.random() < 0.5))
        elif roll < 0.6:
            self.feed(self.M.WorkerParked("ghost", 1, 0, (), 0, self.now, self.now, "park", 0.0, 0))
        elif roll < 0.7:
            layout = TrainerLayout("1f1b", 4, self.rng.choice([4, 8]), ("cpu:0",) * 4, self.now,
                                   self.rng.choice([-1, 2000 * MiB]))
            self.feed(self.M.LayoutChanged(layout, self.now, self.rng.random() < 0.8))
        elif roll < 0.8:
            self.feed(self.M.DeviceStatusChanged(self.rng.choice(["", "", "NVML: GPU is lost"])))
        elif roll < 0.9 and ids:
            self.feed(self.M.TaskMemorySampled(self.rng.choice(ids), self.rng.choice([10, 150, 5000]) * MiB,
                                               self.rng.choice([-1, 350, 800]) * MiB))
        else:
            self.add_task()

    def run(self, bubbles: int) -> list[tuple[Any, int]]:
        self.feed(self.M.DeviceMemorySampled(2000 * MiB))
        for _ in range(30):
            self.add_task()
        for k in range(bubbles):
            self.bubble()
            self.run_until(self.now + 45 * MS)
            if self.rng.random() < 0.1:
                self.feed(self.M.DeviceMemorySampled(self.rng.choice([2000, 2000, 900, 3000]) * MiB))
            if self.rng.random() < 0.02:
                self.add_task()
            if self.chaos and self.rng.random() < 0.1:
                self.chaos_event()
            if self.chaos and k == bubbles - 50:
                self.feed(self.M.DrainRequested())
            self.run_until(self.now + self.rng.choice([1, 5, 15]) * MS)
        self.run_until(self.now + 30_000 * MS)
        return self.record


# ====================================================================== replay


def translate(events: list[tuple[Any, int]], module: ModuleType) -> list[tuple[Any, int]]:
    """The same events as instances of ``module``'s classes (the two cores define their own). A field that
    ``module``'s class no longer has (the worker's own memory figure left the park report for a ``WorkerUsage``
    of its own) must hold its default: the recording never sets it."""
    out = []
    for event, now in events:
        cls = getattr(module, type(event).__name__)
        known = {f.name for f in dataclasses.fields(cls)}
        fields = {}
        for f in dataclasses.fields(event):
            value = getattr(event, f.name)
            if f.name in known:
                fields[f.name] = value
            elif value != f.default:
                raise ValueError(f"{type(event).__name__}.{f.name}={value!r}: no such field in {module.__name__}")
        out.append((cls(**fields), now))
    return out


def _plain(action: Any, like: ModuleType | None = None) -> tuple[str, tuple[Any, ...]]:
    """An action as (class name, field values). ``like``: only the fields that module's class of that name has, as
    :func:`translate` (a field a newer core added must hold its default, which the older core means by
    leaving it out)."""
    name = type(action).__name__
    if like is None:
        return name, dataclasses.astuple(action)
    known = {f.name for f in dataclasses.fields(getattr(like, name))}
    values = []
    for f, plain in zip(dataclasses.fields(action), dataclasses.astuple(action), strict=True):
        if f.name in known:
            values.append(plain)
        elif getattr(action, f.name) != f.default:
            values.append((f.name, plain))  # differs from the baseline's action, which has no such field
    return name, tuple(values)


def check_same(events: list[tuple[Any, int]], old: ModuleType, policy: str) -> int:
    """Replay into both cores; raise on the first event whose actions differ. Returns the events checked."""
    old_core = old.SchedulerCore(old.CoreConfig(headroom_bytes=0, policy=policy))
    new_core = C.SchedulerCore(C.CoreConfig(headroom_bytes=0, policy=policy))
    for k, ((old_event, now), (new_event, _)) in enumerate(zip(translate(events, old), translate(events, C),
                                                               strict=True)):
        before = [_plain(a) for a in old_core.on_event(old_event, now) if type(a).__name__ != "Note"]
        after = [_plain(a, old) for a in new_core.on_event(new_event, now) if not isinstance(a, C.Note)]
        if before != after:
            raise AssertionError(f"event {k} ({new_event!r}) at {now}: baseline {before} != new {after}")
        if old_core.next_timer_ns() != new_core.next_timer_ns():
            raise AssertionError(f"event {k}: next timer {old_core.next_timer_ns()} != {new_core.next_timer_ns()}")
    for tid, task in old_core.tasks.items():
        assert new_core.tasks[tid].state == task.state, tid
    return len(events)


def time_replay(events: list[tuple[Any, int]], module: ModuleType, policy: str) -> dict[str, float]:
    """ns per event over the sequence (one fresh core each): ``all`` in this thread's CPU time over the whole
    replay (a loaded machine's preemptions do not count), and by event type in wall time around each call."""
    core = module.SchedulerCore(module.CoreConfig(headroom_bytes=0, policy=policy))
    on_event = core.on_event
    t0 = time.thread_time_ns()
    for event, now in events:
        on_event(event, now)
    cpu = time.thread_time_ns() - t0
    core = module.SchedulerCore(module.CoreConfig(headroom_bytes=0, policy=policy))
    on_event = core.on_event
    clock = time.perf_counter_ns
    by_type: dict[str, list[int]] = defaultdict(list)
    for event, now in events:
        t0 = clock()
        on_event(event, now)
        by_type[type(event).__name__].append(clock() - t0)
    return {"all": cpu / len(events), **{k: sum(v) / len(v) for k, v in by_type.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bubbles", type=int, default=4000)
    parser.add_argument("--trials", type=int, default=7)
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--chaos", action="store_true", help="add out-of-order and unusual events")
    parser.add_argument("--policy", choices=C.POLICIES, default="freeride")
    parser.add_argument("--baseline", default=None, help="git revision of the baseline core")
    parser.add_argument("--check-only", action="store_true", help="only check that both cores decide alike")
    parser.add_argument("--out", default=None, help="write core.json and core.md here")
    args = parser.parse_args(argv)

    rev = args.baseline or baseline_rev()
    old = load_baseline(rev)
    seeds = [int(s) for s in args.seeds.split(",")]
    sequences = {seed: Device(old, seed, args.chaos, args.policy).run(args.bubbles) for seed in seeds}
    for seed, events in sequences.items():
        print(f"seed {seed}: {check_same(events, old, args.policy)} events, same actions from both cores")
    if args.check_only:
        return 0

    loadavg_before = os.getloadavg()
    results: dict[str, dict[str, list[float]]] = {"baseline": defaultdict(list), "new": defaultdict(list)}
    translated = {seed: (translate(ev, old), translate(ev, C)) for seed, ev in sequences.items()}
    for _ in range(args.trials):
        for seed in seeds:
            old_events, new_events = translated[seed]
            for name, module, events in (("baseline", old, old_events), ("new", C, new_events)):
                for kind, ns in time_replay(events, module, args.policy).items():
                    results[name][kind].append(ns)
    loadavg_after = os.getloadavg()

    kinds = sorted(results["new"], key=lambda k: (k != "all", k))
    rows = []
    for kind in kinds:
        row: dict[str, Any] = {"event": "all (CPU time)" if kind == "all" else kind}
        for stat, fn in (("median", statistics.median), ("min", min)):
            base, new = fn(results["baseline"][kind]), fn(results["new"][kind])
            row |= {f"baseline_{stat}_ns": round(base), f"new_{stat}_ns": round(new),
                    f"change_{stat}_pct": round((new / base - 1) * 100, 1)}
        rows.append(row)
    count = sum(len(e) for e in sequences.values())
    lines = [
        f"Scheduler core, ns per `on_event` ({args.trials} trials x {len(seeds)} sequences, baseline and new "
        f"interleaved, {count} events in all, policy {args.policy}{', chaos' if args.chaos else ''}); "
        f"baseline {rev}",
        f"load average before {loadavg_before[0]:.2f}, after {loadavg_after[0]:.2f}",
        "",
        "| event | baseline median | new median | change | baseline min | new min | change |",
        "|---|---:|---:|---:|---:|---:|---:|",
        *(f"| {r['event']} | {r['baseline_median_ns']} | {r['new_median_ns']} | {r['change_median_pct']:+.1f}% "
          f"| {r['baseline_min_ns']} | {r['new_min_ns']} | {r['change_min_pct']:+.1f}% |" for r in rows),
    ]
    print("\n".join(lines))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        suffix = f"_{args.policy}" if args.policy != "freeride" else ""
        suffix += "_chaos" if args.chaos else ""
        (out / f"core{suffix}.json").write_text(json.dumps({
            "baseline": rev, "policy": args.policy, "chaos": args.chaos, "trials": args.trials, "seeds": seeds,
            "events": count, "loadavg_before": loadavg_before, "loadavg_after": loadavg_after, "rows": rows,
            "machine": machine_info(),
        }, indent=2) + "\n")
        (out / f"core{suffix}.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
