"""Learned slots: waits the schedule model does not list, offered as bubbles once they recur.

The schedule model (:mod:`freeride.training.schedules`) lists the idle slots that the action order
implies at its reference cost ratio. Real pipelines wait in other places too: a stage slower than
its neighbour (stage imbalance), communication latency, a cost ratio unlike the model's. In a 2-stage
GPipe job with 8 micro-batches those waits took about a quarter of the ranks' time, counted as
"unplanned" and never offered to side tasks.

:class:`WaitLearner` watches every gap between two compute actions that no slot names, keyed by the
action whose end opens it (its position in the rank's order is stable from one iteration to the
next). A gap that recurs in ``recur_iterations`` consecutive iterations, each time at least
``min_length_ns`` long and within ``max_spread`` of their median, becomes a **learned slot**: the
instrumentation then reports it like a modelled slot (a bubble start when that action ends, an end
when the next one begins), with the id ``LEARNED_SLOT_BASE + position`` (apart from every modelled
id, which counts the modelled slots from 0) and ``learned=True`` on the wire, and a predicted length
from what it measured (the predictor is seeded with those lengths). A learned slot that is missing or
shorter than ``min_length_ns / 2`` in ``drop_after`` consecutive iterations is dropped again.

Pure: plain data in (each finished iteration's gaps and learned bubbles), the current slots out;
called on the training thread when an iteration is delivered, so it costs nothing inside a step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from freeride.errors import ConfigError
from freeride.training.schedules import Action, IdleSlot

#: Learned slot ids start here: a schedule never has this many modelled slots per rank.
LEARNED_SLOT_BASE = 1 << 16
#: The kind a learned slot is reported with.
LEARNED_KIND = "learned"

ActionKey = tuple[str, int, int]  # (kind, stage index, micro-batch)


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

    def __init__(self, rank: int, order: Sequence[ActionKey], config: LearningConfig | None = None) -> None:
        self.rank = rank
        self.config = config or LearningConfig()
        self._position = {key: i for i, key in enumerate(order)}
        self._history: dict[ActionKey, deque[int]] = {}
        self._short: dict[ActionKey, int] = {}
        #: The action whose end opens each learned slot -> that slot (replaced whole, never mutated:
        #: the training thread's hook reads it without a lock).
        self.opens: dict[ActionKey, IdleSlot] = {}

    def slot_id(self, key: ActionKey) -> int | None:
        position = self._position.get(key)
        return None if position is None else LEARNED_SLOT_BASE + position

    def observe(self, gaps: Iterable[tuple[ActionKey, int]], learned: Iterable[tuple[int, int]]) -> list[IdleSlot]:
        """Learn from one finished iteration: its unmodelled ``gaps`` (action that opened it, length) and
        its ``learned`` slots' bubbles (slot id, length). Returns the slots learned by this iteration
        (the caller seeds its predictor with :meth:`lengths`)."""
        cfg = self.config
        seen: dict[ActionKey, int] = {}
        for key, length in gaps:
            if key in self._position:
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

    def lengths(self, key: ActionKey) -> list[int]:
        """The lengths measured for ``key`` over the last iterations (what made it a slot)."""
        return list(self._history.get(key, ()))

    def _recurs(self, history: deque[int]) -> bool:
        cfg = self.config
        if len(history) < cfg.recur_iterations or min(history) < cfg.min_length_ns:
            return False
        ordered = sorted(history)
        median = ordered[len(ordered) // 2]
        return ordered[0] >= (1 - cfg.max_spread) * median and ordered[-1] <= (1 + cfg.max_spread) * median

    def _slot(self, key: ActionKey, history: deque[int]) -> IdleSlot:
        ordered = sorted(history)
        slot_id = self.slot_id(key)
        assert slot_id is not None
        return IdleSlot(rank=self.rank, index=slot_id, start=0.0, length=float(ordered[len(ordered) // 2]),
                        kind=LEARNED_KIND, before=None, after=Action(*key))
