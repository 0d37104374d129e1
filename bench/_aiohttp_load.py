"""The load as an aiohttp program writes it: ``bench.compare --client aiohttp``.

Why: the issue's independent measurement drove the proxies with aiohttp, and real clients do
not write a request the way ``bench._epoll_load`` does (head and body in one ``send``). This is
a plain ``aiohttp.ClientSession`` on asyncio's default loop, as an application would use it:
``concurrency`` tasks, each posting its next request when the previous answer is complete, over
one connector with ``limit=concurrency`` (so each task keeps its connection alive).

It runs as a separate process under a Python that has aiohttp (``--aiohttp-python``; by default
the EPD proxy's reference venv, which has it): aiohttp is no dependency of epd_trio. Standard
library and aiohttp only, so it runs in that venv. Input: one request body per line in
``--bodies``. Output on stdout: one JSON object, ``{"cpu": seconds, "results": [...]}``, each
result with the fields of ``bench._load.Result``; ``cpu`` is this process's CPU during the load
only (its start-up and imports excluded).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time


def _cpu() -> float:
    times = os.times()
    return times.user + times.system


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
    results: list[dict] = []
    next_index = iter(range(len(bodies)))
    connector = aiohttp.TCPConnector(limit=args.concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def worker() -> None:
            for index in next_index:
                results.append(await _one(session, url, bodies[index], index, args.stream,
                                          args.timeout, args.record_gaps))

        await asyncio.gather(*(worker() for _ in range(min(args.concurrency, len(bodies)))))
    return sorted(results, key=lambda r: r["index"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python bench/_aiohttp_load.py")
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--path", required=True)
    p.add_argument("--bodies", required=True, help="a file with one request body per line")
    p.add_argument("--concurrency", type=int, required=True)
    p.add_argument("--stream", action="store_true")
    p.add_argument("--record-gaps", action="store_true")
    p.add_argument("--timeout", type=float, default=120.0)
    args = p.parse_args(argv)
    with open(args.bodies, "rb") as f:
        bodies = f.read().splitlines()
    cpu0 = _cpu()
    results = asyncio.run(_run(args, bodies))
    json.dump({"cpu": _cpu() - cpu0, "results": results}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
