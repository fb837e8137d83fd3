"""``freeride launch``: managers up, the training command run, managers down, its exit code kept.

    freeride launch --devices cpu:0,cpu:1 [--state-dir DIR] -- torchrun --nproc-per-node 2 \\
        -m freeride.workload --report
    srun --ntasks-per-node=1 freeride launch --queue redis://head:6379/0 --checkpoint-dir /shared/ckpt \\
        -- torchrun --nnodes 4 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint head:29500 train.py

**Many nodes.** One launch runs per node (torchrun's own multi-node form, or Slurm's
``srun --ntasks-per-node=1``; with ``srun --overlap`` next to a training step started on its own, give
``-- sleep infinity`` as the command: the managers then stop when the job ends). Without ``--devices``
(or with ``--devices auto``) launch finds this node's devices, first match wins (see
:func:`local_devices`): torchrun's ``--nproc-per-node`` in the command; ``$LOCAL_WORLD_SIZE``;
Slurm's ``$SLURM_GPUS_ON_NODE``, ``$SLURM_STEP_GPUS`` or ``$SLURM_JOB_GPUS``; ``$CUDA_VISIBLE_DEVICES``;
the GPUs NVML sees. The devices are ``cuda:0..n-1`` when this node has GPUs (indices inside the
visible set, as the ranks number them), else the ``cpu:N`` cores the reference trainer pins its local
ranks to (``--device-kind`` overrides). When the job spans nodes (torchrun ``--nnodes`` above 1, or
``$SLURM_JOB_NUM_NODES`` above 1) each manager's state directory gains this node's name, so that a
state directory on a shared file system is never shared by two nodes. ``--queue`` and
``--checkpoint-dir`` are passed to every manager (with ``--node``, this node's name).

1. One ``freeride manager --device D`` child per device, each in its own session and set to receive
   SIGTERM when this process dies (``PR_SET_PDEATHSIG``), its output in ``<log dir>/manager-<D>.log``.
   A device whose default endpoint already has a SERVING manager is used as is and left running,
   unless this launch was given options for its managers (``--queue``, ``--checkpoint-dir``,
   ``--state-dir``, ``--manager-arg``), which that manager was started without: then it is refused.
2. Wait until every manager's health check says SERVING (``--ready-timeout-s``); a manager that exits
   or stays unready fails the launch with its log's tail, before the command starts.
3. Run the command as an argument list (no shell) in its own process group; SIGINT and SIGTERM
   received by ``launch`` are forwarded to it (the handlers only record the signal; the wait loop
   forwards it).
   While it runs, what the managers log at WARNING or above is said on this terminal too
   (:class:`WarningRelay`), prefixed ``freeride launch: manager D:``.
4. Print what each started manager harvested (bubbles, bubble time, harvested time, overruns, tasks by
   state: its figures go with it), then stop the managers: SIGTERM to each manager's process group (they
   drain and exit 0), one deadline for all (``--stop-timeout-s``), then SIGKILL. A temporary log
   directory that no manager of this launch wrote to (all were already serving) is removed.
5. Exit with the command's exit code (128 + N if a signal N ended it).
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import IO, Any

from freeride.devices import check_cpu_device, parse_device_name
from freeride.endpoints import Endpoint, default_endpoint, runtime_dir
from freeride.errors import ConfigError, FreerideError, ManagerUnavailable

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
#: A manager's exit code for bad input (``freeride.cli.EXIT_BAD_INPUT``; the CLI's layer is above this one).
_MANAGER_BAD_INPUT = 2


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "launch",
        help="start managers for the job's devices, run a training command, stop the managers",
        description="Start one manager per device, run COMMAND (no shell), stop the managers, exit with "
        "COMMAND's exit code.",
    )
    add_device_options(parser)
    parser.add_argument("--node", default=None,
                        help="this node's name for the managers (default: $SLURMD_NODENAME, else the host name)")
    parser.add_argument("--queue", default=None, metavar="URL", help="every manager joins this cluster queue")
    parser.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                        help="with --queue: the shared checkpoint directory of cluster tasks")
    parser.add_argument("--state-dir", default=None, help="parent of each manager's state directory")
    parser.add_argument("--log-dir", default=None, help="where manager logs go (default: state dir or a temp dir)")
    parser.add_argument("--ready-timeout-s", type=float, default=30.0, help="how long managers may take to serve")
    parser.add_argument("--stop-timeout-s", type=float, default=30.0, help="drain time before SIGKILL")
    parser.add_argument("--manager-arg", action="append", default=[], metavar="ARG",
                        help="extra argument for every manager (repeatable), e.g. --manager-arg=--grace-ms=1")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command and its arguments")
    parser.set_defaults(func=run)


def add_device_options(parser: argparse.ArgumentParser) -> None:
    """``--devices`` and ``--device-kind``, as :func:`job_devices` reads them (launch and bench)."""
    parser.add_argument("--devices", default="auto",
                        help="comma-separated devices, e.g. cpu:0,cpu:1 or cuda:0,cuda:1; auto (the default): this "
                        "node's, from torchrun's --nproc-per-node, Slurm or the visible GPUs")
    parser.add_argument("--device-kind", choices=("auto", "cuda", "cpu"), default="auto",
                        help="with --devices auto: cuda when this node has GPUs, else cpu (default auto)")


def set_pdeathsig() -> None:  # pragma: no cover - runs in the child between fork and exec
    """SIGTERM when the parent dies (a ``preexec_fn``): a manager in a session of its own gets no terminal's signal."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass


@dataclass
class ManagedManager:
    """One manager child (or a manager found already running, ``proc`` None)."""

    device: str
    endpoint: Endpoint
    proc: subprocess.Popen[bytes] | None
    log_path: Path | None

    def log_tail(self, lines: int = 15) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def _serving(endpoint: Endpoint) -> bool:
    from freeride._wire.client import health_status

    try:
        return health_status(endpoint, timeout_s=1.0) == "SERVING"
    except FreerideError:
        return False


def start_managers(
    devices: Sequence[str], state_dir: Path | None, log_dir: Path, extra_args: Sequence[str],
    env: Mapping[str, str] | None = None, configured: Sequence[str] = (),
) -> list[ManagedManager]:
    """Start a manager child for each device that has none serving yet (``state_dir``: their parent).

    ``env`` is the managers' environment (default: this process's); they listen on the default
    endpoints of its runtime directory (``$XDG_RUNTIME_DIR``), where a job run in the same
    environment finds them. ``configured``: the options given for the managers (``--queue``, ...): a
    manager found serving cannot be given them (it may run with other ones), so it is refused rather than used
    (a node whose stray manager never joined the queue harvested nothing for the cluster, and nothing said so).
    """
    started: list[ManagedManager] = []
    for device in devices:
        endpoint = default_endpoint(device, environ=env)
        if _serving(endpoint):
            if configured:
                raise ConfigError(
                    f"a manager this launch did not start already serves {device} at {endpoint}, and it cannot "
                    f"take this launch's {', '.join(configured)}: stop it first (freeride drain --device {device}, "
                    "then SIGTERM it), or launch without those options to use it as it is")
            log.warning("a manager already serves %s at %s: using it, and leaving it running", device, endpoint)
            started.append(ManagedManager(device, endpoint, None, None))
            continue
        slug = parse_device_name(device).slug
        cmd = [sys.executable, "-m", "freeride.cli", "manager", "--device", device, *extra_args]
        if state_dir is not None:
            cmd += ["--state-dir", str(state_dir / slug)]
        log_path = log_dir / f"manager-{slug}.log"
        with log_path.open("ab") as out:
            proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=set_pdeathsig, env=None if env is None else dict(env),
            )
        log.info("started manager for %s (pid %d, log %s)", device, proc.pid, log_path)
        started.append(ManagedManager(device, endpoint, proc, log_path))
    return started


def wait_ready(managers: Sequence[ManagedManager], timeout_s: float) -> None:
    """Block until every manager is SERVING; raise with the culprit's log tail otherwise."""
    deadline = time.monotonic() + timeout_s
    pending = list(managers)
    while pending:
        for m in list(pending):
            if m.proc is not None and m.proc.poll() is not None:
                # Its own bad input (an unknown device, a malformed option) is the launch's: exit 2 as well.
                error = ConfigError if m.proc.returncode == _MANAGER_BAD_INPUT else FreerideError
                raise error(
                    f"the manager for {m.device} exited with code {m.proc.returncode} before serving; "
                    f"its log ({m.log_path}) ends with:\n{m.log_tail()}"
                )
            if _serving(m.endpoint):
                pending.remove(m)
        if not pending:
            return
        if time.monotonic() > deadline:
            names = ", ".join(m.device for m in pending)
            raise ManagerUnavailable(
                f"manager(s) for {names} not SERVING after {timeout_s:g} s; see {pending[0].log_path}:\n"
                f"{pending[0].log_tail()}"
            )
        time.sleep(0.1)


class WarningRelay:
    """The warnings and errors the started managers log, said on this terminal as they come (every
    ``interval_s``), each line once: a manager's output goes to its log file, and a stranger's launch printed only
    "logs in ..." while its managers warned that every core computed a rank and their own CPU came out of
    training's. :meth:`relay` reads what was written since the last read; :meth:`close` stops the thread after
    a last read."""

    #: The levels relayed: the third field of the managers' log format (``date time LEVEL name: message``).
    LEVELS = ("WARNING", "ERROR", "CRITICAL")

    def __init__(self, managers: Sequence[ManagedManager], out: IO[str] | None = None,
                 interval_s: float = 0.5) -> None:
        self._logs = [(m.device, m.log_path) for m in managers if m.log_path is not None]
        self._read: dict[Path, int] = {}
        self._out = out
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> WarningRelay:
        self._thread = threading.Thread(target=self._run, name="freeride-launch-relay", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.relay()

    def relay(self) -> None:
        out = self._out or sys.stderr
        for device, path in self._logs:
            try:
                with path.open("rb") as fh:
                    fh.seek(self._read.get(path, 0))
                    data = fh.read()
            except OSError:
                continue
            complete = data[:data.rfind(b"\n") + 1]  # a line still being written is read whole next time
            self._read[path] = self._read.get(path, 0) + len(complete)
            for line in complete.decode(errors="replace").splitlines():
                fields = line.split(" ", 3)  # the level by its place: an INFO line may say "ERROR" in its text
                if len(fields) == 4 and fields[2] in self.LEVELS:
                    print(f"freeride launch: manager {device}: {fields[2]} {fields[3]}", file=out, flush=True)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.relay()


def summary_lines(managers: Sequence[ManagedManager]) -> list[str]:
    """What each manager this launch started harvested, read before it stops (its figures go with it; a
    manager found running keeps serving and is not summed up). A manager that does not answer is skipped."""
    from freeride._wire.client import ControlClient

    lines = []
    for m in managers:
        if m.proc is None or m.proc.poll() is not None:
            continue
        try:
            with ControlClient(m.endpoint, timeout_s=2.0) as client:
                s = client.stats()
        except FreerideError as exc:
            log.debug("no figures from the manager of %s: %s", m.device, exc)
            continue
        share = f" ({100 * s.harvested_s / s.bubble_time_s:.1f}% of it)" if s.bubble_time_s > 0 else ""
        tasks = ", ".join(f"{k} {v}" for k, v in sorted(s.tasks_by_state.items())) or "none"
        lines.append(f"freeride launch: {m.device}: {s.bubbles} bubbles, {s.bubble_time_s:.2f} s of bubble time, "
                     f"{s.harvested_s:.2f} s harvested{share}, {s.overruns} overruns; tasks: {tasks}")
        if s.queue is not None and not s.queue.connected:
            # A stranger's `launch --queue redis://localhost:1/0` ran and exited 0 saying nothing of it: the
            # unreachable queue was in the manager's log only.
            lines.append(f"freeride launch: {m.device}: the cluster queue was unreachable at the end "
                         f"({s.queue.errors} failed polls; last: {s.queue.last_error}): it took no cluster task")
    return lines


def stop_managers(managers: Sequence[ManagedManager], timeout_s: float) -> None:
    """SIGTERM every started manager's group, one deadline for all, then SIGKILL what is left."""
    ours = [m for m in managers if m.proc is not None and m.proc.poll() is None]
    for m in ours:
        assert m.proc is not None
        try:
            os.killpg(m.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout_s
    for m in ours:
        assert m.proc is not None
        try:
            m.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("manager for %s did not stop within %g s: killing it", m.device, timeout_s)
            try:
                os.killpg(m.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            m.proc.wait()
    for m in managers:
        if m.proc is not None and m.proc.returncode not in (0, None):
            log.warning("manager for %s exited with code %s (log %s)", m.device, m.proc.returncode, m.log_path)


@dataclass(frozen=True)
class Outcome:
    """How a supervised command ended.

    ``code``: its exit code, 128 + N when signal N ended it. ``signals``: the SIGINT and SIGTERM this
    process received meanwhile, each forwarded to the command. ``timed_out``: it outlived its time
    and was stopped (SIGTERM to its process group, then SIGKILL).
    """

    code: int
    signals: tuple[int, ...] = ()
    timed_out: bool = False


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _job_preexec(die_with_parent: bool) -> Callable[[], None]:
    def preexec() -> None:  # pragma: no cover - runs in the child between fork and exec
        os.setpgrp()
        if die_with_parent:
            set_pdeathsig()

    return preexec


def supervise(
    command: Sequence[str],
    on_started: Callable[[subprocess.Popen[bytes]], None] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    output: IO[bytes] | None = None,
    timeout_s: float | None = None,
    stop_after_signal_s: float | None = None,
    kill_after_s: float = 10.0,
    die_with_parent: bool = False,
    kill_group_at_exit: bool = False,
) -> Outcome:
    """Run ``command`` (no shell) in its own process group until it ends; how it ended.

    SIGINT and SIGTERM sent to this process are only recorded by their handlers and forwarded to the
    command by the wait loop. ``timeout_s``: past it, the command's group gets SIGTERM and, after
    ``kill_after_s``, SIGKILL. ``stop_after_signal_s``: a command still running that long after a
    forwarded signal is stopped the same way. ``output`` receives its stdout and stderr (default: this
    process's). ``die_with_parent``: the command gets SIGTERM if this process dies.
    ``kill_group_at_exit``: whatever the command left running in its group is killed once it exits.
    """
    received: list[int] = []
    forwarded: list[int] = []

    def record(signum: int, frame: FrameType | None) -> None:
        received.append(signum)  # only record: the loop below forwards

    previous = {s: signal.signal(s, record) for s in (signal.SIGINT, signal.SIGTERM)}
    timed_out = False
    try:
        try:
            proc = subprocess.Popen(
                list(command), preexec_fn=_job_preexec(die_with_parent), env=None if env is None else dict(env),
                stdin=subprocess.DEVNULL if output is not None else None, stdout=output,
                stderr=subprocess.STDOUT if output is not None else None,
            )
        except OSError as exc:
            raise ConfigError(f"cannot run {command[0]!r}: {exc.strerror}") from None
        if on_started is not None:
            on_started(proc)
        started = time.monotonic()
        term_at: float | None = None  # when the group gets SIGTERM
        kill_at: float | None = None  # when it gets SIGKILL
        while True:
            try:
                code = proc.wait(timeout=0.05)
                break
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            while received:
                signum = received.pop(0)
                forwarded.append(signum)
                log.info("forwarding signal %d to the command (pid %d)", signum, proc.pid)
                try:
                    proc.send_signal(signum)
                except ProcessLookupError:
                    pass
                if stop_after_signal_s is not None and term_at is None:
                    term_at = now + stop_after_signal_s
            if timeout_s is not None and not timed_out and now - started > timeout_s:
                timed_out = True
                log.info("the command (pid %d) outlived %g s: stopping its process group", proc.pid, timeout_s)
                term_at = now
            if term_at is not None and now >= term_at and kill_at is None:
                _signal_group(proc.pid, signal.SIGTERM)
                kill_at = now + kill_after_s
            if kill_at is not None and now >= kill_at:
                _signal_group(proc.pid, signal.SIGKILL)
        if kill_group_at_exit:
            _signal_group(proc.pid, signal.SIGKILL)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return Outcome(128 - code if code < 0 else code, tuple(forwarded), timed_out)


def run_command(command: Sequence[str], on_started: Callable[[subprocess.Popen[bytes]], None] | None = None) -> int:
    """Run ``command`` (no shell) in its own process group, forwarding SIGINT/SIGTERM; its exit code."""
    return supervise(command, on_started).code


_TORCHRUN_MODULES = ("torch.distributed.run", "torch.distributed.launch")
#: Sources that count GPUs: the devices are GPUs whatever this process sees.
_GPU_SOURCES = ("torchrun --nproc-per-node gpu", "$SLURM_GPUS_ON_NODE", "$SLURM_STEP_GPUS", "$SLURM_JOB_GPUS",
                "$CUDA_VISIBLE_DEVICES", "the GPUs NVML sees")


def _torchrun_options(command: Sequence[str]) -> dict[str, str] | None:
    """torchrun's own options in ``command`` (``--opt value`` or ``--opt=value``, ``_`` as ``-``), or None
    if the command is not torchrun (``torchrun ...`` or ``python -m torch.distributed.run ...``)."""
    words = list(command)
    if not words:
        return None
    if os.path.basename(words[0]) == "torchrun":
        rest = words[1:]
    else:
        try:
            at = words.index("-m")
        except ValueError:
            return None
        if at + 1 >= len(words) or words[at + 1] not in _TORCHRUN_MODULES:
            return None
        rest = words[at + 2:]
    options: dict[str, str] = {}
    i = 0
    while i < len(rest) and rest[i].startswith("-"):
        word = rest[i]
        if word == "--":
            break
        key, eq, value = word.lstrip("-").partition("=")
        key = key.replace("_", "-")
        if not eq:
            # A flag (--standalone, --no-python) takes no value; every other option takes the next word.
            if key in ("standalone", "no-python", "run-path", "module", "m") or i + 1 >= len(rest):
                options[key] = ""
                i += 1
                continue
            value = rest[i + 1]
            i += 1
        options[key] = value
        i += 1
    return options


def _count_list(text: str) -> int:
    """How many devices a list such as ``0,1,3`` or ``GPU-uuid,GPU-uuid`` names (0 for ``-1`` or empty)."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items or items[0] in ("-1", "NoDevFiles"):
        return 0
    return len(items)


def local_devices(
    env: Mapping[str, str],
    command: Sequence[str],
    cuda_count: Callable[[], int],
    cores: Sequence[int],
    kind: str = "auto",
) -> tuple[list[str], str]:
    """This node's devices for the job's local ranks, and where the count came from.

    ``cuda_count`` says how many GPUs this node has (called only when needed); ``cores`` are the CPU
    cores this process may use. Raises :class:`ConfigError` when nothing says how many ranks run here.
    """
    count, source = 0, ""
    options = _torchrun_options(command) or {}
    nproc = options.get("nproc-per-node", "")
    if nproc.isdigit() and int(nproc) > 0:
        count, source = int(nproc), "torchrun --nproc-per-node"
    elif nproc == "gpu" and cuda_count() > 0:
        count, source = cuda_count(), "torchrun --nproc-per-node gpu"
    elif env.get("LOCAL_WORLD_SIZE", "").isdigit() and int(env["LOCAL_WORLD_SIZE"]) > 0:
        count, source = int(env["LOCAL_WORLD_SIZE"]), "$LOCAL_WORLD_SIZE"
    elif env.get("SLURM_GPUS_ON_NODE", "").isdigit() and int(env["SLURM_GPUS_ON_NODE"]) > 0:
        count, source = int(env["SLURM_GPUS_ON_NODE"]), "$SLURM_GPUS_ON_NODE"
    else:
        for name in ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS", "CUDA_VISIBLE_DEVICES"):
            if _count_list(env.get(name, "")):
                count, source = _count_list(env[name]), f"${name}"
                break
        else:
            if cuda_count() > 0:
                count, source = cuda_count(), "the GPUs NVML sees"
    if count <= 0:
        raise ConfigError("cannot tell how many ranks run on this node: pass --devices (e.g. cuda:0,cuda:1), or "
                          "run torchrun with --nproc-per-node N")
    if kind == "auto":
        kind = "cuda" if source in _GPU_SOURCES or cuda_count() > 0 else "cpu"
    if kind == "cuda":
        return [f"cuda:{i}" for i in range(count)], source
    allowed = sorted(cores)
    if not allowed:
        raise ConfigError("no CPU core is available to this process")
    # The reference trainer pins local rank r to core r when it may, else to the r-th allowed core.
    picked = [r if r in allowed else allowed[r % len(allowed)] for r in range(count)]
    unique = list(dict.fromkeys(picked))
    if len(unique) < count:
        log.warning("%d ranks on %d CPU cores: ranks share devices, and a device that ranks share grants nothing "
                    "(it is idle only while all of its ranks wait); give the job a core per rank to harvest it",
                    count, len(unique))
    return [f"cpu:{c}" for c in unique], source


def spans_nodes(env: Mapping[str, str], command: Sequence[str]) -> bool:
    """Whether the job runs on more than one node (torchrun ``--nnodes``, Slurm's node count)."""
    nnodes = (_torchrun_options(command) or {}).get("nnodes", "1")
    upper = nnodes.rpartition(":")[2]  # elastic form MIN:MAX
    if upper.isdigit() and int(upper) > 1:
        return True
    return any(env.get(name, "").isdigit() and int(env[name]) > 1 for name in ("SLURM_JOB_NUM_NODES", "SLURM_NNODES"))


def check_node_name(node: str) -> str:
    """A node name as the queue and a trainer's stage map use it (``node/cuda:0``)."""
    if not node or "/" in node or " " in node or len(node) > 64 or not node.isprintable():
        raise ConfigError(f"a node name is 1 to 64 printable characters without '/' or spaces, got {node!r}")
    return node


def _cuda_count() -> int:
    try:
        import pynvml

        pynvml.nvmlInit()
        return int(pynvml.nvmlDeviceGetCount())
    except Exception:  # noqa: BLE001 - no driver, no library: no GPU
        return 0


def _parse_devices(text: str) -> list[str]:
    """``--devices``' list; a CPU core this process may not run on is refused here, before any run (the bench
    ran its warm-up first, then failed with a traceback from ``sched_setaffinity``)."""
    names = [parse_device_name(d) for d in text.split(",") if d.strip()]
    for name in names:
        if name.kind == "cpu":
            check_cpu_device(name)
    devices = [str(name) for name in names]
    if not devices:
        raise ConfigError("--devices needs at least one device, e.g. cpu:0")
    if len(set(devices)) != len(devices):
        raise ConfigError(f"--devices names a device twice: {text}")
    return devices


def remainder_command(words: Sequence[str], usage: str) -> list[str]:
    """The command of an argparse remainder (after ``--``); ConfigError showing ``usage`` when there is none."""
    command = list(words)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise ConfigError(f"no command given: {usage}")
    return command


def job_devices(text: str, kind: str, command: Sequence[str]) -> tuple[list[str], str]:
    """``--devices``: a list, or ``auto`` (:func:`local_devices`, with ``--device-kind``); and where they
    came from."""
    if text.strip() == "auto":
        return local_devices(os.environ, command, _cuda_count, sorted(os.sched_getaffinity(0)), kind)
    return _parse_devices(text), "--devices"


def run(args: argparse.Namespace) -> int:
    command = remainder_command(args.command, "freeride launch --devices cpu:0 -- COMMAND [ARGS...]")
    env = os.environ
    devices, source = job_devices(args.devices, args.device_kind, command)
    log.info("devices of this node: %s (from %s)", ",".join(devices), source)
    if args.ready_timeout_s <= 0 or args.stop_timeout_s < 0:
        raise ConfigError("--ready-timeout-s must be > 0 and --stop-timeout-s >= 0")
    node = check_node_name(args.node or env.get("SLURMD_NODENAME") or socket.gethostname())
    extra = list(args.manager_arg) + ["--node", node]
    if args.queue is not None or args.checkpoint_dir is not None:
        if not (args.queue and args.checkpoint_dir):
            raise ConfigError("--queue and --checkpoint-dir go together (a shared directory for cluster tasks)")
        extra += ["--queue", args.queue, "--checkpoint-dir", os.path.abspath(args.checkpoint_dir)]
    state_dir = Path(args.state_dir) if args.state_dir else None
    if spans_nodes(env, command):
        # One state directory per node: a shared file system must never give two nodes one SQLite store.
        if state_dir is None:
            base = env.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
            state_dir = Path(base) / "freeride" / "nodes"
        state_dir = state_dir / node
    if args.log_dir:
        log_dir = Path(args.log_dir)
    elif state_dir is not None:
        log_dir = state_dir
    else:
        log_dir = Path(tempfile.mkdtemp(prefix="launch-", dir=runtime_dir()))
    made_log_dir = not args.log_dir and state_dir is None
    log_dir.mkdir(parents=True, exist_ok=True)

    configured = [name for name, given in (("--queue", args.queue), ("--checkpoint-dir", args.checkpoint_dir),
                                           ("--state-dir", args.state_dir), ("--manager-arg", args.manager_arg))
                  if given]
    managers: list[ManagedManager] = []
    relay: WarningRelay | None = None
    try:
        managers = start_managers(devices, state_dir, log_dir, extra, configured=configured)
        wait_ready(managers, args.ready_timeout_s)
        relay = WarningRelay(managers).start()
        ours = [m.device for m in managers if m.proc is not None]
        found = [m.device for m in managers if m.proc is None]
        serving = (f"managers serving {', '.join(ours)} (logs in {log_dir})" if ours else "")
        if found:
            serving += ("; " if serving else "") + f"using the managers already serving {', '.join(found)}"
        print(f"freeride launch: {serving}; running: " + " ".join(command), file=sys.stderr, flush=True)
        return run_command(command)
    finally:
        if relay is not None:
            relay.close()
        for line in summary_lines(managers):
            print(line, file=sys.stderr, flush=True)
        stop_managers(managers, args.stop_timeout_s)
        if made_log_dir and not any(log_dir.iterdir()):
            log_dir.rmdir()  # every manager was already serving: nothing of this launch's to keep
