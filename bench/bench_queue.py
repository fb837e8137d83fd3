"""The cluster queue on a real redis-server: claims per second, and the time to re-place a task after a node loss.

Two measurements, each on its own fresh ``redis-server`` (unix socket, append-only file fsynced on every
write, as in the tests):

* **Claims per second.** ``--tasks`` tasks are submitted, then ``C`` claimers (threads, each with its
  own connection: separate managers) take them all through the managers' own claim path -- peek at the
  head of the waiting room, rank with :func:`freeride._cluster.placement.ranked`, claim the first it
  can with the atomic script -- until none is left. Reported: tasks claimed per second of wall time,
  for each ``C``. This is the queue's own rate; a manager adds its poll (at most ``CLAIMS_PER_POLL`` claims per
  ``--queue-poll-ms``) and a worker process per task on top.
* **Re-placement after a node loss.** A manager daemon (``freeride manager --queue ...``) holds a
  1 ms-step counter that checkpoints every 50 ms, fed bubbles by a real ``BubbleReporter``; a second
  manager, also fed bubbles, waits. The first is killed with SIGKILL. Reported: kill -> the task is
  claimed by the second manager, and kill -> its first step there (from the worker's own step log,
  ``CLOCK_MONOTONIC`` on both sides), with the lease and poll used. The expected floor is the lease
  plus up to half a lease (the sweep period) plus a poll, plus a worker's start.

* **Poison records.** The claims measurement is run again with ``--poison`` malformed records (each kind
  the issue saw, in turn: missing fields, a memory field that is not a number, bytes that are not UTF-8
  in the spec, the name or a placement field) queued *ahead* of the tasks. Reported: claims per second
  with them, and that every task was claimed once and every malformed record set aside (never claimed,
  never a claim loop's failure).
* **A Redis restart under live holders.** ``--holders`` threads each hold ``--held`` tasks and renew their
  leases as a manager's agent does (every third of the lease; while Redis is down, a retry every quarter
  lease); another thread sweeps as the managers do. Redis is killed with SIGKILL, left down for two
  leases, and started again from its append-only file. Reported: tasks taken from a live holder within
  three leases of the restart (the issue saw 7 of 10; the contact clock's grace makes it 0), and the
  time from the restart to the first sweep that was allowed to expire anything.

Run: ``python -m bench.bench_queue [--tasks 500] [--claimers 1,4] [--poison 7] [--trials 3] [--lease-ms 1000]
[--out bench/results/cpu]``. Needs ``redis-server`` on the PATH.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.machine import machine_info
from freeride._cluster.placement import Capacity, ranked
from freeride._cluster.records import SET_ASIDE
from freeride._cluster.redis_queue import Held, RedisQueue
from freeride._cluster.url import parse_queue_url
from freeride._validation import Submission
from freeride._wire.client import ControlClient, health_status
from freeride.endpoints import Endpoint
from freeride.errors import FreerideError
from freeride.measure import median
from freeride.training.reporter import BubbleReporter

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from redis_server import RedisServer, remove, start_redis  # noqa: E402 - the tests' own server runner

MS = 1_000_000
MiB = 2**20
#: Room for anything: the claims bench measures the queue, not placement refusals.
OPEN = Capacity(budget_bytes=2**50, longest_bubble_ns=10**12, margin_ns=0, waiting=0)


def wait(predicate: Callable[[], object], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.002)


# ====================================================================== claims per second


#: Malformed records, one of each kind the issue saw, as changes to a good record's hash (set, delete).
POISON: list[tuple[dict[str, bytes], list[str]]] = [
    ({}, ["seq", "epoch"]),
    ({"memory_bytes": b"lots"}, []),
    ({"spec": b'{"target": "\xff"}'}, []),
    ({"name": b"caf\xe9"}, []),
    ({"step_hint_ms": b"\xff1.0"}, []),
    ({"priority": b"high"}, []),
    ({"schema": b"99"}, []),
]


def claims_per_second(binary: str, tasks: int, claimers: int, poison: int = 0) -> dict[str, Any]:
    server = start_redis(binary)
    try:
        url = parse_queue_url(server.url)
        q = RedisQueue(url)
        q.connect()
        sub = Submission(target="sample_tasks:Counter", args_json="{}", memory_bytes=MiB, name="bench")
        for i in range(poison):  # ahead of the tasks, at the head of the waiting room
            sets, deletes = POISON[i % len(POISON)]
            key = q.task_key(q.submit(sub))
            if sets:
                q._r.hset(key, mapping=sets)  # type: ignore[arg-type]
            if deletes:
                q._r.hdel(key, *deletes)
        t0 = time.perf_counter()
        for _ in range(tasks):
            q.submit(sub)
        submit_s = time.perf_counter() - t0
        claimed = [0] * claimers
        start = threading.Barrier(claimers + 1)

        def claimer(index: int) -> None:
            mine = RedisQueue(url)
            mine.connect()
            me = f"bench/cpu:{index}/claimer"
            start.wait()
            while True:
                peek = mine.waiting(64)
                for raw_id, why in peek.unreadable:  # as the agent does: set aside, never stop on it
                    mine.set_aside(raw_id, why, time.time())
                if not peek.candidates and not peek.unreadable:
                    break
                for choice in ranked(peek.candidates, OPEN):  # on a lost race, the next in line
                    claim = mine.claim(choice.task_id, me, me, time.time())
                    if claim.status == "unreadable" and claim.held is not None:
                        mine.set_aside(choice.task_id, claim.reason, time.time(), me, claim.held)
                    elif claim.status == "claimed":
                        claimed[index] += 1
                        break
            mine.close()

        threads = [threading.Thread(target=claimer, args=(i,)) for i in range(claimers)]
        for t in threads:
            t.start()
        start.wait()
        t0 = time.perf_counter()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - t0
        records = q.records()
        assert sum(claimed) == tasks == sum(1 for r in records if r.state == "CLAIMED"), "a task was lost or doubled"
        set_aside = sum(1 for r in records if r.state == SET_ASIDE)
        assert set_aside == poison, f"{set_aside} of {poison} malformed records set aside"
        q.close()
        return {"claimers": claimers, "tasks": tasks, "poison": poison, "set_aside": set_aside,
                "seconds": round(elapsed, 4), "claims_per_s": round(tasks / elapsed, 1),
                "submits_per_s": round(tasks / submit_s, 1), "per_claimer": claimed}
    finally:
        remove(server)


# ====================================================================== a Redis restart under live holders


def restart_trial(binary: str, holders: int, held_each: int, lease_ms: int) -> dict[str, Any]:
    server: RedisServer = start_redis(binary)
    url = parse_queue_url(server.url)
    stop = threading.Event()
    lost: list[str] = []
    first_swept: list[float] = []
    restarted_at = [0.0]
    try:
        q = RedisQueue(url, timeout_s=lease_ms / 2000)
        q.connect()
        sub = Submission(target="sample_tasks:Counter", args_json="{}", memory_bytes=MiB, name="bench")
        mine: list[list[Held]] = []
        for h in range(holders):
            mine.append([])
            for _ in range(held_each):
                task_id = q.submit(sub)
                claim = q.claim(task_id, f"holder{h}", f"n{h}/cpu:0", time.time())
                assert claim.held is not None
                mine[h].append(claim.held)

        def holder(h: int) -> None:  # renews as an agent does, retrying every quarter lease while Redis is down
            conn = RedisQueue(url, timeout_s=lease_ms / 2000)
            while not stop.is_set():
                try:
                    lost.extend(conn.heartbeat(f"holder{h}", mine[h], lease_ms).lost)
                    stop.wait(lease_ms / 3000)
                except FreerideError:
                    stop.wait(lease_ms / 4000)
            conn.close()

        def sweeper() -> None:
            conn = RedisQueue(url, timeout_s=lease_ms / 2000)
            while not stop.is_set():
                try:
                    sweep = conn.sweep("sweeper", lease_ms, max(1, lease_ms // 2), time.time())
                    if restarted_at[0] and sweep.status == "swept" and not first_swept:
                        first_swept.append(time.monotonic())
                except FreerideError:
                    pass
                stop.wait(0.05)
            conn.close()

        threads = [threading.Thread(target=holder, args=(h,)) for h in range(holders)]
        threads.append(threading.Thread(target=sweeper))
        for t in threads:
            t.start()
        time.sleep(2 * lease_ms / 1000)  # a bench, not a test: settle into renewing
        server.kill()
        time.sleep(2 * lease_ms / 1000)  # down for two leases: every pending entry's idle time is past the lease
        server.start()
        restarted_at[0] = time.monotonic()
        time.sleep(3 * lease_ms / 1000)
        stop.set()
        for t in threads:
            t.join(10)
        q.connect()
        owners = {r.task_id: r.owner for r in q.records()}
        taken = sum(1 for h in range(holders) for held in mine[h] if owners.get(held.task_id) != f"holder{h}")
        q.close()
        return {"holders": holders, "tasks": holders * held_each, "lease_ms": lease_ms,
                "taken_from_live_holders": taken, "holders_told_lost": len(lost),
                "restart_to_first_sweep_ms": round((first_swept[0] - restarted_at[0]) * 1000, 1)
                if first_swept else None}
    finally:
        stop.set()
        remove(server)


# ====================================================================== re-placement after a node loss


class Trainer:
    """A trainer stand-in: 30 ms bubbles with 5 ms gaps through a real BubbleReporter, on its own thread."""

    def __init__(self, device: str, endpoint: Endpoint, free_bytes: int) -> None:
        self.reporter = BubbleReporter(device, 0, 0, endpoint=endpoint, backoff_initial_s=0.02, backoff_max_s=0.2)
        self.free = free_bytes
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        it = 0
        while not self._stop.is_set():
            self.reporter.bubble_start(it, 0, "bench", 30 * MS, self.free)
            time.sleep(0.030)  # the bubble itself
            self.reporter.bubble_end(it, 0)
            time.sleep(0.005)
            it += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.reporter.close()


def start_manager(tmp: Path, name: str, device: str, url: str, lease_ms: int, poll_ms: float) -> tuple[
        subprocess.Popen[bytes], Endpoint]:
    sock = Path(f"/tmp/frq-{name}-{os.getpid()}.sock")
    endpoint = Endpoint("unix", str(sock))
    with open(tmp / f"{name}.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "freeride.cli", "manager", "--device", device, "--endpoint", f"unix:{sock}",
             "--state-dir", str(tmp / f"state-{name}"), "--queue", url, "--checkpoint-dir", str(tmp / "ckpt"),
             "--queue-lease-ms", str(lease_ms), "--queue-poll-ms", str(poll_ms), "--node", name],
            stdout=subprocess.DEVNULL, stderr=log, start_new_session=True,
        )

    def serving() -> bool:
        if proc.poll() is not None:
            raise RuntimeError((tmp / f"{name}.log").read_text())
        try:
            return health_status(endpoint, timeout_s=1) == "SERVING"
        except FreerideError:
            return False

    wait(serving, 30, f"manager {name}")
    return proc, endpoint


def replacement_trial(binary: str, lease_ms: int, poll_ms: float) -> dict[str, Any]:
    server: RedisServer = start_redis(binary)
    tmp = Path(tempfile.mkdtemp(prefix="frq-"))
    cores = sorted(os.sched_getaffinity(0))
    dev_a, dev_b = f"cpu:{cores[0]}", f"cpu:{cores[-1]}"
    procs: list[subprocess.Popen[bytes]] = []
    trainers: list[Trainer] = []
    try:
        url = parse_queue_url(server.url)
        q = RedisQueue(url)
        q.connect()
        doomed, ep_a = start_manager(tmp, "doomed", dev_a, server.url, lease_ms, poll_ms)
        procs.append(doomed)
        trainers.append(Trainer(dev_a, ep_a, 2048 * MiB))
        task_id = q.submit(Submission(target="sample_tasks:Counter", args_json='{"step_ms": 1.0}',
                                      memory_bytes=256 * MiB, name="survivor", working_dir=str(REPO / "tests"),
                                      checkpoint_interval_s=0.05))
        wait(lambda: (r := q.record(task_id)) is not None and r.device == f"doomed/{dev_a}"
             and r.checkpoint_step >= 30, 60, "the first manager to run and checkpoint the task")
        survivor, ep_b = start_manager(tmp, "survivor", dev_b, server.url, lease_ms, poll_ms)
        procs.append(survivor)
        trainers.append(Trainer(dev_b, ep_b, 2048 * MiB))
        with ControlClient(ep_b) as client:
            wait(lambda: client.stats().bubbles > 0, 30, "bubbles at the second manager")
        killed_ns = time.monotonic_ns()
        os.killpg(doomed.pid, signal.SIGKILL)
        doomed.wait()
        checkpoint = q.record(task_id).checkpoint_step  # type: ignore[union-attr]
        wait(lambda: (r := q.record(task_id)) is not None and r.device == f"survivor/{dev_b}", 120,
             "the second manager to claim the task")
        claimed_ns = time.monotonic_ns()
        steps_log = tmp / "state-survivor" / "tasks" / task_id / "work" / "steps.log"
        first = wait(lambda: steps_log.exists() and steps_log.read_text().split("\n", 1)[0].strip(), 60,
                     "the first step on the second manager")
        first_step_ns = int(first.split()[0])
        log = (tmp / "state-survivor" / "tasks" / task_id / "worker.log").read_text()
        match = re.search(r"resumed from ckpt-\d+\.pt at step (\d+)", log)
        q.close()
        return {
            "lease_ms": lease_ms,
            "poll_ms": poll_ms,
            "kill_to_claimed_ms": round((claimed_ns - killed_ns) / MS, 1),
            "kill_to_first_step_ms": round((first_step_ns - killed_ns) / MS, 1),
            "checkpoint_at_kill": checkpoint,
            "resumed_at_step": int(match.group(1)) if match else None,
        }
    finally:
        for trainer in trainers:
            trainer.stop()
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        for name in ("doomed", "survivor"):  # a killed manager leaves its socket behind
            Path(f"/tmp/frq-{name}-{os.getpid()}.sock").unlink(missing_ok=True)
        remove(server)
        shutil.rmtree(tmp, ignore_errors=True)


# ====================================================================== report


def render(results: dict[str, Any]) -> str:
    m = results["machine"]
    lines = [
        "# Cluster queue (Redis Streams): claims per second, re-placement after a node loss",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, Python {m['python']}, redis-server {results['redis_version']}, "
        f"redis-py {results['redis_py']}. Command: `{results['command']}`. Redis on a unix socket with "
        "`appendfsync always`. The machine was shared with other work while measuring (load average "
        f"{' '.join(results.get('loadavg', ['?']))} at the end): figures are indicative.",
        "",
        "## Claims per second",
        "",
        f"{results['claims'][0]['tasks']} tasks queued, then claimed by C claimers (threads with their own "
        "connections, the managers' claim path: peek 64, rank, atomic claim script, the next in line on a lost race).",
        "",
        "| claimers | claims/s | seconds | per claimer | submits/s (one client) |",
        "|---|---|---|---|---|",
    ]
    for c in results["claims"]:
        lines.append(f"| {c['claimers']} | {c['claims_per_s']} | {c['seconds']} | {c['per_claimer']} | "
                     f"{c['submits_per_s']} |")
    poisoned = results.get("poisoned", [])
    if poisoned:
        lines += [
            "",
            f"With {poisoned[0]['poison']} malformed records queued ahead of the tasks (each kind in turn: missing "
            "fields, memory not a number, bytes that are not UTF-8 in the spec, the name or a placement field, "
            "priority not a number, a newer schema):",
            "",
            "| claimers | claims/s | seconds | set aside | every task claimed once |",
            "|---|---|---|---|---|",
        ]
        for c in poisoned:
            lines.append(f"| {c['claimers']} | {c['claims_per_s']} | {c['seconds']} | {c['set_aside']} of "
                         f"{c['poison']} | yes |")
    restarts = results.get("restart", [])
    if restarts:
        first = restarts[0]
        lines += [
            "",
            "## A Redis restart under live holders",
            "",
            f"{first['holders']} holders with {first['tasks']} tasks between them, renewing every third of a "
            f"{first['lease_ms']} ms lease; Redis killed with SIGKILL, down for two leases, restarted from its "
            "append-only file; watched for three leases.",
            "",
            "| trial | taken from a live holder | holders told they lost a task | restart -> first sweep allowed "
            "to expire (ms) |",
            "|---|---|---|---|",
        ]
        for i, t in enumerate(restarts, 1):
            lines.append(f"| {i} | {t['taken_from_live_holders']} | {t['holders_told_lost']} | "
                         f"{t['restart_to_first_sweep_ms']} |")
    r = results["replacement"]
    lines += [
        "",
        "## Re-placement after a node loss (kill -9 of the holding manager)",
        "",
        f"Lease {r['trials'][0]['lease_ms']} ms, poll {r['trials'][0]['poll_ms']} ms; {len(r['trials'])} trials.",
        "",
        "| trial | kill -> claimed elsewhere (ms) | kill -> first step elsewhere (ms) | checkpoint at kill | "
        "resumed at step |",
        "|---|---|---|---|---|",
    ]
    for i, t in enumerate(r["trials"], 1):
        lines.append(f"| {i} | {t['kill_to_claimed_ms']} | {t['kill_to_first_step_ms']} | {t['checkpoint_at_kill']} | "
                     f"{t['resumed_at_step']} |")
    lines += [
        "",
        f"Median: claimed after {r['median_claimed_ms']} ms, first step after {r['median_first_step_ms']} ms. The "
        "floor is the lease (a holder is presumed dead only after it), plus up to half a lease (one manager "
        "sweeps expired leases per half lease), plus a poll of the claiming manager, plus a worker's start. "
        "The default lease is 10 s: a node loss then costs its tasks 10-15 s. \"Checkpoint at kill\" is the "
        "record's; a task resumes from the record's checkpoint or a newer file of the claim it replaces, which can "
        "be newer (the dead manager wrote it after its last record update; see \"Checkpoints, fenced by claim "
        "epoch\" in docs/architecture.md).",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=500)
    parser.add_argument("--claimers", default="1,4")
    parser.add_argument("--poison", type=int, default=7, help="malformed records ahead of the tasks (0: none)")
    parser.add_argument("--holders", type=int, default=3)
    parser.add_argument("--held", type=int, default=4, help="tasks each holder holds across the restart")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--lease-ms", type=int, default=1000)
    parser.add_argument("--poll-ms", type=float, default=100.0)
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "cpu"))
    args = parser.parse_args(argv)
    binary = shutil.which("redis-server")
    if binary is None:
        print("bench_queue: redis-server is not installed (scripts/setup.sh installs it as root)", file=sys.stderr)
        return 2
    import redis

    version = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout.split()
    claims = [claims_per_second(binary, args.tasks, int(c)) for c in args.claimers.split(",")]
    for c in claims:
        print(f"claims: {c}", flush=True)
    poisoned = [claims_per_second(binary, args.tasks, int(c), args.poison) for c in args.claimers.split(",")
                if args.poison > 0]
    for c in poisoned:
        print(f"claims with poison records: {c}", flush=True)
    restarts = []
    for _ in range(args.trials):
        restart = restart_trial(binary, args.holders, args.held, args.lease_ms)
        print(f"restart: {restart}", flush=True)
        restarts.append(restart)
    trials = []
    for _ in range(args.trials):
        trial = replacement_trial(binary, args.lease_ms, args.poll_ms)
        print(f"re-placement: {trial}", flush=True)
        trials.append(trial)
    results = {
        "machine": machine_info(),
        "command": " ".join(["python -m bench.bench_queue", *(argv if argv is not None else sys.argv[1:])]),
        "redis_version": next((w.split("=", 1)[1] for w in version if w.startswith("v=")), "?"),
        "redis_py": redis.__version__,
        "claims": claims,
        "poisoned": poisoned,
        "restart": restarts,
        "loadavg": Path("/proc/loadavg").read_text().split()[:3],
        "replacement": {
            "trials": trials,
            "median_claimed_ms": round(median(t["kill_to_claimed_ms"] for t in trials), 1),
            "median_first_step_ms": round(median(t["kill_to_first_step_ms"] for t in trials), 1),
        },
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "queue.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "queue.md").write_text(render(results))
    print(render(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
