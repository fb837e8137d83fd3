"""Free device memory for bubble reports, sampled without ever synchronising the device."""

from __future__ import annotations

import time

from freeride.messages import UNKNOWN_MEMORY


class MemorySampler:
    """Free device memory for bubble reports, never synchronising the device.

    :meth:`refresh` (called between iterations) takes one real sample at most every
    ``refresh_interval_s`` (a host memory query costs tens of microseconds, too much for every
    iteration of a fast pipeline); :meth:`free_bytes` (called at each bubble start) adjusts the
    sample by how much the caching allocator reserved since (CUDA), or returns it (CPU).
    """

    def __init__(self, device: str | None, refresh_interval_s: float = 0.5) -> None:
        self._interval_ns = int(refresh_interval_s * 1e9)
        self._last_ns = -self._interval_ns
        self._cuda_index: int | None = None
        if device and device.startswith("cuda"):
            self._cuda_index = int(device.split(":", 1)[1]) if ":" in device else 0
        self._free = UNKNOWN_MEMORY
        self._reserved_at_sample = 0
        self._enabled = device is not None

    def refresh(self) -> None:
        if not self._enabled:
            return
        now = time.monotonic_ns()
        if now - self._last_ns < self._interval_ns and self._free >= 0:
            return
        self._last_ns = now
        try:
            if self._cuda_index is None:
                import psutil

                self._free = int(psutil.virtual_memory().available)
            else:
                import torch

                self._free = int(torch.cuda.mem_get_info(self._cuda_index)[0])
                self._reserved_at_sample = int(torch.cuda.memory_reserved(self._cuda_index))
        except Exception:  # noqa: BLE001 - a missing figure is reported as unknown, never raised
            self._free = UNKNOWN_MEMORY

    def free_bytes(self) -> int:
        if self._cuda_index is None or self._free < 0:
            return self._free
        try:
            import torch

            grown = int(torch.cuda.memory_reserved(self._cuda_index)) - self._reserved_at_sample
        except Exception:  # noqa: BLE001
            return self._free
        return max(0, self._free - grown)
