"""ASGI plumbing around the Quart app: per-request resource ownership and the keep-alive fix.

Two problems live at this layer, below the routes:

1. **Who closes an open upstream stream?** A route returns a ``Response`` whose body generator
   owns the decode stream; if the client disconnects after the route returned but before the body
   is iterated, the generator never runs its ``finally`` and the upstream connection would stay
   checked out of the pool. Each HTTP request therefore gets an ``AsyncExitStack`` here, closed
   when the ASGI call returns (response sent, or request cancelled); routes register anything
   that must outlive them on it (``request_resources()``).

2. **Keep-alive idle timeout never fires (quart-trio on Hypercorn's trio worker).** Hypercorn
   reports the disconnect while the app's final body ``send()`` is still running; quart-trio then
   cancels the request nursery, which cancels the part of that ``send()`` that re-arms Hypercorn's
   idle timer, so idle keep-alive connections stay open forever. Shielding the final body send
   (``more_body`` false) from cancellation lets it finish. Hypercorn's socket writes are shielded
   already, so this adds no new way to block.
"""

from __future__ import annotations

from contextlib import AsyncExitStack
from contextvars import ContextVar
from typing import Any

import trio
from hypercorn.typing import ASGIReceiveCallable, ASGISendCallable, ASGISendEvent

ASGIApp = Any

_resources: ContextVar[AsyncExitStack] = ContextVar("epd_trio_request_resources")


def request_resources() -> AsyncExitStack:
    """The current request's resource owner (only valid inside a request wrapped by ``ProxyASGI``)."""
    return _resources.get()


class ProxyASGI:
    """Wraps an ASGI app (installed as ``quart_app.asgi_app``) with the two fixes above."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(
        self, scope: dict[str, Any], receive: ASGIReceiveCallable, send: ASGISendCallable
    ) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_final_shielded(message: ASGISendEvent) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                with trio.CancelScope(shield=True):
                    await send(message)
            else:
                await send(message)

        async with AsyncExitStack() as resources:
            token = _resources.set(resources)
            try:
                await self.app(scope, receive, send_final_shielded)
            finally:
                _resources.reset(token)
