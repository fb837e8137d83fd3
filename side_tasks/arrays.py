"""The array backend of the bundled tasks: NumPy and SciPy on a CPU, CuPy and ``cupyx.scipy`` on a GPU.

One code path serves both (the array-module idiom): a task asks :func:`array_backend` for the
module of its device and writes ``xp.bincount``, ``sparse.csr_matrix``, ``xp.abs`` and so on against
it. What the two libraries spell differently lives here and only here (:meth:`ArrayBackend.scatter_min`,
:meth:`ArrayBackend.to_host`). The NumPy path is what the CPU tests run, so the logic a GPU runs with
CuPy is the logic they check.

In a freeride worker CuPy allocates through torch's allocator, so a task's one memory cap covers
both (see :mod:`freeride.devices.cuda_worker`).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from freeride.errors import ConfigError

#: The backends a bundled task's ``backend`` argument accepts.
BACKENDS = ("torch", "array")


@dataclass(frozen=True)
class ArrayBackend:
    """``xp`` (numpy or cupy) and ``sparse`` (scipy.sparse or cupyx.scipy.sparse) for one device."""

    name: str
    xp: ModuleType
    sparse: ModuleType
    gpu: bool

    def asarray(self, host: np.ndarray | Any, dtype: Any = None) -> Any:
        """A host (NumPy) array, or a tensor or array of either library, as this backend's array."""
        if hasattr(host, "detach"):  # a torch tensor, e.g. from a checkpoint of the torch backend
            host = host.detach().cpu().numpy()
        elif not isinstance(host, np.ndarray) and hasattr(host, "get"):  # a CuPy array
            host = host.get()
        return self.xp.asarray(host, dtype=dtype)

    def to_host(self, array: Any) -> np.ndarray:
        """A NumPy copy (checkpoints and results hold host arrays, whatever ran the task)."""
        return np.asarray(array.get() if self.gpu else array).copy()

    def scatter_min(self, target: Any, index: Any, values: Any) -> None:
        """``target[index[k]] = min(target[index[k]], values[k])`` for every k, in place."""
        if self.gpu:
            import cupyx

            cupyx.scatter_min(target, index, values)
        else:
            np.minimum.at(target, index, values)


def array_backend(device: str) -> ArrayBackend:
    """The backend for a torch-style device string: ``cpu`` or ``cuda:N`` (CuPy, made current on N)."""
    if device == "cpu" or device.startswith("cpu:"):
        try:
            import scipy.sparse
        except ImportError as exc:  # a core dependency; say what is missing all the same
            raise ConfigError(f"the array backend needs SciPy on the CPU: {exc}") from None
        return ArrayBackend("numpy", np, scipy.sparse, gpu=False)
    if device.startswith("cuda"):
        try:
            import cupy
            import cupyx.scipy.sparse
        except ImportError as exc:
            raise ConfigError(
                f"the array backend needs CuPy on {device} ({exc}): install freeride[cuda12] or freeride[cuda13] "
                "for your CUDA, or use backend=torch"
            ) from None
        index = int(device.split(":", 1)[1]) if ":" in device else 0
        cupy.cuda.Device(index).use()
        return ArrayBackend("cupy", cupy, cupyx.scipy.sparse, gpu=True)
    raise ConfigError(f"no array backend for device {device!r}")


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ConfigError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    return backend
