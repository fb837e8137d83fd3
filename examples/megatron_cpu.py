"""Megatron Core's pipeline schedules on a machine without a GPU: what freeride's own tests run them with.

Megatron Core is built for CUDA. To try its 1F1B and interleaved schedules, and freeride's adapter
(``freeride.training.megatron``), on a CPU-only torch over gloo, copy this file beside your trainer and::

    import megatron_cpu
    megatron_cpu.install()          # first, before anything imports Megatron

    config = TransformerConfig(..., **megatron_cpu.cpu_config_overrides(virtual_stages))

What it changes, for Megatron Core 0.19.2 (``shared/FRAMEWORKS.md`` in the repository has the findings):

* ``import megatron.core`` imports ``triton`` (undeclared) through
  ``megatron.core.transformer.moe.ops.paged_stash`` (Triton kernels for MoE paged stashing, unused by
  a dense pipeline). A stand-in module under that name avoids a 691 MB install. A fake ``triton``
  package does not work: torch._dynamo then treats it as the real one. A real triton is left alone.
* ``schedules.py`` creates ``torch.zeros(..., device="cuda")`` and ``p2p_communication.py`` allocates
  receive buffers on ``torch.cuda.current_device()``: a ``TorchFunctionMode`` maps ``device="cuda"``
  to the CPU, and ``torch.cuda.current_device`` answers the CPU device. On a machine with CUDA nothing
  is changed.
* The config (:func:`cpu_config_overrides`): the batched P2P path calls ``torch.cuda.synchronize()``
  when ``batch_p2p_sync`` is on; and interleaved schedules on two pipeline ranks must not batch their
  transfers at all on gloo (the batched ops post both directions to one peer on one group and tag, and
  activations and gradients land in each other's buffers: a NaN loss by the third iteration).

Megatron's own ``Timer`` synchronizes CUDA too: a CPU trainer that sets ``config.timers`` gives a timers
object of its own (freeride's adapter chains to it).
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_PAGED_STASH = "megatron.core.transformer.moe.ops.paged_stash"


def _stand_in_paged_stash() -> types.ModuleType:
    module = types.ModuleType(_PAGED_STASH)
    module.__doc__ = "A stand-in (megatron_cpu): Megatron's Triton paged-stash kernels, which a CPU run never calls."
    module.GLOBAL_BLOCK_SIZE = 1024  # type: ignore[attr-defined]

    def _unavailable(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("MoE paged stashing needs triton; megatron_cpu stood in for it")

    module.paged_stash_copy_kernel = _unavailable  # type: ignore[attr-defined]
    module.paged_stash_pop_kernel = _unavailable  # type: ignore[attr-defined]
    module.__all__ = ["GLOBAL_BLOCK_SIZE", "paged_stash_copy_kernel", "paged_stash_pop_kernel"]  # type: ignore[attr-defined]
    return module


class _CudaToCpu(TorchFunctionMode):
    """Rewrites ``device="cuda"`` (and ``cuda:N``) in torch calls to the CPU."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        device = kwargs.get("device")
        if device is not None and str(device).startswith("cuda"):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


def stand_in_triton_kernels() -> None:
    """Let ``import megatron.core`` work without triton (idempotent; a real triton is left alone)."""
    if "triton" in sys.modules or _PAGED_STASH in sys.modules:
        return
    try:
        import triton  # noqa: F401
    except ImportError:
        sys.modules[_PAGED_STASH] = _stand_in_paged_stash()


def _cpu_device() -> torch.device:
    return torch.device("cpu")


@contextlib.contextmanager
def on_cpu() -> Iterator[None]:
    """Within: Megatron's CUDA literals land on the CPU (this thread). Restored on exit."""
    stand_in_triton_kernels()
    if torch.cuda.is_available():
        yield
        return
    saved = torch.cuda.current_device
    torch.cuda.current_device = _cpu_device  # type: ignore[assignment]
    try:
        with _CudaToCpu():
            yield
    finally:
        torch.cuda.current_device = saved  # type: ignore[assignment]


_installed: list[contextlib.AbstractContextManager[None]] = []


def install() -> None:
    """For a whole process (a torchrun rank): :func:`on_cpu` from now until the process exits.

    Call before the first Megatron import. Idempotent.
    """
    if not _installed:
        context = on_cpu()
        context.__enter__()
        _installed.append(context)  # held: a dropped generator would restore everything at once


def cpu_config_overrides(virtual_stages: int = 1) -> dict[str, Any]:
    """The ``TransformerConfig`` fields a CPU run over gloo needs, for ``virtual_stages`` model chunks per rank: no
    CUDA synchronize after batched transfers, and none batched where the schedule is interleaved."""
    overrides: dict[str, Any] = {"batch_p2p_sync": False}
    if virtual_stages > 1:
        overrides["batch_p2p_comm"] = False
    return overrides
