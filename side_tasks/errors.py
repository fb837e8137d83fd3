"""Errors of the side-task library, rooted in freeride's error tree.

Both are :class:`freeride.errors.ConfigError`: the user can fix them by changing the task's
arguments (a smaller size, a larger ``--memory``, a repaired input file), and the CLI maps them
to the "bad input" exit code.
"""

from __future__ import annotations

from pathlib import Path

from freeride.errors import ConfigError
from freeride.units import format_size


class TaskTooLarge(ConfigError):
    """The configured size of a task cannot fit its memory limit; raised by ``setup``.

    Raised before the task allocates its working set, so that a task that would run out of its
    cap halfway through fails at once with a message that says what to change.
    """

    def __init__(self, what: str, needed_bytes: int, limit_bytes: int, hint: str) -> None:
        self.needed_bytes = needed_bytes
        self.limit_bytes = limit_bytes
        super().__init__(
            f"{what} needs about {format_size(needed_bytes)}, more than its memory limit of "
            f"{format_size(limit_bytes)}; {hint}"
        )


class DataFormatError(ConfigError):
    """An input file is missing or malformed; the message names the file and, where there is
    one, the 1-based line number."""

    def __init__(self, path: str | Path, message: str, line: int | None = None) -> None:
        self.path = str(path)
        self.line = line
        where = f"{path}:{line}" if line is not None else str(path)
        super().__init__(f"{where}: {message}")


def check_fits(what: str, needed_bytes: int, limit_bytes: int, hint: str) -> None:
    """Raise :class:`TaskTooLarge` when ``needed_bytes`` exceeds ``limit_bytes``."""
    if needed_bytes > limit_bytes:
        raise TaskTooLarge(what, needed_bytes, limit_bytes, hint)
