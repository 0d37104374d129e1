"""Upstream pools follow the roster: retired when an instance leaves, closed once idle."""

from __future__ import annotations

import trio

from epd_trio import Instance
from epd_trio._http import UpstreamClient
from epd_trio.testing import FakeVLLM


async def test_pools_follow_the_instances(nursery: trio.Nursery) -> None:
    a, b = FakeVLLM("encode"), FakeVLLM("encode")
    for fake in (a, b):
        await nursery.start(fake.serve)
    ia, ib = Instance(a.url), Instance(b.url)
    async with UpstreamClient(max_connections=2, headers={"authorization": "Bearer up"}) as client:
        client.follow([ia, ib])
        pool_a = client.pool(ia)
        response = await pool_a.request(b"GET", b"/health")  # in flight until closed
        client.follow([ib])  # a left
        assert client.pool(ia) is pool_a  # a request routed there before still gets it
        assert await client.reap() == 0 and not pool_a.is_closed
        await response.aread()
        assert await client.reap() == 1 and pool_a.is_closed
        # Unknown to the roster: usable, but retired from the start (closed by the next reap).
        stray = client.pool(ia)
        assert stray is not pool_a and await client.reap() == 1 and stray.is_closed
        # An instance back with another dp_size: its pool admits more.
        pool_b = client.pool(ib)
        client.follow([Instance(b.url, 3)])
        assert client.pool(ib) is pool_b and pool_b.limiter.total_tokens == 6
    assert pool_b.is_closed
    assert all(r.headers.get("authorization") == "Bearer up" for r in a.received + b.received)


async def test_a_connection_returned_to_a_closed_pool_is_closed(nursery: trio.Nursery) -> None:
    fake = FakeVLLM("encode")
    await nursery.start(fake.serve)
    client = UpstreamClient()
    pool = client.pool(Instance(fake.url))
    response = await pool.request(b"GET", b"/health")
    await client.aclose()  # shutdown with a response still open
    await response.aread()
    assert response._conn.is_closed() and pool._idle == []
