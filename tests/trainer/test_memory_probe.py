"""The trainer's memory probe, the action hook it rides on, and one real run against the memory model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from freeride.training.instrument import InstrumentedSchedule
from freeride.training.memory import PRECISIONS, RUNTIMES, TransformerDims, rank_memory, transformer_chunks
from freeride.training.schedules import build_schedule
from freeride.workload.memory_probe import MemoryProbe, heap_reader

torch = pytest.importorskip("torch")


def test_cpu_probe_counts_a_tensors_bytes_and_forwards_bubbles() -> None:
    if heap_reader("cpu") is None:
        pytest.skip("no glibc mallinfo2 here")

    class Sink:
        def __init__(self) -> None:
            self.calls: list[str] = []

        def bubble_start(self, *args: Any, **kwargs: Any) -> None:
            self.calls.append("start")

        def bubble_end(self, *args: Any, **kwargs: Any) -> None:
            self.calls.append("end")

    inner = Sink()
    probe = MemoryProbe("cpu", inner=inner)
    before = probe.sample()
    held = torch.empty(2**21, dtype=torch.float32)  # 8 MiB
    probe.bubble_start(0, 3, "drain", 1)
    probe.action_end("F", 0, 0)
    probe.bubble_end(0, 3)
    slots, actions = probe.take()
    assert 8 * 2**20 <= slots[3] - before < 9 * 2**20
    assert len(actions) == 1 and actions[0] >= slots[3] - 4096
    assert inner.calls == ["start", "end"]
    assert probe.take() == ({}, [])
    del held


class _Stage:
    """Just what InstrumentedSchedule hooks: a PipelineStage's three compute entry points and its receives."""

    def __init__(self, stage_index: int, num_stages: int) -> None:
        self.stage_index = stage_index
        self.num_stages = num_stages

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> None:
        pass

    def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> None:
        pass

    def backward_weight_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> None:
        pass

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[Any]:
        return []

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[Any]:
        return []


class Schedule1F1B:  # named like torch's: the instrumentation models it as 1f1b
    def __init__(self, stage: _Stage, n_microbatches: int) -> None:
        self._stage = stage
        self._n_microbatches = n_microbatches

    def step(self) -> None:
        for a in build_schedule("1f1b", self._stage.num_stages, self._n_microbatches).orders[self._stage.stage_index]:
            if a.kind == "F":
                self._stage.forward_one_chunk(a.microbatch)
            else:
                self._stage.backward_one_chunk(a.microbatch, None, True)


def test_instrumented_schedule_times_every_action_and_calls_the_action_hook() -> None:
    seen: list[tuple[str, int, int]] = []
    inst = InstrumentedSchedule(Schedule1F1B(_Stage(0, 2), 3),
                                on_action_end=lambda kind, s, mb: seen.append((kind, s, mb)))
    inst.step()
    order = [(a.kind, a.stage, a.microbatch) for a in build_schedule("1f1b", 2, 3).orders[0]]
    assert seen == order
    timed = inst.last_actions
    assert [(a.kind, a.stage, a.microbatch) for a in timed] == order
    assert all(a.length_ns >= 0 for a in timed)
    assert all(x.end_ns <= y.start_ns for x, y in zip(timed, timed[1:], strict=False))


@pytest.mark.slow
def test_trainer_memory_probe_agrees_with_the_memory_model(tmp_path: Path) -> None:
    if heap_reader("cpu") is None:
        pytest.skip("no glibc mallinfo2 here")
    log = tmp_path / "it.jsonl"
    model = {"vocab": 256, "d_model": 128, "heads": 4, "layers": 2, "seq_len": 64, "microbatch_size": 4}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "freeride.workload", "--schedule", "1f1b", "--microbatches", "4", "--iterations", "4",
           "--warmup", "2", "--memory-probe", "--iteration-log", str(log)]
    cmd += [arg for k, v in model.items() for arg in (f"--{k.replace('_', '-')}", str(v))]
    env = dict(os.environ, FREERIDE_LOG_LEVEL="WARNING", OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    schedule = build_schedule("1f1b", 2, 4)
    dims = TransformerDims(layers=2, hidden=128, heads=4, seq_len=64, microbatch_size=4, vocab=256)
    chunks = transformer_chunks(dims, 2, PRECISIONS["fp32"])
    for rank in (0, 1):
        records = [json.loads(line) for line in log.with_name(f"it.rank{rank}.jsonl").read_text().splitlines()]
        last = [r for r in records if not r.get("summary")][-1]
        mem = rank_memory(schedule, rank, chunks, PRECISIONS["fp32"], "adam", RUNTIMES["torch"])
        assert len(last["actions"]) == len(last["memory"]["after_actions"]) == len(schedule.orders[rank])
        for measured, point in zip(last["memory"]["after_actions"], mem.points[1:], strict=True):
            # Allocator accounting counts a few percent of other malloc users (graph nodes, gloo);
            # a wrong count of in-flight micro-batches would be off by tens of percent.
            assert measured == pytest.approx(point.total_bytes, rel=0.15)
