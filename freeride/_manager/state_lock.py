"""One manager per state directory: an exclusive lock on ``<state dir>/manager.lock``, taken before anything
in the directory is read.

A second manager given a directory in use (by mistake: the default state directory depends on the device
only, so a second ``freeride manager --device cpu:1`` with another ``--endpoint`` shares it) recovered the
first one's tasks as its own: it killed their workers as leftovers of a dead manager, and the first one's
tasks failed ``SIGNAL`` while both went on writing one store. The lock is flock(2)'s: the kernel drops it when
its holder exits however it exits, so a killed manager's successor takes it at once; the descriptor is not
inherited, so no worker outliving its manager holds it. The file says who holds it (pid, endpoint) for the
refusal. A file system that cannot lock (some network mounts) is warned about, not refused.
"""

from __future__ import annotations

import fcntl
import logging
import os
from pathlib import Path

from freeride.errors import ConfigError

log = logging.getLogger(__name__)

LOCK_NAME = "manager.lock"


class StateDirLock:
    """Held from construction until :meth:`release` (or the process's exit)."""

    def __init__(self, state_dir: Path, endpoint: str) -> None:
        self._fd: int | None = None  # (a refusal below leaves nothing for __del__ to close)
        path = state_dir / LOCK_NAME
        try:
            state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd: int | None = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:  # read-only, not a directory, not ours: the store would say the same
            raise ConfigError(f"state directory {state_dir} is not writable: {exc}") from None
        assert fd is not None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "a process that has not said which"
            os.close(fd)
            raise ConfigError(f"another manager ({holder}) uses the state directory {state_dir}: stop it first, or "
                              "give this one its own --state-dir") from None
        except OSError as exc:
            log.warning("the state directory %s cannot be locked (%s): nothing stops a second manager from "
                        "using it too", state_dir, exc)
            os.close(fd)
            fd = None
        if fd is not None:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()}, endpoint {endpoint}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        """Let another manager use the directory (the holder's tasks are stopped or handed over)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __del__(self) -> None:
        self.release()
