"""CuPy against torch for each bundled task that has both backends, on one GPU, standalone.

Each task runs alone on ``cuda:0`` for ``--seconds`` with ``backend=torch`` and with ``backend=array``
(CuPy and ``cupyx.scipy``), through :func:`freeride.standalone.run_standalone` (steps timed after the
device finished them), and the table gives step time p50/p99, throughput and peak memory of each, and
the throughput ratio. All runs share this process: before each, the allocators' caches are emptied and
their peak figures reset (:func:`fresh_cuda_memory`), so that a run's peak is its own.

Each run's setup comes on top of its ``--seconds``, and a graph task generates its graph on the host in
every setup, once per backend: that, at ``rmat:22`` (64 M edges, generated and sorted by NumPy on one
core), is what took the first GPU run past its 90 s limit before a row. The graphs are ``rmat:18`` here.
Every run is printed as it ends and the results are written after every task, so a run cut off at its
limit keeps the rows it finished; a run that raises is a row that says so, not the end of the others.

    python -m bench.gpu.backends [--seconds 15]
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from bench.gpu.common import RMAT18_BFS_SOURCE, GiB, MiB, fresh_cuda_memory, not_measured, pagerank_args, write_results
from freeride.standalone import run_standalone

BACKENDS = ("torch", "array")
TASKS: list[tuple[str, str, dict[str, Any]]] = [
    ("pagerank", "side_tasks.graphs:PageRank", pagerank_args("rmat:18")),
    ("bfs", "side_tasks.graphs:BFS", {"graph": "rmat:18", "source": RMAT18_BFS_SOURCE}),
    ("components", "side_tasks.graphs:ConnectedComponents", {"graph": "rmat:18"}),
    ("watermark", "side_tasks.images:ImageWatermark", {"repeat": 10000, "max_side": 2048}),
]


def run(target: str, args: dict[str, Any], backend: str, seconds: float) -> dict[str, Any]:
    """One task on one backend: its figures, or the error it raised."""
    fresh_cuda_memory()
    try:
        report = run_standalone(target, {**args, "backend": backend}, "cuda:0", seconds, 16 * GiB)
    except Exception as exc:  # a row of its own, not the end of the other runs
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"step_ms_p50": report.step_ms_p50, "step_ms_p99": report.step_ms_p99,
            "progress_per_s": report.progress_per_s, "unit": report.progress_unit, "steps": report.steps,
            "finished": report.finished, "setup_s": report.setup_s, "peak_memory_bytes": report.peak_memory_bytes}


def ratio(row: dict[str, Any]) -> float | None:
    """CuPy's throughput over torch's; None where either run is missing or failed, or torch's is 0."""
    t, a = row.get("torch") or {}, row.get("array") or {}
    if not t.get("progress_per_s") or "progress_per_s" not in a:
        return None
    return float(a["progress_per_s"] / t["progress_per_s"])


def cells(result: dict[str, Any] | None) -> tuple[str, str, str]:
    """One backend's run in the table: step p50 / p99 ms, peak MiB, steps."""
    if result is None:
        return "not run", "-", "-"
    if "error" in result:
        return f"failed: {result['error'][:80]}", "-", "-"
    return (f"{result['step_ms_p50']:.3f} / {result['step_ms_p99']:.3f}",
            f"{result['peak_memory_bytes'] / MiB:.0f}", f"{result['steps']}{' (done)' if result['finished'] else ''}")


def table(rows: list[dict[str, Any]], left: list[str] | None = None) -> str:
    lines = ["| task | torch step p50 / p99 ms | CuPy step p50 / p99 ms | throughput CuPy / torch | "
             "peak torch / CuPy MiB | steps torch / CuPy |", "|---|---|---|---|---|---|"]
    for r in rows:
        (t_step, t_peak, t_steps), (a_step, a_peak, a_steps) = cells(r.get("torch")), cells(r.get("array"))
        x = ratio(r)
        lines.append(f"| {r['task']} | {t_step} | {a_step} | {'-' if x is None else f'{x:.2f}x'} | "
                     f"{t_peak} / {a_peak} | {t_steps} / {a_steps} |")
    return "\n".join(lines + not_measured(left))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=15.0)
    ns = ap.parse_args(argv)
    command = "python -m bench.gpu.backends " + " ".join(sys.argv[1:])
    rows: list[dict[str, Any]] = []
    for i, (name, target, args) in enumerate(TASKS):
        row: dict[str, Any] = {"task": name}
        rows.append(row)
        for backend in BACKENDS:
            row[backend] = run(target, args, backend, ns.seconds)
            row["array_over_torch_throughput"] = ratio(row)
            print(name, backend, row[backend], flush=True)
            left = [n for n, _, _ in TASKS[i + 1:]]
            write_results("backends", {"rows": rows, "not_measured_yet": left}, table(rows, left), command)
    return 0 if all("error" not in r[b] for r in rows for b in BACKENDS) else 1


if __name__ == "__main__":
    raise SystemExit(main())
