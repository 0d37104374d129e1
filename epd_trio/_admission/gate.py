"""Admission control: a cap on the client requests in flight, with a bounded wait for a place.

Why: every request in flight holds its body, its trace and (for a stream) an upstream
connection, so a flood of clients would otherwise grow the proxy's memory without bound. Over
the cap a request waits at most ``timeout`` seconds (every wait has a deadline), then gets a 503
``AtCapacity`` with ``Retry-After``: the client may come back, and no instance is blamed. The
place is held until the request's resources close, so a stream counts until its last byte.
"""

from __future__ import annotations

from contextlib import AsyncExitStack

import trio

from .._core.errors import AtCapacity


class Admission:
    """One proxy's cap (``EPD_MAX_INFLIGHT``) and wait (``EPD_ADMISSION_TIMEOUT``)."""

    def __init__(self, max_inflight: int, timeout: float, *,
                 limit: str = "its limit of {cap} requests (EPD_MAX_INFLIGHT)") -> None:
        """``limit``: how a refusal names the cap (a model's own, ``{cap}`` its size)."""
        self._limiter = trio.CapacityLimiter(max_inflight)
        self._timeout = timeout
        self._limit = limit.format(cap=max_inflight)

    async def enter(self, resources: AsyncExitStack) -> None:
        """Take a place for the request that owns ``resources`` (released when they close);
        ``AtCapacity`` when none frees in time."""
        borrower = object()
        try:
            self._limiter.acquire_on_behalf_of_nowait(borrower)
        except trio.WouldBlock:
            acquired = False
            with trio.move_on_after(self._timeout):
                await self._limiter.acquire_on_behalf_of(borrower)
                acquired = True
            if not acquired:
                raise AtCapacity(
                    f"the proxy is serving {self._limit} and none finished within "
                    f"{self._timeout:g} s; retry later") from None
        resources.callback(self._limiter.release_on_behalf_of, borrower)
