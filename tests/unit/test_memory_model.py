"""The per-stage memory model: in-flight counts from the schedule walk, formulas, byte accounting."""

from __future__ import annotations

import pytest

from freeride.errors import ConfigError
from freeride.training.memory import (
    PRECISIONS,
    RUNTIMES,
    ChunkMemory,
    MeasuredStages,
    TransformerDims,
    block_params,
    chunk_memory,
    in_flight_counts,
    rank_memory,
    transformer_chunks,
)
from freeride.training.schedules import BOUNDARY, Action, build_schedule

FP32 = PRECISIONS["fp32"]


# ------------------------------------------------------------------ in flight, from the walk


@pytest.mark.parametrize("p,m", [(2, 2), (2, 8), (4, 4), (4, 16), (8, 8), (5, 7)])
def test_1f1b_keeps_p_minus_s_microbatches_in_flight_on_stage_s(p: int, m: int) -> None:
    s = build_schedule("1f1b", p, m)
    for r in range(p):
        counts = in_flight_counts(s.orders[r])
        assert max(counts) == p - r
        assert counts[0] == 0 and counts[-1] == 0


@pytest.mark.parametrize("p,m", [(2, 2), (2, 8), (4, 4), (4, 16), (3, 1)])
def test_gpipe_keeps_every_microbatch_in_flight(p: int, m: int) -> None:
    s = build_schedule("gpipe", p, m)
    for r in range(p):
        assert max(in_flight_counts(s.orders[r])) == m


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (4, 16, 4), (3, 6, 3), (2, 2, 2)])
def test_interleaved_warms_up_megatron_style_in_chunk_units(p: int, m: int, v: int) -> None:
    # Rank r runs 2 (p - r - 1) + (v - 1) p chunk-forwards before its first backward, then one more.
    s = build_schedule("interleaved-1f1b", p, m, virtual=v)
    for r in range(p):
        assert max(in_flight_counts(s.orders[r])) == min(m * v, 2 * (p - r - 1) + (v - 1) * p + 1)


def test_interleaved_hand_walk_of_two_stages_four_microbatches() -> None:
    s = build_schedule("interleaved-1f1b", 2, 4, virtual=2)
    # Rank 0: F0.0 F1.0 F0.1 F1.1 | F2.0 B0.1 F3.0 B1.1 F2.1 B0.0 F3.1 B1.0 | B2.1 B3.1 B2.0 B3.0
    assert in_flight_counts(s.orders[0]) == [0, 1, 2, 3, 4, 5, 4, 5, 4, 5, 4, 5, 4, 3, 2, 1, 0]


@pytest.mark.parametrize("p,m", [(2, 4), (4, 4), (4, 8), (6, 12)])
def test_zb_h1_keeps_p_in_flight_on_every_stage_because_w_holds_state(p: int, m: int) -> None:
    s = build_schedule("zb-h1", p, m)
    one_f_one_b = build_schedule("1f1b", p, m)
    for r in range(p):
        assert max(in_flight_counts(s.orders[r])) == p
        assert max(in_flight_counts(s.orders[r])) >= max(in_flight_counts(one_f_one_b.orders[r]))


def test_input_pass_keeps_state_until_weight_pass() -> None:
    order = [Action("F", 0, 0), Action("I", 0, 0), Action("F", 0, 1), Action("W", 0, 0), Action("B", 0, 1)]
    assert in_flight_counts(order) == [0, 1, 1, 2, 1, 0]


# ------------------------------------------------------------------ formulas


def test_parameter_counts_of_the_reference_gpt_by_hand() -> None:
    # d=128, 4 layers, V=256, s=64 (the reference trainer's defaults), split over 2 chunks.
    dims = TransformerDims(layers=4, hidden=128, heads=4, seq_len=64, microbatch_size=4, vocab=256)
    assert block_params(dims) == 12 * 128 * 128 + 13 * 128 == 198_272
    first, last = transformer_chunks(dims, 2, FP32)
    assert first.params == 2 * 198_272 + (256 + 64) * 128 == 437_504  # blocks + token and position tables
    assert last.params == 2 * 198_272 + 2 * 128 + 256 * 128 == 429_568  # blocks + final norm + head


def test_parameter_counts_match_the_reference_models_modules() -> None:
    pytest.importorskip("torch")
    from freeride.workload.model import GPTConfig, build_chunk

    dims = TransformerDims(layers=5, hidden=64, heads=4, seq_len=32, microbatch_size=2, vocab=96)
    cfg = GPTConfig(vocab=96, d_model=64, heads=4, layers=5, seq_len=32)
    for chunks in (1, 2, 3):
        for c, mem in enumerate(transformer_chunks(dims, chunks, FP32)):
            assert mem.params == sum(p.numel() for p in build_chunk(cfg, c, chunks).parameters())


def test_static_bytes_of_adam_in_fp32_and_mixed_precision_by_hand() -> None:
    chunks = (ChunkMemory(1000, 0, 0, 0, 0), ChunkMemory(3000, 0, 0, 0, 0))
    s = build_schedule("1f1b", 2, 2)
    lean = RUNTIMES["lean"]
    fp32 = rank_memory(s, 0, chunks, FP32, "adam", lean).peak
    assert (fp32.weights, fp32.gradients, fp32.optimizer) == (4000, 4000, 8000)  # 16 bytes per parameter
    mixed = rank_memory(s, 1, chunks, PRECISIONS["bf16-mixed"], "adam", lean).peak
    assert (mixed.weights, mixed.gradients, mixed.optimizer) == (6000, 12000, 36000)  # 2 + 4 + (4 + 8)
    sgd = rank_memory(s, 1, chunks, FP32, "sgd", lean).peak
    assert sgd.optimizer == 0


def test_activation_bytes_of_a_tiny_gpt_by_hand() -> None:
    # h=8, a=2, s=4, b=1, V=16, fp32: N = s b h = 32 elements.
    dims = TransformerDims(layers=2, hidden=8, heads=2, seq_len=4, microbatch_size=1, vocab=16)
    first, last = transformer_chunks(dims, 2, FP32)
    block = 16 * 32 * 4 + 2 * 2 * 4 * 4 + 2 * 4 * 4  # (8 + 2f) N fp32 + LayerNorm stats + log-sum-exp
    assert first.activation_bytes == block + 4 * 8  # + token ids
    # The received input is not the chunk's; the final norm's input and output, its stats, the
    # log-softmax and the targets are.
    assert last.activation_bytes == block - 32 * 4 + 2 * 32 * 4 + 2 * 4 * 4 + 4 * 16 * 4 + 4 * 8
    assert (first.input_bytes, first.output_bytes) == (0, 32 * 4)
    assert (last.input_bytes, last.output_bytes) == (32 * 4, 4 * 16 * 4)


def test_plain_attention_adds_the_softmax_matrix() -> None:
    flash = TransformerDims(layers=1, hidden=8, heads=2, seq_len=4, microbatch_size=1, vocab=16)
    plain = TransformerDims(layers=1, hidden=8, heads=2, seq_len=4, microbatch_size=1, vocab=16,
                            flash_attention=False)
    (a,), (b,) = transformer_chunks(flash, 1, FP32), transformer_chunks(plain, 1, FP32)
    assert b.activation_bytes - a.activation_bytes == 2 * 4 * 4 * 4 - 2 * 4 * 4  # a b s^2 d - a b s fp32


def test_formula_matches_what_autograd_saves_in_the_reference_model() -> None:
    torch = pytest.importorskip("torch")
    from freeride.workload.model import GPTConfig, build_chunk, lm_loss

    cfg = GPTConfig(vocab=96, d_model=64, heads=4, layers=4, seq_len=32)
    dims = TransformerDims(layers=4, hidden=64, heads=4, seq_len=32, microbatch_size=3, vocab=96)
    expected = transformer_chunks(dims, 2, FP32)
    for c in (0, 1):
        chunk = build_chunk(cfg, c, 2)
        params = {p.untyped_storage().data_ptr() for p in chunk.parameters()}
        x = torch.randint(0, 96, (3, 32)) if c == 0 else torch.randn(3, 32, 64, requires_grad=True)
        excluded = set(params) | ({x.untyped_storage().data_ptr()} if c else set())
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor, saved: dict[int, int] = saved, excluded: set[int] = excluded) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage.data_ptr() not in excluded:
                saved[storage.data_ptr()] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = chunk(x)
            if c == 1:
                lm_loss(out, torch.randint(0, 96, (3, 32)))
        # Within 2%: the position ids (s int64 values, independent of the batch) are not modelled.
        assert sum(saved.values()) == pytest.approx(expected[c].activation_bytes, rel=0.02)


def test_measured_figures_are_split_over_a_ranks_chunks() -> None:
    measured = MeasuredStages((800, 400), (1000, 600), boundary_bytes=10)
    chunks = chunk_memory(measured, 2, 2, FP32)
    assert [c.params for c in chunks] == [100, 50, 100, 50]
    assert [c.activation_bytes for c in chunks] == [500, 300, 500, 300]
    assert [(c.input_bytes, c.output_bytes) for c in chunks] == [(0, 10), (10, 10), (10, 10), (10, 0)]
    with pytest.raises(ConfigError, match="3 stages"):
        chunk_memory(MeasuredStages((1, 1, 1), (1, 1, 1)), 2, 1, FP32)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"layers": 0}, "layers must be an integer >= 1"),
        ({"hidden": 100, "heads": 3}, "multiple of heads"),
        ({"microbatch_size": 1.5}, "microbatch_size"),
    ],
)
def test_bad_dimensions_are_config_errors(kwargs: dict, match: str) -> None:
    base = {"layers": 4, "hidden": 64, "heads": 4, "seq_len": 8, "microbatch_size": 1, "vocab": 16}
    with pytest.raises(ConfigError, match=match):
        TransformerDims(**{**base, **kwargs})


def test_more_chunks_than_layers_is_a_config_error() -> None:
    dims = TransformerDims(layers=3, hidden=8, heads=2, seq_len=4, microbatch_size=1, vocab=16)
    with pytest.raises(ConfigError, match="cannot split 3 layers over 4"):
        transformer_chunks(dims, 4, FP32)


# ------------------------------------------------------------------ byte accounting through the iteration

_CHUNKS = (ChunkMemory(10, 100, 100, 0, 5), ChunkMemory(20, 200, 200, 5, 9))


def test_lean_runtime_holds_static_state_plus_activations_in_flight() -> None:
    s = build_schedule("1f1b", 2, 2)  # rank 0: F0 F1 B0 B1
    mem = rank_memory(s, 0, _CHUNKS, FP32, "adam", RUNTIMES["lean"])
    # weights 40 + persistent gradients 40 + Adam 80, then 100 per micro-batch in flight
    assert [p.total_bytes for p in mem.points] == [160, 260, 360, 260, 160]
    assert mem.peak.total_bytes == 360 and mem.peak_in_flight == 2


def test_torch_runtime_keeps_receive_buffers_outputs_until_backward_and_the_last_outputs() -> None:
    s = build_schedule("1f1b", 2, 2)
    torch_rt = RUNTIMES["torch"]
    first = rank_memory(s, 0, _CHUNKS, FP32, "adam", torch_rt)  # F0 F1 B0 B1
    # 2 gradient receive buffers (2 x 5); each forward keeps its output (5) until its backward;
    # gradients appear with the first backward.
    assert [p.total_bytes for p in first.points] == [130, 235, 340, 275, 170]
    last = rank_memory(s, 1, _CHUNKS, FP32, "adam", torch_rt)  # F0 B0 F1 B1
    # 2 activation receive buffers (2 x 5); the outputs (9 each) stay until the next step starts;
    # an input gradient lives only until it is sent (1F1B waits for each send soon).
    assert [p.total_bytes for p in last.points] == [250, 459, 339, 548, 348]
    assert last.step_end.total_bytes == 348 and last.step_end.buffers == 10 + 18


def test_torch_gpipe_holds_what_it_sends_until_the_step_ends() -> None:
    s = build_schedule("gpipe", 2, 2)
    torch_rt = RUNTIMES["torch"]
    first = rank_memory(s, 0, _CHUNKS, FP32, "adam", torch_rt)  # F0 F1 B0 B1
    # Outputs (5 each) are held by their sends' handles until the step returns.
    assert [p.total_bytes for p in first.points] == [130, 235, 340, 280, 180]
    assert first.step_end.total_bytes == 170
    last = rank_memory(s, 1, _CHUNKS, FP32, "adam", torch_rt)  # F0 F1 B0 B1
    # Input gradients (5 each) too; the last outputs (9 each) outlive the step.
    assert [p.total_bytes for p in last.points] == [250, 459, 668, 553, 358]
    assert last.step_end.total_bytes == 348


def test_memory_during_a_slot_is_what_the_action_before_it_left() -> None:
    s = build_schedule("1f1b", 4, 8)
    chunks = tuple(ChunkMemory(10, 100, 100, 5, 5) for _ in range(4))
    for r in range(4):
        mem = rank_memory(s, r, chunks, FP32, "adam", RUNTIMES["torch"])
        for slot in s.cyclic_slots(r):
            held = mem.during(slot)
            if slot.kind == BOUNDARY:
                assert held.total_bytes == max(mem.points[0].total_bytes, mem.step_end.total_bytes)
            else:
                k = s.orders[r].index(slot.after)
                assert held == mem.points[k + 1]


def test_rank_memory_rejects_a_model_of_the_wrong_shape() -> None:
    with pytest.raises(ConfigError, match="3 chunks"):
        rank_memory(build_schedule("1f1b", 2, 2), 0, _CHUNKS + _CHUNKS[:1], FP32, "adam", RUNTIMES["lean"])
    with pytest.raises(ConfigError, match="unknown optimizer"):
        rank_memory(build_schedule("1f1b", 2, 2), 0, _CHUNKS, FP32, "lion", RUNTIMES["lean"])
