"""One HTTP/1.1 client connection to an upstream instance: a socket and an llhttp parser.

Why not httpcore and h11, which the proxy used before: on a relayed stream every token is one
upstream read, so what a read costs is what a token costs. Through httpcore a read passed four
generator layers, a cancel scope, trio's stream wrapper (a failed ``recv``, then a wait, then a
second ``recv``) and h11's pure-Python parser, about half the proxy's CPU per token
(docs/discussion/performance.md). Here a read is one ``recv`` into the socket, tried before
waiting, and one ``feed_data`` into httptools (llhttp, the parser uvicorn uses, in C). The body
bytes that one read completes come back as one piece, so a relay sends what is already buffered
in one write and never waits to batch.

A request goes out in one ``send``: head and body together (httpcore wrote them separately, and
the backend paid a wake-up for each).

What it does not do, on purpose: pipelining, ``HEAD``, upgrades, ``Expect: 100-continue``. An
interim (1xx) response the server sends anyway is skipped, as RFC 9110 asks of a client.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import struct
from collections.abc import Sequence
from typing import Any

import httptools
import trio


class HTTPError(Exception):
    """Every failure of this module (the caller translates them in one place)."""


class TransportError(HTTPError):
    """The connection could not be made, or broke, or the server spoke something else."""


class ConnectError(TransportError):
    pass


class ConnectRefused(ConnectError):
    """Every attempt to connect was refused: nothing listens there (a server that exited)."""


class ReadError(TransportError):
    pass


class WriteError(TransportError):
    pass


class RemoteProtocolError(TransportError):
    """The server's bytes are not a valid HTTP/1.1 response (or stopped in the middle of one)."""


class LocalProtocolError(HTTPError, ValueError):
    """A request this module refuses to write (a header that would split the message)."""


class TimeoutException(HTTPError):
    pass


class ConnectTimeout(TimeoutException):
    pass


class ReadTimeout(TimeoutException):
    pass


class WriteTimeout(TimeoutException):
    pass


class PoolTimeout(TimeoutException):
    pass


#: What a socket raises when the connection is gone (resets, refusals, a closed descriptor).
_GONE = (OSError,)
_RECV_SIZE = 65536
#: After a read that found nothing, one read in this many tries before waiting (``_Plain``).
_PROBE_EVERY = 8
_FORBIDDEN_IN_HEADERS = (b"\r", b"\n", b"\0")


def encode_request(method: bytes, target: bytes, headers: Sequence[tuple[bytes, bytes]],
                   body: bytes) -> bytes:
    """The whole request as one buffer, refusing anything that would split the message.

    Checked on the joined head, not per header: a head is well formed when its only CR and LF
    are the line ends this function wrote (one per line, one more at the end) and it has no
    NUL. Per-header checks are the slow path that names the culprit.
    """
    if method == b"HEAD":
        raise LocalProtocolError("HEAD is not supported (its response has no body to frame)")
    parts = [method, b" ", target, b" HTTP/1.1\r\n"]
    for name, value in headers:
        if not name or b":" in name or b" " in name:
            raise LocalProtocolError(f"illegal header name {name!r}")
        parts += (name, b": ", value, b"\r\n")
    parts.append(b"\r\n")
    head = b"".join(parts)
    lines = len(headers) + 2
    if (head.count(b"\r") != lines or head.count(b"\n") != lines or b"\0" in head
            or target.count(b" ")):
        raise LocalProtocolError(_culprit(target, headers))
    return head + body if body else head


def _culprit(target: bytes, headers: Sequence[tuple[bytes, bytes]]) -> str:
    if b" " in target or any(c in target for c in _FORBIDDEN_IN_HEADERS):
        return f"illegal request target {target!r}"
    for name, value in headers:
        if any(c in name or c in value for c in _FORBIDDEN_IN_HEADERS):
            return f"illegal header {name!r}"
    return "illegal request head"  # pragma: no cover (one of the above always matches)


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


class _Message:
    """What the parser has told of the response being read (httptools calls these methods).

    Holds its parser while the response is read (to ask the status of a message that ends its
    head); the connection drops both when the response is over, which breaks the cycle.
    """

    __slots__ = ("body", "complete", "extra", "headers", "headers_done", "interim", "keep_alive",
                 "parser")

    def __init__(self) -> None:
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.headers_done = False
        self.complete = False
        #: The message being parsed is an interim (1xx) response: skipped.
        self.interim = False
        #: Bytes came after the response: the connection is not reused.
        self.extra = False
        #: The server lets the connection be reused (llhttp knows only until the message ends).
        self.keep_alive = False
        self.parser: Any = httptools.HttpResponseParser(self)

    def on_message_begin(self) -> None:
        if self.complete:
            self.extra = True

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.complete:
            self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        if self.complete:
            return
        if self.parser.get_status_code() < 200:
            self.interim = True
            self.headers = []
            return
        self.headers_done = True

    def on_body(self, body: bytes) -> None:
        if not self.complete:
            self.body.append(body)

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False
        elif not self.complete:
            self.complete = True
            self.keep_alive = self.parser.should_keep_alive()

    def feed(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            raise RemoteProtocolError("the server switched protocols") from None
        except httptools.HttpParserError as exc:
            if self.complete:  # garbage after a whole response: keep it, drop the connection
                self.extra = True
                return
            raise RemoteProtocolError(f"invalid HTTP/1.1 response: {exc}") from None


class _Plain:
    """A TCP socket read and written directly (non-blocking, trio's wait for readiness)."""

    __slots__ = ("_misses", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        #: Reads in a row that found (or were expected to find) nothing at first.
        self._misses = 0

    async def receive(self) -> bytes:
        # Whether to try the read before waiting depends on the peer's pace. Under load the
        # bytes are often there already, and a wait would cost a trip through the epoll loop;
        # a stream slower than the proxy (a token every few ms) finds nothing, and the failed
        # read (a syscall and an exception) is a tenth of what relaying a token costs. So after
        # a read that found nothing the next ones wait first, and one in _PROBE_EVERY tries
        # first again to notice when the bytes are there. A read that returns data at once is
        # not a checkpoint: a relay sends next (and a send yields often enough), a whole-body
        # read ends with the body; either way no loop spins without yielding.
        sock = self.sock
        misses = self._misses
        if misses and misses % _PROBE_EVERY:
            self._misses = misses + 1
            await self._wait_readable()
        else:
            await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            try:
                data = sock.recv(_RECV_SIZE)
            except BlockingIOError:
                self._misses += 1
            except _GONE as exc:
                raise ReadError(str(exc) or type(exc).__name__) from exc
            else:
                if self._misses == misses:  # found at the first try: keep trying first
                    self._misses = 0
                return data
            await self._wait_readable()

    async def _wait_readable(self) -> None:
        try:
            await trio.lowlevel.wait_readable(self.sock)
        except trio.ClosedResourceError as exc:  # closed by its owner meanwhile
            raise ReadError("the connection was closed") from exc

    async def send_all(self, data: bytes) -> None:
        sock = self.sock
        await trio.lowlevel.checkpoint_if_cancelled()
        view = memoryview(data)
        while view:
            try:
                sent = sock.send(view)
            except BlockingIOError:
                try:
                    await trio.lowlevel.wait_writable(sock)
                except trio.ClosedResourceError as exc:
                    raise WriteError("the connection was closed") from exc
                continue
            except _GONE as exc:
                raise WriteError(str(exc) or type(exc).__name__) from exc
            view = view[sent:]

    def has_data_or_eof(self) -> bool:
        """Readable while idle: the server closed the connection, or sent bytes nobody asked for."""
        try:
            self.sock.recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            return False
        except OSError:
            return True
        return True

    async def aclose(self) -> None:
        trio.lowlevel.notify_closing(self.sock)
        self.sock.close()
        await trio.lowlevel.checkpoint()


class _TLS:
    """TLS over trio's ``SSLStream`` (https:// instances: rare, so no fast path)."""

    __slots__ = ("sock", "stream")

    def __init__(self, stream: trio.SSLStream[trio.SocketStream]) -> None:
        self.stream = stream
        self.sock: Any = stream.transport_stream.socket

    async def receive(self) -> bytes:
        try:
            return await self.stream.receive_some(_RECV_SIZE)
        except (trio.BrokenResourceError, trio.ClosedResourceError, *_GONE) as exc:
            raise ReadError(str(exc) or type(exc).__name__) from exc

    async def send_all(self, data: bytes) -> None:
        try:
            await self.stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, *_GONE) as exc:
            raise WriteError(str(exc) or type(exc).__name__) from exc

    def has_data_or_eof(self) -> bool:
        return bool(self.sock.is_readable())

    async def aclose(self) -> None:
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await trio.aclose_forcefully(self.stream)


async def connect(host: str, port: int, *, tls: ssl.SSLContext | None = None,
                  timeout: float | None = None) -> Connection:  # noqa: ASYNC109
    """Open a connection (trio's happy eyeballs; ``TCP_NODELAY`` is trio's default)."""
    try:
        with trio.fail_after(timeout) if timeout is not None else contextlib.nullcontext():
            stream = await trio.open_tcp_stream(host, port)
            if tls is not None:
                ssl_stream = trio.SSLStream(stream, tls, server_hostname=host)
                try:
                    await ssl_stream.do_handshake()
                except BaseException:
                    await trio.aclose_forcefully(ssl_stream)
                    raise
                return Connection(_TLS(ssl_stream))
    except trio.TooSlowError:
        raise ConnectTimeout(f"no connection within {timeout:g} s") from None
    except (OSError, trio.BrokenResourceError) as exc:
        error = ConnectRefused if _all_refused(exc) else ConnectError
        raise error(str(exc) or type(exc).__name__) from exc
    # Plain TCP: take the socket out of trio's stream and drive it directly.
    sock = socket.socket(fileno=stream.socket.detach())
    sock.setblocking(False)
    return Connection(_Plain(sock))


def _all_refused(exc: BaseException) -> bool:
    """``exc`` is a refusal, or trio's error for a connect whose every attempt was refused (it
    chains them as an ``ExceptionGroup``)."""
    if isinstance(exc, ConnectionRefusedError):
        return True
    group = exc.__cause__
    return (isinstance(exc, OSError) and isinstance(group, BaseExceptionGroup)
            and all(_all_refused(e) for e in group.exceptions))


class Connection:
    """One keep-alive connection: a request, then its response read to the end, then the next.

    ``send_request`` writes a request and reads up to the end of the response head;
    ``receive_body`` returns the body bytes that arrive next (``b""`` once the body is over).
    The connection is reusable (``is_idle``) once a response was read to its end and the server
    did not ask to close; otherwise the owner closes it. Timeouts are per wait for data and
    optional: a caller that owns one deadline for a whole stream passes None.
    """

    __slots__ = ("_message", "_state", "_transport", "expires_at")

    def __init__(self, transport: _Plain | _TLS) -> None:
        self._transport = transport
        #: idle -> head -> body -> idle; "spent" (to be closed) or "closed" after a failure.
        self._state = "idle"
        self._message: _Message | None = None
        #: trio clock time after which an idle connection is not reused (set by the pool).
        self.expires_at = float("inf")

    @property
    def socket(self) -> Any:
        return self._transport.sock

    def is_idle(self) -> bool:
        return self._state == "idle"

    def has_expired(self, now: float) -> bool:
        """Past its keep-alive, or closed (or written to) by the server while idle."""
        return now >= self.expires_at or self._transport.has_data_or_eof()

    async def send_request(self, data: bytes, timeout: float | None = None,  # noqa: ASYNC109
                           body: bytes = b"") -> tuple[int, list[tuple[bytes, bytes]]]:
        """Write one request (from ``encode_request``; ``body``: its body when it was not
        joined to the head there, written after it); the response's status and headers."""
        if self._state != "idle":
            raise RuntimeError(f"connection is {self._state}, not idle")
        self._state = "head"
        message = self._message = _Message()
        try:
            await self._send(data, timeout)
            if body:
                await self._send(body, timeout)
            while not message.headers_done:
                data = await self._receive(timeout)
                if not data:
                    raise RemoteProtocolError(  # noqa: TRY301
                        "the server closed the connection before the response head")
                message.feed(data)
        except BaseException:
            self._spend()
            raise
        self._state = "body"
        return message.parser.get_status_code(), message.headers

    async def receive_body(self, timeout: float | None = None) -> bytes:  # noqa: ASYNC109
        """The body bytes that arrive next, everything one read completed; ``b""`` at the end.

        Raises ``RemoteProtocolError`` if the server closes the connection mid-body.
        """
        message = self._message
        if message is None:
            return b""
        try:
            while True:
                if message.body:
                    parts, message.body = message.body, []
                    return parts[0] if len(parts) == 1 else b"".join(parts)
                if message.complete:
                    self._finish(message)
                    return b""
                data = await self._receive(timeout)
                if data:
                    message.feed(data)
                else:
                    self._eof(message)
        except BaseException:
            self._spend()
            raise

    def _finish(self, message: _Message) -> None:
        reusable = self._state == "body" and message.keep_alive and not message.extra
        self._state = "idle" if reusable else "spent"
        message.parser = None
        self._message = None

    def _spend(self) -> None:
        if self._state != "closed":
            self._state = "spent"
        if self._message is not None:
            self._message.parser = None
            self._message = None

    def _eof(self, message: _Message) -> None:
        """The server closed the connection before the body ended: only a body without a
        length (ended by the close) is complete then."""
        if any(name.lower() in (b"content-length", b"transfer-encoding")
               for name, _ in message.headers):
            raise RemoteProtocolError("the server closed the connection in the middle of the body")
        message.complete = True
        self._state = "spent"  # not reusable: the server closed it

    async def _receive(self, timeout: float | None) -> bytes:  # noqa: ASYNC109
        if timeout is None:
            return await self._transport.receive()
        try:
            with trio.fail_after(timeout):
                return await self._transport.receive()
        except trio.TooSlowError:
            # No reset here: the owner closes a connection whose body did not end with one.
            raise ReadTimeout(f"no data for {timeout:g} s") from None

    async def _send(self, data: bytes, timeout: float | None) -> None:  # noqa: ASYNC109
        if timeout is None:
            await self._transport.send_all(data)
            return
        try:
            with trio.fail_after(timeout):
                await self._transport.send_all(data)
        except trio.TooSlowError:
            raise WriteTimeout(f"could not write for {timeout:g} s") from None

    async def aclose(self, *, reset: bool = False) -> None:
        """Close the socket, once (shielded: a half-done close leaks it); ``reset`` sends a TCP
        reset instead of a FIN."""
        if self._state == "closed":
            return
        self._spend()
        self._state = "closed"
        if reset:
            reset_on_close(self.socket)
        with trio.CancelScope(shield=True):
            await self._transport.aclose()
