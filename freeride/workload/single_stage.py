"""Single-device mode: one real pipeline stage, its neighbours emulated by timed peers.

``python -m freeride.workload.single_stage --device cuda:0 --stages 4 --stage-index 1`` runs stage 1
of a 4-stage GPipe or 1F1B pipeline in one process on one device, with no ``torch.distributed`` at
all: the stage's GPT chunk does its real forward and backward of every micro-batch, in the
schedule's action order, and every receive from a neighbour is replaced by a timed wait. So one GPU
(or one CPU core) shows the bubbles a real pipeline would give it, where it would give them, and a
freeride manager on that device can harvest them.

**The emulated peers.** :class:`EmulatedPeers` places every other stage's actions in time the way
:func:`freeride.training.schedules.simulate` does (list scheduling in each rank's order: an action starts
when its rank is free and its input has arrived), except that this stage's own actions are not
modelled: their real end times are fed in as they happen. A receive waits until the emulated peer's
action that produces it ends. The neighbours therefore react to the real stage like real ones would
(a slow forward here delays the gradient that comes back), and with equal costs everywhere the waits
are exactly the model's idle slots (tested). Peer action costs are ``--peer-forward-ms`` /
``--peer-backward-ms``, by default this stage's own costs learned over the warm-up iterations
(median per kind; iteration 0 is left out when there are more; then fixed, like steady neighbours),
and ``--jitter-pct`` adds seeded uniform noise per peer action (predictions stay the noiseless
model's). Between two iterations every peer spends what this stage spent between the same two
(optimizer step, batch preparation, logging), measured, not learned: it is known before any peer
action of the next iteration is needed, and a learned figure would turn this stage's noise there
into boundary bubbles. Until measured, the model assumes 1 ms per forward and 2 ms per backward.

**Which waits are bubbles.** The slot layout (ids and kinds) is the reference trainer's:
``build_schedule(name, P, M).cyclic_slots(stage)``, as
:class:`freeride.training.instrument.InstrumentedSchedule` uses. Each slot is reported every iteration (start
when the wait begins, end when it ends, possibly at once), with the *predicted* length from
:func:`plan_waits` -- the same emulation run ahead on the current cost estimates, which with equal
costs is ``simulate``'s slot length. A wait at another place (peers slower than this stage, or
jitter) is real idle time too, but not a modelled slot: it is measured and counted as unplanned, as
in the reference trainer.

**Waiting is real idleness.** On ``cpu:N`` the training thread is pinned to core N with one torch
thread and a wait is a blocking sleep. On ``cuda:N`` kernels are queued asynchronously, so each
action is bracketed by CUDA events, and the host resolves them to host-clock times only when the
peers need them; at the start of every wait it **synchronizes the stream** (so the device really is
idle from the reported start on) and then sleeps. This one synchronize per bubble is a property of
the emulation, not of the instrumented real trainer, which never synchronizes; on CUDA the emulation
also checks deliveries only where the model expects a wait (deciding anywhere else would need a
synchronize per action), so jitter there is not enforced. ``time.sleep`` overshoots by the kernel's
timer slack (50 us by default) plus wake-up latency, so a wait sleeps until ``--spin-us`` before its
target and spins the rest.

Reporting (``--report``) goes through :class:`freeride.training.reporter.BubbleReporter` to the device's
manager (``--endpoint``, else ``$FREERIDE_ENDPOINT``, else the device's default socket), with free
memory from the host (CPU) or ``torch.cuda.mem_get_info`` (CUDA: the driver's figure for the whole GPU,
which counts this trainer's own allocation as used; no NVML on the training path).
``--iteration-log`` writes the reference trainer's JSON-lines record shape, plus ``model`` (the costs
and bubble fraction the predictions used), ``compute_ms`` (the stage's own forward and backward time of
the iteration, where known without a synchronize: the bench's measure of how much side tasks slow the
stage itself), ``runqueue_wait_ms`` (how long the training thread waited, runnable, for its CPU in the
iteration: time something else held the stage's core) and a final summary.
:func:`single_stage_command` gives the bench the command line.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

from freeride.devices import parse_device_name
from freeride.devices.cpu import check_cpu_device
from freeride.endpoints import parse_endpoint, read_token
from freeride.errors import ConfigError
from freeride.measure import median
from freeride.messages import UNKNOWN_MEMORY
from freeride.training.instrument import BubbleSink, MeasuredBubble
from freeride.training.predictor import summarize
from freeride.training.schedules import BACKWARD, FORWARD, Action, IdleSlot, build_schedule
from freeride.workload.run import TrainerConfig, add_model_arguments, bubble_record

log = logging.getLogger(__name__)

#: Schedules this mode emulates: one model chunk per stage, full backwards.
SCHEDULES = ("gpipe", "1f1b")

#: Costs (ns) the model assumes before this stage has measured its own: the reference 1 : 2 ratio.
DEFAULT_FORWARD_NS = 1_000_000.0
DEFAULT_BACKWARD_NS = 2_000_000.0

_Key = tuple[int, Action]  # (iteration, action)


# ------------------------------------------------------------------ the model: pure, no torch


@dataclass(frozen=True)
class ActionCosts:
    """Cost of one micro-batch's forward and full backward through one stage (any unit)."""

    forward: float
    backward: float

    def of(self, action: Action) -> float:
        return self.forward if action.kind == FORWARD else self.backward


def pipeline_dependency(action: Action, num_stages: int) -> Action | None:
    """The action whose output ``action`` consumes, or None for the first stage's forwards.

    A forward needs the previous stage's forward of its micro-batch; a backward needs the next
    stage's backward, or on the last stage the micro-batch's own forward (the loss).
    """
    if action.kind == FORWARD:
        return Action(FORWARD, action.stage - 1, action.microbatch) if action.stage > 0 else None
    if action.stage == num_stages - 1:
        return Action(FORWARD, action.stage, action.microbatch)
    return Action(BACKWARD, action.stage + 1, action.microbatch)


class EmulatedPeers:
    """The other stages of the pipeline, simulated as they would run around the real one.

    ``orders`` is every rank's action order of one iteration (repeated for every iteration);
    ``rank`` is the real stage. A peer action starts when its rank has finished the previous action
    (for a rank's first action of iteration ``k > 0``: its last action of ``k - 1`` plus
    ``overhead(k - 1)``; of iteration 0: ``start``) and its input has arrived, and ends
    ``peer_cost(iteration, rank, action)`` later. An input produced by the real stage arrives at
    ``own_end(iteration, action)``, the real end time. Times are evaluated on demand and memoized,
    so a query touches only what it depends on; a deadlock-free order never needs a real action
    that has not run yet (it would deadlock a real pipeline too).
    """

    def __init__(
        self,
        orders: Mapping[int, Sequence[Action]],
        num_stages: int,
        rank: int,
        *,
        own_end: Callable[[int, Action], float | None],
        peer_cost: Callable[[int, int, Action], float],
        overhead: Callable[[int], float],
        start: float,
    ) -> None:
        if rank not in orders:
            raise ConfigError(f"stage {rank} is not in the {num_stages}-stage schedule")
        self.rank = rank
        self.num_stages = num_stages
        self._orders = {q: tuple(o) for q, o in orders.items()}
        self._position = {a: i for o in self._orders.values() for i, a in enumerate(o)}
        self._own_end = own_end
        self._peer_cost = peer_cost
        self._overhead = overhead
        self._start = start
        self._ends: dict[_Key, float] = {}
        self._horizon = 0  # iterations before this one are forgotten

    def release_time(self, iteration: int, action: Action) -> float | None:
        """When the input of the real stage's ``action`` arrives; None if no neighbour sends it."""
        dep = pipeline_dependency(action, self.num_stages)
        if dep is None or dep.stage == self.rank:
            return None
        return self._end((iteration, dep))

    def forget_before(self, iteration: int) -> None:
        """Drop the times of iterations before ``iteration`` (keep two back: a peer's first action
        of an iteration depends on its last of the previous one)."""
        if iteration > self._horizon:
            self._horizon = iteration
            self._ends = {k: v for k, v in self._ends.items() if k[0] >= iteration}

    def _end(self, key: _Key) -> float:
        stack = [key]
        on_stack = {key}
        while stack:
            it, action = stack[-1]
            if (it, action) in self._ends:
                on_stack.discard(stack.pop())
                continue
            if it < self._horizon:
                raise RuntimeError(f"emulated pipeline: iteration {it} is already forgotten (needed for {key})")
            needed: _Key | None = None
            ready: list[float] = []
            order = self._orders[action.stage]
            pos = self._position[action]
            if pos > 0:
                prev: _Key | None = (it, order[pos - 1])
            elif it > 0:
                prev = (it - 1, order[-1])
            else:
                prev = None
                ready.append(self._start)
            if prev is not None:
                if prev in self._ends:
                    ready.append(self._ends[prev] + (self._overhead(it - 1) if pos == 0 else 0.0))
                else:
                    needed = prev
            dep = pipeline_dependency(action, self.num_stages)
            if dep is not None and needed is None:
                if dep.stage == self.rank:
                    own = self._own_end(it, dep)
                    if own is None:
                        raise RuntimeError(
                            f"emulated pipeline: stage {action.stage}'s {action.kind}{action.microbatch} of "
                            f"iteration {it} needs the real stage's {dep.kind}{dep.microbatch}, which has not run"
                        )
                    ready.append(own)
                elif (it, dep) in self._ends:
                    ready.append(self._ends[(it, dep)])
                else:
                    needed = (it, dep)
            if needed is not None:
                if needed in on_stack:
                    raise ConfigError(f"the schedule's orders deadlock at {needed[1]} of iteration {needed[0]}")
                stack.append(needed)
                on_stack.add(needed)
                continue
            self._ends[(it, action)] = max(ready) + self._peer_cost(it, action.stage, action)
            on_stack.discard(stack.pop())
        return self._ends[key]


@dataclass(frozen=True)
class PlannedWait:
    """The real stage's wait before ``action`` in a steady iteration: ``length`` from ``start``
    (offset from the end of the stage's previous iteration plus its overhead); ``slot`` is the
    reference layout's slot ending there, or None for a wait the layout does not name."""

    action: Action
    start: float
    length: float
    slot: IdleSlot | None


@dataclass(frozen=True)
class WaitPlan:
    """Where and how long the real stage waits in one steady (cyclic) iteration."""

    slots: tuple[IdleSlot, ...]
    waits: tuple[PlannedWait, ...]
    period: float
    busy: float

    @property
    def idle(self) -> float:
        return sum(w.length for w in self.waits)

    @property
    def bubble_fraction(self) -> float:
        return self.idle / self.period if self.period > 0 else 0.0

    def slot_length(self, index: int) -> float:
        return next((w.length for w in self.waits if w.slot is not None and w.slot.index == index), 0.0)

    def wait_before(self, action: Action) -> PlannedWait | None:
        return next((w for w in self.waits if w.action == action), None)


def reference_layout(schedule: str, stages: int, microbatches: int, stage_index: int) -> tuple[IdleSlot, ...]:
    """The stage's cyclic slots at the reference 1 : 2 cost ratio: the reference trainer's slot ids."""
    return build_schedule(schedule, stages, microbatches).cyclic_slots(stage_index)


def plan_waits(
    schedule: str,
    stages: int,
    microbatches: int,
    stage_index: int,
    own: ActionCosts,
    peers: ActionCosts,
    overhead: float = 0.0,
) -> WaitPlan:
    """The real stage's waits in steady state, from the emulation run with fixed costs.

    The stage itself costs ``own``, every peer ``peers``, and every stage spends ``overhead``
    between iterations. Two iterations are emulated; the second is the steady one (in GPipe and
    1F1B the first stage's last backward is the last action of an iteration, so iteration 1 is
    iteration 0 shifted, plus the wait across the boundary). With ``own == peers`` the waits are
    :meth:`freeride.training.schedules.Schedule.cyclic_slots` of ``simulate``. Every slot of the reference
    layout is in ``waits`` (with length 0 if it closes), plus any other wait longer than zero.
    """
    model = build_schedule(schedule, stages, microbatches)
    slots = model.cyclic_slots(stage_index)
    by_action = {s.before: s for s in slots}
    order = model.orders[stage_index]
    own_ends: dict[_Key, float] = {}
    engine = EmulatedPeers(
        model.orders, stages, stage_index,
        own_end=lambda it, a: own_ends.get((it, a)),
        peer_cost=lambda it, q, a: peers.of(a),
        overhead=lambda it: overhead,
        start=0.0,
    )
    eps = 1e-9 * (own.forward + own.backward + peers.forward + peers.backward)
    free = 0.0
    waits: list[PlannedWait] = []
    busy = 0.0
    for it in (0, 1):
        iteration_start = free
        for action in order:
            release = engine.release_time(it, action)
            begin = free if release is None else max(free, release)
            slot = by_action.get(action)
            if it == 1 and (slot is not None or begin - free > eps):
                waits.append(PlannedWait(action, free - iteration_start, begin - free, slot))
            free = begin + own.of(action)
            own_ends[(it, action)] = free
            if it == 1:
                busy += own.of(action)
        free += overhead
    busy += overhead
    return WaitPlan(slots, tuple(waits), busy + sum(w.length for w in waits), busy)


def jittered(cost: float, jitter_pct: float, seed: int, iteration: int, rank: int, action: Action) -> float:
    """``cost`` times a factor drawn uniformly from ``1 +- jitter_pct/100``, the same for the same
    (seed, iteration, rank, action) whatever order the emulation evaluates them in."""
    if jitter_pct <= 0:
        return cost
    draw = random.Random(f"{seed}/{iteration}/{rank}/{action}").random()
    return cost * (1.0 + jitter_pct / 100.0 * (2.0 * draw - 1.0))


def sleep_until(target_ns: int, spin_ns: int) -> None:
    """Block until ``time.monotonic_ns() >= target_ns``: sleep to ``spin_ns`` before it, then spin."""
    while True:
        left = target_ns - time.monotonic_ns()
        if left <= 0:
            return
        if left > spin_ns:
            time.sleep((left - spin_ns) / 1e9)
        else:
            while time.monotonic_ns() < target_ns:
                pass
            return


# ------------------------------------------------------------------ configuration and command line


@dataclass
class SingleStageConfig:
    """Options of one single-stage run (model and loop options as in the reference trainer)."""

    device: str = "cpu:0"
    stage_index: int = 0
    stages: int = 4
    schedule: str = "1f1b"
    microbatches: int = TrainerConfig.microbatches
    microbatch_size: int = TrainerConfig.microbatch_size
    iterations: int = TrainerConfig.iterations
    warmup: int = TrainerConfig.warmup
    token_file: str = TrainerConfig.token_file
    vocab: int = TrainerConfig.vocab
    d_model: int = TrainerConfig.d_model
    heads: int = TrainerConfig.heads
    layers: int = TrainerConfig.layers
    seq_len: int = TrainerConfig.seq_len
    seed: int = TrainerConfig.seed
    lr: float = TrainerConfig.lr
    report: bool = False
    endpoint: str = ""
    log: str = ""
    peer_forward_ms: float | None = None
    peer_backward_ms: float | None = None
    jitter_pct: float = 0.0
    spin_us: float = 100.0

    def validate(self) -> None:
        """Check everything that needs neither torch nor the device (a bad value: ConfigError)."""
        parse_device_name(self.device)
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"unknown schedule {self.schedule!r} for a single stage: expected one of "
                              f"{', '.join(SCHEDULES)}")
        if self.stages < 2:
            raise ConfigError(f"--stages must be >= 2 (with one stage there are no neighbours), got {self.stages}")
        if not 0 <= self.stage_index < self.stages:
            raise ConfigError(f"--stage-index {self.stage_index} is out of range: a {self.stages}-stage pipeline "
                              f"has stages 0 to {self.stages - 1}")
        if self.iterations < 1 or self.microbatches < 1 or self.microbatch_size < 1:
            raise ConfigError("--iterations, --microbatches and --microbatch-size must be >= 1")
        if self.schedule == "1f1b" and self.microbatches < self.stages:
            raise ConfigError(f"1f1b needs --microbatches ({self.microbatches}) >= --stages ({self.stages})")
        if self.layers < self.stages:
            raise ConfigError(f"--layers ({self.layers}) must be >= --stages ({self.stages}): one block per stage")
        if self.warmup < 0:
            raise ConfigError(f"--warmup must be >= 0, got {self.warmup}")
        for name in ("peer_forward_ms", "peer_backward_ms"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be > 0, got {value}")
        if not 0 <= self.jitter_pct < 100:
            raise ConfigError(f"--jitter-pct must be in [0, 100), got {self.jitter_pct}")
        if self.spin_us < 0:
            raise ConfigError(f"--spin-us must be >= 0, got {self.spin_us}")
        if self.endpoint:
            parse_endpoint(self.endpoint)


def parse_args(argv: Sequence[str] | None = None) -> SingleStageConfig:
    p = argparse.ArgumentParser(
        prog="python -m freeride.workload.single_stage",
        description="Run one real pipeline stage on one device; its neighbours are emulated by timed waits.",
    )
    p.add_argument("--device", default="cpu:0", help="cpu:N (pinned to core N) or cuda:N (default cpu:0)")
    p.add_argument("--stages", type=int, default=4, help="pipeline stages P (default 4)")
    p.add_argument("--stage-index", type=int, default=0, help="which stage runs for real, 0 .. P-1 (default 0)")
    p.add_argument("--schedule", default="1f1b", choices=SCHEDULES)
    add_model_arguments(p)
    p.add_argument("--report", action=argparse.BooleanOptionalAction, default=False,
                   help="stream bubbles to the device's freeride manager")
    p.add_argument("--endpoint", default="", help="manager endpoint (default: $FREERIDE_ENDPOINT, else the "
                   "device's default socket)")
    p.add_argument("--iteration-log", dest="log", default="", help="JSON-lines file, one record per iteration")
    p.add_argument("--peer-forward-ms", type=float, default=None,
                   help="the neighbours' forward per micro-batch (default: this stage's own, learned)")
    p.add_argument("--peer-backward-ms", type=float, default=None,
                   help="the neighbours' backward per micro-batch (default: this stage's own, learned)")
    p.add_argument("--jitter-pct", type=float, default=0.0,
                   help="uniform noise on every neighbour action, +- this percentage (seeded by --seed)")
    p.add_argument("--spin-us", type=float, default=100.0,
                   help="spin (instead of sleeping) for the last microseconds of each wait (default 100)")
    return SingleStageConfig(**vars(p.parse_args(argv)))


def single_stage_command(
    device: str,
    stage_index: int,
    stages: int,
    microbatches: int,
    iterations: int,
    log: str | os.PathLike[str] | None = None,
    report: bool = False,
    endpoint: str | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """The argv that runs one single-stage trainer (for the bench and the demo).

    ``extra`` is appended as is (``--schedule gpipe``, ``--d-model 256``, ``--peer-forward-ms 5``).
    """
    argv = [
        sys.executable, "-m", "freeride.workload.single_stage", "--device", device,
        "--stage-index", str(stage_index), "--stages", str(stages), "--microbatches", str(microbatches),
        "--iterations", str(iterations),
    ]
    if log:
        argv += ["--iteration-log", os.fspath(log)]
    if report:
        argv.append("--report")
    if endpoint:
        argv += ["--endpoint", endpoint]
    return argv + list(extra)


# ------------------------------------------------------------------ the device seam: clocks


class _Mark:
    """A point in the stage's compute stream: a host time, or a CUDA event until resolved."""

    __slots__ = ("event", "ns")

    def __init__(self, event: Any = None, ns: int | None = None) -> None:
        self.event = event
        self.ns = ns


class _HostClock:
    """CPU: compute is synchronous, so the host clock is the device's."""

    check_every_action = True

    def mark(self) -> _Mark:
        return _Mark(ns=time.monotonic_ns())

    def resolve(self, mark: _Mark) -> int:
        assert mark.ns is not None  # host marks are born resolved
        return mark.ns

    def drain(self) -> int:
        return time.monotonic_ns()


class _CudaClock:
    """CUDA: marks are events on the stage's stream, mapped to the host clock through an anchor.

    The anchor is an event recorded on the idle stream at a known host time, taken at every
    :meth:`drain` (the synchronize at the start of each wait); marks recorded before it are
    resolved against the previous anchor at that moment, so every elapsed time is measured from an
    anchor that precedes the mark. Resolving a mark that is still queued waits for that event only.
    """

    check_every_action = False

    def __init__(self, index: int) -> None:
        import torch

        self._torch = torch
        self._stream = torch.cuda.current_stream(index)
        self._pending: list[_Mark] = []
        self._anchor: Any = None
        self._anchor_ns = 0
        self.drain()

    def mark(self) -> _Mark:
        event = self._torch.cuda.Event(enable_timing=True)
        event.record(self._stream)
        mark = _Mark(event=event)
        self._pending.append(mark)
        return mark

    def resolve(self, mark: _Mark) -> int:
        if mark.ns is None:
            mark.event.synchronize()
            mark.ns = self._anchor_ns + round(self._anchor.elapsed_time(mark.event) * 1e6)
            mark.event = None
        return mark.ns

    def drain(self) -> int:
        self._stream.synchronize()
        for mark in self._pending:
            self.resolve(mark)
        self._pending.clear()
        anchor = self._torch.cuda.Event(enable_timing=True)
        anchor.record(self._stream)
        anchor_ns = time.monotonic_ns()
        anchor.synchronize()
        self._anchor, self._anchor_ns = anchor, anchor_ns
        return time.monotonic_ns()


def _runqueue_wait_ns() -> int | None:
    """How long this thread has waited, runnable, for a CPU (``/proc/thread-self/schedstat``, Linux);
    None where the kernel does not say. On ``cpu:N`` that is time something else held the stage's
    core: a side task not yet parked, or another program."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as fh:
            return int(fh.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None


class _FreeMemory:
    """Free memory of the device for bubble reports, never raising.

    CPU: host RAM, re-sampled at most every 0.5 s (it is shared and moves slowly). CUDA:
    ``torch.cuda.mem_get_info``, sampled at every bubble, after the synchronize, when the trainer's own
    allocation is what it will be.
    """

    def __init__(self, read: Callable[[], int], refresh_interval_s: float) -> None:
        self._read = read
        self._interval_ns = int(refresh_interval_s * 1e9)
        self._at_ns = 0
        self._free = UNKNOWN_MEMORY

    def free_bytes(self) -> int:
        now = time.monotonic_ns()
        if self._free < 0 or now - self._at_ns >= self._interval_ns:
            self._at_ns = now
            try:
                self._free = int(self._read())
            except Exception:  # noqa: BLE001 - an unknown figure is reported as such, never raised
                self._free = UNKNOWN_MEMORY
        return self._free


# ------------------------------------------------------------------ learning this stage's costs


class _CostLearner:
    """This stage's forward, backward and between-iteration times over the learning iterations.

    The estimate of each is the median (``freeride.measure``) of its samples, leaving out iteration 0 (first-call costs:
    allocator growth, kernel selection) once later iterations have given some.
    """

    def __init__(self) -> None:
        self._samples: dict[str, list[tuple[int, float]]] = {}

    def observe(self, what: str, iteration: int, value_ns: float) -> None:
        if value_ns >= 0:
            self._samples.setdefault(what, []).append((iteration, value_ns))

    def estimate(self, what: str) -> float | None:
        samples = self._samples.get(what, [])
        values = [v for it, v in samples if it > 0] or [v for _, v in samples]
        return median(values) if values else None


# ------------------------------------------------------------------ the run


class _SingleStage:
    """One real stage and its emulated neighbours; :meth:`run` trains and returns the records."""

    def __init__(self, cfg: SingleStageConfig, sink: BubbleSink | None) -> None:
        self.cfg = cfg
        self.sink = sink
        self.model = build_schedule(cfg.schedule, cfg.stages, cfg.microbatches)
        self.order = self.model.orders[cfg.stage_index]
        self.slots = self.model.cyclic_slots(cfg.stage_index)
        self.slot_before = {s.before: s for s in self.slots}
        self.learner = _CostLearner()
        self.learn_iterations = max(1, cfg.warmup)
        self.spin_ns = int(cfg.spin_us * 1000)
        self.marks: dict[_Key, tuple[_Mark, _Mark]] = {}
        self.ready: dict[int, _Mark] = {}
        self.unplanned_waits = 0
        self.unplanned_wait_ns = 0
        self.plan = self._plan()
        self.summary: dict[str, Any] = {}

    # ---------------------------------------------------------------- costs

    def own_costs(self) -> ActionCosts:
        return ActionCosts(self.learner.estimate(FORWARD) or DEFAULT_FORWARD_NS,
                           self.learner.estimate(BACKWARD) or DEFAULT_BACKWARD_NS)

    def peer_costs(self) -> ActionCosts:
        own = self.own_costs()
        f, b = self.cfg.peer_forward_ms, self.cfg.peer_backward_ms
        return ActionCosts(own.forward if f is None else f * 1e6, own.backward if b is None else b * 1e6)

    def overhead_ns(self) -> float:
        return self.learner.estimate("overhead") or 0.0

    def _plan(self) -> WaitPlan:
        cfg = self.cfg
        return plan_waits(cfg.schedule, cfg.stages, cfg.microbatches, cfg.stage_index,
                          self.own_costs(), self.peer_costs(), self.overhead_ns())

    def _peer_cost(self, iteration: int, rank: int, action: Action) -> float:
        return jittered(self.peer_costs().of(action), self.cfg.jitter_pct, self.cfg.seed, iteration, rank, action)

    # ---------------------------------------------------------------- waiting

    def _wait_slot(self, iteration: int, action: Action, slot: IdleSlot, engine: EmulatedPeers,
                   clock: _HostClock | _CudaClock, memory: _FreeMemory) -> MeasuredBubble:
        start = clock.drain()
        free = memory.free_bytes()
        predicted = max(1, round(self.plan.slot_length(slot.index)))
        if self.sink is not None:
            self.sink.bubble_start(iteration, slot.index, slot.kind, predicted, free, start)
        release = engine.release_time(iteration, action)
        if release is not None:
            sleep_until(int(release), self.spin_ns)
        end = time.monotonic_ns()
        if self.sink is not None:
            self.sink.bubble_end(iteration, slot.index, end)
        return MeasuredBubble(iteration, slot.index, slot.kind, start, end, predicted, free)

    def _wait_unplanned(self, iteration: int, action: Action, engine: EmulatedPeers,
                        clock: _HostClock | _CudaClock) -> None:
        release = engine.release_time(iteration, action)
        if release is None or release <= time.monotonic_ns():
            return
        start = clock.drain()
        if release > start:
            sleep_until(int(release), self.spin_ns)
            self.unplanned_waits += 1
            self.unplanned_wait_ns += time.monotonic_ns() - start

    # ---------------------------------------------------------------- learning

    def _learn(self, iteration: int, clock: _HostClock | _CudaClock) -> None:
        clock.drain()
        for action in self.order:
            begin, end = self.marks[(iteration, action)]
            self.learner.observe(action.kind, iteration, clock.resolve(end) - clock.resolve(begin))
        self.plan = self._plan()

    def _between(self, iteration: int, clock: _HostClock | _CudaClock) -> float:
        """What this stage spent between the end of ``iteration`` and the start of the next: the
        time every emulated peer spends there too."""
        ready = self.ready.get(iteration + 1)
        marks = self.marks.get((iteration, self.order[-1]))
        if ready is None or marks is None:
            return self.overhead_ns()
        return float(max(0, clock.resolve(ready) - clock.resolve(marks[1])))

    def _observe_between(self, iteration: int) -> None:
        """Feed the model's period (not the peers) with the time before ``iteration``, once known."""
        ready = self.ready.get(iteration)
        marks = self.marks.get((iteration - 1, self.order[-1]))
        if ready is not None and marks is not None and ready.ns is not None and marks[1].ns is not None:
            self.learner.observe("overhead", iteration - 1, ready.ns - marks[1].ns)

    def _compute_ms(self, iteration: int) -> float | None:
        """This stage's own forward and backward time in ``iteration`` (its actions only: no waits,
        no optimizer step), when every mark is already resolved (always on CPU; on CUDA the marks
        after the last wait are not, and resolving them here would synchronize the stream)."""
        total = 0
        for action in self.order:
            marks = self.marks.get((iteration, action))
            if marks is None or marks[0].ns is None or marks[1].ns is None:
                return None
            total += marks[1].ns - marks[0].ns
        return total / 1e6

    def _model_record(self) -> dict[str, float]:
        own, peers = self.own_costs(), self.peer_costs()
        return {"forward_ms": own.forward / 1e6, "backward_ms": own.backward / 1e6,
                "peer_forward_ms": peers.forward / 1e6, "peer_backward_ms": peers.backward / 1e6,
                "overhead_ms": self.overhead_ns() / 1e6, "bubble_fraction": self.plan.bubble_fraction}

    # ---------------------------------------------------------------- training loop

    def run(self, out_file: IO[str] | None) -> list[dict[str, Any]]:
        """Train ``cfg.iterations`` iterations, writing a record per iteration to ``out_file``;
        the summary is left in :attr:`summary`."""
        import torch

        from freeride.workload.model import GPTConfig, build_chunk, lm_loss, synthetic_batch

        cfg = self.cfg
        name = parse_device_name(cfg.device)
        gpt = GPTConfig(cfg.vocab, cfg.d_model, cfg.heads, cfg.layers, cfg.seq_len, cfg.seed)
        if name.kind == "cuda":
            torch.cuda.set_device(name.index)
            torch_device = torch.device("cuda", name.index)
            clock: _HostClock | _CudaClock = _CudaClock(name.index)
            memory = _FreeMemory(lambda: torch.cuda.mem_get_info(name.index)[0], 0.0)
        else:
            import psutil

            torch_device = torch.device("cpu")
            clock = _HostClock()
            memory = _FreeMemory(lambda: psutil.virtual_memory().available, 0.5)

        r, m, mb = cfg.stage_index, cfg.microbatches, cfg.microbatch_size
        first, last = r == 0, r == cfg.stages - 1
        chunk = build_chunk(gpt, r, cfg.stages).to(torch_device)
        optimizer = torch.optim.AdamW(chunk.parameters(), lr=cfg.lr)
        # What the neighbours would send: one activation per micro-batch (into a non-first stage)
        # and one output gradient per micro-batch (into a non-last stage), fixed random tensors.
        gen = torch.Generator().manual_seed(cfg.seed * 7919 + 101 + r)
        shape = (mb, cfg.seq_len, cfg.d_model)
        received = [] if first else [torch.randn(shape, generator=gen).to(torch_device) for _ in range(m)]
        grads = [] if last else [(torch.randn(shape, generator=gen) * 1e-2).to(torch_device) for _ in range(m)]
        saved: dict[int, Any] = {}
        losses: list[Any] = []
        xs: list[Any] = []
        ys: list[Any] = []

        def compute(action: Action) -> None:
            i = action.microbatch
            if action.kind == FORWARD:
                inp = xs[i] if first else received[i].detach().requires_grad_()
                out = chunk(inp)
                if last:
                    out = lm_loss(out, ys[i]) / m
                    losses.append(out.detach())
                saved[i] = out
            else:
                out = saved.pop(i)
                if last:
                    out.backward()
                else:
                    out.backward(grads[i])

        engine: EmulatedPeers | None = None

        def own_end(iteration: int, action: Action) -> float | None:
            marks = self.marks.get((iteration, action))
            return None if marks is None else float(clock.resolve(marks[1]))

        records: list[dict[str, Any]] = []
        errors: list[float] = []
        log.info("[stage %d/%d %s] %s x %d micro-batches, neighbours emulated, report=%s", r, cfg.stages,
                 cfg.device, cfg.schedule, m, cfg.report)
        for it in range(cfg.iterations):
            x, y = synthetic_batch(gpt, m * mb, it)
            xs = list(x.to(torch_device).split(mb)) if first else []
            ys = list(y.to(torch_device).split(mb)) if last else []
            losses.clear()
            bubbles: list[MeasuredBubble] = []
            model_record = self._model_record()
            waited0 = _runqueue_wait_ns()
            t0 = time.monotonic_ns()
            optimizer.zero_grad(set_to_none=True)
            self.ready[it] = clock.mark()
            if engine is None:
                engine = EmulatedPeers(self.model.orders, cfg.stages, r, own_end=own_end,
                                       peer_cost=self._peer_cost, overhead=lambda k: self._between(k, clock),
                                       start=float(clock.resolve(self.ready[it])))
            engine.forget_before(it - 2)
            for key in [k for k in self.marks if k[0] < it - 2]:
                del self.marks[key]
            self.ready.pop(it - 3, None)
            for action in self.order:
                slot = self.slot_before.get(action)
                if slot is not None:
                    bubbles.append(self._wait_slot(it, action, slot, engine, clock, memory))
                elif clock.check_every_action or self.plan.wait_before(action) is not None:
                    self._wait_unplanned(it, action, engine, clock)
                begin = clock.mark()
                compute(action)
                self.marks[(it, action)] = (begin, clock.mark())
            optimizer.step()
            elapsed = time.monotonic_ns() - t0
            waited1 = _runqueue_wait_ns()
            if it > 0:
                self._observe_between(it)
            if it < self.learn_iterations:
                self._learn(it, clock)
            elif it >= cfg.warmup:
                errors.extend(abs(b.predicted_ns - b.length_ns) / b.length_ns for b in bubbles if b.length_ns > 0)
            bubble_ms = sum(b.length_ns for b in bubbles) / 1e6
            record: dict[str, Any] = {
                "iteration": it,
                "rank": r,
                "stage": r,
                "device": cfg.device,
                "warmup": it < cfg.warmup,
                "instrumented": True,
                "reporting": self.sink is not None,
                "emulated_peers": True,
                "time_ms": elapsed / 1e6,
                "end_ns": t0 + elapsed,
                "loss": float(torch.stack(losses).sum()) if losses else None,
                "bubbles": [bubble_record(b) for b in bubbles],
                "bubble_fraction": bubble_ms / (elapsed / 1e6) if elapsed > 0 else 0.0,
                "model": model_record,
            }
            compute_ms = self._compute_ms(it)
            if compute_ms is not None:
                record["compute_ms"] = compute_ms
            if waited0 is not None and waited1 is not None:
                record["runqueue_wait_ms"] = (waited1 - waited0) / 1e6
            records.append(record)
            if out_file is not None:
                out_file.write(json.dumps(record) + "\n")
                out_file.flush()
            log.info("[stage %d] iteration %d: %.1f ms, bubbles %.0f%% (model %.0f%%)%s", r, it, elapsed / 1e6,
                     100 * record["bubble_fraction"], 100 * model_record["bubble_fraction"],
                     f", loss {record['loss']:.4f}" if record["loss"] is not None else "")
        steady = [rec for rec in records if not rec["warmup"]] or records
        self.plan = self._plan()  # the period with every between-iterations time measured
        err = summarize(errors)
        summary: dict[str, Any] = {
            "summary": True,
            "rank": r,
            "stage": r,
            "device": cfg.device,
            "config": asdict(cfg),
            "slots": [{"slot": s.index, "kind": s.kind} for s in self.slots],
            "unplanned_waits": self.unplanned_waits,
            "unplanned_wait_ms": self.unplanned_wait_ns / 1e6,
            "prediction_error": {"count": err.count, "p50": err.p50, "p90": err.p90, "max": err.max},
            "bubble_fraction": {
                "measured": sum(rec["bubble_fraction"] for rec in steady) / len(steady),
                "model": self.plan.bubble_fraction,
            },
            "model": self._model_record(),
        }
        self.summary = summary
        return records


def run(cfg: SingleStageConfig, sink: BubbleSink | None = None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Train one stage in this process; returns the iteration records and the summary.

    ``sink`` receives the bubbles (a test's recorder); without one, ``cfg.report`` opens a
    :class:`freeride.training.reporter.BubbleReporter`. On ``cpu:N`` the calling thread is pinned to core N
    and torch to one thread for the run; both are restored afterwards.
    """
    cfg.validate()
    device = parse_device_name(cfg.device)
    token = read_token(cfg.token_file or None) if cfg.report and sink is None else None
    import torch

    if device.kind == "cpu":
        check_cpu_device(device)
    elif not torch.cuda.is_available() or device.index >= torch.cuda.device_count():
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        raise ConfigError(f"unknown device {device}: this process sees {count} GPU(s)")

    given_cores = set(os.sched_getaffinity(0))
    threads = torch.get_num_threads()
    reporter = None
    out_file = None
    try:
        if device.kind == "cpu":
            # One core per stage: the waits are then real idle time of that core (the device cpu:N).
            os.sched_setaffinity(0, {device.index})
            torch.set_num_threads(1)
        if sink is None and cfg.report:
            from freeride.training.reporter import BubbleReporter

            # Keep the sender thread (and gRPC's) off the stage's core when there is another one.
            others = given_cores - {device.index} if device.kind == "cpu" else given_cores
            reporter = BubbleReporter(cfg.device, stage=cfg.stage_index, rank=cfg.stage_index,
                                      endpoint=cfg.endpoint or None, token=token,
                                      cpu_affinity=others or given_cores)
            sink = reporter
        if cfg.log:
            path = Path(cfg.log.format(rank=cfg.stage_index, stage=cfg.stage_index))
            path.parent.mkdir(parents=True, exist_ok=True)
            out_file = path.open("w")
        stage = _SingleStage(cfg, sink)
        records = stage.run(out_file)
        summary = stage.summary
        if reporter is not None:
            reporter.close()  # flush first: the counters then say what reached the manager
            summary["reporter"] = asdict(reporter.counters())
        if out_file is not None:
            out_file.write(json.dumps(summary) + "\n")
        return records, summary
    finally:
        if out_file is not None:
            out_file.close()
        if reporter is not None:
            reporter.close()
        if device.kind == "cpu":
            os.sched_setaffinity(0, given_cores)
            torch.set_num_threads(threads)


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(
        level=os.environ.get("FREERIDE_LOG_LEVEL", "INFO"),
        format="%(asctime)s single-stage %(levelname)s %(name)s: %(message)s",
    )
    try:
        cfg = parse_args(argv)
        _records, summary = run(cfg)
    except ConfigError as exc:
        logging.getLogger(__name__).error("%s", exc)
        return 2
    fraction = summary["bubble_fraction"]
    log.info("[stage %d] bubble fraction: measured %.3f, model %.3f", cfg.stage_index,
             fraction["measured"], fraction["model"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
