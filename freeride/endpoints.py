"""Where a manager listens, and how clients find it.

The default endpoint is a unix socket ``<runtime dir>/<device>.sock`` (``cpu-0.sock``), where the
runtime directory is ``$XDG_RUNTIME_DIR/freeride`` or ``/tmp/freeride-<uid>``, created owner-only
(0700) and refused if another user owns it. TCP is opt-in (``tcp://host:port``) and then every
call must carry a token (``authorization: bearer <token>`` metadata).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from freeride.devices import DeviceName, parse_device_name
from freeride.errors import ConfigError

TOKEN_ENV = "FREERIDE_TOKEN"
ENDPOINT_ENV = "FREERIDE_ENDPOINT"
#: Largest message either side accepts (a task's arguments, a listing of many tasks).
MAX_MESSAGE_BYTES = 4 * 2**20


@dataclass(frozen=True)
class Endpoint:
    kind: str  # "unix" or "tcp"
    address: str  # socket path, or host:port

    @property
    def grpc_target(self) -> str:
        return f"unix:{self.address}" if self.kind == "unix" else self.address

    def __str__(self) -> str:
        return f"unix:{self.address}" if self.kind == "unix" else f"tcp://{self.address}"


def runtime_dir(create: bool = True, environ: Mapping[str, str] | None = None) -> Path:
    """The per-user directory that holds manager sockets, owner-only.

    ``environ`` is the environment whose ``$XDG_RUNTIME_DIR`` counts (default: this process's): a
    process that starts managers and a job in another environment finds the sockets they will use.
    """
    base = (os.environ if environ is None else environ).get("XDG_RUNTIME_DIR")
    path = Path(base) / "freeride" if base and os.path.isdir(base) else Path(f"/tmp/freeride-{os.getuid()}")
    if create:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = path.stat()
        if info.st_uid != os.getuid():
            raise ConfigError(f"{path} belongs to another user; refusing to place sockets there")
        if stat.S_IMODE(info.st_mode) & 0o077:
            path.chmod(0o700)
    return path


def default_endpoint(device: str | DeviceName, environ: Mapping[str, str] | None = None) -> Endpoint:
    """The device's socket in the runtime directory of ``environ`` (default: this process's)."""
    name = parse_device_name(device) if isinstance(device, str) else device
    return Endpoint("unix", str(runtime_dir(environ=environ) / f"{name.slug}.sock"))


def parse_endpoint(text: str) -> Endpoint:
    """Parse ``unix:/path``, a path ending in ``.sock``, ``tcp://host:port`` or ``host:port``."""
    text = text.strip()
    if text.startswith("unix:"):
        path = text[len("unix:") :]
        if path.startswith("//"):
            path = path[2:]
        if not path:
            raise ConfigError("empty unix socket path in endpoint")
        return Endpoint("unix", path)
    if text.startswith("/") or text.endswith(".sock"):
        return Endpoint("unix", text)
    if text.startswith("tcp://"):
        text = text[len("tcp://") :]
    elif _is_device_name(text):  # ``cpu:1`` would read as host "cpu", port 1: a device given as the endpoint
        raise ConfigError(f"endpoint {text!r} is a device name, not an endpoint: name the device as the device "
                          "(BubbleReporter's first argument, --device) and an endpoint as unix:/path/to.sock or "
                          "tcp://host:port (a host named like a device: tcp://" + text + ")")
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"cannot parse endpoint {text!r}: use unix:/path/to.sock or tcp://host:port")
    return Endpoint("tcp", f"{host}:{port}")


def _is_device_name(text: str) -> bool:
    try:
        parse_device_name(text)
    except ConfigError:
        return False
    return True


def resolve_endpoint(endpoint: str | None, device: str | None) -> Endpoint:
    """The endpoint a client should use: explicit, else ``$FREERIDE_ENDPOINT``, else the device's."""
    if endpoint:
        return parse_endpoint(endpoint)
    if os.environ.get(ENDPOINT_ENV):
        return parse_endpoint(os.environ[ENDPOINT_ENV])
    return default_endpoint(device or "cpu:0")


def read_token(token_file: str | None) -> str | None:
    """A token from a file (first line) or ``$FREERIDE_TOKEN``; None if neither is given."""
    if token_file:
        try:
            token = Path(token_file).read_text().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read token file {token_file}: {exc.strerror}") from None
        if not token:
            raise ConfigError(f"token file {token_file} is empty")
        return token
    return os.environ.get(TOKEN_ENV) or None
