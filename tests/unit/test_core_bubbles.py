"""Bubbles (``core/bubbles.py``): ends park the running worker, early parks backfill, and malformed or
out-of-order streams are counted and never raise."""

from __future__ import annotations

import pytest
from core_sim import MS, T0, S, Sim, grants, non_state, of, paper_sim

from freeride._manager.core import (
    BubbleEnded,
    BubbleStarted,
    Freeze,
    Grant,
    Park,
    StateChanged,
    WorkerParked,
)
from freeride.messages import BubbleEnd, BubbleStart


def test_bubble_end_while_running_emits_park() -> None:
    sim = Sim()
    sim.resident("a")
    grant = of(sim.start(predicted_ms=10), Grant)[0]
    sim.advance_ms(8)
    actions = sim.end()
    assert actions == [Park("a", grant.grant_id, end_received_ns=sim.now, end_ns=sim.now)]
    assert sim.state("a") == S.RUNNING  # until the worker says it parked


def test_a_worker_that_stopped_on_the_trainers_end_board_records_a_park_latency_of_zero() -> None:
    # Third trial: with the trainer on the manager's host, `stats` showed no park latency at all.
    sim = Sim()
    sim.resident("a")
    sim.start(predicted_ms=10)
    sim.advance_ms(8)
    parked_at = sim.now  # the worker read the end board and parked before the end reached the core
    sim.advance_ms(0.2)
    sim.end(end_ns=parked_at - 1000)
    sim.parked("a", [2.0, 2.0, 2.0], reason="ended", last_end_ns=parked_at - MS)
    assert list(sim.core.stats.park_latency_ms) == [0.0]


def test_a_worker_that_parked_on_the_end_board_before_the_end_reached_the_core_records_zero_once() -> None:
    # First hour: the board's park skips the wire, so it often arrives before the trainer's end does; such
    # parks counted no park latency, and `stats` with a trainer on the manager's host showed almost none.
    sim = Sim()
    sim.resident("a")
    sim.start(predicted_ms=10)
    sim.advance_ms(6)
    end_ns = sim.now
    sim.advance_ms(0.1)
    sim.parked("a", [2.0, 2.0], reason="ended", last_end_ns=end_ns - MS, seen_end_ns=end_ns)
    sim.advance_ms(0.3)
    sim.end(end_ns=end_ns)
    assert list(sim.core.stats.park_latency_ms) == [0.0]


def test_worker_parked_returns_the_task_to_parked_and_records_park_latency() -> None:
    sim = Sim()
    sim.resident("a")
    sim.start(predicted_ms=10)
    sim.advance_ms(8)
    sim.end()
    sim.advance_ms(0.3)
    actions = sim.parked("a", [2.0, 2.0, 2.0], reason="park", last_end_ns=sim.now - MS)
    assert StateChanged("a", S.RUNNING, S.PARKED, "park") in actions
    assert list(sim.core.stats.park_latency_ms) == [pytest.approx(0.3)]
    task = sim.core.tasks["a"]
    assert task.known_step_ns == 2 * MS
    assert task.harvested_ns == 6 * MS
    assert task.steps == 3
    assert sim.core.next_timer_ns() is None  # the freeze timer is cancelled


def test_worker_parked_records_grant_latency_of_the_first_grant_of_a_bubble() -> None:
    sim = Sim()
    sim.resident("a")
    sim.start(predicted_ms=10)
    sim.advance_ms(5)
    sim.parked("a", [1.0], reason="deadline")  # first step 1000 ns after the grant
    assert list(sim.core.stats.grant_latency_ms) == [pytest.approx(0.001)]


def test_worker_parking_early_lets_another_task_use_the_rest_of_the_bubble() -> None:
    sim = Sim()
    sim.resident("a", "b")
    assert grants(sim.start(predicted_ms=10)) == ["a"]
    sim.advance_ms(3)
    actions = sim.parked("a", [1.0, 1.0], reason="deadline")
    assert of(actions, Grant) == [Grant("b", 2, T0 + 10 * MS, sim.core.config.margin_ns, False, rank=0,
                                        bubble_start_ns=T0, bubble_key=sim.open.key,  # type: ignore[union-attr]
                                        trainer_ends=True, grace_ns=sim.core.config.grace_ns)]
    assert sim.state("a") == S.PARKED
    assert sim.state("b") == S.RUNNING


def test_a_task_is_not_granted_twice_in_the_same_bubble() -> None:
    sim = Sim()
    sim.resident("a")
    sim.start(predicted_ms=10)
    sim.advance_ms(3)
    assert grants(sim.parked("a", [1.0], reason="deadline")) == []
    assert sim.state("a") == S.PARKED


def test_no_second_task_is_granted_while_the_first_is_running() -> None:
    sim = Sim()
    sim.resident("a")
    sim.start(predicted_ms=10)
    sim.advance_ms(1)
    sim.add("b")
    assert grants(sim.ready("b")) == []
    assert sim.state("b") == S.PARKED


def test_no_grant_in_a_new_bubble_while_the_last_bubbles_worker_finishes_its_step() -> None:
    sim = Sim(grace_ns=5 * MS)
    sim.resident("a", "b")
    sim.start(predicted_ms=10)
    sim.advance_ms(10)
    sim.end()  # "a" is told to park but is still inside a step
    sim.advance_ms(1)
    assert grants(sim.start(predicted_ms=10)) == []
    sim.advance_ms(1)
    # When "a" parks, the bubble that opened meanwhile goes to the next task.
    actions = sim.parked("a", [11.0], reason="park")
    assert grants(actions) == ["b"]


def test_late_park_after_the_real_end_counts_an_overrun_without_freezing() -> None:
    sim = Sim(grace_ns=5 * MS)
    sim.resident("a")
    sim.start(predicted_ms=10)
    sim.advance_ms(10)
    sim.end()
    end_ns = sim.now
    sim.advance_ms(2)
    actions = sim.parked("a", [12.0], reason="park", last_end_ns=end_ns + 2 * MS)
    assert of(actions, Freeze) == []
    assert sim.core.tasks["a"].overruns == 1
    assert list(sim.core.stats.overrun_ms) == [pytest.approx(2.0)]


def test_park_for_a_stale_grant_updates_stats_but_not_state() -> None:
    sim = Sim()
    sim.resident("a")
    sim.start(predicted_ms=10)
    actions = sim.parked("a", [1.0], grant_id=999)
    assert actions == []
    assert sim.state("a") == S.RUNNING
    assert sim.core.tasks["a"].harvested_ns == MS


def test_bubble_end_without_a_start_is_an_anomaly_and_does_nothing() -> None:
    sim = Sim()
    sim.resident("a")
    end = BubbleEnd(stage=0, rank=0, iteration=9, slot=0, end_ns=T0)
    assert sim.send(BubbleEnded(bubble=end, received_ns=T0)) == []
    assert sim.core.stats.anomalies == 1
    assert sim.core.stats.bubbles == 0


def test_bubble_end_for_another_bubble_is_an_anomaly_and_keeps_the_open_one() -> None:
    sim = Sim()
    sim.resident("a")
    sim.start(predicted_ms=10)
    other = BubbleEnd(stage=0, rank=0, iteration=99, slot=0, end_ns=sim.now + MS)
    assert sim.send(BubbleEnded(bubble=other, received_ns=sim.now)) == []
    assert sim.core.stats.anomalies == 1
    assert sim.state("a") == S.RUNNING
    assert sim.core.bubble is not None


def test_bubble_end_before_its_start_is_an_anomaly_and_does_nothing() -> None:
    sim = Sim()
    sim.resident("a")
    sim.start(predicted_ms=10)
    sim.advance_ms(5)
    assert sim.end(end_ns=T0 - MS) == []
    assert sim.core.stats.anomalies == 1
    assert sim.state("a") == S.RUNNING


def test_duplicate_bubble_start_is_an_anomaly_and_does_nothing_without_tasks() -> None:
    sim = Sim()
    sim.start(predicted_ms=10, iteration=1)
    assert sim.start(predicted_ms=10, iteration=1) == []
    assert sim.core.stats.anomalies == 1
    assert sim.end() == []
    assert sim.core.stats.anomalies == 1


def test_repeated_end_of_the_same_bubble_is_an_anomaly() -> None:
    sim = Sim()
    sim.start(predicted_ms=10)
    sim.advance_ms(10)
    sim.end()
    assert sim.end() == []
    assert sim.core.stats.anomalies == 1


def test_grants_name_their_bubble_for_the_trainers_end_board_except_under_the_reference_policy() -> None:
    sim = Sim()
    sim.resident("a")
    grant = of(sim.start(predicted_ms=10, rank=2), Grant)[0]
    assert (grant.rank, grant.bubble_start_ns, grant.trainer_ends) == (2, sim.now, True)
    paper = paper_sim()
    paper.tick()
    paper.start(predicted_ms=30)
    paper.advance_ms(10)
    assert [g.trainer_ends for g in of(paper.tick(), Grant)] == [False]


def test_a_worker_that_stopped_on_the_trainers_end_closes_its_bubble_to_grants() -> None:
    # The worker read the trainer's end on the end board before the end reached the manager: nothing
    # may be granted in the rest of that bubble, and the end, when it comes, is measured as usual.
    sim = Sim()
    sim.resident("a", "b")
    sim.start(predicted_ms=10)
    assert sim.state("a") == S.RUNNING
    trainer_end = sim.now + 6 * MS
    sim.advance_ms(6.3)
    task = sim.core.tasks["a"]
    actions = sim.send(WorkerParked("a", task.grant_id, 1, (int(6.2 * MS),), task.granted_at_ns + 1000,
                                    trainer_end + MS // 10, sim.now, "ended", 0.0, 1, seen_end_ns=trainer_end))
    assert grants(actions) == []  # no backfill of an ended bubble
    assert sim.state("a") == S.PARKED
    assert list(sim.core.stats.overrun_ms) == [pytest.approx(0.1)]  # measured from the trainer's end
    sim.advance_ms(0.3)
    assert sim.end(end_ns=trainer_end) == []  # no park: nobody runs
    assert [s.count for s in sim.core.slot_stats()] == [1] and sim.core.stats.ignored_events == 0
    sim.advance_ms(5)
    assert grants(sim.start(predicted_ms=10)) == ["b"]  # the next bubble is granted as usual


def test_start_while_another_bubble_is_open_closes_the_lost_one_and_parks_its_worker() -> None:
    sim = Sim()
    sim.resident("a")
    grant = of(sim.start(predicted_ms=10), Grant)[0]
    sim.advance_ms(12)
    actions = sim.start(predicted_ms=10)  # the first bubble's end was lost
    assert sim.core.stats.anomalies == 1
    assert non_state(actions) == [Park("a", grant.grant_id)]


@pytest.mark.parametrize("same_key", [True, False])
def test_regression_worker_parking_after_a_duplicate_start_does_not_wedge_grants(same_key: bool) -> None:
    sim = Sim()
    sim.resident("a", "b")
    sim.start(predicted_ms=10, iteration=1)
    sim.advance_ms(2)
    sim.start(predicted_ms=10, iteration=1 if same_key else 2)  # duplicate / lost end
    sim.advance_ms(1)
    actions = sim.parked("a", [2.0], reason="park")
    assert sim.state("a") == S.PARKED
    assert grants(actions) == ["b"]  # the open bubble goes on being used
    sim.advance_ms(10)
    sim.end()
    sim.parked("b", [5.0], reason="park")
    sim.advance_ms(5)
    assert len(grants(sim.start(predicted_ms=10, iteration=3))) == 1


def test_stale_start_older_than_the_open_bubble_is_ignored_and_counted() -> None:
    sim = Sim()
    sim.resident("a")
    sim.start(predicted_ms=10, iteration=5)
    stale = BubbleStart(0, 0, 3, 0, "fwd", sim.now - 50 * MS, 10 * MS)  # an old iteration, delivered late
    assert sim.send(BubbleStarted(stale, sim.now)) == []
    assert sim.state("a") == S.RUNNING  # the open (newer) bubble keeps its worker
    assert sim.core.stats.ignored_events == 1
    assert sim.core.stats.bubbles == 1


def test_out_of_order_ends_are_counted_as_ignored_events() -> None:
    sim = Sim()
    sim.send(BubbleEnded(BubbleEnd(0, 0, 9, 0, T0), T0))  # an end without its start
    sim.start(predicted_ms=10)
    sim.advance_ms(5)
    sim.end(end_ns=T0 - MS)  # an end before its start
    assert sim.core.stats.ignored_events == 2


def test_duplicate_start_is_not_an_ignored_event() -> None:
    sim = Sim()
    sim.start(predicted_ms=10, iteration=1)
    sim.start(predicted_ms=10, iteration=1)  # used: it closes the bubble whose end was lost
    assert sim.core.stats.ignored_events == 0


def test_malformed_streams_never_raise() -> None:
    sim = Sim()
    sim.resident("a", "b")
    b1 = BubbleStart(0, 0, 1, 0, "fwd", T0, 10 * MS)
    for event in (
        BubbleEnded(BubbleEnd(0, 0, 1, 0, T0), T0),
        BubbleStarted(b1, T0),
        BubbleStarted(b1, T0),
        BubbleEnded(BubbleEnd(0, 0, 1, 0, T0 - 5), T0),
        BubbleEnded(BubbleEnd(0, 0, 1, 0, T0 + MS), T0 + MS),
        BubbleEnded(BubbleEnd(0, 0, 1, 0, T0 + MS), T0 + MS),
        BubbleStarted(BubbleStart(0, 0, 0, 0, "fwd", T0 + 2 * MS, 10 * MS), T0 + 2 * MS),
    ):
        sim.at(max(sim.now, event.received_ns))
        sim.send(event)
    assert sim.core.stats.anomalies >= 4


def test_a_bubble_whose_end_came_with_its_start_is_measured_and_never_granted() -> None:
    """A manager that fell behind reads a bubble's start and end together: granting it thawed a worker
    only to freeze it at once, past an end long gone."""
    sim = Sim()
    sim.resident("a")
    over = BubbleStart(stage=0, rank=0, iteration=1, slot=0, kind="fwd", start_ns=sim.now - 6 * MS,
                       predicted_ns=2 * MS, free_memory_bytes=-1)
    assert not of(sim.send(BubbleStarted(over, received_ns=sim.now, end_ns=sim.now - 5 * MS)), Grant)
    sim.send(BubbleEnded(BubbleEnd(0, 0, 1, 0, sim.now - 5 * MS), received_ns=sim.now))
    assert sim.core.stats.bubbles == 1 and sim.core.stats.bubble_ns == MS
    assert sim.state("a") == S.PARKED
    assert grants(sim.start(predicted_ms=10)) == ["a"]  # the next bubble, still open, is granted


def _notes(actions: list) -> list[str]:
    from freeride._manager.core import Note

    return [a.message for a in actions if isinstance(a, Note)]


def test_a_second_rank_on_the_device_stops_grants_and_its_events_are_counted_apart_not_rejected() -> None:
    # Stranger trial: 4 ranks on 2 CPU devices; each rank's start closed the other's bubble as a lost end, whose
    # real end then counted as rejected (a quarter of the events), and side tasks ran while the other rank computed.
    sim = Sim()
    sim.resident("a")
    assert grants(sim.start(predicted_ms=10, rank=0)) == ["a"]
    sim.advance_ms(2)
    actions = sim.start(predicted_ms=10, rank=2)  # rank 2 starts waiting on the same device
    assert [n for n in _notes(actions) if "trainer ranks 0 and 2 report bubbles to this device" in n]
    assert not of(actions, Park) and sim.core.bubble is not None and sim.core.bubble.event.rank == 0
    assert sim.core.shared_by == (0, 2)
    sim.advance_ms(1)
    parked = of(sim.end(sim.core.bubble.event), Park)  # rank 0's own end still ends rank 0's bubble
    assert [p.task_id for p in parked] == ["a"]
    sim.parked("a", [1.0])
    for _ in range(3):  # rank 0's bubbles are measured but never granted while rank 2 shares the device
        sim.advance_ms(2)
        assert grants(sim.start(predicted_ms=10, rank=0)) == []
        sim.advance_ms(5)
        sim.end()
        sim.start(predicted_ms=10, rank=2)
        sim.advance_ms(1)
        sim.end()
    stats = sim.core.stats
    assert (stats.anomalies, stats.ignored_events) == (0, 0)
    assert stats.other_rank_events == 7 and stats.bubbles == 4
    # every one of rank 0's bubbles ended while rank 2 shared the device: counted, their time not the device's
    assert stats.shared_bubbles == 4 and stats.bubble_ns == 0
    # ... and their slot says so: `bubbles` marks them (a stranger read such rows as the device's idle time)
    assert {(s.rank, s.count, s.shared) for s in sim.core.slot_stats() if s.count} == {(0, 4, 4)}
    assert "trainer ranks 0, 2 share this device" in sim.core.waiting_reason(sim.core.tasks["a"])


def test_two_jobs_ranks_of_the_same_number_share_the_device_and_are_named_by_job() -> None:
    # A stranger ran two jobs at once on the same managers: both had a rank 0, their events were taken for one
    # rank's (mixed into one set of slots, a stream of "out of order" ends) and the side task was granted while
    # the other job computed.
    sim = Sim()
    sim.resident("a")
    assert grants(sim.start(predicted_ms=10, rank=0, job="first")) == ["a"]
    sim.advance_ms(1)
    first = sim.open
    actions = sim.start(predicted_ms=10, rank=0, job="second")  # the other job's rank 0 waits on the same device
    notes = [n for n in _notes(actions) if "report bubbles to this device" in n]
    assert notes and "trainer ranks 0 (job first) and 0 (job second)" in notes[0]
    assert sim.core.bubble is not None and sim.core.bubble.event == first  # not taken for a lost end
    sim.advance_ms(1)
    sim.end(job="second")
    assert [p.task_id for p in of(sim.end(first, job="first"), Park)] == ["a"]
    sim.parked("a", [1.0])
    sim.advance_ms(1)
    assert grants(sim.start(predicted_ms=10, rank=0, job="first")) == []
    stats = sim.core.stats
    assert (stats.anomalies, stats.ignored_events, stats.other_rank_events) == (0, 0, 2)
    assert sim.core.shared_by == (0, 0)
    assert "trainer ranks 0, 0 (of different jobs) share this device" in sim.core.waiting_reason(sim.core.tasks["a"])


def test_an_event_of_no_known_job_is_the_ranks_of_that_number_whose_job_is_known_and_the_reverse() -> None:
    # A trainer that reports no layout, or an event that came another way than its layout: the same rank.
    sim = Sim()
    sim.resident("a")
    assert grants(sim.start(predicted_ms=10, rank=0)) == ["a"]  # no job known yet
    sim.advance_ms(1)
    sim.end(job="run")  # its job learnt: the same rank
    sim.parked("a", [0.5])
    sim.advance_ms(1)
    assert grants(sim.start(predicted_ms=10, rank=0, job="run")) == ["a"]
    sim.advance_ms(1)
    sim.end(job="")
    stats = sim.core.stats
    assert stats.other_rank_events == 0 and sim.core.shared_by == () and sim.core.followed_rank == 0


def test_once_the_other_rank_falls_silent_the_device_is_granted_again() -> None:
    sim = Sim()
    sim.resident("a")
    assert grants(sim.start(predicted_ms=10, rank=1)) == ["a"]
    sim.advance_ms(1)
    sim.end()
    sim.parked("a", [0.5])
    sim.start(predicted_ms=10, rank=3)
    sim.advance_ms(1)
    sim.end()
    sim.advance_ms(1)
    assert sim.state("a") == S.PARKED
    assert grants(sim.start(predicted_ms=10, rank=1)) == []
    sim.advance_ms(1)
    sim.end()
    sim.advance_ms(6_000)  # rank 3 sent nothing for longer than RANK_LEFT_NS
    actions = sim.start(predicted_ms=10, rank=1)
    assert grants(actions) == ["a"]
    assert [n for n in _notes(actions) if "no longer shared by trainer ranks (only trainer rank 1 reports" in n]
    assert sim.core.shared_by == () and sim.core.waiting_reason(sim.core.tasks["a"]) == ""
    assert sim.core.stats.shared_bubbles == 1  # the one rank 1 had while rank 3 was there; the first counts


def test_when_the_followed_rank_falls_silent_the_device_follows_the_rank_that_reports() -> None:
    # A new run of the trainer on another rank of this device: its waits are the device's bubbles.
    sim = Sim()
    sim.resident("a")
    sim.start(predicted_ms=10, rank=0)
    sim.advance_ms(1)
    sim.end()
    sim.advance_ms(6_000)
    assert grants(sim.start(predicted_ms=10, rank=5)) == ["a"]
    assert sim.core.followed_rank == 5 and sim.core.shared_by == ()
    assert sim.core.stats.other_rank_events == 0


def test_a_new_runs_layout_starts_the_ranks_afresh_so_its_rank_is_not_taken_for_a_second_one() -> None:
    from freeride._manager.core import LayoutChanged
    from freeride.messages import TrainerLayout

    sim = Sim()
    sim.resident("a")
    sim.start(predicted_ms=10, rank=0)  # the last run: rank 0 on this device
    sim.advance_ms(1)
    sim.end()
    sim.parked("a", [0.5])
    sim.advance_ms(100)
    layout = TrainerLayout("1f1b", 2, 8, (), sim.now, -1, "run-2")
    notes = _notes(sim.send(LayoutChanged(layout, sim.now, True)))
    assert notes and "trainer layout" in notes[0]
    actions = sim.start(predicted_ms=10, rank=1)  # the new run put rank 1 here, within 5 s of rank 0's last event
    assert grants(actions) == ["a"] and not [n for n in _notes(actions) if "report bubbles" in n]
    assert sim.core.followed_rank == 1 and sim.core.shared_by == ()


def test_after_training_a_shared_device_stops_being_shared_on_its_own_5_s_after_the_other_ranks_last_event() -> None:
    # Stranger trial: 80 s after a 4-rank run ended, `ls` still said the ranks share the device: the state changed
    # only on events, and none came.
    sim = Sim()
    sim.resident("a")
    sim.start(predicted_ms=10, rank=0)
    sim.advance_ms(1)
    sim.end()
    sim.start(predicted_ms=10, rank=2)
    last = sim.now
    sim.advance_ms(1)
    sim.end()  # rank 2's last event; rank 0's came before
    assert sim.core.shared_by == (0, 2)
    assert sim.core.next_timer_ns() == last + MS + 5_000 * MS + 1  # rank 2's end was its last event
    assert sim.core.shared_quiet_ns(sim.now) == 0
    assert "trainer ranks 0, 2 share this device" in sim.core.waiting_reason(sim.core.tasks["a"], sim.now)
    sim.advance_ms(4_000)
    assert not _notes(sim.tick()) and sim.core.shared_by == (0, 2)
    # quiet for 4 s: still counted as shared, and said in the past tense (a stranger read "share" as now)
    assert sim.core.shared_quiet_ns(sim.now) == 4_000 * MS
    assert "trainer ranks 0, 2 shared this device until 4 s ago (no event from them since)" in \
        sim.core.waiting_reason(sim.core.tasks["a"], sim.now)
    sim.at(last + MS + 5_000 * MS + 1)
    notes = _notes(sim.tick())
    assert notes == ["this device is no longer shared by trainer ranks (no trainer rank has reported for 5 s): its "
                     "bubbles are granted again"]
    assert sim.core.shared_by == () and sim.core.next_timer_ns() is None
    assert "share" not in sim.core.waiting_reason(sim.core.tasks["a"])
    assert grants(sim.start(predicted_ms=10, rank=2)) == ["a"]  # the next job's rank, alone: granted


def test_a_ranks_waits_on_a_shared_device_are_not_counted_as_its_bubble_time() -> None:
    sim = Sim()
    sim.start(predicted_ms=10, rank=0)
    sim.advance_ms(2)
    sim.end()
    alone = sim.core.stats.bubble_ns
    assert alone == 2 * MS
    sim.start(predicted_ms=10, rank=1)
    sim.advance_ms(1)
    sim.end()
    sim.start(predicted_ms=10, rank=0)
    sim.advance_ms(3)
    sim.end()
    assert sim.core.stats.bubble_ns == alone and sim.core.stats.bubbles == 2


def test_a_slots_stats_carry_the_mean_of_its_lengths_beside_their_percentiles() -> None:
    # Stranger trial: `bubbles` summed slot medians (16.7 ms an iteration) where `stats` read 35.7 ms.
    sim = Sim()
    for length_ms in (1, 1, 1, 10):
        sim.start(predicted_ms=5)
        sim.advance_ms(length_ms)
        sim.end()
        sim.advance_ms(1)
    (slot,) = sim.core.slot_stats()
    assert slot.length_ms.p50 == pytest.approx(1.0) and slot.length_mean_ms == pytest.approx(3.25)
