"""Device-timed bubbles on a GPU: their error against the torch profiler's kernel timeline, and their cost.

One GPU, one stage, the exact device behaviour of a pipeline receive: compute actions launch matrix
products on the current stream; before each action that needs a neighbour's output, a "receive" makes
the stream (not the host) wait for an event recorded on a communication stream behind a timed sleep
kernel, as NCCL's receive wait does. The sleep starts once the stage's work before it is done, so every
modelled slot is a gap of the sleep's length on the device. The host runs ahead; only the device idles.
The stage runs under :class:`InstrumentedSchedule` (CUDA events, resolved off the training thread)
and under the torch profiler, each action bracketed by ``record_function`` with a label of its own;
the profiler's device span of each action is the span of the kernels launched under its label
(:func:`action_spans`), so no kernel's name matters (torch's sleep kernel is ``spin_kernel``, not
"sleep"). For every reported bubble the error is taken against the profiler's gap between the actions
around it, both relative to the iteration's first action (the two have different clock bases), for
the start and the end.

The mechanism's cost is the training thread's time per iteration with the instrumentation attached
against detached, interleaved, as a trainer runs it: marks only where waits begin and end (no
``time_actions``, which the error run needs and production does not), after the tracker's profiling
iterations (``remodel_iterations``, whose action marks and model fits are a start-up cost, counted apart
as ``host_ms_profiling``). Every sample is kept in the JSON, so a tail can be told from a start-up.
(The first GPU run, on an H200, measured with ``time_actions`` on and the profiling iterations in:
3.65 ms attached against 1.74 ms bare, p50 of 20. The second, as here: 0.56 ms more an iteration for
18 marks, about 31 us a mark, unexplained.) So the cost is also given as a share of the iteration as
the device runs it (a bare iteration launched and waited for), and a mark is taken apart
(:func:`mark_costs`): each call it makes on the training thread, timed alone on the real device.

    python -m bench.gpu.bubble_timing [--iterations 60]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any

from bench.gpu.common import pct, write_results
from freeride.training.device_clock import CudaEventClock, TorchClockDevice
from freeride.training.free_memory import MemorySampler
from freeride.training.instrument import InstrumentedSchedule
from freeride.training.schedules import build_schedule

MS = 1_000_000


class GpuStage:
    """A pipeline stage whose actions are matrix products on the current stream."""

    def __init__(self, torch: Any, stage_index: int, num_stages: int, size: int, kernels: int) -> None:
        self.torch = torch
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
        self.c = torch.empty_like(self.a)
        self.kernels = kernels

    def _work(self, n: int) -> None:
        for _ in range(n):
            self.torch.matmul(self.a, self.a, out=self.c)

    def forward_one_chunk(self, fwd_chunk_id: int, args: Any = None, kwargs: Any = None) -> None:
        self._work(self.kernels)

    def backward_one_chunk(self, bwd_chunk_id: int, loss: Any = None, full_backward: bool = True,
                           last_backward: bool = False) -> None:
        self._work(2 * self.kernels)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False) -> None:
        self._work(self.kernels)


class Schedule1F1B:
    """Stage ``stage_index`` of a 1F1B pipeline; each receive is a stream wait behind a sleep kernel."""

    def __init__(self, stage: GpuStage, n_microbatches: int, wait_cycles: int) -> None:
        self._stage = stage
        self._n_microbatches = n_microbatches
        self.model = build_schedule("1f1b", stage.num_stages, n_microbatches)
        self.order = self.model.orders[stage.stage_index]
        self.waits_before = {s.before for s in self.model.cyclic_slots(stage.stage_index)}
        self.comm = stage.torch.cuda.Stream()
        self.wait_cycles = wait_cycles
        self.iteration = 0

    def step(self, *args: Any, **kwargs: Any) -> None:
        torch = self._stage.torch
        it, self.iteration = self.iteration, self.iteration + 1
        for j, action in enumerate(self.order):
            if action in self.waits_before:
                # The neighbour's send arrives wait_cycles after this stage's work so far is done (the H200
                # run timed the sleep from its launch: the host runs ahead, so every wait but the
                # iteration's first was over before the stream reached it, and only 10 bubbles were seen).
                done = torch.cuda.Event()
                done.record(torch.cuda.current_stream())
                with torch.cuda.stream(self.comm):
                    self.comm.wait_event(done)
                    torch.cuda._sleep(self.wait_cycles)  # the neighbour's send, still in flight
                    arrived = torch.cuda.Event()
                    arrived.record(self.comm)
                torch.cuda.current_stream().wait_event(arrived)  # the receive: the stream waits, not the host
            with torch.profiler.record_function(action_label(it, j)):
                if action.kind == "F":
                    self._stage.forward_one_chunk(action.microbatch, (), {})
                else:
                    self._stage.backward_one_chunk(action.microbatch, loss=None, full_backward=True)


LABEL = "freeride.action:"


def action_label(iteration: int, index: int) -> str:
    return f"{LABEL}{iteration}:{index}"


def _on_device(event: Any) -> bool:
    return str(getattr(event, "device_type", "")).endswith("CUDA")


def action_spans(events: list[Any]) -> dict[str, tuple[float, float]]:
    """Each labelled action's device span (first kernel start, last kernel end; the profiler's us).

    Where the profiler records GPU-side annotations (a device event carrying the label), those are the
    spans. Otherwise each label's span is that of the device kernels launched by the CPU-side annotation
    or anything under it (a kernel's ``linked_correlation_id`` names the CPU op that launched it).
    """
    spans: dict[str, tuple[float, float]] = {}

    def widen(label: str, start: float, end: float) -> None:
        old = spans.get(label)
        spans[label] = (start, end) if old is None else (min(old[0], start), max(old[1], end))

    for e in events:
        if _on_device(e) and e.name.startswith(LABEL) and e.time_range.end > e.time_range.start:
            widen(e.name, e.time_range.start, e.time_range.end)
    if spans:
        return spans
    kernels: dict[int, list[Any]] = {}
    for e in events:
        if _on_device(e) and getattr(e, "linked_correlation_id", 0) > 0:
            kernels.setdefault(e.linked_correlation_id, []).append(e)
    for e in events:
        if _on_device(e) or not e.name.startswith(LABEL):
            continue
        stack, ids = [e], set()
        while stack:
            op = stack.pop()
            ids.add(op.id)
            stack.extend(getattr(op, "cpu_children", []))
        for k in (k for i in ids for k in kernels.get(i, [])):
            widen(e.name, k.time_range.start, k.time_range.end)
    return spans


class Sink:
    def __init__(self) -> None:
        self.starts: dict[tuple[int, int], int] = {}
        self.ends: dict[tuple[int, int], int] = {}

    def bubble_start(self, iteration: int, slot: int, kind: str, predicted_ns: int, free_memory_bytes: int = -1,
                     start_ns: int | None = None, learned: bool = False) -> None:
        self.starts[(iteration, slot)] = int(start_ns or 0)

    def bubble_end(self, iteration: int, slot: int, end_ns: int | None = None) -> None:
        self.ends[(iteration, slot)] = int(end_ns or 0)


def bubble_errors(spans: dict[str, tuple[float, float]], actions: dict[int, list[Any]], sink: Sink,
                  schedule: Schedule1F1B, first_it: int, labelled_from: int,
                  iterations: int) -> tuple[list[float], list[float]]:
    """|ours - profiler's| for each bubble's start and end (us), both relative to the iteration's first action.

    ``actions``: our measured actions per iteration (their ``start_ns``); ``sink``: the bubbles we reported;
    the instrumentation's iteration ``first_it + k`` is the schedule's labelled iteration ``labelled_from + k``.
    """
    start_err: list[float] = []
    end_err: list[float] = []
    pos = {a: j for j, a in enumerate(schedule.order)}
    for k in range(iterations):
        it = first_it + k
        labels = [action_label(labelled_from + k, j) for j in range(len(schedule.order))]
        if it not in actions or not all(label in spans for label in labels):
            continue
        base_prof = spans[labels[0]][0]
        base_ours = actions[it][0].start_ns
        for slot in schedule.model.cyclic_slots(0):
            key = (it, slot.index)
            if key not in sink.starts or key not in sink.ends or slot.after is None or slot.before is None:
                continue
            prof_start = (spans[labels[pos[slot.after]]][1] - base_prof) * 1000
            prof_end = (spans[labels[pos[slot.before]]][0] - base_prof) * 1000
            start_err.append(abs((sink.starts[key] - base_ours) - prof_start) / 1000)
            end_err.append(abs((sink.ends[key] - base_ours) - prof_end) / 1000)
    return start_err, end_err


def host_cost(schedule: Any, iterations: int, synchronize: Callable[[], None], device: str = "cuda:0",
              remodel_iterations: int = 5) -> dict[str, list[float]]:
    """The training thread's ms per iteration, as a trainer runs the instrumentation (module doc): the
    profiling iterations first (``profiling``), then ``iterations`` alternating ``attached`` / ``detached``.
    ``synchronize`` waits for the device between iterations (``torch.cuda.synchronize``). Beside them:
    ``iteration``, each bare iteration's ms from its launch until the device finished it (what the cost is
    a share of), and ``marks``, the device clock's marks in each attached iteration (empty on the host
    clock, which keeps no count)."""
    inst = InstrumentedSchedule(schedule, sink=Sink(), device=device, remodel_iterations=remodel_iterations)
    host: dict[str, list[float]] = {"profiling": [], "attached": [], "detached": [], "iteration": [], "marks": []}

    def timed(key: str) -> None:
        marks = getattr(inst.clock, "marks", None)
        t0 = time.perf_counter_ns()
        inst.step()
        t1 = time.perf_counter_ns()
        host[key].append((t1 - t0) / 1e6)
        synchronize()  # between iterations only: each one starts on an idle GPU
        if key == "detached":
            host["iteration"].append((time.perf_counter_ns() - t0) / 1e6)
        elif key == "attached" and marks is not None:
            host["marks"].append(float(inst.clock.marks - marks))  # type: ignore[attr-defined]
        inst.flush()  # and the tracker has every mark of the last one: its learning falls in the next one

    for _ in range(remodel_iterations + 1):  # delivered one iteration late: one more ends the profiling
        timed("profiling")
    for i in range(iterations):
        attached = i % 2 == 0
        (inst.attach if attached else inst.detach)()
        timed("attached" if attached else "detached")
    inst.close()
    return host


def cost_share(cost_ms: list[float], iteration_ms: list[float]) -> float:
    """The instrumentation's cost as a share of the iteration: p50 of the pair-by-pair cost over p50 of the
    bare iterations' time on the device (NaN without samples)."""
    if not cost_ms or not iteration_ms:
        return float("nan")
    return pct(cost_ms)["p50"] / pct(iteration_ms)["p50"]


def mark_costs(device: Any, calls: int = 2000, blocks: int = 5,
               also: dict[str, Callable[[], Any]] | None = None) -> dict[str, float]:
    """What a device-clock mark costs the training thread, call by call (us a call; each the median over
    ``blocks`` blocks of ``calls`` calls): the capture check, the current stream, an event's record, and
    the whole :meth:`CudaEventClock.mark` with its resolver thread running, as in use; then each of
    ``also`` (other calls the hooks make, by name). ``device`` is a
    :class:`~freeride.training.device_clock.ClockDevice` (the real one on a GPU, a fake in tests)."""

    def per_call(fn: Callable[[], Any]) -> float:
        samples = []
        for _ in range(blocks):
            t0 = time.perf_counter_ns()
            for _ in range(calls):
                fn()
            samples.append((time.perf_counter_ns() - t0) / calls / 1000)
        return sorted(samples)[len(samples) // 2]

    stream = device.current_stream()
    event = device.new_event()
    costs = {
        "capture check": per_call(device.capturing),
        "current stream": per_call(device.current_stream),
        "event record": per_call(lambda: event.record(stream)),
    }
    clock = CudaEventClock(lambda payload, at_ns: None, 0, device=device, max_pending=calls * blocks + 1)
    try:
        costs["whole mark, resolver running"] = per_call(lambda: clock.mark(None))
        clock.flush()
    finally:
        clock.close()
    costs.update((name, per_call(fn)) for name, fn in (also or {}).items())
    return costs


def main(argv: list[str] | None = None) -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=60)
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--kernels", type=int, default=4)
    ap.add_argument("--wait-ms", type=float, default=3.0)
    ns = ap.parse_args(argv)
    torch.cuda.init()
    stage = GpuStage(torch, 0, 4, ns.size, ns.kernels)
    # _sleep spins for a number of GPU clock cycles: calibrate cycles per ms on this GPU.
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    cycles_per_ms = 10_000_000 / start.elapsed_time(end)
    schedule = Schedule1F1B(stage, 8, int(ns.wait_ms * cycles_per_ms))
    host = host_cost(schedule, ns.iterations, torch.cuda.synchronize)
    memory = MemorySampler("cuda:0")
    memory.refresh()
    parts = mark_costs(TorchClockDevice(0), also={"free memory at a bubble start": memory.free_bytes})

    sink = Sink()
    inst = InstrumentedSchedule(schedule, sink=sink, device="cuda:0", time_actions=True)
    actions: dict[int, list[Any]] = {}
    inst.on_iteration = lambda it, bubbles: actions.__setitem__(it, inst.last_actions)
    inst.step()  # the first iteration's one-off costs (event pool, the clock's first anchor)
    torch.cuda.synchronize()
    inst.flush()

    # Error against the profiler: profile a few iterations, compare relative times.
    sink.starts.clear()
    sink.ends.clear()
    first_it = inst.iteration
    labelled_from = schedule.iteration
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]  # CPU: the labels
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(10):
            inst.step()
            torch.cuda.synchronize()
    inst.flush()
    spans = action_spans(list(prof.events()))
    start_err, end_err = bubble_errors(spans, actions, sink, schedule, first_it, labelled_from, 10)
    cost_ms = [a - d for a, d in zip(host["attached"], host["detached"], strict=False)]
    data = {"start_error_us": pct(start_err), "end_error_us": pct(end_err),
            "host_ms_attached": pct(host["attached"]), "host_ms_detached": pct(host["detached"]),
            "host_cost_ms_per_iteration": pct(cost_ms), "host_ms_profiling": pct(host["profiling"]),
            "iteration_ms": pct(host["iteration"]), "marks_per_iteration": pct(host["marks"]),
            "cost_share_of_iteration": cost_share(cost_ms, host["iteration"]), "mark_us": parts,
            "host_samples_ms": host, "marks_dropped": getattr(inst.clock, "dropped", 0),
            "anchor_window_us": getattr(inst.clock, "anchor_window_ns", 0) / 1000,
            "anchors_refused": getattr(inst.clock, "anchors_refused", 0),
            "wait_ms": ns.wait_ms, "kernels": ns.kernels, "size": ns.size}
    table = "\n".join([
        "| figure | p50 | p99 | max | count |", "|---|---|---|---|---|",
        *(f"| {name} | {v['p50']:.2f} | {v['p99']:.2f} | {v['max']:.2f} | {v['count']} |"
          for name, v in (("bubble start error vs profiler (us)", data["start_error_us"]),
                          ("bubble end error vs profiler (us)", data["end_error_us"]),
                          ("training-thread ms per iteration, instrumented", data["host_ms_attached"]),
                          ("training-thread ms per iteration, bare", data["host_ms_detached"]),
                          ("instrumented minus bare, pair by pair (ms)", data["host_cost_ms_per_iteration"]),
                          ("training-thread ms per profiling iteration", data["host_ms_profiling"]),
                          ("iteration ms, bare, launch to the device's end", data["iteration_ms"]),
                          ("device-clock marks per instrumented iteration", data["marks_per_iteration"]))),
        "",
        f"Cost as a share of the bare iteration (p50 over p50): {data['cost_share_of_iteration']:.3%}.",
        "",
        "A mark on the training thread, call by call (us each, median of blocks of calls, on this device):",
        "",
        "| call | us |", "|---|---|",
        *(f"| {name} | {us:.2f} |" for name, us in parts.items()),
    ])
    write_results("bubble_timing", data, table, "python -m bench.gpu.bubble_timing " + " ".join(sys.argv[1:]))
    inst.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
