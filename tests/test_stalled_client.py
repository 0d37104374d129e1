"""A client that stops reading does not pin its upstream stream (or the vLLM generation)."""

from __future__ import annotations

from urllib.parse import urlsplit

import orjson
import trio
import trio.testing

from epd_trio.testing import run_cluster

from helpers import chat_body


async def test_stalled_reader_releases_the_upstream_stream() -> None:
    async with run_cluster(prefills=1, decodes=1, client_write_timeout=0.5) as c:
        decode = c.decodes[0]
        decode.behaviour.tokens = 10**6  # far more than the socket buffers hold
        parts = urlsplit(c.proxy_url)
        stuck = await trio.open_tcp_stream(parts.hostname, parts.port)
        async with stuck:
            body = orjson.dumps({**chat_body(), "stream": True, "max_tokens": 10**6})
            await stuck.send_all(
                b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                b"application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
            with trio.fail_after(30):  # never read: the proxy's send to us blocks, then...
                await decode.wait_until(lambda: decode.disconnects == 1)  # ...decode released
            await trio.testing.wait_all_tasks_blocked()
            assert c.proxy.registry.in_flight() == 0
            assert c.proxy.counters.client_cancels == {"decode": 1}
