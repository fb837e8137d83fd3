"""The private manager <-> worker channel: small JSON messages over a SOCK_SEQPACKET socketpair.

SEQPACKET keeps message boundaries (no framing to write), delivers in order, and reports the
peer's death as end-of-file, which is how a worker notices that its manager is gone and how the
manager notices a worker that closed its channel. JSON rather than pickle: the manager never
deserialises anything executable that comes from side-task code.
"""

from __future__ import annotations

import json
import socket
from typing import Any

#: Largest message; a parked report carries at most a bounded list of step durations.
MAX_MESSAGE_BYTES = 64 * 1024


class ChannelClosed(Exception):
    """The peer closed the channel or died."""


class ChannelFull(Exception):
    """The peer is not reading (busy in a long step, or frozen) and its buffer is full."""


class ProtocolError(Exception):
    """The peer sent something that is not a well-formed message."""


def socketpair() -> tuple[socket.socket, socket.socket]:
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)


class Channel:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, message: dict[str, Any]) -> None:
        data = json.dumps(message, separators=(",", ":")).encode()
        if len(data) > MAX_MESSAGE_BYTES:
            raise ProtocolError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
        try:
            self.sock.send(data)
        except BlockingIOError:
            raise ChannelFull(f"peer's buffer is full; dropped a {message.get('t')!r} message") from None
        except OSError as exc:
            raise ChannelClosed(str(exc)) from None

    def _decode(self, data: bytes) -> dict[str, Any]:
        if not data:
            raise ChannelClosed("peer closed the channel")
        try:
            message = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ProtocolError(f"malformed message: {exc}") from None
        if not isinstance(message, dict) or not isinstance(message.get("t"), str):
            raise ProtocolError("message is not an object with a type field 't'")
        return message

    def recv(self, timeout_s: float | None = None) -> dict[str, Any] | None:
        """The next message; None if ``timeout_s`` passed first. Raises ChannelClosed at EOF."""
        self.sock.settimeout(timeout_s)
        try:
            data = self.sock.recv(MAX_MESSAGE_BYTES)
        except TimeoutError:
            return None
        except (ConnectionResetError, OSError) as exc:
            raise ChannelClosed(str(exc)) from None
        return self._decode(data)

    def recv_nowait(self) -> dict[str, Any] | None:
        try:
            data = self.sock.recv(MAX_MESSAGE_BYTES, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return None
        except (ConnectionResetError, OSError) as exc:
            raise ChannelClosed(str(exc)) from None
        return self._decode(data)

    def close(self) -> None:
        self.sock.close()
