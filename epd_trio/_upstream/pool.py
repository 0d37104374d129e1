"""The upstream HTTP client: a lean per-instance pool of HTTP/1.1 connections (``_upstream/h1``).

Why not ``httpx.AsyncClient``: measured on the proxy's hot path (docs/discussion/performance.md),
the client layers above the connection were most of the proxy's CPU per request. httpx 0.28's
pool assigns queued requests in O(n^2) (encode/httpx#3215); its maintained fork ``httpx2`` fixed
that, but its pool still re-checks every connection it holds each time a request starts or
ends, and every request also pays for URL/header models, auth, redirect and cookie handling,
and five nested body generators per chunk. httpcore and h11 below it were then half the cost of
a relayed token (``_upstream/h1`` says why). Here each instance gets an ``UpstreamPool``: a stack of idle
``_h1.Connection``s (last in, first out, so the warm ones are reused) and a
``trio.CapacityLimiter`` that admits at most ``limit`` requests (the rest wait in its FIFO
queue, at most ``queue_timeout``).

Timeouts: connect (per new connection), the queue wait, and an optional per-read timeout (the
stream idle gap) live here; the whole-call deadline is the caller's (``_upstream``).

Instances come and go (self-registration): ``UpstreamClient.follow`` retires the pools of the
instances that left, which keep serving the requests already routed there, and ``reap`` closes
them once nothing is in flight on them. A closed pool closes each connection as its response
ends, instead of keeping it.

Idle connections are dropped after ``keepalive_expiry`` (default 4 s): vLLM's server closes idle
keep-alive connections after 5 s (``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``), and a request written to a
connection the server is closing fails without having been read. A connection whose peer already
closed it is detected when taken from the stack (a non-blocking peek at its socket).

A response closed before its end (the client left, a deadline, a failed sibling) closes its
connection with a TCP reset, so vLLM aborts the work at once (``_h1.reset_on_close``).
"""

from __future__ import annotations

import math
import ssl
from collections.abc import Collection, Iterable, Mapping
from typing import Any
from urllib.parse import urlsplit

import trio

from .._core.routing import Instance
from .h1 import (
    ConnectError,
    Connection,
    ConnectRefused,
    ConnectTimeout,
    PoolTimeout,
    TimeoutException,
    TransportError,
    connect,
    encode_request,
)

#: Seconds an idle connection is kept: below vLLM's (uvicorn's) 5 s keep-alive.
KEEPALIVE_EXPIRY = 4.0


def _encode_headers(headers: Mapping[str, str]) -> list[tuple[bytes, bytes]]:
    """Header pairs as bytes; names lowercased so a caller's value can replace a default of the
    same name whatever its casing."""
    return [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]


async def _close_all(conns: Iterable[Connection], *, reset: bool = False) -> None:
    for conn in conns:
        await conn.aclose(reset=reset)


class UpstreamResponse:
    """A response whose body is still to be read; ``aclose()`` gives its connection back."""

    __slots__ = ("_closed", "_conn", "_ended", "_pool", "_read_timeout", "_release", "headers",
                 "status")

    def __init__(self, pool: UpstreamPool, conn: Connection, status: int,
                 headers: list[tuple[bytes, bytes]], release: _Release,
                 read_timeout: float | None) -> None:
        self.status = status
        #: Raw header pairs as received (names in the server's casing).
        self.headers = headers
        self._pool = pool
        self._conn = conn
        self._release = release
        self._read_timeout = read_timeout
        self._closed = False
        self._ended = False

    @property
    def is_success(self) -> bool:
        return 200 <= self.status < 300

    def header(self, name: str, default: str | None = None) -> str | None:
        """One header's value (case-insensitive name), decoded as latin-1 like HTTP says."""
        key = name.lower().encode("ascii")
        for raw_name, value in self.headers:
            if raw_name.lower() == key:
                return value.decode("latin-1")
        return default

    async def receive(self, timeout: float | None = -1.0) -> bytes:  # noqa: ASYNC109
        """The body bytes that arrive next, as one piece however many reads' worth were
        buffered; ``b""`` once the body is over. ``timeout`` bounds the wait (the request's
        ``read_timeout`` by default, None: no bound; the caller owns the deadline)."""
        if self._ended:
            return b""
        data = await self._conn.receive_body(self._read_timeout if timeout == -1.0 else timeout)
        if not data:
            self._ended = True
        return data

    async def aread(self) -> bytes:
        """The whole body; the connection goes back to the pool."""
        try:
            parts = []
            while data := await self.receive():
                parts.append(data)
            return b"".join(parts)
        finally:
            await self.aclose()

    @property
    def socket(self) -> Any:
        """The connection's socket (for socket options)."""
        return self._conn.socket

    async def aclose(self) -> None:
        """Close the body (idempotent): a connection read to its end and still reusable goes
        back to the idle stack; one closed before its end is reset (vLLM aborts the work)."""
        if self._closed:
            return
        self._closed = True
        self._release()
        await self._pool._check_in(self._conn, reset=not self._ended)


class _Release:
    """Gives one request's limiter token back, once."""

    __slots__ = ("_borrower", "_limiter")

    def __init__(self, limiter: trio.CapacityLimiter, borrower: object) -> None:
        self._limiter = limiter
        self._borrower: object | None = borrower

    def __call__(self) -> None:
        if self._borrower is not None:
            self._limiter.release_on_behalf_of(self._borrower)
            self._borrower = None


#: Bodies larger than this are written after their head rather than joined to it in one
#: buffer (one write for the small ones, no copy of the large ones).
SEPARATE_BODY_BYTES = 256 * 1024


class UpstreamPool:
    """Connections to one upstream instance (base URL), at most ``limit`` requests at once."""

    def __init__(self, url: str, *, limit: int = 256, connect_timeout: float = 10.0,
                 queue_timeout: float | None = None,
                 keepalive_expiry: float = KEEPALIVE_EXPIRY,
                 headers: Mapping[str, str] | None = None) -> None:
        parsed = urlsplit(url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"not an http:// or https:// URL: {url!r}")
        #: Sent with every request (the upstream API key).
        self._default_headers = _encode_headers(headers or {})
        self.url = url
        self._host = parsed.hostname
        self._port = parsed.port or (443 if parsed.scheme == "https" else 80)
        self._tls = ssl.create_default_context() if parsed.scheme == "https" else None
        self._prefix = parsed.path.rstrip("/").encode("ascii")
        host = self._host
        if ":" in host:  # an IPv6 literal goes in brackets
            host = f"[{host}]"
        self._host_header = (host if parsed.port is None else f"{host}:{parsed.port}").encode()
        self._connect_timeout = connect_timeout
        self._queue_timeout = queue_timeout
        self._keepalive_expiry = keepalive_expiry
        self._idle: list[Connection] = []
        self._closed = False
        self.limiter = trio.CapacityLimiter(limit)

    async def _check_out(self) -> Connection:
        """The most recently used idle connection still open, else a new one."""
        now = trio.current_time()
        while self._idle:
            conn = self._idle.pop()
            if not conn.has_expired(now):
                return conn
            await conn.aclose()
        return await connect(self._host, self._port, tls=self._tls,
                             timeout=self._connect_timeout)

    async def sweep(self) -> int:
        """Close idle connections past their keep-alive or closed by the server (after a burst
        they would otherwise sit in CLOSE_WAIT below the top of the stack); how many."""
        now = trio.current_time()
        keep: list[Connection] = []
        stale: list[Connection] = []
        for conn in self._idle:
            (stale if conn.has_expired(now) else keep).append(conn)
        self._idle[:] = keep
        await _close_all(stale)
        return len(stale)

    @property
    def is_closed(self) -> bool:
        return self._closed

    async def _check_in(self, conn: Connection, *, reset: bool = False) -> None:
        if conn.is_idle() and not self._closed:
            conn.expires_at = trio.current_time() + self._keepalive_expiry
            self._idle.append(conn)
            return
        # Not reusable (the server asked to close, the body was not read to its end), or the
        # pool was closed while this request ran.
        await conn.aclose(reset=reset)

    async def request(
        self, method: bytes, path: bytes, *, headers: Mapping[str, str] = {},
        content: bytes = b"", read_timeout: float | None = None,
    ) -> UpstreamResponse:
        """Send a request; return once the response headers are in (the body is still to read).

        ``read_timeout`` bounds each wait for data (None: only the caller's deadline does).
        Raises ``PoolTimeout`` when no place frees within ``queue_timeout``.
        """
        if self._closed:
            raise ConnectError(f"the pool for {self.url} is closed")
        # Everything that can fail on the caller's input happens before a place is taken.
        request_headers = [(b"host", self._host_header),
                           (b"content-length", str(len(content)).encode())]
        own = _encode_headers(headers)
        if self._default_headers:
            names = {name for name, _ in own}  # the caller's value wins (one Authorization)
            request_headers += [h for h in self._default_headers if h[0] not in names]
        request_headers += own
        # A large body (an audio upload, base64 media) goes out after its head, not joined to
        # it: joining would hold a second copy of it for the time of the write.
        joined = len(content) <= SEPARATE_BODY_BYTES
        data = encode_request(method, self._prefix + path, request_headers,
                              content if joined else b"")
        body = b"" if joined else content
        borrower = object()
        try:  # a free place needs no cancel scope (one per request saved)
            self.limiter.acquire_on_behalf_of_nowait(borrower)
        except trio.WouldBlock:
            with trio.move_on_after(self._queue_timeout or math.inf) as waited:
                await self.limiter.acquire_on_behalf_of(borrower)
            if waited.cancelled_caught:
                raise PoolTimeout(f"no free place among {self.limiter.total_tokens:g} in "
                                  f"{self._queue_timeout:g} s") from None
        release = _Release(self.limiter, borrower)
        conn: Connection | None = None
        try:
            conn = await self._check_out()
            # No resend on a failed reused connection: the server may have processed the
            # request (a POST that runs a generation); the failover layer decides, on another
            # instance, with a new request id.
            status, response_headers = await conn.send_request(data, read_timeout, body)
        except BaseException:
            release()
            if conn is not None:  # abandoned or failed mid-request: vLLM must abort it
                await conn.aclose(reset=True)
            raise
        return UpstreamResponse(self, conn, status, response_headers, release, read_timeout)

    async def aclose(self) -> None:
        """Close the idle connections; busy ones close when their response does."""
        self._closed = True
        idle, self._idle = self._idle, []
        await _close_all(idle)


class UpstreamClient:
    """One ``UpstreamPool`` per upstream instance, made on first use; an async context manager.

    ``max_connections`` is per DP rank: an instance serving ``dp_size`` ranks admits
    ``max_connections * dp_size`` requests at once. ``headers`` go on every request.

    The owner of the pools: ``follow`` tells it which instances exist (the proxy calls it at each
    roster change); the pools of the others are retired, still usable by requests routed there
    before, and closed by ``reap`` once idle; ``aclose`` closes all.
    """

    def __init__(self, *, max_connections: int = 256, connect_timeout: float = 10.0,
                 queue_timeout: float | None = 30.0,
                 keepalive_expiry: float = KEEPALIVE_EXPIRY,
                 headers: Mapping[str, str] | None = None) -> None:
        self._max_connections = max_connections
        self._connect_timeout = connect_timeout
        self._queue_timeout = queue_timeout
        self._keepalive_expiry = keepalive_expiry
        self._headers = dict(headers or {})
        self._pools: dict[str, UpstreamPool] = {}
        self._retired: dict[str, UpstreamPool] = {}
        #: The instances that exist (None: any; the client was never told).
        self._present: Collection[str] | None = None
        self._closed = False

    def pool(self, instance: Instance) -> UpstreamPool:
        pool = self._pools.get(instance.url)
        if pool is None:
            pool = self._retired.get(instance.url)  # it left; a request routed there before
            if pool is not None:
                return pool
            if self._closed:
                raise RuntimeError("UpstreamClient used after aclose()")
            pool = UpstreamPool(
                instance.url, limit=self._max_connections * instance.dp_size,
                connect_timeout=self._connect_timeout, queue_timeout=self._queue_timeout,
                keepalive_expiry=self._keepalive_expiry, headers=self._headers)
            gone = self._present is not None and instance.url not in self._present
            (self._retired if gone else self._pools)[instance.url] = pool
        return pool

    def follow(self, instances: Iterable[Instance]) -> None:
        """The instances that exist now: retire the pools of the others, take back a returning
        one's, resize a pool whose instance changed its ``dp_size``."""
        present = {inst.url: inst for inst in instances}
        for url in [url for url in self._pools if url not in present]:
            self._retired[url] = self._pools.pop(url)
        for url, inst in present.items():
            pool = self._retired.pop(url, None)
            if pool is not None and not pool.is_closed:
                self._pools[url] = pool
            pool = self._pools.get(url)
            if pool is not None:
                pool.limiter.total_tokens = self._max_connections * inst.dp_size
        self._present = present

    async def reap(self) -> int:
        """Close the retired pools with no request in flight, and the stale idle connections
        of the live ones; how many pools were closed.

        Each step re-reads the state: closing yields, and meanwhile ``follow`` may take a pool
        back or a request may start on it.
        """
        closed = 0
        for url in list(self._retired):
            pool = self._retired.get(url)
            if pool is None or pool.limiter.borrowed_tokens:
                continue
            del self._retired[url]
            await pool.aclose()
            closed += 1
        for pool in list(self._pools.values()):
            await pool.sweep()
        return closed

    async def aclose(self) -> None:
        self._closed = True
        pools = [*self._pools.values(), *self._retired.values()]
        self._pools, self._retired = {}, {}
        for pool in pools:
            await pool.aclose()

    async def __aenter__(self) -> UpstreamClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


__all__ = ["KEEPALIVE_EXPIRY", "ConnectRefused", "ConnectTimeout", "PoolTimeout", "TimeoutException",
           "TransportError", "UpstreamClient", "UpstreamPool", "UpstreamResponse"]
