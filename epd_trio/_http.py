"""The upstream HTTP client: httpcore2 connections (httpx2's transport core) in a lean per-instance pool.

Why not ``httpx.AsyncClient``: measured on the proxy's hot path (docs/discussion/performance.md), the
client layers above the connection were most of the proxy's CPU per request. httpx 0.28's pool
assigns queued requests in O(n^2) (encode/httpx#3215); its maintained fork ``httpx2`` fixed that,
but its pool still re-checks every connection it holds (a ``poll`` syscall per idle one) each
time a request starts or ends, and every request also pays for URL/header models, auth, redirect
and cookie handling, and five nested body generators per chunk. Here each instance gets an
``UpstreamPool``: a stack of idle ``httpcore2`` HTTP/1.1 connections (last in, first out, so the
warm ones are reused), a ``trio.CapacityLimiter`` that admits at most ``limit`` requests (the
rest wait in its FIFO queue, at most ``queue_timeout``), and a network backend without a cancel
scope per read or write unless the call asked for a timeout. Parsing, chunked encoding and
keep-alive stay httpcore's and h11's.

Timeouts: connect (per new connection), the queue wait, and an optional per-read timeout (the
stream idle gap) live here; the whole-call deadline is the caller's (``_upstream``).

Instances come and go (self-registration): ``UpstreamClient.follow`` retires the pools of the
instances that left, which keep serving the requests already routed there, and ``reap`` closes
them once nothing is in flight on them. A closed pool closes each connection as its response
ends, instead of keeping it.

Idle connections are dropped after ``keepalive_expiry`` (default 4 s): vLLM's server closes idle
keep-alive connections after 5 s (``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``), and a request written to a
connection the server is closing fails without having been read. A connection whose peer already
closed it is detected when taken from the stack (httpcore's ``has_expired``).
"""

from __future__ import annotations

import contextlib
import math
import socket
import ssl
import struct
from collections.abc import AsyncGenerator, Collection, Iterable, Mapping
from typing import Any

import httpcore2 as httpcore
import trio

from ._core.routing import Instance

#: The exceptions ``_upstream.map_upstream_errors`` translates (this library's).
PoolTimeout = httpcore.PoolTimeout
TimeoutException = httpcore.TimeoutException
ConnectTimeout = httpcore.ConnectTimeout
TransportError = (httpcore.NetworkError, httpcore.ProtocolError)

#: Seconds an idle connection is kept: below vLLM's (uvicorn's) 5 s keep-alive.
KEEPALIVE_EXPIRY = 4.0

#: What a trio socket raises when the connection is gone (reads and writes alike).
_SOCKET_ERRORS = (trio.BrokenResourceError, trio.ClosedResourceError, OSError)


def _encode_headers(headers: Mapping[str, str]) -> list[tuple[bytes, bytes]]:
    """Header pairs as httpcore takes them; names lowercased so a caller's value can replace a
    default of the same name whatever its casing."""
    return [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]


def _reusable(conn: httpcore.AsyncHTTPConnection) -> bool:
    """Idle, within its keep-alive, and not closed by the server (httpcore polls the socket)."""
    return conn.is_idle() and not conn.has_expired()


async def _close_all(conns: Iterable[httpcore.AsyncHTTPConnection]) -> None:
    """Close connections even under cancellation: a close left half-done leaks the socket."""
    with trio.CancelScope(shield=True):
        for conn in conns:
            await conn.aclose()


def reset_on_close(sock: socket.socket | None) -> None:
    """Make closing ``sock`` send a TCP reset instead of a FIN (``SO_LINGER`` 0).

    Why: a FIN only half-closes the connection, and vLLM's server notices it only when a later
    write fails, so an abandoned generation ran on for up to hundreds of tokens (measured on real
    vLLM: 11 to 480 of 480 tokens through the proxy, 1 to 3 when the client itself reset). A
    reset is seen at once and vLLM aborts. Best effort: a socket already closed is left alone.
    """
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


class _LeanStream(httpcore.AsyncNetworkStream):
    """A trio socket stream for httpcore with no cancel scope when no timeout is asked for."""

    __slots__ = ("_stream",)

    def __init__(self, stream: trio.SocketStream) -> None:
        self._stream = stream

    # The ``timeout`` parameters are httpcore's network-stream interface.
    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:  # noqa: ASYNC109
        try:
            if timeout is None:
                return await self._stream.receive_some(max_bytes)
            with trio.fail_after(timeout):
                return await self._stream.receive_some(max_bytes)
        except trio.Cancelled:
            # The request is being abandoned while it waits for the server (client gone, a
            # deadline, a failed sibling): httpcore closes the connection next, and that close
            # must reach vLLM as a reset so it aborts the work.
            reset_on_close(self._stream.socket)
            raise
        except trio.TooSlowError:
            reset_on_close(self._stream.socket)
            raise httpcore.ReadTimeout(f"no data for {timeout:g} s") from None
        except _SOCKET_ERRORS as exc:
            raise httpcore.ReadError(str(exc) or type(exc).__name__) from exc

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:  # noqa: ASYNC109
        if not buffer:
            return
        try:
            if timeout is None:
                await self._stream.send_all(buffer)
                return
            with trio.fail_after(timeout):
                await self._stream.send_all(buffer)
        except trio.TooSlowError:
            raise httpcore.WriteTimeout(f"could not write for {timeout:g} s") from None
        except _SOCKET_ERRORS as exc:
            raise httpcore.WriteError(str(exc) or type(exc).__name__) from exc

    async def aclose(self) -> None:
        await self._stream.aclose()

    async def start_tls(self, ssl_context: ssl.SSLContext, server_hostname: str | None = None,
                        timeout: float | None = None,  # noqa: ASYNC109
                        ) -> httpcore.AsyncNetworkStream:
        raise httpcore.ConnectError("the lean backend is for http:// instances only")

    def get_extra_info(self, info: str) -> Any:
        if info == "socket":
            return self._stream.socket
        if info == "is_readable":
            return self._stream.socket.is_readable()
        return None


class _LeanBackend(httpcore.AsyncNetworkBackend):
    """Plain-TCP connects for ``_LeanStream`` (https:// instances use httpcore's own backend)."""

    async def connect_tcp(
        self, host: str, port: int, timeout: float | None = None,  # noqa: ASYNC109
        local_address: str | None = None, socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        try:
            with trio.fail_after(math.inf if timeout is None else timeout):
                stream = await trio.open_tcp_stream(host, port, local_address=local_address)
        except trio.TooSlowError:
            raise httpcore.ConnectTimeout(f"no connection within {timeout:g} s") from None
        except OSError as exc:
            raise httpcore.ConnectError(str(exc) or type(exc).__name__) from exc
        return _LeanStream(stream)

    async def sleep(self, seconds: float) -> None:
        await trio.sleep(seconds)


_LEAN = _LeanBackend()


class UpstreamResponse:
    """A response whose body is still to be read; ``aclose()`` gives its connection back."""

    __slots__ = ("_closed", "_conn", "_pool", "_release", "_response", "headers", "status")

    def __init__(self, pool: UpstreamPool, conn: httpcore.AsyncHTTPConnection,
                 response: httpcore.Response, release: _Release) -> None:
        self.status: int = response.status
        #: Raw header pairs as received (names in the server's casing).
        self.headers: list[tuple[bytes, bytes]] = response.headers
        self._response = response
        self._pool = pool
        self._conn = conn
        self._release = release
        self._closed = False

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

    def aiter_raw(self) -> AsyncGenerator[bytes, None]:
        """The body bytes exactly as they arrive (chunked framing removed, nothing decoded)."""
        return self._response.stream.__aiter__()  # type: ignore[union-attr,return-value]

    async def aread(self) -> bytes:
        """The whole body; the connection goes back to the pool."""
        try:
            return b"".join([chunk async for chunk in self.aiter_raw()])
        finally:
            await self.aclose()

    @property
    def socket(self) -> Any:
        """The connection's socket (for socket options), or None."""
        stream = self._response.extensions.get("network_stream")
        return stream.get_extra_info("socket") if stream is not None else None

    async def aclose(self) -> None:
        """Close the body (idempotent); a connection left reusable returns to the idle stack."""
        if self._closed:
            return
        self._closed = True
        # Shielded: a cancellation pending here must not leave the connection half-closed.
        with trio.CancelScope(shield=True):
            try:
                await self._response.stream.aclose()  # type: ignore[union-attr]
            finally:
                self._release()
                await self._pool._check_in(self._conn)


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


class UpstreamPool:
    """Connections to one upstream instance (base URL), at most ``limit`` requests at once."""

    def __init__(self, url: str, *, limit: int = 256, connect_timeout: float = 10.0,
                 queue_timeout: float | None = None,
                 keepalive_expiry: float = KEEPALIVE_EXPIRY,
                 headers: Mapping[str, str] | None = None) -> None:
        parsed = httpcore.URL(url)
        #: Sent with every request (the upstream API key).
        self._default_headers = _encode_headers(headers or {})
        self.url = url
        self._origin = parsed.origin
        self._prefix = parsed.target.rstrip(b"/")
        port = parsed.port
        host = parsed.host
        if b":" in host:  # an IPv6 literal goes in brackets
            host = b"[" + host + b"]"
        self._host_header = host if port is None else host + b":" + str(port).encode()
        self._backend = _LEAN if parsed.scheme == b"http" else None
        self._connect_timeout = connect_timeout
        self._queue_timeout = queue_timeout
        self._keepalive_expiry = keepalive_expiry
        self._idle: list[httpcore.AsyncHTTPConnection] = []
        self._urls: dict[bytes, httpcore.URL] = {}
        self._closed = False
        self.limiter = trio.CapacityLimiter(limit)

    def _url(self, path: bytes) -> httpcore.URL:
        url = self._urls.get(path)
        if url is None:
            origin = self._origin
            url = self._urls[path] = httpcore.URL(scheme=origin.scheme, host=origin.host,
                                                  port=origin.port, target=self._prefix + path)
        return url

    async def _check_out(self) -> httpcore.AsyncHTTPConnection:
        """The most recently used idle connection still open, else a new one."""
        while self._idle:
            conn = self._idle.pop()
            if _reusable(conn):
                return conn
            await _close_all([conn])
        return self._new_connection()

    async def sweep(self) -> int:
        """Close idle connections past their keep-alive or closed by the server (after a burst
        they would otherwise sit in CLOSE_WAIT below the top of the stack); how many."""
        keep: list[httpcore.AsyncHTTPConnection] = []
        stale: list[httpcore.AsyncHTTPConnection] = []
        for conn in self._idle:
            (keep if _reusable(conn) else stale).append(conn)
        self._idle[:] = keep
        await _close_all(stale)
        return len(stale)

    def _new_connection(self) -> httpcore.AsyncHTTPConnection:
        return httpcore.AsyncHTTPConnection(self._origin, keepalive_expiry=self._keepalive_expiry,
                                            network_backend=self._backend)

    @property
    def is_closed(self) -> bool:
        return self._closed

    async def _check_in(self, conn: httpcore.AsyncHTTPConnection) -> None:
        if not conn.is_idle():
            return  # httpcore closed it (body not fully read, or the server asked to close)
        if not self._closed:
            self._idle.append(conn)
            return
        await _close_all([conn])  # the pool was closed while this request ran

    async def request(
        self, method: bytes, path: bytes, *, headers: Mapping[str, str] = {},
        content: bytes = b"", read_timeout: float | None = None,
    ) -> UpstreamResponse:
        """Send a request; return once the response headers are in (the body is still to read).

        ``read_timeout`` bounds each wait for data (None: only the caller's deadline does).
        Raises ``PoolTimeout`` when no place frees within ``queue_timeout``.
        """
        if self._closed:
            raise httpcore.ConnectError(f"the pool for {self.url} is closed")
        # Everything that can fail on the caller's input happens before a place is taken.
        request_headers = [(b"host", self._host_header),
                           (b"content-length", str(len(content)).encode())]
        own = _encode_headers(headers)
        if self._default_headers:
            names = {name for name, _ in own}  # the caller's value wins (one Authorization)
            request_headers += [h for h in self._default_headers if h[0] not in names]
        request_headers += own
        timeouts = {"connect": self._connect_timeout}
        if read_timeout is not None:
            timeouts["read"] = read_timeout
        request = httpcore.Request(method, self._url(path), headers=request_headers,
                                   content=content, extensions={"timeout": timeouts})
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
        conn: httpcore.AsyncHTTPConnection | None = None
        try:
            conn = await self._check_out()
            # No resend on a failed reused connection: the server may have processed the
            # request (a POST that runs a generation); the failover layer decides, on another
            # instance, with a new request id.
            response = await conn.handle_async_request(request)
        except BaseException:
            release()
            if conn is not None and not conn.is_closed():
                await _close_all([conn])
            raise
        return UpstreamResponse(self, conn, response, release)

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


__all__ = ["KEEPALIVE_EXPIRY", "UpstreamClient", "UpstreamPool", "UpstreamResponse",
           "reset_on_close"]
