"""The same load as ``bench._load.run_load``, on one epoll loop with no async framework.

Why a second one: on a 2-core machine the client shares the CPU with the proxy under test,
and ``bench.compare``'s long streams are ~20 000 SSE events a second. Trio's per-wake-up cost
(a task switch, a checkpoint and an epoll round per ``receive_some``) made the client the
largest CPU consumer of the run; here an event costs one ``epoll`` entry, one ``recv`` and a
few slices (``bench._wire``). The results are the same ``Result`` objects, times from
``time.monotonic``. Sockets stay blocking: ``recv`` runs only when epoll reported data, and a
request (a few hundred bytes, or a small image) fits the loopback send buffer at once.
"""

from __future__ import annotations

import contextlib
import itertools
import select
import socket
import time
from collections.abc import Callable

from bench._load import Result, classify, request_head
from bench._wire import ResponseReader, SSECounter, WireError

__all__ = ["run_load_epoll"]


class _Exchange:
    __slots__ = ("counter", "deadline", "gaps", "index", "last", "reader", "size", "sock",
                 "t0", "ttfb")

    def __init__(self, sock: socket.socket, index: int, stream: bool, record_gaps: bool,
                 timeout: float, began: float) -> None:
        self.sock = sock
        self.index = index
        self.reader = ResponseReader()
        self.counter = SSECounter() if stream else None
        self.gaps: list[float] | None = [] if stream and record_gaps else None
        #: When the client began this request, its connect included: a proxy that answers a
        #: burst with a short listen backlog makes clients wait in SYN retries, and a client
        #: sees that wait as latency.
        self.t0 = began
        self.deadline = self.t0 + timeout
        self.ttfb: float | None = None
        self.last: float | None = None
        self.size = 0

    def feed(self, data: bytes, now: float) -> None:
        pieces = self.reader.feed(data)
        if not pieces:
            return
        if self.ttfb is None:
            self.ttfb = now - self.t0
        for piece in pieces:
            self.size += len(piece)
            if self.counter is not None:
                events = self.counter.feed(piece)
                if self.gaps is not None and events:
                    if self.last is not None:
                        self.gaps.append(now - self.last)
                    self.gaps.extend([0.0] * (events - 1))
                    self.last = now

    def result(self, now: float, error: str | None) -> Result:
        r, c = self.reader, self.counter
        if error is None:
            if c is not None and c.errors:
                error = "error event in stream"
            elif r.status != 200:
                error = f"HTTP {r.status}"
            elif c is not None and not c.done:
                error = "stream ended without [DONE]"
        return Result(self.index, self.t0, now - self.t0, self.ttfb, r.status, error, self.size,
                      c.tokens if c is not None else 0, self.gaps)


def run_load_epoll(host: str, port: int, path: str, make_body: Callable[[int], bytes], *,
                   requests: int, concurrency: int, stream: bool, request_timeout: float,
                   record_gaps: bool = False, split_head: bool = False) -> list[Result]:
    """Send ``requests`` requests over ``concurrency`` keep-alive connections (blocking call).

    ``split_head``: write each request's head and body with two ``send`` calls, as httpx (the
    OpenAI SDK's client) does, instead of one. With TCP_NODELAY each is a segment of its own,
    and a server may need two reads (two wake-ups) for one request."""
    authority = f"{host}:{port}"
    indices = itertools.count()
    results: list[Result] = []
    live: dict[int, _Exchange] = {}
    ep = select.epoll()

    def start(sock: socket.socket | None, began: float | None = None) -> None:
        """Send the next request on ``sock`` (a new connection when None), if any is left.

        ``began``: when the request began for its client (default now). The first wave of
        ``concurrency`` requests all began when the run did, however long this one loop takes
        to connect them: they stand for that many clients arriving at once, and a proxy that
        keeps them waiting in its listen backlog keeps them waiting all the same."""
        while (index := next(indices)) < requests:
            body = make_body(index)
            if began is None:
                began = time.monotonic()
            try:
                if sock is None:
                    sock = socket.create_connection((host, port))
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    ep.register(sock.fileno(), select.EPOLLIN)
                live[sock.fileno()] = _Exchange(sock, index, stream, record_gaps,
                                                request_timeout, began)
                head = request_head("POST", path, authority, len(body))
                if split_head:
                    sock.sendall(head)
                    sock.sendall(body)
                else:
                    sock.sendall(head + body)
            except OSError as exc:  # this request failed; the next one gets a new connection
                if sock is not None:
                    live.pop(sock.fileno(), None)
                    _close(ep, sock)
                    sock = None
                results.append(Result(index, time.monotonic(), 0.0, None, None, classify(exc)))
            else:
                return
        if sock is not None:
            _close(ep, sock)

    def finish(exchange: _Exchange, now: float, error: str | None) -> None:
        del live[exchange.sock.fileno()]
        results.append(exchange.result(now, error))
        if error is None and exchange.reader.keep_alive:
            start(exchange.sock)
        else:
            _close(ep, exchange.sock)
            start(None)

    try:
        run_began = time.monotonic()
        for _ in range(min(concurrency, requests)):
            start(None, run_began)
        next_sweep = time.monotonic() + 0.5
        while live:
            ready = ep.poll(0.1)
            now = time.monotonic()
            for fd, _ in ready:
                exchange = live.get(fd)
                if exchange is None:
                    continue
                try:
                    data = exchange.sock.recv(262144)
                    if data:
                        exchange.feed(data, now)
                except (OSError, WireError) as exc:
                    finish(exchange, now, classify(exc))
                    continue
                if not data:
                    finish(exchange, now, "connection reset")  # closed mid-response
                    continue
                if exchange.reader.done:
                    finish(exchange, now, None)
            if now >= next_sweep:
                next_sweep = now + 0.5
                for exchange in [e for e in live.values() if e.deadline <= now]:
                    finish(exchange, now, "timeout")
    finally:
        for exchange in live.values():
            exchange.sock.close()
        ep.close()
    return sorted(results, key=lambda r: r.index)


def _close(ep: select.epoll, sock: socket.socket) -> None:
    with contextlib.suppress(OSError, ValueError):
        ep.unregister(sock.fileno())
    sock.close()
