"""Harvest efficiency and its breakdown on fixed traces: the pieces of every bubble sum to it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from demo_data import MS, T0, trace

from freeride.harvest import (
    CATEGORIES,
    BubbleAccount,
    TraceBubble,
    TraceGrant,
    account_bubble,
    account_trace,
    grants_from_trace,
    harvest,
    measurement_window,
    standalone_step_s,
    steady_window,
    summarize,
)

US = 1_000


def bubble(start_ms: float, end_ms: float, received_ms: float | None = None, iteration: int = 0) -> TraceBubble:
    return TraceBubble(0, 0, iteration, 0, int(start_ms * MS), int(end_ms * MS), 0,
                       None if received_ms is None else int(received_ms * MS))


def grant(task: str, at_ms: float, deadline_ms: float, *spans_ms: tuple[float, float], count: int | None = None,
          first: bool = False, number: int = 1) -> TraceGrant:
    spans = tuple((int(a * MS), int(z * MS)) for a, z in spans_ms)
    return TraceGrant(task, number, int(at_ms * MS), int(deadline_ms * MS), spans,
                      len(spans) if count is None else count, first_of_task=first)


def ms(seconds: dict[str, float]) -> dict[str, float]:
    return {k: round(v * 1e3, 6) for k, v in seconds.items() if abs(v) > 1e-12}


def test_the_demo_trace_bubble_is_cut_into_latency_steps_gaps_and_margin() -> None:
    # demo_data.trace: bubble [0, 20) ms, report received at +1 us, grant at +0.5 ms, steps of 2 ms at
    # +0.6 and +3.5 ms, deadline at the end. Standalone, a step takes 1 ms: the rest is "slower".
    start = T0
    records = trace("cpu:0", "t-1", [(start, start + 20 * MS), (start + 100 * MS, start + 120 * MS)])
    second = account_trace(records, {"t-1": 0.001})[1]
    assert ms(second.seconds) == {"delivery": 0.001, "decision": 0.499, "wakeup": 0.1, "work": 2.0, "slower": 2.0,
                                  "between": 0.9, "margin": 14.5}
    assert sum(second.seconds.values()) == pytest.approx(0.020)
    assert second.steps == {"t-1": 2}
    assert second.overrun_ms == 0.0
    # The task's first grant is its probe: setup and first steps count there, beyond their work.
    first = account_trace(records, {"t-1": 0.001})[0]
    assert ms(first.seconds)["probe"] == pytest.approx(2.1)
    assert "slower" not in ms(first.seconds) and "wakeup" not in ms(first.seconds)


def test_every_bubble_sums_to_its_length_and_h_is_work_over_bubble_time() -> None:
    start = T0
    records = trace("cpu:0", "t-1", [(start + k * 50 * MS, start + k * 50 * MS + 20 * MS) for k in range(5)])
    accounts = account_trace(records, {"t-1": 0.0015})
    for acc in accounts:
        assert sum(acc.seconds.values()) == pytest.approx(acc.bubble.length_s)
    h = summarize(accounts)
    assert h.bubble_s == pytest.approx(0.1)
    assert sum(h.seconds.values()) == pytest.approx(h.bubble_s)
    assert sum(h.shares().values()) == pytest.approx(1.0)
    # H as DESIGN section 6 defines it: progress (10 steps) / standalone throughput / B.
    assert h.efficiency == pytest.approx(10 * 0.0015 / 0.1)
    assert h.steps == {"t-1": 10}


def test_a_step_past_the_real_end_is_overrun_and_its_work_counts_outside_the_bubble() -> None:
    acc = account_bubble(bubble(0, 10, 0.1), [grant("a", 0.5, 10, (1, 5), (5, 13))], {"a": 0.004})
    assert ms(acc.seconds) == {"delivery": 0.1, "decision": 0.4, "wakeup": 0.5, "work": 4.0 + 0.004e3 * 5 / 8,
                               "slower": 5 - 0.004e3 * 5 / 8}
    assert acc.overrun_s == pytest.approx(0.003)
    assert acc.overrun_ms == pytest.approx(3.0)
    assert acc.work_past_end_s == pytest.approx(0.004 * 3 / 8)
    assert acc.work_s == pytest.approx(0.008)  # both steps' standalone work


def test_the_tail_splits_at_the_predicted_end() -> None:
    # Predicted end 8 ms, real end 12 ms: the worker stopped at 6 ms (next step would not fit by 8 ms).
    acc = account_bubble(bubble(0, 12, 0.0), [grant("a", 0.0, 8, (0, 2), (2, 6))], {"a": 0.002})
    assert ms(acc.seconds) == {"work": 6.0 - 2.0, "slower": 2.0, "margin": 2.0, "past_predicted": 4.0}


def test_two_tasks_share_a_bubble_with_a_handoff_between() -> None:
    grants = [grant("a", 1, 20, (1.2, 5), number=1), grant("b", 6, 20, (6.5, 9), (9.1, 12), number=2)]
    acc = account_bubble(bubble(0, 20, 0.5), grants, {"a": 0.0038, "b": 0.0025})
    # a's step and b's first ran at their standalone speed; b's second took 2.9 ms for 2.5 ms of work.
    assert ms(acc.seconds) == pytest.approx({"delivery": 0.5, "decision": 0.5, "wakeup": 0.2 + 0.5,
                                             "work": 3.8 + 2 * 2.5, "slower": 0.4, "handoff": 1.0, "between": 0.1,
                                             "margin": 8.0})
    assert acc.steps == {"a": 1, "b": 2}


def test_steps_the_worker_did_not_list_fill_the_time_before_the_first_listed_one() -> None:
    # 10 steps, 2 listed: 8 ran between the grant (1 ms) and the first listed span (9 ms), 1 ms each alone.
    acc = account_bubble(bubble(0, 20, 0.5), [grant("a", 1, 20, (9, 10), (10, 11), count=10)], {"a": 0.001})
    assert ms(acc.seconds) == {"delivery": 0.5, "decision": 0.5, "work": 10.0, "margin": 9.0}
    assert acc.steps == {"a": 10}


def test_bubbles_without_a_grant_are_idle_and_can_be_filtered_by_length() -> None:
    short = account_bubble(bubble(0, 3), [], {"a": 0.001})
    long = account_bubble(bubble(10, 40, 10.1), [grant("a", 10.2, 40, (10.3, 39.3))], {"a": 0.029})
    assert ms(short.seconds) == {"idle": 3.0}
    assert short.overrun_ms is None
    both = summarize([short, long])
    assert both.bubbles == 2 and both.bubble_s == pytest.approx(0.033)
    assert both.overruns_ms == (0.0,)  # one per granted bubble
    only_long = summarize([short, long], min_bubble_s=0.010)
    assert only_long.bubbles == 1 and only_long.efficiency == pytest.approx(29 / 30)


def test_a_grant_after_the_real_end_leaves_the_bubble_to_the_decision() -> None:
    # The reference policy's 10 ms poll: the grant came after the 6 ms bubble had ended.
    acc = account_bubble(bubble(0, 6, 0.2), [grant("a", 9, 12, (9.5, 11))], {"a": 0.0015})
    assert ms(acc.seconds) == {"delivery": 0.2, "decision": 5.8}
    assert acc.overrun_s == pytest.approx(0.0015)
    assert acc.work_past_end_s == pytest.approx(0.0015)


def test_a_late_grant_leaves_the_wait_past_the_predicted_end_to_past_predicted_not_to_the_decision() -> None:
    # Predicted 0.3 ms, no step fitted: offered again once the bubble outlived 0.3 ms, granted at 0.4 ms.
    b = TraceBubble(0, 0, 0, 0, 0, int(5 * MS), int(0.3 * MS), int(0.1 * MS))
    late = TraceGrant("a", 1, int(0.4 * MS), int(5 * MS), ((int(0.5 * MS), int(4.5 * MS)),), 1, late=True)
    assert ms(account_bubble(b, [late], {"a": 0.004}).seconds) == pytest.approx(
        {"delivery": 0.1, "decision": 0.2, "past_predicted": 0.1, "wakeup": 0.1, "work": 4.0, "margin": 0.5})
    # The same grant at its start's decision (not late): the loop's time, whatever the prediction said.
    on_time = TraceGrant("a", 1, int(0.4 * MS), int(5 * MS), ((int(0.5 * MS), int(4.5 * MS)),), 1)
    assert ms(account_bubble(b, [on_time], {"a": 0.004}).seconds)["decision"] == pytest.approx(0.3)


def test_a_late_grant_is_read_from_the_trace() -> None:
    records = _trace_records([(0, 5 * MS)], [{"ev": "grant", "task": "a", "grant": 1, "deadline_ns": 5 * MS,
                                               "at_ns": MS // 2, "late": True},
                                              {"ev": "grant", "task": "a", "grant": 2, "deadline_ns": 5 * MS,
                                               "at_ns": MS}])
    assert [g.late for g in grants_from_trace(records)] == [True, False]


def _trace_records(bubbles: list[tuple[int, int]], grants: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, (s, e) in enumerate(bubbles):
        key = {"stage": 0, "rank": 0, "iteration": i, "slot": 0}
        out += [{"ev": "bubble_start", **key, "start_ns": s, "predicted_ns": e - s, "received_ns": s},
                {"ev": "bubble_end", **key, "end_ns": e}]
    return out + grants


def test_window_and_harvest_over_devices() -> None:
    records = _trace_records(
        [(0, 10 * MS), (20 * MS, 30 * MS)],
        [{"ev": "grant", "task": "a", "grant": 1, "at_ns": 21 * MS, "deadline_ns": 30 * MS},
         {"ev": "steps", "task": "a", "grant": 1, "count": 1, "spans": [[22 * MS, 27 * MS]]}])
    h = harvest([records, records], {"a": 0.005}, window=(15 * MS, 100 * MS))
    assert h.bubbles == 2 and h.bubble_s == pytest.approx(0.020)
    assert h.efficiency == pytest.approx(0.5)
    assert set(CATEGORIES) == set(h.seconds)
    assert json.loads(json.dumps(h.to_json()))["efficiency"] == pytest.approx(0.5)


def _frozen_run(reason_of_first: str) -> list[dict[str, Any]]:
    """Two bubbles; the task's first grant is frozen 2 ms past the first bubble's end, and the next thaws it."""
    return _trace_records(
        [(0, 10 * MS), (20 * MS, 30 * MS)],
        [{"ev": "grant", "task": "a", "grant": 1, "at_ns": 1 * MS, "deadline_ns": 10 * MS},
         {"ev": "freeze", "task": "a", "at_ns": 12 * MS},
         {"ev": "grant", "task": "a", "grant": 2, "at_ns": 21 * MS, "deadline_ns": 30 * MS, "thaw": True},
         # The first grant's report: its last step began at 8 ms and ran 3 ms, 1 of them after the thaw.
         {"ev": "steps", "task": "a", "grant": 1, "count": 2, "reason": reason_of_first,
          "spans": [[2 * MS, 7 * MS], [8 * MS, 11 * MS]]},
         {"ev": "steps", "task": "a", "grant": 2, "count": 1, "reason": "deadline", "spans": [[23 * MS, 28 * MS]]}])


def test_a_grant_a_freeze_ended_ran_until_the_freeze_and_its_steps_count_in_its_own_bubble() -> None:
    first, second = account_trace(_frozen_run("frozen"), {"a": 0.005})
    assert first.steps == {"a": 2} and second.steps == {"a": 1}
    assert first.overrun_ms == pytest.approx(2.0)  # the freeze, not the span's running time
    assert first.overrun_s == pytest.approx(0.002)
    assert second.overrun_ms == 0.0
    grants = {g.grant: g for g in grants_from_trace(_frozen_run("frozen"))}
    assert grants[1].frozen_ns == 12 * MS and grants[1].stopped_by_freeze
    assert grants[2].frozen_ns is None and not grants[2].stopped_by_freeze


def test_a_freeze_of_a_worker_that_had_parked_already_is_no_overrun() -> None:
    # The worker parked at the deadline; the manager, not yet having read it, froze an idle process.
    first, _ = account_trace(_frozen_run("deadline"), {"a": 0.005})
    assert first.overrun_ms == pytest.approx(1.0)  # its last step's own end
    assert first.overrun_s == pytest.approx(0.001)


def _with_cpu(records: list[dict[str, Any]], freeze_cpu: int, start_cpu: int) -> list[dict[str, Any]]:
    """The run with the CPU figures: the worker's CPU time at the freeze and at its last step's start."""
    out = []
    for r in records:
        if r["ev"] == "freeze":
            r = {**r, "cpu_ns": freeze_cpu}
        elif r["ev"] == "steps" and r["grant"] == 1:
            r = {**r, "start_cpu_ns": start_cpu}
        out.append(r)
    return out


def test_a_frozen_step_that_got_no_core_past_the_end_ran_only_its_cpu_time_there() -> None:
    # The step began at 8 ms with 50 ms of CPU used; at the freeze (12 ms) 50.3 ms: it ran at most 0.3 ms
    # past the end (10 ms), though it was held unfrozen 2 ms.
    first, second = account_trace(_with_cpu(_frozen_run("frozen"), 50_300_000, 50 * MS), {"a": 0.005})
    assert first.overrun_ms == pytest.approx(2.0)
    assert first.cpu_overrun_ms == pytest.approx(0.3)
    assert second.cpu_overrun_ms == 0.0
    h = harvest([_with_cpu(_frozen_run("frozen"), 50_300_000, 50 * MS)], {"a": 0.005})
    assert h.overruns_ms == pytest.approx((2.0, 0.0)) and h.cpu_overruns_ms == pytest.approx((0.3, 0.0))


def test_a_frozen_step_that_used_more_cpu_than_the_time_held_counts_the_time_held() -> None:
    # 4 ms of CPU from the step's start (8 ms) to the freeze: the bound is no tighter than the 2 ms held.
    first, _ = account_trace(_with_cpu(_frozen_run("frozen"), 54 * MS, 50 * MS), {"a": 0.005})
    assert first.cpu_overrun_ms == pytest.approx(2.0)


def test_without_cpu_figures_what_ran_past_the_end_is_the_time_held() -> None:
    first, _ = account_trace(_frozen_run("frozen"), {"a": 0.005})
    assert first.cpu_overrun_ms == first.overrun_ms == pytest.approx(2.0)
    # A worker that had parked before the freeze: its own last step's end, with or without figures.
    parked, _ = account_trace(_with_cpu(_frozen_run("deadline"), 50_300_000, 50 * MS), {"a": 0.005})
    assert parked.cpu_overrun_ms == parked.overrun_ms == pytest.approx(1.0)


def test_a_grant_that_only_finished_an_earlier_step_and_was_frozen_again_ran_until_that_freeze() -> None:
    records = _trace_records(
        [(0, 10 * MS)],
        [{"ev": "grant", "task": "a", "grant": 5, "at_ns": 1 * MS, "deadline_ns": 10 * MS, "thaw": True},
         {"ev": "freeze", "task": "a", "at_ns": 13 * MS}])
    (acc,) = account_trace(records, {"a": 0.005})
    assert acc.overrun_ms == pytest.approx(3.0)
    assert sum(acc.seconds.values()) == pytest.approx(0.010)


def _thaw_then_freeze(granted_ms: float, granted_cpu_ms: float, frozen_ms: float,
                      frozen_cpu_ms: float) -> BubbleAccount:
    """A bubble of [0, 10 ms) whose one grant thawed the worker, which was frozen again before it reported,
    with the worker's CPU time read at both."""
    records = _trace_records(
        [(0, 10 * MS)],
        [{"ev": "grant", "task": "a", "grant": 5, "at_ns": int(granted_ms * MS), "deadline_ns": 12 * MS,
          "thaw": True, "cpu_ns": int(granted_cpu_ms * MS)},
         {"ev": "freeze", "task": "a", "at_ns": int(frozen_ms * MS), "cpu_ns": int(frozen_cpu_ms * MS)}])
    (acc,) = account_trace(records, {"a": 0.005})
    return acc


def test_a_thawed_worker_frozen_again_before_it_reported_ran_its_cpu_time_since_the_grant() -> None:
    # Thawed at 1 ms (CPU 40 ms then), frozen again 3 ms past the end with CPU 40.1 ms: it ran 0.1 ms.
    acc = _thaw_then_freeze(1, 40, 13, 40.1)
    assert acc.overrun_ms == pytest.approx(3.0)
    assert acc.cpu_overrun_ms == pytest.approx(0.1)


def test_a_grant_given_after_its_bubble_ended_ran_past_the_end_only_from_the_grant() -> None:
    # The end (10 ms) reached the manager late: granted at 11 ms (CPU 40 ms), frozen at 14 ms (CPU 40.5 ms).
    acc = _thaw_then_freeze(11, 40, 14, 40.5)
    assert acc.overrun_ms == pytest.approx(4.0)  # the time held is counted from the end
    assert acc.cpu_overrun_ms == pytest.approx(0.5)  # parked or frozen until the grant, then 0.5 ms of CPU


def test_standalone_step_seconds() -> None:
    # 300 images in 100 steps, 600 images/s alone: each step is 5 ms of standalone work.
    assert standalone_step_s(300, 100, 600.0) == pytest.approx(0.005)
    assert standalone_step_s(0, 0, 600.0) == 0.0
    with pytest.raises(ValueError):
        standalone_step_s(1, 1, 0.0)


def test_measurement_window_starts_after_the_last_warmup_iteration_of_any_rank(tmp_path: Path) -> None:
    logs = []
    for rank, ends in ((0, [100, 200, 300]), (1, [110, 210, 310])):
        lines = [json.dumps({"iteration": i, "warmup": i == 0, "time_ms": 1e-5, "end_ns": e})
                 for i, e in enumerate(ends)]
        path = tmp_path / f"it.rank{rank}.jsonl"
        path.write_text("\n".join(lines + ['{"summary": true}']) + "\n")
        logs.append(path)
    assert measurement_window(logs) == (110, 310)


def test_setup_spanning_bubbles_counts_as_probe_until_the_first_stepping_grant() -> None:
    records = _trace_records(
        [(0, 10 * MS), (20 * MS, 30 * MS), (40 * MS, 50 * MS)],
        [{"ev": "grant", "task": "a", "grant": 1, "at_ns": 1 * MS, "deadline_ns": 10 * MS},
         {"ev": "grant", "task": "a", "grant": 2, "at_ns": 21 * MS, "deadline_ns": 30 * MS, "thaw": True},
         {"ev": "steps", "task": "a", "grant": 2, "count": 1, "spans": [[25 * MS, 27 * MS]]},
         {"ev": "grant", "task": "a", "grant": 3, "at_ns": 41 * MS, "deadline_ns": 50 * MS},
         {"ev": "steps", "task": "a", "grant": 3, "count": 1, "spans": [[42 * MS, 44 * MS]]}])
    setup, first_step, steady = account_trace(records, {"a": 0.001})
    assert ms(setup.seconds) == {"decision": 1.0, "probe": 9.0}  # setup ran on, frozen at the end
    assert ms(first_step.seconds) == {"decision": 1.0, "probe": 4.0 + 1.0, "work": 1.0, "margin": 3.0}
    assert ms(steady.seconds) == {"decision": 1.0, "wakeup": 1.0, "work": 1.0, "slower": 1.0, "margin": 6.0}


def test_the_steady_window_starts_after_every_tasks_first_step() -> None:
    records = _trace_records(
        [(0, 10 * MS), (20 * MS, 30 * MS)],
        [{"ev": "grant", "task": "a", "grant": 1, "at_ns": 1 * MS, "deadline_ns": 10 * MS},
         {"ev": "steps", "task": "a", "grant": 1, "count": 1, "spans": [[2 * MS, 3 * MS]]},
         {"ev": "grant", "task": "b", "grant": 1, "at_ns": 21 * MS, "deadline_ns": 30 * MS},
         {"ev": "steps", "task": "b", "grant": 1, "count": 1, "spans": [[22 * MS, 23 * MS]]}])
    assert steady_window([records], (0, 100 * MS)) == (22 * MS, 100 * MS)
    assert steady_window([records], (50 * MS, 100 * MS)) == (50 * MS, 100 * MS)
    assert steady_window([[]], (5, 9)) == (5, 9)


def test_a_step_that_ended_by_itself_past_the_end_ran_there_no_more_than_its_cost() -> None:
    # A stranger-sized case from a ZBV trace: a 0.2 ms step preempted by the trainer at the end (10 ms) finished
    # only when the core was free again, 5 ms later; it ran 0.2 ms of it, not 5.
    records = _trace_records(
        [(0, 10 * MS)],
        [{"ev": "grant", "task": "a", "grant": 1, "at_ns": 1 * MS, "deadline_ns": 10 * MS},
         {"ev": "steps", "task": "a", "grant": 1, "count": 2, "reason": "deadline",
          "spans": [[2 * MS, 2_200_000], [9_900_000, 15 * MS]], "costs": [200_000, 200_000]}])
    (acc,) = account_trace(records, {"a": 0.0002})
    assert acc.overrun_ms == pytest.approx(5.0)  # held: until it ended
    assert acc.cpu_overrun_ms == pytest.approx(0.2)  # ran: its cost, all of it past the end at most
    without = [{k: v for k, v in r.items() if k != "costs"} for r in records]
    (acc,) = account_trace(without, {"a": 0.0002})
    assert acc.cpu_overrun_ms == pytest.approx(5.0)  # no costs in the trace: the time held


def test_a_steps_cost_stays_with_its_span_when_the_listed_spans_come_out_of_order() -> None:
    records = _trace_records(
        [(0, 10 * MS)],
        [{"ev": "grant", "task": "a", "grant": 1, "at_ns": 1 * MS, "deadline_ns": 10 * MS},
         {"ev": "steps", "task": "a", "grant": 1, "count": 2, "reason": "deadline",
          "spans": [[9 * MS, 12 * MS], [2 * MS, 3 * MS]], "costs": [500_000, 900_000]}])
    (g,) = grants_from_trace(records)
    assert g.spans == ((2 * MS, 3 * MS), (9 * MS, 12 * MS)) and g.costs == (900_000, 500_000)
    (acc,) = account_trace(records, {"a": 0.001})
    assert acc.cpu_overrun_ms == pytest.approx(0.5)


def test_a_trainers_stop_dated_before_its_grants_stamp_is_that_grants_freeze() -> None:
    # A manager that lost its core between sending a grant and stamping it wrote the grant dated after the trainer's
    # stop of its worker at the end; read by the times, the stop went to the grant before, and this grant took the
    # next freeze, 65 ms on (a hold of 65 ms on a bubble the trainer had stopped 10 us past its end).
    records: list[dict[str, Any]] = [
        {"ev": "grant", "task": "a", "grant": 1, "deadline_ns": 5 * MS, "margin_ns": 0, "thaw": False, "at_ns": 1 * MS},
        {"ev": "freeze", "task": "a", "at_ns": 6 * MS},
        {"ev": "grant", "task": "a", "grant": 2, "deadline_ns": 12 * MS, "margin_ns": 0, "thaw": True,
         "at_ns": 11 * MS},
        {"ev": "freeze", "task": "a", "at_ns": 10 * MS + 10 * US, "by": "trainer"},
        {"ev": "grant", "task": "a", "grant": 3, "deadline_ns": 80 * MS, "margin_ns": 0, "thaw": True,
         "at_ns": 70 * MS},
        {"ev": "freeze", "task": "a", "at_ns": 75 * MS},
    ]
    frozen = {g.grant: g.frozen_ns for g in grants_from_trace(records)}
    assert frozen == {1: 6 * MS, 2: 10 * MS + 10 * US, 3: 75 * MS}
