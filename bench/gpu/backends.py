"""CuPy against torch for each bundled task that has both backends, on one GPU, standalone.

Each task runs alone on ``cuda:0`` for ``--seconds`` with ``backend=torch`` and with ``backend=array``
(CuPy and ``cupyx.scipy``), through :func:`freeride.standalone.run_standalone` (steps timed after the
device finished them), and the table gives step time p50/p99, throughput and peak memory of each, and
the throughput ratio. All runs share this process: before each, the allocators' caches are emptied and
their peak figures reset (:func:`fresh_cuda_memory`), so that a run's peak is its own.

    python -m bench.gpu.backends [--seconds 15]
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from bench.gpu.common import GiB, MiB, fresh_cuda_memory, write_results
from freeride.standalone import run_standalone

TASKS: list[tuple[str, str, dict[str, Any]]] = [
    ("pagerank", "side_tasks.graphs:PageRank", {"graph": "rmat:22", "max_iterations": 1000, "tol": 0.0}),
    ("bfs", "side_tasks.graphs:BFS", {"graph": "rmat:22"}),
    ("components", "side_tasks.graphs:ConnectedComponents", {"graph": "rmat:22"}),
    ("watermark", "side_tasks.images:ImageWatermark", {"repeat": 10000, "max_side": 2048}),
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=15.0)
    ns = ap.parse_args(argv)
    rows = []
    for name, target, args in TASKS:
        row: dict[str, Any] = {"task": name}
        for backend in ("torch", "array"):
            fresh_cuda_memory()
            report = run_standalone(target, {**args, "backend": backend}, "cuda:0", ns.seconds, 16 * GiB)
            row[backend] = {"step_ms_p50": report.step_ms_p50, "step_ms_p99": report.step_ms_p99,
                            "progress_per_s": report.progress_per_s, "unit": report.progress_unit,
                            "steps": report.steps, "finished": report.finished,
                            "peak_memory_bytes": report.peak_memory_bytes}
            print(name, backend, row[backend], flush=True)
        row["array_over_torch_throughput"] = (row["array"]["progress_per_s"] / row["torch"]["progress_per_s"]
                                              if row["torch"]["progress_per_s"] else None)
        rows.append(row)
    lines = ["| task | torch step p50 / p99 ms | CuPy step p50 / p99 ms | throughput CuPy / torch | "
             "peak torch / CuPy MiB |", "|---|---|---|---|---|"]
    for r in rows:
        t, a = r["torch"], r["array"]
        ratio = r["array_over_torch_throughput"]
        lines.append(f"| {r['task']} | {t['step_ms_p50']:.3f} / {t['step_ms_p99']:.3f} | "
                     f"{a['step_ms_p50']:.3f} / {a['step_ms_p99']:.3f} | "
                     f"{'-' if ratio is None else f'{ratio:.2f}x'} | "
                     f"{t['peak_memory_bytes'] / MiB:.0f} / {a['peak_memory_bytes'] / MiB:.0f} |")
    command = "python -m bench.gpu.backends " + " ".join(sys.argv[1:])
    write_results("backends", {"rows": rows}, "\n".join(lines), command)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
