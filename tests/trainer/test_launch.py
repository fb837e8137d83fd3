"""``freeride launch`` end to end: real manager daemons, a real command, exit codes and signals."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import cpu_devices, wait_for

from freeride._manager.daemon import Manager
from freeride._wire.client import health_status
from freeride.endpoints import default_endpoint, runtime_dir
from freeride.training.learned_slots import LEARNED_SLOT_BASE
from freeride.training.rank_slots import RankPlan
from freeride.training.schedules import build_schedule

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture
def runtime() -> Iterator[Path]:
    # A private runtime directory: default endpoints of this test never meet anyone else's managers.
    path = Path(tempfile.mkdtemp(prefix="frl-", dir="/tmp"))
    path.chmod(0o700)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _env(runtime: Path) -> dict[str, str]:
    env = dict(os.environ, XDG_RUNTIME_DIR=str(runtime), OMP_NUM_THREADS="1", FREERIDE_LOG_LEVEL="WARNING")
    env.pop("FREERIDE_ENDPOINT", None)
    return env


def _launch(runtime: Path, *args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "freeride.cli", "launch", "--state-dir", str(runtime / "state"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env(runtime))


def _no_managers_left(runtime: Path) -> None:
    assert not list((runtime / "freeride").glob("*.sock")), "a manager socket outlived launch"
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(runtime / "state") not in out, "a manager process outlived launch"


def test_launch_runs_command_with_managers_up_and_passes_its_exit_code(runtime: Path) -> None:
    devices = cpu_devices(2)
    probe = (
        "import sys; from freeride._wire.client import health_status; "
        "from freeride.endpoints import default_endpoint; "
        f"sys.exit(7 if all(health_status(default_endpoint(d)) == 'SERVING' for d in {devices!r}) else 1)"
    )
    proc = _launch(runtime, "--devices", ",".join(devices), "--", sys.executable, "-c", probe)
    assert proc.returncode == 7, proc.stderr[-2000:]
    _no_managers_left(runtime)


def test_launch_forwards_sigterm_to_the_command(runtime: Path) -> None:
    flag = runtime / "started"
    script = (
        "import signal, sys, time, pathlib\n"
        "signal.signal(signal.SIGTERM, lambda *a: sys.exit(42))\n"
        f"pathlib.Path({str(flag)!r}).write_text('x')\n"
        "time.sleep(60)\n"
    )
    cmd = [sys.executable, "-m", "freeride.cli", "launch", "--devices", cpu_devices(1)[0], "--state-dir",
           str(runtime / "state"), "--", sys.executable, "-c", script]
    proc = subprocess.Popen(cmd, env=_env(runtime), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: flag.exists() or proc.poll() is not None, 60)
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 42
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    _no_managers_left(runtime)


def test_launch_fails_clearly_when_a_manager_cannot_start(runtime: Path) -> None:
    marker = runtime / "ran"
    device = cpu_devices(1)[0]
    proc = _launch(
        runtime, "--devices", device, "--manager-arg=--headroom=lots", "--ready-timeout-s", "20", "--",
        sys.executable, "-c", f"open({str(marker)!r}, 'w')",
    )
    assert proc.returncode == 2  # the manager's bad input is the launch's
    assert f"manager for {device} exited" in proc.stderr
    assert not marker.exists()  # the command never ran
    _no_managers_left(runtime)


def test_launch_with_every_manager_already_serving_uses_them_and_leaves_no_log_directory(runtime: Path) -> None:
    device = cpu_devices(1)[0]
    env = _env(runtime)
    manager = Manager(device, endpoint=default_endpoint(device, environ=env), state_dir=runtime / "theirs")
    manager.start()
    try:
        proc = subprocess.run([sys.executable, "-m", "freeride.cli", "launch", "--devices", device, "--",
                               sys.executable, "-c", "pass"], capture_output=True, text=True, timeout=90, env=env)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "already serves" in proc.stderr
        assert not list(runtime_dir(environ=env).glob("launch-*")), "an empty log directory was left behind"
        assert health_status(manager.endpoint) == "SERVING"  # left running: it is not launch's
    finally:
        manager.stop()


def test_launch_given_manager_options_refuses_a_manager_already_serving_that_was_started_without_them(
    runtime: Path,
) -> None:
    # A stranger's stray manager was used as is: the node never joined the queue, and nothing said so.
    device = cpu_devices(1)[0]
    marker = runtime / "ran"
    manager = Manager(device, endpoint=default_endpoint(device, environ=_env(runtime)), state_dir=runtime / "theirs")
    manager.start()
    try:
        proc = _launch(runtime, "--devices", device, "--manager-arg=--grace-ms=1", "--",
                       sys.executable, "-c", f"open({str(marker)!r}, 'w')")
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert f"a manager this launch did not start already serves {device}" in proc.stderr
        assert "and it cannot take this launch's --state-dir, --manager-arg: stop it first" in proc.stderr
        assert not marker.exists()
        assert health_status(manager.endpoint) == "SERVING"  # not launch's to stop
    finally:
        manager.stop()


def test_launch_rejects_missing_command(runtime: Path) -> None:
    proc = _launch(runtime, "--devices", cpu_devices(1)[0])
    assert proc.returncode == 2 and "no command" in proc.stderr


def test_trainer_under_launch_reports_the_modelled_bubbles_to_each_manager(runtime: Path) -> None:
    """The whole trainer path: torchrun ranks -> reporters -> one manager per core -> Bubbles RPC."""
    iterations, microbatches = 5, 4
    devices = cpu_devices(2)  # the trainer pins local rank k to the k-th core it was given
    model = build_schedule("1f1b", 2, microbatches)
    long = {device: [s.index for s in model.cyclic_slots(rank)] for rank, device in enumerate(devices)}
    out = runtime / "bubbles.json"
    driver = runtime / "driver.py"
    driver.write_text(textwrap.dedent(f"""
        import json, subprocess, sys, time
        from dataclasses import asdict
        from freeride._wire.client import ControlClient
        from freeride.endpoints import default_endpoint
        rc = subprocess.call([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "-m", "freeride.workload",
            "--schedule", "1f1b", "--microbatches", "{microbatches}", "--iterations", "{iterations}",
            "--layers", "2", "--d-model", "32", "--seq-len", "16", "--vocab", "64", "--report"])
        # Each manager folds the last events into its statistics shortly after the trainer exits: wait
        # until every long slot has seen every iteration (or 30 s), never a fixed sleep.
        doc = {{}}
        deadline = time.monotonic() + 30
        for device in {devices!r}:
            with ControlClient(default_endpoint(device)) as c:
                while True:
                    doc[device] = [asdict(s) for s in c.bubbles()]
                    counts = {{s["slot"]: s["count"] for s in doc[device] if not s["learned"]}}
                    if all(counts.get(k, 0) >= {iterations} for k in {long!r}[device]) \
                            or time.monotonic() > deadline:
                        break
                    time.sleep(0.02)
        json.dump(doc, open({str(out)!r}, "w"))
        sys.exit(rc)
    """))
    proc = _launch(runtime, "--devices", ",".join(devices), "--", sys.executable, str(driver))
    assert proc.returncode == 0, proc.stderr[-3000:]
    _no_managers_left(runtime)
    # Stranger trial: what the managers harvested went with them. Launch prints it before it stops them.
    for device in devices:
        [line] = [x for x in proc.stderr.splitlines() if x.startswith(f"freeride launch: {device}: ")]
        assert int(line.split(": ")[2].split()[0]) >= iterations and "s harvested" in line, line
    doc = json.loads(out.read_text())
    for rank, device in enumerate(devices):
        got = {(s["stage"], s["slot"], s["kind"]): s["count"] for s in doc[device] if not s["learned"]}
        plan = RankPlan.from_orders(model.orders, rank)
        # Every wait the order implies where it was long enough to report, the long ones every iteration.
        assert set(got) <= {(rank, k, plan.kind(k)) for k in plan.positions}, device
        assert all(got.get((rank, s.index, s.kind)) == iterations for s in model.cyclic_slots(rank)), device
        # Waits the model does not list may recur and be learned: reported apart, with ids of their own.
        assert all(s["kind"] == "learned" and s["slot"] >= LEARNED_SLOT_BASE for s in doc[device] if s["learned"])


def test_launch_on_a_slurm_node_finds_its_devices_joins_the_queue_and_keeps_a_state_dir_per_node(
    runtime: Path, redis_server: object
) -> None:
    """No Slurm here: its environment stands in (a 2-node job, this node's name, one local rank)."""
    core = sorted(os.sched_getaffinity(0))[0]
    device = f"cpu:{core}"
    probe = (
        "import sys; from freeride._wire.client import health_status; "
        "from freeride.endpoints import default_endpoint; "
        f"sys.exit(7 if health_status(default_endpoint({device!r})) == 'SERVING' else 1)"
    )
    env = dict(_env(runtime), SLURM_JOB_NUM_NODES="2", SLURMD_NODENAME="node7", LOCAL_WORLD_SIZE="1")
    cmd = [sys.executable, "-m", "freeride.cli", "launch", "--state-dir", str(runtime / "state"),
           "--queue", redis_server.url, "--checkpoint-dir", str(runtime / "ckpt"),  # type: ignore[attr-defined]
           "--", sys.executable, "-c", probe]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=90, env=env)
    assert proc.returncode == 7, proc.stderr[-2000:]
    assert f"managers serving {device}" in proc.stderr
    state = runtime / "state" / "node7" / f"cpu-{core}"
    assert (state / "tasks.db").exists()  # this node's own state, apart from the other nodes'
    log = (runtime / "state" / "node7" / f"manager-cpu-{core}.log").read_text()
    assert "queue unix://" in log and f"as node7/{device}" in log
    _no_managers_left(runtime)
