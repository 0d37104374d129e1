"""The connection server under ``epd-trio serve``: Hypercorn's trio worker with its own TCPServer.

Why a server class of our own: Hypercorn's ``trio.tcp_server.TCPServer`` (0.18) runs each
connection's keep-alive timer as a task in the connection's task group, started with
``nursery.start`` when the connection opens and after every response. Two costs follow:

- **A defect: CLOSE-WAIT.** When the client closes an idle connection, the read loop sees end
  of file and returns, but the connection's task group still holds the idle-timer task, which
  sleeps until ``keep_alive_timeout``. Only then does ``run`` reach its ``finally`` and close the
  socket: the kernel keeps it in CLOSE-WAIT, one fd per closed connection, for 75 s with
  ``epd-trio serve``'s default. Under connection churn that is thousands of fds.
- **A cost per response.** ``TrioSingleTask.restart`` takes a lock, cancels the old timer task
  and starts a new one (a task, a scheduling round) every time the connection goes idle, and
  ``stop`` takes the lock again when the next request arrives.

``ProxyTCPServer`` keeps everything else of Hypercorn (the h11/h2 protocol classes, the ASGI
stream, the worker's lifespan and shutdown) and changes these things:

1. The idle timer is the **deadline of the pending read's cancel scope**: ``Updated(idle=True)``
   sets it to now + ``keep_alive_timeout``, ``Updated(idle=False)`` to infinity. No task, no lock.
   When it expires the read loop ends and the connection closes, as Hypercorn's timer does. A
   client's close ends the read loop, and with no timer task left the connection's task group
   exits and the socket is closed at once.
2. Worker shutdown closes idle connections at once (Hypercorn's timer task waited on
   ``context.terminated``): ``ProxyWorkerContext`` cancels the reads of the connections that are
   idle when ``terminated`` is set.
3. A write takes the send lock without a scheduling round when it is free (it still raises
   ``Cancelled`` first if the sender is cancelled, as ``trio.Lock.acquire`` would), and an empty
   write (h11's end of a ``content-length`` body) is not sent.
4. A connection whose client closed it is closed without ``send_eof`` first (a ``shutdown``
   call and a checkpoint): ``close`` sends the same FIN.
5. The head of a response that declares its ``content-length`` is held until the body's first
   bytes (or the end of the response) and written with them in one ``send``: one socket write
   per non-stream answer instead of two (h11 frames such a body's end as ``b""``, not written).
   A response without a length (a stream: chunked) sends its head at once, as before, so an
   SSE head still goes out before the first token.
6. A chunk of a chunked body (a relayed token) is framed here, as h11's ``ChunkedWriter``
   frames it (a ``Data`` event leaves h11's state machine where it is), and written with one
   non-blocking ``send`` on the plain socket when the send lock is free. Only what the kernel
   did not take goes the usual way (lock, shielded ``send_all``, which waits for the client).
   Per token that skips h11's event processing, two of Hypercorn's event objects, the lock,
   a shielded cancel scope and trio's ``send_all``, whose successful ``send`` always yields to
   the scheduler: such a write yields once every ``_YIELD_EVERY`` chunks instead, so a relay
   whose upstream always has bytes ready still lets the other tasks run.
7. The connection tells its HTTP/1.x requests that their client left (``_web/client_gone``): it
   offers a ``ClientGone`` in the connection's ASGI state and cancels the requests registered
   there when the client closes the connection or a write to it fails, so a request needs no
   task of its own waiting for ``http.disconnect``.
8. Every HTTP/1.x status line carries its reason phrase (``HTTP/1.1 200 OK``; Hypercorn sends
   ``HTTP/1.1 200 ``, and clients that print the reason, vLLM's benchmark among them, print
   nothing), and the 400 and 431 Hypercorn answers itself to bytes h11 cannot parse carry an
   OpenAI error body (``_core.errors.MalformedHTTP``, ``HeadersTooLarge``) instead of none.
9. A client's end of file reaches the protocol only once a write in flight has returned: one
   access-log line per request, not a second one with status ``-`` for a response the client
   had read whole (Hypercorn logs a stream closed before its end as unanswered).
10. ``100 Continue`` is sent when the app first reads the request body, not as soon as the
   request head is parsed: Hypercorn's HTTP/1.1 protocol sends it at once, so a client that
   asked (``Expect: 100-continue``) was told to send a body the app then refused unread (a
   ``Content-Length`` over the limit, a bad key, the admission cap). The app's answer now
   comes first, and the client never sends the body.
11. The connection offers its HTTP/1.1 requests the chunk write of change 6 directly
   (``_web/direct_body``: ``scope["state"][DIRECT_BODY]``), so a relayed token skips the ASGI
   message as well: the message dict, Hypercorn's ``app_send`` state machine, its ``Body``
   event and the check of its type here. What the writer declines takes the ASGI path.

How it is plugged in: ``hypercorn.trio.run.worker_serve`` names ``TCPServer`` and
``WorkerContext`` as globals of its module and takes no parameter for them. ``worker_serve``
below is Hypercorn's own function object rebuilt over a copy of its globals with our two classes
in their place: Hypercorn's worker code runs unchanged, and no Hypercorn module is modified (plain
``hypercorn --worker-class trio epd_trio.app:app`` in another process, or in this one, is
untouched). ``tests/serve/test_server.py`` pins every Hypercorn internal used here and fails, naming
it, when an upgrade moves one. docs/contributing/hypercorn-patches.md has each change written as
the patch Hypercorn could take, with its measured effect.
"""

from __future__ import annotations

import os
import types
from functools import partial
from http import HTTPStatus
from math import inf
from typing import Any

import h11
import trio
from h11._writers import ChunkedWriter
from hypercorn.events import Closed, Event, RawData, Updated
from hypercorn.protocol import ProtocolWrapper
from hypercorn.protocol.events import Body, EndBody, Response
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.trio import run as hypercorn_run
from hypercorn.trio.task_group import TaskGroup
from hypercorn.trio.tcp_server import MAX_RECV, TCPServer
from hypercorn.trio.worker_context import EventWrapper, WorkerContext
from hypercorn.typing import ConnectionState
from hypercorn.utils import parse_socket_addr

from .._core.errors import HeadersTooLarge, MalformedHTTP, ProxyError
from .._web.client_gone import CLIENT_GONE, ClientGone
from .._web.direct_body import DECLINED, DIRECT_BODY, PARTIAL, WRITTEN, WRITTEN_YIELD

__all__ = ["ProxyTCPServer", "ProxyWorkerContext", "worker_serve"]

#: A chunk written directly (change 6) yields to the scheduler once every this many writes.
_YIELD_EVERY = 16
#: The reason phrase of each status (change 8); an unknown status keeps h11's empty one.
_REASONS = {int(status): status.phrase.encode() for status in HTTPStatus}
_HEAD_EVENTS = (h11.Response, h11.InformationalResponse)


async def _send_with_reason(send_h11_event: Any, event: Any) -> None:
    """``H11Protocol._send_h11_event`` with the reason phrase h11 would leave empty (change 8).

    The event is one Hypercorn just built and holds nowhere else, so its (frozen) ``reason``
    is set in place: building another would re-validate every header of every response."""
    if type(event) in _HEAD_EVENTS and not event.reason:
        object.__setattr__(event, "reason", _REASONS.get(event.status_code, b""))
    await send_h11_event(event)


async def _send_error_json(protocol: H11Protocol, status_code: int) -> None:
    """``H11Protocol._send_error_response`` with an OpenAI error body (change 8): the same
    status, ``connection: close`` and server headers, plus the JSON and its length."""
    error: ProxyError
    if status_code == 431:
        error = HeadersTooLarge(protocol.config.h11_max_incomplete_size)
    else:  # h11's only other hint is 400 (a 414 or 505 would keep its status here)
        error = MalformedHTTP()
        error.status = status_code
    body = error.body()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode()), (b"connection", b"close"),
               *protocol.config.response_headers("h11")]
    await protocol._send_h11_event(h11.Response(status_code=status_code, headers=headers))
    await protocol._send_h11_event(h11.Data(data=body))
    await protocol._send_h11_event(h11.EndOfMessage())


class _Terminated(EventWrapper):
    """``context.terminated``: once set, every idle connection of the worker is closed."""

    def __init__(self, idle: set[ProxyTCPServer]) -> None:
        super().__init__()
        self._idle = idle

    async def set(self) -> None:
        await super().set()
        for server in list(self._idle):
            server.expire_idle()


class ProxyWorkerContext(WorkerContext):
    """Hypercorn's worker context, plus the set of this worker's idle connections."""

    def __init__(self, max_requests: int | None) -> None:
        super().__init__(max_requests)
        #: Connections waiting for a request (their read has a keep-alive deadline).
        self.idle: set[ProxyTCPServer] = set()
        self.terminated = _Terminated(self.idle)


class ProxyTCPServer(TCPServer):
    """One client connection: Hypercorn's ``TCPServer`` with the idle timer on the read."""

    def __init__(self, app: Any, config: Any, context: Any, state: Any, stream: Any) -> None:
        super().__init__(app, config, context, state, stream)
        #: When the connection, idle, is closed (inf while a request is in flight).
        self._idle_deadline = inf
        #: The read loop's cancel scope (None outside the loop): its deadline is the idle one.
        self._read_scope: trio.CancelScope | None = None
        self._idle_set: set[ProxyTCPServer] | None = getattr(context, "idle", None)
        #: The client closed its side (end of file read).
        self._peer_closed = False
        #: Writes held back (a content-length response's head) until its body; None: write.
        self._corked: list[bytes] | None = None
        #: The h11 connection of the HTTP/1.1 protocol (None: HTTP/2, or not started yet), and
        #: the plain socket a chunk may be written to directly (None: TLS).
        self._h11: h11.Connection | None = None
        self._plain: Any = None
        #: Chunks written directly since the last yield to the scheduler.
        self._unyielded = 0
        #: What the kernel did not take of the last chunk written directly (see flush_chunk).
        self._rest = b""
        #: The news, for this connection's HTTP/1.x requests, that their client left (change 7).
        self._client_gone = ClientGone()

    async def run(self) -> None:
        """Hypercorn's ``TCPServer.run`` with the idle timer armed instead of started."""
        try:
            try:
                with trio.fail_after(self.config.ssl_handshake_timeout):
                    await self.stream.do_handshake()
            except (trio.BrokenResourceError, trio.TooSlowError):
                return  # Handshake failed
            alpn_protocol = self.stream.selected_alpn_protocol()
            socket = self.stream.transport_stream.socket
            ssl = True
        except AttributeError:  # Not SSL
            alpn_protocol = "http/1.1"
            socket = self.stream.socket
            ssl = False
            self._plain = socket

        try:
            client = parse_socket_addr(socket.family, socket.getpeername())
            server = parse_socket_addr(socket.family, socket.getsockname())

            async with _ContinueOnRead(self) as task_group:
                self._task_group = task_group
                self.protocol = ProtocolWrapper(
                    self.app, self.config, self.context, task_group,
                    ConnectionState({**self.state, CLIENT_GONE: self._client_gone,
                                     DIRECT_BODY: self}), ssl,
                    client, server, self.protocol_send,
                    alpn_protocol,
                )
                await self.protocol.initiate()
                self._cork_heads()
                self._set_idle(True)
                await self._read_data()
        except OSError:
            pass
        finally:
            self._set_idle(False)
            await self._close()

    def continue_on_read(self, app: Any) -> Any:
        """``app`` (a Hypercorn app wrapper) whose request, if its client waits for ``100
        Continue``, gets it at its first ``receive`` (change 10); else ``app`` itself.

        Called as the request's app task is spawned: h11 has parsed the head, so it knows
        whether the client waits. Its flag is cleared here, so Hypercorn's read loop does not
        send the ``100`` at once; the first read sends it, if the app has not answered and
        the client has not sent its body meanwhile (nor given up waiting and started it)."""
        connection = self._h11
        if connection is None or not connection.they_are_waiting_for_100_continue:
            return app
        connection.client_is_waiting_for_100_continue = False
        send_event = self.protocol.protocol._send_h11_event
        headers = self.config.response_headers("h11")

        async def reading_app(scope: Any, receive: Any, *args: Any) -> None:
            asked = False

            async def receive_continued() -> Any:
                nonlocal asked
                if not asked:
                    asked = True
                    if (connection.our_state is h11.SEND_RESPONSE
                            and connection.their_state is h11.SEND_BODY
                            and not connection.trailing_data[0]):
                        await send_event(h11.InformationalResponse(status_code=100,
                                                                   headers=headers))
                return await receive()

            await app(scope, receive_continued, *args)

        return reading_app

    def _cork_heads(self) -> None:
        """Route the HTTP/1.1 protocol's stream events through ``_stream_send``, its h11 writes
        through ``_send_with_reason`` and its own error answers through ``_send_error_json``.

        ``H11Protocol`` hands ``self.stream_send`` to each ``HTTPStream`` it creates, and calls
        ``self._send_h11_event`` / ``self._send_error_response``, so instance attributes set
        before the first request are what every stream and every error calls."""
        inner = getattr(self.protocol, "protocol", None)
        if isinstance(inner, H11Protocol):
            inner.stream_send = partial(self._stream_send, inner.stream_send)
            inner._send_h11_event = partial(  # type: ignore[method-assign]
                _send_with_reason, inner._send_h11_event)
            inner._send_error_response = partial(  # type: ignore[method-assign]
                _send_error_json, inner)
            self._h11 = inner.connection

    async def _stream_send(self, stream_send: Any, event: Any) -> None:
        if type(event) is Body and self._corked is None:
            await trio.lowlevel.checkpoint_if_cancelled()  # as an ASGI send has always been
            taken = self.write_chunk(event.data)
            if taken != DECLINED:
                if taken == WRITTEN_YIELD:
                    await trio.lowlevel.cancel_shielded_checkpoint()
                elif taken == PARTIAL:
                    await self.flush_chunk()
                return
        if (isinstance(event, Response) and event.status_code >= 200
                and any(name.lower() == b"content-length" for name, _ in event.headers)):
            self._corked = []
            await stream_send(event)  # the head's RawData is held in _corked
            return
        if self._corked is None:
            await stream_send(event)
            return
        if isinstance(event, Body | EndBody):
            await stream_send(event)  # appended to the held head
        corked, self._corked = self._corked, None
        if corked:
            await self.protocol_send(RawData(data=b"".join(corked)))
        if not isinstance(event, Body | EndBody):
            await stream_send(event)

    def write_chunk(self, data: bytes) -> int:
        """One chunk of a chunked body, framed as h11 frames it and written now, if the
        response is one and nothing else is writing (changes 6 and 11; ``_web/direct_body``).

        Declined (nothing written) when the kernel takes none of it, or the write fails: the
        usual path then waits for the client, or meets the same error and handles it."""
        connection = self._h11
        if (connection is None or self._plain is None or self._corked is not None
                or self.send_lock.locked() or connection.our_state is not h11.SEND_BODY
                or type(connection._writer) is not ChunkedWriter):
            return DECLINED
        if not data:
            return WRITTEN  # h11 writes nothing for an empty chunk: it would read as the end
        fd = self._plain.fileno()
        if fd == -1:  # closed: the usual path says so
            return DECLINED
        frame = b"%x\r\n%b\r\n" % (len(data), data)
        try:
            sent = os.write(fd, frame)
        except OSError:  # full (BlockingIOError) or broken
            return DECLINED
        if sent < len(frame):
            self._rest = frame[sent:]
            return PARTIAL
        self._unyielded += 1
        if self._unyielded >= _YIELD_EVERY:
            # A relay whose upstream always has bytes ready never waits: let the others run.
            self._unyielded = 0
            return WRITTEN_YIELD
        return WRITTEN

    async def flush_chunk(self) -> None:
        """The rest of a chunk the kernel took only in part, written the usual way (the send
        lock, a shielded ``send_all``), which waits for the client."""
        rest, self._rest = self._rest, b""
        await self.protocol_send(RawData(data=rest))

    async def protocol_send(self, event: Event) -> None:
        if isinstance(event, RawData):
            if not event.data:
                return  # h11 frames the end of a content-length body as b"": nothing to write
            if self._corked is not None:
                self._corked.append(event.data)
                return
            lock = self.send_lock
            if lock.locked():
                await lock.acquire()
            else:
                # trio.Lock.acquire would yield to the scheduler even when the lock is free;
                # only its cancellation check matters here.
                await trio.lowlevel.checkpoint_if_cancelled()
                lock.acquire_nowait()
            try:
                with trio.CancelScope(shield=True):
                    await self.stream.send_all(event.data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self._client_gone.left()
                await self.protocol.handle(Closed())
            finally:
                lock.release()
        elif isinstance(event, Closed):
            self._corked = None  # the client is gone: nothing held is wanted any more
            self._client_gone.left()
            await self._close()
            await self.protocol.handle(Closed())
        elif isinstance(event, Updated):
            self._set_idle(event.idle)

    async def _read_data(self) -> None:
        """Read until end of file, an error, the read timeout or the idle deadline."""
        read_timeout = self.config.read_timeout
        with trio.CancelScope(deadline=self._idle_deadline) as scope:
            self._read_scope = scope
            try:
                while True:
                    if read_timeout:
                        scope.deadline = min(self._idle_deadline,
                                             trio.current_time() + read_timeout)
                    try:
                        data = await self.stream.receive_some(MAX_RECV)
                    except (trio.ClosedResourceError, trio.BrokenResourceError):
                        break
                    if read_timeout:
                        scope.deadline = self._idle_deadline
                    await self.protocol.handle(RawData(bytes(data)))
                    if data == b"":
                        self._peer_closed = True
                        break
            finally:
                self._read_scope = None
        self._client_gone.left()
        if self.send_lock.locked():
            # Change 9: a write is in flight, most often the end of the response the client has
            # just read before closing. Closed now would reach the request's stream before the
            # write returns, and Hypercorn would log it twice: once as unanswered (status "-")
            # and once with its status. Once the lock is free, the writer has finished the
            # response without a checkpoint in between (the lock is handed over, not raced for).
            # A write that never completes (a client that closed its side and reads nothing)
            # ends as before, by TCP_USER_TIMEOUT or the worker's shutdown; the request itself
            # already knows its client left (ClientGone, above).
            async with self.send_lock:
                pass
        await self.protocol.handle(Closed())

    async def _close(self) -> None:
        if self._peer_closed:
            await self.stream.aclose()
        else:
            await super()._close()

    def _set_idle(self, idle: bool) -> None:
        if idle and not self.context.terminated.is_set():
            deadline = trio.current_time() + self.config.keep_alive_timeout
            if self._idle_set is not None:
                self._idle_set.add(self)
        else:
            deadline = -inf if idle else inf  # idle after shutdown began: close now
            if self._idle_set is not None:
                self._idle_set.discard(self)
        self._set_deadline(deadline)

    def _set_deadline(self, deadline: float) -> None:
        self._idle_deadline = deadline
        if self._read_scope is not None:
            self._read_scope.deadline = deadline

    def expire_idle(self) -> None:
        """Close this idle connection now (worker shutdown)."""
        if self._idle_deadline != inf:
            self._set_deadline(-inf)


class _ContinueOnRead(TaskGroup):
    """The connection's task group: Hypercorn's, spawning each request's app through
    ``ProxyTCPServer.continue_on_read`` (change 10)."""

    def __init__(self, server: ProxyTCPServer) -> None:
        super().__init__()
        self._server = server

    async def spawn_app(self, app: Any, config: Any, scope: Any, send: Any) -> Any:
        return await super().spawn_app(self._server.continue_on_read(app), config, scope, send)


def _rebound(function: types.FunctionType, **names: Any) -> types.FunctionType:
    """``function`` over a copy of its module globals with ``names`` replaced."""
    rebound = types.FunctionType(function.__code__, {**function.__globals__, **names},
                                 function.__name__, function.__defaults__, function.__closure__)
    rebound.__kwdefaults__ = function.__kwdefaults__
    rebound.__qualname__ = function.__qualname__
    rebound.__doc__ = function.__doc__
    rebound.__annotations__ = function.__annotations__
    return rebound


#: Hypercorn's trio ``worker_serve``, serving each connection with ``ProxyTCPServer``.
worker_serve = _rebound(hypercorn_run.worker_serve, TCPServer=ProxyTCPServer,
                        WorkerContext=ProxyWorkerContext)
