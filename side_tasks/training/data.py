"""Training data: bundled real data for the demos, or a user-given dataset path.

Images (32x32, 3 channels, uint8, NCHW):
  * ``"digits"``: the UCI handwritten digits bundled in ``side_tasks/data/digits`` (1,797 real
    8x8 scans, upsampled to 32x32 and repeated over 3 channels), so that ResNet-18 trains on
    real data with no download;
  * a CIFAR-10/100 "python version" directory (``data_batch_*`` / ``train`` pickles);
  * an ``.npz`` file with ``images`` (N,32,32,3 or N,3,32,32 uint8) and ``labels`` (N ints).

Text (bytes): ``"python-docs"`` is the English text of the Python reference manual that every
CPython ships in ``pydoc_data.topics`` (about 460 KB); any other value is a path to a text file.
"""

from __future__ import annotations

import gzip
import pickle
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from side_tasks._io import DATA_DIR
from side_tasks.errors import DataFormatError

DIGITS_PATH = DATA_DIR / "digits" / "digits.csv.gz"


@dataclass(frozen=True)
class ImageDataset:
    """uint8 images (N, 3, 32, 32) and int64 labels (N,), split into train and test."""

    train_images: torch.Tensor
    train_labels: torch.Tensor
    test_images: torch.Tensor
    test_labels: torch.Tensor
    num_classes: int

    @property
    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size()
            for t in (self.train_images, self.train_labels, self.test_images, self.test_labels)
        )


def _split(images: np.ndarray, labels: np.ndarray, test_fraction: float) -> ImageDataset:
    cut = len(labels) - max(1, int(len(labels) * test_fraction))
    tensors = torch.from_numpy(np.ascontiguousarray(images)), torch.from_numpy(labels.astype(np.int64))
    return ImageDataset(tensors[0][:cut], tensors[1][:cut], tensors[0][cut:], tensors[1][cut:], int(labels.max()) + 1)


def load_digits(path: Path = DIGITS_PATH) -> ImageDataset:
    """The bundled digits as 32x32x3 images; the last 20% (a fixed split) is the test set."""
    try:
        with gzip.open(path, "rt") as handle:
            table = np.loadtxt(handle, delimiter=",", dtype=np.float32)
    except (OSError, ValueError) as exc:
        raise DataFormatError(path, f"cannot read the digits data: {exc}") from None
    pixels = torch.from_numpy(table[:, :64].reshape(-1, 1, 8, 8) * (255.0 / 16.0))
    big = F.interpolate(pixels, size=(32, 32), mode="bilinear", align_corners=False)
    images = big.round().clamp(0, 255).to(torch.uint8).repeat(1, 3, 1, 1).numpy()
    return _split(images, table[:, 64].astype(np.int64), 0.2)


def _cifar_pickle(path: Path) -> tuple[np.ndarray, np.ndarray]:
    try:
        with open(path, "rb") as handle:
            batch = pickle.load(handle, encoding="bytes")
        data = np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32)
        labels = np.asarray(batch.get(b"labels", batch.get(b"fine_labels")), dtype=np.int64)
    except (OSError, pickle.UnpicklingError, KeyError, ValueError, TypeError, EOFError) as exc:
        raise DataFormatError(path, f"not a CIFAR python batch: {exc}") from None
    if labels.shape != (data.shape[0],):
        raise DataFormatError(path, f"{data.shape[0]} images but {labels.shape} labels")
    return data, labels


def check_image_dataset(spec: str) -> None:
    """DataFormatError unless ``spec`` names a dataset that exists (the constructor's check: cheap)."""
    if spec != "digits" and not Path(spec).exists():
        raise DataFormatError(spec, "dataset not found (use 'digits', a CIFAR python directory or an .npz file)")


def load_image_dataset(spec: str) -> ImageDataset:
    """Load ``"digits"``, a CIFAR python directory or an ``.npz`` file (see the module doc)."""
    if spec == "digits":
        return load_digits()
    check_image_dataset(spec)
    path = Path(spec)
    if path.is_dir():
        train = sorted(path.glob("data_batch_*")) or sorted(path.glob("train"))
        if not train:
            raise DataFormatError(path, "no CIFAR python batches (data_batch_* or train) in this directory")
        parts = [_cifar_pickle(p) for p in train]
        images, labels = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
        test_files = [p for p in (path / "test_batch", path / "test") if p.exists()]
        if test_files:
            test_images, test_labels = _cifar_pickle(test_files[0])
            return ImageDataset(
                torch.from_numpy(images), torch.from_numpy(labels), torch.from_numpy(test_images),
                torch.from_numpy(test_labels), int(max(labels.max(), test_labels.max())) + 1,
            )  # fmt: skip
        return _split(images, labels, 0.1)
    try:
        with np.load(path) as archive:
            images, labels = np.asarray(archive["images"]), np.asarray(archive["labels"])
    except (OSError, ValueError, KeyError) as exc:
        raise DataFormatError(path, f"expected an .npz with 'images' and 'labels' arrays: {exc}") from None
    if images.ndim == 4 and images.shape[-1] == 3:
        images = images.transpose(0, 3, 1, 2)
    if images.ndim != 4 or images.shape[1:] != (3, 32, 32) or images.dtype != np.uint8:
        raise DataFormatError(path, f"images must be uint8 N x 32 x 32 x 3 (or N x 3 x 32 x 32), got "
                              f"{images.dtype} {images.shape}")  # fmt: skip
    if labels.shape != (images.shape[0],) or labels.min() < 0:
        raise DataFormatError(path, f"labels must be {images.shape[0]} non-negative integers")
    return _split(images, labels.astype(np.int64), 0.1)


def check_text(spec: str) -> None:
    """DataFormatError unless ``spec`` names a text that exists (the constructor's check: cheap)."""
    if spec != "python-docs" and not Path(spec).is_file():
        raise DataFormatError(spec, "text file not found (use 'python-docs' or a path to a text file)")


def load_text(spec: str) -> bytes:
    """``"python-docs"`` (the bundled Python reference text) or the bytes of a text file."""
    if spec == "python-docs":
        from pydoc_data.topics import topics

        return "\n\n".join(topics[key] for key in sorted(topics)).encode("utf-8")
    check_text(spec)
    return Path(spec).read_bytes()
