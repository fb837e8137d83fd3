"""Learned slots: waits the schedule model does not list, offered as bubbles once they recur.

The schedule's action order says where a rank can wait: before an action that needs another rank's
output (:mod:`freeride.training.rank_slots`); those are the modelled slots. A framework can wait in
other places too: a blocking send, a collective after the schedule (DeepSpeed's loss broadcast), a
second wait in one gap. Such a wait is still idle time, and it recurs at the same place.

:class:`WaitLearner` watches every wait that no slot names, keyed by its *site*: ``(position,
ordinal)``, the position in the rank's order of the action the wait comes before (the order's length
for a wait after the last action) and which wait of that gap it is (0 for the first). A site is
stable from one iteration to the next. A wait that recurs in ``recur_iterations`` consecutive
iterations, each time at least ``min_length_ns`` long and within ``max_spread`` of their median,
becomes a **learned slot**: the tracker then reports it like a modelled slot, with the id
``LEARNED_SLOT_BASE + position * WAITS_PER_GAP + ordinal`` (apart from every modelled id, which is a
position) and ``learned=True`` on the wire, and a predicted length from what it measured (the
predictor is seeded with those lengths). A learned slot that is missing or shorter than
``min_length_ns / 2`` in ``drop_after`` consecutive iterations is dropped again.

Pure: plain data in (each finished iteration's gaps and learned bubbles), the current slots out;
called on the training thread when an iteration is delivered, so it costs nothing inside a step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from freeride.errors import ConfigError
from freeride.training.schedules import Action, IdleSlot

#: Learned slot ids start here: a rank's order never has this many actions.
LEARNED_SLOT_BASE = 1 << 16
#: Waits per gap a learned slot can name (a later one in the same gap stays unplanned).
WAITS_PER_GAP = 8
#: The kind a learned slot is reported with.
LEARNED_KIND = "learned"

Site = tuple[int, int]  # (position in the rank's order, ordinal of the wait in that gap)


def is_learned(slot: int) -> bool:
    return slot >= LEARNED_SLOT_BASE


@dataclass(frozen=True)
class LearningConfig:
    """When a recurring wait becomes a slot, and when it stops being one; units are in the names."""

    recur_iterations: int = 3
    min_length_ns: int = 500_000
    max_spread: float = 0.5
    drop_after: int = 3
    max_slots: int = 64

    def __post_init__(self) -> None:
        if self.recur_iterations < 1 or self.drop_after < 1 or self.max_slots < 0:
            raise ConfigError("recur_iterations and drop_after must be >= 1, max_slots >= 0")
        if self.min_length_ns <= 0 or not 0 <= self.max_spread < 1:
            raise ConfigError("min_length_ns must be > 0 and max_spread in [0, 1)")


class WaitLearner:
    """Learns one rank's recurring unmodelled waits (see the module docstring)."""

    def __init__(self, rank: int, order: Sequence[Action], config: LearningConfig | None = None) -> None:
        self.rank = rank
        self.config = config or LearningConfig()
        self._order = tuple(order)
        self._history: dict[Site, deque[int]] = {}
        self._short: dict[Site, int] = {}
        #: Each learned slot by its site (replaced whole, never mutated: the training thread's hook
        #: reads it without a lock).
        self.opens: dict[Site, IdleSlot] = {}

    @property
    def active(self) -> bool:
        """Whether anything is being watched or learned (else an iteration with no gaps changes nothing)."""
        return bool(self._history or self.opens)

    def slot_id(self, site: Site) -> int | None:
        """The learned slot id of a site, or None for a site no learned slot can name."""
        position, ordinal = site
        if not 0 <= position <= len(self._order) or not 0 <= ordinal < WAITS_PER_GAP:
            return None
        return LEARNED_SLOT_BASE + position * WAITS_PER_GAP + ordinal

    def observe(self, gaps: Iterable[tuple[Site, int]], learned: Iterable[tuple[int, int]]) -> list[IdleSlot]:
        """Learn from one finished iteration: its unplanned waits (``gaps``: site, length) and its
        ``learned`` slots' bubbles (slot id, length). Returns the slots learned by this iteration
        (the caller seeds its predictor with :meth:`lengths`)."""
        cfg = self.config
        seen: dict[Site, int] = {}
        for key, length in gaps:
            if self.slot_id(key) is not None:
                seen[key] = seen.get(key, 0) + length
        by_id = {slot.index: key for key, slot in self.opens.items()}
        for slot_id, length in learned:
            owner = by_id.get(slot_id)
            if owner is not None:
                seen[owner] = seen.get(owner, 0) + length
        for key in set(self._history) | set(seen):
            history = self._history.setdefault(key, deque(maxlen=cfg.recur_iterations))
            history.append(seen.get(key, 0))
        new: list[IdleSlot] = []
        opens = dict(self.opens)
        for key, history in self._history.items():
            if key in opens:
                if seen.get(key, 0) < cfg.min_length_ns // 2:
                    self._short[key] = self._short.get(key, 0) + 1
                    if self._short[key] >= cfg.drop_after:
                        del opens[key]
                        self._short.pop(key, None)
                else:
                    self._short.pop(key, None)
            elif len(opens) < cfg.max_slots and self._recurs(history):
                learned_slot = self._slot(key, history)
                opens[key] = learned_slot
                new.append(learned_slot)
        # Forget keys that are neither slots nor seen lately (a wait that went away).
        for key in [k for k, h in self._history.items() if k not in opens and not any(h)]:
            del self._history[key]
        self.opens = opens
        return new

    def lengths(self, key: Site) -> list[int]:
        """The lengths measured for ``key`` over the last iterations (what made it a slot)."""
        return list(self._history.get(key, ()))

    def _recurs(self, history: deque[int]) -> bool:
        cfg = self.config
        if len(history) < cfg.recur_iterations or min(history) < cfg.min_length_ns:
            return False
        ordered = sorted(history)
        median = ordered[len(ordered) // 2]
        return ordered[0] >= (1 - cfg.max_spread) * median and ordered[-1] <= (1 + cfg.max_spread) * median

    def _slot(self, key: Site, history: deque[int]) -> IdleSlot:
        ordered = sorted(history)
        slot_id = self.slot_id(key)
        assert slot_id is not None
        position, order = key[0], self._order
        return IdleSlot(rank=self.rank, index=slot_id, start=0.0, length=float(ordered[len(ordered) // 2]),
                        kind=LEARNED_KIND, before=order[position] if position < len(order) else None,
                        after=order[position - 1] if position else None)
