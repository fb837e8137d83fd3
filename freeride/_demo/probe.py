"""Standalone throughput of the demo's side tasks on one device: ``python -m freeride._demo.probe REQ OUT``.

The yardstick of harvest efficiency is each task's throughput with the device to itself
(:func:`freeride.standalone.run_standalone`). The demo measures it in a child process per device
(so that this process's pinning and imports never touch the orchestrator) that runs the device's
tasks one after the other and writes one JSON result per task.

On ``cpu:N`` the process is pinned to core N with one thread, like a worker, but keeps its normal
priority: a worker's nice 19 only matters against the trainer, which is idle in a bubble, while on a
shared machine it would let any other program starve the measurement. One thread, as in a worker:
the thread variables of the device's worker environment are set before any task module is imported,
so torch, when a task imports it, starts with one thread (and torch is not imported for a task that
does not use it). On ``cuda:N`` nothing is prepared beyond the device itself.

``REQ`` is a JSON file ``{"device": "cpu:1", "seconds": 3, "tasks": [{"name", "target", "args",
"memory_bytes"}, ...]}``; ``OUT`` receives ``[{"name": ..., "report": {...}} | {"name": ...,
"error": "..."}, ...]``. The exit code is 0 when every task ran, 1 otherwise.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from freeride.devices import parse_device_name
from freeride.devices.cpu import CpuDevice
from freeride.errors import FreerideError


def probe(request: dict[str, Any]) -> list[dict[str, Any]]:
    """Run each requested task alone for ``seconds``; one result per task, errors as data."""
    from freeride.standalone import run_standalone

    device = str(request["device"])
    name = parse_device_name(device)
    if name.kind == "cpu":
        os.sched_setaffinity(0, {name.index})
        os.environ.update(CpuDevice(name).worker_env(0))
        torch = sys.modules.get("torch")
        if torch is not None:  # imported already (not by this module): its pool exists, so shrink it
            torch.set_num_threads(1)
    results: list[dict[str, Any]] = []
    for task in request["tasks"]:
        try:
            report = run_standalone(str(task["target"]), dict(task["args"]), device, float(request["seconds"]),
                                    int(task["memory_bytes"]))  # fmt: skip
            results.append({"name": task["name"], "report": asdict(report)})
        except FreerideError as exc:
            results.append({"name": task["name"], "error": str(exc)})
    return results


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m freeride._demo.probe REQUEST.json OUT.json", file=sys.stderr)
        return 2
    request = json.loads(Path(argv[0]).read_text())
    results = probe(request)
    Path(argv[1]).write_text(json.dumps(results, indent=2, default=str))
    return 0 if all("report" in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
