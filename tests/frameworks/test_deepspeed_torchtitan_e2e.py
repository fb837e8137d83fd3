"""End to end: DeepSpeed and torchtitan pipelines in two CPU ranks, instrumented by their adapters.

Each test runs one short job under ``torchrun --standalone`` (two ranks, gloo, one core each), with
model stage 1 made slower by a known amount (it spins 8 ms more in every forward), a
manager on each rank's core, and a side task on stage 0's core, where the waits are. The job runs the
documented snippet exactly as written (``docs/bubbles.md``). Checked, with no timing threshold: the
managers' traces hold bubbles exactly where the framework waits (DeepSpeed: within the runs of its
waiting instructions, as the job's own probes timed them, never over a compute instruction, and
covering every wait for the slowed stage); ``freeride bubbles`` lists them; the side task harvested;
the losses and final weights equal those of an uninstrumented twin; evaluation reports nothing; and
the engine or trainer is restored.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from framework_support import RankLog, docs_snippet, managed_ranks, require_framework, traced_bubbles

from freeride._cli import bubbles as bubbles_cli
from freeride._wire.client import ControlClient

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ITERATIONS = 12
SLOW_MS = 8.0
WAITING = {"SendActivation", "RecvActivation", "SendGrad", "RecvGrad", "LossBroadcast"}
COMPUTE = {"ForwardPass", "BackwardPass", "LoadMicroBatch"}


def _bubbles_cli(endpoint: Any, capsys: pytest.CaptureFixture[str]) -> list[dict[str, Any]]:
    """``freeride bubbles --endpoint ... --json``: the manager's rows, one per (stage, slot)."""
    parser = argparse.ArgumentParser()
    bubbles_cli.register(parser.add_subparsers())
    args = parser.parse_args(["bubbles", "--endpoint", f"unix:{endpoint.address}", "--json"])
    capsys.readouterr()
    assert args.func(args) == 0
    doc = json.loads(capsys.readouterr().out)
    return [row for rows in doc["devices"].values() for row in rows]


@dataclass
class Run:
    logs: list[RankLog]  # per rank: iteration records, summary
    cli_rows: list[list[dict[str, Any]]]  # per rank: what ``freeride bubbles`` listed
    traced: list[list[dict[str, Any]]]  # per rank: the bubbles in its manager's trace
    side_task_steps: int
    harvested_s: float


def _run(tmp_path: Path, capsys: pytest.CaptureFixture[str], framework: str, module: str, *args: str) -> Run:
    """The framework's snippet, as documented, in a two-rank job beside the managers and a side task
    on stage 0's core; what the job logged, the CLI listed, the traces hold, the side task did."""
    require_framework(framework)
    snippet = tmp_path / "snippet.py"
    snippet.write_text(docs_snippet(framework))
    with managed_ranks(tmp_path) as ranks:
        task = ranks.submit(0, "sample_tasks:Counter", step_ms=1.0, log_steps=False)
        logs = ranks.run_job(module, *args, "--snippet", str(snippet), "--twin", "--iterations", str(ITERATIONS),
                             "--slow-stage", "1", "--slow-ms", str(SLOW_MS))
        rows = [_bubbles_cli(ranks.endpoint(r), capsys) for r in (0, 1)]
        with ControlClient(ranks.endpoint(0)) as client:
            steps, harvested_s = client.get(task.task_id).steps, client.stats().harvested_s
        ranks.stop()  # the traces are complete once the managers stopped
        traced = [traced_bubbles(ranks.traces[r]) for r in (0, 1)]
    return Run(logs, rows, traced, steps, harvested_s)


def _overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


@pytest.mark.timeout(420)
def test_deepspeed_pipeline_reports_its_waits_and_a_side_task_harvests_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _run(tmp_path, capsys, "deepspeed", "freeride.workload.deepspeed_job")
    results, rows, traced = run.logs, run.cli_rows, run.traced
    for iterations, summary in results:
        assert summary["instrumented"] and summary["engine"] == "PipelineEngine"
        # Training is untouched: the same losses and weights as a bare twin on the same batches.
        assert summary["losses"] == summary["twin_losses"] == [it["loss"] for it in iterations]
        assert summary["weights_equal"]
        assert summary["eval_marked_nothing"]
        assert summary["restored"]
        # What the engine holds beyond the bare twin: the job's own probes, nothing of freeride's.
        assert summary["extra_attributes"] == sorted(
            {"_INSTRUCTION_MAP", "train_batch", "_aggregate_total_loss", "clip_fp32_gradients"})
        assert summary["reporter"]["sent"] > 0

    for rank in (0, 1):
        bubbles = traced[rank]
        assert bubbles and {b["rank"] for b in bubbles} == {rank}
        iterations = results[rank][0]
        spans = [(e[1], e[2]) for it in iterations for e in it["probe"] if e[0] in COMPUTE]
        waits = [(e[1], e[2]) for it in iterations for e in it["probe"] if e[0] in WAITING]
        clips = [(e[1], e[2]) for it in iterations for e in it["probe"] if e[0] == "ClipGradients"]
        # A bubble ends where the data came; the rank may have waited for its core after that (its log says how
        # long), and the probe's wait ends only where it ran again.
        core_wait = {b["start_ns"]: int(b["core_wait_ms"] * 1e6) for it in iterations for b in it["bubbles"]}
        assert core_wait and all(wait >= 0 for wait in core_wait.values())
        for b in bubbles:
            span = (b["start_ns"], b["end_ns"] + core_wait.get(b["start_ns"], 0))
            assert b["iteration"] < ITERATIONS
            # Never over compute; always over a wait of the framework (an instruction's, the loss
            # broadcast, or the gradient-norm all-reduce inside the clipping).
            assert not any(_overlaps(span, c) for c in spans), b
            assert any(w[0] >= span[0] and w[1] <= span[1] for w in waits) or any(
                _overlaps(span, c) for c in clips), b
        # The CLI lists the stage's slots with the bubbles the manager counted.
        assert {r["slot"] for r in rows[rank] if r["stage"] == rank and r["count"] > 0} >= {b["slot"] for b in bubbles}

    # Stage 0 waits for the slowed stage in RecvGrad before each backward: every such wait (after the
    # first iteration, which also exchanges shapes) is inside a reported bubble of a planned slot.
    by_iteration: dict[int, list[tuple[int, int, int]]] = {}
    core_wait = {b["start_ns"]: int(b["core_wait_ms"] * 1e6) for it in results[0][0] for b in it["bubbles"]}
    for b in traced[0]:
        by_iteration.setdefault(b["iteration"], []).append(
            (b["start_ns"], b["end_ns"] + core_wait.get(b["start_ns"], 0), b["slot"]))
    planned = {s["slot"] for s in results[0][1]["slots"]}
    for i, it in enumerate(results[0][0][1:], start=1):
        for name, start, end in it["probe"]:
            if name == "RecvGrad":
                assert any(s <= start and end <= e and slot in planned for s, e, slot in by_iteration.get(i, [])), (
                    i, name, start, end)
    assert run.side_task_steps > 0 and run.harvested_s > 0


@pytest.mark.timeout(420)
def test_torchtitan_schedule_reports_its_waits_and_a_side_task_harvests_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _run(tmp_path, capsys, "torchtitan", "freeride.workload.torchtitan_job", "--builder", "torchtitan")
    results, rows, traced = run.logs, run.cli_rows, run.traced
    for _iterations, summary in results:
        assert summary["instrumented"] and summary["builder"] == "torchtitan" and summary["schedule"] == "Schedule1F1B"
        assert summary["losses"] == summary["twin_losses"] and summary["weights_equal"]
        assert summary["restored"] and summary["hooks_off_between_steps"] and summary["attribute_passes_through"]
        assert summary["validation_loss"] == summary["validation_loss_through_wrapper"]
        assert summary["reporter"]["sent"] > 0
    assert results[1][1]["validation_loss"] is not None  # the last stage computed it

    for rank in (0, 1):
        bubbles = traced[rank]
        assert bubbles
        window = results[rank][1]["eval_window_ns"]
        assert not any(window[0] <= b["start_ns"] <= window[1] for b in bubbles)  # validation reports nothing
        assert {r["slot"] for r in rows[rank] if r["stage"] == rank and r["count"] > 0} >= {b["slot"] for b in bubbles}
    # Stage 0 of a 1F1B waits for the slowed stage before each backward: those slots, every iteration.
    planned = {s["slot"] for s in results[0][1]["slots"]}
    for i in range(1, ITERATIONS):
        assert planned <= {b["slot"] for b in traced[0] if b["iteration"] == i}, i
    assert run.side_task_steps > 0 and run.harvested_s > 0
