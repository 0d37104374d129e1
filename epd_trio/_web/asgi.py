"""ASGI plumbing around the Quart app: per-request resource ownership and the keep-alive fix.

Four problems live at this layer, below the routes:

1. **Who closes an open upstream stream?** The pipeline returns a reply whose body generator
   owns the decode stream; if the client disconnects before that body is iterated, the generator
   never runs its ``finally`` and the upstream connection would stay checked out. Each HTTP
   request therefore gets an ``AsyncExitStack`` here, closed when the ASGI call returns (response
   sent, or request cancelled); the hot-path endpoints (``_web/endpoints``, served from here, below
   Quart) register anything that must outlive the pipeline call on it.

2. **Keep-alive idle timeout never fires (quart-trio on Hypercorn's trio worker).** Hypercorn
   reports the disconnect while the app's final body ``send()`` is still running; quart-trio then
   cancels the request nursery, which cancels the part of that ``send()`` that re-arms Hypercorn's
   idle timer, so idle keep-alive connections stay open forever. Shielding the final body send
   (``more_body`` false) from cancellation lets it finish. Hypercorn's socket writes are shielded
   already, so this adds no new way to block.

3. **A client that stops reading.** Those shielded socket writes have no timeout, so a client
   that keeps its connection open but reads nothing would hold its request, and the vLLM
   generation behind it, forever. Every body send is registered while it runs; a watchdog task
   (``watch_stalled_sends``, owned by the app's lifespan nursery) closes the resources of a
   request whose send has been stuck for ``write_timeout`` seconds, which releases the upstream
   stream (vLLM aborts it). The client connection itself is cut by the kernel when the server
   socket has ``TCP_USER_TIMEOUT`` set, as ``epd-trio serve`` and the in-process server do.

4. **A relayed token's cost.** Under ``epd-trio serve`` a body chunk is handed to the
   connection's own writer (``direct_body``) instead of going down as an ASGI message; what the
   writer declines goes down as before.
"""

from __future__ import annotations

import logging
import math
from contextlib import AsyncExitStack
from typing import Any

import trio
from hypercorn.typing import ASGIReceiveCallable, ASGISendCallable, ASGISendEvent

from .._core.names import KIND_OF_PATH, MODEL_ENDPOINTS
from .direct_body import PARTIAL, WRITTEN, WRITTEN_YIELD, chunk_writer
from .endpoints import CompletionEndpoints

ASGIApp = Any
log = logging.getLogger("epd_trio")

class ProxyASGI:
    """Wraps an ASGI app (installed as ``quart_app.asgi_app``) with the fixes above."""

    def __init__(self, app: ASGIApp, write_timeout: float = 60.0,
                 endpoints: CompletionEndpoints | None = None) -> None:
        self.app = app
        #: The hot-path routes served below the framework (``_core.names.KIND_OF_PATH``), if any.
        self.endpoints = endpoints
        self.write_timeout = write_timeout
        #: The requests being answered, each with the start of its body send in progress.
        self._watches: set[_Watch] = set()
        #: Requests whose resources were released because their client stopped reading.
        self.stalled = 0

    async def watch_stalled_sends(
        self, *, task_status: trio.TaskStatus[trio.CancelScope] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Release the resources of requests whose body send is stuck.

        Reports the cancel scope that stops it (the app cancels it at shutdown).
        """
        with trio.CancelScope() as scope:
            task_status.started(scope)
            while True:
                await trio.sleep(self.write_timeout / 4)
                limit = trio.current_time() - self.write_timeout
                for watch in [w for w in self._watches if w.since <= limit]:
                    if watch in self._watches:
                        self._watches.discard(watch)
                        self.stalled += 1
                        log.warning("client stopped reading for %g s: releasing its upstream "
                                    "request", self.write_timeout)
                        try:
                            await watch.resources.aclose()
                        except Exception:  # one request's cleanup must not stop the watchdog
                            log.exception("releasing a stalled request failed")

    async def __call__(
        self, scope: dict[str, Any], receive: ASGIReceiveCallable, send: ASGISendCallable
    ) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        writer = chunk_writer(scope)

        async def send_watched(message: ASGISendEvent) -> None:
            if message["type"] != "http.response.body":
                await send(message)
                return
            if writer is not None and message.get("more_body", False):
                # A relayed token, written by the connection itself (``direct_body``): no wait,
                # so nothing to watch, unless the kernel took only part of it.
                taken = writer.write_chunk(message.get("body", b""))
                if taken == WRITTEN:
                    return
                if taken == WRITTEN_YIELD:
                    await trio.lowlevel.cancel_shielded_checkpoint()
                    return
                if taken == PARTIAL:
                    watch.since = trio.current_time()
                    try:
                        await writer.flush_chunk()
                    finally:
                        watch.since = math.inf
                    return
            # Per send only the clock is read: registering once per request is cheaper than
            # once per relayed token.
            watch.since = trio.current_time()
            try:
                if message.get("more_body", False):
                    await send(message)
                else:
                    with trio.CancelScope(shield=True):
                        await send(message)
            finally:
                watch.since = math.inf

        async with AsyncExitStack() as resources:
            watch = _Watch(resources)
            self._watches.add(watch)
            try:
                if self.endpoints is not None and (scope["path"] in KIND_OF_PATH
                                                   or scope["path"] in MODEL_ENDPOINTS):
                    await self.endpoints(scope, receive, send_watched, resources)
                    return
                await self.app(scope, receive, send_watched)
            finally:
                self._watches.discard(watch)


class _Watch:
    """One request being answered, for the stalled-send watchdog."""

    __slots__ = ("resources", "since")

    def __init__(self, resources: AsyncExitStack) -> None:
        self.resources = resources
        #: When its body send in progress began (inf: none in progress).
        self.since = math.inf
