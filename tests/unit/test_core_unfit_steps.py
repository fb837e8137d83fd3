"""A resident task whose step fits no bubble the trainer makes: the trainer's events decide nothing, so the loop may
read them late (``SchedulerCore.wants_trainer_events``), and the bubbles read so still count towards its re-probe."""

from __future__ import annotations

from core_sim import MS, Sim, of

from freeride._manager.core import Action, BubbleStarted, Grant
from freeride._manager.core.steps import MAX_REPROBE_DOUBLINGS, StepHealth
from freeride.messages import BubbleStart


def _beside(lengths_ms: list[float], step_ms: float, **config: int) -> Sim:
    """A parked task of ``step_ms`` steps beside slot 0's bubbles of these lengths; margin 0.2 ms."""
    config.setdefault("margin_ns", MS // 5)
    sim = Sim(**config)
    for length in lengths_ms:
        sim.advance_ms(1)
        sim.start(predicted_ms=length)
        sim.advance_ms(length)
        sim.end()
    sim.resident("a")
    sim.core.tasks["a"].estimator.extend([int(step_ms * MS)] * 8)
    return sim


def _feed_over(sim: Sim, length_ms: float, predicted_ms: float = 0.5) -> list[Action]:
    """A bubble of slot 0 read after its end (a lazy read, or a loop that fell behind: ``loop.with_ends_known``)."""
    sim.advance_ms(1)
    sim.iteration += 1
    start = BubbleStart(stage=0, rank=0, iteration=sim.iteration, slot=0, kind="fwd", start_ns=sim.now,
                        predicted_ns=int(predicted_ms * MS), free_memory_bytes=-1)
    end = sim.now + int(length_ms * MS)
    sim.at(end + MS)
    out = sim.send(BubbleStarted(bubble=start, received_ns=sim.now, end_ns=end))
    sim.open = start
    return out + sim.end(end_ns=end)


def test_a_parked_task_whose_step_fits_no_bubble_lets_the_events_be_read_late() -> None:
    sim = _beside([0.5, 1.0] * 8, step_ms=2.0)
    assert not sim.core.wants_trainer_events()


def test_a_parked_task_whose_step_fits_a_slots_longest_recent_length_wants_each_event() -> None:
    # 0.7 ms + 0.2 ms margin fits the 1 ms waits: a late re-offer can take them once the bubble outlived 0.5 ms.
    sim = _beside([0.5, 1.0] * 8, step_ms=0.7)
    assert sim.core.wants_trainer_events()


def test_a_longer_wait_brings_the_events_back_and_short_ones_let_them_go_again() -> None:
    sim = _beside([0.5] * 16, step_ms=2.0)
    assert not sim.core.wants_trainer_events()
    _feed_over(sim, 4.0)  # a 4 ms wait: now its slot's longest recent length, which the step fits
    assert sim.core.wants_trainer_events()
    for _ in range(15):
        _feed_over(sim, 0.5)
    assert sim.core.wants_trainer_events()
    _feed_over(sim, 0.5)  # ... until 16 shorter ones have followed it
    assert not sim.core.wants_trainer_events()


def test_a_task_holding_a_bubble_or_whose_step_is_not_known_wants_each_event() -> None:
    sim = _beside([0.5] * 16, step_ms=2.0)
    sim.resident("b")  # no step time yet: its probe takes the next bubble
    assert sim.core.wants_trainer_events()
    sim.advance_ms(1)
    assert [g.task_id for g in of(sim.start(predicted_ms=0.5), Grant)] == ["b"]
    sim.core.tasks["b"].estimator.extend([3 * MS] * 8)
    assert sim.core.wants_trainer_events()  # b holds the bubble: its end parks b


def test_the_reference_policy_wants_each_event_while_a_task_is_resident() -> None:
    sim = Sim(policy="paper")  # type: ignore[arg-type]
    sim.resident("a")
    sim.core.tasks["a"].estimator.extend([50 * MS] * 8)  # the reference's worker decides what fits, not the core
    assert sim.core.wants_trainer_events()


def test_bubbles_read_over_count_towards_the_reprobe_of_a_step_that_fits_none() -> None:
    sim = _beside([0.5] * 16, step_ms=2.0, reprobe_after_bubbles=5)
    task = sim.core.tasks["a"]
    for n in range(1, 4):
        assert of(_feed_over(sim, 0.5), Grant) == []
        assert task.health.unfit_bubbles == n and not sim.core.wants_trainer_events()
    _feed_over(sim, 0.5)
    assert task.health.unfit_bubbles == 4 and sim.core.wants_trainer_events()  # its re-probe is the next bubble
    sim.advance_ms(1)
    [grant] = of(sim.start(predicted_ms=0.5), Grant)
    assert grant.task_id == "a" and grant.probe


def test_a_bubble_read_over_that_the_step_would_have_fitted_is_not_counted_unfit() -> None:
    sim = _beside([0.5] * 16, step_ms=2.0)
    _feed_over(sim, 3.0)
    assert sim.core.tasks["a"].health.unfit_bubbles == 0


def test_the_reach_is_the_longest_recent_length_or_latest_prediction_over_the_slots() -> None:
    sim = Sim()
    bubbles = sim.core.bubbles
    assert bubbles.reach_ns() == 0  # no slot yet
    for length in [0.5, 1.0] * 8:
        sim.advance_ms(1)
        sim.start(predicted_ms=0.5)
        sim.advance_ms(length)
        sim.end()
    assert bubbles.reach_ns() == MS
    sim.advance_ms(1)
    sim.start(predicted_ms=3.0, slot=1)  # slot 1's prediction: a grant there could be sized to it
    assert bubbles.reach_ns() == 3 * MS
    sim.advance_ms(1.5)
    sim.end()
    assert bubbles.reach_ns() == 3 * MS  # its length and its prediction: the prediction is longer
    sim.advance_ms(1)
    sim.start(predicted_ms=0.2, slot=1)
    sim.advance_ms(0.3)
    sim.end()
    assert bubbles.reach_ns() == 3 * MS // 2  # slot 1's longest recent length now


def _reprobe(sim: Sim, step_ms: float) -> None:
    """Bubbles of 0.5 ms until task a is re-probed; its probe step takes ``step_ms`` again."""
    for _ in range(10_000):
        sim.advance_ms(1)
        grants = of(sim.start(predicted_ms=0.5), Grant)
        if grants:
            break
    assert [(g.task_id, g.probe) for g in grants] == [("a", True)]
    sim.advance_ms(0.5)
    sim.end()
    sim.advance_ms(step_ms)
    sim.parked("a", [step_ms] * 3, reason="park")


def test_each_reprobe_that_finds_the_step_fitting_no_bubble_doubles_the_wait_for_the_next() -> None:
    sim = _beside([0.5] * 16, step_ms=2.0, reprobe_after_bubbles=5)
    task = sim.core.tasks["a"]
    counts = []
    for _ in range(4):
        before = sim.iteration
        _reprobe(sim, 2.0)
        counts.append(sim.iteration - before)
    assert counts == [5, 10, 20, 40]
    assert task.health.reprobes == 4


def test_a_step_that_fits_a_bubble_again_brings_the_reprobes_back_to_the_first_wait() -> None:
    sim = _beside([0.5] * 16, step_ms=2.0, reprobe_after_bubbles=5)
    task = sim.core.tasks["a"]
    _reprobe(sim, 2.0)
    _reprobe(sim, 2.0)
    assert task.health.reprobes == 2
    sim.advance_ms(1)
    [grant] = of(sim.start(predicted_ms=3.0), Grant)  # a bubble its step fits
    assert grant.task_id == "a" and not grant.probe
    assert task.health.reprobes == 0
    sim.advance_ms(2)
    sim.parked("a", [2.0], reason="deadline")
    sim.end()
    before = sim.iteration
    _reprobe(sim, 2.0)
    assert sim.iteration - before == 5


def test_the_doubling_stops_at_its_cap() -> None:
    health = StepHealth(reprobes=MAX_REPROBE_DOUBLINGS + 3)
    assert health.reprobe_after(200) == 200 << MAX_REPROBE_DOUBLINGS
