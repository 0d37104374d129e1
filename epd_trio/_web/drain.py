"""Shutdown: requests in flight get a grace period, new ones are refused, the rest are told.

Why the proxy drains itself instead of leaving it to Hypercorn's ``graceful_timeout``: when
that ran out, Hypercorn cancelled what was left, and the cancellation looked like a client that
left. A stream stopped mid-answer with a truncated chunked body and no error event, and the
request was logged and counted as ``cancelled 499``, the client's doing. Here ``epd-trio
serve``'s shutdown trigger runs ``Drain.run`` before it lets Hypercorn stop:

1. At once, ``draining``: a new completion request gets a 503 ``shutting_down`` with
   ``Connection: close`` (``ShuttingDown``) and ``/ready`` answers 503, so a load balancer
   stops sending here; every other route still answers.
2. The requests in flight get ``grace`` seconds (``EPD_SHUTDOWN_GRACE``) to end by themselves.
3. Then each one left is cut: a relayed stream ends with an SSE error event naming the shutdown
   (``StreamRelay.cut``), any other request is cancelled and answered 503 if its reply had not
   started. The accounting (``shutting_down``) counts and logs each as ``shutdown``.
4. ``run`` returns once they are over, or ``CUT_MARGIN`` seconds later (a client that stopped
   reading can hold a write: the process watchdog of ``_serve/runner`` bounds that).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

import trio

from .._core.errors import ProxyError, ShuttingDown

__all__ = ["CUT_MARGIN", "Drain", "InFlight"]

log = logging.getLogger("epd_trio")

#: Seconds the requests cut at the end of the grace period get to send their last bytes.
CUT_MARGIN = 0.5


class Cuttable(Protocol):
    """A relayed stream (``_upstream/legs.StreamRelay``): ``cut`` ends it with an error event."""

    def cut(self, error: ProxyError) -> None: ...


class InFlight:
    """One completion request while it runs: how to cut it, and whether it was cut."""

    __slots__ = ("cut", "handed", "relay", "scope", "started")

    def __init__(self) -> None:
        #: Cancels the request (set by the endpoint once the request's scope exists).
        self.scope: trio.CancelScope | None = None
        #: Its relayed stream, once the reply is a stream being sent.
        self.relay: Cuttable | None = None
        #: The reply's head has been sent (a cut request can then no longer get a 503).
        self.started = False
        #: The drain cancelled it.
        self.cut = False
        #: Its body is read and it went to the pipeline (whose accounting then counts it).
        self.handed = False

    def end(self, error: ShuttingDown) -> None:
        if self.relay is not None:
            self.relay.cut(error)  # the stream ends with ``error``'s event, not cancelled
        elif self.scope is not None:
            self.cut = True
            self.scope.cancel()


class Drain:
    """The completion requests in flight of one app, and its shutdown (see the module)."""

    def __init__(self, grace: float, on_cut: Callable[[], None]) -> None:
        self.grace = grace
        self._on_cut = on_cut
        self._requests: set[InFlight] = set()
        self._idle: trio.Event | None = None
        #: Shutdown has begun: new completion requests are refused, ``/ready`` says 503.
        self.draining = False

    def __len__(self) -> int:
        return len(self._requests)

    def add(self) -> InFlight:
        """One request in flight, until ``discard`` (a context manager cost more per request
        than the rest of this)."""
        entry = InFlight()
        self._requests.add(entry)
        return entry

    def discard(self, entry: InFlight) -> None:
        self._requests.discard(entry)
        if not self._requests and self._idle is not None:
            self._idle.set()

    def refusal(self) -> ShuttingDown:
        return ShuttingDown("the proxy is shutting down and accepts no new request; "
                            "retry on another replica")

    def refusal_at_end(self) -> ShuttingDown:
        return ShuttingDown(f"the proxy shut down: the request was still running at the end "
                            f"of its {self.grace:g} s shutdown grace period")

    async def run(self) -> None:
        """Drain (once, when shutdown begins); returns when no request is left in flight."""
        self.draining = True
        self._idle = idle = trio.Event()
        if not self._requests:
            return
        log.info("shutting down: %d request(s) in flight get up to %g s (EPD_SHUTDOWN_GRACE)",
                 len(self._requests), self.grace)
        with trio.move_on_after(self.grace):
            await idle.wait()
        if not self._requests:
            return
        log.warning("shutdown grace of %g s over: ending %d request(s) still in flight",
                    self.grace, len(self._requests))
        self._on_cut()
        error = self.refusal_at_end()
        for entry in list(self._requests):
            entry.end(error)
        with trio.move_on_after(CUT_MARGIN):
            await idle.wait()
