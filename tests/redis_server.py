"""A real ``redis-server`` for the cluster-queue tests and the queue bench: one per test, on a unix
socket in its own temporary directory (no TCP port: ``--port 0``), stopped at the end.

It persists with an append-only file fsynced after every write (``appendfsync always``), so a test
can kill it with SIGKILL and start it again on the same socket and directory with nothing lost.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path


class RedisServer:
    def __init__(self, binary: str, directory: Path, *options: str) -> None:
        self.binary = binary
        self.directory = directory
        self.sock = directory / "redis.sock"
        self.options = list(options)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"unix://{self.sock}"

    def url_with(self, password: str = "", db: int = 0) -> str:
        auth = f":{password}@" if password else ""
        return f"unix://{auth}{self.sock}" + (f"?db={db}" if db else "")

    def start(self, timeout_s: float = 20.0) -> None:
        argv = [
            self.binary, "--port", "0", "--unixsocket", str(self.sock), "--unixsocketperm", "700",
            "--dir", str(self.directory), "--appendonly", "yes", "--appendfsync", "always", "--save", "",
            "--daemonize", "no", "--logfile", str(self.directory / "redis.log"), *self.options,
        ]
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while not self._answers():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                log = self.log_tail()
                self.kill()
                raise RuntimeError(f"redis-server did not start on {self.sock}; its log ends with:\n{log}")
            time.sleep(0.02)

    def _answers(self) -> bool:
        import socket

        if not self.sock.exists():
            return False
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(1.0)
                s.connect(str(self.sock))
                s.sendall(b"PING\r\n")
                reply = s.recv(64)
        except OSError:
            return False
        # A server that needs a password answers NOAUTH: it is up all the same.
        return reply.startswith((b"+PONG", b"-NOAUTH"))

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join((self.directory / "redis.log").read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL, as a crash or a lost machine would do it."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def restart(self) -> None:
        """Kill and start again on the same socket and directory (the append-only file survives)."""
        self.kill()
        self.start()


def start_redis(binary: str, *options: str) -> RedisServer:
    """A started server in a fresh short directory under /tmp (a unix socket path has at most 107 bytes)."""
    directory = Path(tempfile.mkdtemp(prefix="fr-redis-", dir="/tmp"))
    server = RedisServer(binary, directory, *options)
    try:
        server.start()
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    return server


def remove(server: RedisServer) -> None:
    server.stop()
    shutil.rmtree(server.directory, ignore_errors=True)
