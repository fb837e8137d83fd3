"""The per-stage memory model of a pipeline: what each rank holds at every point of an iteration.

A rank's memory is a **static** part -- weights, gradients, optimizer state, the runtime's persistent
receive buffers -- plus the **state of the micro-batches in flight**: a forward saves tensors for its
backward, and they are released when that backward has run. How many micro-batches are in flight is
not a formula here: :func:`in_flight_counts` walks the rank's action order from
:mod:`freeride.training.schedules` and counts, after every action, the (model chunk, micro-batch) pairs whose
forward ran and whose state is not released yet. The textbook figures fall out of the same walk
(``p - s`` on stage ``s`` under 1F1B, ``m`` under GPipe; tested), and so do the schedules without a
textbook figure:

* **Interleaved 1F1B.** The walk counts chunk-micro-batches: rank ``r`` warms up with
  ``2 (p - r - 1) + (v - 1) p`` forwards of ``1/v``-size chunks before its first backward.
* **ZB-H1.** The backward is split into ``I`` (gradient of the chunk's input: on the critical path)
  and ``W`` (gradient of the weights: deferred into what would be cool-down bubbles). ``I`` does not
  release a micro-batch: ``W`` still needs, for every matrix multiply ``Y = X A``, its input ``X``
  and the gradient at its output ``dY`` (``dA = X^T dY``). Between ``I`` and ``W`` a micro-batch
  therefore holds :attr:`ChunkMemory.weight_pass_bytes`; ``W`` releases it. For the transformer
  block below that is ``(3 + f)`` inputs plus ``(5 + f)`` output gradients, ``(8 + 2f) sbh``
  elements: exactly as much as the forward saved, so deferring ``r`` weight passes keeps rank ``r``
  at ``p`` micro-batches in flight, where 1F1B keeps ``p - r``. This is what an implementation
  that frees everything ``W`` does not need keeps; ``torch.distributed.pipelining`` retains the whole
  autograd graph between the two passes (more).

**Transformer formulas** (:func:`transformer_chunks`). For a GPT of pre-norm blocks (LayerNorm,
fused QKV projection, attention, output projection, LayerNorm, ``h -> f h -> h`` MLP with GELU; the
reference trainer's model), hidden size ``h``, ``a`` heads, sequence ``s``, micro-batch ``b``,
vocabulary ``V``, activation element size ``d`` bytes, writing ``N = s b h``:

* parameters per block: QKV ``3h^2 + 3h``, projection ``h^2 + h``, MLP ``2 f h^2 + (f + 1) h``, two
  LayerNorms ``4h``: ``(4 + 2f) h^2 + (9 + f) h`` (``12 h^2 + 13 h`` for ``f = 4``); the first chunk
  adds the token and position tables ``(V + s) h``, the last the final LayerNorm and an untied head
  without bias ``2h + V h``.
* activations saved per block and micro-batch: the block's input (kept by the first LayerNorm), the
  first LayerNorm's output (QKV's input), the QKV output (``3N``, attention's inputs), the attention
  output (the projection's input: a view of the same storage), the residual sum (the second
  LayerNorm's input), its output (the MLP's input), the MLP's hidden before and after GELU
  (``2 f N``): ``(8 + 2f) N`` elements, plus per LayerNorm its mean and reciprocal deviation and per
  attention its log-sum-exp (``b s`` and ``a b s`` fp32 values). Fused ("flash") attention saves no
  ``s x s`` matrix; plain attention (``flash_attention=False``) also saves the softmax output,
  ``a b s^2`` elements. A chunk's first block's input is the chunk's input: a received tensor, which
  the runtime keeps (see :class:`Runtime`), so it is not counted twice. The first chunk also keeps
  the token ids (int64); the last keeps the final LayerNorm's input and output, the loss's
  log-softmax (``b s V``) and the targets.
* assumed: no dropout (none of its masks), no activation recomputation, no tensor or sequence
  parallelism, layers split over chunks as the reference trainer splits them (earlier chunks get
  the extra layers), transfers and the loss in the activation dtype. Workspace inside one action
  (the backward's activation gradients, an optimizer step's temporaries) is not modelled: the figures
  are the memory held *between* actions, which is what a side task running in a bubble competes
  with; leave headroom for the rest. Checked against the allocator's accounting in runs of the
  reference trainer on CPU: p90 error 5% over every point between actions of four configurations
  (``bench/bench_plan.py``, ``bench/results/cpu/plan_validation.md``).

**Measured inputs** (:class:`MeasuredStages`): per rank, the weight bytes and the activation bytes
one micro-batch saves (e.g. from a profiling run), for models the formulas do not describe.

**Precision and optimizer** (:data:`PRECISIONS`, :data:`OPTIMIZER_STATES`): ``fp32`` keeps 4-byte
weights and gradients; ``bf16-mixed`` keeps 2-byte weights and activations, 4-byte gradients and a
4-byte master copy; every optimizer state (Adam: 2, SGD with momentum: 1) is 4 bytes per parameter.
Adam in fp32 costs 16 bytes per parameter, in mixed precision 18.

Everything here is pure (no torch, no I/O); sizes are bytes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from freeride.errors import ConfigError
from freeride.training.schedules import (
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    BOUNDARY,
    FORWARD,
    Action,
    IdleSlot,
    Schedule,
)

_FP32 = 4
_INT64 = 8


# ------------------------------------------------------------------ inputs


@dataclass(frozen=True)
class Precision:
    """Bytes per element of each kind of state."""

    name: str
    weight_bytes: int
    grad_bytes: int
    master_bytes: int
    state_bytes: int
    activation_bytes: int


PRECISIONS: dict[str, Precision] = {
    "fp32": Precision("fp32", weight_bytes=4, grad_bytes=4, master_bytes=0, state_bytes=4, activation_bytes=4),
    "bf16-mixed": Precision("bf16-mixed", weight_bytes=2, grad_bytes=4, master_bytes=4, state_bytes=4,
                            activation_bytes=2),
}

#: Optimizer states per parameter.
OPTIMIZER_STATES: dict[str, int] = {"adam": 2, "sgd-momentum": 1, "sgd": 0}


@dataclass(frozen=True)
class Runtime:
    """What the pipeline runtime keeps besides the saved activations.

    Attributes:
        recv_buffers_per_microbatch: a receive buffer for every micro-batch, allocated once and kept
            (activations into every chunk but the first, gradients into every chunk but the last);
            else a received tensor lives as long as the micro-batch that saved it.
        keeps_stage_outputs: a chunk's output tensor is kept until its backward.
        keeps_last_outputs: the last chunk keeps every micro-batch's output until the step ends
            (to return the merged outputs).
        sends_held_until_step_end: schedules under which everything a chunk sends (its outputs, the
            gradients of its inputs) is held until the step ends: the send's handle keeps the tensor
            alive until it is waited for. Elsewhere an input gradient lives only until it is sent.
        grads_freed_between_iterations: gradients are freed after the optimizer step
            (``zero_grad(set_to_none=True)``) and exist from a chunk's first backward on; else they
            are persistent buffers.
    """

    name: str
    recv_buffers_per_microbatch: bool
    keeps_stage_outputs: bool
    keeps_last_outputs: bool
    grads_freed_between_iterations: bool
    sends_held_until_step_end: frozenset[str] = frozenset()


RUNTIMES: dict[str, Runtime] = {
    # torch.distributed.pipelining 2.13 (stage.py: receive buffers per micro-batch, fwd_cache until
    # the backward, the last stage's output_chunks until the step ends; _backward.py drops an input's
    # .grad once taken for sending). ScheduleGPipe keeps every send's handle in a list it waits on
    # at the end of its phase and drops at the step's end, the runtime schedules (interleaved,
    # zero-bubble) wait for their sends only at the step's end; Schedule1F1B waits for each soon.
    # Driven like the reference trainer drives it (zero_grad(set_to_none=True)).
    "torch": Runtime("torch", True, True, True, True, frozenset({"gpipe", "interleaved-1f1b", "zb-h1"})),
    # A runtime that frees every transfer and output as soon as it is sent and keeps persistent
    # gradient buffers (Megatron-LM's behaviour, as far as this model goes).
    "lean": Runtime("lean", False, False, False, False),
}


@dataclass(frozen=True)
class TransformerDims:
    """A GPT's dimensions (see the module doc for the formulas and their assumptions)."""

    layers: int
    hidden: int
    heads: int
    seq_len: int
    microbatch_size: int
    vocab: int
    ffn_multiplier: int = 4
    flash_attention: bool = True

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "seq_len", "microbatch_size", "vocab", "ffn_multiplier"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        if self.hidden % self.heads:
            raise ConfigError(f"hidden ({self.hidden}) must be a multiple of heads ({self.heads})")

    def with_microbatch_size(self, microbatch_size: int) -> TransformerDims:
        return TransformerDims(self.layers, self.hidden, self.heads, self.seq_len, microbatch_size, self.vocab,
                               self.ffn_multiplier, self.flash_attention)


@dataclass(frozen=True)
class MeasuredStages:
    """Measured figures per pipeline rank, for models the formulas do not describe.

    ``weight_bytes[r]``: rank ``r``'s parameters in the weights' precision; ``activation_bytes[r]``:
    what one micro-batch saves for the backward on rank ``r`` (all its chunks);
    ``boundary_bytes``: one micro-batch's tensor at a stage boundary (0: no receive buffers or
    kept outputs are counted). A rank's figures are split evenly over its chunks.
    """

    weight_bytes: tuple[int, ...]
    activation_bytes: tuple[int, ...]
    boundary_bytes: int = 0

    def __post_init__(self) -> None:
        if not self.weight_bytes or len(self.weight_bytes) != len(self.activation_bytes):
            raise ConfigError(
                f"measured weight bytes ({len(self.weight_bytes)} values) and activation bytes "
                f"({len(self.activation_bytes)} values) need one value per stage each"
            )
        for name in ("weight_bytes", "activation_bytes"):
            if any(not isinstance(v, int) or v < 0 for v in getattr(self, name)):
                raise ConfigError(f"{name} must be byte counts >= 0, got {getattr(self, name)!r}")
        if self.boundary_bytes < 0:
            raise ConfigError(f"boundary_bytes must be >= 0, got {self.boundary_bytes}")

    @property
    def stages(self) -> int:
        return len(self.weight_bytes)

    def scaled(self, factor: float) -> MeasuredStages:
        """The figures for a micro-batch ``factor`` times as large (activations scale linearly)."""
        return MeasuredStages(self.weight_bytes, tuple(round(a * factor) for a in self.activation_bytes),
                              round(self.boundary_bytes * factor))


MemorySource = TransformerDims | MeasuredStages


@dataclass(frozen=True)
class ChunkMemory:
    """One model chunk (one model stage) in bytes, except ``params`` (a count).

    ``activation_bytes`` is what one micro-batch's forward saves for its backward (not counting the
    received input); ``weight_pass_bytes`` what it keeps between ``I`` and ``W``; ``input_bytes`` and
    ``output_bytes`` are one micro-batch's tensors at the chunk's boundaries (0 where there is no
    neighbour).
    """

    params: int
    activation_bytes: int
    weight_pass_bytes: int
    input_bytes: int
    output_bytes: int


def split_layers(layers: int, chunks: int) -> list[tuple[int, int]]:
    """Split ``layers`` blocks over ``chunks`` as evenly as possible (earlier chunks get extras)."""
    if chunks < 1 or layers < chunks:
        raise ConfigError(f"cannot split {layers} layers over {chunks} pipeline chunks (need layers >= chunks)")
    base, extra = divmod(layers, chunks)
    bounds, start = [], 0
    for c in range(chunks):
        end = start + base + (1 if c < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def block_params(dims: TransformerDims) -> int:
    h, f = dims.hidden, dims.ffn_multiplier
    return (4 + 2 * f) * h * h + (9 + f) * h


def transformer_chunks(dims: TransformerDims, chunks: int, precision: Precision) -> tuple[ChunkMemory, ...]:
    """Per model chunk, the parameters and per-micro-batch bytes of a GPT (formulas: module doc)."""
    h, a, s, b, V, f = dims.hidden, dims.heads, dims.seq_len, dims.microbatch_size, dims.vocab, dims.ffn_multiplier
    d = precision.activation_bytes
    n = s * b * h
    per_block = (8 + 2 * f) * n * d + 2 * 2 * b * s * _FP32
    per_block += a * b * s * _FP32 if dims.flash_attention else a * b * s * s * d
    weight_pass_block = (8 + 2 * f) * n * d
    out: list[ChunkMemory] = []
    for c, (first, last) in enumerate(split_layers(dims.layers, chunks)):
        is_first, is_last = c == 0, c == chunks - 1
        blocks = last - first
        params = blocks * block_params(dims)
        act = blocks * per_block
        wpass = blocks * weight_pass_block
        if is_first:
            params += (V + s) * h
            act += b * s * _INT64  # token ids (the embeddings' backward)
            wpass += n * d + b * s * _INT64  # the embeddings' output gradient and the ids
        else:
            act -= n * d  # the first block's input is the received tensor (the runtime's)
        if is_last:
            params += 2 * h + V * h
            # final LayerNorm input, output and statistics, the loss's log-softmax, the targets
            act += 2 * n * d + 2 * b * s * _FP32 + b * s * V * d + b * s * _INT64
            wpass += n * d + b * s * V * d  # the head's input and its output gradient
        out.append(ChunkMemory(
            params=params,
            activation_bytes=act,
            weight_pass_bytes=wpass,
            input_bytes=0 if is_first else n * d,
            output_bytes=b * s * V * d if is_last else n * d,
        ))
    return tuple(out)


def measured_chunks(measured: MeasuredStages, virtual: int, precision: Precision,
                    rank_of: Mapping[int, int] | None = None) -> tuple[ChunkMemory, ...]:
    """Per model chunk, from per-rank measurements split evenly over the rank's chunks.

    ``rank_of`` maps a chunk to the rank holding it (a V-shaped schedule's rank ``r`` holds ``r`` and
    ``2p - 1 - r``); without it rank ``r`` holds chunks ``r, r + p, ...``. The state kept between ``I``
    and ``W`` is taken to be the full activation (see the module doc).
    """
    p = measured.stages
    chunks = p * virtual
    out = []
    for c in range(chunks):
        r = c % p if rank_of is None else rank_of[c]
        weights = measured.weight_bytes[r] // virtual
        act = measured.activation_bytes[r] // virtual
        out.append(ChunkMemory(
            params=weights // precision.weight_bytes,
            activation_bytes=act,
            weight_pass_bytes=act,
            input_bytes=measured.boundary_bytes if c > 0 else 0,
            output_bytes=measured.boundary_bytes if c < chunks - 1 else 0,
        ))
    return tuple(out)


def chunk_memory(source: MemorySource, stages: int, virtual: int, precision: Precision,
                 rank_of: Mapping[int, int] | None = None) -> tuple[ChunkMemory, ...]:
    """The chunks of a ``stages`` x ``virtual`` pipeline from either kind of input (``rank_of``: see
    :func:`measured_chunks`)."""
    if isinstance(source, TransformerDims):
        return transformer_chunks(source, stages * virtual, precision)
    if source.stages != stages:
        raise ConfigError(f"measured figures are given for {source.stages} stages, the pipeline has {stages}")
    return measured_chunks(source, virtual, precision, rank_of)


# ------------------------------------------------------------------ the walk


def in_flight_counts(order: Sequence[Action]) -> list[int]:
    """Micro-batch state alive on a rank: before its first action (index 0) and after each action.

    A forward adds its (chunk, micro-batch); a full backward ``B`` or a weight pass ``W`` releases
    it; an input pass ``I`` keeps it (``W`` still needs it).
    """
    alive: set[tuple[int, int]] = set()
    counts = [0]
    for action in order:
        key = (action.stage, action.microbatch)
        if action.kind == FORWARD:
            alive.add(key)
        elif action.kind in (BACKWARD, BACKWARD_WEIGHT):
            alive.discard(key)
        counts.append(len(alive))
    return counts


@dataclass(frozen=True)
class HeldMemory:
    """What a rank holds at one point of an iteration, in bytes (``in_flight`` is a count)."""

    weights: int
    gradients: int
    optimizer: int
    buffers: int
    activations: int
    in_flight: int

    @property
    def total_bytes(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.buffers + self.activations


@dataclass(frozen=True)
class RankMemory:
    """A rank's memory through one iteration.

    ``points[0]`` is the state when the iteration starts, ``points[k]`` the state after the rank's
    ``k``-th action (1-based), while it waits for the next; ``step_end`` the state once the step
    has returned (what the runtime holds only until then released), until the optimizer step.
    """

    rank: int
    points: tuple[HeldMemory, ...]
    order: tuple[Action, ...]
    step_end: HeldMemory

    @property
    def peak(self) -> HeldMemory:
        """The point holding the most (between actions; see the module doc on workspace)."""
        return max(self.points, key=lambda p: p.total_bytes)

    @property
    def peak_in_flight(self) -> int:
        return max(p.in_flight for p in self.points)

    def during(self, slot: IdleSlot) -> HeldMemory:
        """What the rank holds while it waits in ``slot``.

        A ``boundary`` slot spans the iteration's end (the step's return, the optimizer step, then
        the next step's start): the larger of the two states is taken, so free memory is never
        overstated.
        """
        if slot.kind == BOUNDARY or slot.after is None:
            return max(self.step_end, self.points[0], key=lambda p: p.total_bytes)
        for k, action in enumerate(self.order):
            if action == slot.after:
                return self.points[k + 1]
        raise ConfigError(f"slot {slot.index} of rank {self.rank} follows {slot.after}, not in the rank's order")


def rank_memory(
    schedule: Schedule,
    rank: int,
    chunks: Sequence[ChunkMemory],
    precision: Precision,
    optimizer: str,
    runtime: Runtime,
) -> RankMemory:
    """Walk ``rank``'s action order and account every byte it holds between actions."""
    if optimizer not in OPTIMIZER_STATES:
        raise ConfigError(f"unknown optimizer {optimizer!r}: expected one of {', '.join(OPTIMIZER_STATES)}")
    num_chunks = schedule.ranks * schedule.virtual
    if len(chunks) != num_chunks:
        raise ConfigError(f"the memory model has {len(chunks)} chunks, the schedule {num_chunks}")
    order = schedule.orders[rank]
    own = sorted({a.stage for a in order})  # where the orders place them: a V-shaped rank holds r and 2p - 1 - r
    m = schedule.microbatches
    params = sum(chunks[c].params for c in own)
    weights = params * precision.weight_bytes
    optimizer_bytes = params * (precision.master_bytes + OPTIMIZER_STATES[optimizer] * precision.state_bytes)
    persistent = 0
    if runtime.recv_buffers_per_microbatch:
        for c in own:
            persistent += m * chunks[c].input_bytes  # activations received
            if c < num_chunks - 1:
                persistent += m * chunks[c].output_bytes  # gradients received

    state: dict[tuple[int, int], str] = {}
    backwarded: set[int] = set()
    kept_last = 0  # the last chunk's outputs, until the next step starts
    kept_sends = 0  # everything sent, until the step ends (where the runtime holds sends)
    sends_held = schedule.name in runtime.sends_held_until_step_end

    def held_to_step_end(c: int) -> bool:
        last = c == num_chunks - 1
        return (last and runtime.keeps_last_outputs) or (not last and sends_held)

    def point() -> HeldMemory:
        act = 0
        for (c, _mb), phase in state.items():
            chunk = chunks[c]
            if phase == FORWARD:
                act += chunk.activation_bytes
                if not runtime.recv_buffers_per_microbatch:
                    act += chunk.input_bytes
                if runtime.keeps_stage_outputs and not held_to_step_end(c):
                    act += chunk.output_bytes
            else:
                act += chunk.weight_pass_bytes
        with_grads = backwarded if runtime.grads_freed_between_iterations else own
        grads = sum(chunks[c].params for c in with_grads) * precision.grad_bytes
        return HeldMemory(weights, grads, optimizer_bytes, persistent + kept_last + kept_sends, act, len(state))

    points = [point()]
    for action in order:
        key = (action.stage, action.microbatch)
        chunk = chunks[action.stage]
        if action.kind == FORWARD:
            state[key] = FORWARD
            if action.stage == num_chunks - 1 and runtime.keeps_last_outputs:
                kept_last += chunk.output_bytes
            elif held_to_step_end(action.stage):
                kept_sends += chunk.output_bytes
        elif action.kind == BACKWARD_INPUT:
            state[key] = BACKWARD_INPUT
            if sends_held:
                kept_sends += chunk.input_bytes
        else:
            state.pop(key, None)
            backwarded.add(action.stage)
            if action.kind == BACKWARD and sends_held:
                kept_sends += chunk.input_bytes
        points.append(point())
    kept_sends = 0
    return RankMemory(rank, tuple(points), tuple(order), point())
