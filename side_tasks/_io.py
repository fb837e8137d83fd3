"""Small file helpers shared by the tasks: atomic writes and locating bundled data."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

#: Where the bundled sample data lives (see ``side_tasks/data/README.md``).
DATA_DIR = Path(__file__).resolve().parent / "data"


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see either the old file or the whole new one.

    The temporary file is created in the destination directory (``os.replace`` is atomic only
    within one file system), flushed and fsynced before the rename, and the directory is fsynced
    after it so that the rename itself survives a crash. A task killed halfway leaves at most a
    stray ``.tmp`` file, never a truncated result under the final name.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
