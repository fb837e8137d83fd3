"""Several managers on ``cpu:N`` standing in for the nodes of a job, joined to a real redis-server:
placement, a node killed with SIGKILL, a Redis restart, a layout change, the job's end."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import TESTS_DIR, now_ns, read_steps, wait_for
from nodes import (
    MiB,
    Node,
    Queue,
    Trainer,
    kill_9,
    node_devices,
    socket_for,
    start_daemon_node,
    start_node,
)
from redis_server import RedisServer

from freeride._cli import cluster
from freeride._validation import submission_of
from freeride.cli import main
from freeride.endpoints import Endpoint
from freeride.errors import ConfigError
from freeride.messages import TaskSpec, TrainerLayout

pytestmark = pytest.mark.e2e


def _counter(name: str, memory_mib: int = 256, **args: float) -> TaskSpec:
    return TaskSpec(target="sample_tasks:Counter", args={"step_ms": 1.0, **args}, memory_bytes=memory_mib * MiB,
                    name=name, working_dir=str(TESTS_DIR), checkpoint_interval_s=0.05)


@pytest.fixture
def nodes() -> Iterator[list[Node]]:
    started: list[Node] = []
    yield started
    for node in started:
        node.stop()


def _resumed(node: Node, task_id: str) -> int:
    """The step a task's worker on ``node`` resumed from (waits for its log to say so)."""
    log = node.state_dir / "tasks" / task_id / "worker.log"
    pattern = re.compile(r"resumed from ckpt-\d+\.pt at step (\d+)")
    found = wait_for(lambda: log.exists() and pattern.search(log.read_text()), 30)
    return int(found.group(1))  # type: ignore[union-attr]


def _held_by(queue: Queue, task_id: str, node: Node) -> bool:
    record = queue.record(task_id)
    return record.device == node.where and record.state in ("PARKED", "RUNNING", "FROZEN")


def test_a_task_is_claimed_by_the_manager_that_can_place_it_and_a_drain_hands_it_back(
    tmp_path: Path, redis_server: RedisServer, nodes: list[Node]
) -> None:
    # Two "nodes" on one core: different endpoints and state directories are all the queue needs.
    device = node_devices(1)[0]
    small = start_node(tmp_path, "small", device, redis_server.url, tmp_path / "ckpt")
    large = start_node(tmp_path, "large", device, redis_server.url, tmp_path / "ckpt")
    nodes += [small, large]
    small.train(free_mib=600)  # budget 600 - 256 headroom = 344 MiB
    large.train(free_mib=1500)  # budget 1244 MiB
    queue = Queue(redis_server.url)
    big = cluster.submit(redis_server.url, _counter("big", memory_mib=768)).task_id
    huge = cluster.submit(redis_server.url, _counter("huge", memory_mib=2 * 1024)).task_id  # over both budgets
    wait_for(lambda: _held_by(queue, big, large), 30)
    # A cap over every device the queue's managers serve is refused at submission: such a task was accepted and
    # waited, QUEUED, for ever.
    with pytest.raises(ConfigError, match=r"is more than any device of this queue has in all \(the largest: "
                                          r"(small|large)/cpu:\d+, .*\): the task could never be placed"):
        cluster.submit(redis_server.url, _counter("never", memory_mib=5 * 2**20))
    tiny = cluster.submit(redis_server.url, _counter("tiny", memory_mib=256)).task_id
    wait_for(lambda: queue.record(tiny).state in ("PARKED", "RUNNING"), 30)
    # Only the large node could place the big task; no node can place the huge one: it was never claimed.
    assert queue.record(big).epoch == 1
    record = queue.record(huge)
    assert (record.state, record.epoch, record.device) == ("QUEUED", 0, "")
    wait_for(lambda: queue.record(big).progress > 0, 30)
    listing = cluster.render_table(cluster.records(redis_server.url, include_finished=True))
    assert re.search(rf"{big}\s+big\s+(PARKED|RUNNING|FROZEN)\s+{re.escape(large.where)}", listing), listing
    # Each manager lists the cluster tasks it holds, as it lists its own.
    assert big in {t.task_id for t in large.client.list()}

    # The job ends on the large node: its manager drains and hands the big task back at once (no lease
    # to wait for), with its checkpoint; the small node cannot place it, so it waits in the queue.
    drained = large.client.drain(timeout_s=30)
    large.stop(drain=True)
    nodes.remove(large)
    record = queue.record(big)
    assert (record.state, record.device) == ("QUEUED", ""), record
    assert "drain" in record.reason and record.checkpoint_step > 0 and record.restarts == 1
    # The reply counts the task it handed back (a queue manager's said "0 checkpointed": the task had left).
    assert (drained.parked, drained.checkpointed) == (1, 1), drained
    queue.close()


def test_queue_tasks_spread_over_the_managers_rather_than_all_going_to_the_first_that_saw_a_bubble(
    tmp_path: Path, redis_server: RedisServer, nodes: list[Node]
) -> None:
    # A stranger's two managers: the first to see a bubble claimed all four tasks, the other device's bubbles
    # went unused. One task per claim, and the next only a spread later for each task already held.
    device = node_devices(1)[0]
    first = start_node(tmp_path, "first", device, redis_server.url, tmp_path / "ckpt", spread_ms=5_000.0)
    later = start_node(tmp_path, "later", device, redis_server.url, tmp_path / "ckpt", spread_ms=5_000.0)
    nodes += [first, later]
    queue = Queue(redis_server.url)
    ids = [cluster.submit(redis_server.url, _counter(f"t{i}", memory_mib=64)).task_id for i in range(4)]
    first.train(free_mib=2000)
    wait_for(lambda: any(queue.record(t).device == first.where for t in ids), 30)
    assert sorted(queue.record(t).state for t in ids)[1:] == ["QUEUED"] * 3  # it left the rest a while
    later.train(free_mib=2000)  # its device's bubbles start a moment later
    wait_for(lambda: all(queue.record(t).device for t in ids), 60)
    held = [queue.record(t).device for t in ids]
    assert sorted(held) == sorted([first.where] * 2 + [later.where] * 2), held
    queue.close()


def test_kill_9_of_a_manager_its_task_is_reclaimed_after_the_lease_and_resumes_from_its_checkpoint(
    tmp_path: Path, redis_server: RedisServer, nodes: list[Node]
) -> None:
    first, second = node_devices(2)
    checkpoints = tmp_path / "ckpt"
    daemon = start_daemon_node(tmp_path, "doomed", first, redis_server.url, checkpoints)
    queue = Queue(redis_server.url)
    try:
        trainer = Trainer(Endpoint("unix", str(socket_for("doomed"))), 2048 * MiB).start()
        task_id = cluster.submit(redis_server.url, _counter("survivor")).task_id
        wait_for(lambda: queue.record(task_id).device == f"doomed/{first}"
                 and queue.record(task_id).checkpoint_step >= 30, 60)
        # The second node is up and reporting bubbles before the first one dies; it cannot take the task
        # while its holder renews the lease.
        survivor = start_node(tmp_path, "survivor", second, redis_server.url, checkpoints)
        nodes.append(survivor)
        survivor.train(free_mib=2048)
        kill_9(daemon)
        trainer.stop()
        checkpoint_at_kill = queue.record(task_id).checkpoint_step
        wait_for(lambda: _held_by(queue, task_id, survivor), 30)
        resumed_at = _resumed(survivor, task_id)
        wait_for(lambda: len(read_steps(survivor.state_dir / "tasks" / task_id / "work")) >= 10, 30)
    finally:
        if daemon.poll() is None:
            kill_9(daemon)
        socket_for("doomed").unlink(missing_ok=True)  # a killed manager leaves its socket behind
    record = queue.record(task_id)
    assert record.restarts == 1 and record.epoch == 2 and record.reason == f"claimed by {survivor.where}"
    # It went on from the dead manager's newest checkpoint, not from zero.
    assert resumed_at >= checkpoint_at_kill >= 30
    wait_for(lambda: survivor.client.get(task_id).progress >= resumed_at + 10, 30)
    queue.close()
    # In the shared directory, the task's checkpoints are the managers' user's alone (they were 0755 and 0644).
    for path in (checkpoints / task_id, *(checkpoints / task_id).rglob("*")):
        assert path.stat().st_mode & 0o077 == 0, (path, oct(path.stat().st_mode))


def test_a_redis_restart_stops_nothing_and_every_manager_goes_on_with_its_tasks(
    tmp_path: Path, redis_server: RedisServer, nodes: list[Node]
) -> None:
    first, second = node_devices(2)
    a = start_node(tmp_path, "a", first, redis_server.url, tmp_path / "ckpt")
    b = start_node(tmp_path, "b", second, redis_server.url, tmp_path / "ckpt")
    nodes += [a, b]
    a.train(free_mib=600)
    b.train(free_mib=600)  # room for one 256 MiB task each
    queue = Queue(redis_server.url)
    ids = [cluster.submit(redis_server.url, _counter(f"t{i}")).task_id for i in range(2)]
    wait_for(lambda: all(queue.record(t).progress > 0 for t in ids), 30)
    before = {t: queue.record(t) for t in ids}
    assert {r.device for r in before.values()} == {a.where, b.where}

    redis_server.kill()
    wait_for(lambda: not a.manager.agent.connected and not b.manager.agent.connected, 30)  # type: ignore[union-attr]
    # No Redis: the managers and their tasks go on.
    for node in (a, b):
        [info] = node.client.list()
        steps = info.steps
        wait_for(lambda node=node, steps=steps: node.client.list()[0].steps > steps, 30)
    redis_server.start()
    wait_for(lambda: a.manager.agent.connected and b.manager.agent.connected, 30)  # type: ignore[union-attr]
    wait_for(lambda: all(queue.record(t).progress > before[t].progress for t in ids), 30)
    for task_id in ids:
        record = queue.record(task_id)
        # The same holder, the same claim: nothing was re-placed, nothing lost.
        assert (record.device, record.epoch, record.restarts) == (before[task_id].device, 1, 0)
    # What the managers' queue agents saw, as `freeride stats` shows it: renewals on both sides of the
    # restart, no task lost, and the sweeps after it held back (by whichever manager swept).
    def figures_say_so() -> bool:
        figures = [node.client.stats().queue for node in (a, b)]
        return all(f is not None and f.connected and f.claims == 1 and f.held == 1 and f.lost == 0
                   and f.renewals > 2 for f in figures) and sum(f.graces for f in figures if f is not None) >= 1

    wait_for(figures_say_so, 30)  # the figures are a snapshot of each agent's last poll
    # The queue takes new work after the restart.
    late = cluster.submit(redis_server.url, _counter("late", memory_mib=64)).task_id
    wait_for(lambda: queue.record(late).state in ("PARKED", "RUNNING"), 30)
    queue.close()


def test_a_layout_change_resets_the_bubble_statistics_and_the_task_that_no_longer_fits_moves(
    tmp_path: Path, redis_server: RedisServer, nodes: list[Node]
) -> None:
    first, second = node_devices(2)
    a = start_node(tmp_path, "a", first, redis_server.url, tmp_path / "ckpt")
    b = start_node(tmp_path, "b", second, redis_server.url, tmp_path / "ckpt")
    nodes += [a, b]
    trainer = a.train(free_mib=1500)  # b reports no bubble yet, so it claims nothing
    queue = Queue(redis_server.url)
    task_id = cluster.submit(redis_server.url, _counter("elastic", memory_mib=768)).task_id
    wait_for(lambda: _held_by(queue, task_id, a) and queue.record(task_id).checkpoint_step >= 20, 30)
    b.train(free_mib=1500)
    assert {s.slot for s in a.client.bubbles()} == {0}

    # The job re-shards: on a's device the trainer now leaves 512 MiB free, and its idle slot is another.
    trainer.free_memory_bytes = 512 * MiB
    trainer.slot, trainer.kind = 1, "new-layout"
    trainer.layout(TrainerLayout("1f1b", 2, 8, (f"a/{first}", f"b/{second}"), now_ns(), 512 * MiB))
    wait_for(lambda: a.client.stats().layout_changes == 1, 30)
    stats = a.client.stats()
    assert stats.layout.startswith("1f1b stages=2 microbatches=8")
    # The old layout's statistics are gone: only the new slot is tracked from the change on.
    wait_for(lambda: {s.slot for s in a.client.bubbles()} == {1}, 30)
    # The 768 MiB task no longer fits a's budget: evicted, handed back, placed on b, where it goes on.
    wait_for(lambda: _held_by(queue, task_id, b), 30)
    resumed_at = _resumed(b, task_id)
    assert resumed_at >= 20  # from the checkpoint a wrote when it was evicted, not from zero
    wait_for(lambda: len(read_steps(b.state_dir / "tasks" / task_id / "work")) >= 10, 30)
    record = queue.record(task_id)
    assert record.epoch == 2 and record.restarts == 1
    assert task_id not in {t.task_id for t in a.client.list()}
    queue.close()


def test_a_claimed_spec_is_validated_again_and_fails_as_a_record(
    tmp_path: Path, redis_server: RedisServer, nodes: list[Node]
) -> None:
    """A record written around ``submit --queue`` (anyone with access to Redis can) is checked on claim."""
    node = start_node(tmp_path, "a", node_devices(1)[0], redis_server.url, tmp_path / "ckpt")
    nodes.append(node)
    node.train(free_mib=1500)
    queue = Queue(redis_server.url)
    bad = TaskSpec(target="os:system", args={"command": "true"}, memory_bytes=MiB)
    task_id = queue.q.submit(dataclasses.replace(submission_of(bad), args_json='{"x": NaN}'))
    wait_for(lambda: queue.record(task_id).state == "FAILED", 30)
    record = queue.record(task_id)
    assert record.failure is not None and record.failure.kind == "INVALID"
    assert "standard JSON" in record.failure.message
    queue.close()


def test_a_record_that_cannot_be_read_is_set_aside_and_the_tasks_after_it_run(
    tmp_path: Path, redis_server: RedisServer, nodes: list[Node], capsys: pytest.CaptureFixture[str]
) -> None:
    """The issue's wedge: a spec that is not UTF-8 made every claim loop fail on each poll."""
    node = start_node(tmp_path, "a", node_devices(1)[0], redis_server.url, tmp_path / "ckpt")
    nodes.append(node)
    node.train(free_mib=1500)
    queue = Queue(redis_server.url)
    poison = queue.q.submit(submission_of(_counter("poison")))
    queue.q._r.hset(queue.q.task_key(poison), "spec", b"\xff\xfe not text")
    after = cluster.submit(redis_server.url, _counter("after")).task_id
    wait_for(lambda: queue.record(after).progress > 0, 30)
    record = queue.record(poison)
    assert record.state == "SET_ASIDE" and "its spec is not UTF-8 text" in record.aside
    wait_for(lambda: node.client.stats().queue.set_aside == 1, 30)  # type: ignore[union-attr]
    assert main(["show", poison, "--queue", redis_server.url]) == 0
    assert "its spec is not UTF-8 text" in capsys.readouterr().out
    queue.close()
