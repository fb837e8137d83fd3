"""The files by which trainers and clients reach a running manager, watched: one removed says so.

A manager at a Unix endpoint is reached through three files beside each other: its gRPC socket (clients,
``freeride`` commands, trainers over the wire), its local event socket (trainers on this host) and its end
board (trainers write their bubbles' ends there, workers read them). A clean-up of old files (``/tmp`` is
swept; ``rm -rf /tmp/freeride-*``) removes them under a running manager. What is already connected goes on
(a socket's connections and a mapped board outlive their names), but whatever starts later finds nothing:
a new trainer's reporter warns that no manager answers, a client's command fails to connect, and the manager
itself said nothing. gRPC cannot bind again in place, and a board made again would not be the one running
trainers write, so the manager does not repair this: it says what was lost, once per file, as an error, and
what to do (restart it). Checked with the state directory's check (about once a second): a ``stat`` of each
path against an ``fstat`` of the file it held.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

#: What each file is for, as the error says it: (what it is, what starts to fail without it).
_ROLES = {
    "socket": ("its socket", "new trainers, clients and `freeride` commands cannot reach it"),
    "events": ("its local event socket", "trainers that start now report their bubbles over the slower wire"),
    "board": ("its end board", "trainers that start now cannot stop side tasks at their bubbles' ends at once: "
                               "the ends reach workers through the manager only, later"),
}


class AddressWatch:
    """Watches ``files`` (``socket``, ``events``, ``board``: the paths this manager made) for removal or
    replacement; :meth:`check` logs each loss once and returns the names newly lost.

    Each file is held by an ``O_PATH`` descriptor and compared with what its path names now: held, its inode
    cannot be reused, so a file made again in its place (another manager's) is told from the manager's own.
    """

    def __init__(self, device: str, files: dict[str, Path]) -> None:
        unknown = set(files) - set(_ROLES)
        if unknown:
            raise ValueError(f"unknown manager files {sorted(unknown)}")
        self.device = device
        self._files: dict[str, tuple[Path, int]] = {}
        for name, path in files.items():
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue  # one the manager could not make is said at start-up, not here
            self._files[name] = (path, fd)
        self.lost: dict[str, str] = {}  # name -> why, once found

    def check(self) -> list[str]:
        found = []
        for name, (path, fd) in self._files.items():
            if name in self.lost:
                continue
            held = os.fstat(fd)
            try:
                now = os.stat(path)
            except OSError:
                why = "removed"
            else:
                if (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino):
                    continue
                why = "replaced by another file (another manager's?)"
            self.lost[name] = why
            found.append(name)
            what, consequence = _ROLES[name]
            log.error("[%s] %s %s was %s while this manager runs: %s (what is connected already is still "
                      "served); restart the manager to serve there again", self.device, what, path, why,
                      consequence)
        return found

    def close(self) -> None:
        for _, fd in self._files.values():
            os.close(fd)
        self._files.clear()
