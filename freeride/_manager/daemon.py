"""Assembly of one manager: device, loop, gRPC server (Trainer, Control, health), endpoint.

``Manager.serve_forever()`` is what ``freeride manager`` runs: the loop on the main thread (so
worker processes, which die with the thread that spawned them, live as long as the manager), and
SIGTERM/SIGINT draining every task before exit. ``Manager.start()`` runs the loop on a background
thread instead, for tests and embedding. With ``metrics_port`` set, a Prometheus ``/metrics``
endpoint (``freeride._manager.metrics``) starts and stops with the gRPC server. With ``queue`` set,
a :class:`~freeride._cluster.agent.QueueAgent` joins the cluster queue once the server serves, and
hands back what the manager still holds when it stops.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2

from freeride._boards import EndBoard, end_board_path
from freeride._local_events import LocalEvents, local_events_path
from freeride._manager.addresses import AddressWatch
from freeride._manager.core import CoreConfig
from freeride._manager.loop import LoopConfig, ManagerLoop
from freeride._manager.metrics import DEFAULT_ADDRESS, MetricsServer
from freeride._manager.servicers import TokenInterceptor, add_raw_service, add_servicers
from freeride._manager.state_lock import StateDirLock, default_state_dir_of, lock_holder
from freeride.devices import Device, open_device
from freeride.endpoints import MAX_MESSAGE_BYTES, Endpoint, default_endpoint
from freeride.errors import ConfigError

if TYPE_CHECKING:
    from freeride._cluster.agent import QueueAgent, QueueConfig

log = logging.getLogger(__name__)

FIRST_READING_TIMEOUT_S = 2.0


def default_state_dir(device: Device) -> Path:
    return default_state_dir_of(device.name)


def _socket_in_use(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except OSError:
            return False
        return True


def _tcp_bind_refusal(address: str) -> str | None:
    """Why ``host:port`` cannot be listened on, in a few words, or None when every address it resolves to
    binds now (a fixed port only: port 0 always binds).

    Asked before gRPC binds: gRPC's own refusal is "Failed to bind to address", after a log line of its C core
    on stderr (``E... add_port.cc``) that a user cannot act on. A port taken between this probe and the bind
    still fails, with gRPC's words.
    """
    host, _, port = address.rpartition(":")
    if not port.isdigit() or int(port) == 0:
        return None
    try:
        infos = socket.getaddrinfo(host.strip("[]") or None, int(port), type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return f"{host} does not resolve ({exc.strerror})"
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds: TIME_WAIT is no refusal
            try:
                probe.bind(sockaddr)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    return f"port {port} is in use (another manager, or another program, listens there)"
                return f"{sockaddr[0]} port {port}: {exc.strerror}"
    return None


def _prepare_checkpoint_dir(path: Path) -> None:
    """The shared checkpoint directory must exist and take writes before the manager claims anything."""
    from freeride._manager.store import check_writable

    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        check_writable(path)
    except OSError as exc:
        raise ConfigError(f"checkpoint directory {path} is not writable: {exc}") from None


class Manager:
    def __init__(
        self,
        device: str | Device,
        endpoint: Endpoint | None = None,
        state_dir: Path | None = None,
        token: str | None = None,
        core: CoreConfig | None = None,
        memory_poll_ms: float = 50.0,
        device_poll_ms: float = 1000.0,
        max_workers: int = 16,
        trace_path: Path | None = None,
        metrics_port: int | None = None,
        metrics_address: str = DEFAULT_ADDRESS,
        queue: QueueConfig | None = None,
        node: str | None = None,
        worker_log_max_bytes: int = 8 * 2**20,
        worker_log_backups: int = 1,
        event_spin_ns: int = 0,
        idle_read_ns: int | None = None,
        trainer_stops: bool = True,
        quiet_slots: bool = True,
    ) -> None:
        """``metrics_port``: None serves no metrics; 0 serves them on a free port (see ``metrics.port``).
        ``queue``: join the cluster queue; ``node``: this host's name there (default: the host name).
        ``worker_log_max_bytes``, ``worker_log_backups``: each task's log is rotated at that size, and
        that many older logs are kept. ``event_spin_ns``: the loop stays awake this long after each trainer
        event (:attr:`LoopConfig.event_spin_ns`). ``idle_read_ns``: with no side task resident, a local trainer's
        events are read this often (:attr:`LoopConfig.idle_read_ns`; None: its default; 0: at each).
        ``trainer_stops``: a local trainer stops a step still running at its end (:attr:`LoopConfig.trainer_stops`).
        ``quiet_slots``: a local trainer holds back the events of slots no task could use
        (:attr:`LoopConfig.quiet_slots`)."""
        self.device = open_device(device) if isinstance(device, str) else device
        self.endpoint = endpoint or default_endpoint(self.device.name)
        if self.endpoint.kind == "tcp" and not token:
            raise ConfigError("a TCP endpoint needs a token (--token-file or $FREERIDE_TOKEN)")
        self.state_dir = state_dir or default_state_dir(self.device)
        self.node = node or socket.gethostname()
        if queue is not None:
            _prepare_checkpoint_dir(queue.checkpoint_dir)
        #: Where a trainer on this host (as this user: the socket's directory is owner-only) writes its
        #: bubble ends for the workers to read at once (:mod:`freeride._boards`). TCP: none.
        self.end_board = end_board_path(self.endpoint.address) if self.endpoint.kind == "unix" else None
        #: The files trainers and clients reach it by, once made (watched by the loop: :mod:`addresses`).
        self._watched: dict[str, Path] = {}
        if self.endpoint.kind == "unix" and not os.path.exists(self.endpoint.address):
            self._refuse_a_manager_without_its_socket()  # before this one's state directory is made
        # Before the loop recovers the directory's tasks (and kills what it takes for a dead manager's workers).
        self.state_lock = StateDirLock(self.state_dir, str(self.endpoint))
        try:
            self.loop = ManagerLoop(
                self.device,
                LoopConfig(
                    state_dir=self.state_dir,
                    core=core or CoreConfig(),
                    memory_poll_ms=memory_poll_ms,
                    device_poll_ms=device_poll_ms,
                    trace_path=trace_path,
                    node=self.node,
                    checkpoint_root=queue.checkpoint_dir if queue is not None else None,
                    worker_log_max_bytes=worker_log_max_bytes,
                    worker_log_backups=worker_log_backups,
                    end_board_path=self.end_board,
                    event_spin_ns=event_spin_ns,
                    **({} if idle_read_ns is None else {"idle_read_ns": idle_read_ns}),
                    trainer_stops=trainer_stops,
                    quiet_slots=quiet_slots,
                ),
                state_lock=self.state_lock,
            )
        except BaseException:
            self.state_lock.release()
            raise
        self.agent: QueueAgent | None = None
        if queue is not None:
            from freeride._cluster.agent import QueueAgent

            self.agent = QueueAgent(self.loop, queue, str(self.device), self.node)
        interceptors = [TokenInterceptor(token)] if token else []
        self.server = grpc.server(
            ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=f"grpc-{self.device.name.slug}"),
            interceptors=interceptors,
            options=[
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.so_reuseport", 0),
                # Keep each stream's receive window at gRPC's default 64 KiB. With bandwidth-delay
                # probing a saturating trainer stream grew it to megabytes: seconds of stale bubble
                # events buffered in the transport, past the loop's own bound (a 1.8 s median event
                # delay in bench/bench_load.py, 0.1 s without). Control calls are small either way.
                ("grpc.http2.bdp_probe", 0),
            ],
        )
        add_servicers(self.server, self.loop)
        self.health = health.HealthServicer()
        add_raw_service(self.server, health_pb2, "Health", self.health)
        self.loop.on_draining = self._update_health
        self.loop.on_device_state = lambda problem: self._update_health()
        self._thread: threading.Thread | None = None
        self.port = 0
        self.metrics = MetricsServer(self.loop, metrics_address, metrics_port) if metrics_port is not None else None

    def _update_health(self) -> None:
        """SERVING unless draining or the device cannot be read (its problem is in Stats and the log)."""
        unusable = self.loop.core.draining or bool(self.loop.core.device_problem)
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING if unusable
                         else health_pb2.HealthCheckResponse.SERVING)

    def _set_health(self, status: int) -> None:
        self.health.set("", status)
        for service in ("freeride.v1.Trainer", "freeride.v1.Control"):
            self.health.set(service, status)

    def _bind(self) -> None:
        if self.endpoint.kind == "unix":
            path = self.endpoint.address
            parent = Path(path).parent
            if not parent.parent.is_dir():
                # One level is made (a runtime directory's ``freeride``); more is a typo in --endpoint, which
                # made /nonexistent/dir and served there.
                raise ConfigError(f"cannot listen at {self.endpoint}: {parent.parent} does not exist")
            parent.mkdir(exist_ok=True, mode=0o700)
            if os.path.exists(path):
                if _socket_in_use(path):
                    raise ConfigError(f"a manager is already listening at {self.endpoint}")
                os.unlink(path)  # left behind by a manager that was killed
            if self.end_board is not None:
                try:
                    EndBoard.create(self.end_board)  # after the check: a running manager's board stays
                except OSError as exc:
                    log.warning("[%s] no end board at %s (%s): bubble ends reach workers through the manager "
                                "only", self.device, self.end_board, exc)
                    self.end_board = None
            if self.end_board is not None:
                try:
                    self.loop.listen_locally(LocalEvents(local_events_path(path)))
                    self._watched["events"] = local_events_path(path)
                except OSError as exc:
                    log.warning("[%s] no local event socket at %s (%s): a trainer on this host reports over the "
                                "wire", self.device, local_events_path(path), exc)
            old = os.umask(0o177)
            try:
                self.port = self.server.add_insecure_port(self.endpoint.grpc_target)
            finally:
                os.umask(old)
        else:
            refusal = _tcp_bind_refusal(self.endpoint.address)
            if refusal is not None:
                raise ConfigError(f"cannot listen on {self.endpoint}: {refusal}")
            try:
                self.port = self.server.add_insecure_port(self.endpoint.grpc_target)
            except RuntimeError as exc:
                raise ConfigError(f"cannot listen on {self.endpoint}: {exc}") from None
            if self.port == 0:
                raise ConfigError(f"cannot listen on {self.endpoint}")

    def _refuse_a_manager_without_its_socket(self) -> None:
        """Refuse to start beside a running manager of this device and endpoint whose socket was removed under it
        (a sweep of /tmp): it holds the device's default state directory, and its lock says its endpoint. A
        stranger, told that no manager answered, started a second one with another state directory, and two
        managers granted the same device's bubbles."""
        default = default_state_dir_of(self.device.name)
        if self.state_dir.resolve() == default.resolve():
            return  # the state directory's own lock refused it already, if held
        holder = lock_holder(default)
        if holder.endswith(f"endpoint {self.endpoint}"):
            raise ConfigError(f"a manager of {self.device.name} runs here ({holder}, state in {default}) and its "
                              f"socket {self.endpoint.address} was removed under it: stop it first (SIGTERM drains "
                              "its tasks), then start this one")

    def _serve(self) -> None:
        if self.agent is not None:
            self.agent.check_credentials()  # refused credentials stop the start; an outage does not
        # The device's first reading goes into the loop's inbox before any request (a scrape included)
        # can arrive: a new manager then answers with a memory budget. Bounded: a device that does not
        # answer yet is reported as such by the poller, and serving does not wait on it.
        self.loop.poller.start()
        self.loop.poller.first_reading.wait(FIRST_READING_TIMEOUT_S)
        try:
            if self.metrics is not None:
                self.metrics.start()  # a busy metrics port fails before the gRPC endpoint is bound
            self._bind()
        except BaseException:
            self.loop.poller.stop()
            if self.metrics is not None:
                self.metrics.stop()
            self.state_lock.release()
            raise
        self.server.start()
        if self.endpoint.kind == "unix":
            os.chmod(self.endpoint.address, 0o600)
            self._watched["socket"] = Path(self.endpoint.address)
            if self.end_board is not None:
                self._watched["board"] = self.end_board
            self.loop.watch_addresses(AddressWatch(str(self.device), self._watched))
        self._update_health()
        log.info("[%s] manager listening on %s (state in %s); %s", self.device, self.endpoint, self.state_dir,
                 self.device.describe())
        if self.agent is not None:
            self.agent.start()

    def serve_forever(self, serving: Callable[[], None] | None = None) -> None:
        """Serve until SIGTERM/SIGINT; then drain every task and return. ``serving`` is called once the manager
        serves (its endpoint is its own): what it says comes after a refusal never does."""
        self._serve()
        if serving is not None:
            serving()
        self.loop.install_signal_handlers()
        try:
            self.loop.run()
        finally:
            self._shutdown_server()
            self._close_agent()

    def _close_agent(self) -> None:
        """After the loop stopped: hand back to the queue what it released while draining."""
        if self.agent is not None:
            self.agent.close()

    def start(self) -> None:
        """Serve with the loop on a background thread (tests, embedding)."""
        self._serve()
        self._thread = threading.Thread(target=self._run_loop, name=f"manager-{self.device.name.slug}", daemon=True)
        self._thread.start()

    def _run_loop(self) -> None:
        try:
            self.loop.run()
        except Exception:
            log.exception("[%s] manager loop crashed", self.device)

    def stop(self, drain: bool = False, timeout_s: float = 30.0) -> None:
        if drain:
            from freeride._manager.requests import Shutdown

            self.loop.post(Shutdown())
        else:
            self.loop.stop()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._shutdown_server()
        self._close_agent()

    def _shutdown_server(self) -> None:
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        self.server.stop(grace=0.5).wait(2.0)
        if self.metrics is not None:
            self.metrics.stop()
        if self._thread is None or not self._thread.is_alive():
            self.loop.poller.stop()  # stopped by the loop already, unless the loop never ran
            self.loop.release()
            self.device.close()
            self.state_lock.release()
        if self.endpoint.kind == "unix":
            for path in (self.endpoint.address, self.end_board):
                try:
                    if path is not None:
                        os.unlink(path)
                except FileNotFoundError:
                    pass
