"""``freeride manager``: run the manager daemon of one device in the foreground.

    freeride manager --device cpu:0 [--endpoint unix:/p.sock | tcp://host:port] [--state-dir DIR]
                     [--token-file FILE] [--headroom 256MiB] [--grace-ms 0.5] [--margin-ms 0.2]
                     [--step-timeout-s 60] [--stop-timeout-s 10] [--memory-poll-ms 50]

It serves until SIGTERM or SIGINT, then parks and checkpoints every task and exits 0 (a second
signal stops at once). Bad options exit 2 with one line; a TCP endpoint needs a token.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import Any

from freeride._manager.core import MS, CoreConfig
from freeride._manager.daemon import Manager
from freeride.endpoints import ENDPOINT_ENV, TOKEN_ENV, read_token, resolve_endpoint
from freeride.errors import ConfigError
from freeride.units import parse_size

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
        help="a single step holding grants longer than this fails its task (default %(default)s)",
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
    parser.set_defaults(func=run)


def _ms(name: str, value: float, positive: bool) -> float:
    if not math.isfinite(value) or value < 0 or (positive and value == 0) or value > _MAX_MS:
        bound = "> 0" if positive else ">= 0"
        raise ConfigError(f"--{name} must be a number {bound} and at most {_MAX_MS:.0f} ms, got {value}")
    return value


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
    try:
        return CoreConfig(
            headroom_bytes=headroom_bytes,
            grace_ns=round(grace_ms * MS),
            margin_ns=margin_ns,
            # Overruns double the margin up to this bound; a larger starting margin raises it.
            max_margin_ns=max(CoreConfig().max_margin_ns, margin_ns),
            step_timeout_ns=round(step_timeout_ms * MS),
            stop_timeout_ns=round(stop_timeout_ms * MS),
        )
    except ValueError as exc:
        raise ConfigError(f"bad manager option: {exc}") from None


class _AnnouncingManager(Manager):
    """A manager that says on stderr, once, where it listens (after the bind succeeded)."""

    def _serve(self) -> None:
        super()._serve()
        print(
            f"freeride manager for {self.device} listening on {self.endpoint}; state in {self.state_dir}",
            file=sys.stderr,
            flush=True,
        )


def run(args: argparse.Namespace) -> int:
    config = core_config(args)
    memory_poll_ms = _ms("memory-poll-ms", args.memory_poll_ms, positive=True)
    # The same endpoint the client commands resolve for this device (explicit, $FREERIDE_ENDPOINT, default).
    endpoint = resolve_endpoint(args.endpoint, args.device)
    token = read_token(args.token_file)
    state_dir = Path(os.path.abspath(os.path.expanduser(args.state_dir))) if args.state_dir else None
    try:
        manager = _AnnouncingManager(
            args.device,
            endpoint=endpoint,
            state_dir=state_dir,
            token=token,
            core=config,
            memory_poll_ms=memory_poll_ms,
        )
    except ValueError as exc:  # ConfigError is a ValueError too: keep its message as it is
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"bad manager option: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"cannot prepare the manager's state directory: {exc}") from None
    manager.serve_forever()
    return 0
