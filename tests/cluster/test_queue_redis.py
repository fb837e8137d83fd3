"""The queue's Redis operations on a real redis-server: atomic claims, leases, fencing, hand-backs,
persistence across a restart, and the CLI's ``--queue`` forms with their exit codes."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from conftest import TESTS_DIR, redis_binary, wait_for
from nodes import node_devices, start_node
from redis_server import RedisServer, remove, start_redis

from freeride._cluster.placement import Capacity
from freeride._cluster.redis_queue import Held, RedisQueue, Renewal
from freeride._cluster.url import parse_queue_url
from freeride._validation import Submission
from freeride.cli import main
from freeride.errors import QueueUnavailable, Unauthenticated
from freeride.messages import TaskSpec

GIB = 2**30


def _queue(url: str) -> RedisQueue:
    q = RedisQueue(parse_queue_url(url))
    q.connect()
    return q


def _sub(name: str = "t", memory: int = GIB, priority: int = 0) -> Submission:
    return Submission(target="sample_tasks:Counter", args_json="{}", memory_bytes=memory, priority=priority,
                      name=name)


def _held(q: RedisQueue, task_id: str) -> Held:
    rec = q.record(task_id)
    assert rec is not None
    return Held(task_id, rec.entry, rec.epoch)


def test_each_task_is_claimed_by_exactly_one_of_many_racing_managers(redis_server: RedisServer) -> None:
    q = _queue(redis_server.url)
    ids = [q.submit(_sub(f"t{i}")) for i in range(40)]
    claimed: list[tuple[str, str]] = []
    lock = threading.Lock()

    def manager(me: str) -> None:
        mine = _queue(redis_server.url)
        try:
            while True:
                waiting = mine.waiting(64).candidates
                if not waiting:
                    return
                for candidate in waiting:
                    if mine.claim(candidate.task_id, me, me, time.time()).status == "claimed":
                        with lock:
                            claimed.append((candidate.task_id, me))
        finally:
            mine.close()

    threads = [threading.Thread(target=manager, args=(f"m{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    counts = Counter(task_id for task_id, _ in claimed)
    assert sorted(counts) == sorted(ids) and set(counts.values()) == {1}
    for task_id, me in claimed:
        record = q.record(task_id)
        assert record is not None and (record.state, record.owner, record.epoch) == ("CLAIMED", me, 1)
    q.close()


def test_the_waiting_room_is_ordered_by_priority_then_submission(redis_server: RedisServer) -> None:
    q = _queue(redis_server.url)
    low = q.submit(_sub("low", priority=-1))
    first = q.submit(_sub("first"))
    urgent = q.submit(_sub("urgent", priority=7))
    second = q.submit(_sub("second"))
    assert [c.task_id for c in q.waiting().candidates] == [urgent, first, second, low]
    q.close()


def test_a_renewed_lease_holds_and_a_silent_holder_loses_its_task_to_the_sweep(redis_server: RedisServer) -> None:
    q = _queue(redis_server.url)
    task_id = q.submit(_sub())
    assert q.claim(task_id, "m1", "n1/cpu:0", time.time()).status == "claimed"
    held = _held(q, task_id)
    lease_ms = 300
    until = time.monotonic() + 3 * lease_ms / 1000
    while time.monotonic() < until:  # renew, then let another manager sweep at once: the lease holds
        assert q.heartbeat("m1", [held], lease_ms) == Renewal([], [], 1)
        assert q.sweep("m2", lease_ms, 1, time.time()).moved == 0
    assert q.record(task_id).owner == "m1"  # type: ignore[union-attr]
    # m1 goes silent: after the lease a sweep returns the task to the waiting room.
    wait_for(lambda: q.sweep("m2", lease_ms, 1, time.time()).moved == 1, 10)
    record = q.record(task_id)
    assert record is not None and (record.state, record.owner) == ("QUEUED", "")
    assert "lease expired" in record.reason and [c.task_id for c in q.waiting().candidates] == [task_id]
    # Fencing: m1 learns it lost the task and none of its writes land.
    assert q.heartbeat("m1", [held], lease_ms) == Renewal([task_id], [], 0)
    assert q.update("m1", [(held, {"progress": "99"})]) == [False]
    assert q.release("m1", held, {}, time.time()) == "lost" and not q.finish("m1", held, {"state": "FINISHED"})
    # Another manager claims it again, with a new epoch.
    again = q.claim(task_id, "m2", "n2/cpu:0", time.time()).record
    assert again is not None and again.epoch == 2 and again.progress == 0.0
    q.close()


def test_hand_back_finish_and_cancel(redis_server: RedisServer) -> None:
    q = _queue(redis_server.url)
    a, b, c = (q.submit(_sub(n)) for n in ("a", "b", "c"))
    q.claim(a, "m1", "n1/cpu:0", time.time())
    held = _held(q, a)
    assert q.update("m1", [(held, {"state": "RUNNING", "progress": "5.0", "checkpoint_step": "4"})]) == [True]
    assert q.release("m1", held, {"reason": "left n1/cpu:0: evict"}, time.time()) == "released"
    record = q.record(a)
    assert record is not None and (record.state, record.progress, record.checkpoint_step) == ("QUEUED", 5.0, 4)
    assert [w.task_id for w in q.waiting().candidates] == [a, b, c]  # it keeps its place: the oldest goes first

    q.claim(b, "m1", "n1/cpu:0", time.time())
    assert q.finish("m1", _held(q, b), {"state": "FINISHED", "reason": "done"})
    assert q.record(b).state == "FINISHED"  # type: ignore[union-attr]
    assert q._r.xlen(q.stream_key) == 2  # a finished task's stream entry is acknowledged and deleted

    assert q.cancel(c) == "CANCELLED" and q.cancel(c) == "CANCELLED"
    q.claim(a, "m2", "n2/cpu:0", time.time())
    assert q.cancel(a) == "REQUESTED"
    assert q.heartbeat("m2", [_held(q, a)], 1000).cancelled == [a]  # its holder learns it at its next renewal
    assert q.cancel("nope-q99") == "MISSING" and q.cancel("../etc") == "MISSING"
    assert [r.task_id for r in q.records(include_finished=False)] == [a]
    q.close()


def test_the_queue_survives_a_redis_kill_and_restart(redis_server: RedisServer) -> None:
    q = _queue(redis_server.url)
    held_id = q.submit(_sub("held"))
    waiting_id = q.submit(_sub("waiting"))
    q.claim(held_id, "m1", "n1/cpu:0", time.time())
    held = _held(q, held_id)
    redis_server.kill()
    with pytest.raises(QueueUnavailable):
        q.records()
    redis_server.start()
    wait_for(lambda: _answers(q), 10)  # the client reconnects by itself
    assert {r.task_id: r.state for r in q.records()} == {held_id: "CLAIMED", waiting_id: "QUEUED"}
    assert q.heartbeat("m1", [held], 1000) == Renewal([], [], 1)  # the lease came back with the data
    assert [c.task_id for c in q.waiting().candidates] == [waiting_id]
    assert q.submit(_sub("after")).endswith("-q3")  # the counter too
    q.close()


def _answers(q: RedisQueue) -> bool:
    try:
        q.connect()
        return True
    except QueueUnavailable:
        return False


# ------------------------------------------------------------------ the CLI


def test_cli_submits_lists_shows_and_cancels_through_the_queue(
    redis_server: RedisServer, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(TESTS_DIR)
    url = redis_server.url
    assert main(["submit", "sample_tasks:Counter", "--queue", url, "--memory", "256MiB", "--name", "tick"]) == 0
    task_id = capsys.readouterr().out.strip()
    assert task_id == "tick-q1"
    assert main(["ls", "--queue", url]) == 0
    table = capsys.readouterr().out
    assert "DEVICE" in table and "tick-q1" in table and "QUEUED" in table and "256.0 MiB" in table
    assert main(["show", task_id, "--queue", url]) == 0
    shown = capsys.readouterr().out
    assert "sample_tasks:Counter" in shown and "overruns:   0 (on its current holder)" in shown
    assert main(["cancel", task_id, "--queue", url]) == 0
    assert "CANCELLED" in capsys.readouterr().out
    assert main(["ls", "--queue", url, "--all", "--json"]) == 0
    assert '"state": "CANCELLED"' in capsys.readouterr().out
    assert main(["show", "nope-q9", "--queue", url]) == 4


def test_cli_validates_a_queued_submission_exactly_as_submit_does(
    redis_server: RedisServer, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(TESTS_DIR)
    code = main(["submit", "sample_tasks:Counter", "--queue", redis_server.url, "--memory", "1MiB",
                 "--name", "x" * 65])
    assert code == 2 and "a task name has at most 64 characters, got 65" in capsys.readouterr().err
    code = main(["submit", "sample_tasks:Counter", "--queue", redis_server.url, "--memory", "1MiB",
                 "--args-json", '{"step_ms": 1e999}'])
    assert code == 2 and "must be standard JSON" in capsys.readouterr().err
    assert _queue(redis_server.url).records() == []  # nothing reached the queue


def test_cli_exit_codes_for_a_bad_url_an_unreachable_queue_and_refused_credentials(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(TESTS_DIR)
    assert main(["ls", "--queue", "http://example.org"]) == 2
    assert main(["ls", "--queue", f"unix://{tmp_path}/nobody.sock"]) == 3
    assert "cannot reach the queue" in capsys.readouterr().err
    server = start_redis(redis_binary(), "--requirepass", "s3cret")
    try:
        assert main(["ls", "--queue", server.url_with("wrong")]) == 5
        assert main(["ls", "--queue", server.url]) == 5  # no password at all
        err = capsys.readouterr().err
        assert "refused the credentials" in err and "s3cret" not in err and "wrong" not in err
        # Stranger trial: a database the server does not have exited 1 ("DB index is out of range"): bad input.
        assert main(["ls", "--queue", server.url_with("s3cret", db=99999)]) == 2
        assert "the queue URL's database 99999 is not one the server" in capsys.readouterr().err
        assert main(["submit", "sample_tasks:Counter", "--queue", server.url_with("s3cret"), "--memory", "1MiB"]) == 0
        assert main(["ls", "--queue", server.url_with("s3cret"), "--json"]) == 0
        assert '"state": "QUEUED"' in capsys.readouterr().out
        with pytest.raises(Unauthenticated):
            _queue(server.url_with("wrong"))
    finally:
        remove(server)


# ------------------------------------------------------------------ a manager's start


def test_a_manager_with_refused_queue_credentials_does_not_start(tmp_path: Path) -> None:
    server = start_redis(redis_binary(), "--requirepass", "s3cret")
    base = [sys.executable, "-m", "freeride.cli", "manager", "--device", node_device(),
            "--endpoint", f"unix:/tmp/fr-refused-{tmp_path.name[-8:]}.sock", "--state-dir", str(tmp_path / "s")]
    try:
        proc = subprocess.run([*base, "--queue", server.url_with("wrong"), "--checkpoint-dir", str(tmp_path / "c")],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 5, proc.stderr
        assert "refused the credentials" in proc.stderr and "wrong" not in proc.stderr
        proc = subprocess.run([*base, "--queue", server.url], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and "--checkpoint-dir" in proc.stderr
        proc = subprocess.run([*base, "--queue", "redis://h/x", "--checkpoint-dir", str(tmp_path / "c")],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and "database" in proc.stderr
    finally:
        remove(server)


def test_a_manager_whose_queue_is_unreachable_serves_its_own_tasks(tmp_path: Path) -> None:
    node = start_node(tmp_path, "alone", node_device(), f"unix://{tmp_path}/no-redis.sock", tmp_path / "ckpt")
    try:
        node.train(free_mib=1500)
        info = node.client.submit(TaskSpec(target="sample_tasks:Counter", args={"step_ms": 1.0},
                                           memory_bytes=2**28, working_dir=str(TESTS_DIR)))
        wait_for(lambda: node.client.get(info.task_id).steps > 10, 30)
        agent = node.manager.agent
        assert agent is not None and not agent.connected and "cannot reach the queue" in agent.last_error
    finally:
        node.stop()


def node_device() -> str:
    return node_devices(1)[0]


def _room(total: int, **kw: Any) -> Capacity:
    return Capacity(budget_bytes=total // 2, longest_bubble_ns=5_000_000, margin_ns=200_000, waiting=0,
                    total_bytes=total, **kw)


def test_managers_announce_their_devices_and_only_live_ones_count(redis_server: RedisServer) -> None:
    q = _queue(redis_server.url)
    now = 1_000_000.0
    assert q.devices(now) == []  # none announced: submit --queue accepts any cap
    q.announce("m1", "n1/cpu:0", _room(24 * GIB), 0, 10_000, now)
    q.announce("m2", "n2/cuda:0", _room(80 * GIB), 0, 10_000, now - 29.0)  # within three leases
    q.announce("m3", "n3/cuda:0", _room(141 * GIB), 0, 10_000, now - 31.0)  # gone for more than three leases
    q.announce("m4", "n4/cuda:1", _room(0), 0, 10_000, now)  # its size unknown
    q._r.hset(q.devices_key, "garbage", b"\xff not json")
    assert sorted(q.devices(now)) == [("n1/cpu:0", 24 * GIB), ("n2/cuda:0", 80 * GIB)]
    q.announce("m1", "n1/cpu:0", _room(24 * GIB), 0, 10_000, now + 2 * 86_400)  # a day on: the others' entries go
    assert set(q._r.hkeys(q.devices_key)) == {b"m1"}
    q.retire("m1")
    assert q._r.hlen(q.devices_key) == 0
    q.close()


def test_a_manager_announces_what_it_holds_and_what_it_could_place_every_field_read_back(
    redis_server: RedisServer,
) -> None:
    q = _queue(redis_server.url)
    now = 1_000_000.0
    room = _room(80 * GIB, draining=True, hosts_stage=False, device_problem="nvml", trainer_paused=True)
    q.announce("m1", "n1/cuda:0", room, 3, 10_000, now)
    others = q.announce("m2", "n2/cuda:0", dataclasses.replace(room, budget_bytes=None), 0, 10_000, now)
    assert [p.me for p in others] == ["m1"]  # the others, as the same read found them
    peers = {p.me: p for p in q.peers(now)}
    assert (peers["m1"].where, peers["m1"].held, peers["m1"].capacity) == ("n1/cuda:0", 3, room)
    assert peers["m2"].capacity == dataclasses.replace(room, budget_bytes=None)
    # An entry whose capacity does not read (another freeride, a hand edit) still counts as a device.
    q._r.hset(q.devices_key, "m3", json.dumps({"where": "n3/cuda:0", "total_bytes": GIB, "lease_ms": 10_000,
                                               "at_unix": now, "capacity": {"budget_bytes": "lots"}}))
    m3 = next(p for p in q.peers(now) if p.me == "m3")
    assert (m3.capacity, m3.held) == (None, 0) and ("n3/cuda:0", GIB) in q.devices(now)
    q.close()
