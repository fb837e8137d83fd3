from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class BubbleStart(_message.Message):
    __slots__ = ("stage", "rank", "iteration", "slot", "kind", "start_ns", "predicted_ns", "free_memory_bytes", "learned")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    START_NS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_NS_FIELD_NUMBER: _ClassVar[int]
    FREE_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    LEARNED_FIELD_NUMBER: _ClassVar[int]
    stage: int
    rank: int
    iteration: int
    slot: int
    kind: str
    start_ns: int
    predicted_ns: int
    free_memory_bytes: int
    learned: bool
    def __init__(self, stage: _Optional[int] = ..., rank: _Optional[int] = ..., iteration: _Optional[int] = ..., slot: _Optional[int] = ..., kind: _Optional[str] = ..., start_ns: _Optional[int] = ..., predicted_ns: _Optional[int] = ..., free_memory_bytes: _Optional[int] = ..., learned: _Optional[bool] = ...) -> None: ...

class BubbleEnd(_message.Message):
    __slots__ = ("stage", "rank", "iteration", "slot", "end_ns")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    END_NS_FIELD_NUMBER: _ClassVar[int]
    stage: int
    rank: int
    iteration: int
    slot: int
    end_ns: int
    def __init__(self, stage: _Optional[int] = ..., rank: _Optional[int] = ..., iteration: _Optional[int] = ..., slot: _Optional[int] = ..., end_ns: _Optional[int] = ...) -> None: ...

class BubbleEvent(_message.Message):
    __slots__ = ("start", "end", "batch", "layout")
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    start: BubbleStart
    end: BubbleEnd
    batch: BubbleEventBatch
    layout: TrainerLayout
    def __init__(self, start: _Optional[_Union[BubbleStart, _Mapping]] = ..., end: _Optional[_Union[BubbleEnd, _Mapping]] = ..., batch: _Optional[_Union[BubbleEventBatch, _Mapping]] = ..., layout: _Optional[_Union[TrainerLayout, _Mapping]] = ...) -> None: ...

class TrainerLayout(_message.Message):
    __slots__ = ("schedule", "stages", "microbatches", "stage_devices", "at_ns", "free_memory_bytes", "job")
    SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    MICROBATCHES_FIELD_NUMBER: _ClassVar[int]
    STAGE_DEVICES_FIELD_NUMBER: _ClassVar[int]
    AT_NS_FIELD_NUMBER: _ClassVar[int]
    FREE_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    schedule: str
    stages: int
    microbatches: int
    stage_devices: _containers.RepeatedScalarFieldContainer[str]
    at_ns: int
    free_memory_bytes: int
    job: str
    def __init__(self, schedule: _Optional[str] = ..., stages: _Optional[int] = ..., microbatches: _Optional[int] = ..., stage_devices: _Optional[_Iterable[str]] = ..., at_ns: _Optional[int] = ..., free_memory_bytes: _Optional[int] = ..., job: _Optional[str] = ...) -> None: ...

class BubbleEventBatch(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[BubbleEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[BubbleEvent, _Mapping]]] = ...) -> None: ...

class StreamSummary(_message.Message):
    __slots__ = ("accepted", "rejected", "last_error", "dropped")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    rejected: int
    last_error: str
    dropped: int
    def __init__(self, accepted: _Optional[int] = ..., rejected: _Optional[int] = ..., last_error: _Optional[str] = ..., dropped: _Optional[int] = ...) -> None: ...

class SubmitRequest(_message.Message):
    __slots__ = ("target", "args_json", "memory_bytes", "priority", "name", "command", "working_dir", "checkpoint_interval_s", "step_time_hint_ms")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    ARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    WORKING_DIR_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_HINT_MS_FIELD_NUMBER: _ClassVar[int]
    target: str
    args_json: str
    memory_bytes: int
    priority: int
    name: str
    command: _containers.RepeatedScalarFieldContainer[str]
    working_dir: str
    checkpoint_interval_s: float
    step_time_hint_ms: float
    def __init__(self, target: _Optional[str] = ..., args_json: _Optional[str] = ..., memory_bytes: _Optional[int] = ..., priority: _Optional[int] = ..., name: _Optional[str] = ..., command: _Optional[_Iterable[str]] = ..., working_dir: _Optional[str] = ..., checkpoint_interval_s: _Optional[float] = ..., step_time_hint_ms: _Optional[float] = ...) -> None: ...

class ListRequest(_message.Message):
    __slots__ = ("include_finished",)
    INCLUDE_FINISHED_FIELD_NUMBER: _ClassVar[int]
    include_finished: bool
    def __init__(self, include_finished: _Optional[bool] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("task_id",)
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    def __init__(self, task_id: _Optional[str] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("task_id",)
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    def __init__(self, task_id: _Optional[str] = ...) -> None: ...

class Failure(_message.Message):
    __slots__ = ("kind", "message", "exit_code", "has_exit_code", "signal", "step", "traceback", "log_tail", "at_unix_s")
    KIND_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    HAS_EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TRACEBACK_FIELD_NUMBER: _ClassVar[int]
    LOG_TAIL_FIELD_NUMBER: _ClassVar[int]
    AT_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    kind: str
    message: str
    exit_code: int
    has_exit_code: bool
    signal: int
    step: int
    traceback: str
    log_tail: str
    at_unix_s: float
    def __init__(self, kind: _Optional[str] = ..., message: _Optional[str] = ..., exit_code: _Optional[int] = ..., has_exit_code: _Optional[bool] = ..., signal: _Optional[int] = ..., step: _Optional[int] = ..., traceback: _Optional[str] = ..., log_tail: _Optional[str] = ..., at_unix_s: _Optional[float] = ...) -> None: ...

class TaskInfo(_message.Message):
    __slots__ = ("task_id", "name", "target", "command", "state", "priority", "memory_bytes", "steps", "progress", "progress_unit", "step_p50_ms", "step_p95_ms", "harvested_s", "overruns", "checkpoint_step", "waiting_reason", "submitted_unix_s", "updated_unix_s", "failure", "has_failure", "pid", "args_json", "restarts", "working_dir", "checkpoint_interval_s", "step_time_hint_ms", "task_dir")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_UNIT_FIELD_NUMBER: _ClassVar[int]
    STEP_P50_MS_FIELD_NUMBER: _ClassVar[int]
    STEP_P95_MS_FIELD_NUMBER: _ClassVar[int]
    HARVESTED_S_FIELD_NUMBER: _ClassVar[int]
    OVERRUNS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_STEP_FIELD_NUMBER: _ClassVar[int]
    WAITING_REASON_FIELD_NUMBER: _ClassVar[int]
    SUBMITTED_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    UPDATED_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    HAS_FAILURE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    ARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    WORKING_DIR_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_HINT_MS_FIELD_NUMBER: _ClassVar[int]
    TASK_DIR_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    name: str
    target: str
    command: _containers.RepeatedScalarFieldContainer[str]
    state: str
    priority: int
    memory_bytes: int
    steps: int
    progress: float
    progress_unit: str
    step_p50_ms: float
    step_p95_ms: float
    harvested_s: float
    overruns: int
    checkpoint_step: int
    waiting_reason: str
    submitted_unix_s: float
    updated_unix_s: float
    failure: Failure
    has_failure: bool
    pid: int
    args_json: str
    restarts: int
    working_dir: str
    checkpoint_interval_s: float
    step_time_hint_ms: float
    task_dir: str
    def __init__(self, task_id: _Optional[str] = ..., name: _Optional[str] = ..., target: _Optional[str] = ..., command: _Optional[_Iterable[str]] = ..., state: _Optional[str] = ..., priority: _Optional[int] = ..., memory_bytes: _Optional[int] = ..., steps: _Optional[int] = ..., progress: _Optional[float] = ..., progress_unit: _Optional[str] = ..., step_p50_ms: _Optional[float] = ..., step_p95_ms: _Optional[float] = ..., harvested_s: _Optional[float] = ..., overruns: _Optional[int] = ..., checkpoint_step: _Optional[int] = ..., waiting_reason: _Optional[str] = ..., submitted_unix_s: _Optional[float] = ..., updated_unix_s: _Optional[float] = ..., failure: _Optional[_Union[Failure, _Mapping]] = ..., has_failure: _Optional[bool] = ..., pid: _Optional[int] = ..., args_json: _Optional[str] = ..., restarts: _Optional[int] = ..., working_dir: _Optional[str] = ..., checkpoint_interval_s: _Optional[float] = ..., step_time_hint_ms: _Optional[float] = ..., task_dir: _Optional[str] = ...) -> None: ...

class ListResponse(_message.Message):
    __slots__ = ("tasks",)
    TASKS_FIELD_NUMBER: _ClassVar[int]
    tasks: _containers.RepeatedCompositeFieldContainer[TaskInfo]
    def __init__(self, tasks: _Optional[_Iterable[_Union[TaskInfo, _Mapping]]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Percentiles(_message.Message):
    __slots__ = ("count", "p50", "p90", "p99", "max", "p999")
    COUNT_FIELD_NUMBER: _ClassVar[int]
    P50_FIELD_NUMBER: _ClassVar[int]
    P90_FIELD_NUMBER: _ClassVar[int]
    P99_FIELD_NUMBER: _ClassVar[int]
    MAX_FIELD_NUMBER: _ClassVar[int]
    P999_FIELD_NUMBER: _ClassVar[int]
    count: int
    p50: float
    p90: float
    p99: float
    max: float
    p999: float
    def __init__(self, count: _Optional[int] = ..., p50: _Optional[float] = ..., p90: _Optional[float] = ..., p99: _Optional[float] = ..., max: _Optional[float] = ..., p999: _Optional[float] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("device", "uptime_s", "bubbles", "bubble_time_s", "granted_s", "harvested_s", "overruns", "overrun_ms", "grant_latency_ms", "park_latency_ms", "memory_budget_bytes", "tasks_by_state", "events_received", "events_rejected", "draining", "event_delay_ms", "events_dropped", "device_info", "device_problem", "layout_changes", "layout", "end_to_worker_ms", "queue", "shared_by_ranks", "events_other_ranks", "events_ignored", "bubbles_while_shared", "shared_quiet_s", "trainer_stops", "hung_overruns", "events_late", "run_s", "run_bubbles", "run_bubble_time_s", "run_granted_s", "run_harvested_s")
    class TasksByStateEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    BUBBLES_FIELD_NUMBER: _ClassVar[int]
    BUBBLE_TIME_S_FIELD_NUMBER: _ClassVar[int]
    GRANTED_S_FIELD_NUMBER: _ClassVar[int]
    HARVESTED_S_FIELD_NUMBER: _ClassVar[int]
    OVERRUNS_FIELD_NUMBER: _ClassVar[int]
    OVERRUN_MS_FIELD_NUMBER: _ClassVar[int]
    GRANT_LATENCY_MS_FIELD_NUMBER: _ClassVar[int]
    PARK_LATENCY_MS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    TASKS_BY_STATE_FIELD_NUMBER: _ClassVar[int]
    EVENTS_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    EVENTS_REJECTED_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    EVENT_DELAY_MS_FIELD_NUMBER: _ClassVar[int]
    EVENTS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    DEVICE_INFO_FIELD_NUMBER: _ClassVar[int]
    DEVICE_PROBLEM_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_CHANGES_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    END_TO_WORKER_MS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    SHARED_BY_RANKS_FIELD_NUMBER: _ClassVar[int]
    EVENTS_OTHER_RANKS_FIELD_NUMBER: _ClassVar[int]
    EVENTS_IGNORED_FIELD_NUMBER: _ClassVar[int]
    BUBBLES_WHILE_SHARED_FIELD_NUMBER: _ClassVar[int]
    SHARED_QUIET_S_FIELD_NUMBER: _ClassVar[int]
    TRAINER_STOPS_FIELD_NUMBER: _ClassVar[int]
    HUNG_OVERRUNS_FIELD_NUMBER: _ClassVar[int]
    EVENTS_LATE_FIELD_NUMBER: _ClassVar[int]
    RUN_S_FIELD_NUMBER: _ClassVar[int]
    RUN_BUBBLES_FIELD_NUMBER: _ClassVar[int]
    RUN_BUBBLE_TIME_S_FIELD_NUMBER: _ClassVar[int]
    RUN_GRANTED_S_FIELD_NUMBER: _ClassVar[int]
    RUN_HARVESTED_S_FIELD_NUMBER: _ClassVar[int]
    device: str
    uptime_s: float
    bubbles: int
    bubble_time_s: float
    granted_s: float
    harvested_s: float
    overruns: int
    overrun_ms: Percentiles
    grant_latency_ms: Percentiles
    park_latency_ms: Percentiles
    memory_budget_bytes: int
    tasks_by_state: _containers.ScalarMap[str, int]
    events_received: int
    events_rejected: int
    draining: bool
    event_delay_ms: Percentiles
    events_dropped: int
    device_info: str
    device_problem: str
    layout_changes: int
    layout: str
    end_to_worker_ms: Percentiles
    queue: QueueStats
    shared_by_ranks: _containers.RepeatedScalarFieldContainer[int]
    events_other_ranks: int
    events_ignored: int
    bubbles_while_shared: int
    shared_quiet_s: float
    trainer_stops: int
    hung_overruns: int
    events_late: int
    run_s: float
    run_bubbles: int
    run_bubble_time_s: float
    run_granted_s: float
    run_harvested_s: float
    def __init__(self, device: _Optional[str] = ..., uptime_s: _Optional[float] = ..., bubbles: _Optional[int] = ..., bubble_time_s: _Optional[float] = ..., granted_s: _Optional[float] = ..., harvested_s: _Optional[float] = ..., overruns: _Optional[int] = ..., overrun_ms: _Optional[_Union[Percentiles, _Mapping]] = ..., grant_latency_ms: _Optional[_Union[Percentiles, _Mapping]] = ..., park_latency_ms: _Optional[_Union[Percentiles, _Mapping]] = ..., memory_budget_bytes: _Optional[int] = ..., tasks_by_state: _Optional[_Mapping[str, int]] = ..., events_received: _Optional[int] = ..., events_rejected: _Optional[int] = ..., draining: _Optional[bool] = ..., event_delay_ms: _Optional[_Union[Percentiles, _Mapping]] = ..., events_dropped: _Optional[int] = ..., device_info: _Optional[str] = ..., device_problem: _Optional[str] = ..., layout_changes: _Optional[int] = ..., layout: _Optional[str] = ..., end_to_worker_ms: _Optional[_Union[Percentiles, _Mapping]] = ..., queue: _Optional[_Union[QueueStats, _Mapping]] = ..., shared_by_ranks: _Optional[_Iterable[int]] = ..., events_other_ranks: _Optional[int] = ..., events_ignored: _Optional[int] = ..., bubbles_while_shared: _Optional[int] = ..., shared_quiet_s: _Optional[float] = ..., trainer_stops: _Optional[int] = ..., hung_overruns: _Optional[int] = ..., events_late: _Optional[int] = ..., run_s: _Optional[float] = ..., run_bubbles: _Optional[int] = ..., run_bubble_time_s: _Optional[float] = ..., run_granted_s: _Optional[float] = ..., run_harvested_s: _Optional[float] = ...) -> None: ...

class QueueStats(_message.Message):
    __slots__ = ("connected", "lease_ms", "depth", "set_aside", "held", "claims", "reclaims", "renewals", "lost", "handed_back", "set_aside_here", "errors", "graces", "last_error")
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    SET_ASIDE_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    CLAIMS_FIELD_NUMBER: _ClassVar[int]
    RECLAIMS_FIELD_NUMBER: _ClassVar[int]
    RENEWALS_FIELD_NUMBER: _ClassVar[int]
    LOST_FIELD_NUMBER: _ClassVar[int]
    HANDED_BACK_FIELD_NUMBER: _ClassVar[int]
    SET_ASIDE_HERE_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    GRACES_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    connected: bool
    lease_ms: int
    depth: int
    set_aside: int
    held: int
    claims: int
    reclaims: int
    renewals: int
    lost: int
    handed_back: int
    set_aside_here: int
    errors: int
    graces: int
    last_error: str
    def __init__(self, connected: _Optional[bool] = ..., lease_ms: _Optional[int] = ..., depth: _Optional[int] = ..., set_aside: _Optional[int] = ..., held: _Optional[int] = ..., claims: _Optional[int] = ..., reclaims: _Optional[int] = ..., renewals: _Optional[int] = ..., lost: _Optional[int] = ..., handed_back: _Optional[int] = ..., set_aside_here: _Optional[int] = ..., errors: _Optional[int] = ..., graces: _Optional[int] = ..., last_error: _Optional[str] = ...) -> None: ...

class BubblesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BubbleSlotStats(_message.Message):
    __slots__ = ("stage", "rank", "slot", "kind", "count", "length_ms", "predicted_ms", "abs_error_pct", "min_free_memory_bytes", "learned", "length_mean_ms", "shared")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    LENGTH_MS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_MS_FIELD_NUMBER: _ClassVar[int]
    ABS_ERROR_PCT_FIELD_NUMBER: _ClassVar[int]
    MIN_FREE_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    LEARNED_FIELD_NUMBER: _ClassVar[int]
    LENGTH_MEAN_MS_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    stage: int
    rank: int
    slot: int
    kind: str
    count: int
    length_ms: Percentiles
    predicted_ms: Percentiles
    abs_error_pct: Percentiles
    min_free_memory_bytes: int
    learned: bool
    length_mean_ms: float
    shared: int
    def __init__(self, stage: _Optional[int] = ..., rank: _Optional[int] = ..., slot: _Optional[int] = ..., kind: _Optional[str] = ..., count: _Optional[int] = ..., length_ms: _Optional[_Union[Percentiles, _Mapping]] = ..., predicted_ms: _Optional[_Union[Percentiles, _Mapping]] = ..., abs_error_pct: _Optional[_Union[Percentiles, _Mapping]] = ..., min_free_memory_bytes: _Optional[int] = ..., learned: _Optional[bool] = ..., length_mean_ms: _Optional[float] = ..., shared: _Optional[int] = ...) -> None: ...

class BubblesResponse(_message.Message):
    __slots__ = ("slots",)
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    slots: _containers.RepeatedCompositeFieldContainer[BubbleSlotStats]
    def __init__(self, slots: _Optional[_Iterable[_Union[BubbleSlotStats, _Mapping]]] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ManagerEvent(_message.Message):
    __slots__ = ("at_unix_s", "task", "bubble_start", "bubble_end")
    AT_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    BUBBLE_START_FIELD_NUMBER: _ClassVar[int]
    BUBBLE_END_FIELD_NUMBER: _ClassVar[int]
    at_unix_s: float
    task: TaskInfo
    bubble_start: BubbleStart
    bubble_end: BubbleEnd
    def __init__(self, at_unix_s: _Optional[float] = ..., task: _Optional[_Union[TaskInfo, _Mapping]] = ..., bubble_start: _Optional[_Union[BubbleStart, _Mapping]] = ..., bubble_end: _Optional[_Union[BubbleEnd, _Mapping]] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("timeout_s",)
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    timeout_s: float
    def __init__(self, timeout_s: _Optional[float] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("parked", "checkpointed", "timed_out", "killed")
    PARKED_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTED_FIELD_NUMBER: _ClassVar[int]
    TIMED_OUT_FIELD_NUMBER: _ClassVar[int]
    KILLED_FIELD_NUMBER: _ClassVar[int]
    parked: int
    checkpointed: int
    timed_out: bool
    killed: int
    def __init__(self, parked: _Optional[int] = ..., checkpointed: _Optional[int] = ..., timed_out: _Optional[bool] = ..., killed: _Optional[int] = ...) -> None: ...
