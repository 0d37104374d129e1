"""How a request learns that its client left, without a task per request.

Under ASGI an app learns that its client left by receiving ``http.disconnect``, so the proxy's
endpoints start a watcher task per request that waits on ``receive()`` and cancels the request
(``_endpoints._cancel_on_disconnect``). That task is a real share of a short request's cost: a
spawn, a channel wait, a cancellation with its reason, a nursery (docs/discussion/performance.md).

``epd-trio serve``'s connection class knows it first hand: an HTTP/1.x connection carries one
request at a time, so when its client closes it (the read loop sees the end or an error, or a
write fails), the request on it is gone. Each connection offers a ``ClientGone`` to its
requests through the connection's ASGI state (``scope["state"][CLIENT_GONE]``), and a request
registers its cancel scope there instead of starting the watcher. HTTP/2 streams end one by
one without the connection closing, so they (and plain Hypercorn, which offers nothing) keep
the watcher: ``client_gone(scope)`` answers only for HTTP/1.x requests.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import trio

__all__ = ["CLIENT_GONE", "ClientGone", "client_gone"]

#: The key of a connection's ``ClientGone`` in its ASGI state.
CLIENT_GONE = "epd_trio.client_gone"


class ClientGone:
    """One HTTP/1.x connection's news that its client left (owned by the connection)."""

    __slots__ = ("_scopes", "gone")

    def __init__(self) -> None:
        self._scopes: set[trio.CancelScope] = set()
        #: The client has left: a scope registered from now on is cancelled at once.
        self.gone = False

    @contextmanager
    def cancelling(self, scope: trio.CancelScope) -> Iterator[None]:
        """Cancel ``scope`` if the client leaves while the block runs."""
        if self.gone:
            scope.cancel()
        self._scopes.add(scope)
        try:
            yield
        finally:
            self._scopes.discard(scope)

    def left(self) -> None:
        """The client closed the connection (or it broke): cancel every registered request."""
        self.gone = True
        for scope in self._scopes:
            scope.cancel()


def client_gone(scope: Mapping[str, Any]) -> ClientGone | None:
    """The request's connection's ``ClientGone``, if its server offers one and the request is
    HTTP/1.x (one request per connection at a time); None: watch for ``http.disconnect``."""
    state = scope.get("state")
    if state is None or scope.get("http_version") not in ("1.1", "1.0"):
        return None
    return state.get(CLIENT_GONE)
