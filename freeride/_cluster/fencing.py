"""Checkpoint files fenced by claim epoch, as the records are.

A cluster task's checkpoints live in the shared ``--checkpoint-dir``, under ``<root>/<task id>/``. Every
write of a holder *to the record* is fenced by its claim epoch (a script checks owner and epoch first),
but a file is written by the holder's worker, which cannot ask Redis: a holder that lost its lease (cut
off from Redis, its task reclaimed and claimed elsewhere) keeps stepping and checkpointing until its
manager learns of the loss. Were the files of all holders in one directory, such a late file could be the
newest there, and the next holder would resume from a history that the queue had already abandoned.

So each claim writes to a directory of its own, ``<root>/<task id>/e<epoch>/``, and a holder of claim
``epoch`` resumes from (:func:`resume_point`):

* the checkpoint the record names: every write of it was fenced, so it is the newest checkpoint a
  holder wrote *while it held the task*; or
* the newest file in the directory of claim ``epoch - 1``, when it is newer than the record's: the last
  holder may have died between writing a file and recording it. That holder is the one this claim
  replaces, and what it wrote up to this claim continues the only history there is.

Files of older claims are never looked at, unless the record names one: a holder of claim ``k`` that
kept writing after claim ``k + 1`` began writes into ``e<k>``, and claim ``k + 2`` and later read only
``e<k + 1>`` (and the record). :func:`prune` removes those directories at the next claim. Both run on
the queue agent's thread, never on the manager loop's (a shared file system may be slow).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
from pathlib import Path

from freeride import _checkpoints

log = logging.getLogger(__name__)


def epoch_dir(task_root: Path, epoch: int) -> Path:
    """Where the holder of claim ``epoch`` writes its checkpoints."""
    return task_root / f"e{epoch}"


def _epoch_of(path: Path) -> int | None:
    name = path.name
    return int(name[1:]) if name.startswith("e") and name[1:].isdigit() else None


def _inside(path: Path, task_root: Path) -> Path | None:
    """``path`` as an existing file under ``task_root``: as given, or re-rooted there when it was recorded
    under another mount point of the same shared directory (its last two parts: ``e<k>/ckpt-N.pt``)."""
    if not path.name:
        return None
    try:
        if path.resolve().is_relative_to(task_root.resolve()):
            return path if path.is_file() else None  # gone (pruned, or a hand edit): not a resume point
    except OSError:
        return None
    for tail in (Path(*path.parts[-2:]), Path(path.name)):
        moved = task_root / tail
        if moved.is_file():
            return moved
    return None


def resume_point(task_root: Path, epoch: int, recorded_path: str, recorded_step: int) -> tuple[str, int]:
    """The checkpoint the holder of claim ``epoch`` resumes from, ``(path, step)``; ``("", -1)``: none."""
    path, step = "", -1
    if recorded_path and recorded_step >= 0:
        found = _inside(Path(recorded_path), task_root)
        if found is not None:
            path, step = str(found), recorded_step
    previous = _checkpoints.checkpoint_files(epoch_dir(task_root, epoch - 1))[:1]
    if previous and _checkpoints.step_of(previous[0]) > step:
        path, step = str(previous[0]), _checkpoints.step_of(previous[0])
    return path, step


def prune(task_root: Path, epoch: int, keep: str) -> int:
    """Remove the checkpoint directories of claims older than ``epoch - 1`` (and files of managers that
    wrote to ``task_root`` itself), except what holds ``keep``; how many went. Never raises."""
    removed = 0
    keep_path = Path(keep) if keep else None
    try:
        entries = list(task_root.iterdir())
    except OSError:
        return 0
    for entry in entries:
        if keep_path is not None and (entry == keep_path or entry == keep_path.parent):
            continue
        k = _epoch_of(entry)
        try:
            if k is not None and k < epoch - 1 and entry.is_dir():
                shutil.rmtree(entry)
                removed += 1
            elif k is None and entry.is_file() and _checkpoints.step_of(entry) >= 0:
                with contextlib.suppress(FileNotFoundError):
                    entry.unlink()
                removed += 1
        except OSError as exc:  # a stale holder writing there meanwhile, or a read-only mount: next claim
            log.debug("cannot prune %s: %s", entry, exc)
    return removed
