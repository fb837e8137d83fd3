"""``freeride manager``: run the manager daemon of one device in the foreground.

    freeride manager --device cpu:0 [--endpoint unix:/p.sock | tcp://host:port] [--state-dir DIR]
                     [--token-file FILE] [--headroom 256MiB] [--grace-ms 0.5] [--margin-ms 0.2]
                     [--step-timeout-s 60] [--stop-timeout-s 10] [--memory-poll-ms 50] [--trace FILE]
                     [--policy freeride|paper [--paper-profile FILE]] [--autogroup-nice N]
                     [--metrics-port N [--metrics-address 127.0.0.1]] [--event-spin-us N] [--idle-read-ms 10]
                     [--no-trainer-stops] [--no-quiet-slots]
                     [--queue URL --checkpoint-dir DIR [--queue-lease-ms 10000] [--queue-poll-ms 200]
                      [--queue-hold-ms 5000] [--queue-spread-ms 1000] [--node NAME]]

It serves until SIGTERM or SIGINT, then parks and checkpoints every task and exits 0 (a SIGINT
meanwhile stops at once; a second SIGTERM changes nothing). Bad options exit 2 with one line; a TCP
endpoint needs a token.
``--metrics-port`` also serves Prometheus metrics at ``http://ADDRESS:PORT/metrics`` (0: a free
port, announced on stderr); without it no metrics are served. A port in use exits 2.

``--queue`` joins the cluster queue at a Redis URL (``redis://``, ``rediss://``, ``unix://``): the
manager then also runs tasks it claims from the queue, checkpointing them in ``--checkpoint-dir``, a
directory every node shares. A malformed URL exits 2, refused credentials exit 5; a queue that
cannot be reached does not stop the manager (it retries with backoff and serves its local tasks).

A manager that leads its session (``freeride launch`` and the demo start it so) and may lower a nice
gives its autogroup nice -10 (``--autogroup-nice``, 0 to leave it; ``freeride.devices.set_autogroup_nice``):
where the kernel shares a core between sessions first, a mostly sleeping manager beside a busy trainer rank
otherwise waited tens of milliseconds for the core to read a bubble's start. Its log says which it did, and
why not.

``--event-spin-us N`` keeps the manager's loop awake (turning, not sleeping) for N microseconds after each
trainer event, so that the trainer's next event costs its training thread a send to an awake process (~1 us)
instead of a wake-up of a sleeping one (~15 us on the 2-core test VM): for a manager with a core of its own
(``taskset``), at the price of that core while training runs. A manager whose cores all compute ranks turns it
off and says so. 0 (default) is off; at most 100,000.

``--idle-read-ms N``: while no side task is resident, a local trainer's events are read every N ms instead of at
each, so that a send wakes no one (a stranger's trainer ran +17% slower beside managers with no task; default
10, at most 100); 0 reads each at once whatever the tasks (and times each as ``stats``' event delay).

``--no-trainer-stops``: on a ``cpu:N`` device a trainer on this host stops a side task's worker still holding its
bubble (in a step, or not yet parked) at the bubble's end itself (the rank takes the core back then; the manager
waits for a core to do it); with this, only the manager freezes such workers, grace after the end.

``--no-quiet-slots``: a local trainer sends each bubble event as it happens. By default the manager tells it, on the
end board, which slots no resident task's step could use now, and it holds their events back and sends them with
its next event of another slot (or 10 ms later): each would otherwise wake the manager for nothing.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any

from freeride._manager.core import MS, POLICIES, CoreConfig
from freeride._manager.daemon import Manager
from freeride._manager.loop import LAZY_READ_NS, MAX_EVENT_SPIN_NS, MAX_IDLE_READ_NS
from freeride._manager.metrics import DEFAULT_ADDRESS
from freeride.devices import MANAGER_AUTOGROUP_NICE, open_device, set_autogroup_nice
from freeride.devices.mps import DEFAULT_SM_PERCENT, MpsMode
from freeride.endpoints import ENDPOINT_ENV, TOKEN_ENV, read_token, resolve_endpoint
from freeride.errors import ConfigError
from freeride.units import parse_size

log = logging.getLogger(__name__)

#: The largest value accepted for a time option, in milliseconds (a day): beyond is a unit mistake.
_MAX_MS = 86_400_000.0


def register(subparsers: Any) -> None:
    defaults = CoreConfig()
    parser = subparsers.add_parser(
        "manager",
        help="run the manager daemon of one device (foreground)",
        description="Serve the manager of one device until SIGTERM/SIGINT, then drain every task and exit.",
    )
    parser.add_argument("--device", required=True, help="the device to manage: cpu:N or cuda:N")
    parser.add_argument(
        "--endpoint",
        default=None,
        help=f"unix:/path.sock or tcp://host:port (default: ${ENDPOINT_ENV}, else a unix socket in the "
        "per-user runtime directory)",
    )
    parser.add_argument("--state-dir", default=None, help="where the task store and checkpoints live")
    parser.add_argument("--token-file", default=None, help=f"token for a TCP endpoint (else ${TOKEN_ENV})")
    parser.add_argument(
        "--headroom",
        default=f"{defaults.headroom_bytes // 2**20}MiB",
        help="device memory never given to side tasks (default %(default)s)",
    )
    parser.add_argument(
        "--grace-ms",
        type=float,
        default=defaults.grace_ns / MS,
        help="how long a step may run past a bubble's end before the task is frozen (default %(default)s)",
    )
    parser.add_argument(
        "--margin-ms",
        type=float,
        default=defaults.margin_ns / MS,
        help="safety margin added to a task's step time when fitting it into a bubble (default %(default)s)",
    )
    parser.add_argument(
        "--step-timeout-s",
        type=float,
        default=defaults.step_timeout_ns / 1e9,
        help="a single step holding grants longer than this, or looking hung this long while the trainer makes "
             "bubbles, fails its task (default %(default)s)",
    )
    parser.add_argument(
        "--stop-timeout-s",
        type=float,
        default=defaults.stop_timeout_ns / 1e9,
        help="how long a task may take to checkpoint and exit when stopped (drain, eviction) before it is "
        "killed; bounds the time SIGTERM takes (default %(default)s)",
    )
    parser.add_argument(
        "--memory-poll-ms",
        type=float,
        default=50.0,
        help="how often side tasks' memory is checked against their caps (default %(default)s)",
    )
    parser.add_argument(
        "--event-spin-us", type=float, default=0.0, metavar="N",
        help="stay awake N us after each trainer event so that the next one costs the trainer ~1 us, not a "
        "wake-up (~15 us on a VM); spends the manager's core while training runs: give it one (default 0: off)",
    )
    parser.add_argument(
        "--idle-read-ms", type=float, default=LAZY_READ_NS / 1e6, metavar="N",
        help="while no side task is resident, read a local trainer's events every N ms, not at each (a send then "
        "wakes no one; default %(default)g, at most 100); 0: at each, always",
    )
    parser.add_argument(
        "--no-trainer-stops", dest="trainer_stops", action="store_false",
        help="cpu:N: the manager alone freezes a side task still holding a bubble past its end (by default the trainer "
        "on this host stops it at the end itself)",
    )
    parser.add_argument(
        "--no-quiet-slots", dest="quiet_slots", action="store_false",
        help="a local trainer sends every bubble event as it happens (by default it holds back those of slots that "
        "no resident task's step could use, and the manager reads them with its next one)",
    )
    parser.add_argument("--trace", default=None,
                        help="write a JSON-lines timeline of bubbles, grants and steps to FILE (see the demo)")
    parser.add_argument("--autogroup-nice", type=int, default=MANAGER_AUTOGROUP_NICE, metavar="N",
                        help="the nice (-20..19) a manager that leads its session gives its autogroup where it may "
                        "(default %(default)s: it reads reports before a busy trainer rank's time slice ends; "
                        "0: the kernel's default)")
    parser.add_argument("--policy", choices=POLICIES, default="freeride",
                        help="scheduling policy: freeride (default) or paper, an emulation of the reference "
                        "system's policy for the bench (10 ms polling, predicted ends only, 1.2x median admission)")
    parser.add_argument("--paper-profile", default=None,
                        help="for --policy paper: JSON of the minimum bubble length per (stage, slot), "
                        '{"slots": [{"stage": 0, "slot": 1, "min_ns": 12000000}, ...]}; without it the trainer\'s '
                        "prediction stands in for the offline profile")
    parser.add_argument(
        "--mps", choices=[m.value for m in MpsMode], default=MpsMode.AUTO.value,
        help="CUDA only. auto (default): side tasks join a live MPS control daemon as low-priority clients with "
        "an SM share and a pinned-memory limit; off: they never join one; require: refuse to start without a "
        "live daemon. MPS makes side-task kernels yield to the trainer's, but shares one fault domain with it: "
        "see the README",
    )
    parser.add_argument(
        "--mps-sm-percent", type=int, default=DEFAULT_SM_PERCENT,
        help="CUDA with MPS: the share of the GPU's SMs a side task's kernels may occupy (default %(default)s)",
    )
    parser.add_argument(
        "--worker-log-max", default="8MiB",
        help="a task's log (its worker's stdout and stderr) is rotated when it would pass this size "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--worker-log-backups", type=int, default=1,
        help="rotated logs kept per task, as worker.log.1 ... (default %(default)s): a task's logs take at "
        "most (backups + 1) x --worker-log-max",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics at http://ADDRESS:PORT/metrics; 0 picks a free port (default: off)",
    )
    parser.add_argument(
        "--metrics-address",
        default=None,
        help=f"the address the metrics endpoint binds to (default {DEFAULT_ADDRESS}; it has no authentication)",
    )
    queue = parser.add_argument_group("cluster queue")
    queue.add_argument("--queue", default=None, metavar="URL",
                       help="join the cluster queue at this Redis URL: redis://[:password@]host[:port][/db], "
                       "rediss://... (TLS) or unix:///path/redis.sock")
    queue.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                       help="with --queue: where cluster tasks checkpoint, shared by every node (required)")
    queue.add_argument("--queue-lease-ms", type=int, default=10_000,
                       help="a manager that has not renewed its tasks' leases for this long loses them to "
                       "the queue (default %(default)s)")
    queue.add_argument("--queue-poll-ms", type=float, default=200.0,
                       help="how often the manager talks to the queue (default %(default)s; at most a third "
                       "of the lease)")
    queue.add_argument("--queue-hold-ms", type=float, default=5_000.0,
                       help="a claimed task still waiting for memory after this long goes back to the queue "
                       "(default %(default)s)")
    queue.add_argument("--queue-spread-ms", type=float, default=1_000.0,
                       help="after a claim, a manager holding n queue tasks claims its next only n times this "
                       "later, leaving it to managers that hold fewer (default %(default)s; 0: claim at once)")
    queue.add_argument("--node", default=None,
                       help="this host's name in the queue and in a trainer's stage map (default: the host name)")
    parser.set_defaults(func=run)


def queue_config(args: argparse.Namespace) -> Any:
    """The queue settings from the command line (None without --queue), validated with clear messages."""
    if args.queue is None:
        if args.checkpoint_dir is not None:
            raise ConfigError("--checkpoint-dir needs --queue (a manager's own tasks checkpoint in its state dir)")
        return None
    if not args.checkpoint_dir:
        raise ConfigError("--queue needs --checkpoint-dir: a directory every node shares, where a task "
                          "reclaimed on another device finds its checkpoints")
    from freeride._cluster.agent import QueueConfig

    return QueueConfig.from_text(
        args.queue,
        Path(os.path.abspath(os.path.expanduser(args.checkpoint_dir))),
        lease_ms=args.queue_lease_ms,
        poll_ms=args.queue_poll_ms,
        hold_ms=args.queue_hold_ms,
        spread_ms=args.queue_spread_ms,
    )


def load_paper_profile(path: str) -> dict[tuple[int, int], int]:
    """The reference policy's offline profile: minimum bubble length per (stage, slot)."""
    try:
        data = json.loads(Path(path).read_text())
        profile = {(int(s["stage"]), int(s["slot"])): int(s["min_ns"]) for s in data["slots"]}
    except OSError as exc:
        raise ConfigError(f"cannot read the paper profile {path}: {exc.strerror or exc}") from None
    except (ValueError, KeyError, TypeError) as exc:
        shape = '{"slots": [{"stage", "slot", "min_ns"}, ...]}'
        raise ConfigError(f"the paper profile {path} is not {shape}: {exc}") from None
    bad = [k for k, v in profile.items() if v <= 0 or min(k) < 0]
    if bad:
        raise ConfigError(f"the paper profile {path} has non-positive lengths or negative indices at {bad[:3]}")
    return profile


def _ms(name: str, value: float, positive: bool) -> float:
    if not math.isfinite(value) or value < 0 or (positive and value == 0) or value > _MAX_MS:
        bound = "> 0" if positive else ">= 0"
        raise ConfigError(f"--{name} must be a number {bound} and at most {_MAX_MS:.0f} ms, got {value}")
    return value


def idle_read(ms: float) -> int:
    """``--idle-read-ms`` in ns, or a :class:`ConfigError` naming the bounds."""
    bound_ms = MAX_IDLE_READ_NS / 1e6
    if not math.isfinite(ms) or not 0 <= ms <= bound_ms:
        raise ConfigError(f"--idle-read-ms must be a number 0..{bound_ms:g}, got {ms:g}")
    return round(ms * 1e6)


def event_spin(us: float) -> int:
    """``--event-spin-us`` in ns, or a :class:`ConfigError` naming the bounds."""
    bound_us = MAX_EVENT_SPIN_NS // 1000
    if not math.isfinite(us) or not 0 <= us <= bound_us:
        raise ConfigError(f"--event-spin-us must be a number 0..{bound_us}, got {us:g}")
    return round(us * 1000)


def core_config(args: argparse.Namespace) -> CoreConfig:
    """The scheduling knobs from the command line, validated with clear messages."""
    headroom = str(args.headroom).strip()
    # A headroom of zero is legitimate (parse_size only accepts positive sizes).
    headroom_bytes = 0 if headroom in ("0", "0B", "0b") else parse_size(headroom)
    grace_ms = _ms("grace-ms", args.grace_ms, positive=False)
    margin_ms = _ms("margin-ms", args.margin_ms, positive=False)
    step_timeout_ms = _ms("step-timeout-s", args.step_timeout_s * 1000, positive=True)
    stop_timeout_ms = _ms("stop-timeout-s", args.stop_timeout_s * 1000, positive=True)
    margin_ns = round(margin_ms * MS)
    policy = getattr(args, "policy", "freeride")
    profile_file = getattr(args, "paper_profile", None)
    if profile_file and policy != "paper":
        raise ConfigError("--paper-profile needs --policy paper")
    profile = load_paper_profile(profile_file) if profile_file else {}
    try:
        return CoreConfig(
            headroom_bytes=headroom_bytes,
            grace_ns=round(grace_ms * MS),
            margin_ns=margin_ns,
            # Overruns double the margin up to this bound; a larger starting margin raises it.
            max_margin_ns=max(CoreConfig().max_margin_ns, margin_ns),
            step_timeout_ns=round(step_timeout_ms * MS),
            policy=policy,
            paper_profile_ns=profile,
            stop_timeout_ns=round(stop_timeout_ms * MS),
        )
    except ValueError as exc:
        raise ConfigError(f"bad manager option: {exc}") from None


class _AnnouncingManager(Manager):
    """A manager that says on stderr, once, where it listens (after the bind succeeded), and that it is
    stopping when a signal comes: a drain takes a while, and a Ctrl-C that seems to do nothing gets a
    second one, which kills the workers without checkpoints."""

    def _serve(self) -> None:
        self._stop_announced = False
        self.loop.on_shutdown = self._announce_stop
        super()._serve()
        metrics = f"; metrics on {self.metrics.url}" if self.metrics is not None else ""
        if self.loop.config.event_spin_ns:  # it spends a core: said where the user looks, not at -v only
            metrics += f"; awake {self.loop.config.event_spin_ns / 1000:g} us after each trainer event"
        if self.agent is not None:
            metrics += f"; queue {self.agent.config.url} as {self.agent.where}"
        print(
            f"freeride manager for {self.device} listening on {self.endpoint}{metrics}; state in {self.state_dir}",
            file=sys.stderr,
            flush=True,
        )
        if self.device.name.kind == "cuda":
            print(f"  {self.device.describe()}", file=sys.stderr, flush=True)

    def _announce_stop(self, immediate: bool) -> None:
        if immediate or self._stop_announced:
            return  # the loop warns of an immediate stop itself; a repeated SIGTERM changes nothing
        self._stop_announced = True
        print(f"freeride manager for {self.device}: stopping: draining first (parking and checkpointing every "
              "task; one that does not stop is killed after --stop-timeout-s); a SIGINT now stops at once, "
              "without checkpoints (Ctrl-C, where it runs at a terminal)", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    if not -20 <= args.autogroup_nice <= 19:
        raise ConfigError(f"--autogroup-nice must be -20..19, got {args.autogroup_nice}")
    config = core_config(args)
    device = open_device(args.device, mps=args.mps, mps_sm_percent=args.mps_sm_percent)
    args.device = str(device.name)  # as every log line and client spells it ("cpu:0 " was logged as [cpu:0 ])
    memory_poll_ms = _ms("memory-poll-ms", args.memory_poll_ms, positive=True)
    event_spin_ns = event_spin(args.event_spin_us)
    idle_read_ns = idle_read(args.idle_read_ms)
    # The same endpoint the client commands resolve for this device (explicit, $FREERIDE_ENDPOINT, default).
    endpoint = resolve_endpoint(args.endpoint, args.device)
    token = read_token(args.token_file)
    state_dir = Path(os.path.abspath(os.path.expanduser(args.state_dir))) if args.state_dir else None
    if args.metrics_address is not None and args.metrics_port is None:
        raise ConfigError("--metrics-address needs --metrics-port (metrics are off without it)")
    queue = queue_config(args)
    if args.node is not None:
        from freeride._cli.launch import check_node_name

        check_node_name(args.node)
    try:
        manager = _AnnouncingManager(
            device,
            endpoint=endpoint,
            state_dir=state_dir,
            token=token,
            core=config,
            memory_poll_ms=memory_poll_ms,
            trace_path=Path(os.path.abspath(os.path.expanduser(args.trace))) if args.trace else None,
            metrics_port=args.metrics_port,
            metrics_address=args.metrics_address or DEFAULT_ADDRESS,
            queue=queue,
            node=args.node,
            worker_log_max_bytes=parse_size(args.worker_log_max),
            worker_log_backups=args.worker_log_backups,
            event_spin_ns=event_spin_ns,
            idle_read_ns=idle_read_ns,
            trainer_stops=args.trainer_stops,
            quiet_slots=args.quiet_slots,
        )
    except ValueError as exc:  # ConfigError is a ValueError too: keep its message as it is
        device.close()
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"bad manager option: {exc}") from None
    except OSError as exc:
        device.close()
        raise ConfigError(f"cannot prepare the manager's state directory: {exc}") from None
    # Once it serves: a second manager refused at a busy endpoint printed this warning before its refusal.
    manager.serve_forever(serving=lambda: _set_autogroup_nice(args.autogroup_nice, args.device, device.name.kind))
    # The log's last line says the manager is gone, not only that it was stopping (a stranger's log ended there).
    print(f"freeride manager for {device.name}: stopped", file=sys.stderr, flush=True)
    return 0


def _set_autogroup_nice(niceness: int, device: str, kind: str) -> None:
    """The manager's autogroup at ``niceness`` where it may (0: left alone); what happened, logged."""
    if niceness == 0:
        return
    why_not = set_autogroup_nice(niceness)
    if not why_not:
        log.info("[%s] the manager's autogroup runs at nice %d", device, niceness)
        return
    # A CPU device shares its core with a trainer rank by design: there the wait costs harvest.
    log.log(logging.WARNING if kind == "cpu" else logging.INFO,
            "[%s] the manager's autogroup keeps its nice: %s; beside a busy trainer rank on the same core, bubble "
            "reports can wait for the core (start it with 'freeride launch', or in a session of its own with "
            "CAP_SYS_NICE; --autogroup-nice 0 says nothing of it)", device, why_not)
