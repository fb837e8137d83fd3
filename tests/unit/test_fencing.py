"""Checkpoint files fenced by claim epoch (``freeride._cluster.fencing``), on real directories: a stale
holder's late file never becomes the checkpoint a later holder resumes from."""

from __future__ import annotations

from pathlib import Path

from freeride._cluster.fencing import epoch_dir, prune, resume_point


def _file(root: Path, epoch: int, step: int) -> Path:
    path = epoch_dir(root, epoch) / f"ckpt-{step}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"whole")
    return path


def test_a_new_claim_resumes_from_the_record_or_a_newer_file_of_the_claim_it_replaces(tmp_path: Path) -> None:
    root = tmp_path / "pr-q7"
    recorded = _file(root, 1, 3)
    assert resume_point(root, 2, str(recorded), 3) == (str(recorded), 3)
    newer = _file(root, 1, 9)  # holder 1 died between writing it and recording it
    assert resume_point(root, 2, str(recorded), 3) == (str(newer), 9)


def test_a_stale_holders_late_file_is_never_resumed_from(tmp_path: Path) -> None:
    root = tmp_path / "pr-q7"
    _file(root, 1, 9)
    recorded = _file(root, 2, 5)  # claim 2 resumed and checkpointed, fenced into the record
    _file(root, 1, 20)  # holder 1 lost its lease but kept writing: newest of all, and not the history
    assert resume_point(root, 3, str(recorded), 5) == (str(recorded), 5)
    assert prune(root, 3, str(recorded)) == 1 and not epoch_dir(root, 1).exists()
    assert epoch_dir(root, 2).is_dir()


def test_no_checkpoint_to_resume_from(tmp_path: Path) -> None:
    root = tmp_path / "pr-q7"
    assert resume_point(root, 1, "", -1) == ("", -1)
    # The record names a file that is gone (a step alone cannot be resumed from): start afresh.
    assert resume_point(root, 2, str(root / "e1" / "ckpt-4.pt"), 4) == ("", -1)
