"""The client side of the protocol edge: ``ControlClient``, ``BubbleStream`` and the health check.

Plain dataclasses (``freeride.messages``) go out and come back through :mod:`freeride._wire.codec`,
which the manager's servicers share; gRPC status codes map onto freeride's error tree in one place
(:func:`map_rpc_errors`).
"""

from __future__ import annotations

import builtins
import contextlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import grpc

from freeride._wire import codec
from freeride._wire import freeride_pb2 as _pb
from freeride._wire import freeride_pb2_grpc as _pb_grpc
from freeride._wire.codec import bubble_message_to_pb
from freeride.devices.base import parse_device_name
from freeride.endpoints import MAX_MESSAGE_BYTES, Endpoint, default_endpoint, parse_endpoint
from freeride.errors import (
    ConfigError,
    DrainIncomplete,
    FreerideError,
    ManagerUnavailable,
    RequestRejected,
    TaskNotFound,
    Unauthenticated,
)
from freeride.messages import (
    BubbleSlotStats,
    Drained,
    ManagerStats,
    StreamSummary,
    TaskEvent,
    TaskInfo,
    TaskSpec,
    TrainerEvent,
)

_CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Reconnect quickly when a manager (re)starts; the reporter backs off on its own as well.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


def open_channel(endpoint: Endpoint) -> grpc.Channel:
    """An insecure channel (unix sockets are owner-only; TCP callers carry a token)."""
    return grpc.insecure_channel(endpoint.grpc_target, options=_CHANNEL_OPTIONS)


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"bearer {token}"),) if token else ()


#: How a manager's own UNAVAILABLE details begin ("the manager is stopping", "the manager loop did not
#: answer in time"): shown as given, where a transport failure (nobody listens) gets the generic hint.
MANAGER_UNAVAILABLE_PREFIX = "the manager "


@contextlib.contextmanager
def map_rpc_errors(endpoint: Endpoint) -> Iterator[None]:
    """Translate :class:`grpc.RpcError` into the freeride error tree."""
    try:
        yield
    except grpc.RpcError as exc:
        code = exc.code() if hasattr(exc, "code") else None
        details = (exc.details() if hasattr(exc, "details") else None) or str(code)
        if code == grpc.StatusCode.UNAVAILABLE and details.startswith(MANAGER_UNAVAILABLE_PREFIX):
            raise ManagerUnavailable(f"{details} (at {endpoint})") from None
        # CANCELLED: a manager stopping cancels the calls still in flight after its grace period
        # (our clients cancel no call of their own through here: a cancelled future raises elsewhere).
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
            raise ManagerUnavailable(
                f"no manager answers at {endpoint}: none runs there, or it is stopping "
                "(start one with `freeride manager --device ...`)"
            ) from None
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            raise RequestRejected(details) from None
        if code == grpc.StatusCode.NOT_FOUND:
            raise TaskNotFound(details) from None
        if code == grpc.StatusCode.UNAUTHENTICATED:
            raise Unauthenticated(details) from None
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            raise RequestRejected(details) from None
        raise FreerideError(f"manager error ({code.name if code else 'unknown'}): {details}") from None


# ------------------------------------------------------------------ clients


def _endpoint_from_text(text: str) -> Endpoint:
    try:
        name = parse_device_name(text)
    except ConfigError:
        return parse_endpoint(text)
    return default_endpoint(name)


class ControlClient:
    """Blocking client of a manager's Control service; returns plain dataclasses.

    Every method raises from the freeride error tree: :class:`ManagerUnavailable` when nobody
    answers, :class:`RequestRejected` for invalid requests, :class:`TaskNotFound`, ...
    """

    def __init__(self, endpoint: Endpoint | str, token: str | None = None, timeout_s: float = 10.0) -> None:
        """``endpoint``: an :class:`Endpoint`, or text: a device (``"cuda:0"``: the socket of its
        manager on this host), ``unix:/path``, ``tcp://host:port``. ``token``: for TCP endpoints."""
        if isinstance(endpoint, str):
            endpoint = _endpoint_from_text(endpoint)
        self.endpoint = endpoint
        self._timeout_s = timeout_s
        self._metadata = auth_metadata(token)
        self._channel = open_channel(endpoint)
        self._stub = _pb_grpc.ControlStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: Any, request: Any, timeout_s: float | None = None) -> Any:
        with map_rpc_errors(self.endpoint):
            return method(request, timeout=timeout_s or self._timeout_s, metadata=self._metadata)

    def submit(self, spec: TaskSpec, check: bool = False) -> TaskInfo:
        """Submit ``spec``; the manager checks what it can without importing user code (it never does).

        ``check``: first check it in this process as ``freeride submit`` does: import its class (from
        ``spec.working_dir``, else the current directory, first), build it once with its arguments and drop
        it, and take its ``estimate_memory`` for a ``memory_bytes`` of 0. A bad target, argument or value
        then raises :class:`TaskLoadError` or :class:`ConfigError` here, in one line, rather than failing
        ``IMPORT`` or ``CONFIG`` in the worker later. It runs the task's module and constructor here, and sets an
        empty ``working_dir`` to the current directory (as ``freeride submit`` does). Without ``check`` the spec goes
        as it is: a class in a module beside the caller's script needs ``working_dir``, or the worker cannot import it
        (the manager may be on another host, where this directory means nothing)."""
        if check:
            from freeride._validation import checked_spec

            spec = checked_spec(spec)
        return codec.task_info_from_pb(self._call(self._stub.Submit, codec.spec_to_pb(spec)))

    def list(self, include_finished: bool = True) -> list[TaskInfo]:
        reply = self._call(self._stub.List, _pb.ListRequest(include_finished=include_finished))
        return [codec.task_info_from_pb(t) for t in reply.tasks]

    def get(self, task_id: str) -> TaskInfo:
        return codec.task_info_from_pb(self._call(self._stub.Get, _pb.GetRequest(task_id=task_id)))

    def cancel(self, task_id: str) -> TaskInfo:
        return codec.task_info_from_pb(self._call(self._stub.Cancel, _pb.CancelRequest(task_id=task_id)))

    def stats(self) -> ManagerStats:
        return codec.stats_from_pb(self._call(self._stub.Stats, _pb.StatsRequest()))

    def bubbles(self) -> builtins.list[BubbleSlotStats]:  # `list` is a method here
        return [codec.slot_from_pb(s) for s in self._call(self._stub.Bubbles, _pb.BubblesRequest()).slots]

    def drain(self, timeout_s: float = 30.0) -> Drained:
        """Drain and wait up to ``timeout_s``: (tasks parked, of them checkpointed at their last step, of them
        killed past the stop timeout), or :class:`DrainIncomplete`.

        Idempotent: on a drained manager it returns at once.
        """
        drained, timed_out = codec.drain_from_pb(
            self._call(self._stub.Drain, _pb.DrainRequest(timeout_s=timeout_s), timeout_s + 5))
        if timed_out:
            raise DrainIncomplete(
                f"the drain of the manager at {self.endpoint} did not finish within {timeout_s:g} s: tasks are "
                "still stopping (one that ignores its stop is killed after the manager's --stop-timeout-s); "
                "run drain again to wait on"
            )
        return drained

    def watch(self) -> Iterator[TaskEvent]:
        """Live events until the manager stops or the caller stops iterating."""
        with map_rpc_errors(self.endpoint):
            for msg in self._stub.Watch(_pb.WatchRequest(), metadata=self._metadata):
                event = codec.event_from_pb(msg)
                if event is not None:
                    yield event

    def wait_ready(self, timeout_s: float) -> None:
        """Block until the manager's channel is ready, or raise :class:`ManagerUnavailable`."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            raise ManagerUnavailable(f"no manager answered at {self.endpoint} within {timeout_s} s") from None


def health_status(endpoint: Endpoint, timeout_s: float = 2.0, token: str | None = None) -> str:
    """The manager's ``grpc.health.v1`` status (``SERVING``, ``NOT_SERVING``, ...)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with open_channel(endpoint) as channel, map_rpc_errors(endpoint):
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=timeout_s, metadata=auth_metadata(token)
        )
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


class BubbleStream:
    """One open ``Trainer.StreamBubbles`` call fed from an iterator of messages.

    Each item the iterator yields is one message: a bubble event, or a sequence of events sent as
    one batch (see :func:`bubble_message_to_pb`). The call runs on gRPC's own threads; :meth:`done`
    tells whether it ended (the manager went away, or the iterator finished); :meth:`summary`
    returns the manager's counts and :meth:`result` ``(accepted, rejected)``, or they raise
    :class:`ManagerUnavailable`.
    """

    def __init__(
        self,
        endpoint: Endpoint,
        messages: Iterable[TrainerEvent | Sequence[TrainerEvent]],
        token: str | None = None,
    ) -> None:
        self.endpoint = endpoint
        self._channel = open_channel(endpoint)
        stub = _pb_grpc.TrainerStub(self._channel)
        self._future = stub.StreamBubbles.future(
            (bubble_message_to_pb(m) for m in messages), metadata=auth_metadata(token)
        )
        self._token = token

    def answers(self, timeout_s: float) -> bool:
        """Whether the manager answers a health check on this stream's channel within ``timeout_s`` (the
        channel's connection waited for meanwhile). gRPC connects lazily: an open call alone says nothing
        about whether anyone listens."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        try:
            health_pb2_grpc.HealthStub(self._channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout_s, wait_for_ready=True,
                metadata=auth_metadata(self._token))
        except (grpc.RpcError, ValueError):  # ValueError: the channel was closed meanwhile
            return False
        return True

    def done(self) -> bool:
        return bool(self._future.done())

    def summary(self, timeout_s: float | None = None) -> StreamSummary:
        with map_rpc_errors(self.endpoint):
            reply = self._future.result(timeout=timeout_s)
        return codec.summary_from_pb(reply)

    def result(self, timeout_s: float | None = None) -> tuple[int, int]:
        summary = self.summary(timeout_s)
        return summary.accepted, summary.rejected

    def cancel(self) -> None:
        self._future.cancel()

    def close(self) -> None:
        self._future.cancel()
        self._channel.close()
