"""Run one fake vLLM server: ``python -m epd_trio.testing --role decode --port 8200 --dp 2``."""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence

import trio

from .fake_vllm import ROLES, Behaviour, FakeVLLM


async def _run(args: argparse.Namespace) -> None:
    fake = FakeVLLM(role=args.role, dp_size=args.dp, model=args.model,
                    behaviour=Behaviour(latency=args.latency, chunk_delay=args.chunk_delay,
                                        tokens=args.tokens))
    async with trio.open_nursery() as nursery:
        url = await nursery.start(fake.serve, args.host, args.port)
        print(f"fake vLLM {args.role} (DP{args.dp}, model {args.model!r}) on {url}", flush=True)
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for _ in signals:
                break
        nursery.cancel_scope.cancel()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m epd_trio.testing", description=__doc__)
    parser.add_argument("--role", choices=ROLES, default="decode")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 = any free port (printed)")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel size (rank check)")
    parser.add_argument("--model", default="fake-model")
    parser.add_argument("--tokens", type=int, default=8, help="tokens per answer")
    parser.add_argument("--latency", type=float, default=0.0, help="seconds before answering")
    parser.add_argument("--chunk-delay", type=float, default=0.0, help="seconds between chunks")
    trio.run(_run, parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
