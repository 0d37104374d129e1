"""``EPD_STATE_URL``: where the replicas of one fleet share their state (a Redis server).

Parsed here, once, at start-up, so that a malformed URL stops the proxy with one line naming
the setting instead of a connection error minutes later, and so that nothing else ever holds
the raw string: the password lives in one field that no ``repr`` shows, and every log line
uses ``redacted()``. Pure: no I/O, no client library.

Accepted (as redis-py and coredis spell them):
``redis://[[username]:password@]host[:port][/db]``, ``rediss://...`` (TLS), and
``unix://[[username]:password@]/path/to/socket[?db=N]``.

TLS (``rediss://``) verifies the server's certificate and host name against the system's
certificate authorities, or against a private one given as ``?ssl_ca_certs=/path/ca.pem`` (a
file, or a directory of them); ``ssl_certfile`` and ``ssl_keyfile`` (both or neither) give a
client certificate for servers that ask for one (``tls-auth-clients yes``). The names are
redis-py's and coredis's own URL parameters. Whether the files can be read is checked at
start-up too (``_replicas/tls``): this module does no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import parse_qs, unquote, urlsplit

DEFAULT_PORT = 6379
SCHEMES = ("redis", "rediss", "unix")
#: The query parameters of ``rediss://`` (paths of PEM files).
TLS_PARAMETERS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")


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
    #: ``rediss://`` only: the certificate authorities that sign the server's certificate (a
    #: PEM file or a directory; None: the system's), and a client certificate and its key.
    ca_certs: str | None = None
    certfile: str | None = None
    keyfile: str | None = None

    @property
    def tls(self) -> bool:
        return self.scheme == "rediss"

    def redacted(self) -> str:
        """The URL as logs and ``/instances`` show it: its userinfo (user and password) as
        ``***``, as ``urls.redact_url`` shows every URL."""
        auth = "***@" if self.password is not None or self.username else ""
        if self.scheme == "unix":
            query = f"?db={self.db}" if self.db else ""
            return f"unix://{auth}{self.path}{query}"
        host = f"[{self.host}]" if self.host and ":" in self.host else self.host
        files = [(name, value) for name, value in zip(
            TLS_PARAMETERS, (self.ca_certs, self.certfile, self.keyfile), strict=True) if value]
        query = "?" + "&".join(f"{name}={value}" for name, value in files) if files else ""
        return f"{self.scheme}://{auth}{host}:{self.port}/{self.db}{query}"


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
    if port == 0:
        raise ValueError("bad port 0: expected an integer from 1 to 65535")
    if any(ch.isspace() or not ch.isprintable() for ch in text):
        raise ValueError("a state URL holds no whitespace or control character")
    if "db" in query:
        raise ValueError(f"{scheme}:// takes the database as a path (/db), not a query")
    unknown = set(query) - set(TLS_PARAMETERS)
    if unknown:
        raise ValueError(f"unknown query parameter(s): {', '.join(sorted(unknown))} (rediss:// "
                         f"takes {', '.join(TLS_PARAMETERS)})")
    if query and scheme != "rediss":
        raise ValueError(f"{', '.join(sorted(query))}: TLS parameters need rediss://")
    files = {}
    for name, values in query.items():
        if len(values) != 1 or not values[0].strip():
            raise ValueError(f"{name} needs one path")
        files[name] = values[0].strip()
    if ("ssl_certfile" in files) != ("ssl_keyfile" in files):
        raise ValueError("a client certificate needs both ssl_certfile and ssl_keyfile")
    path = parts.path.strip("/")
    db = _db(path) if path else 0
    return StateURL(scheme, host=parts.hostname, port=DEFAULT_PORT if port is None else port,
                    db=db, username=username, password=password,
                    ca_certs=files.get("ssl_ca_certs"), certfile=files.get("ssl_certfile"),
                    keyfile=files.get("ssl_keyfile"))


def _db(raw: str) -> int:
    if not raw.isdigit():
        raise ValueError(f"the database must be a number (0, 1, ...), got {raw!r}")
    return int(raw)
