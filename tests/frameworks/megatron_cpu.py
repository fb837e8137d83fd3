"""What Megatron Core 0.19.2 needs to run its pipeline schedules on a CPU-only torch (tests only).

Nothing here belongs in ``freeride/``: it makes a CPU machine look enough like a CUDA one for
Megatron's schedules, and it is applied by the test processes themselves before they import Megatron.

* ``import megatron.core`` imports ``triton`` (undeclared) through
  ``megatron.core.transformer.moe.ops.paged_stash`` (Triton kernels for MoE paged stashing, unused by
  a dense pipeline). A stand-in module under that name avoids a 691 MB install. A fake ``triton``
  package does not work: torch._dynamo then treats it as the real one.
* ``schedules.py`` creates ``torch.zeros(..., device="cuda")`` and ``p2p_communication.py`` allocates
  receive buffers on ``torch.cuda.current_device()``: a ``TorchFunctionMode`` maps ``device="cuda"``
  to the CPU, and ``torch.cuda.current_device`` answers the CPU device.
* The batched P2P path calls ``torch.cuda.synchronize()`` when ``batch_p2p_sync`` is on: configs built
  with :func:`cpu_config_overrides` turn it off.
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
    module.__doc__ = "Test stand-in: Megatron's Triton paged-stash kernels, which a CPU run never calls."
    module.GLOBAL_BLOCK_SIZE = 1024  # type: ignore[attr-defined]

    def _unavailable(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("MoE paged stashing needs triton; this test process replaced it")

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
    """For a whole test process (a torchrun rank): :func:`on_cpu` from now until the process exits.

    Call before the first Megatron import. Idempotent.
    """
    if not _installed:
        context = on_cpu()
        context.__enter__()
        _installed.append(context)  # held: a dropped generator would restore everything at once


def cpu_config_overrides() -> dict[str, Any]:
    """Config fields a CPU run needs (no CUDA synchronize after batched P2P)."""
    return {"batch_p2p_sync": False}
