"""Run fake vLLM servers.

    python -m epd_trio.testing --role decode --port 8200 --dp 2     one server
    python -m epd_trio.testing --cluster 3,2x2,2x2                  encoders, prefills x DP, decodes x DP
    python -m epd_trio.testing --role decode --dp 4 --sim --max-num-seqs 8   a simulated engine

``--sim`` answers through the simulated batch engine (``epd_trio.testing.sim_engine``: batches of
``--max-num-seqs`` per rank, step times, prefix and encoder caches, vLLM's load gauges on
``GET /metrics``); its other flags are that engine's parameters.

``--cluster`` starts a whole fake EPD cluster in this process on free ports and prints one
``EPD_ENCODE_URLS=...`` / ``EPD_PREFILL_URLS=...`` / ``EPD_DECODE_URLS=...`` line per role
(``#dp=N`` included), then ``ready``. Every server answers ``GET /fake/stats``.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence
from dataclasses import fields

import trio

from .fake_vllm import ROLES, Behaviour, FakeVLLM, Role
from .sim_engine import EngineConfig, SimEngine


def parse_cluster(spec: str) -> list[tuple[Role, int, int]]:
    """``"3,2x2,2x2"`` -> [("encode", 3, 1), ("prefill", 2, 2), ("decode", 2, 2)].

    A prefill count of 0 makes the decodes ``prefill_decode`` instances (the E+PD / PD layouts).
    """
    parts = spec.split(",")
    if len(parts) != 3:
        raise argparse.ArgumentTypeError("expected ENCODERS,PREFILLSxDP,DECODESxDP")
    out: list[tuple[int, int]] = []
    for part in parts:
        count, _, dp = part.partition("x")
        if not count.isdigit() or (dp and not dp.isdigit()) or (dp and int(dp) < 1):
            raise argparse.ArgumentTypeError(f"bad cluster part {part!r}")
        out.append((int(count), int(dp or 1)))
    (e, _), (p, p_dp), (d, d_dp) = out
    if d < 1:
        raise argparse.ArgumentTypeError("a cluster needs at least one decode")
    decode_role: Role = "decode" if p else "prefill_decode"
    return [("encode", e, 1), ("prefill", p, p_dp), (decode_role, d, d_dp)]


async def _run(args: argparse.Namespace) -> None:
    behaviour = Behaviour(latency=args.latency, chunk_delay=args.chunk_delay, tokens=args.tokens,
                          profiler=args.profiler)
    async with trio.open_nursery() as nursery:
        if args.cluster:
            for role, count, dp in args.cluster:
                urls = []
                for _ in range(count):
                    fake = FakeVLLM(role=role, dp_size=dp, model=args.model, behaviour=behaviour,
                                    api_key=args.api_key, engine=_engine(args, dp))
                    url = await nursery.start(fake.serve, args.host)
                    urls.append(f"{url}#dp={dp}" if dp > 1 else url)
                name = {"encode": "ENCODE", "prefill": "PREFILL"}.get(role, "DECODE")
                print(f"EPD_{name}_URLS={','.join(urls)}", flush=True)
            print("ready", flush=True)
        else:
            fake = FakeVLLM(role=args.role, dp_size=args.dp, model=args.model,
                            behaviour=behaviour, api_key=args.api_key,
                            engine=_engine(args, args.dp))
            url = await nursery.start(fake.serve, args.host, args.port)
            print(f"fake vLLM {args.role} (DP{args.dp}, model {args.model!r}) on {url}",
                  flush=True)
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for _ in signals:
                break
        nursery.cancel_scope.cancel()


def _engine(args: argparse.Namespace, dp: int) -> SimEngine | None:
    if not args.sim:
        return None
    config = EngineConfig(**{f.name: getattr(args, f.name) for f in fields(EngineConfig)})
    return SimEngine(config, dp)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m epd_trio.testing", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--role", choices=ROLES, default="decode")
    parser.add_argument("--cluster", type=parse_cluster, metavar="E,PxDP,DxDP",
                        help="a whole fake cluster instead of one server")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 = any free port (printed)")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel size (rank check)")
    parser.add_argument("--model", default="fake-model")
    parser.add_argument("--tokens", type=int, default=8, help="tokens per answer")
    parser.add_argument("--latency", type=float, default=0.0, help="seconds before answering")
    parser.add_argument("--chunk-delay", type=float, default=0.0, help="seconds between chunks")
    parser.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 (vLLM's "
                        "--api-key)")
    parser.add_argument("--profiler", action="store_true",
                        help="serve /start_profile and /stop_profile (else they are 404)")
    parser.add_argument("--sim", action="store_true",
                        help="answer through the simulated batch engine (the flags below)")
    defaults = EngineConfig()
    for f in fields(EngineConfig):
        default = getattr(defaults, f.name)
        parser.add_argument("--" + f.name.replace("_", "-"), type=type(default),
                            default=default, help=f"--sim: {f.name} (default {default})")
    trio.run(_run, parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
