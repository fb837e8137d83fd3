"""``bench.gpu.mps_daemon`` on CPU: a daemon that starts but never serves its pipe is reported with what
the machine can tell of why (the H200 run's MPS steps said only "a stale pipe")."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

from bench.gpu.mps_daemon import MpsDaemon

# -d leaves a control pipe nobody reads, the pid of a process that has exited, and a log, as a daemon that
# died at start does.
DEAD_CONTROL = """#!{python}
import os, subprocess, sys
pipes = os.environ["CUDA_MPS_PIPE_DIRECTORY"]
logs = os.environ["CUDA_MPS_LOG_DIRECTORY"]
if sys.argv[1:] == ["-d"]:
    os.mkfifo(os.path.join(pipes, "control"))
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    open(os.path.join(pipes, "nvidia-cuda-mps-control.pid"), "w").write(str(p.pid))
    open(os.path.join(logs, "control.log"), "w").write("Starting control daemon\\nFailed to initialize NVML\\n")
"""


def test_a_daemon_that_never_serves_its_pipe_is_reported_with_its_exit_and_its_log(tmp_path: Path) -> None:
    binary = tmp_path / "nvidia-cuda-mps-control"
    binary.write_text(DEAD_CONTROL.format(python=sys.executable))
    binary.chmod(binary.stat().st_mode | stat.S_IEXEC)
    pipes = tmp_path / f"mps-{os.getpid()}"
    why = MpsDaemon(pipes, binary=str(binary), up_timeout_s=0.2).start()
    assert why.startswith("the daemon did not come up within 0 s (the MPS control pipe")
    assert "has exited" in why
    assert "control.log ends: Starting control daemon | Failed to initialize NVML" in why
    assert not pipes.exists() and not Path(f"{pipes}-log").exists()  # removed after reading
