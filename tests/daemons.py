"""A real ``freeride manager`` process for end-to-end tests: started, awaited, signalled."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil
from conftest import cpu_devices, wait_for

from freeride._wire.client import health_status
from freeride.endpoints import Endpoint
from freeride.errors import ManagerUnavailable

DEVICE = cpu_devices(1)[0]  # a core this process may run on: tests never name core numbers


def health(endpoint: Endpoint) -> str:
    """The manager's health status, or ``DOWN`` when nobody answers."""
    try:
        return health_status(endpoint, timeout_s=1)
    except ManagerUnavailable:
        return "DOWN"


def start_daemon(sock: Path, state: Path, *options: str, device: str = DEVICE,
                 new_session: bool = False) -> subprocess.Popen[bytes]:
    """``freeride manager`` on ``device`` (an allowed core by default), on ``sock`` with ``state``; returns
    once it is SERVING. ``new_session``: in a session of its own, as ``freeride launch`` starts it."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "freeride.cli", "manager", "--device", device, "--endpoint", f"unix:{sock}",
         "--state-dir", str(state), *options],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=new_session,
    )
    endpoint = Endpoint("unix", str(sock))

    def serving() -> bool:
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else "manager exited"
        return health(endpoint) == "SERVING"

    try:
        wait_for(serving, 30)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc


def stop_daemon(proc: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    """Stop a manager from :func:`start_daemon` as a service manager would: SIGTERM (a drain), then SIGKILL."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def socket_path(name: str) -> Path:
    """A short unix socket path (the 108-byte limit rules out pytest's temporary directories)."""
    return Path(f"/tmp/fr-{name}-{os.getpid()}.sock")


def alive(pid: int) -> bool:
    """True if ``pid`` runs (a zombie waiting for its reaper does not count)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
