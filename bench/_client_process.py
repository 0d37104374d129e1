"""What the client processes of ``bench.compare`` share (``_aiohttp_load``, ``_openai_load``).

Why a module of its own: each client runs as a script under another Python (the one that has
its client library), so it can import only the standard library and its neighbours in
``bench/`` (a script's folder is first on ``sys.path``), not ``bench._load``. Standard library
only. The command line, the bodies file, ``concurrency`` workers over one shared queue of
request indices, and the report on stdout are the same for every client; only one request's
call differs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Awaitable, Callable

#: One request: its index in, its result (the fields of ``bench._load.Result``) out.
Call = Callable[[int], Awaitable[dict]]


def parse_args(prog: str, argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog)
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--path", required=True)
    p.add_argument("--bodies", required=True, help="a file with one request body per line")
    p.add_argument("--concurrency", type=int, required=True)
    p.add_argument("--stream", action="store_true")
    p.add_argument("--record-gaps", action="store_true")
    p.add_argument("--timeout", type=float, default=120.0)
    return p.parse_args(argv)


def read_bodies(path: str) -> list[bytes]:
    with open(path, "rb") as f:
        return f.read().splitlines()


async def run_workers(call: Call, requests: int, concurrency: int) -> list[dict]:
    """``call`` for every index, ``concurrency`` at a time (each worker takes the next index
    when its previous answer is complete); the results in index order."""
    results: list[dict] = []
    next_index = iter(range(requests))

    async def worker() -> None:
        for index in next_index:
            results.append(await call(index))

    await asyncio.gather(*(worker() for _ in range(min(concurrency, requests))))
    return sorted(results, key=lambda r: r["index"])


def report(load: Callable[[], Awaitable[list[dict]]]) -> int:
    """Run ``load`` on asyncio's default loop and print ``{"cpu": s, "results": [...]}``, the
    CPU being this process's during the load only."""
    cpu0 = _cpu()
    results = asyncio.run(load())
    json.dump({"cpu": _cpu() - cpu0, "results": results}, sys.stdout)
    return 0


def _cpu() -> float:
    times = os.times()
    return times.user + times.system
