"""A task's step health: where its current process is in its steps, and whether a step looks hung.

The rule that calls a step hung (:meth:`StepHealth.looks_hung`) and what becomes of one (thawed only every
other whole bubble, failed ``STEP_TIMEOUT`` after ``step_timeout`` of wall time looking hung while the
trainer makes bubbles: see the grant ranking and :meth:`StepHealth.hung_too_long`) are here and in
``grants.py``, nowhere else.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from freeride._manager.core.machines import STEP, StepPhase
from freeride.messages import FailureRecord

#: A step looks hung only once its granted time is more than this many of the task's step estimates (and more
#: than two of the longest bubbles): a task whose finished steps are short for a hang is never taken for one.
HUNG_STEPS = 10
#: For how long after a bubble's start the trainer counts as making bubbles: a frozen step's looked-hung clock
#: runs only then. A trainer that pauses (evaluation, a checkpoint, the end of training) grants nothing, and a
#: frozen step cannot finish without a grant: failing it then (a healthy task's step, frozen at the last
#: bubble's end) lost a task and its work since the last checkpoint for no hang.
TRAINER_PAUSE_NS = 5_000_000_000
#: How long a frozen grant's time is held out of a step's stuck time while no reading has shown its wait for the
#: core (:meth:`StepHealth.waited`): the kernel books a wait only when it ends. A worker at nice 19 beside a busy
#: loop at nice 0 on its core had its waits booked at most 0.35 s apart (a 2-core VM, 127 bookings, 7 s).
BOOKING_NS = 1_000_000_000
#: A re-probe that finds a step still fitting no bubble doubles the bubbles the next one waits for
#: (:meth:`StepHealth.reprobe_after`), at most this many times (x32: 6,400 bubbles, minutes of a trainer's, at the
#: default 200). Each re-probe of a step longer than every bubble runs it past a bubble's end.
MAX_REPROBE_DOUBLINGS = 5
#: A step is said to be starved of its core (``StepHealth.starved``) only past this much granted time: a wait
#: of a few grants is the scheduler's noise.
STARVED_MIN_NS = 100_000_000


@dataclass
class StepHealth:
    phase: StepPhase = StepPhase.FRESH
    stuck_ns: int = 0  # granted time spent inside one step that has not finished yet
    hung_ns: int = 0  # wall time the current step has looked hung while the trainer made bubbles (phase HUNG)
    hung_seen_ns: int = 0  # when that was last counted (0: the step does not look hung)
    unfit_bubbles: int = 0  # bubbles in a row whose time the task's step estimate did not fit
    #: Re-probes in a row since its step last fitted a bubble (:meth:`reprobe_after`).
    reprobes: int = 0
    #: Bubbles in a row that its step fitted and whose first grant went to another task, and of those, to a
    #: task of a higher priority: what its waiting reason says once they are many (``explain``).
    outranked_bubbles: int = 0
    outranked_by_priority: int = 0
    #: The bubble time (predicted at each first grant) of the task's last first turn, and the bubble time whose
    #: first grant went to a task whose step does not look hung since: a step that looks hung takes a turn only
    #: once the others have had as much (``hung_turn_due``; a bubble no other task could use is no turn).
    turn_ns: int = 0
    passed_over_ns: int = 0
    board_steps: int = 0  # steps its process had finished at the last reading of its board
    #: The task's steps finished before the one it was in at the last reading of its board (restored ones
    #: included: its step word), which its own progress may not have said yet (:meth:`step_reached`).
    board_step: int = 0
    last_grant_ns: int = 0  # the granted time of the grant it was last frozen in
    in_checkpoint: bool = False  # its board said, when it was last frozen, that it was writing a checkpoint
    run_delay_ns: int = -1  # its main thread's run delay inside grants, at its last freeze (-1: not read)
    #: What it waited for its core in the grant of its last freeze (the supervisor sums only grants that end in a
    #: freeze, from 0 for each process); -1: not read.
    freeze_wait_ns: int = -1
    #: Since its current step (or its setup) began: the granted time of the grants it was frozen in, and of those
    #: in which its worker had no core (``WorkerStepsSeen.starved``; :attr:`starved`).
    frozen_granted_ns: int = 0
    core_wait_ns: int = 0
    #: Frozen grants (when, granted ns) whose wait for the core no reading has shown yet: not stuck time yet.
    unbooked: collections.deque[tuple[int, int]] = field(default_factory=collections.deque)
    #: Its step used up the step timeout of granted time at a freeze: it is failed, or not, on that freeze's
    #: board read (``WorkerStepsSeen``), and granted nothing until then. Decided before the read, the failure
    #: named what the board said at the freeze before (a hang in state_dict() at its first freeze read "one
    #: step"), and counted as stuck the grants of steps the board then showed finished.
    verdict_due: bool = False

    def reprobe_after(self, base: int) -> int:
        """How many unfit bubbles in a row its next re-probe waits for: ``base``, doubled for each re-probe since
        its step last fitted a bubble (:data:`MAX_REPROBE_DOUBLINGS`)."""
        return base << min(self.reprobes, MAX_REPROBE_DOUBLINGS)

    def _to(self, new: StepPhase) -> None:
        STEP.check(self.phase, new)
        self.phase = new

    @property
    def has_stepped(self) -> bool:
        """The current process has finished a step (its setup is over)."""
        return self.phase is StepPhase.STEPPED or self.phase is StepPhase.HUNG

    @property
    def hung_turn_due(self) -> bool:
        """A step that looks hung may take this bubble's first turn: since its last, the other tasks have had at
        least as much bubble time (so a hung step has at most about half of it, whatever its task's priority and
        whatever the order of long and short bubbles; counted in bubbles, its turns fell in the same positions of
        every iteration, and took the long ones)."""
        return self.passed_over_ns >= self.turn_ns

    @property
    def in_setup(self) -> bool:
        return self.phase is StepPhase.IN_SETUP

    def new_process(self) -> None:
        """Its process is (re)started: no step finished yet. The granted time of a stuck step is kept."""
        self.hung_ns = self.hung_seen_ns = 0
        self._settle(None)  # the new process's run delay says nothing of the old one's waits
        self.run_delay_ns = -1
        self.freeze_wait_ns = -1
        self.board_steps = self.board_step = 0
        self.verdict_due = False
        self.frozen_granted_ns = self.core_wait_ns = 0
        self._to(StepPhase.FRESH)

    def finished_steps(self) -> None:
        """A park reported finished steps: nothing is stuck."""
        self.stuck_ns = 0
        self.unbooked.clear()
        self.hung_ns = self.hung_seen_ns = 0
        self.frozen_granted_ns = self.core_wait_ns = 0
        self._to(StepPhase.STEPPED)

    def seen_on_board(self, steps_done: int, in_setup: bool, in_checkpoint: bool = False) -> None:
        """What its board showed when it was frozen. Boards only move forward: a process that has finished
        a step is past its setup, whatever else the board says.

        A board that shows more finished steps than at its last reading says that the step it is frozen in
        began inside the grant it was frozen in: only that grant's time is stuck in it. A task with short
        steps, frozen mid-step at the end of grant after grant (its park never came before the freeze),
        used to add every such grant to one "stuck" step and was soon held as looking hung.
        """
        if steps_done < 0:
            return  # no board: nothing was read
        self.in_checkpoint = in_checkpoint
        if steps_done > self.board_steps:
            if self.unbooked:  # the grant just frozen is the last of them: only its time is the step's
                self.stuck_ns = 0
                while len(self.unbooked) > 1:
                    self.unbooked.popleft()
            else:
                self.stuck_ns = min(self.stuck_ns, self.last_grant_ns)
                self.unbooked.clear()
            self.hung_ns = self.hung_seen_ns = 0
            self.frozen_granted_ns, self.core_wait_ns = self.last_grant_ns, 0  # the step began in the last grant
            if self.phase is StepPhase.HUNG:
                self._to(StepPhase.STEPPED)
        self.board_steps = max(self.board_steps, steps_done)
        if steps_done > 0:
            if not self.has_stepped:
                self._to(StepPhase.STEPPED)
        elif not self.has_stepped:
            self._to(StepPhase.IN_SETUP if in_setup else StepPhase.FRESH)

    def waited(self, run_delay_ns: int, now_ns: int, starved: bool = False, asleep: bool = False) -> None:
        """At a freeze: its main thread's run delay inside its grants so far (-1: not read). What it grew by since
        the last reading is time it was runnable and had no core: not the step's, it comes off the step's granted
        time, the grants not yet booked first (:attr:`unbooked`). Those become stuck time once a reading shows
        their waits, or :data:`BOOKING_NS` after their freeze, whatever is left of them, never a starved one early.

        On a busy core a worker at nice 19 can spend grant after grant waiting for the core (the trainer, or
        another job, holds it); counted as stuck, a task of 0.1-0.3 ms steps was held as looking hung. The kernel
        books a wait when it ends, so a reading can miss a grant's wait that a later one holds. Only waits inside
        grants count (the supervisor reads the delay at each grant and before each stop): a worker frozen
        mid-step waits for its core, beside a rank, until the stop lands, often at the rank's next bubble, and
        that wait, taken off the step's granted time too, kept a step hung in a busy loop from ever being judged.
        A step that hangs by sleeping or blocking accrues none, and is judged on its granted time.

        ``starved``: the worker had no core in the grant just frozen, and still waits for one (the supervisor's
        reading, before the stop): that grant is no step's time, at once, rather than once the wait is booked,
        which comes only when the worker gets a core (a worker starved for longer than :data:`BOOKING_NS` had
        its grants counted as stuck, and would have been failed after its step timeout of waiting). Its wait is
        booked once it ends: at the stop's landing, outside any grant, where it counts for nothing.
        ``asleep``: the worker slept through the grant just frozen (the same reading): no wait will be booked for
        it, so it is the step's stuck time at once (a step hung in a sleep was judged :data:`BOOKING_NS` late,
        and took every bubble first meanwhile, as any frozen step does).
        """
        frozen_now = bool(self.unbooked) and self.unbooked[-1][1] == self.last_grant_ns  # ran_past_end's entry
        if starved:
            self.core_wait_ns += self.last_grant_ns  # what "had no core" says: grants known starved only
            if frozen_now:
                self.unbooked.pop()
            else:
                self.stuck_ns = max(0, self.stuck_ns - self.last_grant_ns)
        elif asleep and frozen_now:
            self.stuck_ns += self.unbooked.pop()[1]
        if run_delay_ns < 0:
            self.freeze_wait_ns = -1
            self._settle(None)  # nothing can be booked: granted time is the step's
            return
        self.freeze_wait_ns = max(0, run_delay_ns - max(0, self.run_delay_ns))
        grown = max(0, run_delay_ns - self.run_delay_ns) if self.run_delay_ns >= 0 else 0
        self.run_delay_ns = run_delay_ns
        while grown and self.unbooked:
            at, granted = self.unbooked[0]
            if grown < granted:
                self.unbooked[0] = (at, granted - grown)
                grown = 0
            else:
                self.unbooked.popleft()
                grown -= granted
        self.stuck_ns = max(0, self.stuck_ns - grown)
        self._settle(now_ns - BOOKING_NS)

    def _settle(self, before_ns: int | None) -> None:
        """Count as stuck the unbooked grants frozen before ``before_ns`` (None: all of them)."""
        while self.unbooked and (before_ns is None or self.unbooked[0][0] < before_ns):
            self.stuck_ns += self.unbooked.popleft()[1]

    def ran_past_end(self, granted_ns: int, now_ns: int = 0) -> None:
        """It was frozen mid-step after ``granted_ns`` of its grant, at ``now_ns``. Once its run delay has been
        read, the grant waits in :attr:`unbooked` for the reading that shows its wait for the core (:meth:`waited`)."""
        if self.run_delay_ns >= 0:
            self.unbooked.append((now_ns, granted_ns))
        else:
            self.stuck_ns += granted_ns
        self.last_grant_ns = granted_ns
        self.frozen_granted_ns += granted_ns

    @property
    def starved(self) -> bool:
        """Its worker had no core for most of the granted time it was frozen in since its step (or setup) began,
        over :data:`STARVED_MIN_NS` of it at least: the core is busy with other work (a worker runs at the
        lowest CPU priority), and the step is neither slow nor hung (a command task sat FROZEN in setup() through
        30 s of a test's bubbles beside the test suite's processes on its core, with no word of why)."""
        return self.frozen_granted_ns >= STARVED_MIN_NS and 2 * self.core_wait_ns >= self.frozen_granted_ns

    def looks_hung(self, longest_bubble_ns: int, step_ns: int | None = None) -> bool:
        """A step that has run more granted time than two of the longest bubbles seen, and than
        :data:`HUNG_STEPS` of the task's step estimate ``step_ns`` (None: none yet).

        It fits no bubble and is far longer than the task's steps: a step far longer than its estimate, or a
        hang. The bubbles alone did not say that: predictions are a low percentile, so a task whose steps are
        a few bubbles long (3-5 ms steps, 0.3-1.4 ms bubbles on a torch runtime schedule) looked hung in the
        middle of an ordinary step. Setup and the first step of a process are expected to be long (a graph is
        generated, a model built): until the worker has finished a step (its park reports, or its board read
        when it was frozen), it never looks hung, and keeps the first turn until it finishes or times out.
        """
        if not self.has_stepped or longest_bubble_ns <= 0:
            return False
        stuck = self.stuck_ns
        return stuck > 2 * longest_bubble_ns and (step_ns is None or stuck > HUNG_STEPS * step_ns)

    def takes_turns(self, longest_bubble_ns: int, step_ns: int | None = None) -> bool:
        """Its frozen step shares first turns of whole bubbles with the other tasks (``grants.rank``) rather than
        being thawed first: it looks hung (:meth:`looks_hung`), or its process has finished no step yet and its
        setup and first step have been granted more than two of the longest bubbles, whether or not its worker
        had its core in them (counted by its stuck time instead, a setup starved of its core by a trainer rank
        beside it kept every first turn, and a task of 1 ms steps ran none in a stranger's whole run).

        A setup or first step is expected to be long and is never taken for a hang (:meth:`looks_hung`), but it
        kept the first turn of every bubble until it finished: on an H200 the demo's watermark task, its setup
        (importing torchvision among it) in grants of 10-20 ms, took every bubble for 23 s of a 33 s run, and the
        LSTM and PageRank tasks, past their first steps, ran none. Taking turns, the tasks that step get at least
        half the bubble time, and it still gets the rest (whole bubbles, first turns only).
        """
        if longest_bubble_ns <= 0:
            return False
        if not self.has_stepped:
            return self.frozen_granted_ns > 2 * longest_bubble_ns
        return self.looks_hung(longest_bubble_ns, step_ns)

    def hung_too_long(self, now_ns: int, step_timeout_ns: int, last_bubble_ns: int) -> bool:
        """Note that its step looks hung (from ``now_ns`` if it was not seen so before); True once it has
        looked hung for ``step_timeout`` of wall time while the trainer made bubbles: up to
        :data:`TRAINER_PAUSE_NS` after each bubble's start (``last_bubble_ns``: the latest one's).

        Granted only every other whole bubble, a hung step would take many times its step timeout of wall
        time to use up that much granted time (13 minutes for the default 60 s at a 20% bubble fraction,
        with an overrun into training at each of its bubbles). While the trainer pauses, the clock stops: the
        step is frozen and cannot finish, and the next bubbles give it its turns again.
        """
        if self.phase is not StepPhase.HUNG:
            self.hung_ns, self.hung_seen_ns = 0, now_ns
            self._to(StepPhase.HUNG)
            return False
        counted_to = min(now_ns, last_bubble_ns + TRAINER_PAUSE_NS)
        # At most a pause's worth at once: a check that comes at the first bubble after a pause counts from
        # the check before it, which the pause's idle wakes keep recent.
        self.hung_ns += max(0, min(counted_to - self.hung_seen_ns, TRAINER_PAUSE_NS))
        self.hung_seen_ns = max(self.hung_seen_ns, now_ns)
        return self.hung_ns >= step_timeout_ns

    @property
    def _what(self) -> str:
        """What its process was in when it was last frozen: a checkpoint, or a step."""
        return "a checkpoint (state_dict() and its write)" if self.in_checkpoint else "one step"

    def step_reached(self, reported: int) -> int:
        """The steps it had finished: those its worker ``reported`` at its last park, or more on its board."""
        return max(reported, self.board_step)

    def hung_failure(self, step_timeout_ns: int, step: int) -> FailureRecord:
        return FailureRecord(
            kind="STEP_TIMEOUT",
            message=(f"{self._what} looked hung (it had run longer than two of the longest bubbles and "
                     f"{HUNG_STEPS} times its step estimate) for {self.hung_ns / 1e9:.1f} s of training without "
                     f"finishing (limit {step_timeout_ns / 1e9:.1f} s); {self._granted_text()}"),
            step=step,
        )

    def _granted_text(self) -> str:
        """What it was granted in that step: "it ran for 0.0 ms of granted time" said nothing of a step asleep in a
        hang whose grants read as waits for its core (a stranger's), granted a second and more; "2.5 s of them read
        as waits for its core" was read as nothing clear by the next."""
        waited = self.frozen_granted_ns - self.stuck_ns  # grants read as its waits for the core (or not booked yet)
        if waited < 1_000_000:
            return f"it ran for {_seconds(self.stuck_ns)} of granted time"
        return (f"its grants in this step came to {_seconds(self.frozen_granted_ns)}, {_seconds(waited)} of which "
                "its worker was found waiting for the core (not counted as the step's own time)")

    def stuck_failure(self, step_timeout_ns: int, step: int) -> FailureRecord:
        """The failure of a step (or setup) that ran ``step_timeout`` of granted time without finishing."""
        return FailureRecord(
            kind="STEP_TIMEOUT",
            message=(
                f"{'setup()' if self.in_setup else self._what} ran for {_seconds(self.stuck_ns)} "
                f"of granted time without finishing (limit {step_timeout_ns / 1e9:.1f} s)"
            ),
            step=step,
        )


def _seconds(ns: int) -> str:
    """A duration as a reader wants it: ``3.2 ms`` under a second (``0.0 s`` read as none at all)."""
    return f"{ns / 1e9:.1f} s" if ns >= 1_000_000_000 else f"{ns / 1e6:.1f} ms"
