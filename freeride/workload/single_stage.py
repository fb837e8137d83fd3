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
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

from freeride.devices import parse_device_name
from freeride.devices.cpu import check_cpu_device
from freeride.endpoints import parse_endpoint, read_token
from freeride.errors import ConfigError
from freeride.training.predictor import summarize
from freeride.training.schedules import BACKWARD, FORWARD, Action, IdleSlot, build_schedule
from freeride.training.tracker import BubbleSink, MeasuredBubble
from freeride.workload.emulated_peers import ActionCosts, EmulatedPeers, WaitPlan, jittered, plan_waits, sleep_until
from freeride.workload.run import TrainerConfig, add_model_arguments, bubble_record
from freeride.workload.stage_clocks import CostLearner, CudaMarks, FreeMemory, HostMarks, Mark, runqueue_wait_ns

log = logging.getLogger(__name__)

#: Schedules this mode emulates: one model chunk per stage, full backwards.
SCHEDULES = ("gpipe", "1f1b")

#: Costs (ns) the model assumes before this stage has measured its own: the reference 1 : 2 ratio.
DEFAULT_FORWARD_NS = 1_000_000.0
DEFAULT_BACKWARD_NS = 2_000_000.0

_Key = tuple[int, Action]  # (iteration, action)

__all__ = ["ActionCosts", "EmulatedPeers", "SingleStageConfig", "jittered", "main", "parse_args", "plan_waits",
           "run", "single_stage_command", "sleep_until"]


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
        self.learner = CostLearner()
        self.learn_iterations = max(1, cfg.warmup)
        self.spin_ns = int(cfg.spin_us * 1000)
        self.marks: dict[_Key, tuple[Mark, Mark]] = {}
        self.ready: dict[int, Mark] = {}
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
                   clock: HostMarks | CudaMarks, memory: FreeMemory) -> MeasuredBubble:
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
                        clock: HostMarks | CudaMarks) -> None:
        release = engine.release_time(iteration, action)
        if release is None or release <= time.monotonic_ns():
            return
        start = clock.drain()
        if release > start:
            sleep_until(int(release), self.spin_ns)
            self.unplanned_waits += 1
            self.unplanned_wait_ns += time.monotonic_ns() - start

    # ---------------------------------------------------------------- learning

    def _learn(self, iteration: int, clock: HostMarks | CudaMarks) -> None:
        clock.drain()
        for action in self.order:
            begin, end = self.marks[(iteration, action)]
            self.learner.observe(action.kind, iteration, clock.resolve(end) - clock.resolve(begin))
        self.plan = self._plan()

    def _between(self, iteration: int, clock: HostMarks | CudaMarks) -> float:
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
            clock: HostMarks | CudaMarks = CudaMarks(name.index)
            memory = FreeMemory(lambda: torch.cuda.mem_get_info(name.index)[0], 0.0)
        else:
            import psutil

            torch_device = torch.device("cpu")
            clock = HostMarks()
            memory = FreeMemory(lambda: psutil.virtual_memory().available, 0.5)

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
            waited0 = runqueue_wait_ns()
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
            waited1 = runqueue_wait_ns()
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
