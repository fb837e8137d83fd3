"""Queue URLs: where the cluster queue's Redis is, and how to reach it.

``redis://[[user]:password@]host[:port][/db]``, ``rediss://...`` for TLS, and
``unix:///path/redis.sock[?db=N]``. Credentials and TLS come through the URL and nowhere else;
:attr:`QueueURL.redacted` is the form printed in messages and logs (the password never is).
A malformed URL is a :class:`~freeride.errors.ConfigError` (exit 2), found before any connection.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qsl, unquote, urlsplit

from freeride.errors import ConfigError

SCHEMES = ("redis", "rediss", "unix")
DEFAULT_PORT = 6379
#: Query parameters passed on to the Redis client: TLS settings for ``rediss://``, the database of
#: a unix socket. Anything else is refused, so that a typo is not silently ignored.
_TLS_PARAMS = ("ssl_cert_reqs", "ssl_ca_certs", "ssl_ca_path", "ssl_certfile", "ssl_keyfile", "ssl_check_hostname")
_URL_HINT = "use redis://[:password@]host[:port][/db], rediss://... for TLS, or unix:///path/redis.sock"


@dataclass(frozen=True)
class QueueURL:
    """A parsed queue URL; ``text`` is what the Redis client is given."""

    text: str
    scheme: str
    host: str
    port: int
    path: str
    db: int
    username: str
    has_password: bool

    @property
    def tls(self) -> bool:
        return self.scheme == "rediss"

    @property
    def redacted(self) -> str:
        """The URL with its password replaced by ``***``: safe for messages and logs."""
        if self.scheme == "unix":
            where = self.path + (f"?db={self.db}" if self.db else "")
            auth = f"{self.username}:***@" if self.has_password else (f"{self.username}@" if self.username else "")
            return f"unix://{auth}{where}"
        auth = ""
        if self.has_password:
            auth = f"{self.username}:***@"
        elif self.username:
            auth = f"{self.username}@"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{auth}{host}:{self.port}/{self.db}"

    def __str__(self) -> str:
        return self.redacted


def parse_queue_url(text: str) -> QueueURL:
    """Check a queue URL's form; raise :class:`ConfigError` naming what is wrong."""
    text = text.strip()
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError as exc:
        raise ConfigError(f"bad queue URL: {exc}; {_URL_HINT}") from None
    if parts.scheme not in SCHEMES:
        raise ConfigError(f"bad queue URL scheme {parts.scheme or '(none)'!r}: {_URL_HINT}")
    if parts.fragment:
        raise ConfigError(f"a queue URL has no #fragment; {_URL_HINT}")
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    allowed = ("db",) if parts.scheme == "unix" else (_TLS_PARAMS if parts.scheme == "rediss" else ())
    unknown = sorted(set(query) - set(allowed))
    if unknown:
        raise ConfigError(f"unknown queue URL parameter(s) {', '.join(unknown)} (allowed here: "
                          f"{', '.join(allowed) or 'none'})")
    username = unquote(parts.username or "")
    has_password = parts.password is not None and parts.password != ""
    if parts.scheme == "unix":
        path = unquote(parts.path)
        if parts.netloc.rpartition("@")[2] or not path.startswith("/"):
            raise ConfigError(f"a unix queue URL names an absolute socket path: unix:///path/redis.sock, got {text!r}")
        db_text = query.get("db", "0")
    else:
        path = ""
        if not parts.hostname:
            raise ConfigError(f"the queue URL names no host; {_URL_HINT}")
        db_text = parts.path.lstrip("/") or "0"
        if "/" in db_text:
            raise ConfigError(f"the queue URL's path is a database number, got {parts.path!r}")
    if not db_text.isdigit() or int(db_text) > 1_000_000:
        raise ConfigError(f"the queue URL's database must be a number, got {db_text!r}")
    return QueueURL(
        text=text,
        scheme=parts.scheme,
        host=parts.hostname or "",
        port=port or DEFAULT_PORT,
        path=path,
        db=int(db_text),
        username=username,
        has_password=has_password,
    )
