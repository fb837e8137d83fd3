"""The queue agent's decisions on plain data: a fake loop and a fake queue, one poll at a time (no thread,
no Redis). The real Redis behaviour is in ``tests/cluster``."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from conftest import wait_for
from queue_fakes import ROOM, FakeLoop

from freeride._cluster.agent import QueueAgent, QueueConfig
from freeride._cluster.placement import Candidate, Capacity
from freeride._cluster.records import CancelTask, ClaimedTask, ClusterRecord, QueueNote, QueueView, ReleaseTask
from freeride._cluster.redis_queue import Claim, Held, Peek, Peer, Renewal, Sweep
from freeride._cluster.url import parse_queue_url
from freeride._validation import Submission
from freeride.errors import QueueUnavailable
from freeride.messages import TaskProgress, TaskRecord, TaskSpec

MiB = 2**20
MS = 1_000_000


@dataclass
class FakeQueue:
    """Records the agent's calls; answers as a queue with the given waiting tasks would."""

    waiting_tasks: list[Candidate] = field(default_factory=list)
    records: dict[str, ClusterRecord] = field(default_factory=dict)
    lost: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    #: Waiting ids whose placement fields cannot be read (as ``waiting`` reports them), and claimed ids whose
    #: whole record cannot be.
    unreadable: list[tuple[bytes, str]] = field(default_factory=list)
    unreadable_claims: dict[str, str] = field(default_factory=dict)
    calls: list[tuple[str, Any]] = field(default_factory=list)
    down: bool = False
    #: What the sweeps answer, in turn (then plain ``swept``).
    sweeps: list[Sweep] = field(default_factory=list)
    #: The managers the queue's devices hash lists (``peers``).
    peer_list: list[Peer] = field(default_factory=list)

    def _call(self, name: str, arg: Any = None) -> None:
        if self.down:
            raise QueueUnavailable("cannot reach the queue at unix:///nowhere")
        self.calls.append((name, arg))

    def connect(self) -> None:
        self._call("connect")

    def announce(self, me: str, where: str, capacity: Capacity, held: int, lease_ms: int,
                 now_unix: float) -> list[Peer]:
        self._call("announce", (where, capacity.total_bytes, held))
        return list(self.peer_list)

    def peers(self, now_unix: float) -> list[Peer]:
        self._call("peers")
        return list(self.peer_list)

    def waiting(self, limit: int) -> Peek:
        self._call("waiting")
        return Peek(list(self.waiting_tasks), list(self.unreadable), len(self.waiting_tasks), 0)

    def claim(self, task_id: str, me: str, device: str, now: float) -> Claim:
        self._call("claim", task_id)
        self.waiting_tasks = [c for c in self.waiting_tasks if c.task_id != task_id]
        held = Held(task_id, "1-0", 1)
        if task_id in self.unreadable_claims:
            return Claim("unreadable", held=held, reason=self.unreadable_claims[task_id])
        record = self.records.get(task_id)
        return Claim("claimed", record, held) if record is not None else Claim("gone")

    def set_aside(self, task_id: str | bytes, reason: str, now: float, me: str = "", held: Held | None = None) -> bool:
        self._call("set_aside", (task_id, reason, held is not None))
        self.unreadable = [u for u in self.unreadable if u[0] != task_id]
        return True

    def heartbeat(self, me: str, held: list[Held], lease_ms: int) -> Renewal:
        self._call("heartbeat", sorted(h.task_id for h in held))
        lost = [t for t in self.lost if any(h.task_id == t for h in held)]
        return Renewal(lost, list(self.cancelled), len(held) - len(lost))

    def update(self, me: str, writes: list[tuple[Held, dict[str, str]]]) -> list[bool]:
        self._call("update", [h.task_id for h, _ in writes])
        return [h.task_id not in self.lost for h, _ in writes]

    def finish(self, me: str, held: Held, fields: dict[str, str]) -> bool:
        self._call("finish", (held.task_id, fields["state"], fields.get("failure", "")))
        return True

    def release(self, me: str, held: Held, fields: dict[str, str], now: float) -> str:
        self._call("release", (held.task_id, fields["reason"]))
        return "released"

    def sweep(self, me: str, lease_ms: int, every_ms: int, now: float) -> Sweep:
        self._call("sweep")
        return self.sweeps.pop(0) if self.sweeps else Sweep("swept")

    def retire(self, me: str) -> bool:
        return True

    def close(self) -> None:
        pass


def _record(task_id: str, memory_mib: int = 100, **sub: Any) -> ClusterRecord:
    base: dict[str, Any] = {"target": "m:C", "args_json": "{}", "memory_bytes": memory_mib * MiB}
    base.update(sub)
    return ClusterRecord(task_id, Submission(**base), seq=1, state="CLAIMED", owner="me", epoch=1, entry="1-0",
                         figures=TaskProgress(checkpoint_step=5, progress=6.0, restarts=1, step_p95_ms=2.5))


def _status(task_id: str, state: str = "PARKED") -> TaskRecord:
    figures = TaskProgress(steps=10, progress=10.0, checkpoint_step=8, step_p95_ms=1.0, harvested_s=0.1)
    return TaskRecord(task_id, TaskSpec(target="m:C"), state, figures, f"/ck/{task_id}/ckpt-8.pt")


def _agent(queue: FakeQueue, loop: FakeLoop, **kw: Any) -> QueueAgent:
    options: dict[str, Any] = {"lease_ms": 900, "poll_ms": 50.0, "spread_ms": 0.0}
    options.update(kw)
    config = QueueConfig(parse_queue_url("unix:///nowhere/redis.sock"), Path("/ckpt"), **options)
    agent = QueueAgent(loop, config, "cpu:0", "n1", queue_factory=lambda url: queue)
    agent._connect()
    return agent


def _names(queue: FakeQueue) -> list[str]:
    return [name for name, _ in queue.calls]


def test_it_claims_what_fits_and_posts_it_to_the_loop_with_its_record() -> None:
    queue = FakeQueue(waiting_tasks=[Candidate("big-q1", 4096 * MiB, 5, 1), Candidate("ok-q2", 100 * MiB, 0, 2)],
                      records={"ok-q2": _record("ok-q2")})
    loop = FakeLoop()
    agent = _agent(queue, loop)
    agent._poll()
    claims = [c for c in loop.posted if isinstance(c, ClaimedTask)]
    assert [c.task_id for c in claims] == ["ok-q2"]  # the urgent one does not fit: never claimed
    claimed = claims[0].record
    # The record names no checkpoint file (its step alone cannot be resumed from): the task starts afresh.
    assert (claimed.checkpoint_step, claimed.restarts, claimed.step_p95_ms, claimed.state) == (-1, 1, 2.5, "CLAIMED")
    assert ("claim", "big-q1") not in queue.calls


def test_after_a_claim_it_leaves_the_next_task_to_managers_holding_fewer_until_its_spread_has_passed() -> None:
    # A stranger's two queue managers: the first to see a bubble claimed all four tasks, the other device none.
    queue = FakeQueue(waiting_tasks=[Candidate("a-q1", MiB, 0, 1), Candidate("b-q2", MiB, 0, 2)],
                      records={"a-q1": _record("a-q1"), "b-q2": _record("b-q2")})
    loop = FakeLoop()
    agent = _agent(queue, loop, spread_ms=60_000.0)
    agent._poll()
    agent._poll()
    assert [c.task_id for c in loop.posted if isinstance(c, ClaimedTask)] == ["a-q1"]
    assert "waiting" in _names(queue)  # it still peeks: the depth, and setting aside what cannot be read
    agent._claimed_at -= 60.0  # a spread later (one task held)
    agent._poll()
    assert [c.task_id for c in loop.posted if isinstance(c, ClaimedTask)] == ["a-q1", "b-q2"]


def test_a_manager_whose_tasks_all_ended_claims_at_once() -> None:
    queue = FakeQueue(waiting_tasks=[Candidate("a-q1", MiB, 0, 1)], records={"a-q1": _record("a-q1")})
    loop = FakeLoop()
    agent = _agent(queue, loop, spread_ms=60_000.0)
    agent._poll()
    loop.queue_notes(QueueNote("ended", _status("a-q1", "FINISHED"), "done"))
    queue.waiting_tasks = [Candidate("b-q2", MiB, 0, 2)]
    queue.records["b-q2"] = _record("b-q2")
    agent._poll()
    assert [c.task_id for c in loop.posted if isinstance(c, ClaimedTask)] == ["a-q1", "b-q2"]


def test_it_claims_nothing_while_a_task_here_waits_for_memory() -> None:
    queue = FakeQueue(waiting_tasks=[Candidate("ok-q2", 100 * MiB, 0, 2)])
    loop = FakeLoop(QueueView(Capacity(1024 * MiB, 50 * MS, 0, waiting=1)))
    _agent(queue, loop)._poll()
    # It still peeks (the queue's depth, and setting aside what cannot be read), but takes nothing.
    assert "claim" not in _names(queue) and "waiting" in _names(queue)


def test_a_spec_that_does_not_validate_fails_in_the_queue_and_never_reaches_the_loop() -> None:
    queue = FakeQueue(waiting_tasks=[Candidate("bad-q1", MiB, 0, 1)],
                      records={"bad-q1": _record("bad-q1", args_json='{"x": NaN}')})
    loop = FakeLoop()
    agent = _agent(queue, loop)
    agent._poll()
    agent._poll()  # the failure is written at the next poll's first step
    assert not [p for p in loop.posted if isinstance(p, ClaimedTask)]
    [(task_id, state, failure)] = [arg for name, arg in queue.calls if name == "finish"]
    assert (task_id, state, json.loads(failure)["kind"]) == ("bad-q1", "FAILED", "INVALID")


def test_notes_from_the_loop_become_an_end_or_a_hand_back() -> None:
    queue = FakeQueue(waiting_tasks=[Candidate("a-q1", MiB, 0, 1), Candidate("b-q2", MiB, 0, 2)],
                      records={"a-q1": _record("a-q1"), "b-q2": _record("b-q2")})
    loop = FakeLoop()
    agent = _agent(queue, loop)
    agent._poll()
    assert {c.task_id for c in loop.posted if isinstance(c, ClaimedTask)} == {"a-q1", "b-q2"}
    loop.queue_notes(QueueNote("ended", _status("a-q1", "FINISHED"), "done"))
    loop.queue_notes(QueueNote("left", _status("b-q2", "EVICTED"), "evict"))
    queue.calls.clear()
    agent._poll()
    assert ("finish", ("a-q1", "FINISHED", "")) in queue.calls
    assert ("release", ("b-q2", "left n1/cpu:0: evict")) in queue.calls
    assert agent._held == {}


def test_a_lost_lease_kills_the_copy_here_and_a_queue_cancel_cancels_it() -> None:
    queue = FakeQueue(waiting_tasks=[Candidate("a-q1", MiB, 0, 1), Candidate("b-q2", MiB, 0, 2)],
                      records={"a-q1": _record("a-q1"), "b-q2": _record("b-q2")})
    loop = FakeLoop()
    agent = _agent(queue, loop)
    agent._poll()
    queue.lost, queue.cancelled = ["a-q1"], ["b-q2"]
    agent._next_heartbeat = 0.0
    loop.view = QueueView(ROOM, (_status("a-q1"), _status("b-q2")))
    agent._poll()
    assert ReleaseTask("a-q1", "lease lost to another manager", checkpoint=False) in loop.posted
    assert CancelTask("b-q2") in loop.posted


def test_a_claimed_task_still_waiting_for_memory_is_handed_back() -> None:
    queue = FakeQueue(waiting_tasks=[Candidate("a-q1", MiB, 0, 1)], records={"a-q1": _record("a-q1")})
    loop = FakeLoop()
    agent = _agent(queue, loop, hold_ms=0.001)
    agent._poll()
    loop.view = QueueView(Capacity(0, 50 * MS, 0, waiting=1), (_status("a-q1", "SUBMITTED"),))
    agent._poll()  # first seen waiting
    agent._poll()  # still waiting after hold_ms
    assert ReleaseTask("a-q1", "waited for memory here", checkpoint=True) in loop.posted


def _holding(queue: FakeQueue, loop: FakeLoop, count: int) -> QueueAgent:
    """An agent that claimed ``count`` tasks (``t1-q1`` ...), the loop reporting them parked; nothing queued."""
    ids = [f"t{i}-q{i}" for i in range(1, count + 1)]
    queue.waiting_tasks = [Candidate(t, 100 * MiB, 0, i) for i, t in enumerate(ids, 1)]
    queue.records = {t: _record(t) for t in ids}
    agent = _agent(queue, loop)
    agent._poll()
    assert loop.claimed() == ids
    spec = TaskSpec(target="m:C", memory_bytes=100 * MiB)
    loop.view = QueueView(ROOM, tuple(dataclasses.replace(_status(t), seq=i, spec=spec) for i, t in enumerate(ids, 1)))
    agent._depth = (0, 0)
    agent._next_heartbeat = 0.0
    return agent


def _peer(held: int, capacity: Capacity | None = ROOM) -> Peer:
    return Peer("n2/cpu:1/7-abc", "n2/cpu:1", 64 * 1024 * MiB, time.time(), 30.0, held, capacity)


def _handed_over(loop: FakeLoop) -> list[ReleaseTask]:
    return [p for p in loop.posted if isinstance(p, ReleaseTask) and p.reason.startswith("handed over")]


def test_with_nothing_queued_it_hands_one_task_over_to_a_manager_holding_two_fewer_and_does_not_claim_it_back(
) -> None:
    # Stranger trial: queue tasks claimed by one manager stayed there, run in turn, while the device of a manager
    # that joined after the queue emptied idled.
    queue, loop = FakeQueue(peer_list=[_peer(held=0)]), FakeLoop()
    agent = _holding(queue, loop, 3)
    agent._poll()
    assert _handed_over(loop) == [ReleaseTask("t3-q3", "handed over to n2/cpu:1, which held fewer tasks",
                                              checkpoint=True)]  # the newest submission: claimed last
    agent._next_heartbeat = 0.0
    agent._poll()
    assert len(_handed_over(loop)) == 1  # one per lease
    loop.queue_notes(QueueNote("left", _status("t3-q3", "EVICTED"), "handed over"))
    queue.waiting_tasks = [Candidate("t3-q3", 100 * MiB, 0, 3)]  # back in the queue: the other manager's to take
    queue.calls.clear()
    agent._poll()
    assert ("release", ("t3-q3", "left n1/cpu:0: handed over")) in queue.calls
    assert not any(name == "claim" for name, _ in queue.calls)


def test_a_manager_that_did_not_take_a_task_handed_over_for_it_is_handed_no_other_for_a_while() -> None:
    queue, loop = FakeQueue(peer_list=[_peer(held=0)]), FakeLoop()
    agent = _holding(queue, loop, 3)
    agent._poll()
    assert [r.task_id for r in _handed_over(loop)] == ["t3-q3"]
    loop.queue_notes(QueueNote("left", _status("t3-q3", "EVICTED"), "handed over"))
    loop.view = QueueView(ROOM, loop.view.tasks[:2])
    agent._poll()
    # Nobody took it within the leases it was left for: this manager claims it back...
    agent._handed_over.clear()
    agent._handed_over_at = -math.inf
    queue.waiting_tasks, queue.records["t3-q3"] = [Candidate("t3-q3", 100 * MiB, 0, 3)], _record("t3-q3")
    agent._poll()
    assert loop.claimed().count("t3-q3") == 2
    # ...and does not hand the same manager another: a task must not shuttle between the two.
    agent._handed_over_at = -math.inf
    agent._next_heartbeat = 0.0
    agent._poll()
    assert len(_handed_over(loop)) == 1


@pytest.mark.parametrize(("peer", "depth", "why"), [
    (_peer(held=1), 0, "holds only one fewer"),
    (_peer(held=0, capacity=None), 0, "did not say what it can place (an older freeride)"),
    (_peer(held=0, capacity=dataclasses.replace(ROOM, budget_bytes=10 * MiB)), 0, "has no memory for it"),
    (_peer(held=0, capacity=dataclasses.replace(ROOM, trainer_paused=True)), 0, "its trainer makes no bubbles"),
    (_peer(held=0), 1, "a task waits in the queue: the idle manager takes that one"),
])
def test_it_hands_nothing_over_to_a_manager_that_could_not_use_it(peer: Peer, depth: int, why: str) -> None:
    queue, loop = FakeQueue(peer_list=[peer]), FakeLoop()
    agent = _holding(queue, loop, 2)
    agent._depth = (depth, 0)
    queue.waiting_tasks = [Candidate("other-q9", 100 * MiB, 0, 9)] if depth else []
    agent._poll()
    assert _handed_over(loop) == [], why


def test_an_unreachable_queue_never_raises_out_of_the_agent() -> None:
    queue = FakeQueue(down=True)
    loop = FakeLoop()
    config = QueueConfig(parse_queue_url("unix:///nowhere/redis.sock"), Path("/ckpt"), lease_ms=300, poll_ms=10.0,
                         backoff_max_ms=20.0, flush_timeout_ms=50.0)
    agent = QueueAgent(loop, config, "cpu:0", "n1", queue_factory=lambda url: queue)
    agent.check_credentials()  # an outage at start is logged, not raised
    agent.start()
    wait_for(lambda: agent.counters["errors"] >= 3, 10)
    assert not agent.connected and "cannot reach the queue" in agent.last_error
    agent.close()
    assert loop.posted == []


def test_a_pass_whose_poll_fails_midway_is_counted_and_the_next_pass_reconnects_and_claims() -> None:
    # A heartbeat slower than the socket timeout (a loaded machine) raised out of a test that polled by hand;
    # the thread's pass counts it and goes on, as this does.
    queue = FakeQueue()
    loop = FakeLoop()
    agent = _agent(queue, loop)
    assert agent._pass()
    queue.down = True
    assert not agent._pass()
    assert agent.counters["errors"] == 1 and not agent.connected and "cannot reach" in agent.last_error
    queue.down = False
    queue.waiting_tasks.append(Candidate("t1-q1", MiB, 0, 1))
    queue.records["t1-q1"] = _record("t1-q1")
    assert agent._pass() and agent.connected
    assert loop.claimed() == ["t1-q1"] and agent.counters["errors"] == 1


def test_unreadable_records_are_set_aside_and_the_claim_loop_goes_on_to_the_next() -> None:
    queue = FakeQueue(waiting_tasks=[Candidate("bad-q1", MiB, 0, 1), Candidate("ok-q3", MiB, 0, 3)],
                      records={"ok-q3": _record("ok-q3")},
                      unreadable=[(b"\xff-q2", "the id \\xff-q2 is not UTF-8 text")],
                      unreadable_claims={"bad-q1": "its memory_bytes is not a whole number (lots)"})
    loop = FakeLoop()
    agent = _agent(queue, loop)
    agent._poll()
    assert [c.task_id for c in loop.posted if isinstance(c, ClaimedTask)] == ["ok-q3"]
    assert ("set_aside", (b"\xff-q2", "the id \\xff-q2 is not UTF-8 text", False)) in queue.calls
    agent._poll()  # the claimed-but-unreadable one is set aside as its holder, at the next write step
    assert ("set_aside", ("bad-q1", "its memory_bytes is not a whole number (lots)", True)) in queue.calls
    assert "bad-q1" not in agent._held and agent._snapshot().set_aside_here == 2


def test_the_agents_figures_count_claims_renewals_reclaims_and_graces() -> None:
    queue = FakeQueue(waiting_tasks=[Candidate("a-q1", MiB, 0, 1)], records={"a-q1": _record("a-q1")},
                      sweeps=[Sweep("grace", grace_ms=900, fresh=True), Sweep("swept", moved=2)])
    loop = FakeLoop()
    agent = _agent(queue, loop)
    assert loop.queue_stats == agent.stats
    agent._poll()
    agent._next_heartbeat = 0.0
    agent._poll()
    stats = agent._snapshot()
    assert (stats.claims, stats.held, stats.renewals, stats.reclaims, stats.graces) == (1, 1, 1, 2, 1)
    assert stats.connected and stats.lease_ms == 900


def test_a_claimed_tasks_steps_go_back_to_the_checkpoint_it_resumes_from() -> None:
    # Stranger trial: a reclaimed task showed its last holder's 44 steps, then 43 once its new holder had resumed
    # from its checkpoint at step 35 and stepped on.
    from freeride._cluster.agent import resumed_figures

    last = TaskProgress(steps=44, progress=44.0, progress_unit="steps", restarts=1, checkpoint_step=35)
    assert resumed_figures(last, 35) == dataclasses.replace(last, steps=35, progress=35.0)
    assert resumed_figures(last, -1) == dataclasses.replace(last, steps=0, progress=0.0, checkpoint_step=-1)
    samples = dataclasses.replace(last, progress=704.0, progress_unit="samples")
    assert resumed_figures(samples, 35) == dataclasses.replace(samples, steps=35)  # its own unit: kept until told
    assert resumed_figures(last, 44) == dataclasses.replace(last, checkpoint_step=44)  # a newer file of its holder
