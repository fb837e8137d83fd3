"""The cluster queue: side tasks for a whole multi-node job, on Redis Streams.

Without it each manager keeps its device's tasks in its own SQLite store (the embedded default,
unchanged). With it, ``freeride submit --queue URL`` puts a task on one stream for the whole job,
and every manager started with ``--queue URL`` takes from that stream the tasks it can place.

Layout, from the edge inwards:

* :mod:`freeride._cluster.url` -- parse and redact ``redis://``, ``rediss://`` and ``unix://`` URLs.
* :mod:`freeride._cluster.records` -- a task's cluster record as plain data, and its codec to and
  from the string fields of a Redis hash (pure).
* :mod:`freeride._cluster.placement` -- whether a manager can place a task now, and which one it
  takes first (pure).
* :mod:`freeride._cluster.redis_queue` -- the only module that imports ``redis``: the keys, the Lua
  scripts that make each queue operation atomic, and the mapping of Redis errors to freeride's tree.
* :mod:`freeride._cluster.agent` -- a manager's thread that does all Redis I/O, so that the manager
  loop never waits on Redis; it posts claimed tasks to the loop the way gRPC servicers post requests.

The design (streams, the consumer group, leases, failure modes) is in ``docs/architecture.md``,
section "Many nodes: the cluster queue".
"""


def require_client() -> None:
    """Raise :class:`~freeride.errors.MissingExtra` if the Redis client (the ``cluster`` extra) is missing."""
    from freeride._extras import require

    require("cluster", "the cluster queue (--queue)")
