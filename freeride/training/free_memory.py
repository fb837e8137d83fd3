"""Free device memory for bubble reports, sampled without ever synchronising the device."""

from __future__ import annotations

import time

from freeride.devices.torch_allocator import allocator_bytes
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
        #: The last sample: free bytes, or ``UNKNOWN_MEMORY``.
        self.sampled = UNKNOWN_MEMORY
        self._reserved_at_sample = 0
        self._enabled = device is not None
        #: Whether :meth:`free_bytes` moves between samples (CUDA: by what the allocator reserved since);
        #: where it does not, :attr:`sampled` is the figure, read without a call.
        self.live = self._cuda_index is not None

    def refresh(self) -> None:
        if not self._enabled:
            return
        now = time.monotonic_ns()
        if now - self._last_ns < self._interval_ns and self.sampled >= 0:
            return
        self._last_ns = now
        try:
            if self._cuda_index is None:
                import psutil

                self.sampled = int(psutil.virtual_memory().available)
            else:
                import torch

                self.sampled = int(torch.cuda.mem_get_info(self._cuda_index)[0])
                self._reserved_at_sample = allocator_bytes(torch, self._cuda_index, "reserved_bytes")
        except Exception:  # noqa: BLE001 - a missing figure is reported as unknown, never raised
            self.sampled = UNKNOWN_MEMORY

    def free_bytes(self) -> int:
        if self._cuda_index is None or self.sampled < 0:
            return self.sampled
        try:
            import torch

            grown = allocator_bytes(torch, self._cuda_index, "reserved_bytes") - self._reserved_at_sample
        except Exception:  # noqa: BLE001
            return self.sampled
        return max(0, self.sampled - grown)
