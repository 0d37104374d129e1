"""The load as an aiohttp program writes it: ``bench.compare --client aiohttp``.

Why: the issue's independent measurement drove the proxies with aiohttp, and real clients do
not write a request the way ``bench._epoll_load`` does (head and body in one ``send``). This is
a plain ``aiohttp.ClientSession`` on asyncio's default loop, as an application would use it:
``concurrency`` tasks, each posting its next request when the previous answer is complete, over
one connector with ``limit=concurrency`` (so each task keeps its connection alive).

It runs as a separate process under a Python that has aiohttp (``--aiohttp-python``; by default
the EPD proxy's reference venv, which has it): aiohttp is no dependency of epd_trio. Standard
library, aiohttp and ``_client_process`` (its neighbour) only, so it runs in that venv.
Input: one request body per line in ``--bodies``. Output on stdout: one JSON object,
``{"cpu": seconds, "results": [...]}``, each result with the fields of ``bench._load.Result``;
``cpu`` is this process's CPU during the load only (its start-up and imports excluded).
"""

from __future__ import annotations

import argparse
import sys
import time

from _client_process import parse_args, read_bodies, report, run_workers


async def _one(session, url: str, body: bytes, index: int, stream: bool, limit: float,
               record_gaps: bool) -> dict:
    import aiohttp

    t0 = time.monotonic()
    ttfb = None
    status = None
    size = events = 0
    gaps: list[float] | None = [] if stream and record_gaps else None
    last = None
    done = errors = False
    error = None
    buffer = b""
    try:
        async with session.post(url, data=body, headers={"content-type": "application/json"},
                                timeout=aiohttp.ClientTimeout(total=limit)) as resp:
            status = resp.status
            async for chunk in resp.content.iter_any():
                now = time.monotonic()
                if ttfb is None:
                    ttfb = now - t0
                size += len(chunk)
                if not stream:
                    continue
                buffer += chunk
                *complete, buffer = buffer.split(b"\n\n")
                seen = 0
                for event in complete:
                    if not event.startswith(b"data: "):
                        continue
                    data = event[6:]
                    if data == b"[DONE]":
                        done = True
                    elif data.startswith(b'{"error"'):
                        errors = True
                    else:
                        events += 1
                        seen += 1
                if gaps is not None and seen:
                    if last is not None:
                        gaps.append(now - last)
                    gaps.extend([0.0] * (seen - 1))
                    last = now
    except TimeoutError:
        error = "timeout"
    except aiohttp.ClientConnectionError as exc:
        error = "connection refused" if "refused" in str(exc).lower() else "connection reset"
    except aiohttp.ClientError as exc:
        error = type(exc).__name__
    if error is None:
        if status != 200:
            error = f"HTTP {status}"
        elif stream and errors:
            error = "error event in stream"
        elif stream and not done:
            error = "stream ended without [DONE]"
    return {"index": index, "started": t0, "latency": time.monotonic() - t0, "ttfb": ttfb,
            "status": status, "error": error, "size": size, "events": events, "gaps": gaps}


async def _run(args: argparse.Namespace, bodies: list[bytes]) -> list[dict]:
    import aiohttp

    url = f"http://{args.host}:{args.port}{args.path}"
    connector = aiohttp.TCPConnector(limit=args.concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        return await run_workers(
            lambda index: _one(session, url, bodies[index], index, args.stream, args.timeout,
                               args.record_gaps),
            len(bodies), args.concurrency)


def main(argv: list[str] | None = None) -> int:
    args = parse_args("python bench/_aiohttp_load.py", argv)
    bodies = read_bodies(args.bodies)
    return report(lambda: _run(args, bodies))


if __name__ == "__main__":
    sys.exit(main())
