"""Support for the GPU tests: a real manager of ``cuda:0`` and real workers on the GPU.

Every test module here sets ``pytestmark = GPU``: marked ``gpu`` and skipped where there is no GPU.
Run them with ``pytest -m gpu`` (``bash bench/gpu/run.sh`` does, with the GPU measurements).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest


def _gpu_reason() -> str:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device"
    return ""


GPU_MISSING = _gpu_reason()
GPU = [pytest.mark.gpu, pytest.mark.skipif(bool(GPU_MISSING), reason=GPU_MISSING or "-")]


class LengthSink:
    """A bubble sink for the adapters' GPU tests: each bubble's length on the device's clock, by (iteration, slot)."""

    device = "cuda:0"

    def __init__(self) -> None:
        self.started: dict[tuple[int, int], int] = {}
        self.lengths: dict[tuple[int, int], int] = {}

    def bubble_start(self, iteration: int, slot: int, kind: str, predicted_ns: int, free_memory_bytes: int = -1,
                     start_ns: int | None = None, learned: bool = False) -> None:
        self.started[(iteration, slot)] = start_ns or 0

    def bubble_end(self, iteration: int, slot: int, end_ns: int | None = None) -> None:
        self.lengths[(iteration, slot)] = (end_ns or 0) - self.started[(iteration, slot)]

    def of(self, iteration: int) -> list[int]:
        """The iteration's bubble lengths, in slot order."""
        return [ns for (it, _), ns in sorted(self.lengths.items()) if it == iteration]


def device_ns(launch: Callable[[], object], repeats: int = 3) -> int:
    """How long ``launch``'s kernels take on the device: the median of ``repeats``, timed with CUDA events."""
    import torch

    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        launch()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e6)
    return int(sorted(times)[repeats // 2])

