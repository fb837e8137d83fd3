"""The trainer's bubbles as the core sees them: the open one, the one closing, and what each slot was like.

At most two bubbles are kept: the **open** one (started, its end not known) and the **closing** one (ended,
or lost to a later start, while the worker it was granted to finishes its step: kept until that worker
parks or is frozen, so that the step's overrun past the real end can be measured). Each bubble's phase
(:class:`BubblePhase`) changes only through :meth:`OpenBubble.to`.

Per (stage, rank, slot) the core keeps statistics (lengths, predictions, errors, the least free memory)
for the Bubbles reply, for at most ``max_slots`` keys.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Hashable
from dataclasses import dataclass, field

from freeride._estimator import SURVIVAL_LENGTHS, percentiles, surviving_end_ns
from freeride._manager.core.machines import BUBBLE, BubblePhase
from freeride.messages import BubbleSlotStats, BubbleStart, Percentiles

MS = 1_000_000
_NEXT = BUBBLE.next
#: How many of a job's layouts the manager keeps the bubble statistics of (the adapters keep as many shapes'
#: trackers: ``freeride.training.tracker.KeptShapes``).
KEPT_SHAPES = 4


@dataclass
class OpenBubble:
    event: BubbleStart
    received_ns: int
    phase: BubblePhase = BubblePhase.OPEN
    end_ns: int = 0  # real end, once known
    end_received_ns: int = 0
    granted: set[str] = field(default_factory=set)
    running: str = ""  # task id holding the bubble now
    #: Set by a policy that predicts ends itself (the reference's): the deadline that stands, whatever
    #: the real end says.
    fixed_deadline_ns: int = 0
    #: The reference policy's poll has asked its worker to park.
    park_sent: bool = False
    #: The real end, as the trainer itself (``TrainerEndSeen``) or a worker's board gave it before the end event
    #: reached this core.
    seen_end_ns: int = 0
    #: The recent lengths of its slot, sorted (at most ``SURVIVAL_LENGTHS``): what its deadline is extended
    #: to while it outlives it (:meth:`deadline_at`).
    survival_ns: tuple[int, ...] = ()
    #: Not granted for want of time: when the core tries again (:meth:`next_chance_ns`; 0: not armed).
    retry_at_ns: int = 0
    #: Ranked for a grant at least once (an unfit task counts the bubble once, however often it is offered).
    ranked: bool = False
    #: Offered again at :attr:`retry_at_ns` (its first grant, if one comes, is late).
    offered_again: bool = False

    @property
    def end_learned_ns(self) -> int:
        """When the manager learned of the real end (0: not yet): the end event's arrival, else the trainer's
        own end (``TrainerEndSeen``: read from the trainer right at the end). Read before a worker's park notes
        the end it saw itself: that one the manager learned from the park."""
        return self.end_received_ns or self.seen_end_ns

    @property
    def deadline_ns(self) -> int:
        if self.fixed_deadline_ns:
            return self.fixed_deadline_ns
        return self.end_ns or self.seen_end_ns or self.event.predicted_end_ns

    def sized_end_ns(self, at_ns: int, within_grace: bool = False) -> int:
        """The end a step admitted at ``at_ns`` was sized to, whatever is known of the real end since: the
        predicted end, or, when later, ``surviving_end_ns`` of its slot's lengths
        (``within_grace``: the step's high-percentile time is within the grace). A fixed deadline (the reference
        policy's) stands."""
        if self.fixed_deadline_ns:
            return self.fixed_deadline_ns
        predicted = self.event.predicted_end_ns
        if not self.survival_ns:
            return predicted
        return max(predicted, surviving_end_ns(self.event.start_ns, self.survival_ns, at_ns, within_grace))

    def deadline_at(self, now_ns: int) -> int:
        """The deadline a grant at ``now_ns`` is sized to: the real end once known, else :meth:`sized_end_ns`."""
        if self.fixed_deadline_ns:
            return self.fixed_deadline_ns
        return self.end_ns or self.seen_end_ns or self.sized_end_ns(now_ns)

    def next_chance_ns(self, now_ns: int, floor_ns: int) -> int:
        """The earliest time after ``now_ns`` at which this bubble, still open with no end known, leaves a grant
        more than ``floor_ns`` (:meth:`deadline_at`); 0 when none comes before its slot's longest length.

        Its deadline moves only as the bubble outlives one of its slot's recent lengths (``surviving_end_ns``),
        and between two of them the time left only shrinks: the candidates are the instants just past each
        length longer than what has passed. A slot whose waits are spread (0.3 ms or 5 ms at the same place in
        the schedule) gets a start prediction that fits no step; once the bubble has outlived the short ones,
        what is left is the long ones' low percentile. A fixed deadline (the reference policy's) never moves.
        """
        if self.fixed_deadline_ns or self.end_ns or self.seen_end_ns or self.phase is not BubblePhase.OPEN:
            return 0
        start = self.event.start_ns
        previous = -1
        for length in self.survival_ns:
            at = start + length + 1
            if at <= now_ns or length == previous:
                continue
            previous = length
            if self.sized_end_ns(at) - at > floor_ns:
                return at
        return 0

    @property
    def latest_deadline_ns(self) -> int:
        """The latest :meth:`deadline_at` can be: a step still running ``grace`` past it, with no end known, is
        frozen (the predicted end, or the longest length seen when that is later)."""
        if self.fixed_deadline_ns or self.end_ns or self.seen_end_ns or not self.survival_ns:
            return self.deadline_ns
        return max(self.event.predicted_end_ns, self.event.start_ns + self.survival_ns[-1])

    def to(self, phase: BubblePhase) -> None:
        old = self.phase
        if old is not phase and phase not in _NEXT[old]:  # BUBBLE.check, inline: this runs at every bubble end
            BUBBLE.check(old, phase, self.event)
        self.phase = phase


@dataclass
class SlotStats:
    kind: str
    learned: bool = False
    lengths_ns: deque[int] = field(default_factory=lambda: deque(maxlen=1024))
    predicted_ns: deque[int] = field(default_factory=lambda: deque(maxlen=1024))
    abs_error_pct: deque[float] = field(default_factory=lambda: deque(maxlen=1024))
    count: int = 0
    #: The most a grant in this slot could be sized to now: the longest of its last ``SURVIVAL_LENGTHS`` lengths
    #: or its latest prediction, whichever is more (what :meth:`OpenBubble.deadline_at` extends to at most).
    reach_ns: int = 0
    #: Of ``count``, those that ended while other trainer ranks shared the device (``BubbleSlotStats.shared``).
    shared: int = 0
    min_free: int = -1


class Bubbles:
    def __init__(self, max_slots: int) -> None:
        self.open: OpenBubble | None = None
        self.closing: OpenBubble | None = None
        self.slots: dict[tuple[int, int, int], SlotStats] = {}
        #: The longest bubble predicted since the start or the last layout change (0: none yet).
        self.longest_ns = 0
        #: When the last bubble started (received; 0: none yet): whether the trainer is making bubbles.
        self.last_start_ns = 0
        self._reach_ns = -1  # reach_ns() cached; -1: a slot's reach changed since
        #: Grows whenever a slot's reach changes (or the slots are replaced): what was derived from them is stale.
        self.reach_version = 0
        self._max_slots = max_slots
        #: The slots and longest bubble of this job's other recent layouts, by shape (:meth:`change_layout`).
        self._kept: OrderedDict[Hashable, tuple[dict[tuple[int, int, int], SlotStats], int]] = OrderedDict()

    def start(self, b: BubbleStart, received_ns: int) -> OpenBubble:
        """Open ``b`` (the last open bubble was closed before) and note its slot."""
        self.longest_ns = max(self.longest_ns, b.predicted_ns)
        self.last_start_ns = received_ns
        slot = self.slots.get((b.stage, b.rank, b.slot))
        if slot is None and len(self.slots) < self._max_slots:
            slot = self.slots[(b.stage, b.rank, b.slot)] = SlotStats(kind=b.kind)
        if slot is not None:
            slot.kind = b.kind
            slot.learned = b.learned
            if b.predicted_ns > slot.reach_ns:
                slot.reach_ns = b.predicted_ns
                self._reach_ns = -1
                self.reach_version += 1
            if b.free_memory_bytes >= 0:
                slot.min_free = b.free_memory_bytes if slot.min_free < 0 else min(slot.min_free, b.free_memory_bytes)
        survival: tuple[int, ...] = ()
        if slot is not None and slot.lengths_ns:
            recent = slot.lengths_ns
            survival = tuple(sorted(itertools.islice(reversed(recent), SURVIVAL_LENGTHS)))
        self.open = OpenBubble(event=b, received_ns=received_ns, survival_ns=survival)
        return self.open

    def measure_end(self, bubble: OpenBubble, end_ns: int, measured: bool, shared: bool = False) -> int:
        """The bubble's length to ``end_ns``; a measured end also feeds its slot's statistics (``shared``: it
        ended while other trainer ranks shared the device, and is counted as such)."""
        start = bubble.event
        length = max(0, end_ns - start.start_ns)
        slot = self.slots.get((start.stage, start.rank, start.slot)) if measured else None
        if slot is not None:
            slot.count += 1
            slot.shared += shared
            slot.lengths_ns.append(length)
            slot.predicted_ns.append(start.predicted_ns)
            reach = max(start.predicted_ns, max(itertools.islice(reversed(slot.lengths_ns), SURVIVAL_LENGTHS)))
            if reach != slot.reach_ns:
                slot.reach_ns = reach
                self._reach_ns = -1
                self.reach_version += 1
            if length > 0:
                slot.abs_error_pct.append(abs(start.predicted_ns - length) * 100.0 / length)
        return length

    def reach_ns(self) -> int:
        """The most time a grant could be sized to in any slot now (0: no slot yet): the longest of the slots'
        :attr:`SlotStats.reach_ns`. A step (plus margin) longer than this fits no bubble the trainer makes now,
        first offer or late re-offer alike. Recomputed only after a slot's reach changed."""
        if self._reach_ns < 0:
            self._reach_ns = max((slot.reach_ns for slot in self.slots.values()), default=0)
        return self._reach_ns

    def close(self, bubble: OpenBubble, end_ns: int, now_ns: int) -> None:
        """The open bubble is over. One still held by a worker is kept, closing, until that worker lets go."""
        if bubble.running:
            bubble.end_ns = end_ns
            bubble.end_received_ns = bubble.end_received_ns or now_ns
            bubble.to(BubblePhase.CLOSING)
            self.closing = bubble
        else:
            bubble.to(BubblePhase.CLOSED)
        self.open = None

    def saw_end(self, bubble: OpenBubble, end_ns: int) -> None:
        """A worker saw ``bubble``'s end on a board before its end event came: nothing more is granted in it."""
        bubble.seen_end_ns = end_ns
        if bubble.phase is BubblePhase.OPEN:
            bubble.to(BubblePhase.SEEN_ENDED)

    def let_go(self, bubble: OpenBubble) -> None:
        """Its worker parked or was frozen: the bubble has no holder now (a closing one is done)."""
        bubble.running = ""
        if bubble is self.closing:
            bubble.to(BubblePhase.CLOSED)
            self.closing = None

    def release(self, task_id: str) -> bool:
        """``task_id`` lets go of whatever bubble it holds (it failed, finished, was cancelled or exited)."""
        released = False
        for bubble in (self.open, self.closing):
            if bubble is not None and bubble.running == task_id:
                bubble.running = ""
                released = True
        if self.closing is not None and not self.closing.running:
            self.closing.to(BubblePhase.CLOSED)
            self.closing = None
        return released

    def held_by(self, task_id: str) -> OpenBubble | None:
        # Match on the holder, not the key: a duplicate start can open a bubble with the same key.
        for bubble in (self.open, self.closing):
            if bubble is not None and bubble.running == task_id:
                return bubble
        return None

    def change_layout(self, leaving: Hashable | None, coming: Hashable, same_job: bool) -> None:
        """A new trainer layout (``coming``, a shape; ``leaving``, the last one's): what was learned of a
        layout's bubbles holds for that layout only. Within one job it is kept, by shape, for the last
        :data:`KEPT_SHAPES` shapes, and a shape seen again gets its slots and longest bubble back: a job that
        alternates micro-batch counts showed its slots afresh (counts of 0-1) at every switch. Another job's
        bubbles are its own: everything is forgotten."""
        if not same_job:
            self._kept.clear()
        elif leaving is not None and self.slots:
            self._kept[leaving] = (self.slots, self.longest_ns)
            self._kept.move_to_end(leaving)
            while len(self._kept) > KEPT_SHAPES:
                self._kept.popitem(last=False)
        self.slots, self.longest_ns = self._kept.pop(coming, ({}, 0))
        self._reach_ns = -1
        self.reach_version += 1

    def slot_stats(self) -> list[BubbleSlotStats]:
        out = []
        for (stage, rank, slot), s in sorted(self.slots.items()):
            out.append(
                BubbleSlotStats(
                    stage=stage,
                    rank=rank,
                    slot=slot,
                    kind=s.kind,
                    count=s.count,
                    length_ms=_pct([v / MS for v in s.lengths_ns]),
                    predicted_ms=_pct([v / MS for v in s.predicted_ns]),
                    abs_error_pct=_pct(list(s.abs_error_pct)),
                    min_free_memory_bytes=s.min_free,
                    learned=s.learned,
                    length_mean_ms=sum(s.lengths_ns) / len(s.lengths_ns) / MS if s.lengths_ns else 0.0,
                    shared=s.shared,
                )
            )
        return out


def _pct(values: list[float]) -> Percentiles:
    return Percentiles(*percentiles(values))
