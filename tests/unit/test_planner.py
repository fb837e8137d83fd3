"""The planner: configurations evaluated, the Pareto front, side tasks fitted to stages and slots."""

from __future__ import annotations

import pytest

from freeride._manager.core import CoreConfig
from freeride.errors import ConfigError
from freeride.training.memory import PRECISIONS, RUNTIMES, MeasuredStages, TransformerDims
from freeride.training.planner import (
    DEFAULT_HEADROOM_BYTES,
    DEFAULT_MARGIN_MS,
    Candidate,
    Costs,
    MemoryInputs,
    PlanInputs,
    SideTaskDemand,
    candidates,
    fit_tasks,
    pareto_flags,
    plan_config,
    sweep,
)

GIB = 2**30
MIB = 2**20


def _dims(microbatch_size: int = 1) -> TransformerDims:
    return TransformerDims(layers=8, hidden=256, heads=4, seq_len=128, microbatch_size=microbatch_size, vocab=512)


def _memory(dims: TransformerDims | None = None, runtime: str = "lean") -> MemoryInputs:
    return MemoryInputs(dims or _dims(), PRECISIONS["fp32"], "adam", RUNTIMES[runtime])


def test_the_planners_defaults_are_the_managers_though_it_never_imports_the_manager() -> None:
    assert CoreConfig().margin_ns == DEFAULT_MARGIN_MS * 1e6
    assert CoreConfig().headroom_bytes == DEFAULT_HEADROOM_BYTES


# ------------------------------------------------------------------ Pareto


def test_pareto_keeps_exactly_the_non_dominated_points() -> None:
    points = [(1, 1), (2, 2), (1, 2), (2, 1), (0, 3), (0, 3)]
    # (2,2), (1,2) and (2,1) are dominated by (1,1); the two (0,3) tie and dominate nothing of (1,1).
    assert pareto_flags(points) == [True, False, False, False, True, True]
    assert pareto_flags([]) == []
    assert pareto_flags([(5.0, 1.0, -2.0)]) == [True]


def test_sweep_marks_no_configuration_that_another_beats_on_every_objective() -> None:
    inputs = PlanInputs(stages=4, memory=_memory(), device_memory_bytes=GIB, microbatch_size=1)
    result = sweep(inputs, candidates(4, microbatches=[4, 8, 16], virtuals=[2]))
    assert result.objectives == ("bubble_fraction", "peak_bytes", "harvest_rate_bytes")

    def key(p):  # every objective minimised
        return (p.bubble_fraction, p.peak_bytes, -p.harvest_rate_bytes)

    for p in result.plans:
        beaten = any(
            all(a <= b for a, b in zip(key(q), key(p), strict=True)) and key(q) != key(p) for q in result.plans
        )
        assert p.pareto == (not beaten)
    assert result.pareto  # something is always on the front


def test_a_configuration_over_the_device_memory_is_never_pareto() -> None:
    inputs = PlanInputs(stages=2, memory=_memory(), device_memory_bytes=200 * MIB, microbatch_size=1)
    result = sweep(inputs, [Candidate("gpipe", m) for m in (2, 16, 64)])
    over = [p for p in result.plans if p.fits_device is False]
    assert over and not any(p.pareto for p in over)
    assert any(p.pareto for p in result.plans if p.fits_device)


def test_objectives_are_only_those_the_inputs_make_known() -> None:
    assert sweep(PlanInputs(stages=2), candidates(2)).objectives == ("bubble_fraction",)
    with_memory = sweep(PlanInputs(stages=2, memory=_memory()), candidates(2, ["1f1b"]))
    assert with_memory.objectives == ("bubble_fraction", "peak_bytes")
    assert all(p.harvest_rate_bytes is None for p in with_memory.plans)


def test_invalid_candidates_are_listed_with_the_reason() -> None:
    result = sweep(PlanInputs(stages=4, memory=_memory()),
                   [Candidate("1f1b", 2), Candidate("interleaved-1f1b", 6, 2), Candidate("interleaved-1f1b", 8, 4),
                    Candidate("gpipe", 4)])
    reasons = {c.label: why for c, why in result.rejected}
    assert "micro-batches (2) >= stages (4)" in reasons["1f1b m=2"]
    assert "multiple of stages" in reasons["interleaved-1f1b m=6 v=2"]
    assert "cannot split 8 layers over 16" in reasons["interleaved-1f1b m=8 v=4"]
    assert [p.candidate.label for p in result.plans] == ["gpipe m=4"]


def test_default_sweep_covers_every_schedule_and_p_2p_4p_8p() -> None:
    cands = candidates(2)
    assert {c.schedule for c in cands} == {"gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "interleaved-zb",
                                           "looped-bfs", "zbv", "dualpipev"}
    assert sorted({c.microbatches for c in cands}) == [2, 4, 8, 16]
    assert {c.virtual for c in cands if c.schedule in ("interleaved-1f1b", "interleaved-zb", "looped-bfs")} == {2}
    assert {c.virtual for c in cands if c.schedule in ("zbv", "dualpipev")} == {2}
    assert {c.virtual for c in candidates(2, ["zbv", "looped-bfs"], [4], [2, 4])} == {2, 4}
    assert {c.virtual for c in candidates(2, ["zbv"], [4], [3, 4])} == {2}
    with pytest.raises(ConfigError, match="unknown schedule"):
        candidates(2, ["pipedream"])


# ------------------------------------------------------------------ one configuration


def test_bubble_fraction_and_iteration_include_the_optimizer_step() -> None:
    plan = plan_config(PlanInputs(stages=4, costs=Costs(1.0, 2.0, t_step_ms=3.0)), Candidate("1f1b", 8))
    assert plan.iteration_ms == pytest.approx(33.0 + 3.0)
    assert plan.bubble_fraction == pytest.approx(4 * 9.0 / (4 * 36.0))
    assert [s.idle_ms for s in plan.stages] == pytest.approx([9.0] * 4)


def test_1f1b_memory_is_flat_in_m_and_gpipe_grows_with_fixed_microbatch_size() -> None:
    inputs = PlanInputs(stages=4, memory=_memory())
    one = [plan_config(inputs, Candidate("1f1b", m)) for m in (4, 8, 16)]
    gpipe = [plan_config(inputs, Candidate("gpipe", m)) for m in (4, 8, 16)]
    assert len({p.peak_bytes for p in one}) == 1
    assert [s.peak_in_flight for s in one[0].stages] == [4, 3, 2, 1]
    assert gpipe[0].peak_bytes < gpipe[1].peak_bytes < gpipe[2].peak_bytes


def test_a_global_batch_splits_into_smaller_microbatches_and_scales_times() -> None:
    inputs = PlanInputs(stages=2, costs=Costs(4.0, 8.0), memory=_memory(_dims(8)), global_batch=32,
                        microbatch_size=8)
    four, sixteen = plan_config(inputs, Candidate("1f1b", 4)), plan_config(inputs, Candidate("1f1b", 16))
    assert (four.microbatch_size, sixteen.microbatch_size) == (8, 2)
    assert four.schedule.t_forward == 4.0 and sixteen.schedule.t_forward == 1.0
    # Same work per iteration: 1F1B keeps p - s micro-batches in flight, now 4x smaller.
    assert sixteen.stages[0].peak.activations < four.stages[0].peak.activations
    with pytest.raises(ConfigError, match="does not split into 5"):
        plan_config(inputs, Candidate("gpipe", 5))


def test_measured_activation_bytes_scale_with_the_microbatch_under_a_global_batch() -> None:
    measured = MeasuredStages((4 * MIB, 4 * MIB), (10 * MIB, 6 * MIB))
    mem = MemoryInputs(measured, PRECISIONS["fp32"], "adam", RUNTIMES["lean"])
    inputs = PlanInputs(stages=2, memory=mem, global_batch=8, microbatch_size=2)
    at_2 = plan_config(inputs, Candidate("gpipe", 4))  # micro-batches of 2, as measured
    at_1 = plan_config(inputs, Candidate("gpipe", 8))
    assert at_2.stages[0].peak.activations == 4 * 10 * MIB
    assert at_1.stages[0].peak.activations == 8 * 5 * MIB


def test_free_memory_per_slot_budget_and_harvest_follow_from_the_held_bytes() -> None:
    device = 2 * GIB
    inputs = PlanInputs(stages=2, memory=_memory(), device_memory_bytes=device, headroom_bytes=100 * MIB)
    plan = plan_config(inputs, Candidate("1f1b", 4))
    for stage in plan.stages:
        for slot in stage.slots:
            assert slot.free_bytes == device - slot.held_bytes
        assert stage.budget_bytes == device - stage.peak.total_bytes - 100 * MIB
        assert stage.harvest_byte_seconds == pytest.approx(sum(s.length_ms / 1e3 * s.free_bytes for s in stage.slots))
    total = sum(s.harvest_byte_seconds for s in plan.stages)
    assert plan.harvest_rate_bytes == pytest.approx(total / (plan.iteration_ms / 1e3))


def test_dimensions_must_be_for_the_microbatch_size_of_the_costs() -> None:
    with pytest.raises(ConfigError, match="micro-batch size 4"):
        PlanInputs(stages=2, memory=_memory(_dims(4)), microbatch_size=1)


# ------------------------------------------------------------------ fitting side tasks


def test_a_step_fits_a_slot_when_step_plus_margin_is_at_most_its_length() -> None:
    # 1F1B p=2 m=2, t_f=1, t_b=2: stage 0 waits 3 ms before its first backward.
    plan = plan_config(PlanInputs(stages=2), Candidate("1f1b", 2))
    stage0 = plan.stages[0]
    lengths = {s.index: s.length_ms for s in stage0.slots}
    longest = max(lengths.values())
    exact = SideTaskDemand("exact", MIB, longest - 0.5)
    over = SideTaskDemand("over", MIB, longest - 0.5 + 1e-6)
    fits = fit_tasks([stage0], [exact, over], margin_ms=0.5)
    assert fits[0].slots and fits[0].fits and fits[0].memory_fits is None
    assert fits[0].usable_ms == pytest.approx(sum(v for v in lengths.values() if v >= longest))
    assert not fits[1].slots and not fits[1].fits


def test_a_task_over_the_stage_budget_does_not_fit_even_where_its_step_does() -> None:
    device = 2 * GIB
    inputs = PlanInputs(stages=2, memory=_memory(), device_memory_bytes=device, headroom_bytes=0,
                        tasks=(SideTaskDemand("small", MIB, 0.1), SideTaskDemand("huge", device, 0.1)))
    plan = plan_config(inputs, Candidate("1f1b", 4))
    assert plan.fitting_stages("small") == (0, 1)
    assert plan.fitting_stages("huge") == ()
    assert all(f.slots and f.memory_fits is False for f in plan.fits if f.task == "huge")


def test_side_task_specs_parse_and_reject_clearly() -> None:
    t = SideTaskDemand.parse("name=pagerank, memory=2GiB, step_ms=3.5")
    assert (t.name, t.memory_bytes, t.step_ms) == ("pagerank", 2 * GIB, 3.5)
    assert SideTaskDemand.from_mapping({"name": "x", "memory": 1024, "step_ms": 1}).memory_bytes == 1024
    for text, match in [
        ("name=x,memory=1GiB", "missing step_ms"),
        ("name=x,memory=lots,step_ms=1", "cannot parse size"),
        ("name=x,memory=1GiB,step_ms=-2", "step_ms must be a number > 0"),
        ("name=x,memory=1GiB,step_ms=fast", "step_ms must be a number"),
        ("name=x,memory=1GiB,step_ms=1,gpu=1", "unknown field"),
        ("pagerank", "key=value"),
    ]:
        with pytest.raises(ConfigError, match=match):
            SideTaskDemand.parse(text)
    with pytest.raises(ConfigError, match="unique"):
        PlanInputs(stages=2, tasks=(t, t))
