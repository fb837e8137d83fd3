"""An MPS control daemon of a measurement's own: a private pipe and log directory, quit afterwards.

Started with ``nvidia-cuda-mps-control -d`` (which forks into the background in a session of its own,
so it outlives the command that started it unless it is told to quit: :meth:`MpsDaemon.stop` always
does), and live once it serves its control pipe (:func:`freeride.devices.mps.probe_mps`). Processes
given :meth:`MpsDaemon.env` are its clients; others are not. The GPU's compute mode is left as it is.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import psutil

from freeride.devices.mps import PID_FILE, probe_mps

CONTROL = "nvidia-cuda-mps-control"


class MpsDaemon:
    def __init__(self, pipes: Path, binary: str = CONTROL, up_timeout_s: float = 15.0) -> None:
        self.pipes = Path(pipes)
        self.logs = Path(f"{pipes}-log")
        self.binary = binary
        self.up_timeout_s = up_timeout_s
        self.started = False

    def env(self) -> dict[str, str]:
        """What makes a process a client of this daemon."""
        return {"CUDA_MPS_PIPE_DIRECTORY": str(self.pipes), "CUDA_MPS_LOG_DIRECTORY": str(self.logs)}

    def start(self) -> str:
        """Start it; empty when it is live, else why there is no MPS here."""
        path = shutil.which(self.binary)
        if path is None:
            return f"{self.binary} is not installed"
        self.pipes.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.env()}
        said = self.logs / "start.out"
        try:
            # Its output to a file, not a pipe: a daemon that kept the pipe open would hold this call.
            with open(said, "w") as out:
                done = subprocess.run([path, "-d"], env=env, stdout=out, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, timeout=30, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"{self.binary} -d failed: {exc}"
        if done.returncode != 0:
            return f"{self.binary} -d exited {done.returncode}: {said.read_text().strip()[:300]}"
        self.started = True
        deadline = time.monotonic() + self.up_timeout_s
        while not (status := probe_mps(env)).live:
            if time.monotonic() > deadline:
                why = self.diagnosis()
                self.stop()
                return f"the daemon did not come up within {self.up_timeout_s:.0f} s ({status.detail}){why}"
            time.sleep(0.05)
        return ""

    def diagnosis(self) -> str:
        """Why a daemon that started is not live, as far as this machine tells (appended to the reason; the
        directories are removed afterwards): whether its process still runs, and the end of its log."""
        parts = []
        try:
            pid = int((self.pipes / PID_FILE).read_text().split()[0])
            parts.append(f"pid {pid} {'still runs' if psutil.pid_exists(pid) else 'has exited'}")
        except (OSError, ValueError, IndexError):
            parts.append(f"no readable {PID_FILE}")
        try:
            lines = (self.logs / "control.log").read_text(errors="replace").strip().splitlines()
            parts.append("control.log ends: " + " | ".join(lines[-4:]) if lines else "control.log is empty")
        except OSError:
            parts.append("no control.log")
        return "; " + "; ".join(parts)

    def stop(self) -> None:
        """Tell it to quit (its server goes with it once its clients are gone); remove its directories."""
        if self.started:
            try:
                subprocess.run([shutil.which(self.binary) or self.binary], input="quit\n", text=True,
                               env={**os.environ, **self.env()}, capture_output=True, timeout=30, check=False)
            except (OSError, subprocess.TimeoutExpired):
                pass
            self.started = False
            deadline = time.monotonic() + 10
            while probe_mps({**os.environ, **self.env()}).live and time.monotonic() < deadline:
                time.sleep(0.05)
        shutil.rmtree(self.pipes, ignore_errors=True)
        shutil.rmtree(self.logs, ignore_errors=True)
