"""The protocol edge: ``freeride.v1``'s generated messages <-> :mod:`freeride.messages`, both ways.

The one module that reads or builds generated messages field by field: the manager's servicers
(:mod:`freeride._manager.servicers`) decode requests and encode answers with it, the client
(:mod:`freeride._wire.client`) the other way round, so the two sides cannot drift apart. Each
``*_to_pb`` has its ``*_from_pb``; ``tests/grpc/test_codec.py`` round-trips every message.

What the wire does not carry comes back as its default: a task's spec travels in a ``TaskInfo``
without its working directory, checkpoint interval and step-time hint, and with its display name
as its name. Incoming trainer events are validated here (:func:`trainer_event_from_pb`); a
submission is returned as it came (:class:`~freeride._validation.Submission`) for
:func:`~freeride._validation.validate_submission`, the check every way in shares.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

from freeride._validation import MAX_PRIORITY, Submission
from freeride._wire import freeride_pb2 as _pb
from freeride.errors import ConfigError, RequestRejected
from freeride.messages import (
    BubbleEnd,
    BubbleEvent,
    BubbleSlotStats,
    BubbleStart,
    Drained,
    FailureRecord,
    ManagerStats,
    Percentiles,
    QueueStats,
    StreamSummary,
    TaskEvent,
    TaskInfo,
    TaskProgress,
    TaskSpec,
    TrainerEvent,
    TrainerLayout,
    validate_bubble_event,
    validate_layout,
)

# ------------------------------------------------------------------ trainer events


def bubble_event_to_pb(event: TrainerEvent) -> _pb.BubbleEvent:
    if isinstance(event, TrainerLayout):
        return _pb.BubbleEvent(layout=_pb.TrainerLayout(
            schedule=event.schedule, stages=event.stages, microbatches=event.microbatches,
            stage_devices=list(event.stage_devices), at_ns=event.at_ns, free_memory_bytes=event.free_memory_bytes,
            job=event.job,
        ))
    if isinstance(event, BubbleStart):
        return _pb.BubbleEvent(start=_bubble_start_to_pb(event))
    return _pb.BubbleEvent(end=_bubble_end_to_pb(event))


def _bubble_start_to_pb(b: BubbleStart) -> _pb.BubbleStart:
    return _pb.BubbleStart(stage=b.stage, rank=b.rank, iteration=b.iteration, slot=b.slot, kind=b.kind,
                           start_ns=b.start_ns, predicted_ns=b.predicted_ns, free_memory_bytes=b.free_memory_bytes,
                           learned=b.learned)


def _bubble_end_to_pb(e: BubbleEnd) -> _pb.BubbleEnd:
    return _pb.BubbleEnd(stage=e.stage, rank=e.rank, iteration=e.iteration, slot=e.slot, end_ns=e.end_ns)


def bubble_message_to_pb(item: TrainerEvent | Sequence[TrainerEvent]) -> _pb.BubbleEvent:
    """One stream message: an event alone, or a sequence of events as one batch.

    A sequence of one goes out as the event alone, the form every manager of ``freeride.v1`` reads.
    """
    if isinstance(item, (BubbleStart, BubbleEnd, TrainerLayout)):
        return bubble_event_to_pb(item)
    if len(item) == 1:
        return bubble_event_to_pb(item[0])
    return _pb.BubbleEvent(batch=_pb.BubbleEventBatch(events=[bubble_event_to_pb(e) for e in item]))


def message_parts(msg: _pb.BubbleEvent) -> Sequence[_pb.BubbleEvent]:
    """The events one stream message carries, in order: a batch's, or the message itself."""
    return msg.batch.events if msg.WhichOneof("event") == "batch" else (msg,)


def _bubble_start_from_pb(s: _pb.BubbleStart) -> BubbleStart:
    return BubbleStart(s.stage, s.rank, s.iteration, s.slot, s.kind, s.start_ns, s.predicted_ns, s.free_memory_bytes,
                       s.learned)


def _bubble_end_from_pb(e: _pb.BubbleEnd) -> BubbleEnd:
    return BubbleEnd(e.stage, e.rank, e.iteration, e.slot, e.end_ns)


def trainer_event_from_pb(msg: _pb.BubbleEvent, latest_ns: int | None = None) -> TrainerEvent:
    """A validated bubble event or layout; raises :class:`ConfigError` saying what is wrong (a batch
    inside a batch, nothing set, a bad field). ``latest_ns``: times after it are refused."""
    which = msg.WhichOneof("event")
    if which == "layout":
        m = msg.layout
        layout = TrainerLayout(m.schedule, m.stages, m.microbatches, tuple(m.stage_devices), m.at_ns,
                               m.free_memory_bytes, m.job)
        validate_layout(layout, latest_ns)
        return layout
    event: BubbleEvent
    if which == "start":
        event = _bubble_start_from_pb(msg.start)
    elif which == "end":
        event = _bubble_end_from_pb(msg.end)
    else:
        raise ConfigError("a bubble event must be a start or an end (or a layout)")
    validate_bubble_event(event, latest_ns)
    return event


def summary_to_pb(s: StreamSummary) -> _pb.StreamSummary:
    return _pb.StreamSummary(accepted=s.accepted, rejected=s.rejected, dropped=s.dropped, last_error=s.last_error)


def summary_from_pb(msg: _pb.StreamSummary) -> StreamSummary:
    return StreamSummary(int(msg.accepted), int(msg.rejected), int(msg.dropped), msg.last_error)


# ------------------------------------------------------------------ submissions and tasks


def spec_to_pb(spec: TaskSpec) -> _pb.SubmitRequest:
    """The submission on the wire. What the wire cannot carry (arguments JSON cannot encode, a number past its
    field's width) is refused here as the manager refuses what it can read, with :class:`RequestRejected`:
    protobuf's own ``ValueError`` or ``TypeError`` named no field a user set."""
    if abs(spec.priority) > MAX_PRIORITY:
        raise RequestRejected(f"priority must be within +-{MAX_PRIORITY}, got {spec.priority}")
    try:
        args_json = json.dumps(spec.args, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise RequestRejected(f"task arguments must be JSON (numbers, strings, lists, objects): {exc}") from None
    try:
        return _pb.SubmitRequest(
            target=spec.target, args_json=args_json, memory_bytes=spec.memory_bytes, priority=spec.priority,
            name=spec.name, command=list(spec.command), working_dir=spec.working_dir,
            checkpoint_interval_s=spec.checkpoint_interval_s, step_time_hint_ms=spec.step_time_hint_ms,
        )
    except (TypeError, ValueError) as exc:  # e.g. memory_bytes past 2**63, a str where a number goes
        raise RequestRejected(f"the task's spec cannot be sent: {exc}") from None


def submission_from_pb(msg: _pb.SubmitRequest) -> Submission:
    """The submission as it came, for :func:`~freeride._validation.validate_submission`."""
    return Submission(
        target=msg.target, args_json=msg.args_json, memory_bytes=msg.memory_bytes, priority=msg.priority,
        name=msg.name, command=tuple(msg.command), working_dir=msg.working_dir,
        checkpoint_interval_s=msg.checkpoint_interval_s, step_time_hint_ms=msg.step_time_hint_ms,
    )


def _failure_to_pb(f: FailureRecord) -> _pb.Failure:
    return _pb.Failure(kind=f.kind, message=f.message, exit_code=f.exit_code or 0,
                       has_exit_code=f.exit_code is not None, signal=f.signal, step=f.step, traceback=f.traceback,
                       log_tail=f.log_tail, at_unix_s=f.at_unix_s)


def _failure_from_pb(f: _pb.Failure) -> FailureRecord:
    return FailureRecord(kind=f.kind, message=f.message, exit_code=f.exit_code if f.has_exit_code else None,
                         signal=f.signal, step=f.step, traceback=f.traceback, log_tail=f.log_tail,
                         at_unix_s=f.at_unix_s)


def task_info_to_pb(info: TaskInfo) -> _pb.TaskInfo:
    spec, figures = info.spec, info.figures
    msg = _pb.TaskInfo(
        task_id=info.task_id, name=spec.display_name, target=spec.target, command=list(spec.command),
        state=info.state, priority=spec.priority, memory_bytes=spec.memory_bytes, args_json=json.dumps(spec.args),
        steps=figures.steps, progress=figures.progress, progress_unit=figures.progress_unit,
        step_p50_ms=info.step_p50_ms, step_p95_ms=figures.step_p95_ms, harvested_s=figures.harvested_s,
        overruns=figures.overruns, checkpoint_step=figures.checkpoint_step, restarts=figures.restarts,
        waiting_reason=info.waiting_reason, submitted_unix_s=info.submitted_unix_s,
        updated_unix_s=info.updated_unix_s, pid=info.pid, working_dir=spec.working_dir,
        checkpoint_interval_s=spec.checkpoint_interval_s, step_time_hint_ms=spec.step_time_hint_ms,
        task_dir=info.task_dir,
    )
    if info.failure is not None:
        msg.has_failure = True
        msg.failure.CopyFrom(_failure_to_pb(info.failure))
    return msg


def task_info_from_pb(msg: _pb.TaskInfo) -> TaskInfo:
    spec = TaskSpec(target=msg.target, args=json.loads(msg.args_json) if msg.args_json else {},
                    memory_bytes=msg.memory_bytes, priority=msg.priority, name=msg.name, command=tuple(msg.command),
                    working_dir=msg.working_dir, checkpoint_interval_s=msg.checkpoint_interval_s,
                    step_time_hint_ms=msg.step_time_hint_ms)
    figures = TaskProgress(steps=msg.steps, progress=msg.progress, progress_unit=msg.progress_unit,
                           harvested_s=msg.harvested_s, overruns=msg.overruns, restarts=msg.restarts,
                           checkpoint_step=msg.checkpoint_step, step_p95_ms=msg.step_p95_ms)
    return TaskInfo(
        task_id=msg.task_id, spec=spec, state=msg.state, figures=figures, step_p50_ms=msg.step_p50_ms,
        waiting_reason=msg.waiting_reason, submitted_unix_s=msg.submitted_unix_s,
        updated_unix_s=msg.updated_unix_s, failure=_failure_from_pb(msg.failure) if msg.has_failure else None,
        pid=msg.pid, task_dir=msg.task_dir,
    )


# ------------------------------------------------------------------ statistics and the live view


def percentiles_to_pb(p: Percentiles) -> _pb.Percentiles:
    return _pb.Percentiles(count=p.count, p50=p.p50, p90=p.p90, p99=p.p99, max=p.max, p999=p.p999)


def percentiles_from_pb(msg: _pb.Percentiles) -> Percentiles:
    return Percentiles(msg.count, msg.p50, msg.p90, msg.p99, msg.max, msg.p999)


def stats_to_pb(s: ManagerStats) -> _pb.StatsResponse:
    """``messages_dropped`` is not on the wire (see :class:`~freeride.messages.ManagerStats`)."""
    pct = percentiles_to_pb
    return _pb.StatsResponse(
        device=s.device, uptime_s=s.uptime_s, bubbles=s.bubbles, bubble_time_s=s.bubble_time_s,
        granted_s=s.granted_s, harvested_s=s.harvested_s, overruns=s.overruns, overrun_ms=pct(s.overrun_ms),
        grant_latency_ms=pct(s.grant_latency_ms), park_latency_ms=pct(s.park_latency_ms),
        memory_budget_bytes=s.memory_budget_bytes, tasks_by_state=s.tasks_by_state,
        events_received=s.events_received, events_rejected=s.events_rejected, draining=s.draining,
        event_delay_ms=pct(s.event_delay_ms), events_dropped=s.events_dropped, device_info=s.device_info,
        device_problem=s.device_problem, layout_changes=s.layout_changes, layout=s.layout,
        end_to_worker_ms=pct(s.end_to_worker_ms),
        queue=_pb.QueueStats(**dataclasses.asdict(s.queue)) if s.queue is not None else None,
        shared_by_ranks=s.shared_by_ranks, events_other_ranks=s.events_other_ranks, events_ignored=s.events_ignored,
        bubbles_while_shared=s.bubbles_while_shared, shared_quiet_s=s.shared_quiet_s, trainer_stops=s.trainer_stops,
        hung_overruns=s.hung_overruns, events_late=s.events_late, run_s=s.run_s, run_bubbles=s.run_bubbles,
        run_bubble_time_s=s.run_bubble_time_s, run_granted_s=s.run_granted_s, run_harvested_s=s.run_harvested_s,
    )


def stats_from_pb(msg: _pb.StatsResponse) -> ManagerStats:
    pct = percentiles_from_pb
    return ManagerStats(
        device=msg.device, uptime_s=msg.uptime_s, bubbles=msg.bubbles, bubble_time_s=msg.bubble_time_s,
        granted_s=msg.granted_s, harvested_s=msg.harvested_s, overruns=msg.overruns, overrun_ms=pct(msg.overrun_ms),
        grant_latency_ms=pct(msg.grant_latency_ms), park_latency_ms=pct(msg.park_latency_ms),
        memory_budget_bytes=msg.memory_budget_bytes, tasks_by_state=dict(msg.tasks_by_state),
        events_received=msg.events_received, events_rejected=msg.events_rejected, draining=msg.draining,
        event_delay_ms=pct(msg.event_delay_ms), events_dropped=msg.events_dropped, device_info=msg.device_info,
        device_problem=msg.device_problem, layout_changes=msg.layout_changes, layout=msg.layout,
        end_to_worker_ms=pct(msg.end_to_worker_ms),
        queue=_queue_stats_from_pb(msg.queue) if msg.HasField("queue") else None,
        shared_by_ranks=tuple(msg.shared_by_ranks), events_other_ranks=msg.events_other_ranks,
        events_ignored=msg.events_ignored, bubbles_while_shared=msg.bubbles_while_shared,
        shared_quiet_s=msg.shared_quiet_s, trainer_stops=msg.trainer_stops,
        hung_overruns=msg.hung_overruns, events_late=msg.events_late, run_s=msg.run_s, run_bubbles=msg.run_bubbles,
        run_bubble_time_s=msg.run_bubble_time_s, run_granted_s=msg.run_granted_s,
        run_harvested_s=msg.run_harvested_s,
    )


def _queue_stats_from_pb(msg: _pb.QueueStats) -> QueueStats:
    return QueueStats(**{f.name: getattr(msg, f.name) for f in dataclasses.fields(QueueStats)})


def slot_to_pb(s: BubbleSlotStats) -> _pb.BubbleSlotStats:
    pct = percentiles_to_pb
    return _pb.BubbleSlotStats(
        stage=s.stage, rank=s.rank, slot=s.slot, kind=s.kind, count=s.count, length_ms=pct(s.length_ms),
        predicted_ms=pct(s.predicted_ms), abs_error_pct=pct(s.abs_error_pct),
        min_free_memory_bytes=s.min_free_memory_bytes, learned=s.learned, length_mean_ms=s.length_mean_ms,
        shared=s.shared,
    )


def slot_from_pb(msg: _pb.BubbleSlotStats) -> BubbleSlotStats:
    pct = percentiles_from_pb
    return BubbleSlotStats(
        stage=msg.stage, rank=msg.rank, slot=msg.slot, kind=msg.kind, count=msg.count, length_ms=pct(msg.length_ms),
        predicted_ms=pct(msg.predicted_ms), abs_error_pct=pct(msg.abs_error_pct),
        min_free_memory_bytes=msg.min_free_memory_bytes, learned=msg.learned, length_mean_ms=msg.length_mean_ms,
        shared=msg.shared,
    )


def event_to_pb(event: TaskEvent) -> _pb.ManagerEvent:
    msg = _pb.ManagerEvent(at_unix_s=event.at_unix_s)
    if event.task is not None:
        msg.task.CopyFrom(task_info_to_pb(event.task))
    elif isinstance(event.bubble, BubbleStart):
        msg.bubble_start.CopyFrom(_bubble_start_to_pb(event.bubble))
    elif isinstance(event.bubble, BubbleEnd):
        msg.bubble_end.CopyFrom(_bubble_end_to_pb(event.bubble))
    return msg


def event_from_pb(msg: _pb.ManagerEvent) -> TaskEvent | None:
    """The live-view event; None for a kind this version does not know (a newer manager's)."""
    which = msg.WhichOneof("event")
    if which == "task":
        return TaskEvent(msg.at_unix_s, task=task_info_from_pb(msg.task))
    if which == "bubble_start":
        return TaskEvent(msg.at_unix_s, bubble=_bubble_start_from_pb(msg.bubble_start))
    if which == "bubble_end":
        return TaskEvent(msg.at_unix_s, bubble=_bubble_end_from_pb(msg.bubble_end))
    return None


def drain_to_pb(parked: int, checkpointed: int, timed_out: bool = False, killed: int = 0) -> _pb.DrainResponse:
    return _pb.DrainResponse(parked=parked, checkpointed=checkpointed, timed_out=timed_out, killed=killed)


def drain_from_pb(msg: _pb.DrainResponse) -> tuple[Drained, bool]:
    """What the drain stopped, and whether the drain's timeout ran out first."""
    return Drained(int(msg.parked), int(msg.checkpointed), int(msg.killed)), bool(msg.timed_out)
