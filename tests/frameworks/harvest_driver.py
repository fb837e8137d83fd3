"""Run a training command with a side task harvesting on every device, then ask the managers what they saw.

Meant to run under ``freeride launch --devices ...`` (which starts one manager per device and sets
nothing else up). It submits ``sample_tasks:Counter`` to each device's manager and waits until each is
parked (ready for a bubble), runs the training command, then waits until every manager has received
the events the trainer's reporter says it sent (``rank*.json`` in ``--out``: ``device`` and
``reporter.sent``), and writes ``--out/managers.json``: per device, ``freeride bubbles
--json``'s output (the CLI, as a user runs it), the manager's statistics and the side task. Exits with
the training command's code.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from freeride._wire.client import ControlClient
from freeride.endpoints import default_endpoint
from freeride.messages import TaskSpec

TESTS_DIR = Path(__file__).resolve().parent.parent


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--devices", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--step-ms", type=float, default=1.0)
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    devices = args.devices.split(",")
    out = Path(args.out)
    tasks = {}
    for device in devices:
        with ControlClient(default_endpoint(device)) as client:
            spec = TaskSpec(target="sample_tasks:Counter", args={"step_ms": args.step_ms, "log_steps": False},
                            memory_bytes=256 * 2**20, working_dir=str(TESTS_DIR))
            tasks[device] = client.submit(spec).task_id
    deadline = time.monotonic() + 60
    for device in devices:
        with ControlClient(default_endpoint(device)) as client:
            while client.get(tasks[device]).state != "PARKED" and time.monotonic() < deadline:
                time.sleep(0.02)
    code = subprocess.call(command)
    sent: dict[str, int] = {}
    for path in sorted(out.glob("rank*.json")):
        doc = json.loads(path.read_text())
        sent[doc["device"]] = int(doc.get("reporter", {}).get("sent", 0))
    report: dict[str, dict[str, object]] = {}
    deadline = time.monotonic() + 30
    for device in devices:
        with ControlClient(default_endpoint(device)) as client:
            # The manager folds the last events in shortly after the trainer exits.
            while client.stats().events_received < sent.get(device, 0) and time.monotonic() < deadline:
                time.sleep(0.02)
            report[device] = {"stats": asdict(client.stats()), "task": asdict(client.get(tasks[device]))}
    cli = subprocess.run([sys.executable, "-m", "freeride.cli", "bubbles", "--devices", ",".join(devices), "--json"],
                         capture_output=True, text=True, timeout=60)
    for device in devices:
        report[device]["bubbles_cli"] = json.loads(cli.stdout)["devices"].get(device) if cli.returncode == 0 else None
    report["_cli"] = {"returncode": cli.returncode, "stderr": cli.stderr[-2000:]}
    (out / "managers.json").write_text(json.dumps(report))
    return code


if __name__ == "__main__":
    sys.exit(main())
