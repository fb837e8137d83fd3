"""A real 2-stage CPU run of the reference trainer (torchrun, gloo) against the bubble model.

The comparison is of counts and layout (which slots, of which kind, per iteration and stage), never
of timings: the machine is shared and noisy.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from freeride.training.learned_slots import LEARNED_SLOT_BASE
from freeride.training.rank_slots import RankPlan
from freeride.training.schedules import build_schedule

pytestmark = pytest.mark.slow

ITERATIONS = 5
MICROBATCHES = 4


def _run_trainer(tmp_path: Path, schedule: str, *extra: str) -> dict[int, list[dict[str, Any]]]:
    log = tmp_path / f"{schedule}.jsonl"
    cmd = [
        # --standalone: the rendezvous picks its own port; a test never picks one and binds it later.
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "freeride.workload", "--schedule", schedule, "--microbatches", str(MICROBATCHES),
        "--iterations", str(ITERATIONS), "--layers", "2", "--d-model", "32", "--seq-len", "16",
        "--vocab", "64", "--iteration-log", str(log), *extra,
    ]
    env = dict(os.environ, FREERIDE_LOG_LEVEL="WARNING", OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=90, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records: dict[int, list[dict[str, Any]]] = {}
    for rank in (0, 1):
        path = tmp_path / f"{schedule}.rank{rank}.jsonl"
        records[rank] = [json.loads(line) for line in path.read_text().splitlines()]
    return records


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_two_stage_cpu_run_reports_the_modelled_bubbles(tmp_path: Path, schedule: str) -> None:
    # Reporting on, no manager listening: training must run to the end regardless.
    absent = f"unix:{tmp_path}/absent-{{slug}}.sock"
    records = _run_trainer(tmp_path, schedule, "--report", "--endpoint-template", absent)
    model = build_schedule(schedule, 2, MICROBATCHES)
    for rank in (0, 1):
        iterations = [r for r in records[rank] if not r.get("summary")]
        summary = next(r for r in records[rank] if r.get("summary"))
        assert [r["iteration"] for r in iterations] == list(range(ITERATIONS))
        plan = RankPlan.from_orders(model.orders, rank)
        modelled = [(k, plan.kind(k)) for k in plan.positions]  # every wait the order implies
        assert summary["slots"] == [{"slot": i, "kind": k} for i, k in modelled]
        long = {(s.index, s.kind) for s in model.cyclic_slots(rank)}  # the waits the model finds long
        for record in iterations:
            # The long waits every iteration; the others where they were long enough to report; learned
            # slots (recurring waits the model does not list) may come on top, with ids of their own.
            got = [(b["slot"], b["kind"]) for b in record["bubbles"] if b["kind"] != "learned"]
            assert long <= set(got) and set(got) <= set(modelled), f"rank {rank} iteration {record['iteration']}"
            assert all(b["slot"] >= LEARNED_SLOT_BASE for b in record["bubbles"] if b["kind"] == "learned")
            for b in record["bubbles"]:
                assert b["length_ms"] >= 0 and b["predicted_ms"] > 0
                assert b["free_memory_bytes"] > 0  # CPU: host memory, sampled between iterations
        assert all(r["time_ms"] > 0 for r in iterations)
        # The reporter counted everything it could not deliver; nothing reached a manager.
        counters = summary["reporter"]
        # every bubble's start and end, and the layout, told once before the first (RankTracker)
        assert counters["enqueued"] == 2 * sum(len(r["bubbles"]) for r in iterations) + 1
        assert counters["sent"] + counters["dropped"] == counters["enqueued"]
    loss = [r["loss"] for r in records[1] if not r.get("summary")]
    assert all(x is not None and x > 0 for x in loss)
