"""What a connection class costs per request: Hypercorn's ``TCPServer`` against ``_serve/server``'s.

    python -m bench.server_cost                          # both modes, 3 rounds
    python -m bench.server_cost --mode churn --requests 3000

Each variant serves a bare ASGI app (a 200 with a 2-byte body, the shape of a non-stream reply)
on Hypercorn's trio worker in a process of its own; the load is one of:

- ``keepalive``: ``--concurrency`` kept-alive connections (``bench._epoll_load``, head and body
  in two sends as httpx writes them);
- ``churn``: a new connection per request, closed by the client after the answer (what clients
  without a pool, health checkers and bursts of new clients do).

Variants: ``hypercorn`` (its own ``TCPServer``), ``epd_trio`` (``_server.ProxyTCPServer``: idle
timer on the read, no send_eof after the client's close, lock without a scheduling round, no
empty write) and ``epd_trio-idle`` (the same with Hypercorn's ``protocol_send`` write path: the
idle-timer and close changes alone). The rounds interleave the variants; the figure is the
serving process's CPU (user + system, /proc) per request. docs/contributing/hypercorn-patches.md
has the results.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import threading
from typing import Any

import trio

from bench._epoll_load import run_load_epoll
from bench.burst import process_tree_cpu

VARIANTS = ("hypercorn", "epd_trio", "epd_trio-idle")


async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            await send({"type": message["type"] + ".complete"})
            if message["type"] == "lifespan.shutdown":
                return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"{}"})


def _server_class(variant: str) -> Any:
    from hypercorn.events import RawData
    from hypercorn.trio.tcp_server import TCPServer

    from epd_trio._serve.server import ProxyTCPServer

    if variant == "hypercorn":
        return None
    if variant == "epd_trio":
        return ProxyTCPServer

    class IdleOnly(ProxyTCPServer):
        """The idle-timer and close changes, with Hypercorn's write path."""

        async def protocol_send(self, event: Any) -> None:
            if isinstance(event, RawData):
                await TCPServer.protocol_send(self, event)
            else:
                await ProxyTCPServer.protocol_send(self, event)

    return IdleOnly


def serve(variant: str) -> None:
    from hypercorn.trio import run as hypercorn_run
    from hypercorn.utils import wrap_app

    from epd_trio._serve.server import ProxyWorkerContext, _rebound
    from epd_trio._serve.serving import listening_sockets, quiet_config

    cls = _server_class(variant)
    worker_serve = (hypercorn_run.worker_serve if cls is None else _rebound(
        hypercorn_run.worker_serve, TCPServer=cls, WorkerContext=ProxyWorkerContext))
    config = quiet_config()

    async def main() -> None:
        sockets = listening_sockets(config)
        port = sockets.insecure_sockets[0].getsockname()[1]
        print(f"port={port}", flush=True)
        await worker_serve(wrap_app(_app, config.wsgi_max_body_size, None), config,
                           sockets=sockets)

    trio.run(main)


def churn(port: int, requests: int, threads: int) -> None:
    """``requests`` requests, each on a new connection the client closes after the answer."""
    body = b"{}"
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\ncontent-type: "
            f"application/json\r\ncontent-length: {len(body)}\r\n\r\n").encode()
    left = [requests]
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                if left[0] <= 0:
                    return
                left[0] -= 1
            with socket.create_connection(("127.0.0.1", port)) as sock:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.sendall(head)
                sock.sendall(body)
                answer = b""
                while not answer.endswith(b"{}"):
                    data = sock.recv(65536)
                    if not data:
                        raise RuntimeError(f"closed early: {answer!r}")
                    answer += data

    pool = [threading.Thread(target=worker) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()


def measure(variant: str, mode: str, args: argparse.Namespace) -> float:
    """The serving process's CPU ms per request for one variant and mode."""
    process = subprocess.Popen([sys.executable, "-m", "bench.server_cost", "--serve", variant],
                               stdout=subprocess.PIPE)
    try:
        assert process.stdout is not None
        port = int(process.stdout.readline().decode().strip().split("=")[1])
        load = (lambda n: churn(port, n, args.threads)) if mode == "churn" else (
            lambda n: run_load_epoll("127.0.0.1", port, "/v1/chat/completions",
                                     lambda i: b"{}", requests=n, concurrency=args.concurrency,
                                     stream=False, request_timeout=30, split_head=True))
        load(200)  # warm-up
        cpu0 = process_tree_cpu(process.pid)
        load(args.requests)
        return (process_tree_cpu(process.pid) - cpu0) * 1000 / args.requests
    finally:
        process.terminate()
        process.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.server_cost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--serve", choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=("keepalive", "churn", "both"), default="both")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--concurrency", type=int, default=64, help="keepalive mode")
    p.add_argument("--threads", type=int, default=8, help="churn mode: clients at once")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    if args.serve:
        serve(args.serve)
        return 0
    variants = [v for v in args.variants.split(",") if v]
    modes = ("keepalive", "churn") if args.mode == "both" else (args.mode,)
    figures: dict[tuple[str, str], list[float]] = {}
    for r in range(args.rounds):
        for mode in modes:
            order = variants[r % len(variants):] + variants[:r % len(variants)]
            for variant in order:
                figures.setdefault((mode, variant), []).append(measure(variant, mode, args))
    print(f"server CPU ms per request, {args.requests} requests x {args.rounds} rounds "
          "(range over rounds; ratio to hypercorn per round)")
    for mode in modes:
        base = figures.get((mode, "hypercorn"))
        for variant in variants:
            values = figures[(mode, variant)]
            line = f"  {mode:<10}{variant:<16}{min(values):.3f}-{max(values):.3f} ms"
            if base and variant != "hypercorn":
                ratios = [v / b for v, b in zip(values, base, strict=True)]
                line += f"   x{min(ratios):.2f}-{max(ratios):.2f}"
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
