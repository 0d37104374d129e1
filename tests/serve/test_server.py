"""``epd_trio._serve.server``: connections closed by the client are released; Hypercorn internals pinned.

Hypercorn's own trio ``TCPServer`` keeps a connection the client closed in CLOSE-WAIT until
its keep-alive timer fires (``test_plain_hypercorn_holds_closed_connections_until_keep_alive``
shows it); ``epd-trio serve``'s connection class releases it at once.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable
from functools import partial
from math import inf
from typing import Any

import h11
import pytest
import trio
import trio.testing
from hypercorn.events import Closed, RawData, Updated
from hypercorn.protocol import ProtocolWrapper
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.trio import run as hypercorn_run
from hypercorn.trio import tcp_server, worker_context
from hypercorn.trio.task_group import TaskGroup
from hypercorn.utils import parse_socket_addr, wrap_app

from epd_trio._serve import server as _server
from epd_trio._serve.serving import listening_sockets, quiet_config, serve_app
from epd_trio.testing.process import read_url

from helpers import poll_until

#: How soon a closed connection must be released (the issue's bound).
RELEASE_BOUND = 1.0
#: Ceiling for waits that only fail when something hangs.
GUARD = 30.0
#: /proc/net/tcp state codes.
ESTABLISHED, CLOSE_WAIT = "01", "08"

# -- the Hypercorn internals ProxyTCPServer relies on -----------------------------------------
# ProxyTCPServer.run / protocol_send / _read_data are Hypercorn 0.18's, changed as
# epd_trio/_serve/server.py says. If Hypercorn changes one of them, re-read it and port the change.
COPIED_SOURCES = {
    "run": "fd34b021d1a86c98",
    "protocol_send": "225856426bff7be0",
    "_read_data": "7ca747d922c65cf1",
    # Not copied, but what the replaced timer did (closing at keep-alive or at shutdown):
    "_idle_timeout": "210ce1014d98e1cb",
    "__init__": "4c1d42457bc197b2",
}


# The head-corking hook (ProxyTCPServer._cork_heads): ProtocolWrapper builds an H11Protocol as
# its ``protocol``, H11Protocol hands ``self.stream_send`` to each HTTPStream it creates, and
# stream_send turns Response/Body/EndBody into h11 writes.
HOOKED_SOURCES = {
    (ProtocolWrapper, "__init__"): "df25e181b9e2e64d",
    (H11Protocol, "_create_stream"): "a2338a57ab343908",
    (H11Protocol, "stream_send"): "56a36254a368d71a",
    # Change 8: every h11 write goes through _send_h11_event (reason phrases), and the 400/431
    # of a RemoteProtocolError is _handle_events calling _send_error_response (JSON bodies).
    (H11Protocol, "_send_h11_event"): "5e40283daa303ec7",
    (H11Protocol, "_send_error_response"): "58c2b47ae295d000",
    (H11Protocol, "_handle_events"): "bd4a76b2837e8722",
}


def test_h11_head_events_have_the_reason_field_set_in_place() -> None:
    """``_send_with_reason`` sets the frozen ``reason`` of a head event in place."""
    for event in (h11.Response, h11.InformationalResponse):
        assert "reason" in {f.name for f in dataclasses.fields(event)}
        head = event(status_code=200 if event is h11.Response else 100, headers=[])
        assert head.reason == b""


@pytest.mark.parametrize(("owner", "name"), sorted(HOOKED_SOURCES, key=str),
                         ids=lambda v: getattr(v, "__name__", v))
def test_hypercorn_h11_methods_the_cork_relies_on(owner: Any, name: str) -> None:
    assert _source_hash(getattr(owner, name)) == HOOKED_SOURCES[(owner, name)], (
        f"Hypercorn's {owner.__name__}.{name} changed: check that ProxyTCPServer._cork_heads "
        "still sees every response event, then update HOOKED_SOURCES")


# 100 Continue on the first read (change 10): H11Protocol._handle_events sends it while h11 says
# the client waits, and the trio TaskGroup's spawn_app is where each request's app starts.
CONTINUE_SOURCES = {
    (H11Protocol, "_handle_events"): "bd4a76b2837e8722",
    (TaskGroup, "spawn_app"): "b4c1131427529801",
}


@pytest.mark.parametrize(("owner", "name"), sorted(CONTINUE_SOURCES, key=str),
                         ids=lambda v: getattr(v, "__name__", v))
def test_hypercorn_methods_the_continue_on_read_relies_on(owner: Any, name: str) -> None:
    import h11

    assert _source_hash(getattr(owner, name)) == CONTINUE_SOURCES[(owner, name)], (
        f"Hypercorn's {owner.__name__}.{name} changed: check that ProxyTCPServer."
        "continue_on_read still holds 100 Continue back, then update CONTINUE_SOURCES")
    connection = h11.Connection(h11.SERVER)
    connection.receive_data(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 1\r\n"
                            b"expect: 100-continue\r\n\r\n")
    assert type(connection.next_event()) is h11.Request
    assert connection.they_are_waiting_for_100_continue
    connection.client_is_waiting_for_100_continue = False  # what change 10 writes
    assert not connection.they_are_waiting_for_100_continue
    assert connection.trailing_data == (b"", False)


def _source_hash(function: Any) -> str:
    return hashlib.sha256(inspect.getsource(function).encode()).hexdigest()[:16]


@pytest.mark.parametrize("name", sorted(COPIED_SOURCES))
def test_hypercorn_tcp_server_methods_are_the_ones_ported(name: str) -> None:
    assert _source_hash(getattr(tcp_server.TCPServer, name)) == COPIED_SOURCES[name], (
        f"Hypercorn's trio TCPServer.{name} changed: compare it with epd_trio/_serve/server.py's "
        "ProxyTCPServer and port the change, then update COPIED_SOURCES")


def test_worker_serve_names_the_classes_it_is_rebuilt_with() -> None:
    serve = hypercorn_run.worker_serve
    names = serve.__code__.co_names
    assert "TCPServer" in names and "WorkerContext" in names, (
        "hypercorn.trio.run.worker_serve no longer looks TCPServer/WorkerContext up as module "
        "globals: epd_trio._serve.server.worker_serve cannot substitute its classes any more")
    assert serve.__closure__ is None
    assert hypercorn_run.TCPServer is tcp_server.TCPServer
    assert hypercorn_run.WorkerContext is worker_context.WorkerContext
    assert _server.worker_serve.__globals__["TCPServer"] is _server.ProxyTCPServer
    assert _server.worker_serve.__globals__["WorkerContext"] is _server.ProxyWorkerContext
    assert hypercorn_run.TCPServer is tcp_server.TCPServer  # Hypercorn's module untouched
    assert (inspect.signature(_server.worker_serve)
            == inspect.signature(hypercorn_run.worker_serve))
    assert _server.worker_serve is not hypercorn_run.worker_serve


def test_hypercorn_classes_and_events_have_the_shapes_used() -> None:
    assert list(inspect.signature(tcp_server.TCPServer.__init__).parameters) == [
        "self", "app", "config", "context", "state", "stream"]
    assert list(inspect.signature(ProtocolWrapper.__init__).parameters) == [
        "self", "app", "config", "context", "task_group", "state", "ssl", "client",
        "server", "send", "alpn_protocol"]
    assert tcp_server.MAX_RECV == 2**16
    assert RawData(data=b"x").data == b"x"
    assert Updated(idle=True).idle is True
    assert Closed() == Closed()
    assert callable(parse_socket_addr)
    assert hasattr(TaskGroup, "__aenter__")
    context = worker_context.WorkerContext(None)
    assert isinstance(context.terminated, worker_context.EventWrapper)
    for method in ("set", "is_set", "wait"):
        assert hasattr(worker_context.EventWrapper, method)
    ours = _server.ProxyWorkerContext(None)
    assert isinstance(ours.terminated, worker_context.EventWrapper) and ours.idle == set()
    assert not hasattr(tcp_server.TCPServer, "expire_idle")  # not shadowing a Hypercorn name


# -- counting connections ----------------------------------------------------------------------
def tcp_states(port: int) -> dict[str, int]:
    """Server-side sockets on ``port`` by /proc/net/tcp state (LISTEN left out)."""
    states: dict[str, int] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except FileNotFoundError:
            continue
        for row in rows:
            fields = row.split()
            local_port = int(fields[1].rsplit(":", 1)[1], 16)
            if local_port == port and fields[3] != "0A":
                states[fields[3]] = states.get(fields[3], 0) + 1
    return states


def socket_fds(pid: int | str = "self") -> int:
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:"):
                count += 1
        except FileNotFoundError:
            pass  # closed meanwhile
    return count


async def churn(port: int, connections: int, *, batch: int = 100, every: int = 2,
                settle: bool = False) -> None:
    """Open and close ``connections`` connections, ``batch`` at a time: one in ``every`` sends a
    request and reads its whole answer first, the others close without a request.

    ``settle`` (a server in this process): close only once every task is blocked, so the
    server has gone idle on each connection first. A close that beats the server there is
    handled by other paths (Hypercorn closes at once when the peer is gone before its
    ``getpeername``, or when end of file arrives before the response is recycled)."""

    async def one(index: int) -> None:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            if index % every == 0:
                await stream.send_all(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
                answer = b""
                while b"\r\n\r\n" not in answer or not _complete(answer):
                    data = await stream.receive_some()
                    assert data, answer
                    answer += data
                assert answer.startswith(b"HTTP/1.1 200"), answer[:100]
            if settle:
                await trio.testing.wait_all_tasks_blocked()

    for first in range(0, connections, batch):
        async with trio.open_nursery() as nursery:
            for index in range(first, min(first + batch, connections)):
                nursery.start_soon(one, index)


def _complete(answer: bytes) -> bool:
    head, _, body = answer.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(body) >= int(value)
    return body.endswith(b"0\r\n\r\n")


async def health_app(scope: dict[str, Any], receive: Callable[[], Awaitable[Any]],
                     send: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
    """A bare ASGI app: 200 ``ok`` to every request."""
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            await send({"type": message["type"] + ".complete"})
            if message["type"] == "lifespan.shutdown":
                return
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


# -- the tests ---------------------------------------------------------------------------------
async def test_epd_trio_serve_releases_1000_closed_connections() -> None:
    """A real ``epd-trio serve``: 1000 connections opened and closed, then its fds counted."""
    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", "epd_trio", "serve", "--port", "0",
         "--decode", "http://127.0.0.1:9"], stderr=subprocess.PIPE)
    try:
        assert process.stderr is not None
        url = await read_url(process.stderr, rb"listening on (http://\S+)")
        port = int(url.rsplit(":", 1)[1])
        await churn(port, 2)  # the app is up (lifespan done) before the baseline
        await poll_until(lambda: not tcp_states(port), GUARD)
        before = socket_fds(process.pid)
        await churn(port, 1000)
        released = await poll_until(
            lambda: not tcp_states(port) and socket_fds(process.pid) <= before, GUARD)
        assert released < RELEASE_BOUND, f"closed connections held {released:.2f} s"
        assert socket_fds(process.pid) <= before
    finally:
        process.kill()
        await process.wait()


async def test_plain_hypercorn_holds_closed_connections_until_keep_alive() -> None:
    """What plain Hypercorn does, beside ours in the same run: the same closes, ours released,
    Hypercorn's still in CLOSE-WAIT (until its keep-alive timer, 75 s here, fires): idle after a
    request, and idle before any."""
    async with trio.open_nursery() as nursery:
        ours = await nursery.start(serve_app, health_app, quiet_config())
        plain = await nursery.start(partial_plain, health_app)
        ours_port, plain_port = (int(u.rsplit(":", 1)[1]) for u in (ours, plain))
        await churn(ours_port, 40, settle=True)
        await churn(plain_port, 40, settle=True)
        await poll_until(lambda: tcp_states(plain_port).get(CLOSE_WAIT, 0) == 40, GUARD)
        await poll_until(lambda: not tcp_states(ours_port), RELEASE_BOUND)
        assert tcp_states(plain_port) == {CLOSE_WAIT: 40}
        nursery.cancel_scope.cancel()


async def partial_plain(app: Any, *, task_status: trio.TaskStatus[str]) -> None:
    await serve_app(app, quiet_config(), plain_hypercorn=True, task_status=task_status)


@pytest.mark.parametrize("plain", [False, True], ids=["epd-trio", "plain hypercorn"])
async def test_shutdown_closes_idle_keep_alive_connections_at_once(plain: bool) -> None:
    """An idle kept-alive connection does not hold a shutdown to its graceful timeout."""
    config = quiet_config()
    config.graceful_timeout = 60.0
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        url = await nursery.start(partial(serve_app, health_app, config, shutdown,
                                          plain_hypercorn=plain))
        stream = await trio.open_tcp_stream("127.0.0.1", int(url.rsplit(":", 1)[1]))
        async with stream:
            await stream.send_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            answer = b""
            while not answer.endswith(b"ok"):
                answer += await stream.receive_some()
            shutdown.set()
            with trio.fail_after(GUARD):  # < the 60 s graceful timeout
                assert await stream.receive_some() == b""
    # the nursery exited: serve_app returned, well before the graceful timeout


async def test_read_timeout_closes_a_silent_connection() -> None:
    """``read_timeout`` ends the read and the connection with it. (Plain Hypercorn ends the
    read too, but its idle-timer task keeps the connection open until the keep-alive.)"""
    config = quiet_config(keep_alive=600.0)
    config.read_timeout = 0.2
    async with trio.open_nursery() as nursery:
        url = await nursery.start(serve_app, health_app, config)
        stream = await trio.open_tcp_stream("127.0.0.1", int(url.rsplit(":", 1)[1]))
        async with stream:
            with trio.fail_after(GUARD):  # < the 600 s keep-alive
                assert await stream.receive_some() == b""
        nursery.cancel_scope.cancel()


async def test_idle_set_follows_requests() -> None:
    """A connection is in the worker's idle set between requests, and leaves it on close."""
    contexts: list[_server.ProxyWorkerContext] = []

    class Recording(_server.ProxyWorkerContext):
        def __init__(self, max_requests: int | None) -> None:
            super().__init__(max_requests)
            contexts.append(self)

    serve = _server._rebound(hypercorn_run.worker_serve, TCPServer=_server.ProxyTCPServer,
                             WorkerContext=Recording)
    config = quiet_config()
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(partial(
            serve, wrap_app(health_app, config.wsgi_max_body_size, None), config,
            sockets=listening_sockets(config)))
        (context,) = contexts
        stream = await trio.open_tcp_stream("127.0.0.1", int(binds[0].rsplit(":", 1)[1]))
        await poll_until(lambda: len(context.idle) == 1, GUARD)  # open, waiting for a head
        (server,) = context.idle
        await stream.send_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        answer = b""
        while not answer.endswith(b"ok"):
            answer += await stream.receive_some()
        await poll_until(lambda: server._idle_deadline != inf, GUARD)
        assert context.idle == {server}
        await stream.aclose()
        await poll_until(lambda: not context.idle, GUARD)
        nursery.cancel_scope.cancel()



async def _serve_recording(app: Any, nursery: trio.Nursery) -> tuple[int, list[bytes]]:
    """Serve ``app`` on ProxyTCPServer, recording every socket write; the port and the list."""
    writes: list[bytes] = []

    class Recording(_server.ProxyTCPServer):
        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            send_all = self.stream.send_all

            async def recorded(data: bytes) -> None:
                writes.append(bytes(data))
                await send_all(data)

            self.stream.send_all = recorded  # type: ignore[method-assign]

    serve = _server._rebound(hypercorn_run.worker_serve, TCPServer=Recording,
                             WorkerContext=_server.ProxyWorkerContext)
    config = quiet_config()
    binds = await nursery.start(partial(
        serve, wrap_app(app, config.wsgi_max_body_size, None), config,
        sockets=listening_sockets(config)))
    return int(binds[0].rsplit(":", 1)[1]), writes


async def test_a_response_with_its_length_is_one_write() -> None:
    async with trio.open_nursery() as nursery:
        port, writes = await _serve_recording(health_app, nursery)
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            for _ in range(2):  # two requests on one connection: one write each
                await stream.send_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
                answer = b""
                while not answer.endswith(b"ok"):
                    answer += await stream.receive_some()
        assert len(writes) == 2
        assert all(w.startswith(b"HTTP/1.1 200") and w.endswith(b"\r\n\r\nok") for w in writes)
        nursery.cancel_scope.cancel()


async def test_a_stream_head_goes_out_before_its_first_chunk() -> None:
    """No length (a chunked stream, as SSE is): the head is not held for the body."""
    go = trio.Event()

    async def stream_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await health_app(scope, receive, send)
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        await go.wait()
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    async with trio.open_nursery() as nursery:
        port, writes = await _serve_recording(stream_app, nursery)
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            head = b""
            while b"\r\n\r\n" not in head:
                head += await stream.receive_some()
            assert b"data: 1" not in head  # the head came alone, before the app went on
            go.set()
            rest = head
            while not rest.endswith(b"0\r\n\r\n"):
                rest += await stream.receive_some()
        assert b"Transfer-Encoding: chunked" in writes[0] and b"data: 1" not in writes[0]
        nursery.cancel_scope.cancel()


# -- chunks written directly (change 6 of epd_trio/_serve/server.py) ------------------------------------
def test_h11_internals_the_direct_chunk_write_relies_on() -> None:
    """A chunk is framed as h11's ChunkedWriter frames it, only while h11 is in SEND_BODY with
    that writer; a Data event must leave h11's state where it was."""
    import h11
    from h11._writers import ChunkedWriter

    assert _source_hash(ChunkedWriter.send_data) == "0fbc8fb565f7029f", (
        "h11's ChunkedWriter.send_data changed: check ProxyTCPServer.write_chunk's framing")
    connection = h11.Connection(h11.SERVER)
    connection.receive_data(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    assert type(connection.next_event()) is h11.Request
    connection.send(h11.Response(status_code=200, headers=[]))
    assert connection.our_state is h11.SEND_BODY
    assert type(connection._writer) is ChunkedWriter
    assert connection.send(h11.Data(data=b"abc")) == b"3\r\nabc\r\n"
    assert connection.our_state is h11.SEND_BODY
    old = h11.Connection(h11.SERVER)  # an HTTP/1.0 client gets no chunked framing
    old.receive_data(b"GET / HTTP/1.0\r\n\r\n")
    old.next_event()
    old.send(h11.Response(status_code=200, headers=[]))
    assert type(old._writer) is not ChunkedWriter


def _stream_app(chunks: list[bytes], during: Callable[[], None] = lambda: None) -> Any:
    """An ASGI app that streams ``chunks`` (chunked), calling ``during()`` before each send."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await health_app(scope, receive, send)
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        for chunk in chunks:
            during()
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    return app


async def _raw_answer(port: int, request: bytes, *, wait_first: bool = False) -> bytes:
    """The raw bytes of one answer, read until the server closes or the chunked body ends.
    ``wait_first``: read nothing until every task is blocked (the server's socket buffer fills
    and its writes become partial)."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(request)
        if wait_first:
            await trio.testing.wait_all_tasks_blocked()
        answer = b""
        while not answer.endswith(b"\r\n0\r\n\r\n"):
            data = await stream.receive_some()
            if not data:
                break
            answer += data
    return answer


def _h11_body(chunks: list[bytes]) -> bytes:
    """What h11 itself writes for ``chunks`` as a chunked body, ended."""
    import h11

    connection = h11.Connection(h11.SERVER)
    connection.receive_data(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    connection.next_event()
    connection.send(h11.Response(status_code=200, headers=[]))
    return b"".join(connection.send(h11.Data(data=c)) or b"" for c in chunks) + (
        connection.send(h11.EndOfMessage()) or b"")


@pytest.mark.parametrize("wait_first", [False, True], ids=["reading", "not-reading-at-first"])
async def test_chunks_on_the_wire_are_h11s(wait_first: bool) -> None:
    """Byte for byte what h11 writes, small and large chunks; a chunk the kernel takes only in
    part (the client is not reading yet) is finished by the usual path."""
    chunks = [b"data: 1\n\n", b"x" * 3_000_000, b"data: 3\n\n", b"y" * 70_000]
    async with trio.open_nursery() as nursery:
        port, _ = await _serve_recording(_stream_app(chunks), nursery)
        for _ in range(2):  # two answers on two connections: each is framed alike
            answer = await _raw_answer(port, b"GET / HTTP/1.1\r\nhost: x\r\n\r\n",
                                       wait_first=wait_first)
            head, _, body = answer.partition(b"\r\n\r\n")
            assert b"Transfer-Encoding: chunked" in head
            assert body == _h11_body(chunks)
        nursery.cancel_scope.cancel()


async def test_an_http10_client_gets_the_body_unframed() -> None:
    chunks = [b"data: 1\n\n", b"data: 2\n\n"]
    async with trio.open_nursery() as nursery:
        port, _ = await _serve_recording(_stream_app(chunks), nursery)
        answer = await _raw_answer(port, b"GET / HTTP/1.0\r\n\r\n")
        assert answer.partition(b"\r\n\r\n")[2] == b"".join(chunks)
        nursery.cancel_scope.cancel()


async def test_direct_chunk_writes_still_yield_to_other_tasks() -> None:
    """An app that sends chunk after chunk with nothing else to wait on: the direct writes
    never block, and still let another task run every few chunks."""
    ticks = 0
    seen: list[int] = []

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await trio.lowlevel.checkpoint()

    chunks = [b"data: %d\n\n" % i for i in range(10 * _server._YIELD_EVERY)]
    async with trio.open_nursery() as nursery:
        port, _ = await _serve_recording(
            _stream_app(chunks, during=lambda: seen.append(ticks)), nursery)
        nursery.start_soon(ticker)
        answer = await _raw_answer(port, b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        assert answer.partition(b"\r\n\r\n")[2] == _h11_body(chunks)
        nursery.cancel_scope.cancel()
    # The ticker's turns while the app sent its chunks. Between the first send and the last,
    # the app yielded len // _YIELD_EVERY - 1 times; the ticker runs once per scheduling batch,
    # and trio may run it before or after the app in the first and last batch: one turn less
    # at worst. With no yield it would be 0.
    ran = seen[-1] - seen[0]
    assert ran >= len(chunks) // _server._YIELD_EVERY - 2


# -- the connection's own chunk writer (change 11, epd_trio/_web/direct_body.py) ------------------
@pytest.mark.parametrize("wait_first", [False, True], ids=["reading", "not-reading-at-first"])
async def test_proxy_asgi_relays_chunks_through_the_connection_writer(wait_first: bool) -> None:
    """Behind ``ProxyASGI`` a relayed chunk is written by the connection, not sent down as an
    ASGI message: the bytes are still h11's, and a chunk the kernel took only in part (the
    client is not reading yet) is finished before the next one."""
    from epd_trio._web.asgi import ProxyASGI

    chunks = [b"data: 1\n\n", b"x" * 3_000_000, b"data: 3\n\n", b"y" * 70_000,
              *(b"data: %d\n\n" % i for i in range(40))]
    bodies_down_asgi = 0
    stream_send = _server.ProxyTCPServer._stream_send

    async def counting(self: Any, inner: Any, event: Any) -> None:
        nonlocal bodies_down_asgi
        bodies_down_asgi += type(event).__name__ == "Body"
        await stream_send(self, inner, event)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_server.ProxyTCPServer, "_stream_send", counting)
        async with trio.open_nursery() as nursery:
            port, _ = await _serve_recording(ProxyASGI(_stream_app(chunks)), nursery)
            answer = await _raw_answer(port, b"GET / HTTP/1.1\r\nhost: x\r\n\r\n",
                                       wait_first=wait_first)
            nursery.cancel_scope.cancel()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"Transfer-Encoding: chunked" in head
    assert body == _h11_body(chunks)
    assert bodies_down_asgi == 0


async def test_the_writer_declines_an_http10_response_and_the_asgi_path_sends_it() -> None:
    from epd_trio._web.asgi import ProxyASGI

    chunks = [b"data: 1\n\n", b"data: 2\n\n"]
    async with trio.open_nursery() as nursery:
        port, _ = await _serve_recording(ProxyASGI(_stream_app(chunks)), nursery)
        answer = await _raw_answer(port, b"GET / HTTP/1.0\r\n\r\n")
        assert answer.partition(b"\r\n\r\n")[2] == b"".join(chunks)
        nursery.cancel_scope.cancel()
