"""A trainer on the manager's host sends its bubble events straight to the manager's loop, one datagram each.

Over gRPC an event crosses four threads before the scheduler sees it: the reporter's sender thread, gRPC's
own threads on both sides, and a servicer thread that hands it to the loop; on two busy cores that was
p50 ~0.9 ms, p99 ~1.8-2.4 ms from the trainer's call to the core (``bench/results/cpu/end_stop.md``), and
the end of a bubble reached the manager late enough that a step still running at it was frozen ~1.9 ms
after it instead of grace (0.5 ms) after it. Here the training thread itself sends each event as one
datagram on a unix socket the manager's loop selects on (``<socket>.events``, in the socket's owner-only
directory): one ``send`` of ~60 bytes, and the loop reads it on its next wake, with no other thread
between. The price is on the training thread: a ``bubble_start`` + ``bubble_end`` pair costs ~14 us
(p50; p99 ~250 us, waking the manager's idle core) against ~2 us for the wire's queue, whose sender thread
is often still busy and needs no wake (``bench/results/cpu/local_events.md``, the 2-core VM); a reporter
made with ``local_events=False`` keeps the wire.

Why a ``SOCK_SEQPACKET`` connection per reporter: each event arrives whole and in the order sent; a send
never waits (``MSG_DONTWAIT``) and to a manager that died it answers an error, never ``SIGPIPE``; the
manager learns when a trainer goes (end of file). Not ``SOCK_DGRAM``: Linux lets only
``net.unix.max_dgram_qlen`` datagrams (10 by default) wait in an unconnected receiver's queue, so a loop
busy for a millisecond would have pushed a trainer back to the wire; a connection's queue is bounded by
the sender's buffer instead (``SEND_BUFFER_BYTES``: ~2,700 events, ~550 where ``net.core.wmem_max`` is
Linux's default). Why not shared memory: the
manager's loop would have to poll it or be woken by a second system call.

**Falling back to the wire, in order.** A send that fails (the manager fell thousands of events behind, or died)
returns False and the reporter sends that event and every later one of the same connection over gRPC
(:class:`~freeride.training.reporter.BubbleReporter`); the next connection tries datagrams again. So a
connection's events go by datagram first, then by the wire, never back: the loop reads every waiting
datagram before it takes each batch of wire events (``ManagerLoop._take_inbox``), so none of a
connection's wire events is handled before a datagram that was sent before it.

The format is fixed-size little-endian fields after a one-byte tag, then UTF-8 text: packing it costs the
training thread ~0.6 us (a protobuf message costs ~6 us in Python). The manager decodes and validates a
datagram exactly as it validates an event from the wire (:func:`~freeride.messages.validate_bubble_event`);
a datagram it cannot decode is counted as a rejected event, and the loop goes on.
"""

from __future__ import annotations

import json
import os
import select
import socket
import struct
from pathlib import Path

from freeride.errors import ConfigError
from freeride.messages import BubbleEnd, BubbleStart, TrainerEvent, TrainerLayout

_TAG_START, _TAG_END, _TAG_LAYOUT = 1, 2, 3
#: A start or end the trainer held back on purpose (a quiet slot's: :meth:`freeride._boards.EndBoard.quiet`) and
#: sends with a later event: the same fields; the manager does not time its delay.
_TAG_START_LATE, _TAG_END_LATE = 4, 5
_LATE_TAGS = (_TAG_START_LATE, _TAG_END_LATE)
#: tag, stage, rank, iteration, slot, start, predicted, free memory, learned; then the kind (UTF-8).
_START = struct.Struct("<Bqqqqqqq?")
#: tag, stage, rank, iteration, slot, end.
_END = struct.Struct("<Bqqqqq")
#: tag, stages, micro-batches, at, free memory; then ``[schedule, [stage devices]]`` as JSON (rare: a re-shard).
_LAYOUT = struct.Struct("<Bqqqq")
#: The longest datagram either side handles; an event that encodes longer goes over the wire.
MAX_DATAGRAM = 16384
#: The sender's buffer asked for (the kernel doubles it, capped by ``net.core.wmem_max``); an event of
#: ~60 bytes costs ~770 bytes of it.
SEND_BUFFER_BYTES = 1 << 20


def local_events_path(socket_path: str) -> Path:
    """Where the manager listening on the unix socket ``socket_path`` takes a local trainer's events."""
    return Path(socket_path + ".events")


def encode(event: TrainerEvent) -> bytes:
    """One event as a datagram (the reporter packs the hot events itself, field by field: same bytes)."""
    if isinstance(event, BubbleStart):
        return _START.pack(_TAG_START, event.stage, event.rank, event.iteration, event.slot, event.start_ns,
                           event.predicted_ns, event.free_memory_bytes, event.learned) + event.kind.encode()
    if isinstance(event, BubbleEnd):
        return _END.pack(_TAG_END, event.stage, event.rank, event.iteration, event.slot, event.end_ns)
    return _LAYOUT.pack(_TAG_LAYOUT, event.stages, event.microbatches, event.at_ns, event.free_memory_bytes) + \
        json.dumps([event.schedule, list(event.stage_devices), event.job]).encode()


def decode(data: bytes) -> TrainerEvent:
    """The event a datagram carries, not yet validated; :class:`ConfigError` says why it is not one."""
    if not data:
        raise ConfigError("an empty datagram is not a bubble event")
    tag = data[0]
    try:
        if tag in (_TAG_START, _TAG_START_LATE) and len(data) >= _START.size:
            _, stage, rank, iteration, slot, start_ns, predicted_ns, free, learned = _START.unpack_from(data)
            kind = data[_START.size:].decode()
            return BubbleStart(stage, rank, iteration, slot, kind, start_ns, predicted_ns, free, learned)
        if tag in (_TAG_END, _TAG_END_LATE) and len(data) == _END.size:
            _, stage, rank, iteration, slot, end_ns = _END.unpack(data)
            return BubbleEnd(stage, rank, iteration, slot, end_ns)
        if tag == _TAG_LAYOUT and len(data) >= _LAYOUT.size:
            _, stages, microbatches, at_ns, free = _LAYOUT.unpack_from(data)
            text = json.loads(data[_LAYOUT.size:].decode())
            if not isinstance(text, list) or len(text) not in (2, 3):  # [schedule, devices] from before jobs
                raise ConfigError("a layout datagram's text must be [schedule, [stage devices], job]")
            schedule, devices, job = (*text, "") if len(text) == 2 else text
            if not isinstance(schedule, str) or not isinstance(devices, list) or not isinstance(job, str) or \
                    not all(isinstance(d, str) for d in devices):
                raise ConfigError("a layout datagram's text must be [schedule, [stage devices], job]")
            return TrainerLayout(schedule, stages, microbatches, tuple(devices), at_ns, free, job)
    except UnicodeDecodeError as exc:
        raise ConfigError(f"a datagram's text is not UTF-8: {exc}") from None
    except ValueError as exc:  # json.JSONDecodeError, or a text that does not unpack
        raise ConfigError(f"a layout datagram's text is malformed: {exc}") from None
    raise ConfigError(f"a datagram of {len(data)} bytes with tag {tag} is no bubble event")


def sent_late(data: bytes) -> bool:
    """Whether a datagram is an event the trainer held back on purpose (not to be timed as its delay)."""
    return bool(data) and data[0] in _LATE_TAGS


class LocalEvents:
    """The manager's end: a listening socket and one connection per reporter, behind one epoll descriptor
    that the loop selects on (:meth:`fileno`); :meth:`read` accepts whoever connected and reads everything
    waiting (level-triggered: what one call leaves makes the descriptor readable again). A connection the
    trainer closed (or died with) is closed here too."""

    #: Reporters at once: a device hosts a few ranks; more are refused (they report over the wire).
    MAX_CONNECTIONS = 64

    def __init__(self, path: Path) -> None:
        self.path = path
        self.refused = 0
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
        try:
            path.unlink(missing_ok=True)  # left behind by a manager that was killed (the caller checked)
            old = os.umask(0o177)
            try:
                listener.bind(str(path))
            finally:
                os.umask(old)
            listener.listen(self.MAX_CONNECTIONS)
        except OSError:
            listener.close()
            raise
        self._listener = listener
        self._epoll = select.epoll()
        self._epoll.register(listener.fileno(), select.EPOLLIN)
        self._conns: dict[int, socket.socket] = {}
        #: The job each connection's trainer named in its layout (:meth:`set_job`), until the connection closes.
        self._jobs: dict[int, str] = {}

    def fileno(self) -> int:
        return self._epoll.fileno()

    def listener_fileno(self) -> int:
        """The listening socket alone: readable when a trainer connects (a loop that reads the connections
        late still takes each new one at once, to know it has some)."""
        return self._listener.fileno()

    def accept(self) -> int:
        """Take every waiting connection (their messages are read by :meth:`read`); how many."""
        return len(self._accept())

    @property
    def connections(self) -> int:
        return len(self._conns)

    def read(self) -> list[bytes]:
        """Every message waiting now on the connections that have one, each connection's in its order."""
        return [data for _, data in self.read_from()]

    def read_from(self) -> list[tuple[int, bytes]]:
        """:meth:`read`, each message with its connection (a key for :meth:`set_job` and :meth:`job`)."""
        out: list[tuple[int, bytes]] = []
        ready = [fd for fd, _ in self._epoll.poll(0)]
        if self._listener.fileno() in ready:
            ready += self._accept()  # a new connection may have sent already
        for fd in ready:
            conn = self._conns.get(fd)
            while conn is not None:
                try:
                    data = conn.recv(MAX_DATAGRAM)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError:  # reset by a trainer that died
                    data = b""
                if not data:  # the trainer closed its end
                    self._epoll.unregister(fd)
                    del self._conns[fd]
                    self._jobs.pop(fd, None)
                    conn.close()
                    break
                out.append((fd, data))
        return out

    def set_job(self, connection: int, job: str) -> None:
        """The trainer on ``connection`` named its job (in a layout): its later messages are that job's."""
        if connection in self._conns:  # not one closed meanwhile, whose number a new connection may take
            self._jobs[connection] = job

    def job(self, connection: int) -> str:
        """The job the trainer on ``connection`` named; "" before it named one (or once it closed)."""
        return self._jobs.get(connection, "")

    def _accept(self) -> list[int]:
        """Take every waiting connection; their descriptors."""
        new: list[int] = []
        while True:
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return new
            except OSError:  # a connection aborted before it was taken
                continue
            if len(self._conns) >= self.MAX_CONNECTIONS:
                self.refused += 1
                conn.close()
                continue
            conn.setblocking(False)
            self._conns[conn.fileno()] = conn
            self._epoll.register(conn.fileno(), select.EPOLLIN)
            new.append(conn.fileno())

    def close(self) -> None:
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()
        self._epoll.close()
        self._listener.close()
        try:
            self.path.unlink()
        except OSError:
            pass


class LocalEventSender:
    """The trainer's end: one connection. Every send returns at once, True when it went."""

    _FLAGS = socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL

    def __init__(self, path: Path) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
        try:
            # Room for thousands of events if the loop is busy (the kernel caps it at net.core.wmem_max).
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
            sock.connect(str(path))
        except OSError:
            sock.close()
            raise
        self._send = sock.send
        self._sock = sock

    def send_start(self, stage: int, rank: int, iteration: int, slot: int, kind: str, start_ns: int,
                   predicted_ns: int, free_memory_bytes: int, learned: bool, late: bool = False) -> bool:
        """``late``: held back on purpose (a quiet slot's), sent now with a later event."""
        try:
            data = _START.pack(_TAG_START_LATE if late else _TAG_START, stage, rank, iteration, slot, start_ns,
                               predicted_ns, free_memory_bytes, learned) + kind.encode()
            if len(data) > MAX_DATAGRAM:
                return False
            self._send(data, self._FLAGS)
            return True
        except (OSError, struct.error, UnicodeError):  # full, gone, or a field out of range: the wire says why
            return False

    def send_end(self, stage: int, rank: int, iteration: int, slot: int, end_ns: int, late: bool = False) -> bool:
        try:
            self._send(_END.pack(_TAG_END_LATE if late else _TAG_END, stage, rank, iteration, slot, end_ns),
                       self._FLAGS)
            return True
        except (OSError, struct.error):
            return False

    def send(self, event: TrainerEvent) -> bool:
        """Any event (a layout: rare, off the hot path)."""
        try:
            data = encode(event)
            if len(data) > MAX_DATAGRAM:
                return False
            self._send(data, self._FLAGS)
            return True
        except (OSError, struct.error, UnicodeError, TypeError, ValueError):
            return False

    def close(self) -> None:
        self._sock.close()
