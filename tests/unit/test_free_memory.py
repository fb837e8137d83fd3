"""Free device memory for bubble reports on CUDA, against a fake torch: the allocator's figures are read
from its nested statistics, never through ``torch.cuda.memory_reserved``'s flattening of all of them
(0.3 ms a call, paid at every bubble start on the training thread)."""

from __future__ import annotations

import sys
from types import SimpleNamespace
from typing import Any

import pytest

from freeride.devices.torch_allocator import allocator_bytes
from freeride.training.free_memory import MemorySampler
from freeride.workload.memory_probe import heap_reader

GiB = 2**30


class FakeTorch:
    """torch as the sampler sees it: the allocator's nested statistics, the driver's free figure, and the
    public calls that flatten the statistics (counted: the sampler must not use them)."""

    def __init__(self, with_nested_stats: bool = True) -> None:
        self.reserved = 2 * GiB
        self.allocated = GiB
        self.free = 50 * GiB
        self.flattening_calls = 0
        self.mem_get_info_calls = 0
        self._C = SimpleNamespace()
        if with_nested_stats:
            self._C._cuda_memoryStats = self._stats
        self.initialized = True
        self.cuda = SimpleNamespace(memory_reserved=self._flat("reserved"), memory_allocated=self._flat("allocated"),
                                    max_memory_reserved=self._flat("reserved"),
                                    mem_get_info=self._mem_get_info, is_initialized=lambda: self.initialized)

    def _stats(self, index: int) -> dict[str, Any]:
        assert index == 1
        return {"reserved_bytes": {"all": {"current": self.reserved, "peak": 3 * self.reserved}},
                "allocated_bytes": {"all": {"current": self.allocated, "peak": 0}}}

    def _flat(self, name: str) -> Any:
        def read(index: int) -> int:
            self.flattening_calls += 1
            return int(getattr(self, name))
        return read

    def _mem_get_info(self, index: int) -> tuple[int, int]:
        self.mem_get_info_calls += 1
        return self.free, 80 * GiB


@pytest.fixture
def torch_fake(monkeypatch: pytest.MonkeyPatch) -> FakeTorch:
    fake = FakeTorch()
    monkeypatch.setitem(sys.modules, "torch", fake)
    return fake


def test_allocator_bytes_reads_the_nested_statistics_without_flattening_them() -> None:
    fake = FakeTorch()
    assert allocator_bytes(fake, 1, "reserved_bytes") == 2 * GiB
    assert allocator_bytes(fake, 1, "allocated_bytes") == GiB
    assert allocator_bytes(fake, 1, "reserved_bytes", "peak") == 6 * GiB
    assert fake.flattening_calls == 0


def test_allocator_bytes_is_zero_before_cuda_starts_as_the_public_calls_say() -> None:
    fake = FakeTorch()
    fake.initialized = False
    assert allocator_bytes(fake, 1, "reserved_bytes") == 0


def test_allocator_bytes_falls_back_to_the_public_calls_where_torch_lacks_the_nested_ones() -> None:
    fake = FakeTorch(with_nested_stats=False)
    assert allocator_bytes(fake, 1, "reserved_bytes") == 2 * GiB
    assert allocator_bytes(fake, 1, "allocated_bytes") == GiB
    assert allocator_bytes(fake, 1, "reserved_bytes", "peak") == 2 * GiB  # torch.cuda.max_memory_reserved's
    assert fake.flattening_calls == 3


def test_a_bubble_start_sees_what_the_allocator_reserved_since_the_last_sample(torch_fake: FakeTorch) -> None:
    sampler = MemorySampler("cuda:1", refresh_interval_s=3600)
    sampler.refresh()
    assert sampler.free_bytes() == 50 * GiB
    torch_fake.reserved += 3 * GiB  # the trainer's allocator grew between two bubbles
    assert sampler.free_bytes() == 47 * GiB
    sampler.refresh()  # within the interval: no new driver sample
    assert torch_fake.mem_get_info_calls == 1
    assert torch_fake.flattening_calls == 0


def test_the_memory_probe_reads_allocated_bytes_without_flattening(torch_fake: FakeTorch) -> None:
    read = heap_reader("cuda:1")
    assert read is not None and read() == GiB
    torch_fake.allocated += 5
    assert read() == GiB + 5
    assert torch_fake.flattening_calls == 0
