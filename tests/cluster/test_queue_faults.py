"""The queue under faults, on a real redis-server: records that cannot be read (each kind the issue saw),
a Redis restart between two renewals, and the queue's figures. Nothing lost, nothing run twice.

The claim loop here is the real :class:`~freeride._cluster.agent.QueueAgent` on a real queue, polled one
step at a time, with a stand-in for the manager loop that records what the agent posts (``queue_fakes``) (the whole
manager on the queue is in ``test_cluster_e2e.py``).
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from pathlib import Path

import pytest
from conftest import TESTS_DIR, holds_for, wait_for
from queue_fakes import FakeLoop
from redis_server import RedisServer

from freeride._cluster.agent import QueueAgent, QueueConfig
from freeride._cluster.placement import Capacity
from freeride._cluster.records import SET_ASIDE, QueueNote, QueueView, ReleaseTask
from freeride._cluster.redis_queue import Held, RedisQueue, Renewal
from freeride._cluster.url import parse_queue_url
from freeride._validation import Submission
from freeride.cli import main
from freeride.messages import TaskRecord, TaskSpec

MiB = 2**20
MS = 1_000_000
ROOM = Capacity(budget_bytes=64 * 1024 * MiB, longest_bubble_ns=50 * MS, margin_ns=MS // 5, waiting=0)


def _queue(url: str) -> RedisQueue:
    q = RedisQueue(parse_queue_url(url))
    q.connect()
    return q


def _sub(name: str) -> Submission:
    return Submission(target="sample_tasks:Counter", args_json="{}", memory_bytes=MiB, name=name)


def _agent(url: str, tmp_path: Path, name: str, lease_ms: int = 3000) -> tuple[QueueAgent, FakeLoop]:
    loop = FakeLoop(QueueView(ROOM))  # room for everything
    config = QueueConfig(parse_queue_url(url), tmp_path / "ckpt", lease_ms=lease_ms, poll_ms=50.0)
    agent = QueueAgent(loop, config, "cpu:0", name)
    agent._connect()
    return agent, loop


# ------------------------------------------------------------------ records that cannot be read

#: Each kind of malformed record the issue saw, as a change to a good record's hash: (fields to set, fields
#: to delete, what the reason says).
MALFORMED = {
    "missing-fields": ({}, ["seq", "epoch"], "has no seq field"),
    "memory-not-a-number": ({"memory_bytes": b"lots"}, [], "memory_bytes is not a whole number (lots)"),
    "spec-not-utf8": ({"spec": b'{"target": "\xff\xfe"}'}, [], "spec is not UTF-8"),
    "name-not-utf8": ({"name": b"caf\xe9"}, [], "name is not UTF-8"),
    "placement-not-utf8": ({"step_hint_ms": b"\xff1.0"}, [], "step_hint_ms is not UTF-8"),
    "priority-not-a-number": ({"priority": b"high"}, [], "priority is not a whole number"),
    "newer-schema": ({"schema": b"7"}, [], "written by a newer freeride"),
}


def _break(q: RedisQueue, task_id: str, kind: str) -> None:
    sets, deletes, _ = MALFORMED[kind]
    key = q.task_key(task_id)
    if sets:
        q._r.hset(key, mapping=sets)  # type: ignore[arg-type]
    if deletes:
        q._r.hdel(key, *deletes)


def test_every_kind_of_malformed_record_is_set_aside_with_its_reason_and_the_rest_run_once(
    redis_server: RedisServer, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    q = _queue(redis_server.url)
    # A task whose holder died: it must still be reclaimed while the bad records sit in the queue.
    orphan = q.submit(_sub("orphan"))
    assert q.claim(orphan, "dead", "gone/cpu:0", time.time()).status == "claimed"
    bad = {kind: q.submit(_sub(kind)) for kind in MALFORMED}
    for kind, task_id in bad.items():
        _break(q, task_id, kind)
    q._r.xadd(q.stream_key, {"nothing": "here"})  # a stream entry that names no task
    good = [q.submit(_sub(f"good{i}")) for i in range(3)]  # submitted after them: they must still start

    one, loop_one = _agent(redis_server.url, tmp_path, "n1", lease_ms=300)
    two, loop_two = _agent(redis_server.url, tmp_path, "n2", lease_ms=300)
    expected = {orphan, *good}

    def everything_claimed() -> bool:
        one._pass()
        two._pass()
        return set(loop_one.claimed() + loop_two.claimed()) >= expected

    wait_for(everything_claimed, 30)  # the orphan after its 300 ms lease, the good ones at once
    # The claimed-but-unreadable records are set aside at the poll after their claim; a pass that failed (a
    # heartbeat slower than the socket timeout on a loaded machine) is retried, as the agent's thread does.
    wait_for(one._pass, 10)
    wait_for(two._pass, 10)
    claimed = Counter(loop_one.claimed() + loop_two.claimed())
    assert set(claimed) == expected and set(claimed.values()) == {1}  # nothing run twice, nothing bad run

    records = {r.task_id: r for r in q.records()}
    for kind, task_id in bad.items():  # nothing lost: each is listed, set aside, with why
        record = records[task_id]
        assert record.state == SET_ASIDE and MALFORMED[kind][2] in record.aside, (kind, record.aside)
    [entry] = [r for r in records.values() if r.task_id.startswith("entry:")]
    assert entry.state == SET_ASIDE and "names no task" in entry.aside
    assert q._r.zcard(q.waiting_key) == 0 and q._r.hlen(q.aside_key) == len(bad) + 1
    assert {r.task_id for r in q.records(include_finished=False)} == expected  # live ones only
    assert one._snapshot().set_aside + two._snapshot().set_aside == 2 * (len(bad) + 1)
    # The entry that names no task was set aside by the next submission (its script takes new entries in).
    assert one._snapshot().set_aside_here + two._snapshot().set_aside_here == len(bad)

    # The CLI lists and shows them, with the reason, and exits 0.
    monkeypatch.chdir(TESTS_DIR)
    assert main(["ls", "--queue", redis_server.url, "--all"]) == 0
    table = capsys.readouterr().out
    for task_id in bad.values():
        assert task_id in table
    assert "set aside: its name is not UTF-8 text (caf\\xe9)" in table
    assert main(["ls", "--queue", redis_server.url]) == 0
    assert f"{len(bad) + 1} record(s) set aside because they cannot be read" in capsys.readouterr().out
    assert main(["show", bad["spec-not-utf8"], "--queue", redis_server.url]) == 0
    shown = capsys.readouterr().out
    assert "SET_ASIDE" in shown and "set aside:  its spec is not UTF-8 text" in shown
    assert main(["ls", "--queue", redis_server.url, "--all", "--json"]) == 0
    assert capsys.readouterr().out.count('"state": "SET_ASIDE"') == len(bad) + 1
    # Stranger trial: cancelling a set-aside record printed "junk-q50 SET_ASIDE", which said nothing of the cancel.
    assert main(["cancel", bad["spec-not-utf8"], "--queue", redis_server.url]) == 0
    assert "SET_ASIDE (set aside as unreadable: nothing to cancel" in capsys.readouterr().out
    q.close()


def test_a_record_that_turns_unreadable_while_held_is_set_aside_by_its_holder_and_never_requeued(
    redis_server: RedisServer,
) -> None:
    q = _queue(redis_server.url)
    task_id = q.submit(_sub("held"))
    claim = q.claim(task_id, "m1", "n1/cpu:0", time.time())
    assert claim.held is not None
    q._r.hset(q.task_key(task_id), "priority", "high")  # a hand edit while it runs
    # Handing it back would put a record in the waiting room that no claim can score: it is set aside.
    assert q.release("m1", claim.held, {"reason": "evicted"}, time.time()) == "aside"
    record = q.record(task_id)
    assert record is not None and record.state == SET_ASIDE and "priority" in record.aside
    assert q.waiting().candidates == [] and q.cancel(task_id) == "SET_ASIDE"
    q.close()


def test_a_listing_counts_as_set_aside_only_what_the_queue_set_aside_and_lists_the_rest_in_their_own_state(
    redis_server: RedisServer, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Stranger trial: ``ls --queue`` counted 19 records set aside where ``stats`` counted 13-14; a record corrupted
    # while held was listed SET_ASIDE while its holder ran it to FINISHED; a queued record whose spec was not
    # UTF-8 counted in the depth (1) while ``ls`` showed nothing queued.
    q = _queue(redis_server.url)
    queued, held, huge, aside, fine = (q.submit(_sub(name)) for name in ("queued", "held", "huge", "aside", "fine"))
    q._r.hset(q.task_key(queued), "spec", b'{"target": "\xff"}')  # no manager has claimed it yet
    for task_id in (held, huge):
        assert q.claim(task_id, "m1", "n1/cpu:0", time.time()).status == "claimed"
    q._r.hset(q.task_key(held), "failure", "{broken")  # a hand edit while it runs
    q._r.hset(q.task_key(huge), "reason", "x" * (2 * MiB))
    assert q.set_aside(aside, "a reason of the queue's", time.time())
    # Verifier: two managers that met the same record both logged that they set it aside; the second is told no.
    assert not q.set_aside(aside, "another manager's reason", time.time())

    rows = {r.task_id: r for r in q.records()}
    assert (rows[queued].state, rows[held].state, rows[huge].state) == ("QUEUED", "CLAIMED", "CLAIMED")
    assert "spec is not UTF-8" in rows[queued].unreadable and "failure is not a failure record" in rows[held].unreadable
    assert "its record takes" in rows[huge].unreadable
    assert (rows[aside].state, rows[aside].aside) == (SET_ASIDE, "a reason of the queue's")
    assert not any(rows[i].aside for i in (queued, held, huge)) and not rows[fine].unreadable
    peek = q.waiting()
    assert peek.set_aside == sum(1 for r in rows.values() if r.aside) == 1  # the manager's figure: ``stats``
    assert peek.depth == sum(1 for r in rows.values() if r.state == "QUEUED") == 2

    monkeypatch.chdir(TESTS_DIR)
    assert main(["ls", "--queue", redis_server.url]) == 0
    out = capsys.readouterr().out
    assert f"{queued}  queued  QUEUED" in out and "cannot be read: its spec is not UTF-8" in out
    assert "1 record(s) set aside because they cannot be read" in out
    assert "3 record(s) cannot be read, not set aside by the queue; each is listed with the reason" in out
    assert main(["show", held, "--queue", redis_server.url]) == 0
    out = capsys.readouterr().out
    assert "CLAIMED" in out and "unreadable: its failure is not a failure record (the queue has not set it" in out
    q.close()


class _Serving:
    """A queue agent on a loop stand-in that holds what the agent claimed, reports those tasks parked, and
    lets go of a task the agent asks it to release (as the manager loop does: a ``left`` note)."""

    def __init__(self, url: str, tmp_path: Path, name: str, lease_ms: int) -> None:
        self.loop = FakeLoop(QueueView(ROOM))
        config = QueueConfig(parse_queue_url(url), tmp_path / "ckpt", lease_ms=lease_ms, poll_ms=50.0, spread_ms=0.0)
        self.agent = QueueAgent(self.loop, config, "cpu:0", name)
        self.agent._connect()
        self.released = 0

    @property
    def holds(self) -> set[str]:
        return set(self.loop.claimed()) - {p.task_id for p in self.loop.posted if isinstance(p, ReleaseTask)}

    def poll(self) -> None:
        self.agent._pass()
        for release in [p for p in self.loop.posted if isinstance(p, ReleaseTask)][self.released:]:
            record = TaskRecord(release.task_id, TaskSpec(target="sample_tasks:Counter", memory_bytes=MiB), "EVICTED")
            self.loop.queue_notes(QueueNote("left", record, release.reason))
            self.released += 1
        self.loop.view = QueueView(ROOM, tuple(
            TaskRecord(t, TaskSpec(target="sample_tasks:Counter", memory_bytes=MiB), "PARKED") for t in self.holds))


def test_a_manager_holding_more_hands_tasks_over_to_one_that_joined_after_the_queue_emptied(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    # Stranger trial: queue tasks claimed by one manager were never rebalanced once held, while the device of a
    # manager that started later idled.
    q = _queue(redis_server.url)
    ids = {q.submit(_sub(f"t{i}")) for i in range(4)}
    one = _Serving(redis_server.url, tmp_path, "n1", lease_ms=300)
    wait_for(lambda: one.poll() or one.holds == ids, 10)
    two = _Serving(redis_server.url, tmp_path, "n2", lease_ms=300)
    wait_for(lambda: one.poll() or two.poll() or (len(one.holds), len(two.holds)) == (2, 2), 20)
    assert one.holds | two.holds == ids and not one.holds & two.holds
    # Balanced within one task: nothing more moves.
    holds_for(lambda: one.poll() or two.poll() or (len(one.holds), len(two.holds)) == (2, 2), 1.0, "balanced")
    assert one.agent._snapshot().handed_back == 2 and q._r.zcard(q.waiting_key) == 0
    q.close()


def _sent(q: RedisQueue) -> int:
    """Bytes the server has sent its clients so far (every reply, to every client)."""
    return int(q._r.info("stats")["total_net_output_bytes"])


def test_a_record_over_the_size_bound_is_set_aside_unread_and_no_poll_listing_or_show_sends_it(
    redis_server: RedisServer, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Stranger trial: one record with a 200 MiB spec made every listing take seconds and 1.1 GB, and the managers'
    # polls time out; set aside, it was still fetched whole by every listing.
    q = _queue(redis_server.url)
    huge = q.submit(_sub("huge"))
    q._r.hset(q.task_key(huge), "spec", b"x" * (8 * MiB))
    good = q.submit(_sub("good"))
    before = _sent(q)
    agent, loop = _agent(redis_server.url, tmp_path, "n1")
    wait_for(lambda: agent._pass() and good in loop.claimed(), 20)
    wait_for(agent._pass, 10)
    assert loop.claimed() == [good]
    record = q.record(huge)
    assert record is not None and record.state == SET_ASIDE
    assert f"its record takes {q._r.memory_usage(q.task_key(huge), samples=0)} bytes, more than the 1048576" \
        in record.aside
    assert q._r.zcard(q.waiting_key) == 0 and agent._snapshot().set_aside_here == 1
    monkeypatch.chdir(TESTS_DIR)
    assert main(["ls", "--queue", redis_server.url, "--all"]) == 0
    assert huge in capsys.readouterr().out
    assert main(["show", huge, "--queue", redis_server.url]) == 0
    assert "its record takes" in capsys.readouterr().out
    assert _sent(q) - before < MiB  # nothing of the 8 MiB left the server
    assert q._r.hstrlen(q.task_key(huge), "spec") == 8 * MiB  # nothing lost: the record is kept as it was
    q.close()


def test_members_longer_than_any_task_id_are_taken_out_of_the_queues_sets_unsent_and_recorded(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    # Stranger trial: a 200 MiB member of the waiting room was fetched by every manager's poll.
    q = _queue(redis_server.url)
    q._r.zadd(q.waiting_key, {b"w" * (8 * MiB): 0})
    q._r.zadd(q.index_key, {b"i" * (8 * MiB): 0})
    q._r.xadd(q.stream_key, {"task": b"t" * (8 * MiB)})
    before = _sent(q)
    good = q.submit(_sub("good"))  # its script takes the long entry in, and sets it aside
    agent, loop = _agent(redis_server.url, tmp_path, "n1")
    wait_for(lambda: agent._pass() and good in loop.claimed(), 20)
    assert q._r.zcard(q.index_key) == 1  # swept before any listing: only the good task's id is left
    listed = q.records()
    assert _sent(q) - before < MiB
    aside = {r.task_id: r.aside for r in listed if r.state == SET_ASIDE}
    assert len(aside) == 3, aside
    assert aside["member:waiting:" + "w" * 24 + "..."].startswith(f"the waiting room held a member of {8 * MiB} bytes")
    # The index, which no poll reads, is tidied by the sweep (one manager per half lease), before any listing.
    assert aside["member:index:" + "i" * 24 + "..."].startswith(f"the index held a member of {8 * MiB} bytes")
    [entry] = [why for name, why in aside.items() if name.startswith("entry:")]
    assert "names no task" in entry
    assert q._r.zrange(q.waiting_key, 0, -1) == [] and q._r.zrange(q.index_key, 0, -1) == [good.encode()]
    assert q._r.xlen(q.stream_key) == 1  # the good task's entry only
    q.close()


# ------------------------------------------------------------------ a Redis restart


def test_a_redis_restart_between_two_renewals_takes_no_task_from_its_live_holder(redis_server: RedisServer) -> None:
    lease_ms = 1000
    q = _queue(redis_server.url)
    task_id = q.submit(_sub("held"))
    claim = q.claim(task_id, "m1", "n1/cpu:0", time.time())
    assert claim.held is not None
    held: Held = claim.held
    assert q.heartbeat("m1", [held], lease_ms) == Renewal([], [], 1)  # the first renewal
    renewed_at = time.monotonic()
    redis_server.kill()
    # Down for longer than a lease: on its clock the pending entry's idle time now exceeds the lease, and a
    # sweep that trusted it alone would take the task at once (as the issue saw: 7 tasks taken 5.3 s later).
    wait_for(lambda: time.monotonic() - renewed_at > 2 * lease_ms / 1000, 10)
    redis_server.start()
    wait_for(lambda: _answers(q), 10)
    assert q._r.xpending_range(q.stream_key, "managers", "-", "+", 10)[0]["time_since_delivered"] > lease_ms

    other = _queue(redis_server.url)
    first = other.sweep("m2", lease_ms, 1, time.time())
    assert (first.status, first.moved, first.fresh) == ("grace", 0, True) and 0 < first.grace_ms <= lease_ms
    # Sweeps go on all through the grace and find nothing to take; the holder renews within it.
    holds_for(lambda: other.sweep("m2", lease_ms, 1, time.time()).moved == 0, lease_ms / 10_000, "no sweep took it")
    assert q.heartbeat("m1", [held], lease_ms) == Renewal([], [], 1)  # the second renewal: still its holder
    wait_for(lambda: other.sweep("m2", lease_ms, 1, time.time()).status == "swept", 10)
    record = q.record(task_id)
    assert record is not None and (record.owner, record.state, record.epoch) == ("m1", "CLAIMED", 1)

    # A holder that does not renew after the restart loses the task once the grace is over: nothing is lost.
    wait_for(lambda: other.sweep("m2", lease_ms, 1, time.time()).moved == 1, 10)
    record = q.record(task_id)
    assert record is not None and record.state == "QUEUED" and record.restarts == 1
    assert q.heartbeat("m1", [held], lease_ms).lost == [task_id]
    q.close()
    other.close()


def test_an_agent_counts_the_queues_figures_across_a_restart(redis_server: RedisServer, tmp_path: Path) -> None:
    q = _queue(redis_server.url)
    ids = [q.submit(_sub(f"t{i}")) for i in range(2)]
    agent, loop = _agent(redis_server.url, tmp_path, "n1", lease_ms=600)
    wait_for(lambda: agent._pass() and set(loop.claimed()) == set(ids), 20)
    agent._next_heartbeat = 0.0
    wait_for(agent._pass, 10)
    redis_server.restart()
    wait_for(lambda: _answers(q), 10)
    agent._connect()  # as the agent's thread does after the failed poll
    agent._next_heartbeat = 0.0
    # The sweeper lock taken before the restart may still be held (it was persisted): the grace is seen by
    # the first sweep that gets it, well within the lease.
    wait_for(lambda: agent._pass() and agent._snapshot().graces >= 1, 10)
    stats = agent._snapshot()
    assert (stats.claims, stats.held, stats.lost, stats.depth) == (2, 2, 0, 0)
    assert stats.renewals >= 4 and stats.graces >= 1 and stats.connected
    q.close()


def _answers(q: RedisQueue) -> bool:
    try:
        q.connect()
        return True
    except Exception:  # noqa: BLE001 - not up yet
        return False


def test_an_agent_says_at_the_default_level_that_the_queue_is_back(
    redis_server: RedisServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Stranger trial: the log at the default level had "queue unavailable: ... refused.; local ..." and never the
    # recovery (an INFO line).
    from freeride.errors import FreerideError

    agent, _loop = _agent(redis_server.url, tmp_path, "n1", lease_ms=600)
    wait_for(agent._pass, 10)
    redis_server.kill()
    with caplog.at_level(logging.WARNING, logger="freeride._cluster.agent"):
        with pytest.raises(FreerideError) as info:
            agent._next_heartbeat = 0.0
            agent._poll()
        agent._disconnected(info.value)  # as the agent's thread does with a failed poll
        redis_server.start()
        wait_for(lambda: _answers(_queue(redis_server.url)), 10)
        agent._connect()
    lines = [r.getMessage() for r in caplog.records]
    assert any("queue unavailable: " in line and ".;" not in line for line in lines), lines
    assert any("connected to the queue at" in line and "(again, after 1 failed attempt(s))" in line
               for line in lines), lines


def test_a_launch_whose_queue_was_unreachable_says_so_in_its_summary(tmp_path: Path) -> None:
    # Stranger trial: `launch --queue redis://localhost:1/0` ran and exited 0 with nothing on the console: the
    # unreachable queue was in the manager's log only.
    from conftest import cpu_devices

    from freeride._cli.launch import ManagedManager, summary_lines
    from freeride._manager.daemon import Manager
    from freeride._wire.client import ControlClient
    from freeride.endpoints import Endpoint

    class Running:
        def poll(self) -> None:
            return None

    device = cpu_devices(1)[0]
    endpoint = Endpoint("unix", f"/tmp/fr-unreachable-queue-{os.getpid()}.sock")
    config = QueueConfig(parse_queue_url("redis://127.0.0.1:1/0"), tmp_path / "ckpt", poll_ms=50.0)
    manager = Manager(device, endpoint=endpoint, state_dir=tmp_path / "state", queue=config)
    manager.start()
    try:
        with ControlClient(endpoint) as client:
            wait_for(lambda: getattr(client.stats().queue, "errors", 0) > 0, what="a failed queue poll")
        lines = summary_lines([ManagedManager(device, endpoint, Running(), None)])  # type: ignore[arg-type]
    finally:
        manager.stop()
    assert len(lines) == 2 and "the cluster queue was unreachable at the end" in lines[1], lines
