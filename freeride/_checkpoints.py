"""A task's checkpoint files: written whole by its worker, found by the worker and the manager.

A checkpoint is ``<checkpoint dir>/ckpt-<step>.pt``, written to a temporary file, fsynced and
renamed (and the directory fsynced), so a reader only ever sees whole files; the newest
:data:`CHECKPOINTS_KEPT` are kept, and the temporary files of writers killed mid-write (as large as
the state: a 160 MB one outlived a manager's kill -9) go at the next write. The worker writes and
restores them; the manager, at a restart or a claim from the cluster queue, looks for a file newer
than the one it recorded (it may have died between the worker writing a file and recording it).

The contents are ``{"format": 1, "task_id", "steps", "state"}``: written with ``torch.save`` when
the task imported torch (its state may hold tensors), else with pickle, so a torch-free task never
pays for importing torch. Standard library only (torch is used when already imported).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
import zipfile
from pathlib import Path
from typing import Any

from freeride.task import check_saveable

CHECKPOINTS_KEPT = 2
FORMAT = 1


def step_of(path: Path) -> int:
    """The step a checkpoint file name says (``ckpt-12.pt``: 12); -1 when it says none."""
    try:
        return int(path.stem.split("-", 1)[1])
    except (IndexError, ValueError):
        return -1


def checkpoint_files(directory: Path) -> list[Path]:
    """Checkpoint files in ``directory``, newest (highest step) first."""
    files = [p for p in directory.glob("ckpt-*.pt") if step_of(p) >= 0]
    return sorted(files, key=step_of, reverse=True)


def newest(directory: Path, recorded_path: str, recorded_step: int) -> tuple[str, int]:
    """The checkpoint to resume from: the newest file in ``directory`` when it is newer than the
    recorded one (files are written whole), else the recorded ``(path, step)``."""
    files = checkpoint_files(directory)[:1]
    if files and step_of(files[0]) > recorded_step:
        return str(files[0]), step_of(files[0])
    return recorded_path, recorded_step


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _dump(blob: dict[str, Any], fh: Any) -> None:
    """torch.save when the task uses torch (its state may hold tensors), else plain pickle.

    A task that never imported torch cannot hold tensors, and importing torch only to write a
    checkpoint would cost it a second or more of CPU inside its bubbles.
    """
    if "torch" in sys.modules:
        sys.modules["torch"].save(blob, fh)
    else:
        pickle.dump(blob, fh, protocol=pickle.HIGHEST_PROTOCOL)


class DiskRefused(Exception):
    """The disk refused the write (full, read-only, failing); the previous checkpoint stands."""


def write(directory: Path, task_id: str, steps: int, state: Any) -> Path:
    """Write the checkpoint of ``steps`` whole, then drop all but the newest :data:`CHECKPOINTS_KEPT`.

    Raises :class:`DiskRefused` when the disk refuses it, and whatever serialising ``state`` raises
    (a lambda, a lock, an open file: the task's bug) otherwise; either way no partial file is left.
    """
    path = directory / f"ckpt-{steps}.pt"
    tmp = path.with_suffix(".tmp")
    try:
        # Owner-only, as the state directory: a cluster task's checkpoints sit in a shared directory.
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as fh:
            _dump({"format": FORMAT, "task_id": task_id, "steps": steps, "state": state}, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        _fsync_dir(directory)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise DiskRefused(str(exc)) from exc
    except Exception:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        check_saveable(state)  # names the entry; else the serialiser's own error stands
        raise
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise
    stale = [p for p in directory.glob("ckpt-*.tmp") if 0 <= step_of(p) <= steps]  # a killed writer's halves
    for old in checkpoint_files(directory)[CHECKPOINTS_KEPT:] + stale:
        with contextlib.suppress(OSError):
            old.unlink(missing_ok=True)
    return path


def load(path: Path) -> dict[str, Any]:
    """A checkpoint's contents, every tensor on the CPU.

    Always the CPU: the task's ``load_state_dict`` puts each tensor where it belongs. Loaded straight to
    a GPU, RNG states (which must be CPU byte tensors) fail to load, so a training task would fail its
    first resume on CUDA. The file is the task's own, in its private directory: as trusted as its code.
    """
    if zipfile.is_zipfile(path):
        import torch

        blob = torch.load(path, map_location="cpu", weights_only=False)
    else:
        with open(path, "rb") as fh:
            blob = pickle.load(fh)
    if not isinstance(blob, dict) or "state" not in blob:
        raise ValueError("not a freeride checkpoint")
    return blob
