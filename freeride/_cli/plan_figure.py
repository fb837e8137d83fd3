"""The picture of ``freeride plan --sweep --plot FILE``: the frontier of the configurations swept.

Two panels share the vertical axis, the bubble fraction (the iteration time relative to the work):
against the peak memory per stage (left) and against the harvest capacity (right). Each
configuration is one point, shaped and coloured by schedule; Pareto-optimal points are filled and
labelled, the others hollow; a configuration that exceeds the device's memory is a grey cross.
Without a memory model the panels fall back to the iteration time. Drawn with matplotlib's object
API (no pyplot, no display): the format follows the file's suffix.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from freeride.training.planner import ConfigPlan, SweepResult

_GIB = 2**30
_STYLE = {
    "gpipe": ("#4c72b0", "o"),
    "1f1b": ("#dd8452", "s"),
    "interleaved-1f1b": ("#55a868", "^"),
    "zb-h1": ("#c44e52", "D"),
    "interleaved-zb": ("#8172b2", "v"),
    "looped-bfs": ("#937860", "P"),
    "zbv": ("#da8bc3", "h"),
    "dualpipev": ("#8c8c8c", "*"),
}


def _short(plan: ConfigPlan) -> str:
    c = plan.candidate
    return f"m={c.microbatches}" + (f" v={c.virtual}" if c.virtual > 1 else "")


#: Where a point's label may go (points from the point), in order of preference.
_OFFSETS = [(5, 4), (5, -11), (-6, 6), (-6, -13), (8, 14), (8, -20), (-8, 16), (-8, -24)]


def _spread_labels(fig: Any, labels: list[Any], markers: Sequence[tuple[Any, float, float]] = ()) -> None:
    """Move each label to the first offset where it overlaps no label placed before it.

    Pareto points of one sweep crowd together (m=32 of three schedules within a few GiB), and labels
    at one fixed offset printed over each other. Placement is greedy, in drawing order, measured
    with the Agg renderer; a label also keeps off every marker and inside its panel. A label with no
    free place keeps its first one.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.transforms import Bbox

    renderer = FigureCanvasAgg(fig).get_renderer()
    placed: list[Any] = []  # every marker first: a label must not cover a point
    points = [(label.axes, *label.xy) for label in labels] + list(markers)
    for ax, x, y in points:
        px, py = ax.transData.transform((x, y))
        placed.append(Bbox.from_extents(px - 5, py - 5, px + 5, py + 5))
    for label in labels:
        for dx, dy in _OFFSETS:
            label.xyann = (dx, dy)
            label.set_horizontalalignment("left" if dx >= 0 else "right")
            box = label.get_window_extent(renderer).expanded(1.05, 1.15)
            frame = label.axes.get_window_extent(renderer)
            inside = frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1
            if inside and not any(box.overlaps(other) for other in placed):
                break
        else:
            label.xyann = _OFFSETS[0]
            label.set_horizontalalignment("left")
            box = label.get_window_extent(renderer)
        placed.append(box)


def draw_frontier(result: SweepResult, path: Path) -> None:
    """Write the frontier picture to ``path`` (PNG, SVG or PDF by its suffix)."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    known = set(result.objectives)
    panels: list[tuple[str, str]] = []
    panels.append(("peak_bytes", "peak memory per stage (GiB)") if "peak_bytes" in known
                  else ("iteration_ms", "iteration time (ms)"))
    if "harvest_rate_bytes" in known:
        panels.append(("harvest_rate_bytes", "harvest capacity (GiB-s of free memory in bubbles per s)"))

    def x_of(plan: ConfigPlan, key: str) -> float:
        if key == "peak_bytes":
            return (plan.peak_bytes or 0) / _GIB
        if key == "harvest_rate_bytes":
            return (plan.harvest_rate_bytes or 0.0) / _GIB
        return plan.iteration_ms

    fig = Figure(figsize=(6.0 * len(panels), 4.6), dpi=110)
    axes = fig.subplots(1, len(panels), sharey=True, squeeze=False)[0]
    labels: list[Any] = []
    markers: list[tuple[Any, float, float]] = []
    for ax, (key, xlabel) in zip(axes, panels, strict=True):
        for plan in result.plans:
            colour, marker = _STYLE.get(plan.candidate.schedule, ("#8172b2", "o"))
            x, y = x_of(plan, key), plan.bubble_fraction * 100
            if plan.fits_device is False:
                ax.scatter([x], [y], marker="x", color="#999999", s=30, zorder=2)
            elif plan.pareto:
                ax.scatter([x], [y], marker=marker, color=colour, edgecolors="black", linewidths=0.8, s=52, zorder=3)
                labels.append(ax.annotate(_short(plan), (x, y), textcoords="offset points", xytext=_OFFSETS[0],
                                          fontsize=7))
            else:
                # GPipe's circle is drawn larger: it often has 1F1B's very point, and would hide under it.
                size = 90 if plan.candidate.schedule == "gpipe" else 40
                ax.scatter([x], [y], marker=marker, facecolors="none", edgecolors=colour, s=size, zorder=2)
            markers.append((ax, x, y))
        ax.set_xlabel(xlabel, fontsize=9)
        ax.grid(color="#e4e4e4", linewidth=0.5)
        ax.set_axisbelow(True)
    axes[0].set_ylabel("bubble fraction (%)", fontsize=9)
    schedules = sorted({p.candidate.schedule for p in result.plans}, key=lambda s: list(_STYLE).index(s)
                       if s in _STYLE else len(_STYLE))
    handles = [Line2D([], [], linestyle="none", marker=_STYLE.get(s, ("#8172b2", "o"))[1],
                      color=_STYLE.get(s, ("#8172b2", "o"))[0], label=s) for s in schedules]
    handles.append(Line2D([], [], linestyle="none", marker="o", markerfacecolor="#bbbbbb", markeredgecolor="black",
                          color="#bbbbbb", label="Pareto-optimal (filled)"))
    if any(p.fits_device is False for p in result.plans):
        handles.append(Line2D([], [], linestyle="none", marker="x", color="#999999", label="exceeds device memory"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), frameon=False, fontsize=8)
    stages = result.plans[0].schedule.ranks if result.plans else 0
    names = {"bubble_fraction": "bubble fraction", "peak_bytes": "peak memory",
             "harvest_rate_bytes": "harvest capacity"}
    front_on = ", ".join(names.get(o, o) for o in result.objectives)
    fig.suptitle(f"{stages}-stage pipeline: configurations swept; filled: Pareto-optimal on {front_on}", fontsize=10)
    fig.tight_layout(rect=(0, 0.07, 1, 0.95))
    _spread_labels(fig, labels, markers)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
