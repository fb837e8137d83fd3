"""A freeride process that starts children while gRPC is busy runs none of gRPC's fork handlers.

gRPC's fork support registers ``pthread_atfork`` handlers that pause its threads around each fork;
they deadlocked a ``freeride bench`` inside ``fork()`` while it started a manager (its health checks in
flight). freeride's processes fork only to exec, so ``import freeride`` switches the handlers off
unless the user chose otherwise. The check runs in a fresh interpreter (the setting must precede
grpc's import) with gRPC's own logging at INFO, where every fork that reaches the handlers says so.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

_CHILD = textwrap.dedent("""
    import ctypes, shutil, subprocess, sys, tempfile, threading
    from pathlib import Path
    import os
    import freeride  # first, as every freeride command and manager does
    if "--as-before" in sys.argv:  # what a process did before freeride switched the handlers off
        os.environ.pop("GRPC_ENABLE_FORK_SUPPORT")
    from freeride._manager.daemon import Manager
    from freeride._wire.client import health_status
    from freeride.endpoints import Endpoint

    tmp = Path(tempfile.mkdtemp(prefix="frfork-"))  # short: a unix socket's path has about 100 bytes
    manager = Manager(sys.argv[1], endpoint=Endpoint("unix", str(tmp / "s.sock")), state_dir=tmp / "state")
    manager.start()
    stop = threading.Event()

    def hammer():
        while not stop.is_set():
            health_status(manager.endpoint, timeout_s=5.0)

    threads = [threading.Thread(target=hammer, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    prctl = ctypes.CDLL(None).prctl
    for _ in range(40):  # a preexec_fn forces a real fork(), as launch and the demo use
        subprocess.Popen(["/bin/true"], preexec_fn=lambda: prctl(1, 15, 0, 0, 0)).wait()
    stop.set()
    for t in threads:
        t.join()
    manager.stop()
    shutil.rmtree(tmp, ignore_errors=True)
    print("children started: 40")
""")


def _run(tmp_path: Path, cpu: str, *flags: str, timeout_s: float = 100) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "forks.py"
    script.write_text(_CHILD)
    environ = {k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"}
    environ["GRPC_VERBOSITY"] = "INFO"
    return subprocess.run([sys.executable, str(script), cpu, *flags], env=environ, capture_output=True, text=True,
                          timeout=timeout_s)


def test_forks_of_a_process_that_imported_freeride_skip_grpc_fork_handlers(tmp_path: Path) -> None:
    from conftest import cpu_devices

    proc = _run(tmp_path, cpu_devices(1)[0])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "children started: 40" in proc.stdout
    assert "fork_posix" not in proc.stderr and "fork() handlers" not in proc.stderr, proc.stderr[-2000:]


def test_without_the_setting_grpc_runs_its_fork_handlers(tmp_path: Path) -> None:
    """The witness that the check above can fail: grpcio's default runs the handlers at each fork, and now and
    then deadlocks in one (the bug the setting avoids; it hung this witness in a CI run past pytest's
    timeout). A hang is then cut short, and what the handlers logged before it is the witness."""
    from conftest import cpu_devices

    try:
        proc = _run(tmp_path, cpu_devices(1)[0], "--as-before", timeout_s=60)
    except subprocess.TimeoutExpired as hung:
        partial = hung.stderr or b""
        stderr = partial.decode(errors="replace") if isinstance(partial, bytes) else partial
    else:
        assert proc.returncode == 0, proc.stderr[-2000:]
        stderr = proc.stderr
    assert "fork_posix" in stderr or "fork() handlers" in stderr, stderr[-2000:]
