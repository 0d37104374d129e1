"""Fixtures shared by the integration tests (real sockets on 127.0.0.1)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
    async with httpx.AsyncClient(timeout=30.0, limits=limits, trust_env=False) as c:
        yield c
