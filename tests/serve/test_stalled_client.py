"""A client that stops reading does not pin its upstream stream (or the vLLM generation)."""

from __future__ import annotations

import trio
import trio.testing

from epd_trio.testing import run_cluster

from helpers import client_cancels, open_stuck_stream


async def test_stalled_reader_releases_the_upstream_stream() -> None:
    async with run_cluster(prefills=1, decodes=1, client_write_timeout=0.5) as c:
        decode = c.decodes[0]
        decode.behaviour.tokens = 10**6  # far more than the socket buffers hold
        async with await open_stuck_stream(c.proxy_url):
            with trio.fail_after(30):  # never read: the proxy's send to us blocks, then...
                await decode.wait_until(lambda: decode.disconnects == 1)  # ...decode released
            await trio.testing.wait_all_tasks_blocked()
            assert c.proxy.registry.in_flight() == 0
            assert client_cancels(c.proxy) == {"decode": 1}
