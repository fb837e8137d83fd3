"""A worker's output, bounded: read from its pipe by the manager loop, written to a rotated log.

A worker's stdout and stderr go to a pipe whose read end the loop watches beside the worker's
channel (the way supervisord keeps its children's logs). Each chunk read is appended to
``worker.log``; when the next chunk would take it past ``max_bytes``, the log is rotated:
``worker.log`` becomes ``worker.log.1`` (older backups shift up, the oldest is dropped) and a new
``worker.log`` begins. So a task's logs never take more than ``(backups + 1) * max_bytes`` plus one
chunk, however much it prints (before: a task that printed 50 MB left a 50 MB log).

Why a pipe the manager drains, and not the file handed to the worker as before: a file written by the
worker can only be bounded by truncating it behind the writer's back, losing what the writer wrote
meanwhile; a pipe has one writer side and one reader, so the manager is the only writer of the log
and rotates it by renaming. Nothing is lost when a worker dies: what it wrote before a crash (a fatal
error message, the last lines of a traceback) waits in the pipe, and the loop drains the pipe before
it reads the tail that a failure record quotes. :meth:`WorkerLog.tail` reads across the rotation, so
a rotation just before a failure does not shorten that tail.

The log is best effort: a disk that refuses a write (full, read-only) costs the lines, never the
worker or the loop (the worker is not slowed either: the loop keeps draining the pipe).
"""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

#: The most read from a worker's pipe at once (a pipe holds 64 KiB by default on Linux).
CHUNK_BYTES = 64 * 1024
#: The smallest ``max_bytes`` allowed: a log must hold at least a few chunks.
MIN_MAX_BYTES = 4 * CHUNK_BYTES


def check_limits(max_bytes: int, backups: int) -> None:
    if max_bytes < MIN_MAX_BYTES:
        raise ValueError(f"a worker log's size limit must be at least {MIN_MAX_BYTES} bytes, got {max_bytes}")
    if not 0 <= backups <= 100:
        raise ValueError(f"worker log backups must be from 0 to 100, got {backups}")


class WorkerLog:
    """``path`` and its backups ``path.1`` ... ``path.<backups>``, written by one manager only."""

    def __init__(self, path: Path, max_bytes: int, backups: int) -> None:
        check_limits(max_bytes, backups)
        self.path = path
        self.max_bytes = max_bytes
        self.backups = backups
        self.dropped_bytes = 0  # written by the worker, refused by the disk
        self._fd = -1
        self._size = 0
        self._open()

    def _open(self) -> None:
        try:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
            self._size = os.fstat(self._fd).st_size
        except OSError as exc:
            self._fd = -1
            self._complain(exc)

    def write(self, data: bytes) -> None:
        if not data:
            return
        if self._size and self._size + len(data) > self.max_bytes:
            self._rotate()
        if self._fd < 0:
            self._open()
            if self._fd < 0:
                self.dropped_bytes += len(data)
                return
        try:
            written = os.write(self._fd, data)
        except OSError as exc:
            self.dropped_bytes += len(data)
            self._complain(exc)
            return
        self._size += written
        self.dropped_bytes += len(data) - written

    def _rotate(self) -> None:
        self.close()
        try:
            if self.backups == 0:
                os.truncate(self.path, 0)
            else:
                for index in range(self.backups, 1, -1):
                    older = self._backup(index - 1)
                    if older.exists():
                        os.replace(older, self._backup(index))
                os.replace(self.path, self._backup(1))
        except OSError as exc:
            self._complain(exc)
        self._open()

    def reopen(self) -> None:
        """Write to ``path`` as it is now: after the state directory was removed and made again, the open file
        was the removed one, and a live worker's output went nowhere anyone could read until it started again."""
        self.close()
        self._open()

    def _backup(self, index: int) -> Path:
        return self.path.with_name(f"{self.path.name}.{index}")

    def tail(self, size: int) -> str:
        """The last ``size`` bytes written, across a rotation, as text."""
        chunks: list[bytes] = []
        wanted = size
        for path in [self.path] + [self._backup(i) for i in range(1, self.backups + 1)]:
            if wanted <= 0:
                break
            data = read_tail_bytes(path, wanted)
            chunks.append(data)
            wanted -= len(data)
        return b"".join(reversed(chunks)).decode(errors="replace")

    def close(self) -> None:
        if self._fd >= 0:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = -1

    def _complain(self, exc: OSError) -> None:
        if exc.errno in (errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.EIO):
            log.debug("worker log %s: %s", self.path, exc)
        else:
            log.warning("worker log %s: %s", self.path, exc)


def read_tail_bytes(path: Path, size: int) -> bytes:
    """The last ``size`` bytes of ``path`` (fewer if it is shorter; nothing if it cannot be read)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            end = fh.tell()
            fh.seek(max(0, end - size))
            return fh.read(size)
    except OSError:
        return b""
