"""Who gets a bubble: the grant rankings, as pure functions of the candidates and the time left.

Each policy ranks with one of these (``policy.py``); the scheduler gives the bubble to the winner and
applies the ranking's bookkeeping (:attr:`Ranking.unfit`). Candidates are the parked and frozen tasks
that are not being stopped and have not had a grant in this bubble yet.

**freeride** (:func:`rank`), most important first:

0. a step that looks hung and whose turn is not due (below) goes last;
1. priority;
2. a frozen task, which must finish its step (unless that step looks hung, or is a setup or first step
   that has had more than two of the longest bubbles: then those steps share first turns of whole bubbles,
   the long setups and first steps first, the most advanced first, then the hung steps, the least stuck
   first, and never take the tail another task left: a thaw there only runs it past the end, into
   training; a turn is due once the other tasks have had as much bubble time since the last, and until
   then those steps rank after every other candidate, whatever the priorities, taking the bubble only when
   no other task is waiting for bubbles, fitting or not);
3. a task whose step time is not known yet (one probe);
4. fair share among tasks whose step fits: the one that has harvested least goes first (best fit alone
   let the task with the longer step win every bubble, and a shorter one at the same priority never ran;
   taking turns by grant gave the shorter one the short bubbles and the other every long one);
5. the best fit of its high-percentile step time to the time left;
6. FIFO.

A task whose step (plus margin) does not fit the time left is not a candidate; after
``reprobe_after_bubbles`` bubbles in a row of that, it is ranked once as a task whose step time is
unknown (a re-probe: its estimate may be stale, learned under contention); twice as many after each re-probe
that found it still fitting no bubble (``StepHealth.reprobe_after``).

**reference** (:func:`rank_reference`): the highest priority, FIFO on ties; the task itself decides
whether a step fits (1.2 x its median, see the worker runtime).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from freeride._manager.core.tasks import TaskRuntime
from freeride.states import TaskState


@dataclass(frozen=True, slots=True)
class Ranking:
    best: TaskRuntime | None
    #: Candidates whose step did not fit the time left: at a bubble's first grant, each counts one more
    #: unfit bubble.
    unfit: tuple[TaskRuntime, ...] = ()
    #: The winner's step time is measured afresh (it fitted no bubble for too long).
    reprobe: bool = False


NOBODY = Ranking(None)
_FROZEN = TaskState.FROZEN


def rank(
    tasks: Iterable[TaskRuntime],
    granted: set[str],
    remaining_ns: int,
    margin_ns: int,
    reprobe_after: int,
    longest_bubble_ns: int,
) -> Ranking:
    """The freeride ranking (see the module docstring) for ``remaining_ns`` of bubble, of the candidates
    among ``tasks`` (parked and frozen; ``granted``: the ids granted in this bubble already)."""
    best: tuple[tuple[int, ...], TaskRuntime] | None = None
    unfit: list[TaskRuntime] = []
    first_grant = not granted
    seen_now = 1 if first_grant else 0
    for task in tasks:
        if task.stopping or task.task_id in granted:
            continue
        margin = margin_ns + task.margin_ns
        est = task.known_step_ns
        frozen = task.state is _FROZEN
        health = task.health
        # A step that looks hung, or a long setup or first step: it takes turns (StepHealth.takes_turns).
        hung = frozen and health.takes_turns(longest_bubble_ns, est)
        if hung and not first_grant:
            continue
        # A hung step whose turn is not due ranks after every other candidate, whatever its priority (a hung
        # step of a higher priority took every bubble); it takes the bubble only if there is no other task to
        # take it or a later one (one whose step does not fit this bubble waits for a bubble it fits).
        waits_turn = 1 if hung and not health.hung_turn_due else 0
        thaw_rank = 0 if frozen else 1
        if not frozen and est is not None and est + margin > remaining_ns:
            unfit.append(task)
            if health.unfit_bubbles + seen_now < health.reprobe_after(reprobe_after):
                continue
            est = None  # a re-probe: ranked like a task whose step time is unknown
        key = (
            waits_turn,
            -task.spec.priority,
            thaw_rank,
            # Steps that look hung take their shared turn (scheduler) in order of the least granted time stuck,
            # whether their task's step time is known or not: by share, the first of them took every turn (its
            # share does not grow while it hangs); by a known step time first, two tasks hung in their first
            # step (none known) took every bubble from healthy tasks frozen long enough mid-step to look hung.
            # Long setups and first steps go before hung steps, the most advanced first: they finish one after
            # the other, not all late together (each is no hang, and takes turns only beside tasks that step).
            0 if hung or est is None else 1,
            (health.stuck_ns if health.has_stepped else -health.stuck_ns) if hung else task.share_ns,
            remaining_ns - (est or 0),
            task.seq,
        )
        if best is None or key < best[0]:
            best = (key, task)
    if best is None or (best[0][0] and unfit):  # a hung step's turn not due: no bubble another task could fit
        return Ranking(None, tuple(unfit)) if unfit else NOBODY
    winner = best[1]
    counted = seen_now if any(task is winner for task in unfit) else 0
    reprobe = winner.health.unfit_bubbles + counted >= winner.health.reprobe_after(reprobe_after)
    return Ranking(winner, tuple(unfit), reprobe)


def rank_reference(tasks: Iterable[TaskRuntime], granted: set[str]) -> Ranking:
    """The reference system's ranking of the candidates among ``tasks``: the highest priority, FIFO on ties."""
    best: tuple[tuple[int, int], TaskRuntime] | None = None
    for task in tasks:
        if task.stopping or task.task_id in granted:
            continue
        key = (-task.spec.priority, task.seq)
        if best is None or key < best[0]:
            best = (key, task)
    return NOBODY if best is None else Ranking(best[1])
