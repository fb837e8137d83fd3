"""The cluster queue's pure parts on plain data: URLs, placement, the record codec, launch's device finding."""

from __future__ import annotations

import json
import re

import pytest

from freeride._cli.launch import local_devices, spans_nodes
from freeride._cluster import schema
from freeride._cluster.placement import Candidate, Capacity, closed_reason, pick, ranked, refusal
from freeride._cluster.records import (
    SET_ASIDE,
    cluster_task_id,
    encode_submission,
    is_cluster_id,
    new_task_fields,
    status_fields,
)
from freeride._cluster.schema import Unreadable, decode_record, decode_submission, record_or_aside
from freeride._cluster.url import parse_queue_url
from freeride._validation import Submission, submission_of, validate_spec, validate_submission
from freeride.errors import ConfigError, RequestRejected
from freeride.messages import FailureRecord, TaskProgress, TaskRecord, TaskSpec

MS = 1_000_000
GIB = 2**30


# ------------------------------------------------------------------ URLs


@pytest.mark.parametrize(
    ("text", "scheme", "host", "port", "path", "db", "redacted"),
    [
        ("redis://localhost", "redis", "localhost", 6379, "", 0, "redis://localhost:6379/0"),
        ("redis://:s3cret@queue.example:7000/3", "redis", "queue.example", 7000, "", 3,
         "redis://:***@queue.example:7000/3"),
        ("rediss://bob:pw@h/1?ssl_cert_reqs=required", "rediss", "h", 6379, "", 1, "rediss://bob:***@h:6379/1"),
        ("unix:///run/redis/redis.sock", "unix", "", 6379, "/run/redis/redis.sock", 0, "unix:///run/redis/redis.sock"),
        ("unix://:pw@/tmp/r.sock?db=2", "unix", "", 6379, "/tmp/r.sock", 2, "unix://:***@/tmp/r.sock?db=2"),
    ],
)
def test_queue_urls_parse_and_never_show_the_password(
    text: str, scheme: str, host: str, port: int, path: str, db: int, redacted: str
) -> None:
    url = parse_queue_url(text)
    assert (url.scheme, url.host, url.port, url.path, url.db) == (scheme, host, port, path, db)
    assert url.redacted == redacted
    assert "s3cret" not in str(url) and url.tls == (scheme == "rediss")


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("http://h:6379", "scheme"),
        ("h:6379", "scheme"),
        ("redis://", "no host"),
        ("redis://h:99999", "bad queue URL"),
        ("redis://h/x", "database"),
        ("redis://h/1/2", "database number"),
        ("unix://relative.sock", "absolute socket path"),
        ("redis://h?ssl_cert_reqs=none", "unknown queue URL parameter"),
        ("unix:///r.sock?timeout=3", "unknown queue URL parameter"),
    ],
)
def test_malformed_queue_urls_are_config_errors_naming_the_problem(text: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        parse_queue_url(text)


# ------------------------------------------------------------------ placement


def _cap(**kw: object) -> Capacity:
    base: dict[str, object] = {"budget_bytes": 4 * GIB, "longest_bubble_ns": 50 * MS, "margin_ns": MS // 5,
                               "waiting": 0}
    base.update(kw)
    return Capacity(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("cap", "why"),
    [
        (_cap(draining=True), "draining"),
        (_cap(device_problem="NVML: GPU is lost"), "cannot be read"),
        (_cap(hosts_stage=False), "no stage"),
        (_cap(budget_bytes=None), "no free-memory figure"),
        (_cap(longest_bubble_ns=0), "no bubble"),
        (_cap(waiting=1), "still wait for memory"),
        (_cap(trainer_paused=True), "no bubble for 5 s: the trainer paused or ended"),
    ],
)
def test_a_manager_that_cannot_start_anything_takes_nothing(cap: Capacity, why: str) -> None:
    reason = closed_reason(cap)
    assert reason is not None and why in reason
    assert pick([Candidate("a-q1", 1, 0, 1)], cap) is None


def test_placement_checks_memory_and_the_step_against_the_longest_bubble() -> None:
    cap = _cap()
    assert refusal(Candidate("a-q1", 2 * GIB, 0, 1), cap) is None
    assert "budget" in (refusal(Candidate("a-q1", 5 * GIB, 0, 1), cap) or "")
    assert refusal(Candidate("a-q1", GIB, 0, 1, step_ns=40 * MS), cap) is None
    assert "fits no bubble" in (refusal(Candidate("a-q1", GIB, 0, 1, step_ns=50 * MS), cap) or "")
    assert refusal(Candidate("a-q1", GIB, 0, 1, step_ns=None), cap) is None  # unknown: probed here


def test_pick_takes_the_highest_priority_then_the_oldest_among_those_that_fit() -> None:
    cap = _cap(budget_bytes=3 * GIB)
    tasks = [
        Candidate("big-q1", 8 * GIB, 9, 1),  # the most urgent, but too big here
        Candidate("old-q2", GIB, 1, 2),
        Candidate("new-q3", GIB, 1, 3),
        Candidate("low-q4", GIB, 0, 4),
    ]
    chosen = pick(tasks, cap)
    assert chosen is not None and chosen.task_id == "old-q2"
    assert [t.task_id for t in ranked(tasks, cap)] == ["old-q2", "new-q3", "low-q4"]  # the order of retries
    assert pick([], cap) is None


# ------------------------------------------------------------------ records


def test_cluster_ids_never_look_like_a_managers_own_ids() -> None:
    assert cluster_task_id("PageRank (web)", 12) == "pagerank-web-q12"
    assert is_cluster_id("pagerank-web-q12")
    for local in ("pagerank-12", "counter-q-3", "x-q3-5", "../x-q1", "Counter-q1"):
        assert not is_cluster_id(local)


def _stored(fields: dict[str, str]) -> dict[bytes, bytes]:
    return {k.encode(): v.encode() for k, v in fields.items()}


def _good_fields() -> dict[str, str]:
    sub = Submission(target="side_tasks.graphs:PageRank", args_json='{"graph": "rmat:10"}', memory_bytes=GIB,
                     priority=3, name="pr", working_dir="/srv/job", checkpoint_interval_s=5.0, step_time_hint_ms=2.0)
    fields = new_task_fields(sub, 1000.0)
    fields.update(seq="7", entry="1-0", state="QUEUED", owner="", device="")
    return fields


def test_a_record_round_trips_through_its_hash_fields_with_its_schema_version() -> None:
    fields = _good_fields()
    assert fields["schema"] == str(schema.SCHEMA)
    failure = FailureRecord(kind="EXCEPTION", message="boom", step=3)
    figures = TaskProgress(steps=40, progress=40.0, progress_unit="ticks", checkpoint_step=30, restarts=2,
                           step_p95_ms=1.5, harvested_s=0.25, overruns=5)  # overruns: they all read 0
    status = TaskRecord("pr-q7", TaskSpec(name="pr"), "FAILED", figures, "/ck/pr-q7/ckpt-30.pt", failure)
    fields.update(status_fields(status, 1001.0))
    record = decode_record("pr-q7", _stored(fields))
    assert record.submission.name == "pr" and record.submission.memory_bytes == GIB
    assert (record.seq, record.state, record.steps, record.progress, record.progress_unit) == (7, "FAILED", 40, 40.0,
                                                                                                "ticks")
    assert record.figures == figures and record.checkpoint_path == "/ck/pr-q7/ckpt-30.pt"
    assert record.failure is not None and record.failure.kind == "EXCEPTION" and record.terminal
    assert record.name == "pr" and not record.aside
    del fields["schema"]  # written before records carried a version: read as schema 1
    assert decode_record("pr-q7", _stored(fields)).seq == 7
    del fields["overruns"]  # written before records carried it
    assert decode_record("pr-q7", _stored(fields)).figures.overruns == 0


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"memory_bytes": "lots"}, "memory_bytes is not a whole number"),
        ({"seq": None, "epoch": None}, "lacks the field(s) seq, epoch"),
        ({"state": "DANCING"}, "state DANCING is not one freeride knows"),
        ({"spec": "not json"}, "spec is not JSON"),
        ({"spec": json.dumps({"command": "rm -rf /"})}, "spec's 'command' is not a list"),
        ({"steps": "1e3"}, "steps is not a whole number"),
        ({"schema": "99"}, "newer freeride"),
        ({"failure": "{broken"}, "failure is not a failure record"),
        ({"memory_bytes": "1"}, "differ from its spec's"),
    ],
)
def test_a_record_that_does_not_decode_says_which_field_and_why(change: dict[str, str | None], says: str) -> None:
    fields = _good_fields()
    for key, value in change.items():
        if value is None:
            del fields[key]
        else:
            fields[key] = value
    with pytest.raises(Unreadable, match=re.escape(says)):
        decode_record("pr-q7", _stored(fields))
    # A listing shows it with the reason: in its own state (UNREADABLE where that does not read) until the queue
    # sets it aside, and SET_ASIDE once it has (so that a listing counts set-aside records as ``stats`` does).
    row = record_or_aside("pr-q7", _stored(fields), None)
    own = "UNREADABLE" if "state" in says else "QUEUED"
    assert (row.state, row.aside, row.task_id) == (own, "", "pr-q7") and says in row.unreadable
    row = record_or_aside("pr-q7", _stored(fields), (says, 5.0))
    assert (row.state, row.aside, row.unreadable) == (SET_ASIDE, says, "")


@pytest.mark.parametrize("field", ["spec", "name", "memory_bytes", "priority"])
def test_bytes_that_are_not_utf8_are_named_not_raised(field: str) -> None:
    raw = _stored(_good_fields())
    raw[field.encode()] = b"\xff\xfe" + raw[field.encode()]
    with pytest.raises(Unreadable, match=f"its {field} is not UTF-8"):
        decode_record("pr-q7", raw)
    row = record_or_aside("pr-q7", raw, None)
    assert row.state == "QUEUED" and "\\xff" in row.unreadable and not row.aside


def test_the_queue_validates_a_submission_with_the_same_function_as_submit() -> None:
    ok = TaskSpec(target="m:C", args={"n": 1}, memory_bytes=GIB)
    assert validate_spec(ok) == validate_submission(submission_of(ok))
    sub = submission_of(ok)
    assert decode_submission(encode_submission(sub)) == sub
    for bad, says in [
        (TaskSpec(target="m:C", memory_bytes=0), "memory"),
        (TaskSpec(target="not a target", memory_bytes=GIB), "module:Class"),
        (TaskSpec(target="m:C", command=("x",), memory_bytes=GIB), "exactly one"),
        (TaskSpec(target="m:C", args={"a": float("nan")}, memory_bytes=GIB), "JSON"),
        (TaskSpec(target="m:C", memory_bytes=GIB, working_dir="relative/dir"), "absolute"),
    ]:
        with pytest.raises(RequestRejected, match=says):
            validate_spec(bad)


def test_a_task_name_is_refused_for_what_is_wrong_with_it_its_length_or_the_character() -> None:
    # Stranger trial: a 3-character name with a control character was refused as "at most 64 printable characters".
    for name, says in [("x" * 65, "at most 64 characters, got 65"),
                       ("a\x07b", r"only printable characters, got '\\x07'"), ("tab\t", r"got '\\t' in 'tab\\t'")]:
        with pytest.raises(RequestRejected, match=says):
            validate_spec(TaskSpec(target="m:C", memory_bytes=GIB, name=name))
    assert validate_spec(TaskSpec(target="m:C", memory_bytes=GIB, name="ü" * 64)).name == "ü" * 64


# ------------------------------------------------------------------ launch: this node's devices


def _no_gpu() -> int:
    return 0


@pytest.mark.parametrize(
    ("env", "command", "gpus", "cores", "devices", "source"),
    [
        ({}, ["torchrun", "--nnodes", "2", "--nproc-per-node", "2", "train.py"], 0, [0, 1], ["cpu:0", "cpu:1"],
         "torchrun --nproc-per-node"),
        ({}, ["torchrun", "--nproc_per_node=4", "train.py"], 8, [0], [f"cuda:{i}" for i in range(4)],
         "torchrun --nproc-per-node"),
        ({}, ["python", "-m", "torch.distributed.run", "--nproc-per-node", "3", "t.py"], 0, [4, 5],
         ["cpu:4", "cpu:5"], "torchrun --nproc-per-node"),
        ({}, ["torchrun", "--nproc-per-node", "gpu", "t.py"], 2, [0], ["cuda:0", "cuda:1"],
         "torchrun --nproc-per-node gpu"),
        ({"LOCAL_WORLD_SIZE": "2"}, ["python", "t.py"], 0, [0, 1], ["cpu:0", "cpu:1"], "$LOCAL_WORLD_SIZE"),
        ({"SLURM_GPUS_ON_NODE": "4", "SLURM_JOB_NUM_NODES": "8"}, ["sleep", "infinity"], 0, [0],
         [f"cuda:{i}" for i in range(4)], "$SLURM_GPUS_ON_NODE"),
        ({"SLURM_STEP_GPUS": "4,5,6,7"}, ["sleep", "infinity"], 0, [0], [f"cuda:{i}" for i in range(4)],
         "$SLURM_STEP_GPUS"),
        ({"CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b"}, ["python", "t.py"], 0, [0], ["cuda:0", "cuda:1"],
         "$CUDA_VISIBLE_DEVICES"),
        ({"CUDA_VISIBLE_DEVICES": ""}, ["python", "t.py"], 3, [0], ["cuda:0", "cuda:1", "cuda:2"],
         "the GPUs NVML sees"),
    ],
)
def test_launch_finds_this_nodes_devices_from_torchrun_slurm_or_the_gpus(
    env: dict[str, str], command: list[str], gpus: int, cores: list[int], devices: list[str], source: str
) -> None:
    assert local_devices(env, command, lambda: gpus, cores) == (devices, source)


def test_launch_refuses_to_guess_when_nothing_says_how_many_ranks_run_here() -> None:
    with pytest.raises(ConfigError, match="--devices"):
        local_devices({"CUDA_VISIBLE_DEVICES": "-1"}, ["python", "train.py"], _no_gpu, [0, 1])
    assert local_devices({}, ["torchrun", "--nproc-per-node", "2", "t.py"], _no_gpu, [0, 1], kind="cuda")[0] == [
        "cuda:0", "cuda:1"]


def test_more_cpu_ranks_than_cores_warns_that_the_shared_devices_grant_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level("WARNING", logger="freeride._cli.launch"):
        devices, _ = local_devices({}, ["torchrun", "--nproc-per-node", "4", "t.py"], _no_gpu, [0, 1])
    assert devices == ["cpu:0", "cpu:1"]
    assert "4 ranks on 2 CPU cores: ranks share devices, and a device that ranks share grants nothing" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="freeride._cli.launch"):
        local_devices({}, ["torchrun", "--nproc-per-node", "2", "t.py"], _no_gpu, [0, 1])
    assert caplog.text == ""


def test_a_job_spans_nodes_by_torchrun_nnodes_or_slurm() -> None:
    assert spans_nodes({}, ["torchrun", "--nnodes", "4", "t.py"])
    assert spans_nodes({}, ["torchrun", "--nnodes=1:8", "t.py"])
    assert spans_nodes({"SLURM_JOB_NUM_NODES": "2"}, ["sleep", "infinity"])
    assert not spans_nodes({}, ["torchrun", "--nnodes", "1", "t.py"])
    assert not spans_nodes({"SLURM_JOB_NUM_NODES": "1"}, ["python", "t.py"])
