"""A fixed-memory latency histogram for figures recorded on every bubble event.

The manager records one delay per bubble event, tens of thousands a second under load, for as long
as it runs. Keeping samples (as the grant and park windows do) would either grow without bound or
forget all but the last few seconds; this histogram keeps counts in logarithmic buckets instead:
constant memory (a few hundred integers), a few integer operations per record, and percentiles over
the whole run with a relative error of at most 1/32 (each power of two is split into 16 buckets,
and a percentile reports its bucket's midpoint). Values below 32 ns are exact. The maximum is
kept exactly.

A percentile here has the project's one definition (nearest rank, :mod:`freeride.measure`): the
record of rank ``ceil(q * count)`` is found exactly, and only its value is approximated by its
bucket's midpoint (capped at the maximum). So the histogram's p99 is the sampled p99 to within
1/32 of its value, never a different rank.
"""

from __future__ import annotations

from freeride.measure import rank_index
from freeride.messages import Percentiles

_SUB_BITS = 4
_SUB = 1 << _SUB_BITS  # buckets per power of two
_EXACT = 2 * _SUB  # values below this have a bucket each


def _bucket(value: int) -> int:
    if value < _EXACT:
        return value
    shift = value.bit_length() - _SUB_BITS - 1
    return shift * _SUB + (value >> shift)


def _midpoint(index: int) -> float:
    if index < _EXACT:
        return float(index)
    shift = index // _SUB - 1
    low = (index - shift * _SUB) << shift
    return low + ((1 << shift) - 1) / 2


class LatencyHistogram:
    """Counts of non-negative integer durations (nanoseconds); negative values count as 0.

    Not thread-safe: one thread records (the manager's loop); readers run on that thread too.
    """

    __slots__ = ("_counts", "count", "max", "negative")

    def __init__(self) -> None:
        self._counts: list[int] = [0] * _bucket(1 << 40)  # grows only for delays above ~18 minutes
        self.count = 0
        self.max = 0
        self.negative = 0  # timestamps from the future: a sender whose clock is not this host's

    def record(self, value: int) -> None:
        if value < 0:
            self.negative += 1
            value = 0
        index = _bucket(value)
        counts = self._counts
        if index >= len(counts):
            counts.extend([0] * (index + 1 - len(counts)))
        counts[index] += 1
        self.count += 1
        if value > self.max:
            self.max = value

    def quantile(self, q: float) -> float:
        """The nearest-rank ``q`` quantile (``q`` in [0, 1]) as its bucket's midpoint; 0 when empty."""
        if not self.count:
            return 0.0
        rank = rank_index(self.count, 100 * q) + 1
        seen = 0
        for index, n in enumerate(self._counts):
            seen += n
            if seen >= rank:
                return min(_midpoint(index), float(self.max))
        return float(self.max)

    def percentiles(self, scale: float = 1e-6) -> Percentiles:
        """Count, p50, p90, p99, max and p999, multiplied by ``scale`` (default: ns to ms)."""
        return Percentiles(
            count=self.count,
            p50=self.quantile(0.50) * scale,
            p90=self.quantile(0.90) * scale,
            p99=self.quantile(0.99) * scale,
            max=self.max * scale,
            p999=self.quantile(0.999) * scale,
        )
