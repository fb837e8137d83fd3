"""Park latency (``Stats.park_latency_ms``): every grant that its bubble's end ends records exactly one, by
whichever path the end reached the worker or the core first, and a grant that ended otherwise records none.

An end has four ways to end a grant (``docs/architecture.md``, "A bubble's end stops new steps at once"):
the core's park after the end event, the trainer's end board read by the worker (reason ``ended``), the
worker's ended-grant word set by the end path before the core took the end event (the stream's servicer
thread as it decodes the end, or the loop on the trainer's own end: reason ``park``), and the freeze of a
step still running at the end + grace. The latency runs from when the manager learned of the end (the end
event's arrival, or the trainer's own end, ``TrainerEndSeen``, where that came first); 0 when the worker
learned of it first. The core counts each once in whatever order these reach it. The word's parks counted
nothing, and with a trainer on the manager's host they were most grants under load (a fresh-clone CI run:
`stats` showed park latencies for fewer than half of the grants).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from core_sim import MS, S, Sim, of

from freeride._manager.core import Freeze, Grant, TrainerEndSeen

GRACE_NS = MS // 2


def _granted(sim: Sim) -> Grant:
    sim.resident("a")
    grant = of(sim.start(predicted_ms=60), Grant)[0]
    sim.advance_ms(20)
    return grant


def the_end_event_then_the_cores_park(sim: Sim, grant: Grant, end_ns: int) -> float:
    sim.advance_ms(0.3)
    sim.end(end_ns=end_ns)
    received = sim.now
    sim.advance_ms(0.2)
    sim.parked("a", [0.5], reason="park", seen_end_ns=end_ns)
    return (sim.now - received) / MS


def the_end_event_then_the_board(sim: Sim, grant: Grant, end_ns: int) -> float:
    sim.advance_ms(0.3)
    sim.end(end_ns=end_ns)
    received = sim.now
    sim.advance_ms(0.1)
    sim.parked("a", [0.5], reason="ended", seen_end_ns=end_ns)
    return (sim.now - received) / MS


def the_board_before_anything(sim: Sim, grant: Grant, end_ns: int) -> float:
    sim.advance_ms(0.1)
    sim.parked("a", [0.5], reason="ended", seen_end_ns=end_ns)
    return 0.0


def the_word_set_by_the_stream_before_the_core_took_the_end(sim: Sim, grant: Grant, end_ns: int) -> float:
    # The stream's thread set the word as it decoded the end; the end still waits in the inbox.
    sim.advance_ms(0.4)
    sim.parked("a", [0.5], reason="park", seen_end_ns=end_ns)
    return 0.0


def the_word_set_on_the_trainers_end_before_the_end_event(sim: Sim, grant: Grant, end_ns: int) -> float:
    # The loop read the trainer's own end, set the word and told the core; the worker parked on the word
    # before the core took the end event (a local end is fed right after its end seen).
    sim.advance_ms(0.05)
    sim.send(TrainerEndSeen("a", grant.grant_id, end_ns))
    sim.advance_ms(0.35)
    sim.parked("a", [0.5], reason="park", seen_end_ns=end_ns)
    return (sim.now - end_ns) / MS


def the_board_after_the_trainers_end(sim: Sim, grant: Grant, end_ns: int) -> float:
    sim.advance_ms(0.05)
    sim.send(TrainerEndSeen("a", grant.grant_id, end_ns))
    sim.advance_ms(0.1)
    sim.parked("a", [0.5], reason="ended", seen_end_ns=end_ns)
    return (sim.now - end_ns) / MS


def a_freeze_at_the_trainers_end_then_a_stale_park(sim: Sim, grant: Grant, end_ns: int) -> float:
    sim.advance_ms(0.05)
    sim.send(TrainerEndSeen("a", grant.grant_id, end_ns))
    sim.at(end_ns + GRACE_NS)
    assert of(sim.tick(), Freeze) == [Freeze("a")]
    frozen_at = sim.now
    sim.advance_ms(0.1)
    sim.parked("a", [0.5], reason="park", grant_id=grant.grant_id, seen_end_ns=end_ns)  # sent before the freeze
    return (frozen_at - end_ns) / MS


def a_freeze_after_the_end_event(sim: Sim, grant: Grant, end_ns: int) -> float:
    sim.advance_ms(0.3)
    sim.end(end_ns=end_ns)
    received = sim.now
    sim.at(received + GRACE_NS)
    assert of(sim.tick(), Freeze) == [Freeze("a")]
    return GRACE_NS / MS


ENDS = [the_end_event_then_the_cores_park, the_end_event_then_the_board, the_board_before_anything,
        the_word_set_by_the_stream_before_the_core_took_the_end, the_word_set_on_the_trainers_end_before_the_end_event,
        the_board_after_the_trainers_end, a_freeze_at_the_trainers_end_then_a_stale_park, a_freeze_after_the_end_event]


@pytest.mark.parametrize("path", ENDS, ids=lambda path: path.__name__)
def test_a_grant_ended_by_its_bubbles_end_records_one_park_latency(
    path: Callable[[Sim, Grant, int], float]
) -> None:
    sim = Sim(grace_ns=GRACE_NS)
    grant = _granted(sim)
    end_ns = sim.now  # the bubble ends at a third of its prediction, the worker mid-grant
    expected_ms = path(sim, grant, end_ns)
    assert sim.state("a") in (S.PARKED, S.FROZEN)
    # Whatever has not come yet comes now: the end event, then a while with nothing due.
    if sim.core.bubbles.open is not None:
        sim.advance_ms(0.5)
        sim.end(end_ns=end_ns)
    sim.advance_ms(100)
    sim.tick()
    assert list(sim.core.stats.park_latency_ms) == [pytest.approx(expected_ms)]


def test_a_grant_its_worker_ended_before_the_bubbles_end_records_no_park_latency() -> None:
    # The worker's own deadline (its step no longer fit) ended the grant: no end parked it.
    sim = Sim(grace_ns=GRACE_NS)
    _granted(sim)
    sim.parked("a", [0.5], reason="deadline")
    sim.advance_ms(1)
    sim.end()
    assert list(sim.core.stats.park_latency_ms) == []


def test_a_freeze_at_the_predicted_end_with_no_end_known_records_no_park_latency() -> None:
    # No end came, by the end event or from the trainer: the grant ended at its deadline, not by an end.
    sim = Sim(grace_ns=GRACE_NS)
    _granted(sim)
    sim.advance_ms(40.5)
    assert of(sim.tick(), Freeze) == [Freeze("a")]
    assert list(sim.core.stats.park_latency_ms) == []
