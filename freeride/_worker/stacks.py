"""Where a long step is: the worker's threads' stacks, written to its log while a step (or setup, or a
checkpoint) runs long.

A step that looks hung fails ``STEP_TIMEOUT`` with its log's tail, and a setup that never ends is killed
at the manager's stop; neither said *where* the task was. A user debugging it had a message with a time in
it and nothing else (the GPU demo's watermark task spent 4.4 s of grants in a setup that never ended, and
its log could not say in what). So a watch thread in the worker writes every thread's Python stack to the
log once a phase has run a while of *granted* time (wall time less the time the manager kept the worker
stopped, from its board), again at twice that, and so on, a few times per phase: the failure's log tail then
holds the latest, and the log the history of a slow setup.

What it costs: the runtime marks a phase by one attribute write before it and one after (:attr:`started`: a
tuple the main thread makes; no lock, no event, nothing woken), so a step pays tens of nanoseconds. The
thread wakes every quarter of the first report's time (:data:`CHECK_MIN_S`..:data:`CHECK_MAX_S`) and reads
that attribute; it sleeps through a freeze like every thread, and takes the GIL only for that read, and for a
report. A report needs the GIL: a task stuck in C code that
holds it (rare: numpy, torch and the CUDA waits let go of it) gets none, and its log says so by silence.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from types import FrameType

from freeride.units import format_steps

log = logging.getLogger("freeride.worker")

#: How often the watch thread looks: a quarter of the first report's time, within these bounds (s). A wake costs
#: ~0.1 ms of CPU on the 2-core VM (a timed wait's wake there; the read itself is nothing): at the default step
#: timeout (first report at 2 s) two a second, about 0.03% of a core, between grants too.
CHECK_MIN_S, CHECK_MAX_S = 0.05, 0.5
#: The first report of a phase comes after this much granted time (ns; the manager sends an eighth of its step
#: timeout where that is shorter), or :data:`STEP_ESTIMATES` of the task's step estimate where that is longer:
#: a task whose steps take seconds is not reported at every step.
FIRST_REPORT_NS = 2_000_000_000
STEP_ESTIMATES = 20
#: Reports per phase (at the first time, twice it, four times...): a log a hung step cannot flood.
MAX_REPORTS = 6
#: Frames of each thread's stack shown, innermost last; the task's thread (the main one) first. Bounded so
#: that a report fits the failure's 4 KiB log tail.
MAIN_FRAMES = 12
OTHER_FRAMES = 3
REPORT_CHARS = 3200

#: What a phase is, for its report's first line.
SETUP = "setup()"
STEP = "step"
CHECKPOINT = "a checkpoint (state_dict() and its write)"

#: A phase as the runtime marks it: (its start, the board's stood-still total then, the step estimate, what).
Phase = tuple[int, int, int, str]


class StackWatch:
    """Reports where the worker's threads are while a phase runs long (module doc).

    ``stood_still``: the total time the manager has kept this worker stopped (ns; 0 without a board);
    ``steps``: the worker's count of finished steps, for the report's first line.
    """

    def __init__(self, task_id: str, stood_still: Callable[[], int], steps: Callable[[], int],
                 first_report_ns: int = FIRST_REPORT_NS, clock: Callable[[], int] = time.monotonic_ns) -> None:
        self.task_id = task_id
        self.first_report_ns = first_report_ns
        self.check_s = min(CHECK_MAX_S, max(CHECK_MIN_S, first_report_ns / 4e9))
        self._stood_still = stood_still
        self._steps = steps
        self._clock = clock
        #: The phase under way (set by the runtime before it, None after it).
        self.started: Phase | None = None
        self.reports = 0
        self._seen: Phase | None = None
        self._next_ns = 0
        self._made = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"freeride-stack-watch-{self.task_id}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.check_s):
            try:
                self.check()
            except Exception:  # noqa: BLE001 - a report must never end the worker
                log.exception("[task=%s] the stack watch failed; it stops", self.task_id)
                return

    def check(self) -> bool:
        """Report the phase under way if it is due; True if a report was written."""
        phase = self.started
        if phase is None:
            self._seen = None
            return False
        start_ns, stood_before, estimate_ns, what = phase
        if phase is not self._seen:
            self._seen = phase
            self._next_ns = max(self.first_report_ns, STEP_ESTIMATES * estimate_ns, 1)
            self._made = 0
        if self._made >= MAX_REPORTS:
            return False
        granted_ns = self._clock() - start_ns - max(0, self._stood_still() - stood_before)
        if granted_ns < self._next_ns:
            return False
        frames = sys._current_frames()
        if self.started is not phase:  # it ended meanwhile
            return False
        self._made += 1
        self._next_ns *= 2
        self.reports += 1
        log.warning("[task=%s] %s has run %.1f s of granted time without finishing%s; where its threads are "
                    "(most recent call last):\n%s", self.task_id, self._what(what), granted_ns / 1e9,
                    "" if self._made < MAX_REPORTS else " (its last report)",
                    format_threads(frames, self._thread.ident if self._thread is not None else None))
        return True

    def _what(self, what: str) -> str:
        if what != STEP:
            return what
        return f"a step (after {format_steps(self._steps())})"


def format_threads(frames: Mapping[int, FrameType], skip_ident: int | None = None) -> str:
    """Each thread's stack but ``skip_ident``'s (the watch's own), the main thread's first and deepest; bounded to
    :data:`REPORT_CHARS`."""
    main_ident = threading.main_thread().ident
    names = {t.ident: t.name for t in threading.enumerate()}
    order = sorted((ident for ident in frames if ident != skip_ident), key=lambda ident: ident != main_ident)
    parts = []
    for ident in order:
        limit = MAIN_FRAMES if ident == main_ident else OTHER_FRAMES
        # The runtime's own frames (the interpreter's start, the grant loop, a signal handler the report came in)
        # say nothing of the task: the task's thread is shown from the call the runtime made into it.
        stack = [f for f in traceback.extract_stack(frames[ident]) if not _runtimes(f.filename)][-limit:]
        lines = "".join(traceback.format_list(stack)).rstrip("\n")
        parts.append(f"  thread {names.get(ident, ident)}:\n{lines}")
    text = "\n".join(parts)
    if len(text) > REPORT_CHARS:
        text = text[:REPORT_CHARS] + "\n  ... (cut)"
    return text


_RUNTIME_DIR = os.path.dirname(__file__) + os.sep  # as its modules' frames name their files


def _runtimes(filename: str) -> bool:
    """Whether a frame's file is the worker runtime's own (this package) or the interpreter's start."""
    return filename.startswith(_RUNTIME_DIR) or filename.startswith("<frozen runpy>")
