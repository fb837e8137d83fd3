"""What a pipeline stage holds, sampled between its actions: the trainer's ``--memory-probe``.

The figure the memory model (:mod:`freeride.training.memory`) predicts is the memory a stage holds between
two actions, while it waits in a bubble or not. The probe samples the same thing at the same places
-- at the end of every compute action (:class:`freeride.training.instrument.InstrumentedSchedule`'s
``on_action_end``), at every bubble start, and after the schedule's step (before the optimizer
step) -- relative to a baseline taken before the model is built.

* ``cuda:N``: the caching allocator's ``allocated_bytes`` (what ``torch.cuda.memory_allocated`` returns,
  read without its flattening of every statistic: :func:`freeride.devices.torch_allocator.allocator_bytes`),
  its count of bytes in live tensors (a host-side counter; no device synchronisation).
* ``cpu``: torch's CPU allocator takes its memory from the C library's ``malloc``
  (``posix_memalign``), so glibc's ``mallinfo2()`` -- bytes in chunks handed out and not freed, from
  every arena (``uordblks``) plus mmapped chunks (``hblkhd``) -- counts live tensors exactly, unlike
  the resident set size, which also counts freed pages the allocator keeps, shared libraries and
  pages not touched yet. It also counts other ``malloc`` users of the process (CPython's large
  objects, gloo's buffers, autograd's graph nodes): a few percent here, which is the noise floor of
  the comparison. Without glibc 2.33+ the probe reports nothing (``None``).

Before the baseline, :func:`prime_memory` runs one training step of a throwaway one-block model
of the same shape: the framework allocates some memory once, at its first use (about 1.2 MiB on
CPU for the reference GPT: kernel caches, lazily imported modules), which belongs to no stage's
state and would otherwise be counted in every sample.

A sample costs about a microsecond on CPU (``mallinfo2`` walks the arenas' free lists).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import resource
from collections.abc import Callable
from typing import Any


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _mallinfo2() -> Callable[[], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    fn.argtypes = []

    def in_use() -> int:
        info = fn()
        return int(info.uordblks + info.hblkhd)

    return in_use


def heap_reader(device: str) -> Callable[[], int] | None:
    """A function returning the bytes this process's allocator holds for ``device`` (None: no way)."""
    if device.startswith("cuda"):
        import torch

        from freeride.devices.torch_allocator import allocator_bytes

        index = int(device.split(":", 1)[1]) if ":" in device else 0
        return lambda: allocator_bytes(torch, index, "allocated_bytes")
    return _mallinfo2()


def prime_memory(gpt: Any, microbatch_size: int, device: Any) -> None:
    """One forward, backward and AdamW step of a one-block copy of ``gpt``'s shape, then freed."""
    import dataclasses

    import torch

    from freeride.workload.model import build_chunk, lm_loss, synthetic_batch

    model = build_chunk(dataclasses.replace(gpt, layers=1), 0, 1).to(device)
    optimizer = torch.optim.AdamW(model.parameters())
    x, y = synthetic_batch(gpt, microbatch_size, 0)
    lm_loss(model(x.to(device)), y.to(device)).backward()
    optimizer.step()
    del model, optimizer


def peak_rss_bytes() -> int:
    """The process's resident-set high-water mark (Linux reports ``ru_maxrss`` in KiB)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


class MemoryProbe:
    """Samples the bytes held relative to a baseline; a bubble sink that forwards to another.

    Pass it as :class:`freeride.training.instrument.InstrumentedSchedule`'s sink (wrapping the reporter, if
    any): every ``bubble_start`` is also a sample, keyed by slot. :meth:`take` returns and clears the
    iteration's samples.
    """

    def __init__(self, device: str, inner: Any = None) -> None:
        self._read = heap_reader(device)
        self.inner = inner
        self.baseline_bytes = self._read() if self._read is not None else 0
        self._slots: dict[int, int] = {}
        self._after_actions: list[int] = []

    @property
    def available(self) -> bool:
        return self._read is not None

    def sample(self) -> int | None:
        """Bytes held now beyond the baseline."""
        return None if self._read is None else self._read() - self.baseline_bytes

    def bubble_start(self, iteration: int, slot: int, kind: str, predicted_ns: int,
                     free_memory_bytes: int = -1, start_ns: int | None = None, learned: bool = False) -> None:
        held = self.sample()
        if held is not None:
            self._slots[slot] = held
        if self.inner is not None:
            if learned:
                self.inner.bubble_start(iteration, slot, kind, predicted_ns, free_memory_bytes, start_ns, learned=True)
            else:
                self.inner.bubble_start(iteration, slot, kind, predicted_ns, free_memory_bytes, start_ns)

    def action_end(self, kind: str, stage: int, microbatch: int) -> None:
        held = self.sample()
        if held is not None:
            self._after_actions.append(held)

    def bubble_end(self, iteration: int, slot: int, end_ns: int | None = None) -> None:
        if self.inner is not None:
            self.inner.bubble_end(iteration, slot, end_ns)

    def take(self) -> tuple[dict[int, int], list[int]]:
        """The iteration's samples: per slot at its start, and after each action in order."""
        slots, self._slots = self._slots, {}
        actions, self._after_actions = self._after_actions, []
        return slots, actions
