"""The upstream HTTP client: which library (one import), and the per-instance concurrency cap.

httpx 0.28's connection pool assigns queued requests to connections in O(n^2) (encode/httpx#3215,
encode/httpcore PR #1035, both open): measured here it was the proxy's largest CPU cost under
concurrency. ``httpx2`` is the maintained fork with those fixes merged and the same API; switching
back is the one import below.

Even so, httpcore's pool re-checks every connection it holds (closed? expired? the latter a
``poll`` syscall per idle connection) each time a request is added or removed: O(connections) per
request. With the hundreds of concurrent streams a vLLM instance serves, that was the proxy's
largest cost (measured: 5.2 ms of CPU per request with 256 connections to each instance, 2.7 ms
with 64). ``ShardedTransport`` keeps that scan short without capping concurrency: each instance
gets up to ``limit`` connections split into pools of at most ``SHARD_SIZE``; a
``trio.CapacityLimiter`` admits at most ``limit`` requests (the rest wait in its FIFO queue, O(1)
each) and each admitted request goes to the first pool with a free place (first fit, so load
concentrates on few pools and their connections stay warm). A place is given back when the
response is closed, so a long stream keeps its own. Measured: see README "Performance".
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable

import httpx2 as httpx
import trio

#: The client class to pass to the library functions (``run_encoder_fanout``): errors are mapped
#: from this library's exceptions, so a client from another copy of httpx would not be.
UpstreamClient = httpx.AsyncClient


class _ReleasingStream(httpx.AsyncByteStream):
    """A response body that gives its limiter slot back when closed."""

    def __init__(self, inner: httpx.AsyncByteStream, release: _Release) -> None:
        self._inner = inner
        self._release = release

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._inner:
            yield chunk

    async def aclose(self) -> None:
        try:
            await self._inner.aclose()
        finally:
            self._release()


class _Release:
    """Gives one request's place back (once): its pool's count and the limiter's token."""

    def __init__(self, limiter: trio.CapacityLimiter, borrower: object, in_use: list[int],
                 index: int) -> None:
        self._limiter = limiter
        self._borrower: object | None = borrower
        self._in_use = in_use
        self._index = index

    def __call__(self) -> None:
        if self._borrower is not None:
            self._in_use[self._index] -= 1
            self._limiter.release_on_behalf_of(self._borrower)
            self._borrower = None


#: Connections per pool: short enough that the pool's per-request scan stays cheap.
SHARD_SIZE = 32


class ShardedTransport(httpx.AsyncBaseTransport):
    """Up to ``limit`` requests in flight to one instance, over pools of ``shard_size``."""

    def __init__(
        self, make_pool: Callable[[int], httpx.AsyncBaseTransport], limit: int,
        shard_size: int = SHARD_SIZE, queue_timeout: float | None = None,
    ) -> None:
        self._make_pool = make_pool
        self._queue_timeout = queue_timeout
        self._shard_size = shard_size
        self._shards: list[httpx.AsyncBaseTransport] = []
        self._in_use: list[int] = []
        self.limiter = trio.CapacityLimiter(limit)

    def _place(self) -> int:
        for index, used in enumerate(self._in_use):
            if used < self._shard_size:
                return index
        self._shards.append(self._make_pool(self._shard_size))
        self._in_use.append(0)
        return len(self._shards) - 1

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """Wait for a place (at most ``queue_timeout``: then ``httpx.PoolTimeout``), send."""
        borrower = object()
        with trio.move_on_after(self._queue_timeout or math.inf) as waited:
            await self.limiter.acquire_on_behalf_of(borrower)
        if waited.cancelled_caught:
            raise httpx.PoolTimeout(
                f"no free place among {self.limiter.total_tokens:g} in "
                f"{self._queue_timeout:g} s", request=request)
        try:
            index = self._place()
        except BaseException:
            self.limiter.release_on_behalf_of(borrower)
            raise
        self._in_use[index] += 1
        release = _Release(self.limiter, borrower, self._in_use, index)
        try:
            response = await self._shards[index].handle_async_request(request)
        except BaseException:
            release()
            raise
        assert isinstance(response.stream, httpx.AsyncByteStream)
        response.stream = _ReleasingStream(response.stream, release)
        return response

    async def aclose(self) -> None:
        for shard in self._shards:
            await shard.aclose()


__all__ = ["SHARD_SIZE", "ShardedTransport", "UpstreamClient", "httpx"]
