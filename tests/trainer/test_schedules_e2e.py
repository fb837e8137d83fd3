"""Every multi-stage schedule torch offers, end to end: two ranks under ``torchrun --standalone``, two
model stages each, model stage 1 made slower by a known amount, the reference trainer instrumented.

For each schedule, one short run checks that

* every reported bubble is one of the rank's wait positions, read off the schedule's own order, and
  lies where torch waits: from the end of the action before it (or its loss) to the start of the
  action after it, which ends it;
* the slow stage's neighbour reports the waits it causes;
* training is what it is without freeride: the losses match a plain sequential run of the same model
  on the same batches (one process, no pipeline, no instrumentation).

Lengths and coverage are measured by ``bench/bench_schedules.py``, not asserted here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from freeride.training.schedules import build_schedule

pytestmark = pytest.mark.e2e

MICROBATCHES, ITERATIONS = 4, 4
MODEL = {"vocab": 64, "d_model": 32, "heads": 4, "layers": 4, "seq_len": 16, "microbatch_size": 2, "lr": 1e-3}
SLOW_MS = 2.0


def _run(tmp_path: Path, schedule: str) -> dict[int, list[dict[str, Any]]]:
    log = tmp_path / "it.jsonl"
    extra: list[str] = []
    if schedule == "csv":  # Megatron's interleaved order, which is not torch's
        order = build_schedule("interleaved-1f1b", 2, MICROBATCHES, virtual=2).orders
        csv = tmp_path / "order.csv"
        csv.write_text("\n".join(",".join(str(a) for a in order[r]) for r in (0, 1)) + "\n")
        extra = ["--schedule-csv", str(csv)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "freeride.workload", "--schedule", schedule, "--virtual-stages", "2",
           "--microbatches", str(MICROBATCHES), "--iterations", str(ITERATIONS), "--warmup", "1", "--measure",
           "--slow-stage", "1", "--slow-ms", str(SLOW_MS), "--iteration-log", str(log), *extra]
    cmd += [arg for k, v in MODEL.items() for arg in (f"--{k.replace('_', '-')}", str(v))]
    env = dict(os.environ, FREERIDE_LOG_LEVEL="WARNING", OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {rank: [json.loads(line) for line in (tmp_path / f"it.rank{rank}.jsonl").read_text().splitlines()]
            for rank in (0, 1)}


def _sequential_losses() -> list[float]:
    """The same model, batches and optimizer in one process: the losses a correct pipeline must give."""
    import torch

    from freeride.workload.model import GPTConfig, build_chunk, lm_loss, synthetic_batch

    torch.set_num_threads(1)
    cfg = GPTConfig(MODEL["vocab"], MODEL["d_model"], MODEL["heads"], MODEL["layers"], MODEL["seq_len"], 0)
    chunks = [build_chunk(cfg, c, 4) for c in range(4)]
    optimizer = torch.optim.AdamW([p for c in chunks for p in c.parameters()], lr=MODEL["lr"])
    losses = []
    for it in range(ITERATIONS):
        x, y = synthetic_batch(cfg, MICROBATCHES * MODEL["microbatch_size"], it)
        optimizer.zero_grad(set_to_none=True)
        per_mb = []
        for xm, ym in zip(x.split(MODEL["microbatch_size"]), y.split(MODEL["microbatch_size"]), strict=True):
            out = xm
            for chunk in chunks:
                out = chunk(out)
            per_mb.append(lm_loss(out, ym))
        (torch.stack(per_mb).sum() / MICROBATCHES).backward()  # torch's schedules scale by 1/microbatches
        optimizer.step()
        losses.append(float(torch.stack([x.detach() for x in per_mb]).mean()))
    return losses


@pytest.fixture(scope="module")
def sequential_losses() -> list[float]:
    return _sequential_losses()


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "interleaved-zb", "zbv", "dualpipev", "csv"])
def test_a_multi_stage_schedule_reports_its_waits_where_torch_waits_and_trains_as_without_freeride(
        tmp_path: Path, schedule: str, sequential_losses: list[float]) -> None:
    records = _run(tmp_path, schedule)
    losses: list[float] = []
    for rank in (0, 1):
        iterations = [r for r in records[rank] if not r.get("summary")]
        summary = next(r for r in records[rank] if r.get("summary"))
        positions = {s["slot"] for s in summary["slots"]}
        assert [r["iteration"] for r in iterations] == list(range(ITERATIONS))
        assert summary["learned_slots"] == [] and summary["unplanned_waits"] == 0
        for record in iterations:
            t0 = record["end_ns"] - record["time_ms"] * 1e6
            actions = [(t0 + a[3] * 1e6, t0 + (a[3] + a[4]) * 1e6) for a in record["actions"]]
            for b in record["bubbles"]:
                k, start, end = b["slot"], b["start_ns"], b["start_ns"] + b["length_ms"] * 1e6
                assert k in positions, (rank, k)
                if k > 0:  # from the end of the action before it...
                    assert start >= actions[k - 1][1] - 1e3, (rank, k)
                if k < len(actions):  # ...to the start of the action after it, less the rank's wait for its core
                    assert b["core_wait_ms"] >= 0
                    assert end + b["core_wait_ms"] * 1e6 == pytest.approx(actions[k][0], abs=2e3), (rank, k)
        losses += [r["loss"] for r in iterations if r["loss"] is not None]
        if rank == 0:  # it waits for rank 1, whose model stage 1 is slowed
            assert any(r["bubbles"] for r in iterations), "rank 0 reported no bubble"
    assert losses == pytest.approx(sequential_losses, rel=1e-4)


def test_the_documented_torch_pipelining_snippet_runs(tmp_path: Path) -> None:
    """docs/bubbles.md's snippet, as a user would copy it (no manager: the reporter drops its events)."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "bubbles.md").read_text()
    block = doc.split("```python\n# pp_demo.py")[1].split("```")[0]
    script = tmp_path / "pp_demo.py"
    script.write_text("# pp_demo.py" + block)
    env = dict(os.environ, FREERIDE_LOG_LEVEL="WARNING", OMP_NUM_THREADS="1", XDG_RUNTIME_DIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script)], capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
