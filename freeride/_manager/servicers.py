"""The manager side of the protocol edge: gRPC services over the loop.

Requests are decoded and answers encoded with :mod:`freeride._wire.codec`, which the client shares;
the generated module is used here only to register the services and build the response wrappers.
Servicers validate and translate messages into plain dataclasses, then hand them to the loop:
bubble events are posted (the trainer never waits on the loop), control requests are called and
answered. Every invalid input gets ``INVALID_ARGUMENT`` with a precise message and changes nothing.
"""

from __future__ import annotations

import hmac
import logging
import os
import queue
import shutil
import time
from collections.abc import Callable, Iterator
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import grpc

from freeride._manager import requests as R
from freeride._manager.loop import ManagerLoop
from freeride._validation import shown, validate_submission
from freeride._wire import codec
from freeride._wire import freeride_pb2 as _pb
from freeride._wire import freeride_pb2_grpc as _pb_grpc
from freeride.endpoints import MAX_MESSAGE_BYTES
from freeride.errors import ConfigError, ManagerUnavailable, RequestRejected, StateNotWritable, TaskNotFound
from freeride.messages import MAX_CLOCK_AHEAD_NS, StreamSummary, TaskSpec, TrainerEvent, TrainerLayout

log = logging.getLogger(__name__)

#: Ids are ``<slug of at most 32 characters>-<sequence number>``; anything longer is not one.
MAX_TASK_ID_CHARS = 128
#: How long a control call waits for the loop at most, when the caller's deadline allows that much.
CALL_LIMIT_S = 10.0
#: A call is answered this long before the caller's deadline: a refusal that says why, rather than
#: the client's own DEADLINE_EXCEEDED, which reads as "no manager answers".
ANSWER_MARGIN_S = 0.2


# ------------------------------------------------------------------ validation


def spec_from_pb(msg: _pb.SubmitRequest) -> TaskSpec:
    """Validate a submission (:func:`validate_submission`, and a command's program: here is where it runs);
    raises :class:`RequestRejected`."""
    spec = validate_submission(codec.submission_from_pb(msg))
    if spec.command:
        check_program(spec.command[0])
    return spec


def check_program(program: str) -> None:
    """A command's program must be one this host can run: a bare name on the manager's ``PATH`` (its workers
    inherit it), or an absolute path to an executable file. A relative path runs from the task's work
    directory, which does not exist yet: it is tried when the task sets up. A missing program was accepted
    and the task then failed in setup with a traceback through freeride's own code."""
    if "/" not in program:
        if shutil.which(program) is None:
            raise RequestRejected(f"the command's program {shown(program)} is not on the manager's PATH")
    elif os.path.isabs(program) and not (os.path.isfile(program) and os.access(program, os.X_OK)):
        raise RequestRejected(f"the command's program {shown(program)} is not an executable file on the manager's host")


def check_task_id(task_id: str) -> None:
    """Refuse ids that cannot exist before they reach the loop (and its error message)."""
    if not task_id:
        raise RequestRejected("give a task id")
    if len(task_id) > MAX_TASK_ID_CHARS:
        raise RequestRejected(f"a task id has at most {MAX_TASK_ID_CHARS} characters, got {len(task_id)}")


def bubble_from_pb(msg: _pb.BubbleEvent, received_ns: int | None = None) -> TrainerEvent:
    """Validate a bubble event or layout; with ``received_ns``, times ahead of this host's clock are refused."""
    return codec.trainer_event_from_pb(msg, None if received_ns is None else received_ns + MAX_CLOCK_AHEAD_NS)


# ------------------------------------------------------------------ servicers


def _wait_s(context: grpc.ServicerContext, limit_s: float) -> float:
    """How long a call may wait for the loop: ``limit_s``, less when the caller's deadline is nearer."""
    remaining = context.time_remaining()
    if remaining is None:
        return limit_s
    return max(0.0, min(limit_s, remaining - ANSWER_MARGIN_S))


def _call(loop: ManagerLoop, context: grpc.ServicerContext, request: R.Request,
          limit_s: float = CALL_LIMIT_S) -> Any:
    """Run ``request`` on the loop and return its answer, or abort with the status that says why.

    Every state answers before the caller's deadline: serving, draining, drained (the loop answers)
    and stopping (:meth:`~freeride._manager.loop.ManagerLoop.call_async` refuses at once).
    """
    try:
        return loop.call(request, _wait_s(context, limit_s))
    except ManagerUnavailable as exc:  # the loop has stopped
        context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
    except StateNotWritable as exc:  # the state directory refused the write: retry when space returns
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
    except RequestRejected as exc:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    except TaskNotFound as exc:
        context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
    except FutureTimeout:
        context.abort(grpc.StatusCode.UNAVAILABLE, "the manager loop did not answer in time")


def _check_id_or_abort(task_id: str, context: grpc.ServicerContext) -> None:
    try:
        check_task_id(task_id)
    except RequestRejected as exc:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))


class TrainerServicer(_pb_grpc.TrainerServicer):
    def __init__(self, loop: ManagerLoop) -> None:
        self._loop = loop

    def StreamBubbles(self, request_iterator: Iterator[_pb.BubbleEvent], context: grpc.ServicerContext) -> Any:
        """Validate every event on its own; post each message's valid events to the loop at once.

        A message is one event or a batch (``BubbleEvent.batch``), unpacked in order. A malformed
        event, a batch nested in a batch included, is rejected and counted alone: its neighbours
        still go through, in order. The summary counts events, never messages.
        """
        accepted = rejected = dropped = 0
        last_error = ""
        job = ""  # as the stream's last layout named it: its events are that run's (SchedulerCore._follows)
        for msg in request_iterator:
            received_ns = time.monotonic_ns()
            events: list[TrainerEvent] = []
            for part in codec.message_parts(msg):
                try:
                    events.append(bubble_from_pb(part, received_ns))
                except ConfigError as exc:
                    # One bad event must not cost the trainer its stream: count it, say why, go on.
                    rejected += 1
                    self._loop.inbox.reject()
                    last_error = str(exc)
            if events:
                job = next((e.job for e in reversed(events) if isinstance(e, TrainerLayout)), job)
                lost = self._loop.post_bubbles(events, received_ns, job)  # only when the manager is stopping
                dropped += lost
                accepted += len(events) - lost
        if rejected:
            log.warning("[%s] trainer stream: %d event(s) rejected, last: %s", self._loop.device, rejected, last_error)
        return codec.summary_to_pb(StreamSummary(accepted, rejected, dropped, last_error))


class ControlServicer(_pb_grpc.ControlServicer):
    def __init__(self, loop: ManagerLoop) -> None:
        self._loop = loop

    def Submit(self, request: _pb.SubmitRequest, context: grpc.ServicerContext) -> Any:
        try:
            spec = spec_from_pb(request)
        except RequestRejected as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return codec.task_info_to_pb(_call(self._loop, context, R.SubmitTask(spec)))

    def List(self, request: _pb.ListRequest, context: grpc.ServicerContext) -> Any:
        """Every task, in full while that fits one message; else summaries; else a precise refusal.

        Each task is bounded (arguments, command, failure text), but their number is not: without
        this, enough large tasks would make every listing exceed the message limit, for good. A
        summary leaves out the arguments and the failure's traceback and log tail (Get has them);
        the CLI's table shows none of them.
        """
        infos = _call(self._loop, context, R.ListTasks(request.include_finished))
        response = _pb.ListResponse(tasks=[codec.task_info_to_pb(i) for i in infos])
        if response.ByteSize() <= MAX_MESSAGE_BYTES:
            return response
        for task in response.tasks:
            task.args_json = ""
            if task.has_failure:
                task.failure.traceback = ""
                task.failure.log_tail = ""
        if response.ByteSize() <= MAX_MESSAGE_BYTES:
            return response
        context.abort(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"{len(infos)} tasks do not fit in one reply of {MAX_MESSAGE_BYTES} bytes even as summaries; "
            "list active tasks only, or get tasks one by one",
        )

    def Get(self, request: _pb.GetRequest, context: grpc.ServicerContext) -> Any:
        _check_id_or_abort(request.task_id, context)
        return codec.task_info_to_pb(_call(self._loop, context, R.GetTask(request.task_id)))

    def Cancel(self, request: _pb.CancelRequest, context: grpc.ServicerContext) -> Any:
        _check_id_or_abort(request.task_id, context)
        return codec.task_info_to_pb(_call(self._loop, context, R.CancelTask(request.task_id)))

    def Stats(self, request: _pb.StatsRequest, context: grpc.ServicerContext) -> Any:
        return codec.stats_to_pb(_call(self._loop, context, R.GetStats()))

    def Bubbles(self, request: _pb.BubblesRequest, context: grpc.ServicerContext) -> Any:
        return _pb.BubblesResponse(slots=[codec.slot_to_pb(s) for s in _call(self._loop, context, R.GetBubbles())])

    def Drain(self, request: _pb.DrainRequest, context: grpc.ServicerContext) -> Any:
        """Drain, waiting up to the request's timeout; a drain still under way is answered ``timed_out``.

        Idempotent: on a drained manager it answers at once. Its timeout is the drain's own, not
        the loop's: when it runs out the answer says so, rather than "the manager did not answer".
        """
        timeout = request.timeout_s if 0 < request.timeout_s <= 3600 else 60.0
        future = self._loop.call_async(R.Drain())
        try:
            parked, checkpointed, killed = future.result(_wait_s(context, timeout))
        except FutureTimeout:
            return codec.drain_to_pb(0, 0, timed_out=True)
        except ManagerUnavailable as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        return codec.drain_to_pb(parked, checkpointed, killed=killed)

    def Watch(self, request: _pb.WatchRequest, context: grpc.ServicerContext) -> Any:
        q = self._loop.subscribe()
        try:
            while context.is_active():
                try:
                    event = q.get(timeout=0.5)
                except queue.Empty:
                    continue
                if event is None:
                    return
                yield codec.event_to_pb(event)
        finally:
            self._loop.unsubscribe(q)


class TokenInterceptor(grpc.ServerInterceptor):
    """Every call must carry ``authorization: bearer <token>``; compared in constant time."""

    def __init__(self, token: str) -> None:
        self._expected = f"bearer {token}".encode()

    def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        handler = continuation(details)
        given = dict(details.invocation_metadata or ()).get("authorization", "")
        if hmac.compare_digest(str(given).encode(), self._expected) or handler is None:
            return handler

        def deny(request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong token")

        if handler.request_streaming and handler.response_streaming:
            make = grpc.stream_stream_rpc_method_handler
        elif handler.request_streaming:
            make = grpc.stream_unary_rpc_method_handler
        elif handler.response_streaming:
            make = grpc.unary_stream_rpc_method_handler
        else:
            make = grpc.unary_unary_rpc_method_handler
        return make(deny, handler.request_deserializer, handler.response_serializer)


# ------------------------------------------------------------------ registration: bytes in, decoded here

#: An undecodable request's refusal quotes the parser's complaint up to this many characters.
MAX_DECODE_ERROR_CHARS = 120


def _decode(message_class: Any, raw: bytes, context: grpc.ServicerContext, what: str = "the request") -> Any:
    """Parse ``raw`` as ``message_class``, or abort the call with INVALID_ARGUMENT and a bounded message."""
    try:
        return message_class.FromString(raw)
    except Exception as exc:  # noqa: BLE001 - DecodeError, or anything else the parser raises on bad bytes
        problem = str(exc)[:MAX_DECODE_ERROR_CHARS] or type(exc).__name__
        context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{what} is not a valid {message_class.DESCRIPTOR.full_name} ({len(raw)} bytes): {problem}",
        )


def _decoded_stream(message_class: Any, raws: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[Any]:
    for index, raw in enumerate(raws):
        yield _decode(message_class, raw, context, f"message {index} of the stream")


def _raw_handler(method: Any, module: Any, behavior: Callable[..., Any]) -> grpc.RpcMethodHandler:
    """A handler that receives the request bytes and decodes them itself (see :func:`add_raw_service`)."""
    request_class = getattr(module, method.input_type.name)
    serializer = getattr(module, method.output_type.name).SerializeToString
    if method.client_streaming:
        def streamed(raws: Iterator[bytes], context: grpc.ServicerContext) -> Any:
            return behavior(_decoded_stream(request_class, raws, context), context)

        streams = grpc.stream_stream_rpc_method_handler if method.server_streaming else None
        make = streams or grpc.stream_unary_rpc_method_handler
        return make(streamed, request_deserializer=None, response_serializer=serializer)

    def unary(raw: bytes, context: grpc.ServicerContext) -> Any:
        return behavior(_decode(request_class, raw, context), context)

    make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
    return make(unary, request_deserializer=None, response_serializer=serializer)


def add_raw_service(server: grpc.Server, module: Any, service_name: str, servicer: object) -> None:
    """Serve ``servicer`` for the service ``service_name`` of the generated ``module``, decoding requests
    in the handler rather than in gRPC.

    gRPC's own deserialisation failure path (grpcio 1.85) answers INTERNAL "Exception deserializing
    request!", not the INVALID_ARGUMENT every other bad input gets, and never finishes the call on the
    server: the receive callback aborts the call while the request thunk, woken with no request, waits
    on, and aborts it a second time once the client half-closes; the status operation it adds to the
    call's due set never completes, so the call's ``_RPCState`` (condition, due set, operations:
    4-19 KiB a call, measured with tracemalloc) stays referenced for good. Any client that reaches the
    endpoint could grow the manager with bytes that do not parse (RSS 48 -> 141 MiB over ~2,700 of
    them; a bare grpcio server grows the same, unary and streaming alike). Registered with no request
    deserializer, gRPC hands over the bytes, and the handler parses them: a request that does not
    parse is refused with INVALID_ARGUMENT, a bounded message, and nothing kept
    (``bench/bench_load.py`` measures RSS over 100,000 of them).
    """
    service = module.DESCRIPTOR.services_by_name[service_name]
    handlers = {
        method.name: _raw_handler(method, module, getattr(servicer, method.name)) for method in service.methods
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)


def add_servicers(server: grpc.Server, loop: ManagerLoop) -> None:
    add_raw_service(server, _pb, "Trainer", TrainerServicer(loop))
    add_raw_service(server, _pb, "Control", ControlServicer(loop))
