"""Megatron Core's pipeline schedules, instrumented from outside: every wait reported as a bubble.

Wrap the function ``get_forward_backward_func()`` returns and call the wrapper with the same
arguments::

    from megatron.core.pipeline_parallel import get_forward_backward_func
    from freeride.training import megatron as freeride_megatron

    reporter = BubbleReporter(device="cuda:0", stage=pp_rank, rank=torch.distributed.get_rank())
    forward_backward = freeride_megatron.instrument(get_forward_backward_func(), reporter, device="cuda:0")
    for batch in data:
        losses = forward_backward(forward_step_func=..., data_iterator=..., model=model,
                                  num_microbatches=8, seq_length=..., micro_batch_size=...)
        optimizer.step()
    freeride_megatron.uninstrument(forward_backward)

**Hook points.** Only Megatron's documented extension points, on instances, for the duration of a
call: the model config's ``timers`` callable (``ModelParallelConfig.timers``) is replaced by one that
chains to whatever timers the trainer had set (Megatron-LM's trainer sets its own; ``None`` when it
set none) and notes where Megatron starts and stops ``forward-backward`` (the iteration),
``forward-compute`` and ``backward-compute`` (a compute action) and its pipeline transfers
(``forward-recv``, ``forward-send-backward-recv``, ... : :data:`P2P_TIMERS`, a wait). The trainer's
timers are called as before, with the same arguments, and timed around ours (ours innermost). When the
call returns, or raises, ``config.timers`` is the trainer's object again: nothing stays patched between
calls. No Megatron module or class is patched.

**Which action is which.** The timers carry names, not micro-batches: the ``k``-th forward of a call
is the ``k``-th forward of the rank's planned order, rebuilt here exactly as Megatron runs it
(:func:`megatron_orders`, for the 1F1B and interleaved schedules; checked against real runs in the
tests), and so for backwards. The interleaved schedule receives ahead (after each forward-backward
pair, the next pair's activation and gradient in one transfer): the tracker is told where
(:func:`megatron_receive_at`). The order, the waits and the iteration boundaries go to a
:class:`~freeride.training.tracker.RankTracker`, which maps each wait to its slot, predicts its
length, reports it to the sink and learns; on ``cuda:N`` its marks are CUDA events resolved off the
training thread (:mod:`freeride.training.device_clock`), as for
:class:`~freeride.training.instrument.InstrumentedSchedule`.

**overlap_p2p_comm.** With ``config.overlap_p2p_comm`` (interleaved schedule) Megatron posts its
transfers asynchronously and waits on the returned handles in the schedule itself, outside every
timer: the transfer timers then bracket only the posting. The instrumentation says so (a warning, once)
and falls back to what it sees: every gap between two compute actions (and before the first, and after
the last) is taken as a wait. That gap also holds the posting of the transfers, so its bubbles start a
little early.

**Not instrumented** (the call runs bare, with a warning once): forward-only calls (evaluation: a
different order, whose slots would clash with training's), pipelines of one stage
(``forward_backward_no_pipelining``: no bubbles), multi-module pipelines, and the combined 1F1B
schedule of ``overlap_moe_expert_parallel_comm``.

Importing this module imports neither Megatron nor torch; :func:`instrument` imports Megatron and
names the missing package in one line when it is not installed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from freeride.errors import ConfigError, FrameworkNotInstalled, FreerideError
from freeride.training.schedules import BACKWARD, FORWARD, Action
from freeride.training.tracker import KeptShapes, RankTracker, check_sink, checked_device

log = logging.getLogger(__name__)

#: Megatron's timers around pipeline transfers (``p2p_communication.P2PCommunicator``): each brackets one
#: blocking exchange with a neighbour rank, i.e. a wait.
P2P_TIMERS = frozenset({
    "forward-recv",
    "backward-recv",
    "forward-send",
    "backward-send",
    "forward-send-backward-recv",
    "backward-send-forward-recv",
    "forward-send-forward-recv",
    "backward-send-backward-recv",
    "forward-backward-send-forward-backward-recv",
})
#: Of those, the ones that only send. In a gap where the rank's order has it receive (a wait position), a
#: send's wait stays open into that receive: one wait, the position's (the rank is idle throughout), not two
#: of which the first would take its slot. In any other gap nothing follows it: its wait ends with it.
SEND_TIMERS = frozenset({"forward-send", "backward-send"})
ITERATION_TIMER = "forward-backward"
FORWARD_TIMER = "forward-compute"
BACKWARD_TIMER = "backward-compute"

ONE_F_ONE_B = "1f1b"
INTERLEAVED = "interleaved-1f1b"
_SCHEDULE_FUNCTIONS = {
    "forward_backward_pipelining_without_interleaving": ONE_F_ONE_B,
    "forward_backward_pipelining_with_interleaving": INTERLEAVED,
    "forward_backward_no_pipelining": None,
}


class MegatronInternalsChanged(FreerideError):
    """The installed Megatron Core no longer has what this module relies on."""


# ------------------------------------------------------------------ Megatron's order, as data


def _check_int(name: str, value: int, minimum: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def megatron_schedule_table(microbatches: int, virtual: int, group_size: int) -> list[tuple[int, int]]:
    """The interleaved schedule's ``(micro-batch, model chunk)`` of each virtual micro-batch, in order:
    micro-batches in groups of ``group_size``, each group through chunk 0, then chunk 1, ...; the last
    group takes every micro-batch left (Megatron's ``get_schedule_table``)."""
    table: list[tuple[int, int]] = []
    for first in range(0, microbatches, group_size):
        last = microbatches if first + group_size >= microbatches else first + group_size
        table.extend((mb, chunk) for chunk in range(virtual) for mb in range(first, last))
    return table


def megatron_orders(
    ranks: int, microbatches: int, virtual: int = 1, group_size: int | None = None
) -> dict[int, list[Action]]:
    """Every pipeline rank's compute actions of one training iteration, in the order Megatron Core runs
    them (model stage ``chunk * ranks + rank``).

    ``virtual == 1``: ``forward_backward_pipelining_without_interleaving`` -- rank ``r`` runs
    ``min(ranks - r - 1, m)`` forwards, then alternates forward and backward, then drains the backwards.
    ``virtual > 1``: ``forward_backward_pipelining_with_interleaving`` -- the virtual micro-batches of
    :func:`megatron_schedule_table`; rank ``r`` warms up with ``2 (ranks - r - 1) + (virtual - 1)
    group_size`` forwards (capped at all of them), then runs forward ``k + warmup`` and backward ``k``
    in pairs, then the remaining backwards; backward ``k`` runs the chunks in reverse. ``group_size`` is
    ``config.microbatch_group_size_per_vp_stage`` (default: ``ranks``), checked as Megatron does.
    """
    p = _check_int("ranks", ranks)
    m = _check_int("microbatches", microbatches)
    v = _check_int("virtual", virtual)
    orders: dict[int, list[Action]] = {}
    if v == 1:
        for r in range(p):
            warmup = min(p - r - 1, m)
            order = [Action(FORWARD, r, i) for i in range(warmup)]
            for i in range(m - warmup):
                order += [Action(FORWARD, r, warmup + i), Action(BACKWARD, r, i)]
            order += [Action(BACKWARD, r, m - warmup + i) for i in range(warmup)]
            orders[r] = order
        return orders
    g = p if group_size is None else _check_int("group_size", group_size)
    if not p <= g <= m:
        raise ConfigError(f"Megatron's interleaved schedule needs ranks ({p}) <= micro-batches per group ({g}) "
                          f"<= micro-batches ({m})")
    if 0 < m % g < p:
        raise ConfigError(f"Megatron's interleaved schedule needs the last group of micro-batches ({m % g}) to hold "
                          f"0 or at least {p} (ranks); micro-batches {m}, group size {g}")
    table = megatron_schedule_table(m, v, g)
    total = m * v
    for r in range(p):
        warmup = min(total, 2 * (p - r - 1) + (v - 1) * g)

        def forward(k: int, r: int = r) -> Action:
            mb, chunk = table[k]
            return Action(FORWARD, chunk * p + r, mb)

        def backward(k: int, r: int = r) -> Action:
            mb, chunk = table[k]
            return Action(BACKWARD, (v - 1 - chunk) * p + r, mb)

        order = [forward(k) for k in range(warmup)]
        for k in range(total - warmup):
            order += [forward(warmup + k), backward(k)]
        order += [backward(k) for k in range(total - warmup, total)]
        orders[r] = order
    return orders


def megatron_receive_at(ranks: int, microbatches: int, virtual: int = 1, group_size: int | None = None
                        ) -> dict[int, dict[int, int]]:
    """Where each rank of Megatron's interleaved schedule (without ``overlap_p2p_comm``) waits for an input
    ahead of the action that needs it (``receive_at`` of :mod:`freeride.training.rank_slots`).

    The schedule runs its steady state in forward-backward pairs and, after each pair, exchanges what
    the next pair needs in one blocking transfer: the forward's activation and the backward's gradient
    (the end of the warm-up does the same for the first pair). So the backward of each pair waits for its
    gradient before the pair's forward, at the forward's position. Every other input is received just
    before its action, as is every input of the 1F1B schedule (an empty map).
    """
    megatron_orders(ranks, microbatches, virtual, group_size)  # the same checks
    if virtual == 1:
        return {}
    total = microbatches * virtual
    group = ranks if group_size is None else group_size
    receive_at: dict[int, dict[int, int]] = {}
    for r in range(ranks):
        warmup = min(total, 2 * (ranks - r - 1) + (virtual - 1) * group)
        pairs = total - warmup
        receive_at[r] = {warmup + 2 * j + 1: warmup + 2 * j for j in range(pairs)}
    return receive_at


# ------------------------------------------------------------------ the chained timers


class _NullTimer:
    """What ``config.timers(name)`` gives for a name nobody times (the trainer set no timers)."""

    __slots__ = ()

    def start(self, *args: Any, **kwargs: Any) -> None:
        pass

    def stop(self, *args: Any, **kwargs: Any) -> None:
        pass


_NULL_TIMER = _NullTimer()


class _MarkedTimer:
    """One timer handed out for a hooked name: ours innermost, the trainer's timer around it."""

    __slots__ = ("_inner", "_begin", "_end")

    def __init__(self, inner: Any, begin: Callable[[], None], end: Callable[[], None]) -> None:
        self._inner = inner
        self._begin = begin
        self._end = end

    def start(self, *args: Any, **kwargs: Any) -> Any:
        result = None if self._inner is None else self._inner.start(*args, **kwargs)
        self._begin()
        return result

    def stop(self, *args: Any, **kwargs: Any) -> Any:
        self._end()
        return None if self._inner is None else self._inner.stop(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if self._inner is None:
            raise AttributeError(name)
        return getattr(self._inner, name)


class ChainedTimers:
    """A ``config.timers`` callable: the trainer's timers (``inner``, may be None) plus marks for the
    names in ``hooks`` (name -> (on start, on stop)). Every other name is the trainer's own timer, or a
    timer that does nothing when the trainer set none. Attributes other than the call are the trainer's.
    """

    __slots__ = ("inner", "_hooks", "_own")

    def __init__(self, inner: Any, hooks: Mapping[str, tuple[Callable[[], None], Callable[[], None]]]) -> None:
        self.inner = inner
        self._hooks = dict(hooks)
        # Without trainer timers, one timer per hooked name serves every call (nothing to allocate).
        self._own = {name: _MarkedTimer(None, begin, end) for name, (begin, end) in self._hooks.items()}

    def __call__(self, name: str, *args: Any, **kwargs: Any) -> Any:
        inner = self.inner
        if inner is None:
            return self._own.get(name, _NULL_TIMER)
        timer = inner(name, *args, **kwargs)
        hook = self._hooks.get(name)
        return timer if hook is None else _MarkedTimer(timer, hook[0], hook[1])

    def __getattr__(self, name: str) -> Any:
        inner = object.__getattribute__(self, "inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)


# ------------------------------------------------------------------ a rank's marks


class _Marks:
    """Megatron's timer starts and stops, as a rank tracker's marks (one per tracker; :meth:`reset` per call).

    ``order`` is the rank's planned order; the ``k``-th ``forward-compute`` of a call is its ``k``-th
    forward (and so for backwards: the tracker checks the interleaving). ``gaps_as_waits``
    (overlap_p2p_comm): the transfer timers are ignored and every gap between compute actions is a wait.
    """

    def __init__(self, tracker: Any, order: list[Action], gaps_as_waits: bool) -> None:
        self.tracker = tracker
        self._forwards = [(a.kind, a.stage, a.microbatch) for a in order if a.kind == FORWARD]
        self._backwards = [(a.kind, a.stage, a.microbatch) for a in order if a.kind != FORWARD]
        self._gaps_as_waits = gaps_as_waits
        # The gaps in which this rank receives (the tail past the last action is a send's, not a receive's).
        self._receives = frozenset(k for k in tracker.plan.positions if k < len(order))
        self._compute_begin, self._compute_end = tracker.compute_begin, tracker.compute_end
        self._wait_begin, self._wait_end = tracker.wait_begin, tracker.wait_end
        self.reset()
        self.hooks: dict[str, tuple[Callable[[], None], Callable[[], None]]] = {
            ITERATION_TIMER: (self.iteration_begin, self.iteration_end),
            FORWARD_TIMER: (self.forward_begin, self.compute_end),
            BACKWARD_TIMER: (self.backward_begin, self.compute_end),
        }
        if not gaps_as_waits:
            for name in P2P_TIMERS:
                self.hooks[name] = (self._wait_begin, self.send_end if name in SEND_TIMERS else self._wait_end)
        self._timers: ChainedTimers | None = None

    def reset(self) -> None:
        self._next_forward = 0
        self._next_backward = 0
        self._current: tuple[str, int, int] | None = None
        self.in_iteration = False

    def timers(self, inner: Any) -> ChainedTimers:
        """The ``config.timers`` of a call, chained to ``inner`` (the trainer's): reused while it is the same."""
        timers = self._timers
        if timers is None or timers.inner is not inner:
            timers = self._timers = ChainedTimers(inner, self.hooks)
        return timers

    def iteration_begin(self) -> None:
        if self.in_iteration:
            return
        self.in_iteration = True
        self.tracker.iteration_begin()
        if self._gaps_as_waits:
            self._wait_begin()

    def iteration_end(self) -> None:
        if self.in_iteration:
            self.in_iteration = False
            self.tracker.iteration_end()

    def forward_begin(self) -> None:
        if not self.in_iteration:  # a Megatron without the forward-backward timer: the call is the iteration
            self.iteration_begin()
        k = self._next_forward
        self._next_forward = k + 1
        key = self._current = self._forwards[k] if k < len(self._forwards) else (FORWARD, -1, k)
        self._compute_begin(*key)

    def backward_begin(self) -> None:
        if not self.in_iteration:
            self.iteration_begin()
        k = self._next_backward
        self._next_backward = k + 1
        key = self._current = self._backwards[k] if k < len(self._backwards) else (BACKWARD, -1, k)
        self._compute_begin(*key)

    def send_end(self) -> None:
        """A send is over: in a gap where the order has this rank receive, its wait goes on into that
        receive (whose wait_begin continues it); anywhere else it ends here. Which, the action order says,
        not timing: a send alone in its gap (1F1B's first stage, after its warm-up forward) that took long
        enough to become a learned slot was reported until the next forward began, past Megatron's wait."""
        if self._next_forward + self._next_backward not in self._receives:
            self._wait_end()

    def compute_end(self) -> None:
        key = self._current
        if key is None:
            return
        self._current = None
        self._compute_end(*key)
        if self._gaps_as_waits:
            self._wait_begin()


# ------------------------------------------------------------------ the wrapper


def _import_megatron() -> tuple[Any, Any, Any]:
    """Megatron's schedules, parallel state and ``get_model_config``; one clear line if missing."""
    try:
        from megatron.core import parallel_state
        from megatron.core.pipeline_parallel import schedules
        from megatron.core.utils import get_model_config
    except ModuleNotFoundError as exc:
        if exc.name in ("megatron", "megatron.core"):
            raise FrameworkNotInstalled(
                "freeride.training.megatron needs Megatron Core: pip install 'freeride[megatron]' (on Python "
                "3.11: pip install 'freeride[tasks]' first, then add --ignore-requires-python: the release "
                "declares 3.12 and runs on 3.11)"
            ) from None
        hint = (" (Megatron Core imports triton: pip install triton, or on a machine without a GPU a stand-in "
                "module, as the repository's examples/megatron_cpu.py makes)") if exc.name == "triton" else ""
        raise ConfigError(f"Megatron Core is installed but cannot be imported: {exc}{hint}") from exc
    return schedules, parallel_state, get_model_config


def _named(thing: Any) -> str:
    """What ``thing`` is, in a few words on one line: a model's repr is its whole module tree."""
    name = getattr(thing, "__qualname__", None) or getattr(thing, "__name__", None)
    return f"{type(thing).__name__} {name!r}" if isinstance(name, str) else f"a {type(thing).__name__}"


def _schedule_of(function: Any, schedules: Any) -> str | None:
    """Which schedule ``function`` runs (None: no pipeline); ConfigError for anything else."""
    name = getattr(function, "__name__", None)
    if name not in _SCHEDULE_FUNCTIONS:
        known = ", ".join(_SCHEDULE_FUNCTIONS)
        raise ConfigError(f"instrument() takes one of Megatron Core's forward-backward functions ({known}), "
                          f"as get_forward_backward_func() returns them; got {_named(function)}")
    if getattr(schedules, name, None) is None:
        raise MegatronInternalsChanged(f"megatron.core.pipeline_parallel.schedules has no {name}")
    return _SCHEDULE_FUNCTIONS[name]


@dataclass(frozen=True)
class _Shape:
    """What a rank's planned order depends on: a change makes a new tracker."""

    ranks: int
    rank: int
    microbatches: int
    virtual: int
    group_size: int
    overlap: bool


class InstrumentedForwardBackward:
    """A Megatron Core forward-backward function whose pipeline waits are reported as bubbles.

    Call it with the arguments of the function it wraps (see the module doc). ``sink`` receives the
    bubbles (a :class:`~freeride.training.reporter.BubbleReporter`; None: measure only); ``device``
    (``cpu:N``, ``cuda:N``) picks the clock and the free-memory samples; ``tracker_options`` go to
    :class:`~freeride.training.tracker.RankTracker` (``on_iteration``, ``learning``, ``clock``, ...).
    """

    def __init__(self, forward_backward_func: Callable[..., Any], sink: Any = None, *, device: str | None = None,
                 **tracker_options: Any) -> None:
        self._schedules, self._parallel_state, self._get_model_config = _import_megatron()
        self.forward_backward_func = forward_backward_func
        self.schedule = _schedule_of(forward_backward_func, self._schedules)
        # Checked here, as the other adapters check them: the trackers are made at the first call, which raised.
        device = checked_device(device)
        check_sink(sink, device)
        self.sink = sink
        self.device = device
        self._options = tracker_options
        #: The current rank tracker (None until the first instrumented call).
        self.tracker: Any = None
        self._shape: _Shape | None = None
        self._current_marks: _Marks
        #: The trackers (and their marks) of the last shapes the job ran: one that alternates keeps its slots.
        self._kept: KeptShapes[_Marks] = KeptShapes(lambda marks: marks.tracker)
        self._warned: set[str] = set()
        self.closed = False
        if self.schedule is None:
            self._warn_once("one stage", "a pipeline of one stage has no bubbles: calls run uninstrumented")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        hooked = None if self.closed else self._marks(kwargs)
        if hooked is None:
            return self.forward_backward_func(*args, **kwargs)
        marks, config = hooked
        trainers = config.timers
        config.timers = marks.timers(trainers)
        try:
            return self.forward_backward_func(*args, **kwargs)
        finally:
            config.timers = trainers
            marks.iteration_end()  # after an exception, or a Megatron without the forward-backward timer

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("freeride.training.megatron: %s", message)

    def _marks(self, kwargs: dict[str, Any]) -> tuple[_Marks, Any] | None:
        """This call's marks, on a tracker for its shape, and the config to hook; None when the call runs
        bare (module doc)."""
        if self.schedule is None:
            return None
        if kwargs.get("forward_only"):
            self._warn_once("forward only", "forward-only calls (evaluation) run uninstrumented")
            return None
        model = kwargs.get("model")
        if model is None or "num_microbatches" not in kwargs:
            return None  # Megatron itself will say what is missing
        chunks = model if isinstance(model, list) else [model]
        config = self._get_model_config(chunks[0])
        communicator = kwargs.get("p2p_communicator")
        if "MultiModule" in type(communicator).__name__ or "MultiModule" in type(kwargs.get("pg_collection")).__name__:
            self._warn_once("multi-module", "multi-module pipelines run uninstrumented")
            return None
        if getattr(config, "overlap_moe_expert_parallel_comm", False):
            self._warn_once("combined 1f1b", "the combined 1F1B schedule (overlap_moe_expert_parallel_comm) "
                                             "runs uninstrumented")
            return None
        group = communicator.pp_group if communicator is not None else \
            self._parallel_state.get_pipeline_model_parallel_group()
        ranks, rank = int(group.size()), int(group.rank())
        virtual = len(chunks) if self.schedule == INTERLEAVED else 1
        group_size = int(getattr(config, "microbatch_group_size_per_vp_stage", None) or ranks)
        overlap = bool(getattr(config, "overlap_p2p_comm", False))
        shape = _Shape(ranks, rank, int(kwargs["num_microbatches"]), virtual, group_size, overlap)
        if shape != self._shape:
            self._retrack(shape)
        if overlap:
            self._warn_once("overlap", "with overlap_p2p_comm Megatron waits on its transfers outside every timer: "
                                       "each gap between compute actions is taken as a wait (it also holds the "
                                       "posting of the transfers)")
        self._current_marks.reset()
        return self._current_marks, config

    def _retrack(self, shape: _Shape) -> None:
        if self.tracker is not None:
            log.info("freeride.training.megatron: the pipeline's shape changed from %s to %s", self._shape, shape)
        self._current_marks = self._kept.get(shape, lambda: self._new_marks(shape))
        self.tracker = self._current_marks.tracker
        self._shape = shape

    def _new_marks(self, shape: _Shape) -> _Marks:
        group_size = shape.group_size if shape.virtual > 1 else None
        orders = megatron_orders(shape.ranks, shape.microbatches, shape.virtual, group_size)
        # Overlapped transfers are waited for on handles right before the action that needs them.
        receive_at = {} if shape.overlap else megatron_receive_at(shape.ranks, shape.microbatches, shape.virtual,
                                                                  group_size)
        tracker = RankTracker(orders, shape.rank, self.sink, num_stages=shape.ranks * shape.virtual,
                              device=self.device, receive_at=receive_at, schedule=f"megatron-{self.schedule}",
                              **self._options)
        return _Marks(tracker, orders[shape.rank], gaps_as_waits=shape.overlap)

    def close(self) -> None:
        """Deliver what the tracker's clock still holds and stop it; later calls run bare."""
        self.closed = True
        self._kept.close()


def instrument(forward_backward_func: Callable[..., Any], sink: Any = None, *, device: str | None = None,
               **tracker_options: Any) -> InstrumentedForwardBackward:
    """Wrap a Megatron Core forward-backward function so that its pipeline waits are reported (module doc)."""
    if isinstance(forward_backward_func, InstrumentedForwardBackward):
        raise ConfigError("this forward-backward function is instrumented already: call the wrapper you have "
                          "(or uninstrument(wrapper) first)")
    return InstrumentedForwardBackward(forward_backward_func, sink, device=device, **tracker_options)


def uninstrument(instrumented: InstrumentedForwardBackward | Callable[..., Any]) -> Callable[..., Any]:
    """Stop reporting (delivering what is left) and give back the function that was wrapped; a function
    that is not a wrapper comes back as it is (nothing to undo), as the other adapters do.

    Megatron's config and communicator are already as they were: they are only hooked during a call.
    """
    if not isinstance(instrumented, InstrumentedForwardBackward):
        return instrumented
    instrumented.close()
    return instrumented.forward_backward_func
