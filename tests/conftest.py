"""Fixtures shared by the integration tests (real sockets on 127.0.0.1)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import httpx
import pytest

from real_servers import RedisServer


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
    async with httpx.AsyncClient(timeout=30.0, limits=limits, trust_env=False) as c:
        yield c


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One real redis-server for the session (each test uses its own key prefix)."""
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.kill()
