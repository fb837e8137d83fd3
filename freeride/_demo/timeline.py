"""The demo's timeline picture: each stage's compute and bubbles, and the side-task steps inside.

One lane per pipeline stage, over a window of a few consecutive iterations of the run with side
tasks. A lane is dark where the stage computes and light where it waits (a bubble, measured by
the trainer); the side-task steps its device's manager granted are drawn as narrower coloured
bars inside the bubbles, one colour per task. A step that spills out of a bubble shows as colour
over the dark compute. Times are milliseconds from the window's start, on the clock every process
on the host shares (CLOCK_MONOTONIC), so the trainer's and the managers' records line up.

The window is the one with the most side-task steps (so the picture shows harvest, not the
tasks' start-up), among the iterations after the warm-up. Rendering uses matplotlib's object API
with the Agg canvas: no display, no pyplot global state.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from freeride._demo.summary import Iteration, measured
from freeride._demo.traces import Grant

COMPUTE_COLOUR = "#3b5b92"
BUBBLE_COLOUR = "#e8e8e8"
#: One colour per side task, in the order tasks are listed.
TASK_COLOURS = ("#e45756", "#54a24b", "#f58518", "#b279a2", "#72b7b2", "#eeca3b")


@dataclass(frozen=True)
class Window:
    """The iterations ``first..last`` (inclusive) and their time span ``[start_ns, end_ns]``."""

    first: int
    last: int
    start_ns: int
    end_ns: int


def compute_spans(iteration: Iteration) -> list[tuple[int, int]]:
    """The iteration's span minus its bubbles: when the stage computed, as ``(start_ns, end_ns)``."""
    spans = []
    cursor = iteration.start_ns
    for b in sorted(iteration.bubbles, key=lambda b: b.start_ns):
        start = max(cursor, b.start_ns)
        if start > cursor:
            spans.append((cursor, min(start, iteration.end_ns)))
        cursor = max(cursor, min(iteration.end_ns, b.start_ns + round(b.length_ms * 1e6)))
    if cursor < iteration.end_ns:
        spans.append((cursor, iteration.end_ns))
    return [(s, e) for s, e in spans if e > s]


def bubble_spans(iteration: Iteration) -> list[tuple[int, int]]:
    return [(b.start_ns, b.start_ns + round(b.length_ms * 1e6)) for b in iteration.bubbles]


def choose_window(
    run: Mapping[int, Sequence[Iteration]], steps_ns: Sequence[tuple[int, int]], width: int = 3
) -> Window:
    """The ``width`` consecutive iterations (after the warm-up) holding the most step starts."""
    by_index: dict[int, list[Iteration]] = {}
    for iterations in run.values():
        for it in measured(iterations) or list(iterations):
            by_index.setdefault(it.iteration, []).append(it)
    indices = sorted(by_index)
    if not indices:
        raise ValueError("no iterations to draw")
    width = max(1, min(width, len(indices)))
    starts = sorted(s for s, _ in steps_ns)
    best: Window | None = None
    best_count = -1
    for i in range(len(indices) - width + 1):
        chosen = indices[i : i + width]
        if chosen[-1] - chosen[0] != width - 1:
            continue  # a gap in the log: not consecutive
        lo = min(it.start_ns for k in chosen for it in by_index[k])
        hi = max(it.end_ns for k in chosen for it in by_index[k])
        count = sum(1 for s in starts if lo <= s <= hi)
        if count > best_count:
            best, best_count = Window(chosen[0], chosen[-1], lo, hi), count
    if best is None:
        k = indices[0]
        best = Window(k, k, min(it.start_ns for it in by_index[k]), max(it.end_ns for it in by_index[k]))
    return best


def draw_timeline(
    path: Path,
    run: Mapping[int, Sequence[Iteration]],
    grants: Mapping[str, Sequence[Grant]],
    task_names: Mapping[str, str],
    width: int = 3,
    title: str = "",
) -> Window:
    """Write the picture as a PNG at ``path``; returns the window drawn.

    Args:
        run: iterations per stage of the run with side tasks.
        grants: per device, the grants of its manager's trace (steps inside).
        task_names: display name per task id (legend and colours, in this order).
    """
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    all_steps = [(s, e) for gs in grants.values() for g in gs for s, e in g.steps]
    window = choose_window(run, all_steps, width)
    t0 = window.start_ns

    def ms(spans: Sequence[tuple[int, int]]) -> list[tuple[float, float]]:
        out = []
        for s, e in spans:
            s, e = max(s, window.start_ns), min(e, window.end_ns)
            if e > s:
                out.append(((s - t0) / 1e6, (e - s) / 1e6))
        return out

    stages = sorted(run)
    colours = {task: TASK_COLOURS[i % len(TASK_COLOURS)] for i, task in enumerate(task_names)}
    fig = Figure(figsize=(13, 1.2 + 1.25 * len(stages)), dpi=110)
    ax = fig.add_subplot()
    labels = []
    for lane, stage in enumerate(stages):
        # Every iteration overlapping the window, so that steps near its edges sit in their bubbles.
        iterations = [it for it in run[stage] if it.end_ns > window.start_ns and it.start_ns < window.end_ns]
        y = len(stages) - 1 - lane  # stage 0 on top
        device = iterations[0].device if iterations else (run[stage][0].device if run[stage] else "?")
        labels.append((y, f"stage {stage}\n{device}"))
        ax.broken_barh(ms([s for it in iterations for s in bubble_spans(it)]), (y - 0.4, 0.8),
                       facecolors=BUBBLE_COLOUR, edgecolors="#b0b0b0", linewidth=0.5)
        ax.broken_barh(ms([s for it in iterations for s in compute_spans(it)]), (y - 0.4, 0.8),
                       facecolors=COMPUTE_COLOUR)
        for task in task_names:
            spans = [st for g in grants.get(device, ()) if g.task == task for st in g.steps]
            if spans:
                ax.broken_barh(ms(spans), (y - 0.25, 0.5), facecolors=colours[task], edgecolors="white",
                               linewidth=0.3)
        pad_ms = (window.end_ns - window.start_ns) / 1e6 * 0.003
        for it in iterations:
            if it.start_ns >= window.start_ns:
                ax.annotate(f"iteration {it.iteration}", ((it.start_ns - t0) / 1e6 + pad_ms, y + 0.42), fontsize=7,
                            color="#555555", va="bottom", ha="left")
    ax.set_yticks([y for y, _ in labels], [text for _, text in labels])
    ax.set_ylim(-0.6, len(stages) - 0.3)
    ax.set_xlim(0, (window.end_ns - window.start_ns) / 1e6)
    ax.set_xlabel("time (ms)")
    ax.grid(axis="x", color="#dddddd", linewidth=0.5)
    ax.set_axisbelow(True)
    handles = [Patch(facecolor=COMPUTE_COLOUR, label="training compute"),
               Patch(facecolor=BUBBLE_COLOUR, edgecolor="#b0b0b0", label="bubble (stage idle)")]
    handles += [Patch(facecolor=colours[t], label=f"{name} step") for t, name in task_names.items()]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.18 - 0.25 / len(stages)),
              ncol=len(handles), frameon=False, fontsize=8)
    ax.set_title(title or f"iterations {window.first}-{window.last}: side-task steps inside the bubbles",
                 fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return window
