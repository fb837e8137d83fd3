"""The one error tree of freeride.

Every error that freeride raises to its users derives from :class:`FreerideError`. The names say
whether the caller can do something about it:

* :class:`ConfigError` -- bad local input (a size, a device name, a task reference); fix the input.
* :class:`RequestRejected` -- the manager refused a request (``INVALID_ARGUMENT``); nothing changed
  on the manager, fix the request and send it again.
* :class:`StateNotWritable` -- a kind of rejection: the manager cannot write its state directory
  (disk full, read-only, I/O error), so it refuses what it could not record (``RESOURCE_EXHAUSTED``);
  training is still served; send the request again once space returns.
* :class:`TaskNotFound` -- no task with that id (``NOT_FOUND``).
* :class:`InvalidTransition` -- a task lifecycle change that its state does not allow (internal:
  a bug if a user ever sees it).
* :class:`ManagerUnavailable` -- no manager is listening, or it died (``UNAVAILABLE``,
  ``DEADLINE_EXCEEDED``); recoverable by starting or waiting for the manager.
* :class:`Unauthenticated` -- a TCP endpoint refused the token (``UNAUTHENTICATED``), or the cluster
  queue's Redis refused the URL's credentials.
* :class:`QueueUnavailable` -- the cluster queue's Redis cannot be reached (down, wrong host, timed
  out); recoverable by waiting for it. A manager never stops for it; commands exit 3.
* :class:`DrainIncomplete` -- a drain was still under way when its timeout came (tasks still
  stopping); recoverable by asking again, which waits on (a drain is idempotent). Commands exit 1.
* :class:`FrameworkNotInstalled` -- a trainer-side adapter (``freeride.training.deepspeed``,
  ``freeride.training.megatron``) was called where its framework is missing; install the extra the
  message names.
* :class:`MissingExtra` -- a kind of :class:`ConfigError`: what was asked for needs an optional part
  of freeride that is not installed (the bundled tasks, the demo, the bench, the cluster queue); the
  message names the extra to install. Commands exit 2.

gRPC status codes are mapped to this tree in exactly one place, ``freeride._wire.client.map_rpc_errors``;
Redis errors in one other, ``freeride._cluster.redis_queue.redis_errors``.
"""

from __future__ import annotations


class FreerideError(Exception):
    """Root of every error freeride raises on purpose."""


class ConfigError(FreerideError, ValueError):
    """A locally given value (size, device, task reference, option) is malformed."""


class RequestRejected(FreerideError):
    """The manager rejected a request as invalid; its state is unchanged."""


class StateNotWritable(RequestRejected):
    """The manager cannot write its state directory; the request changed nothing and may be retried."""


class TaskNotFound(FreerideError, KeyError):
    """No task with the given id exists on this manager."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else "task not found"


class InvalidTransition(FreerideError):
    """A task state change that the lifecycle does not allow."""


class ManagerUnavailable(FreerideError):
    """No manager answers at the endpoint (not started, dead, or too slow)."""


class Unauthenticated(FreerideError):
    """The manager (or the queue's Redis) refused the call's credentials."""


class QueueUnavailable(FreerideError):
    """The cluster queue's Redis does not answer (not started, unreachable, or too slow)."""


class DrainIncomplete(FreerideError):
    """A drain did not finish within its timeout: some tasks are still stopping."""


class FrameworkNotInstalled(FreerideError, ImportError):
    """A framework adapter (``freeride.training.deepspeed``, ...) was called where its framework is not
    installed; the message names the extra to install."""


class MissingExtra(ConfigError):
    """An optional dependency is not installed; the message says which ``freeride[extra]`` brings it."""


class TaskLoadError(ConfigError):
    """A task reference (``module:Class``) names a module or class that cannot be loaded."""
