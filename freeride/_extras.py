"""The optional parts of freeride, and the one-line error when one is missing.

``pip install freeride`` is the core: the manager, the CLI, the client and the trainer's reporter,
with only what they import (grpcio, protobuf, psutil, nvidia-ml-py, prometheus-client). Everything
heavier is an extra, declared in ``pyproject.toml`` and named here so that a command which needs one
says which, in one line, instead of failing on an import deep inside:

* ``tasks``: the bundled side tasks (``side_tasks.*``): torch, NumPy, SciPy, Pillow.
* ``demo``: ``freeride demo`` (the reference workload, the bundled tasks, the figures): ``tasks``
  plus matplotlib. ``freeride plan --plot`` needs matplotlib too.
* ``bench``: ``freeride bench`` and :mod:`freeride.measure`'s intervals: SciPy. ``bench/``'s research
  benches also run the reference workload and draw figures: ``demo`` and ``bench``.
* ``cluster``: the cluster queue (``--queue``): the redis client.
* ``megatron``: Megatron Core, for :mod:`freeride.training.megatron` (a Megatron trainer has it already).
* ``cuda12`` / ``cuda13``: CuPy for the bundled tasks' array backend on NVIDIA GPUs.

A side task that uses torch imports it in its own worker process, which runs the manager's Python:
torch must be installed where the manager runs, but the manager itself never imports it.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

from freeride.errors import MissingExtra

#: Top-level modules each extra brings (import names, not distribution names: ``PIL`` is Pillow).
EXTRA_MODULES: dict[str, tuple[str, ...]] = {
    "tasks": ("torch", "numpy", "scipy", "PIL"),
    "demo": ("torch", "numpy", "scipy", "PIL", "matplotlib"),
    "bench": ("scipy",),
    "cluster": ("redis",),
    "megatron": ("megatron",),
    "cuda12": ("cupy",),
    "cuda13": ("cupy",),
}


def installed(module: str) -> bool:
    """Whether a top-level module can be imported here, without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken parent package, or a module whose spec is unset
        return False


def missing(extra: str, modules: Sequence[str] | None = None) -> list[str]:
    """The modules of ``extra`` (or just ``modules`` of it) that are not installed here."""
    return [m for m in (EXTRA_MODULES[extra] if modules is None else modules) if not installed(m)]


#: Said wherever torch is missing: the extras' bare ``torch`` requirement, on a machine without it, pulls a CUDA
#: build of several GB (5.7 GB in one new user's environment), which a CPU machine never uses.
TORCH_FIRST = ("torch first, the build for this machine (a CPU one: pip install torch --index-url "
               "https://download.pytorch.org/whl/cpu; a bare torch requirement pulls a CUDA build of several GB)")


def install_hint(extra: str, absent: Sequence[str]) -> str:
    """How to install ``extra`` where ``absent`` modules are missing: with torch among them, torch's own build
    first (:data:`TORCH_FIRST`)."""
    if "torch" in absent:
        return f"install {TORCH_FIRST}, then pip install 'freeride[{extra}]'"
    return f"pip install 'freeride[{extra}]'"


def require(extra: str, what: str, modules: Sequence[str] | None = None) -> None:
    """Raise :class:`MissingExtra` unless ``what`` (e.g. ``"freeride demo"``) can import what ``extra`` brings.

    ``modules`` narrows the check to the ones ``what`` needs (``freeride plan --plot``: matplotlib).
    """
    absent = missing(extra, modules)
    if absent:
        names = ", ".join("Pillow" if m == "PIL" else m for m in absent)
        raise MissingExtra(f"{what} needs {names}, not installed in this environment: {install_hint(extra, absent)}")

