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

from freeride.devices import DeviceName
from freeride.errors import ConfigError

log = logging.getLogger(__name__)

LOCK_NAME = "manager.lock"


class StateDirInUse(ConfigError):
    """Another manager holds the state directory's lock."""


class StateDirLock:
    """Held from construction until :meth:`release` (or the process's exit).

    The lock is on a file, and a file can be removed under its holder: a clean-up of old files, an ``rm -rf`` of
    the directory while the manager runs. The kernel's lock then guards a file no path names, and a second
    manager given the directory takes a new lock at once. :meth:`lost` says so (the loop asks every second) and
    :meth:`retake` locks the path again.
    """

    def __init__(self, state_dir: Path, endpoint: str) -> None:
        self._fd: int | None = None  # (a refusal below leaves nothing for __del__ to close)
        self.state_dir = state_dir
        self.path = state_dir / LOCK_NAME
        self._endpoint = endpoint
        self._fd, self._identity = self._take()

    def _take(self) -> tuple[int | None, tuple[int, int] | None]:
        """Lock ``path`` (made with its directory if missing): the descriptor (None where the file system cannot
        lock) and the file's identity; :class:`ConfigError` if it cannot be made or another process holds it."""
        state_dir, path = self.state_dir, self.path
        try:
            state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd: int | None = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:  # read-only, not a directory, not ours: the store would say the same
            raise ConfigError(f"state directory {state_dir} is not writable: {exc}") from None
        assert fd is not None
        held = os.fstat(fd)
        identity = (held.st_dev, held.st_ino)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "a process that has not said which"
            os.close(fd)
            raise StateDirInUse(f"another manager ({holder}) uses the state directory {state_dir}: stop it first, or "
                                "give this one its own --state-dir") from None
        except OSError as exc:
            log.warning("the state directory %s cannot be locked (%s): nothing stops a second manager from "
                        "using it too", state_dir, exc)
            os.close(fd)
            fd = None
        if fd is not None:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()}, endpoint {self._endpoint}\n".encode(), 0)
        return fd, identity

    def lost(self) -> str:
        """Why the lock no longer guards the directory, in a few words; "" while it does (and once released)."""
        if self._identity is None:
            return ""
        try:
            now = os.stat(self.path)
        except (FileNotFoundError, NotADirectoryError):
            if not self.state_dir.is_dir():
                return f"the state directory {self.state_dir} was removed"
            return f"its lock file {self.path} was removed"
        except OSError as exc:
            return f"its lock file {self.path} cannot be read ({exc})"
        if (now.st_dev, now.st_ino) != self._identity:
            return f"its lock file {self.path} was replaced by another"
        return ""

    def retake(self) -> None:
        """Lock the path again (the directory made again if it is gone), after :meth:`lost`; :class:`ConfigError`
        if another manager took it meanwhile, or it cannot be made. The old lock is let go only once the new one
        is held. :class:`StateDirInUse`: another manager holds it."""
        fd, identity = self._take()
        old, self._fd, self._identity = self._fd, fd, identity
        if old is not None:
            os.close(old)

    def release(self) -> None:
        """Let another manager use the directory (the holder's tasks are stopped or handed over)."""
        fd, self._fd, self._identity = self._fd, None, None
        if fd is not None:
            os.close(fd)

    def __del__(self) -> None:
        self.release()


def default_state_dir_of(name: DeviceName) -> Path:
    """Where a manager of device ``name`` keeps its state unless told (``--state-dir``)."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "freeride" / name.slug


def lock_holder(state_dir: Path, locks: Path = Path("/proc/locks")) -> str:
    """Who holds ``state_dir``'s lock now, as the lock file says it ("pid 123, endpoint unix:/..."), or "" where no
    process does. Read from the kernel's table of locks (``/proc/locks``, matched by the file's inode), without
    taking the lock even for a moment: a manager starting then would be refused."""
    path = state_dir / LOCK_NAME
    try:
        inode = os.stat(path).st_ino
        table = locks.read_text()
    except OSError:
        return ""
    for line in table.splitlines():
        fields = line.split()
        # "1: FLOCK  ADVISORY  WRITE 4242 08:01:1234567 0 EOF" (a blocked waiter's line begins "1: -> FLOCK")
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5].rsplit(":", 1)[-1] == str(inode):
            try:
                said = path.read_text(errors="replace").strip()
            except OSError:
                said = ""
            return said or f"pid {fields[4]}"
    return ""

