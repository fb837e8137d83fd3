"""The demo's timeline picture and Perfetto trace, from fixed iteration logs and manager traces."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from demo_data import MS, T0, run, trace

from freeride._demo.perfetto import REQUIRED_KEYS, chrome_trace, write_chrome_trace
from freeride._demo.summary import Bubble, Iteration
from freeride._demo.timeline import choose_window, compute_spans, draw_timeline
from freeride._demo.traces import Grant, grants_from_trace, instants_from_trace, step_spans

NAMES = {"lstm-1": "lstm", "pagerank-1": "pagerank"}


def _bubbles_of(stage_run: list[Iteration], slot: int = 0) -> list[tuple[int, int]]:
    return [(it.bubbles[slot].start_ns, it.bubbles[slot].start_ns + round(it.bubbles[slot].length_ms * MS))
            for it in stage_run]  # fmt: skip


def _inputs() -> tuple[dict[int, list[Iteration]], dict[str, list[Grant]], dict[str, Any]]:
    r = run()
    records = {"cpu:0": trace("cpu:0", "lstm-1", _bubbles_of(r[0])),
               "cpu:1": trace("cpu:1", "pagerank-1", _bubbles_of(r[1]))}  # fmt: skip
    grants = {d: grants_from_trace(recs) for d, recs in records.items()}
    instants = {d: instants_from_trace(recs) for d, recs in records.items()}
    return r, grants, instants


# ------------------------------------------------------------------ traces


def test_a_grant_joins_its_park_order_and_the_steps_it_ran() -> None:
    records = trace("cpu:0", "lstm-1", [(T0, T0 + 20 * MS)])
    (g,) = grants_from_trace(records)
    assert (g.task, g.grant, g.device) == ("lstm-1", 1, "cpu:0")
    assert g.start_ns == T0 + MS // 2
    assert len(g.steps) == 2 and g.reason == "park"
    assert g.end_ns == T0 + 20 * MS + 2000  # the park order came after the last step ended
    assert step_spans([g]) == [("lstm-1", s, e) for s, e in g.steps]


def test_a_grant_always_contains_its_steps_even_when_the_worker_parked_late() -> None:
    records = [
        {"ev": "grant", "device": "cpu:0", "task": "t", "grant": 7, "deadline_ns": 50, "at_ns": 10},
        {"ev": "park", "device": "cpu:0", "task": "t", "grant": 7, "at_ns": 40},
        {"ev": "steps", "device": "cpu:0", "task": "t", "grant": 7, "reason": "park", "spans": [[12, 30], [30, 90]]},
        {"ev": "grant", "device": "cpu:0", "task": "t", "grant": 8, "deadline_ns": 150, "at_ns": 100},
    ]  # fmt: skip
    first, second = grants_from_trace(records)
    assert (first.start_ns, first.end_ns) == (10, 90)
    assert (second.start_ns, second.end_ns, second.steps, second.reason) == (100, 100, (), "")


def test_instants_keep_freezes_and_lifecycle_changes_but_not_every_grant_and_park() -> None:
    instants = instants_from_trace(trace("cpu:0", "lstm-1", [(T0, T0 + 20 * MS), (T0 + 50 * MS, T0 + 70 * MS)]))
    assert [i.name for i in instants] == ["new -> SUBMITTED", "STARTING -> PARKED", "freeze"]


# ------------------------------------------------------------------ Perfetto


def test_the_perfetto_trace_is_json_in_the_trace_event_format(tmp_path: Path) -> None:
    r, grants, instants = _inputs()
    path = tmp_path / "trace.json"
    write_chrome_trace(path, chrome_trace(r, grants, NAMES, instants))
    doc = json.loads(path.read_text())
    assert doc["displayTimeUnit"] == "ms"
    events = doc["traceEvents"]
    assert events
    for e in events:
        assert all(k in e for k in REQUIRED_KEYS), e
        assert e["ph"] in ("X", "M", "i")
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int)
        if e["ph"] == "X":
            assert e["dur"] >= 0 and e["ts"] >= 0
        if e["ph"] == "i":
            assert e["s"] in ("t", "p", "g")
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    processes = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert sorted(processes.values()) == ["cpu:0 (stage 0)", "cpu:1 (stage 1)"]
    assert sorted(names.values()) == ["lstm (lstm-1)", "pagerank (pagerank-1)", "training", "training"]
    kinds = {e["cat"] for e in events if e["ph"] == "X"}
    assert kinds == {"training", "bubble", "grant", "step"}


def test_perfetto_events_nest_bubbles_in_iterations_and_steps_in_grants() -> None:
    r, grants, instants = _inputs()
    events = chrome_trace(r, grants, NAMES, instants)["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]

    def parents(child: dict[str, Any], cat: str) -> list[dict[str, Any]]:
        return [p for p in slices if p["cat"] == cat and (p["pid"], p["tid"]) == (child["pid"], child["tid"])
                and p["ts"] <= child["ts"] and child["ts"] + child["dur"] <= p["ts"] + p["dur"]]  # fmt: skip

    for e in slices:
        if e["cat"] == "bubble":
            assert len(parents(e, "training")) == 1, e
        if e["cat"] == "step":
            assert len(parents(e, "grant")) == 1, e
    assert sum(e["cat"] == "step" for e in slices) == 2 * 2 * 10


def test_perfetto_times_are_microseconds_from_the_first_event() -> None:
    r, grants, _ = _inputs()
    events = chrome_trace(r, grants, NAMES)["traceEvents"]
    first = next(e for e in events if e["name"] == "iteration 0" and e["pid"] == 1)
    assert first["ts"] == 0 and first["dur"] == pytest.approx(100_000)  # 100 ms
    bubble = next(e for e in events if e.get("cat") == "bubble" and e["pid"] == 1)
    assert bubble["ts"] == pytest.approx(10_000) and bubble["dur"] == pytest.approx(20_000)


def test_a_bubble_measured_past_its_iteration_is_clipped_so_it_still_nests() -> None:
    it = Iteration(0, 0, "cpu:0", False, 10.0, T0 + 10 * MS, (Bubble(0, "drain", T0 + 8 * MS, 5.0, 5.0),))
    events = chrome_trace({0: [it]}, {}, {})["traceEvents"]
    bubble = next(e for e in events if e.get("cat") == "bubble")
    assert bubble["ts"] + bubble["dur"] == pytest.approx(10_000)


# ------------------------------------------------------------------ timeline


def test_compute_is_the_iteration_minus_its_bubbles() -> None:
    it = run()[0][0]  # 100 ms; bubbles at 10-30 ms and 40-50 ms
    spans = [((s - it.start_ns) / MS, (e - it.start_ns) / MS) for s, e in compute_spans(it)]
    assert spans == [(0, 10), (30, 40), (50, 100)]


def test_the_window_drawn_is_the_one_with_the_most_side_task_steps() -> None:
    r = run(count=10, warmup=2)
    steps = [(T0 + 605 * MS, T0 + 606 * MS), (T0 + 710 * MS, T0 + 712 * MS), (T0 + 720 * MS, T0 + 721 * MS)]
    window = choose_window(r, steps, width=3)
    assert (window.first, window.last) == (5, 7)
    assert window.start_ns == T0 + 500 * MS and window.end_ns == T0 + 800 * MS
    assert choose_window(r, [], width=3).first == 2  # no steps: the first iterations after the warm-up


def test_the_timeline_picture_is_written_as_a_png(tmp_path: Path) -> None:
    r, grants, _ = _inputs()
    path = tmp_path / "pictures" / "timeline.png"
    window = draw_timeline(path, r, grants, NAMES)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 10_000
    assert window.last - window.first == 2


def test_a_timeline_without_any_side_task_step_is_still_drawn(tmp_path: Path) -> None:
    path = tmp_path / "timeline.png"
    draw_timeline(path, run(count=4), {}, {})
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_pictures_are_drawn_without_a_killed_managers_trace_and_a_note_says_so(tmp_path: Path) -> None:
    import io

    from freeride._demo.plan import DemoConfig
    from freeride._demo.run import Demo

    demo = Demo(DemoConfig.make("cpu", 10, tmp_path, quick=True), io.StringIO())
    demo.devices = ("cpu:0", "cpu:1")
    demo.task_ids = dict(NAMES)
    r = run()
    with demo.layout.manager_trace("cpu:1").open("w") as fh:
        for record in trace("cpu:1", "pagerank-1", _bubbles_of(r[1])):
            fh.write(json.dumps(record) + "\n")
        fh.write('{"ev": "steps", "device": "cpu:1", "ta')  # torn by a kill
    files, notes = demo.write_pictures(r, demo.read_traces())
    assert notes and "cpu:0" in notes[0]
    assert Path(files["timeline"]).read_bytes()[:4] == b"\x89PNG"
    events = json.loads(Path(files["trace"]).read_text())["traceEvents"]
    assert any(e.get("cat") == "step" and e["pid"] == 2 for e in events)
