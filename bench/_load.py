"""The load generator: raw HTTP/1.1 over trio sockets, parsed with h11.

Why not httpx: the generator must not be the bottleneck on a 2-core machine, and httpx costs
milliseconds of CPU per request at high concurrency (its pool is O(n^2) in queued requests).
Each worker owns one keep-alive connection and sends the next request as soon as the previous
answer is complete; ``concurrency == requests`` opens every connection at once (a burst).
"""

from __future__ import annotations

import errno
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import h11
import trio


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


@dataclass
class Progress:
    """Counters the progress display reads while the load runs."""

    total: int
    done: int = 0
    failed: int = 0
    results: list[Result] = field(default_factory=list)


class _Conn:
    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.h11 = h11.Connection(h11.CLIENT, max_incomplete_event_size=1 << 20)


def classify(exc: BaseException) -> str:
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, ConnectionResetError | BrokenPipeError | trio.BrokenResourceError
                  | h11.RemoteProtocolError | EOFError):
        return "connection reset"
    if isinstance(exc, OSError) and "refused" in str(exc):
        return "connection refused"
    if isinstance(exc, OSError) and exc.errno is not None:  # say which: EMFILE, EADDRNOTAVAIL...
        return f"{type(exc).__name__} {errno.errorcode.get(exc.errno, exc.errno)}"
    return type(exc).__name__


_SSE_ERROR = b'data: {"error"'


async def _exchange(conn: _Conn, target: str, host: str, body: bytes, stream: bool,
                    t0: float) -> tuple[int, float | None, int, bool]:
    """Send one request and read the whole answer: (status, ttfb, size, sse error seen)."""
    headers = [("host", host), ("content-type", "application/json"),
               ("content-length", str(len(body)))]
    data = conn.h11.send(h11.Request(method="POST", target=target, headers=headers))
    data += conn.h11.send(h11.Data(data=body)) + conn.h11.send(h11.EndOfMessage())
    await conn.stream.send_all(data)
    status, ttfb, size, sse_error = 0, None, 0, False
    tail = b""  # the end of the previous piece: an error event may straddle two reads
    while True:
        event = conn.h11.next_event()
        if event is h11.NEED_DATA:
            chunk = await conn.stream.receive_some(65536)
            if not chunk:
                raise EOFError("server closed the connection mid-response")
            conn.h11.receive_data(chunk)
        elif isinstance(event, h11.Response):
            status = event.status_code
        elif isinstance(event, h11.Data):
            if ttfb is None:
                ttfb = trio.current_time() - t0
            size += len(event.data)
            if stream and not sse_error:
                window = tail + bytes(event.data)
                sse_error = _SSE_ERROR in window
                tail = window[-len(_SSE_ERROR):]
        elif isinstance(event, h11.EndOfMessage):
            return status, ttfb, size, sse_error
        elif isinstance(event, h11.ConnectionClosed):
            raise EOFError("connection closed")


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
) -> list[Result]:
    """Send ``requests`` requests over ``concurrency`` connections; return every outcome."""
    indices = itertools.count()
    authority = f"{host}:{port}"
    start_all = trio.Event()

    async def worker() -> None:
        conn: _Conn | None = None
        await start_all.wait()
        while (i := next(indices)) < requests:
            body = make_body(i)
            t0 = trio.current_time()
            status = ttfb = error = None
            size = 0
            with trio.move_on_after(request_timeout) as scope:
                try:
                    if conn is None:
                        conn = _Conn(await trio.open_tcp_stream(host, port))
                    status, ttfb, size, sse_error = await _exchange(
                        conn, path, authority, body, stream, t0)
                    if sse_error:
                        error = "error event in stream"
                    elif status != 200:
                        error = f"HTTP {status}"
                    if conn.h11.our_state is h11.DONE and conn.h11.their_state is h11.DONE:
                        conn.h11.start_next_cycle()
                    else:
                        await conn.stream.aclose()
                        conn = None
                except (OSError, EOFError, trio.BrokenResourceError, h11.ProtocolError) as exc:
                    error = classify(exc)
            if scope.cancelled_caught:
                error = "timeout"
            if error is not None and conn is not None and (error == "timeout" or status is None):
                await conn.stream.aclose()
                conn = None
            result = Result(i, t0, trio.current_time() - t0, ttfb, status, error, size)
            progress.results.append(result)
            progress.done += 1
            progress.failed += error is not None
        if conn is not None:
            await conn.stream.aclose()

    async with trio.open_nursery() as nursery:
        for _ in range(min(concurrency, requests)):
            nursery.start_soon(worker)
        start_all.set()
    return sorted(progress.results, key=lambda r: r.index)
