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
