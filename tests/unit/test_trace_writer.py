"""The manager's trace file: a restarted manager appends after the earlier run, even after a torn line."""

from __future__ import annotations

from pathlib import Path

from freeride._manager.trace import TraceWriter, read_trace


def test_a_restarted_manager_appends_to_its_trace_after_a_torn_last_line(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    first = TraceWriter(path, "cpu:0")
    first.write("grant", task="a-1", grant=1, deadline_ns=5, at_ns=1)
    first.close()
    with path.open("a") as fh:
        fh.write('{"ev":"grant","dev')  # a kill -9 in the middle of a write
    second = TraceWriter(path, "cpu:0")
    second.write("grant", task="a-1", grant=2, deadline_ns=9, at_ns=7)
    second.close()
    records = read_trace(path)
    assert [r["ev"] for r in records] == ["opened", "grant", "opened", "grant"]
    assert [r["grant"] for r in records if r["ev"] == "grant"] == [1, 2]
    assert all(r["device"] == "cpu:0" for r in records)


def test_the_loops_trace_writes_the_cores_inputs_decisions_and_the_reported_steps(tmp_path: Path) -> None:
    from freeride._channel import Parked
    from freeride._manager import core as C
    from freeride._manager.trace import LoopTrace
    from freeride.messages import BubbleStart

    path = tmp_path / "trace.jsonl"
    trace = LoopTrace(TraceWriter(path, "cpu:0"), lambda: 42)
    trace.event(C.BubbleStarted(BubbleStart(0, 1, 2, 3, "k", 100, 50, learned=True), 101))
    trace.event(C.Tick())  # not traced
    trace.action(C.Grant("a-1", 7, 150, 1, thaw=False))
    trace.action(C.Grant("a-1", 8, 150, 1, thaw=False, late=True))
    trace.action(C.Kill("a-1"))  # not traced
    trace.steps("a-1", Parked(7, 2, (10, 20), 100, 135, 136, "deadline", 2.0, 2, starts_ns=(100, 115)))
    trace.steps("a-1", Parked(8, 2, (10, 20), 100, 135, 136, "deadline", 2.0, 2, starts_ns=(100, 115),
                              costs_ns=(4, 20), worked_ns=24))
    trace.close()
    records = read_trace(path)
    assert [r["ev"] for r in records] == ["opened", "bubble_start", "grant", "grant", "steps", "steps"]
    assert "costs" not in records[4] and (records[5]["costs"], records[5]["worked_ns"]) == ([4, 20], 24)
    assert records[1]["learned"] is True and records[2]["at_ns"] == 42
    assert "late" not in records[2] and records[3]["late"] is True  # a bubble's grant once it outlived its prediction
    assert records[4]["spans"] == [[100, 110], [115, 135]] and records[4]["count"] == 2
