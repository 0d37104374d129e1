"""Command line: ``epd-trio demo`` (or ``python -m epd_trio demo``).

``demo`` starts an embedded fake cluster (3 encoders, 2 prefill x DP2, 2 decode x DP2) and the
real proxy on a local port, prints a ready-to-paste ``curl``, and serves until Ctrl-C.
``demo --check`` instead sends a few requests through it, prints where each leg went, and exits
(non-zero if any request failed): a one-command smoke test of an installation.
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import sys
from collections.abc import Sequence

import httpx
import trio

from .testing.cluster import Cluster, run_cluster
from .testing.media import png_data_url


def _sample_body(seed: int, *, stream: bool) -> dict[str, object]:
    return {
        "model": "fake-model",
        "stream": stream,
        "max_tokens": 8,
        "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": png_data_url(seed=seed)}},
            {"type": "text", "text": "What is in this image?"},
        ]}],
    }


def _curl(url: str) -> str:
    body = json.dumps(_sample_body(0, stream=True))
    return (f"curl -N {url}/v1/chat/completions -H 'content-type: application/json' "
            f"-d {shlex.quote(body)}")


def _describe(cluster: Cluster) -> str:
    def role(name: str, fakes: list, dp: int) -> str:
        urls = ", ".join(f.url for f in fakes)
        return f"  {name:<8} {len(fakes)} x DP{dp}: {urls}"

    s = cluster.settings
    return "\n".join([
        f"epd_trio demo: proxy on {cluster.proxy_url} (layout {s.layout}, fake vLLM backends)",
        role("encode", cluster.encoders, 1),
        role("prefill", cluster.prefills, s.prefill_urls[0].dp_size),
        role("decode", cluster.decodes, s.decode_urls[0].dp_size),
    ])


async def _check(cluster: Cluster, count: int) -> bool:
    ok = True
    async with httpx.AsyncClient(timeout=30, trust_env=False) as client:
        for n in range(count):
            stream = n % 2 == 1
            rid = f"demo-{n}"
            r = await client.post(cluster.proxy_url + "/v1/chat/completions",
                                  json=_sample_body(n, stream=stream),
                                  headers={"x-request-id": rid})
            legs = []
            for label, fakes in (("E", cluster.encoders), ("P", cluster.prefills),
                                 ("D", cluster.decodes)):
                for i, fake in enumerate(fakes):
                    for rec in fake.requests():
                        if rec.request_id and rec.request_id.startswith(rid):
                            rank = "" if rec.rank is None else f" rank {rec.rank}"
                            legs.append(f"{label}{i}{rank}")
            good = r.status_code == 200 and (not stream or r.text.endswith("data: [DONE]\n\n"))
            ok &= good
            kind = "stream" if stream else "json"
            print(f"  request {n} ({kind}): HTTP {r.status_code} via {' -> '.join(legs)}"
                  + ("" if good else f"  FAILED: {r.text[:200]}"))
    return ok


async def _demo(args: argparse.Namespace) -> int:
    async with run_cluster(encoders=3, prefills=2, prefill_dp=2, decodes=2, decode_dp=2,
                           host=args.host, proxy_port=args.port) as cluster:
        print(_describe(cluster), flush=True)
        if args.check:
            ok = await _check(cluster, args.check)
            print("demo check: " + ("all requests succeeded" if ok else "FAILED"))
            return 0 if ok else 1
        print("\nTry a multimodal streaming request:\n\n" + _curl(cluster.proxy_url)
              + "\n\nCtrl-C stops the demo.", flush=True)
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for _ in signals:
                break
    print("epd_trio demo: stopped")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="epd-trio", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="run the proxy on an embedded fake EPD cluster")
    demo.add_argument("--host", default="127.0.0.1")
    demo.add_argument("--port", type=int, default=8000, help="proxy port (0 = any free port)")
    demo.add_argument("--check", type=int, nargs="?", const=6, default=0, metavar="N",
                      help="send N requests (default 6), print their routes and exit")
    args = parser.parse_args(argv)
    try:
        return trio.run(_demo, args)
    except OSError as exc:
        print(f"epd-trio: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
