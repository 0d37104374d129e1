"""Idle keep-alive connections are closed after the configured timeout (quart-trio + Hypercorn).

Without the shielded final send in ``epd_trio._web.asgi`` these connections stay open forever: the
request nursery's cancellation interrupts the send that re-arms Hypercorn's idle timer.
"""

from __future__ import annotations

from urllib.parse import urlsplit

import h11
import orjson
import pytest
import trio

from epd_trio.testing import run_cluster

from helpers import chat_body

KEEP_ALIVE = 0.5


async def _exchange(stream: trio.SocketStream, conn: h11.Connection, request: h11.Request,
                    body: bytes) -> tuple[int, bytes]:
    await stream.send_all(conn.send(request) + conn.send(h11.Data(data=body))
                          + conn.send(h11.EndOfMessage()))
    status, content = 0, b""
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await stream.receive_some())
        elif isinstance(event, h11.Response):
            status = event.status_code
        elif isinstance(event, h11.Data):
            content += event.data
        elif isinstance(event, h11.EndOfMessage):
            return status, content


@pytest.mark.parametrize("stream", [False, True])
async def test_idle_keepalive_connection_is_closed(stream: bool) -> None:
    async with run_cluster(prefills=1, decodes=1, keep_alive=KEEP_ALIVE) as c:
        url = urlsplit(c.proxy_url)
        sock = await trio.open_tcp_stream(url.hostname, url.port)
        async with sock:
            conn = h11.Connection(h11.CLIENT)
            body = orjson.dumps(chat_body(stream=stream))
            request = h11.Request(method="POST", target="/v1/chat/completions", headers=[
                ("host", url.netloc), ("content-type", "application/json"),
                ("content-length", str(len(body)))])
            status, content = await _exchange(sock, conn, request, body)
            assert status == 200 and content
            assert conn.our_state is h11.DONE and conn.their_state is h11.DONE  # kept alive
            idle_since = trio.current_time()
            with trio.fail_after(KEEP_ALIVE + 10):
                assert await sock.receive_some() == b""  # the server closed the idle connection
            assert trio.current_time() - idle_since >= KEEP_ALIVE * 0.9
