"""The upstream pool (``_http.UpstreamPool``) against a real HTTP/1.1 server on a real socket.

The server is a few lines of h11 on trio so a test sees each TCP connection (FakeVLLM runs on
Hypercorn, which hides them): reuse, the concurrency cap, the queue timeout, a server closing an
idle connection, the per-read timeout, closing the pool while a response is still open, and
``UpstreamClient`` retiring the pools of instances that left the roster.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial

import h11
import pytest
import trio

from epd_trio import Instance
from epd_trio._core.errors import ProxyOverloaded, UpstreamTimeout
from epd_trio._upstream.legs import map_upstream_errors
from epd_trio._upstream.pool import PoolTimeout, UpstreamClient, UpstreamPool


@dataclass
class CountingServer:
    """Answers every request with ``body`` (after ``gate``, when set); counts connections."""

    body: bytes = b"ok"
    connections: int = 0
    requests: int = 0
    closed_by_client: int = 0
    #: Close each connection after its first answer (without saying so in the headers).
    close_after_answer: bool = False
    #: Set: every answer waits for it (lets a test hold requests in flight).
    gate: trio.Event | None = None
    #: Send the headers and this first body chunk, then stall (never finish).
    stall_after: bytes | None = None
    arrived: trio.Event = field(default_factory=trio.Event)
    client_closed: trio.Event = field(default_factory=trio.Event)
    #: Set when this server has closed a connection itself (``close_after_answer``).
    server_closed: trio.Event = field(default_factory=trio.Event)
    #: How the client ended a stalled stream: "fin" (orderly close) or "reset".
    stall_ended_by: str | None = None
    #: The headers of the last request.
    last_headers: list[tuple[bytes, bytes]] = field(default_factory=list)

    async def handle(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        conn = h11.Connection(h11.SERVER)
        try:
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    data = await stream.receive_some(65536)
                    if not data:
                        self.closed_by_client += 1
                        self.client_closed.set()
                        return
                    conn.receive_data(data)
                    continue
                if isinstance(event, h11.Request):
                    self.last_headers = list(event.headers)
                if isinstance(event, h11.EndOfMessage):
                    self.requests += 1
                    self.arrived.set()
                    if self.gate is not None:
                        await self.gate.wait()
                    if self.stall_after is not None:
                        await stream.send_all(conn.send(h11.Response(
                            status_code=200, headers=[("transfer-encoding", "chunked")])))
                        await stream.send_all(conn.send(h11.Data(data=self.stall_after)))
                        try:
                            await stream.receive_some(65536)  # until the client ends it
                            self.stall_ended_by = "fin"
                        except trio.BrokenResourceError:
                            self.stall_ended_by = "reset"
                        self.client_closed.set()
                        return
                    await stream.send_all(conn.send(h11.Response(
                        status_code=200, headers=[("content-length", str(len(self.body)))])))
                    await stream.send_all(conn.send(h11.Data(data=self.body)))
                    await stream.send_all(conn.send(h11.EndOfMessage()))
                    if self.close_after_answer:
                        await stream.aclose()
                        self.server_closed.set()
                        return
                    conn.start_next_cycle()
        except trio.BrokenResourceError:
            self.closed_by_client += 1
            self.client_closed.set()
        finally:
            await stream.aclose()


@asynccontextmanager
async def serving(server: CountingServer) -> AsyncIterator[str]:
    async with trio.open_nursery() as nursery:
        (listener,) = await nursery.start(partial(trio.serve_tcp, server.handle, 0, host="127.0.0.1"))
        yield f"http://127.0.0.1:{listener.socket.getsockname()[1]}"
        nursery.cancel_scope.cancel()


async def get(pool: UpstreamPool, read_timeout: float | None = None) -> bytes:
    response = await pool.request(b"GET", b"/x", read_timeout=read_timeout)
    return await response.aread()


async def test_sequential_requests_reuse_one_connection() -> None:
    server = CountingServer()
    async with serving(server) as url:
        pool = UpstreamPool(url)
        for _ in range(5):
            assert await get(pool) == b"ok"
        await pool.aclose()
    assert (server.requests, server.connections) == (5, 1)


async def test_concurrent_requests_get_their_own_connections_up_to_the_limit() -> None:
    server = CountingServer(gate=trio.Event())
    async with serving(server) as url:
        pool = UpstreamPool(url, limit=2, queue_timeout=None)
        results: list[bytes] = []

        async def one() -> None:
            results.append(await get(pool))

        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(one)
            while server.requests < 2:
                server.arrived = trio.Event()
                await server.arrived.wait()
            # Two in flight at the server, the third waits in the pool's queue.
            assert pool.limiter.borrowed_tokens == 2 and pool.limiter.statistics().tasks_waiting == 1
            assert server.connections == 2
            server.gate.set()
        await pool.aclose()
    assert results == [b"ok"] * 3
    assert server.connections == 2  # the third request reused a freed connection


async def test_a_full_pool_times_out_in_its_queue() -> None:
    server = CountingServer(gate=trio.Event())
    async with serving(server) as url:
        pool = UpstreamPool(url, limit=1, queue_timeout=0.05)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(get, pool)
            await server.arrived.wait()
            with pytest.raises(ProxyOverloaded), map_upstream_errors("decode", url):
                await get(pool)
            with pytest.raises(PoolTimeout):
                await get(pool)
            server.gate.set()
        await pool.aclose()


async def test_a_connection_the_server_closed_is_not_reused() -> None:
    server = CountingServer(close_after_answer=True)
    async with serving(server) as url:
        pool = UpstreamPool(url)
        for _ in range(3):
            assert await get(pool) == b"ok"
            await server.server_closed.wait()  # its FIN is on the way (loopback: already there)
            server.server_closed = trio.Event()
        await pool.aclose()
    assert (server.requests, server.connections) == (3, 3)


async def test_the_read_timeout_bounds_each_wait_for_data() -> None:
    server = CountingServer(stall_after=b"first")
    async with serving(server) as url:
        pool = UpstreamPool(url)
        response = await pool.request(b"GET", b"/x", read_timeout=0.05)
        assert await response.receive() == b"first"
        with pytest.raises(UpstreamTimeout), map_upstream_errors("decode", url):
            await response.receive()
        await response.aclose()
        assert pool.limiter.borrowed_tokens == 0
        await pool.aclose()


async def test_a_response_closed_after_the_pool_closes_its_connection() -> None:
    server = CountingServer(gate=trio.Event())
    async with serving(server) as url:
        pool = UpstreamPool(url)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(get, pool)
            await server.arrived.wait()
            await pool.aclose()  # e.g. the instance was removed while a request ran
            server.gate.set()
        # The connection was not kept: the server sees it close.
        await server.client_closed.wait()
        with pytest.raises(Exception, match="closed"):
            await get(pool)


async def test_pools_follow_the_instances_that_exist() -> None:
    leaving, staying = CountingServer(gate=trio.Event()), CountingServer()
    async with serving(leaving) as url_a, serving(staying) as url_b:
        a, b = Instance(url_a), Instance(url_b)
        async with UpstreamClient(max_connections=2) as client:
            client.follow([a, b])
            pool_a = client.pool(a)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(get, pool_a)
                await leaving.arrived.wait()
                client.follow([b])  # a left the roster while a request runs there
                assert client.pool(a) is pool_a  # requests routed there before still get it
                assert await client.reap() == 0 and not pool_a.is_closed
                assert leaving.gate is not None
                leaving.gate.set()
            assert await client.reap() == 1 and pool_a.is_closed
            await leaving.client_closed.wait()  # its idle connection was closed, not kept
            # Unknown to the roster: usable, but retired from the start (the next reap closes it).
            stray = client.pool(a)
            assert stray is not pool_a and await client.reap() == 1 and stray.is_closed
            # Back with another dp_size: the same pool, admitting more.
            pool_b = client.pool(b)
            client.follow([Instance(url_b, 3)])
            assert client.pool(b) is pool_b and pool_b.limiter.total_tokens == 6
            assert await get(pool_b) == b"ok"
        assert pool_b.is_closed



async def test_abandoning_a_waiting_read_resets_the_connection() -> None:
    """vLLM aborts at once on a reset, but only notices a FIN on its next write."""
    server = CountingServer(stall_after=b"first")
    async with serving(server) as url:
        pool = UpstreamPool(url)
        response = await pool.request(b"GET", b"/x")
        assert await response.receive() == b"first"
        with trio.move_on_after(0.05):  # the client leaves while the read waits
            await response.receive()
        await response.aclose()
        await server.client_closed.wait()
        assert server.stall_ended_by == "reset"
        assert pool.limiter.borrowed_tokens == 0
        await pool.aclose()


async def test_a_header_that_cannot_be_sent_takes_no_place() -> None:
    server = CountingServer()
    async with serving(server) as url:
        pool = UpstreamPool(url, limit=1)
        for _ in range(2):
            with pytest.raises(UnicodeEncodeError):
                await pool.request(b"GET", b"/x", headers={"authorization": "Bearer k\u20acy"})
        assert pool.limiter.borrowed_tokens == 0
        assert await get(pool) == b"ok"
        await pool.aclose()


async def test_the_callers_authorization_replaces_the_pools_default() -> None:
    server = CountingServer()
    async with serving(server) as url:
        pool = UpstreamPool(url, headers={"Authorization": "Bearer upstream"})
        await get(pool)
        assert [v for k, v in server.last_headers if k == b"authorization"] == [b"Bearer upstream"]
        response = await pool.request(b"GET", b"/x", headers={"authorization": "Bearer mine"})
        await response.aread()
        assert [v for k, v in server.last_headers if k == b"authorization"] == [b"Bearer mine"]
        await pool.aclose()
