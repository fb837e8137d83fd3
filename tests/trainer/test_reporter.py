"""The reporter never blocks or raises, reconnects and batches; the predictor learns after warm-up."""

from __future__ import annotations

import logging
import random
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import now_ns, wait_for

from freeride.endpoints import Endpoint, parse_endpoint
from freeride.errors import ConfigError, ManagerUnavailable
from freeride.measure import rank_index as percentile_index
from freeride.messages import BubbleEnd, BubbleEvent, BubbleStart, StreamSummary, TrainerLayout
from freeride.training import reporter as reporter_module
from freeride.training.predictor import BubblePredictor, ComputeProfile, percentile
from freeride.training.reporter import MAX_BATCH_EVENTS, BubbleReporter

MS = 1_000_000


def _absent(tmp_path: Path) -> Endpoint:
    return Endpoint("unix", str(tmp_path / "nobody-here.sock"))


def test_reporter_returns_immediately_and_raises_nothing_without_manager(tmp_path: Path) -> None:
    reporter = BubbleReporter("cpu:0", stage=1, rank=1, endpoint=_absent(tmp_path), backoff_initial_s=0.01)
    try:
        for i in range(2000):
            reporter.bubble_start(i, 0, "warmup", predicted_ns=1_000_000, free_memory_bytes=123)
            reporter.bubble_end(i, 0)
        # Nonsense input is swallowed too: the training thread never sees an exception.
        reporter.bubble_start("x", None, None, None)  # type: ignore[arg-type]
        wait_for(lambda: reporter.dropped > 0, 5)
    finally:
        reporter.close()
    # What piled up with nobody listening was discarded and counted.
    assert reporter.dropped > 0
    assert reporter.dropped + reporter.sent == reporter.counters().enqueued


def test_a_reporter_that_never_reaches_a_manager_says_so_once_naming_the_device_and_endpoint(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """A wrong device name or endpoint on the trainer's side used to go unnoticed: every bubble was dropped."""
    monkeypatch.setattr(reporter_module, "ABSENT_WARNING_S", 0.0)
    caplog.set_level(logging.WARNING, logger="freeride.training.reporter")
    attempts: list[int] = []
    open_stream = BubbleReporter._open_stream

    def counted(self: BubbleReporter, alive: threading.Event) -> Any:
        attempts.append(1)
        return open_stream(self, alive)

    monkeypatch.setattr(BubbleReporter, "_open_stream", counted)
    reporter = BubbleReporter("cpu:7", stage=0, rank=0, endpoint=_absent(tmp_path), backoff_initial_s=0.01,
                              backoff_max_s=0.01)
    try:
        wait_for(lambda: any("no freeride manager listens" in r.getMessage() for r in caplog.records), 10)
        tried = len(attempts)
        wait_for(lambda: len(attempts) >= tried + 3, 10)  # it goes on trying, quietly
    finally:
        reporter.close()
    told = [r.getMessage() for r in caplog.records if "no freeride manager listens" in r.getMessage()]
    assert len(told) == 1
    assert "nobody-here.sock" in told[0] and "freeride manager --device cpu:7" in told[0]


def test_a_device_name_given_as_the_endpoint_is_refused_naming_both(tmp_path: Path) -> None:
    # Stranger trial: BubbleReporter("cpu:0", ..., endpoint="cpu:1") read "cpu:1" as TCP host cpu, port 1, and
    # dropped every bubble without a word; ``freeride ls --endpoint cpu:1`` then suggested a manager at tcp://cpu:1.
    with pytest.raises(ConfigError, match=r"endpoint 'cpu:1' is a device name, not an endpoint: name the device as "
                                          r"the device .* tcp://host:port \(a host named like a device: tcp://cpu:1\)"):
        BubbleReporter("cpu:0", stage=0, rank=0, endpoint="cpu:1", start=False)
    assert parse_endpoint("tcp://cuda:7") == Endpoint("tcp", "cuda:7")  # said as TCP, a host so named is one
    assert parse_endpoint("localhost:7") == Endpoint("tcp", "localhost:7")
    # A device name with blanks is the device: kept as the manager and the adapters spell it.
    reporter = BubbleReporter(" cpu:1 ", stage=1, rank=1, endpoint=_absent(tmp_path), start=False)
    assert reporter.device == "cpu:1"
    reporter.close()


def test_a_reporter_whose_tcp_manager_never_answers_says_so_once(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    # Stranger trial: only a unix endpoint got the warning; tcp://127.0.0.1:1 dropped every bubble silently.
    monkeypatch.setattr(reporter_module, "ABSENT_WARNING_S", 0.0)
    caplog.set_level(logging.WARNING, logger="freeride.training.reporter")
    with socket.socket() as silent:  # accepts connections (the kernel's backlog) and never speaks
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        where = f"tcp://127.0.0.1:{silent.getsockname()[1]}"
        reporter = BubbleReporter("cpu:0", stage=0, rank=0, endpoint=where, backoff_initial_s=0.01,
                                  backoff_max_s=0.01)
        try:
            wait_for(lambda: any("no freeride manager answers" in r.getMessage() for r in caplog.records), 20)
        finally:
            reporter.close()
    [told] = [r.getMessage() for r in caplog.records if "no freeride manager answers" in r.getMessage()]
    assert where in told and f"started with --endpoint {where} running" in told


def test_bubbles_after_close_are_dropped_and_said_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Stranger trial: a reporter closed before its instrumented schedule, with training going on, dropped every
    # later bubble without a word.
    caplog.set_level(logging.WARNING, logger="freeride.training.reporter")
    reporter = BubbleReporter("cpu:0", stage=0, rank=0, endpoint=_absent(tmp_path), start=False)
    reporter.close()
    before = reporter.counters().dropped
    for iteration in range(3):
        reporter.bubble_start(iteration, 1, "test", 1_000_000)
        reporter.bubble_end(iteration, 1)
    said = [r.getMessage() for r in caplog.records if "after the reporter was closed" in r.getMessage()]
    assert len(said) == 1 and "close the instrumented schedule first, then its reporter" in said[0]
    assert reporter.counters().dropped >= before + 3


def test_reporter_calls_return_while_the_connection_attempt_hangs(tmp_path: Path) -> None:
    # A manager that accepts the connection and never answers: the background thread is stuck in
    # its connect for good. The training thread's calls must still return (this test would hang
    # at its timeout otherwise) and only enqueue.
    reporter = BubbleReporter("cpu:0", stage=0, rank=0, endpoint=_absent(tmp_path), start=False)
    connecting = threading.Event()
    never = threading.Event()

    def hanging(alive: threading.Event) -> None:
        connecting.set()
        never.wait()

    reporter._open_stream = hanging  # type: ignore[method-assign,assignment]
    reporter._thread.start()
    assert connecting.wait(10)
    for i in range(100):
        reporter.bubble_start(i, 0, "test", predicted_ns=MS)
        reporter.bubble_end(i, 0)
    assert reporter.counters().enqueued == 200 and reporter.sent == 0
    never.set()
    reporter.close(timeout_s=5)


def test_a_stream_open_to_a_listener_that_is_no_manager_is_not_connected() -> None:
    # Regression: `connected` read true as soon as the stream was opened, and gRPC connects lazily: a
    # reporter whose endpoint took connections but never answered (no manager there) said it was connected.
    import os
    import socket

    path = f"/tmp/fr-mute-{os.getpid()}.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(4)
    reporter = BubbleReporter("cpu:0", stage=0, rank=0, endpoint=Endpoint("unix", path), end_board=False,
                              local_events=False)
    try:
        conn, _ = listener.accept()  # gRPC's connection attempt reached the listener: the stream is open
        try:
            wait_for(lambda: reporter.counters().connects >= 1, 10, what="the stream to open")
            reporter.bubble_start(0, 0, "test", predicted_ns=MS)
            counters = reporter.counters()
            assert counters.connects == 1 and not counters.connected and not reporter.connected
        finally:
            conn.close()
    finally:
        reporter.close(timeout_s=5)
        listener.close()
        os.unlink(path)


def test_streams_that_no_manager_answered_are_not_reconnects(tmp_path: Path) -> None:
    # Stranger trial: `reconnects` read 18 after two real connections: it counted every stream opened while
    # no manager listened.
    reporter = BubbleReporter("cpu:0", stage=0, rank=0, endpoint=_absent(tmp_path), backoff_initial_s=0.001,
                              backoff_max_s=0.002)
    try:
        wait_for(lambda: reporter.counters().connects >= 3, 10, what="three streams to open")
        counters = reporter.counters()
        assert counters.reconnects == 0 and not counters.connected
    finally:
        reporter.close()


def test_reporter_bounded_queue_drops_and_counts(tmp_path: Path) -> None:
    reporter = BubbleReporter("cpu:0", 0, 0, endpoint=_absent(tmp_path), queue_size=10, start=False)
    for i in range(25):
        reporter.bubble_end(i, 0)
    assert reporter.counters().enqueued == 10
    assert reporter.dropped == 15
    reporter.close()
    reporter.bubble_end(99, 0)  # after close: dropped, not raised
    assert reporter.dropped == 16


def test_reporter_rejects_bad_device_at_construction(tmp_path: Path) -> None:
    from freeride.errors import ConfigError

    with pytest.raises(ConfigError):
        BubbleReporter("gpu0", 0, 0, endpoint=_absent(tmp_path), start=False)


class _RecordedWaits(threading.Event):
    """The reporter's closing event, recording how long each wait between attempts was asked to last
    (and not waiting it: the test reads the schedule, not the clock)."""

    def __init__(self) -> None:
        super().__init__()
        self.waits: list[float] = []

    def wait(self, timeout: float | None = None) -> bool:
        if timeout is not None:
            self.waits.append(timeout)
        return self.is_set()


def test_reporter_retries_with_backoff(tmp_path: Path) -> None:
    reporter = BubbleReporter(
        "cpu:0", 0, 0, endpoint=_absent(tmp_path), backoff_initial_s=0.01, backoff_max_s=0.05, start=False
    )
    waits = _RecordedWaits()
    reporter._closed = waits
    attempts = 0
    original = reporter._open_stream

    def counting(alive):  # type: ignore[no-untyped-def]
        nonlocal attempts
        attempts += 1
        return original(alive)

    reporter._open_stream = counting  # type: ignore[method-assign]
    reporter._thread.start()
    try:
        wait_for(lambda: len(waits.waits) >= 6, 20)
    finally:
        reporter.close()
    # Each failed attempt waits twice as long as the one before, from the initial backoff up to the
    # maximum, and then tries again: one attempt per wait.
    assert waits.waits[:6] == [0.01, 0.02, 0.04, 0.05, 0.05, 0.05]
    assert attempts >= 6


class FakeStream:
    """Stands in for BubbleStream: consumes the request iterator on its own thread, like gRPC.

    ``sink`` gets every event, ``messages`` every message (a batch) as the reporter yielded it.
    """

    def __init__(self, batches, sink: list, die_after: int | None) -> None:  # type: ignore[no-untyped-def]
        self.sink = sink
        self.messages: list[list] = []
        self._dead = threading.Event()
        self._die_after = die_after
        self._thread = threading.Thread(target=self._consume, args=(batches,), daemon=True)
        self._thread.start()

    def _consume(self, batches) -> None:  # type: ignore[no-untyped-def]
        for batch in batches:
            self.messages.append(list(batch))
            self.sink.extend(batch)
            if self._die_after is not None and len(self.sink) >= self._die_after:
                break  # the manager died mid-stream
        self._dead.set()

    def done(self) -> bool:
        return self._dead.is_set()

    def answers(self, timeout_s: float) -> bool:
        return not self._dead.is_set()

    def summary(self, timeout_s: float | None = None) -> StreamSummary:
        if self._die_after is not None:
            raise ManagerUnavailable("gone")
        return StreamSummary(accepted=len(self.sink))

    def close(self) -> None:
        pass


def _first_manager_dies_after(reporter: BubbleReporter, events: int) -> tuple[list, list[FakeStream]]:
    """Start ``reporter`` on fake streams whose first manager dies after ``events`` events and whose second
    stays; returns what the managers received, and the streams opened."""
    received: list = []
    streams: list[FakeStream] = []

    def open_stream(alive):  # type: ignore[no-untyped-def]
        stream = FakeStream(reporter._batches(alive), received, die_after=events if not streams else None)
        streams.append(stream)
        return stream

    reporter._open_stream = open_stream  # type: ignore[method-assign]
    reporter._thread.start()
    return received, streams


def test_reporter_streams_events_in_order_and_reconnects_after_manager_death(tmp_path: Path) -> None:
    reporter = BubbleReporter("cpu:3", stage=2, rank=5, endpoint=_absent(tmp_path), start=False,
                              backoff_initial_s=0.01)
    received, streams = _first_manager_dies_after(reporter, 4)
    reporter.bubble_start(7, 1, "drain", predicted_ns=2_000_000, free_memory_bytes=4096, start_ns=100)
    reporter.bubble_end(7, 1, end_ns=200)
    reporter.bubble_start(8, 0, "boundary", predicted_ns=0, start_ns=300)
    reporter.bubble_end(8, 0, end_ns=400)
    wait_for(lambda: len(streams) >= 2, 5)
    # While a connection is up, events flow through it at once.
    wait_for(lambda: reporter.counters().connected, 5)
    assert len(streams) == 2 and reporter.reconnects == 1
    reporter.bubble_end(9, 2, end_ns=500)
    wait_for(lambda: len(received) >= 5, 5)
    reporter.close()
    assert received[0] == BubbleStart(2, 5, 7, 1, "drain", 100, 2_000_000, 4096)
    assert received[1] == BubbleEnd(2, 5, 7, 1, 200)
    assert received[2].predicted_ns == 1  # clamped to the protocol's positive range
    assert received[4] == BubbleEnd(2, 5, 9, 2, 500)
    assert reporter.sent == 5


def test_a_manager_that_goes_away_mid_run_and_one_that_answers_again_are_said_once_each(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # A stranger killed a manager mid-run: the trainer said nothing, neither then nor when a new one answered (a
    # killed manager leaves its socket, so the absence warning never came).
    caplog.set_level(logging.WARNING, logger="freeride.training.reporter")
    endpoint = _absent(tmp_path)
    Path(endpoint.address).touch()  # a killed manager leaves its socket
    reporter = BubbleReporter("cpu:3", stage=2, rank=5, endpoint=endpoint, start=False, backoff_initial_s=0.01)
    received, streams = _first_manager_dies_after(reporter, 2)
    for it in range(3):
        reporter.bubble_start(it, 1, "drain", predicted_ns=2_000_000, start_ns=100 + it * 100)
        reporter.bubble_end(it, 1, end_ns=150 + it * 100)
    wait_for(lambda: len(streams) >= 2 and reporter.counters().connected, 5)
    wait_for(lambda: any("answers" in r.getMessage() and "again" in r.getMessage() for r in caplog.records), 5)
    reporter.close()
    said = [r.getMessage() for r in caplog.records]
    gone = [m for m in said if "went away" in m]
    back = [m for m in said if "again after" in m]
    assert len(gone) == 1 and "this rank's bubbles are dropped until one answers there again" in gone[0]
    assert len(back) == 1 and "bubble events dropped meanwhile" in back[0]
    assert not any("went away" in m for m in said[said.index(back[0]):])  # closing is no manager going away


def test_a_rank_whose_manager_never_answered_is_not_told_that_it_went_away(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # A stranger's second rank, with no manager on its device, said "the freeride manager ... went away": gRPC had
    # taken its events from the queue before it found no one at the socket.
    caplog.set_level(logging.INFO, logger="freeride.training.reporter")
    endpoint = Endpoint("unix", str(tmp_path / "none.sock"))
    with BubbleReporter("cpu:1", stage=1, rank=1, endpoint=endpoint, backoff_initial_s=0.01,
                        backoff_max_s=0.05) as reporter:
        for it in range(20):
            reporter.bubble_start(it, 0, "k", predicted_ns=1_000_000)
            reporter.bubble_end(it, 0)
        wait_for(lambda: "bubble stream to" in caplog.text, 10)  # its first try ended: no one is there
    assert "went away" not in caplog.text


def test_a_reconnection_tells_the_manager_the_jobs_layout_again(tmp_path: Path) -> None:
    # Found by a stranger: a manager restarted under a running trainer took its bubbles but never learned its
    # layout (it was reported once, to the manager that died).
    reporter = BubbleReporter("cpu:3", stage=2, rank=5, endpoint=_absent(tmp_path), start=False,
                              backoff_initial_s=0.01, job="run-1")
    received, streams = _first_manager_dies_after(reporter, 3)
    reporter.report_layout("1f1b", 2, 4, at_ns=50)
    reporter.bubble_start(7, 1, "k", predicted_ns=MS, start_ns=100)
    reporter.bubble_end(7, 1, end_ns=200)
    wait_for(lambda: len(streams) >= 2 and len(received) >= 4, 5)
    reporter.bubble_end(8, 1, end_ns=300)
    wait_for(lambda: len(received) >= 5, 5)
    reporter.close()
    layout = TrainerLayout("1f1b", 2, 4, (), 50, -1, job="run-1")
    assert received == [layout, BubbleStart(2, 5, 7, 1, "k", 100, MS, -1), BubbleEnd(2, 5, 7, 1, 200), layout,
                        BubbleEnd(2, 5, 8, 1, 300)]
    counters = reporter.counters()
    assert counters.enqueued == 4 and counters.sent == 4  # the layout told again is the reporter's, not training's


class EndsWhilePulling(FakeStream):
    """A call that ends while gRPC's thread waits in the request iterator for its next event (a manager stopped
    while the trainer had nothing to send): ``end()`` ends it; its thread is still inside ``next``."""

    def __init__(self, batches, sink: list) -> None:  # type: ignore[no-untyped-def]
        self.ended = threading.Event()
        super().__init__(batches, sink, die_after=None)

    def done(self) -> bool:
        return self.ended.is_set() or super().done()

    def answers(self, timeout_s: float) -> bool:
        return not self.done()

    def summary(self, timeout_s: float | None = None) -> StreamSummary:
        raise ManagerUnavailable("gone")


def test_the_first_events_after_a_reconnection_reach_the_new_manager_not_the_ended_calls_iterator(
        tmp_path: Path) -> None:
    # Regression: the ended call's iterator, blocked in the queue on gRPC's thread for up to 0.2 s, took the
    # first events meant for the next connection and dropped them as its own call's (a manager restarted under
    # a trainer over the wire lost the end, start and end sent right after it came back).
    reporter = BubbleReporter("cpu:3", stage=2, rank=5, endpoint=_absent(tmp_path), start=False,
                              backoff_initial_s=0.01)
    old: list = []
    new: list = []
    streams: list[FakeStream] = []

    def open_stream(alive):  # type: ignore[no-untyped-def]
        stream = EndsWhilePulling(reporter._batches(alive), old) if not streams else \
            FakeStream(reporter._batches(alive), new, die_after=None)
        streams.append(stream)
        return stream

    reporter._open_stream = open_stream  # type: ignore[method-assign]
    reporter._thread.start()
    wait_for(lambda: streams and reporter.counters().connected, 5)
    streams[0].ended.set()  # type: ignore[attr-defined]
    wait_for(lambda: len(streams) == 2 and reporter.counters().connected, 5)
    reporter.bubble_end(0, 0, end_ns=100)
    reporter.bubble_start(1, 0, "k", predicted_ns=MS, start_ns=200)
    reporter.bubble_end(1, 0, end_ns=300)
    wait_for(lambda: len(new) == 3, 5)
    reporter.close()
    assert old == [] and [type(e).__name__ for e in new] == ["BubbleEnd", "BubbleStart", "BubbleEnd"]
    assert reporter.counters().dropped == 0


class PullingStream:
    """Stands in for BubbleStream: a gRPC-like sender thread that asks for a message when told to."""

    def __init__(self, batches: Iterator[list[BubbleEvent]]) -> None:
        self.messages: list[list[BubbleEvent]] = []
        self.pull = threading.Semaphore(0)  # one release: the sender asks for one more message
        self._batches = batches
        self._thread = threading.Thread(target=self._send, daemon=True)
        self._thread.start()

    def _send(self) -> None:
        while self.pull.acquire():
            batch = next(self._batches, None)
            if batch is None:
                return
            self.messages.append(batch)

    def done(self) -> bool:
        return not self._thread.is_alive()

    def answers(self, timeout_s: float) -> bool:
        return not self.done()

    def close(self) -> None:
        pass


def test_reporter_coalesces_what_queued_while_sending_but_sends_a_lone_event_at_once(tmp_path: Path) -> None:
    reporter = BubbleReporter("cpu:0", 0, 0, endpoint=_absent(tmp_path), start=False)
    streams: list[PullingStream] = []

    def open_stream(alive: threading.Event) -> PullingStream:
        streams.append(PullingStream(reporter._batches(alive)))
        return streams[-1]

    reporter._open_stream = open_stream  # type: ignore[method-assign]
    reporter._thread.start()
    wait_for(lambda: streams)
    stream = streams[0]
    t0 = now_ns()
    # A lone event, with the sender idle and waiting: it goes out at once, alone.
    stream.pull.release()
    reporter.bubble_start(0, 0, "test", MS, start_ns=t0)
    wait_for(lambda: len(stream.messages) == 1)
    assert stream.messages[0] == [BubbleStart(0, 0, 0, 0, "test", t0, MS, -1)]
    # Events that queue up while the sender is busy with its last message go out together.
    for it in range(1, 6):
        reporter.bubble_end(it, 0, end_ns=t0 + it)
    stream.pull.release()
    wait_for(lambda: len(stream.messages) == 2)
    assert stream.messages[1] == [BubbleEnd(0, 0, it, 0, t0 + it) for it in range(1, 6)]
    # A batch never exceeds MAX_BATCH_EVENTS.
    for it in range(MAX_BATCH_EVENTS + 3):
        reporter.bubble_end(it, 1, end_ns=t0 + it)
    stream.pull.release()
    stream.pull.release()
    wait_for(lambda: len(stream.messages) == 4)
    assert [len(m) for m in stream.messages[2:]] == [MAX_BATCH_EVENTS, 3]
    assert reporter.counters().messages == 4 and reporter.sent == 1 + 5 + MAX_BATCH_EVENTS + 3
    stream.pull.release()
    reporter.close(timeout_s=5)


def test_predictor_starts_from_model_then_learns() -> None:
    model = {(0, 0): 5_000_000.0, (0, 1): 1_000_000.0}
    pred = BubblePredictor(model=lambda s, k: model.get((s, k)), window=5, warmup=3)
    assert pred.predict_ns(0, 0) == 5_000_000
    assert pred.predict_ns(3, 7) == pred.fallback_ns
    rng = random.Random(1)
    for _ in range(200):
        truth = int(8_000_000 * (1 + rng.uniform(-0.03, 0.03)))
        if rng.random() < 0.03:
            truth *= 3  # an outlier (GC pause): the median shrugs it off
        pred.observe(0, 0, truth, predicted_ns=pred.predict_ns(0, 0))
    assert 7_600_000 <= pred.predict_ns(0, 0) <= 8_400_000
    warm = pred.prediction_error()
    cold = pred.prediction_error(after_warmup=False)
    assert warm.count == 197 and cold.count == 200
    assert warm.p90 <= 0.10
    assert cold.max >= warm.p50


def test_a_warm_prediction_is_the_quantile_of_the_slots_last_lengths_as_they_come_and_go() -> None:
    # The predictor keeps each history sorted as it changes (no sort at each wait): the same as sorting it.
    rng = random.Random(7)
    pred = BubblePredictor(window=16, warmup=3, quantile=0.1)
    seen: dict[int, list[int]] = {0: [], 1: []}
    for _ in range(500):
        slot = rng.randrange(2)
        length = rng.choice([rng.randrange(1, 5 * MS), 2 * MS])  # repeats too: a removal must take one copy
        pred.observe(0, slot, length, predicted_ns=pred.predict_ns(0, slot))
        seen[slot].append(length)
        recent = sorted(seen[slot][-16:])
        if len(seen[slot]) >= 3:
            assert pred.predict_ns(0, slot) == recent[percentile_index(len(recent), 10)]
    per_slot = [pred.slot_error(0, slot).count for slot in (0, 1)]
    assert sum(per_slot) == pred.prediction_error().count == 500 - 2 * 3  # each slot's first 3 are cold


def test_an_iterations_lengths_learned_at_once_predict_and_score_as_one_by_one() -> None:
    # The tracker hands the predictor an iteration's waits in one call (observe_all): the same histories,
    # predictions, counts and scores as a call per wait, zero lengths skipped alike.
    rng = random.Random(11)
    batched, single = (BubblePredictor(window=16, warmup=3, quantile=0.1) for _ in range(2))
    for _ in range(60):
        waits = [(slot, rng.choice([0, rng.randrange(1, 4 * MS)]), rng.choice([None, rng.randrange(1, 4 * MS)]))
                 for slot in rng.sample(range(6), 4)]
        batched.observe_all(0, waits)
        for slot, length, predicted in waits:
            single.observe(0, slot, length, predicted)
        for slot in range(6):
            assert batched.predict_ns(0, slot) == single.predict_ns(0, slot)
            assert batched.measurements(0, slot) == single.measurements(0, slot)
    assert batched.prediction_error(after_warmup=False) == single.prediction_error(after_warmup=False)
    assert batched.prediction_error().count > 0


def test_compute_profile_ewma_and_percentile() -> None:
    prof = ComputeProfile(alpha=0.5)
    assert prof.mean_ns("F", 7.0) == 7.0
    prof.observe("F", 100)
    prof.observe("F", 200)
    assert prof.mean_ns("F") == 150.0 and prof.samples("F") == 2
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([], 90) == 0.0


def test_an_end_is_on_the_managers_end_board_before_it_is_queued(tmp_path: Path) -> None:
    # A side task in the bubble reads the board before each step: it learns of the end without waiting
    # for the wire (issue 13). The board is found beside the manager's unix socket at each connection.
    from freeride._boards import EndBoard, end_board_path

    endpoint = Endpoint("unix", str(tmp_path / "m.sock"))
    EndBoard.create(end_board_path(endpoint.address))
    board = EndBoard.open(end_board_path(endpoint.address), writable=False)
    reporter = BubbleReporter("cpu:0", stage=1, rank=5, endpoint=endpoint, backoff_initial_s=0.01)
    try:
        wait_for(lambda: reporter._end_board is not None, 5, what="the reporter to map the end board")
        start = now_ns()
        reporter.bubble_start(3, 2, "drain", predicted_ns=MS, start_ns=start)
        assert board.ended_ns(5, start) == 0
        reporter.bubble_end(3, 2, end_ns=start + 700)
        assert board.ended_ns(5, start) == start + 700
        reporter.bubble_end(4, 2, end_ns=start + 900)  # not the bubble that started: the board keeps its record
        assert board.ended_ns(5, start) == start + 700
    finally:
        reporter.close()


def test_on_the_managers_host_every_event_goes_as_a_datagram_after_the_board_and_falls_back_to_the_wire_in_order(
    tmp_path: Path,
) -> None:
    # Issue 23: a local trainer's events reach the manager's loop without the wire (the loop freezes a step
    # still running at the trainer's end + grace); a manager gone must cost training nothing, and from the
    # first failed send on, this connection's events go over the wire, so that none overtakes another.
    from freeride._boards import EndBoard, end_board_path
    from freeride._local_events import LocalEvents, decode, local_events_path

    endpoint = Endpoint("unix", str(tmp_path / "m.sock"))
    EndBoard.create(end_board_path(endpoint.address))
    board = EndBoard.open(end_board_path(endpoint.address), writable=False)
    local = LocalEvents(local_events_path(endpoint.address))
    wire: list = []
    reporter = BubbleReporter("cpu:0", stage=1, rank=5, endpoint=endpoint, backoff_initial_s=0.01, start=False)
    reporter._open_stream = lambda alive: FakeStream(reporter._batches(alive), wire, None)  # type: ignore[method-assign]
    reporter._thread.start()
    try:
        wait_for(lambda: reporter._local is not None, 5, what="the reporter to open the local event socket")
        start = now_ns()
        reporter.bubble_start(3, 2, "drain", predicted_ns=0, start_ns=start)  # a predicted 0 goes as 1 ns
        reporter.bubble_end(3, 2, end_ns=start + 700)
        assert board.ended_ns(5, start) == start + 700  # the board first, then the datagram
        reporter.report_layout("1F1B", stages=2, microbatches=4, stage_devices=("cpu:0", "cpu:1"), at_ns=start + 800)
        assert [decode(d) for d in local.read()] == [
            BubbleStart(1, 5, 3, 2, "drain", start, 1), BubbleEnd(1, 5, 3, 2, start + 700),
            TrainerLayout("1F1B", 2, 4, ("cpu:0", "cpu:1"), start + 800, job=reporter.job),
        ]
        assert reporter.counters().local == 3 and reporter._queue.qsize() == 0
        local.close()  # the manager is gone
        reporter.bubble_start(4, 2, "drain", predicted_ns=MS, start_ns=start + 900)  # never raises
        reporter.bubble_end(4, 2, end_ns=start + 950)
        counters = reporter.counters()
        assert counters.local == 3 and counters.local_fallbacks == 1 and reporter._local is None
        assert counters.enqueued == 5
        wait_for(lambda: len(wire) == 2, 5, what="the wire to carry what the socket could not")
        assert wire == [BubbleStart(1, 5, 4, 2, "drain", start + 900, MS), BubbleEnd(1, 5, 4, 2, start + 950)]
    finally:
        reporter.close()
        board.close()


def test_over_tcp_a_message_ends_right_after_an_end() -> None:
    # No board over TCP: the wire is an end's only path, so it is never held behind events queued after it.
    import threading

    reporter = BubbleReporter("cpu:0", stage=0, rank=0, endpoint="127.0.0.1:1", start=False)
    for it in range(3):
        reporter.bubble_start(it, 0, "fwd", predicted_ns=MS, start_ns=10 + it)
        reporter.bubble_end(it, 0, end_ns=11 + it)
    alive = threading.Event()
    alive.set()
    batches = reporter._batches(alive)
    sizes = [len(next(batches)) for _ in range(3)]
    alive.clear()
    assert sizes == [2, 2, 2]


def test_events_queued_before_the_connection_go_first_as_datagrams_and_a_stale_route_never_overtakes(
    tmp_path: Path,
) -> None:
    # Reported before the reporter connected: they go out first, in order, on the local socket. An event
    # queued under the route read before the switch (a race of a microsecond) would reach the manager after
    # later datagrams: the wire drops it, counted, rather than deliver it out of order.
    from freeride._boards import EndBoard, end_board_path
    from freeride._local_events import LocalEvents, decode, local_events_path

    endpoint = Endpoint("unix", str(tmp_path / "m.sock"))
    EndBoard.create(end_board_path(endpoint.address))
    local = LocalEvents(local_events_path(endpoint.address))
    wire: list = []
    reporter = BubbleReporter("cpu:0", stage=0, rank=2, endpoint=endpoint, start=False)
    reporter._open_stream = lambda alive: FakeStream(reporter._batches(alive), wire, None)  # type: ignore[method-assign]
    reporter.bubble_start(0, 0, "fwd", predicted_ns=MS, start_ns=10)
    reporter.bubble_end(0, 0, end_ns=20)
    stale_epoch = reporter._route[1]
    reporter._thread.start()
    try:
        wait_for(lambda: reporter._local is not None, 5, what="the reporter to open the local event socket")
        reporter._queue.put((1, 1, 0, 30, stale_epoch))  # an end queued under the old route
        reporter.bubble_start(2, 0, "fwd", predicted_ns=MS, start_ns=40)
        assert [decode(d) for d in local.read()] == [
            BubbleStart(0, 2, 0, 0, "fwd", 10, MS), BubbleEnd(0, 2, 0, 0, 20), BubbleStart(0, 2, 2, 0, "fwd", 40, MS),
        ]
        wait_for(lambda: reporter.dropped == 1, 5, what="the wire to drop the stale event")
        assert wire == [] and reporter.counters().local == 3
    finally:
        reporter.close()
        local.close()


def test_local_events_off_keeps_the_board_and_sends_every_event_over_the_wire(tmp_path: Path) -> None:
    from freeride._boards import EndBoard, end_board_path
    from freeride._local_events import LocalEvents, local_events_path

    endpoint = Endpoint("unix", str(tmp_path / "m.sock"))
    EndBoard.create(end_board_path(endpoint.address))
    board = EndBoard.open(end_board_path(endpoint.address), writable=False)
    local = LocalEvents(local_events_path(endpoint.address))
    wire: list = []
    reporter = BubbleReporter("cpu:0", stage=0, rank=3, endpoint=endpoint, start=False, local_events=False)
    reporter._open_stream = lambda alive: FakeStream(reporter._batches(alive), wire, None)  # type: ignore[method-assign]
    reporter._thread.start()
    try:
        wait_for(lambda: reporter.counters().connected, 5, what="the reporter to connect")
        reporter.bubble_start(0, 1, "fwd", predicted_ns=MS, start_ns=100)
        reporter.bubble_end(0, 1, end_ns=200)
        assert board.ended_ns(3, 100) == 200  # the board still stops side tasks at once
        wait_for(lambda: len(wire) == 2, 5, what="the wire to carry both events")
        assert wire == [BubbleStart(0, 3, 0, 1, "fwd", 100, MS), BubbleEnd(0, 3, 0, 1, 200)]
        assert local.read() == [] and reporter.counters().local == 0 and reporter._local is None
    finally:
        reporter.close()
        local.close()
        board.close()


def _first_bubble_on_a_thread(reporter: BubbleReporter, cores: set[int]) -> None:
    """The first bubble reported from a thread of its own, pinned to ``cores``."""
    import os

    def report() -> None:
        os.sched_setaffinity(0, cores)
        reporter.bubble_start(0, 0, "fwd", predicted_ns=MS)
        reporter.bubble_end(0, 0)
        reporter.bubble_start(1, 0, "fwd", predicted_ns=MS)

    thread = threading.Thread(target=report)
    thread.start()
    thread.join()


def test_a_cpu_rank_not_pinned_to_its_devices_core_alone_is_told_once_how_to_pin_it(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Stranger trial: a DeepSpeed trainer's ranks, left unpinned as the README's snippet showed, trained 30%
    # slower beside their side tasks, and nothing said why.
    import os

    caplog.set_level(logging.WARNING, logger="freeride.training.reporter")
    here = min(os.sched_getaffinity(0))
    for device, warned in ((f"cpu:{here}", False), (f"cpu:{here + 1000}", True)):
        caplog.clear()
        reporter = BubbleReporter(device, stage=0, rank=0, endpoint=_absent(tmp_path), start=False)
        try:
            _first_bubble_on_a_thread(reporter, {here})
        finally:
            reporter.close(timeout_s=1)
        told = [r.getMessage() for r in caplog.records if "not on core" in r.getMessage()]
        assert len(told) == int(warned), device
        if warned:
            assert f"may run on cores {here}, not on core {here + 1000} alone" in told[0]
            assert f"os.sched_setaffinity(0, {{{here + 1000}}})" in told[0]


def test_a_cuda_rank_is_not_told_to_pin_itself(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import os

    caplog.set_level(logging.WARNING, logger="freeride.training.reporter")
    reporter = BubbleReporter("cuda:0", stage=0, rank=0, endpoint=_absent(tmp_path), start=False)
    try:
        _first_bubble_on_a_thread(reporter, set(os.sched_getaffinity(0)))
    finally:
        reporter.close(timeout_s=1)
    assert not [r for r in caplog.records if "not on core" in r.getMessage()]


def test_cores_read_as_ranges() -> None:
    assert reporter_module._cores_text({0, 1, 2, 3, 6, 8, 9}) == "0-3,6,8-9"
    assert reporter_module._cores_text({5}) == "5"


def test_a_cpu_rank_says_its_waiting_thread_on_the_end_board_at_its_first_bubble(tmp_path: Path) -> None:
    # Its side tasks stop stepping while that thread is runnable (freeride._worker.runtime, _rank_wants_core).
    import os

    from freeride._boards import EndBoard

    EndBoard.create(tmp_path / "ends")
    board = EndBoard.open(tmp_path / "ends", writable=True)
    here = min(os.sched_getaffinity(0))
    reporter = BubbleReporter(f"cpu:{here}", stage=0, rank=5, endpoint=_absent(tmp_path), start=False)
    reporter._end_board = board  # as its connection maps the manager's board
    said: list[int] = []

    def report() -> None:
        said.append(threading.get_native_id())
        reporter.bubble_start(0, 0, "fwd", predicted_ns=MS)

    try:
        thread = threading.Thread(target=report)
        thread.start()
        thread.join()
        assert board.trainer_thread(5) == said[0] != threading.get_native_id()
    finally:
        reporter.close(timeout_s=1)
        board.close()
