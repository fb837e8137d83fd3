"""Why a task is not running, in one line (``freeride list`` and ``show``): a pure function of what the core
knows. Each reason names the rule that holds the task back, with the figures that rule compared."""

from __future__ import annotations

from dataclasses import dataclass

from freeride._manager.core.steps import HUNG_STEPS, TRAINER_PAUSE_NS
from freeride._manager.core.tasks import TaskRuntime
from freeride.messages import RANK_LEFT_S, SHARED_QUIET_NS
from freeride.states import TaskState

MS = 1_000_000


@dataclass(frozen=True)
class Circumstances:
    """What, besides the task itself, decides whether it waits."""

    draining: bool
    device_problem: str
    budget_bytes: int | None
    longest_bubble_ns: int
    margin_ns: int
    reprobe_after_bubbles: int
    #: The policy measures a step that fits no bubble again after ``reprobe_after_bubbles`` (freeride's does).
    reprobes: bool
    #: The trainer ranks that share the device, the followed one first (empty: one rank, or none yet).
    sharing_ranks: tuple[int, ...] = ()
    #: How long since the last bubble started (0: unknown, or none yet).
    since_bubble_ns: int = 0
    #: While ranks share the device, how long since any of them sent an event (0: unknown, or not shared).
    shared_quiet_ns: int = 0
    #: The drain is over: nothing is resident, and nothing starts until the manager is started again.
    drained: bool = False


#: Bubbles in a row that a parked task's step fitted and another task took first, from which its waiting reason
#: says so: a low-priority task behind busy higher ones read "waiting for a bubble", as if none came.
OUTRANKED_SAID = 10



def _ms(ns: int) -> str:
    """A margin in ms: two decimals under 10 ms (margins start at fractions of a millisecond), else one."""
    return f"{ns / MS:.2f}" if ns < 10 * MS else f"{ns / MS:.1f}"


def waiting_reason(task: TaskRuntime, now: Circumstances) -> str:
    """Why a non-running task is not running ("" for a finished one, and for a running one past its first step)."""
    if task.state == TaskState.RUNNING:
        # A stranger's task spent seconds of bubbles in setup() with "RUNNING -" as the only word.
        return "" if task.health.has_stepped else "in setup() or its first step: this process has finished no step yet"
    if task.state == TaskState.SUBMITTED:
        budget = now.budget_bytes
        if now.drained:
            # A stranger read "draining" long after `freeride drain` had finished, and waited for a stop that
            # comes only with a SIGTERM.
            return "the manager is drained: nothing starts until a manager is started again on this state directory"
        if now.draining:
            return "the manager is draining"
        if now.device_problem:
            return f"the device cannot be read: {now.device_problem}"
        if budget is None:
            return "waiting for the first free-memory figure from the trainer or device"
        return (
            f"needs {task.memory_bytes / 2**20:.0f} MiB; the device budget has "
            f"{max(0, budget) / 2**20:.0f} MiB free"
        )
    if task.state in (TaskState.PARKED, TaskState.FROZEN) and now.sharing_ranks and not now.draining:
        ranks = ", ".join(str(r) for r in sorted(now.sharing_ranks))
        if len(set(now.sharing_ranks)) < len(now.sharing_ranks):
            ranks += " (of different jobs)"
        if now.shared_quiet_ns >= SHARED_QUIET_NS:
            return (f"trainer ranks {ranks} shared this device until {now.shared_quiet_ns / 1e9:.0f} s ago (no event "
                    f"from them since): nothing is granted until it has been quiet for {RANK_LEFT_S} s")
        return (f"trainer ranks {ranks} share this device: it is idle only while all of them wait, so nothing is "
                "granted here (run one pipeline rank per device)")
    if task.state == TaskState.PARKED:
        est = task.known_step_ns
        margin = now.margin_ns + task.margin_ns
        # Overruns widen a task's margin (and clean grants narrow it again): say so, from what to what, where
        # the figures shown differ (a widening of microseconds is nothing to say "from 0.2 ms to 0.2 ms" about).
        base, total = _ms(now.margin_ns), _ms(margin)
        widened = f", widened by overruns from {base} ms" if task.margin_ns and base != total else ""
        longest = now.longest_bubble_ns
        if est is not None and longest and est + margin > longest:
            again = ""
            if now.reprobes:
                left = max(0, task.health.reprobe_after(now.reprobe_after_bubbles) - task.health.unfit_bubbles)
                again = f"; its step time is measured again in {left} more bubbles"
            # What fits is judged against the trainer's predictions (a low percentile of each slot's waits), not the
            # lengths seen: a stranger read "longest 1.9 ms" against slots of 4-7 ms p99 in `freeride bubbles`.
            return (
                f"its step ({est / MS:.1f} ms p95 + {total} ms margin{widened}) fits no bubble as predicted "
                f"(longest predicted {longest / MS:.1f} ms, a low percentile of its slot's waits: `freeride bubbles` "
                f"shows both){again}"
            )
        if longest == 0:
            return "no bubble reported yet"
        outranked, by_priority = task.health.outranked_bubbles, task.health.outranked_by_priority
        if outranked >= OUTRANKED_SAID:
            whose = (" (of a higher priority)" if by_priority == outranked else
                     f" ({by_priority} of them to a higher priority)" if by_priority else "")
            # Before its first step, nothing is known to fit: a stranger's task read "its step fitted" unmeasured.
            which = "its step fitted" if est is not None else "(its step not measured yet)"
            return (f"waiting for a bubble: the last {outranked} bubbles {which} went to other tasks "
                    f"first{whose}" + (f"; margin {total} ms{widened}" if widened else ""))
        return "waiting for a bubble" + (f" (margin {total} ms{widened})" if widened else "")
    if task.state == TaskState.STARTING:
        # Stranger trial: after a restart, tasks sat in STARTING for a minute with no word (workers importing torch
        # at nice 19 on the trainer's busy core).
        return ("its worker is starting: importing the task's module and building it, at the lowest CPU priority "
                "(slow beside a busy trainer on the same core)")
    if task.state == TaskState.FROZEN:
        # Stranger trial: a task left frozen when training ended read "resumes at its next grant" long after the
        # last bubble (31 of 72 device-runs), and looked broken. Nothing is wrong: it says so, and since when.
        paused = ""
        if now.since_bubble_ns >= TRAINER_PAUSE_NS:
            paused = (f"; the trainer has made no bubble for {now.since_bubble_ns / 1e9:.0f} s (training paused or "
                      "over): it stays frozen, its memory held, until the next bubble")
        health = task.health
        starved = ""
        if health.starved:
            began = "setup() began" if health.in_setup else "its step began"
            starved = (f"; its worker had no core for {health.core_wait_ns / 1e9:.1f} s "
                       f"of the {health.frozen_granted_ns / 1e9:.1f} s of bubbles granted since {began} (the core is "
                       "busy with other work, and a worker runs at the lowest CPU priority)")
        if health.in_setup:
            turns = ("; a long setup: it takes turns of whole bubbles with the tasks that step"
                     if health.takes_turns(now.longest_bubble_ns) else "")
            return ("frozen in setup() after overrunning a bubble" + turns + starved
                    + (paused or "; resumes at its next grant"))
        # What its board said at the freeze: a slow checkpoint (a large state written across bubbles) read as
        # a hung step.
        what = "a checkpoint (state_dict() and its write)" if task.health.in_checkpoint else "a step"
        if task.health.hung_seen_ns:
            return (f"frozen in {what} that looks hung (it has run longer than two of the longest bubbles and "
                    f"{HUNG_STEPS} times its step estimate); thawed at the start of a bubble once the other tasks "
                    "have had as much bubble time since its last turn, until it finishes, or fails once "
                    "it has looked hung for its step timeout while the trainer makes bubbles")
        return f"frozen in {what} after overrunning a bubble" + starved + (paused or "; resumes at its next grant")
    return ""
