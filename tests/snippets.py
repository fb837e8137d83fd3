"""Run the code blocks of the docs as written: the harness behind the README's "Instrument your trainer".

A block to be tested is marked in the Markdown by an HTML comment on the line before its fence, which
renders as nothing::

    <!-- snippet: torch-pipelining -->
    ```python
    ...
    ```

:func:`snippet` returns a marked block's code exactly as a reader copies it; :func:`write_snippet` puts
it in a file. A trainer snippet is then run as its reader runs it, under ``torchrun``
(:func:`run_torchrun`), with a real ``freeride manager`` per device listening where the snippet looks
by default (:func:`managers`: their runtime directory, ``$XDG_RUNTIME_DIR``, is a private one, so the
default endpoints of the test are nobody else's). A framework's snippet (DeepSpeed, Megatron Core,
torchtitan) gets a marker of its own and a test of three calls.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from conftest import TESTS_DIR, wait_for
from daemons import health, stop_daemon

from freeride._wire.client import ControlClient
from freeride.endpoints import Endpoint

REPO = TESTS_DIR.parent
README = REPO / "README.md"

_FENCE = re.compile(r"^```(\w*)\s*$")


def snippet(name: str, path: Path = README) -> str:
    """The code of the fenced block right after ``<!-- snippet: NAME -->`` in ``path`` (exactly one)."""
    lines = path.read_text().splitlines()
    marker = f"<!-- snippet: {name} -->"
    starts = [i for i, line in enumerate(lines) if line.strip() == marker]
    if len(starts) != 1:
        raise AssertionError(f"{path.name} has {len(starts)} blocks marked {marker!r}, expected 1")
    i = starts[0] + 1
    if i >= len(lines) or not _FENCE.match(lines[i]):
        raise AssertionError(f"{marker} in {path.name} is not followed by a ``` fence")
    body: list[str] = []
    for line in lines[i + 1:]:
        if line.strip() == "```":
            return "\n".join(body) + "\n"
        body.append(line)
    raise AssertionError(f"the block marked {marker!r} in {path.name} has no closing fence")


def write_snippet(name: str, directory: Path, file_name: str | None = None, path: Path = README) -> Path:
    """Write the marked block to ``directory/file_name`` (default ``NAME.py``, dashes as underscores)."""
    target = directory / (file_name or name.replace("-", "_") + ".py")
    target.write_text(snippet(name, path))
    return target


@dataclass
class Managers:
    """Managers started by :func:`managers`, and the environment under which their default endpoints are
    where a trainer run with it looks."""

    env: dict[str, str]
    endpoints: dict[str, Endpoint]

    def client(self, device: str) -> ControlClient:
        return ControlClient(self.endpoints[device])


@contextlib.contextmanager
def managers(devices: Sequence[str], state: Path) -> Iterator[Managers]:
    """A ``freeride manager`` per device, each at its default endpoint under a private runtime directory.

    Yields once every manager is SERVING; stops them (SIGTERM, a drain) on exit.
    """
    runtime = Path(tempfile.mkdtemp(prefix="frsn-"))  # a short path: unix sockets allow about 100 bytes
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime)}
    env.pop("FREERIDE_ENDPOINT", None)
    endpoints = {d: Endpoint("unix", str(runtime / "freeride" / f"{d.replace(':', '-')}.sock")) for d in devices}
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for device in devices:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "freeride.cli", "manager", "--device", device, "--state-dir",
                 str(state / device.replace(":", "-"))],
                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            ))
        for proc, (device, endpoint) in zip(procs, endpoints.items(), strict=True):

            def serving(proc: subprocess.Popen[bytes] = proc, endpoint: Endpoint = endpoint) -> bool:
                assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else "manager exited"
                return health(endpoint) == "SERVING"

            wait_for(serving, 60, what=f"the manager of {device}")
        yield Managers(env, endpoints)
    finally:
        for proc in procs:
            stop_daemon(proc)
        with contextlib.suppress(OSError):
            for path in sorted(runtime.rglob("*"), reverse=True):
                path.unlink() if not path.is_dir() else path.rmdir()
            runtime.rmdir()


def run_torchrun(script: Path, nproc: int, env: Mapping[str, str], timeout_s: float = 600,
                 args: Sequence[str] = ()) -> subprocess.CompletedProcess[str]:
    """``torchrun --standalone --nproc-per-node NPROC script args``, as a reader runs it, in ``script``'s
    directory; stdout and stderr are captured."""
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
         str(script), *args],
        cwd=script.parent, env=dict(env), capture_output=True, text=True, timeout=timeout_s,
    )
