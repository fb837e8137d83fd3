"""One rank of a Megatron Core pipeline in this process: Megatron's real schedule, stub transfers.

:func:`run_rank` calls one of Megatron's forward-backward functions (or a wrapper of one) as rank
``rank`` of ``ranks``, with a :class:`StubCommunicator`: Megatron's own ``P2PCommunicator`` (its timers,
its method for each kind of transfer) whose one private exchange, ``_communicate``, receives zeros
instead of talking to another process. So the schedule's real control flow runs -- its order of
forwards and backwards, its timers, its handles under ``overlap_p2p_comm`` -- for any shape, with no
torchrun. Time is virtual (:class:`VirtualTime`): a compute action takes ``compute_ns``, the
first wait for a receive at position ``k`` of the order (compute actions begun so far) takes ``waits[k]``,
and the first send alone there ``send_waits[k]`` (gloo's send waits for the transfer); a tracker given
:func:`virtual_clock` then measures exactly these lengths.

Megatron's schedules read a rank through ``torch.distributed``: the caller provides an initialised
one-process group (see the ``one_process_group`` fixture).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))  # megatron_cpu, as a user copies it

import megatron_cpu  # noqa: E402
import torch  # noqa: E402

megatron_cpu.stand_in_triton_kernels()

from megatron.core.enums import ModelType  # noqa: E402
from megatron.core.pipeline_parallel import schedules  # noqa: E402
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator  # noqa: E402
from megatron.core.process_groups_config import ProcessGroupCollection  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

HIDDEN = 4


class Group:
    """A process group as Megatron's schedules read one: a rank and a size."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


@dataclass
class VirtualTime:
    now_ns: int = 1_000_000_000

    def advance(self, ns: int) -> None:
        self.now_ns += ns


class VirtualClock:
    """A host-style clock (inline delivery) that reads :class:`VirtualTime`."""

    synchronous = True

    def __init__(self, consumer: Callable[[Any, int], None], time: VirtualTime) -> None:
        self._consumer, self._time = consumer, time

    def mark(self, payload: Any) -> None:
        self._consumer(payload, self._time.now_ns)

    def flush(self, timeout_s: float = 30.0) -> bool:
        return True

    def close(self) -> None:
        pass


def virtual_clock(time: VirtualTime) -> Callable[[Callable[[Any, int], None]], VirtualClock]:
    """A ``clock=`` factory for a tracker that measures in ``time``."""
    return lambda consumer: VirtualClock(consumer, time)


@dataclass
class RankState:
    """What one simulated rank did: its order as run, where it received, and the clock it ran on."""

    time: VirtualTime = field(default_factory=VirtualTime)
    waits: dict[int, int] = field(default_factory=dict)  # position -> ns, consumed by the first receive
    send_waits: dict[int, int] = field(default_factory=dict)  # position -> ns, consumed by the first send alone
    compute_ns: int = 100_000
    device: str = "cpu"
    #: Called with a wait's amount where it is waited for (on a GPU: a kernel that holds the stream that long).
    on_wait: Callable[[int], None] | None = None
    order: list[tuple[str, int, int]] = field(default_factory=list)
    received_at: list[int] = field(default_factory=list)  # positions where the rank waited for a receive

    @property
    def position(self) -> int:
        return len(self.order)

    def wait_here(self) -> None:
        self.received_at.append(self.position)
        wait = self.waits.pop(self.position, 0)
        self.time.advance(wait)
        if wait and self.on_wait is not None:
            self.on_wait(wait)

    def send_here(self) -> None:
        self.time.advance(self.send_waits.pop(self.position, 0))


class _Handle:
    """A request handle of an overlapped transfer: the wait happens when the schedule waits on it."""

    def __init__(self, state: RankState) -> None:
        self._state = state

    def wait(self) -> None:
        self._state.wait_here()


class StubCommunicator(P2PCommunicator):
    """Megatron's communicator with its exchange stubbed: receives are zeros, waits are virtual."""

    def __init__(self, group: Group, config: Any, state: RankState) -> None:  # no process group to resolve
        self.pp_group, self.config, self.state = group, config, state
        self.next_rank = self.prev_rank = 0
        self.virtual_pipeline_model_parallel_size = config.virtual_pipeline_model_parallel_size

    def _communicate(self, *, tensor_send_next: Any, tensor_send_prev: Any, recv_prev: bool, recv_next: bool,
                     tensor_shape: Any, wait_on_reqs: bool = True) -> Any:
        def received() -> torch.Tensor:
            return torch.zeros(tensor_shape, requires_grad=True, device=self.state.device)

        prev = received() if recv_prev else None
        nxt = received() if recv_next else None
        if not (recv_prev or recv_next):
            self.state.send_here()
            return prev, nxt, None
        if wait_on_reqs:
            self.state.wait_here()
            return prev, nxt, None
        handles = {}
        if recv_prev:
            handles["recv_prev"] = _Handle(self.state)
        if recv_next:
            handles["recv_next"] = _Handle(self.state)
        return prev, nxt, handles


def make_config(ranks: int, virtual: int = 1, group_size: int | None = None, overlap: bool = False,
                timers: Any = None) -> Any:
    return TransformerConfig(
        num_layers=ranks * virtual, hidden_size=HIDDEN, num_attention_heads=1, pipeline_dtype=torch.float32,
        pipeline_model_parallel_size=ranks, virtual_pipeline_model_parallel_size=virtual if virtual > 1 else None,
        microbatch_group_size_per_vp_stage=group_size, batch_p2p_comm=False, batch_p2p_sync=False,
        overlap_p2p_comm=overlap, timers=timers,
    )


class Chunk(torch.nn.Module):
    """One model chunk of the simulated rank: records each forward, and each backward via its output."""

    def __init__(self, config: Any, stage: int, vp_stage: int, state: RankState) -> None:
        super().__init__()
        self.config, self.model_type, self.vp_stage = config, ModelType.encoder_or_decoder, vp_stage
        self.stage, self.state = stage, state
        self.linear = torch.nn.Linear(HIDDEN, HIDDEN, device=state.device)
        self.input: torch.Tensor | None = None
        self.forwards = 0

    def set_input_tensor(self, tensor: Any) -> None:
        self.input = tensor[0] if isinstance(tensor, list) else tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state, stage, mb = self.state, self.stage, self.forwards
        self.forwards += 1
        state.order.append(("F", stage, mb))
        state.time.advance(state.compute_ns)
        out = self.linear(x if self.input is None else self.input)

        def on_gradient(grad: torch.Tensor) -> torch.Tensor:
            state.order.append(("B", stage, mb))
            state.time.advance(state.compute_ns)
            return grad

        out.register_hook(on_gradient)
        return out


def schedule_function(virtual: int) -> Callable[..., Any]:
    return (schedules.forward_backward_pipelining_with_interleaving if virtual > 1
            else schedules.forward_backward_pipelining_without_interleaving)


@dataclass
class Rank:
    """A simulated rank: call :meth:`step` once per iteration with Megatron's function or a wrapper."""

    ranks: int
    rank: int
    microbatches: int
    virtual: int = 1
    group_size: int | None = None
    overlap: bool = False
    timers: Any = None
    state: RankState = field(default_factory=RankState)

    def __post_init__(self) -> None:
        self.config = make_config(self.ranks, self.virtual, self.group_size, self.overlap, self.timers)
        self.chunks = [Chunk(self.config, vp * self.ranks + self.rank, vp, self.state) for vp in range(self.virtual)]
        self.communicator = StubCommunicator(Group(self.rank, self.ranks), self.config, self.state)
        self.pg_collection = ProcessGroupCollection(tp=Group(0, 1), cp=Group(0, 1))

    def step(self, function: Callable[..., Any], waits: Mapping[int, int] | None = None,
             forward_step: Callable[..., Any] | None = None, send_waits: Mapping[int, int] | None = None,
             **kwargs: Any) -> Any:
        state = self.state
        state.order.clear()
        state.received_at.clear()
        state.waits = dict(waits or {})
        state.send_waits = dict(send_waits or {})
        for chunk in self.chunks:
            chunk.forwards = 0
            chunk.input = None

        def default_forward_step(iterator: Any, model: Chunk) -> tuple[torch.Tensor, Any]:
            return (model(torch.ones(2, 1, HIDDEN, device=state.device)),
                    lambda out: (out.sum(), {"loss": out.sum().detach()}))

        interleaved = self.virtual > 1
        with megatron_cpu.on_cpu():
            return function(
                forward_step_func=forward_step or default_forward_step,
                data_iterator=[None] * self.virtual if interleaved else None,
                model=self.chunks if interleaved else self.chunks[0], num_microbatches=self.microbatches,
                seq_length=2, micro_batch_size=1, p2p_communicator=self.communicator,
                pg_collection=self.pg_collection, **kwargs,
            )
