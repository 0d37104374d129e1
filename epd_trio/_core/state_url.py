"""``EPD_STATE_URL``: where the replicas of one fleet share their state (a Redis server).

Parsed here, once, at start-up, so that a malformed URL stops the proxy with one line naming
the setting instead of a connection error minutes later, and so that nothing else ever holds
the raw string: the password lives in one field that no ``repr`` shows, and every log line
uses ``redacted()``. Pure: no I/O, no client library.

Accepted (as redis-py and coredis spell them):
``redis://[[username]:password@]host[:port][/db]``, ``rediss://...`` (TLS), and
``unix://[[username]:password@]/path/to/socket[?db=N]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import parse_qs, unquote, urlsplit

DEFAULT_PORT = 6379
SCHEMES = ("redis", "rediss", "unix")


@dataclass(frozen=True, slots=True)
class StateURL:
    """A parsed state URL; ``password`` never appears in ``repr`` or ``redacted()``."""

    scheme: str
    host: str | None = None
    port: int | None = None
    #: The socket's path (``unix://`` only).
    path: str | None = None
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)

    @property
    def tls(self) -> bool:
        return self.scheme == "rediss"

    def redacted(self) -> str:
        """The URL as logs and ``/instances`` show it: the password as ``***``."""
        auth = ""
        if self.password is not None or self.username:
            auth = f"{self.username or ''}{':***' if self.password is not None else ''}@"
        if self.scheme == "unix":
            query = f"?db={self.db}" if self.db else ""
            return f"unix://{auth}{self.path}{query}"
        host = f"[{self.host}]" if self.host and ":" in self.host else self.host
        return f"{self.scheme}://{auth}{host}:{self.port}/{self.db}"


def parse_state_url(raw: str) -> StateURL:
    """``raw`` as a ``StateURL``; a ``ValueError`` says what is wrong without repeating the
    password (the message is printed at start-up)."""
    text = raw.strip()
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError:
        raise ValueError("not a URL (expected redis://host:port[/db], rediss://... or "
                         "unix:///path)") from None
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        raise ValueError(f"the scheme must be one of {', '.join(s + '://' for s in SCHEMES)}, "
                         f"got {parts.scheme + '://' if parts.scheme else 'none'}")
    if parts.fragment:
        raise ValueError("a state URL takes no '#' fragment")
    username = unquote(parts.username) if parts.username else None
    password = unquote(parts.password) if parts.password is not None else None
    query = parse_qs(parts.query, keep_blank_values=True)
    if scheme == "unix":
        if parts.hostname:
            raise ValueError("unix:// takes a socket path (unix:///path/to/redis.sock), not a host")
        if not parts.path.startswith("/") or parts.path == "/":
            raise ValueError("unix:// needs an absolute socket path (unix:///path/to/redis.sock)")
        if set(query) - {"db"}:
            raise ValueError(f"unknown query parameter(s): {', '.join(sorted(set(query) - {'db'}))}")
        db = _db(query["db"][-1]) if "db" in query else 0
        return StateURL(scheme, path=unquote(parts.path), db=db, username=username,
                        password=password)
    if not parts.hostname:
        raise ValueError(f"{scheme}:// needs a host ({scheme}://host:port[/db])")
    if parts.query:
        raise ValueError(f"{scheme}:// takes the database as a path (/db), not a query")
    path = parts.path.strip("/")
    db = _db(path) if path else 0
    return StateURL(scheme, host=parts.hostname, port=DEFAULT_PORT if port is None else port,
                    db=db, username=username, password=password)


def _db(raw: str) -> int:
    if not raw.isdigit():
        raise ValueError(f"the database must be a number (0, 1, ...), got {raw!r}")
    return int(raw)
