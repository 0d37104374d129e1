"""The load generator: raw HTTP/1.1 over trio sockets, read by ``bench._wire``.

Why not httpx: the generator must not be the bottleneck on a 2-core machine, and httpx costs
milliseconds of CPU per request at high concurrency (its pool is O(n^2) in queued requests);
why not h11 either: see ``bench._wire``. Each worker owns one keep-alive connection and sends
the next request as soon as the previous answer is complete; ``concurrency == requests`` opens
every connection at once (a burst). A stream's body is split into SSE events as it arrives: the
result counts them, flags an error event, and (``record_gaps``) keeps the client-side gaps
between consecutive events.
"""

from __future__ import annotations

import errno
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import trio

from bench._wire import ResponseReader, SSECounter, WireError


@dataclass(slots=True)
class Result:
    """One request's outcome. ``error`` is None for a complete 200 answer."""

    index: int
    started: float
    latency: float
    ttfb: float | None
    status: int | None
    error: str | None
    size: int = 0
    #: SSE ``data:`` events other than ``[DONE]`` and errors (streams only).
    events: int = 0
    #: Seconds between consecutive SSE events as the client saw them (``record_gaps``).
    gaps: list[float] | None = None


@dataclass
class Progress:
    """Counters the progress display reads while the load runs."""

    total: int
    done: int = 0
    failed: int = 0
    results: list[Result] = field(default_factory=list)


def classify(exc: BaseException) -> str:
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, ConnectionResetError | BrokenPipeError | trio.BrokenResourceError
                  | EOFError):
        return "connection reset"
    if isinstance(exc, WireError):
        return f"bad response: {exc}"
        return "connection reset"
    if isinstance(exc, OSError) and "refused" in str(exc):
        return "connection refused"
    if isinstance(exc, OSError) and exc.errno is not None:  # say which: EMFILE, EADDRNOTAVAIL...
        return f"{type(exc).__name__} {errno.errorcode.get(exc.errno, exc.errno)}"
    return type(exc).__name__


@dataclass(slots=True)
class _Answer:
    status: int
    ttfb: float | None
    size: int
    sse: SSECounter | None
    gaps: list[float] | None
    keep_alive: bool


async def _exchange(stream: trio.SocketStream, head: bytes, body: bytes, sse: bool,
                    record_gaps: bool, t0: float) -> _Answer:
    """Send one request and read the whole answer."""
    await stream.send_all(head + body)
    reader = ResponseReader()
    counter = SSECounter() if sse else None
    gaps: list[float] | None = [] if record_gaps and sse else None
    ttfb = None
    last = None
    size = 0
    while not reader.done:
        data = await stream.receive_some(65536)
        if not data:
            raise EOFError("server closed the connection mid-response")
        pieces = reader.feed(data)
        if not pieces:
            continue
        now = trio.current_time()
        if ttfb is None:
            ttfb = now - t0
        for piece in pieces:
            size += len(piece)
            if counter is not None:
                events = counter.feed(piece)
                if gaps is not None and events:
                    if last is not None:
                        gaps.append(now - last)
                    gaps.extend([0.0] * (events - 1))
                    last = now
    assert reader.status is not None
    return _Answer(reader.status, ttfb, size, counter, gaps, reader.keep_alive)


def request_head(method: str, target: str, authority: str, length: int) -> bytes:
    """The request line and headers, as one bytes object (sent with the body in one write)."""
    return (f"{method} {target} HTTP/1.1\r\nhost: {authority}\r\n"
            f"content-type: application/json\r\ncontent-length: {length}\r\n\r\n").encode()


async def run_load(
    host: str,
    port: int,
    path: str,
    make_body: Callable[[int], bytes],
    *,
    requests: int,
    concurrency: int,
    stream: bool,
    request_timeout: float,
    progress: Progress,
    record_gaps: bool = False,
) -> list[Result]:
    """Send ``requests`` requests over ``concurrency`` connections; return every outcome."""
    indices = itertools.count()
    authority = f"{host}:{port}"
    start_all = trio.Event()

    async def worker() -> None:
        conn: trio.SocketStream | None = None
        await start_all.wait()
        while (i := next(indices)) < requests:
            body = make_body(i)
            head = request_head("POST", path, authority, len(body))
            t0 = trio.current_time()
            answer: _Answer | None = None
            error = None
            with trio.move_on_after(request_timeout) as scope:
                try:
                    if conn is None:
                        conn = await trio.open_tcp_stream(host, port)
                    answer = await _exchange(conn, head, body, stream, record_gaps, t0)
                    sse = answer.sse
                    if sse is not None and sse.errors:
                        error = "error event in stream"
                    elif answer.status != 200:
                        error = f"HTTP {answer.status}"
                    elif sse is not None and not sse.done:
                        error = "stream ended without [DONE]"
                    if not answer.keep_alive:
                        await conn.aclose()
                        conn = None
                except (OSError, EOFError, trio.BrokenResourceError, WireError) as exc:
                    error = classify(exc)
            if scope.cancelled_caught:
                error = "timeout"
            if conn is not None and answer is None:  # the connection's state is unknown
                await conn.aclose()
                conn = None
            result = Result(i, t0, trio.current_time() - t0,
                            answer.ttfb if answer else None, answer.status if answer else None,
                            error, answer.size if answer else 0,
                            answer.sse.tokens if answer and answer.sse else 0,
                            answer.gaps if answer else None)
            progress.results.append(result)
            progress.done += 1
            progress.failed += error is not None
        if conn is not None:
            await conn.aclose()

    async with trio.open_nursery() as nursery:
        for _ in range(min(concurrency, requests)):
            nursery.start_soon(worker)
        start_all.set()
    return sorted(progress.results, key=lambda r: r.index)
