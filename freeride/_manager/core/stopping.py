"""Stopping a task's process: why (its stop phase), the stop timeout, and what its exit completes.

A resident task is stopped for one reason at a time (:class:`StopPhase`): evicted or drained (checkpoint,
exit, be placed again), released (a cluster task goes back to the queue, or, without a checkpoint, is
lost to the manager that owns it now), or failed (killed; its exit only completes the record). A stop
asks the worker to (checkpoint and) exit and arms a deadline, past which it is killed; a task still
starting is killed at once. Once the process is gone (:meth:`Stopping.exited`), a task stopped to leave
goes back to SUBMITTED (or back to the queue), and any other is FAILED with its exit's record.
"""

from __future__ import annotations

import signal

from freeride._manager.core.api import Action, Kill, Note, NoteLevel, Released, Stop, WorkerExited
from freeride._manager.core.bubbles import Bubbles
from freeride._manager.core.machines import StopPhase
from freeride._manager.core.overruns import Overruns
from freeride._manager.core.tasks import TaskRuntime, Tasks
from freeride.messages import FailureRecord
from freeride.states import TaskState

_LEAVING = (StopPhase.EVICT, StopPhase.DRAIN, StopPhase.RELEASE)  # stops after which a task is placed again


class Stopping:
    def __init__(self, tasks: Tasks, bubbles: Bubbles, overruns: Overruns, stop_timeout_ns: int) -> None:
        self._tasks = tasks
        self._bubbles = bubbles
        self._overruns = overruns
        self._timeout_ns = stop_timeout_ns
        #: Tasks given a stop deadline (only stop() sets one); those whose deadline was cleared since are
        #: pruned when the timers are next looked at.
        self.timers: dict[str, TaskRuntime] = {}

    def let_go(self, task: TaskRuntime) -> bool:
        """``task`` lets go of the bubble it holds, if any (then no freeze is due); True if it held one."""
        released = self._bubbles.release(task.task_id)
        if released:
            self._overruns.disarm()
        return released

    def fail(self, task: TaskRuntime, failure: FailureRecord, out: list[Action]) -> None:
        """Fail a resident task now: kill its process; the exit only completes the record."""
        self.let_go(task)
        task.stop_for(StopPhase.FAIL)
        out.append(Kill(task.task_id))
        self._tasks.move(task, TaskState.FAILED, failure.kind, out, failure=failure)

    def stop(self, task: TaskRuntime, why: StopPhase, now_ns: int, out: list[Action], checkpoint: bool,
             kill: bool = False) -> None:
        """Ask ``task``'s worker to (checkpoint and) exit, killed past the stop timeout; killed at once if it
        is still starting or ``kill`` (it loses the work since its last checkpoint)."""
        task.stop_for(why)
        task.stop_deadline_ns = now_ns + self._timeout_ns
        self.timers[task.task_id] = task
        if task.state == TaskState.STARTING or kill:
            out.append(Kill(task.task_id))
            return
        out.append(Stop(task.task_id, checkpoint=checkpoint))

    def release(self, task: TaskRuntime, reason: str, now_ns: int, out: list[Action], checkpoint: bool) -> None:
        """A cluster task leaves: at once if it has no process, else once its process is gone."""
        out.append(Note(NoteLevel.INFO, f"releasing to the queue: {reason}", task.task_id))
        task.release_checkpoint = checkpoint
        if task.state.is_resident:
            if task.stop in (StopPhase.RELEASE, StopPhase.FAIL):
                return
            if not checkpoint:
                self.let_go(task)
                task.stop_for(StopPhase.RELEASE)
                out.append(Kill(task.task_id))
                return
            if not task.stopping:
                self.stop(task, StopPhase.RELEASE, now_ns, out, checkpoint=task.state != TaskState.STARTING)
            else:
                task.stop_for(StopPhase.RELEASE)  # an eviction or drain under way ends the same way
            return
        if task.state in (TaskState.SUBMITTED, TaskState.EVICTED):
            self.leave(task, reason, out)

    def leave(self, task: TaskRuntime, reason: str, out: list[Action]) -> None:
        """Forget a cluster task that has no process here; the loop hands it back to the queue."""
        self._tasks.forget(task)
        self.timers.pop(task.task_id, None)
        out.append(Released(
            task.task_id, reason, task.release_checkpoint, task.steps, task.progress, task.checkpoint_path,
            task.checkpoint_step, task.restarts, task.known_step_ns, task.progress_unit,
        ))

    def exited(self, task: TaskRuntime, event: WorkerExited, out: list[Action]) -> bool:
        """``task``'s process is gone; True if the rest of the open bubble may go to the next task."""
        task.stop_deadline_ns = 0
        task.pid = 0
        was_running = self.let_go(task)
        stopping = task.stop
        task.stop_for(StopPhase.NONE)
        if task.state.is_terminal:
            # A task failed or cancelled mid-grant let go of its bubble when it was killed; now that its
            # process is gone, the rest of the bubble goes to the next task.
            return True
        # A stop for eviction or drain that ended the process one way or another (clean exit after its
        # checkpoint, or killed because it was still starting or ignored the stop) loses at most the work
        # since the last checkpoint: the task goes back to be placed again.
        if stopping in _LEAVING and task.pending_failure is None:
            self._tasks.move(task, TaskState.EVICTED, stopping.value, out)
            task.restarts += 1
            if task.from_queue:
                self.leave(task, stopping.value, out)
            else:
                self._tasks.move(task, TaskState.SUBMITTED, "re-placement", out)
        else:
            failure = task.pending_failure
            if failure is None:
                failure = exit_failure(event, event.step if event.step >= 0 else task.steps)
            elif not failure.log_tail:
                failure = FailureRecord(**{**failure.to_json(), "log_tail": event.log_tail})
            task.pending_failure = None
            if task.state == TaskState.STARTING and failure.kind == "EXIT" and stopping is not StopPhase.NONE:
                failure = FailureRecord(**{**failure.to_json(), "message": failure.message + " while stopping"})
            self._tasks.move(task, TaskState.FAILED, failure.kind, out, failure=failure)
        return was_running

    def fire(self, now_ns: int, out: list[Action]) -> None:
        """Kill each worker that has not stopped by its deadline."""
        for task in list(self.timers.values()):
            if not task.stop_deadline_ns:
                del self.timers[task.task_id]
            elif now_ns >= task.stop_deadline_ns:
                task.stop_deadline_ns = 0
                task.killed_at_stop = True
                del self.timers[task.task_id]
                out.append(Note(NoteLevel.WARNING, "did not stop in time; killing it", task.task_id))
                out.append(Kill(task.task_id))

    def next_deadline_ns(self) -> int | None:
        deadlines = [t.stop_deadline_ns for t in self.timers.values() if t.stop_deadline_ns]
        return min(deadlines) if deadlines else None


def exit_failure(event: WorkerExited, step: int) -> FailureRecord:
    """The failure of a worker that exited without reporting one (or finishing)."""
    if event.signal:
        try:
            name = signal.Signals(event.signal).name
        except ValueError:
            name = str(event.signal)
        return FailureRecord(
            kind="SIGNAL",
            message=f"worker died from signal {name}",
            signal=event.signal,
            step=step,
            log_tail=event.log_tail,
        )
    return FailureRecord(
        kind="EXIT",
        message=f"worker exited with code {event.exit_code} without reporting an error",
        exit_code=event.exit_code,
        step=step,
        log_tail=event.log_tail,
    )
