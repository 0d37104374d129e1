"""Three proxy replicas side by side: sharing nothing, sharing through Redis, and with the global
cursor; in one run, on the lean fakes.

    python -m bench.replicas                              # the figures in docs/how-to/replicas.md
    python -m bench.replicas --requests 3000 --rounds 3 --stream --max-tokens 16

One invocation starts the lean fake backends (``bench.lean_fake``: headers first, one write per
token, spaced in time) and a ``redis-server`` (Debian's package, no persistence, on a free
loopback port; or ``--state-url``) once. Then, for each round and each mode (the order rotates
from round to round), it starts three ``epd-trio serve --workers 1`` processes, sends the same
load through them (one epoll load thread per replica, each with a third of the requests and of
the concurrency, as a Service spreads connections) and stops them. The modes:

- ``local``: no ``EPD_STATE_URL``: three proxies that share nothing (the reference);
- ``shared``: ``EPD_STATE_URL`` set, per-replica cursors (random start offsets): the roster,
  the loads and the registrations shared;
- ``global``: ``shared`` plus ``EPD_GLOBAL_CURSOR=true``: one Redis ``INCRBY`` per routing
  decision.

Measured per mode and round: the three proxies' CPU (user + system of their process trees, from
/proc) per request, the ratio to ``local`` in the same round, the requests' spread over the
instances of each stage (most over fewest, from the replicas' own ``/metrics``; 1.00 is an
exact split), and, in ``shared``, how long a registration made at one replica takes to be listed
by all three (``--registrations`` of them, each at the next replica in turn: p50 and p99).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import trio
from prometheus_client.parser import text_string_to_metric_families

from bench._epoll_load import run_load_epoll
from bench._load import Result
from bench.burst import make_body_factory, percentile, process_tree_cpu
from bench.compare import free_port, start_backends, stop, wait_ready
from bench.lean_fake import DEFAULT_PREFILL_TIME, DEFAULT_TOKEN_INTERVAL
from epd_trio.testing.redis_server import RedisServer

CHAT = "/v1/chat/completions"
MODES = ("local", "shared", "global")
REPLICAS = 3
ADMIN_KEY = "bench-replicas"
ADMIN = {"x-api-key": ADMIN_KEY}
#: The label naming an upstream in the proxy's metrics, whichever this version uses.
UPSTREAM_LABELS = ("upstream", "worker", "instance")


@contextmanager
def redis_url(given: str | None) -> Iterator[str]:
    if given:
        yield given
        return
    server = RedisServer().start()
    try:
        yield server.url
    finally:
        server.kill()


def replica_env(mode: str, state_url: str, fleet: str, index: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPD_")}
    env.update(PYTHONUNBUFFERED="1", EPD_ADMIN_KEY=ADMIN_KEY)
    if mode != "local":
        env.update(EPD_STATE_URL=state_url, EPD_STATE_PREFIX=fleet,
                   EPD_REPLICA_ID=f"replica-{index}")
    if mode == "global":
        env["EPD_GLOBAL_CURSOR"] = "true"
    return env


@asynccontextmanager
async def fleet(args: argparse.Namespace, mode: str, backends: Any, state_url: str,
                logdir: Path) -> Any:
    """Three replicas of ``mode``; yields their (process, URL) pairs, ready."""
    prefix = f"bench{uuid.uuid4().hex[:8]}:"
    async with AsyncExitStack() as stack:
        started = []
        for index in range(REPLICAS):
            port = free_port()
            cmd = [sys.executable, "-m", "epd_trio", "serve", "--host", "127.0.0.1", "--port",
                   str(port), "--workers", "1"]
            for role, urls in (("encode", backends.encode), ("prefill", backends.prefill),
                               ("decode", backends.decode)):
                if urls:
                    cmd += [f"--{role}", *urls]
            log = logdir / f"{mode}-{index}.log"
            with open(log, "wb") as out:  # noqa: ASYNC230 (a local file, opened once)
                process = await trio.lowlevel.open_process(
                    cmd, stdout=out, stderr=subprocess.STDOUT,
                    env=replica_env(mode, state_url, prefix, index))
            stack.push_async_callback(stop, process)
            url = f"http://127.0.0.1:{port}"
            await wait_ready(process, url + "/ready", log)
            started.append((process, url))
        yield started


def upstream_counts(texts: list[str]) -> dict[tuple[str, str], float]:
    """Upstream calls per (role, instance), added up over the replicas' scrapes."""
    counts: dict[tuple[str, str], float] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name != "epd_trio_upstream_requests_total":
                    continue
                label = next((sample.labels[k] for k in UPSTREAM_LABELS if k in sample.labels),
                             None)
                if label is None:
                    continue
                key = (sample.labels["role"], label)
                counts[key] = counts.get(key, 0.0) + sample.value
    return counts


def fallbacks(texts: list[str]) -> float:
    """Routing decisions that fell back from the global cursor to a replica's own."""
    return sum(sample.value for text in texts for family in text_string_to_metric_families(text)
               for sample in family.samples
               if sample.name == "epd_trio_global_cursor_fallbacks_total")


def spreads(counts: dict[tuple[str, str], float], backends: Any) -> dict[str, float | None]:
    """Most requests on one instance over fewest, per role (None: fewer than two instances)."""
    out: dict[str, float | None] = {}
    for role, urls in (("encode", backends.encode), ("prefill", backends.prefill),
                       ("decode", backends.decode)):
        values = [counts.get((role, url), 0.0) for url in urls]
        out[role] = (max(values) / min(values) if len(values) > 1 and min(values) > 0
                     else None if len(values) < 2 else float("inf"))
    return out


async def convergence(urls: list[str], count: int) -> list[float]:
    """Seconds from ``POST /instances`` at one replica until every replica lists it."""
    headers = {"x-api-key": ADMIN_KEY}
    times = []
    async with httpx.AsyncClient(trust_env=False, timeout=10) as client:
        for n in range(count):
            target = f"http://127.0.0.1:{40000 + n}"  # never called: the roster is measured
            started = time.monotonic()
            r = await client.post(urls[n % len(urls)] + "/instances", headers=headers,
                                  json={"role": "encode", "url": target})
            r.raise_for_status()
            pending = set(urls)
            with trio.fail_after(30):
                while pending:
                    for url in list(pending):
                        listing = (await client.get(url + "/instances", headers=headers)).json()
                        if any(e["url"] == target for e in listing["instances"]["encode"]):
                            pending.discard(url)
                    if pending:
                        await trio.sleep(0.002)
            times.append(time.monotonic() - started)
            r = await client.request("DELETE", urls[n % len(urls)] + "/instances",
                                     headers=headers, params={"url": target})
            r.raise_for_status()
    return times


async def measure(args: argparse.Namespace, mode: str, backends: Any, state_url: str,
                  logdir: Path) -> dict[str, Any]:
    make_body = make_body_factory(args.images, args.stream, args.max_tokens, args.model)
    async with fleet(args, mode, backends, state_url, logdir) as replicas:

        async def load(url: str, requests: int, concurrency: int, out: list[Result]) -> None:
            host, port = url.removeprefix("http://").rsplit(":", 1)
            out.extend(await trio.to_thread.run_sync(partial(
                run_load_epoll, host, int(port), CHAT, make_body, requests=requests,
                concurrency=concurrency, stream=args.stream, request_timeout=args.timeout)))

        async def everywhere(requests: int, concurrency: int) -> list[Result]:
            results: list[Result] = []
            async with trio.open_nursery() as nursery:
                for _, url in replicas:
                    nursery.start_soon(load, url, requests // REPLICAS,
                                       max(1, concurrency // REPLICAS), results)
            return results

        await everywhere(args.warmup, min(args.concurrency, 24))
        async with httpx.AsyncClient(trust_env=False, timeout=10) as client:
            before = [(await client.get(url + "/metrics", headers=ADMIN)).text for _, url in replicas]
        cpu0 = sum(process_tree_cpu(p.pid) for p, _ in replicas)
        t0 = time.monotonic()
        results = await everywhere(args.requests, args.concurrency)
        wall = time.monotonic() - t0
        cpu = sum(process_tree_cpu(p.pid) for p, _ in replicas) - cpu0
        async with httpx.AsyncClient(trust_env=False, timeout=10) as client:
            after = [(await client.get(url + "/metrics", headers=ADMIN)).text for _, url in replicas]
        counts = upstream_counts(after)
        for key, value in upstream_counts(before).items():
            counts[key] = counts.get(key, 0.0) - value
        ok = [r for r in results if r.error is None]
        report: dict[str, Any] = {
            "requests": len(results), "ok": len(ok), "wall_seconds": wall,
            "proxy_cpu_ms_per_request": cpu * 1000 / max(len(results), 1),
            "latency_p50_ms": _ms(percentile(sorted(r.latency for r in ok), 50)),
            "latency_p99_ms": _ms(percentile(sorted(r.latency for r in ok), 99)),
            "spread": spreads(counts, backends),
            "global_cursor_fallbacks": fallbacks(after) - fallbacks(before),
        }
        if mode == "shared" and args.registrations:
            times = sorted(await convergence([url for _, url in replicas], args.registrations))
            report["convergence_ms"] = {"p50": _ms(percentile(times, 50)),
                                        "p99": _ms(percentile(times, 99)),
                                        "max": _ms(times[-1])}
        return report


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


async def run(args: argparse.Namespace) -> dict[str, Any]:
    fakes, backends, described = await start_backends(args)
    try:
        with redis_url(args.state_url) as state_url, \
                tempfile.TemporaryDirectory(prefix="epd-replicas-") as tmp:
            rounds = []
            for index in range(args.rounds):
                modes = list(args.modes[index % len(args.modes):]) + list(
                    args.modes[:index % len(args.modes)])
                by_mode = {}
                for mode in modes:
                    print(f"round {index + 1}/{args.rounds}: {mode} ...", file=sys.stderr,
                          flush=True)
                    by_mode[mode] = await measure(args, mode, backends, state_url, Path(tmp))
                rounds.append(by_mode)
        return {"config": {k: v for k, v in vars(args).items() if k != "json"},
                "backends": described, "rounds": rounds}
    finally:
        await stop(fakes)


def render(report: dict[str, Any]) -> str:
    rounds = report["rounds"]
    modes = [m for m in MODES if all(m in r for r in rounds)]
    lines = [f"3 replicas x --workers 1 on {report['backends']}; "
             f"{report['config']['requests']} requests per mode and round, concurrency "
             f"{report['config']['concurrency']}, stream={report['config']['stream']}, "
             f"{report['config']['images']} image(s) per request", "",
             "| mode | proxy CPU ms/request (3 replicas) | vs local, same round | latency p50 / "
             "p99 ms | spread E / P / D (max/min) | global cursor fallbacks | failed |",
             "|---|---|---|---|---|---|---|"]

    def span(values: list[float | None], digits: int = 2) -> str:
        found = [v for v in values if v is not None]
        if not found:
            return "-"
        low, high = min(found), max(found)
        return f"{low:.{digits}f}" if round(low, digits) == round(high, digits) else (
            f"{low:.{digits}f}-{high:.{digits}f}")

    for mode in modes:
        runs = [r[mode] for r in rounds]
        ratios = [r[mode]["proxy_cpu_ms_per_request"] / r["local"]["proxy_cpu_ms_per_request"]
                  for r in rounds if "local" in r]
        spread = " / ".join(span([run["spread"][role] for run in runs])
                            for role in ("encode", "prefill", "decode"))
        lines.append(
            f"| {mode} | {span([run['proxy_cpu_ms_per_request'] for run in runs], 3)} | "
            f"x{span(ratios)} | {span([run['latency_p50_ms'] for run in runs], 1)} / "
            f"{span([run['latency_p99_ms'] for run in runs], 1)} | {spread} | "
            f"{span([run['global_cursor_fallbacks'] for run in runs], 0)} | "
            f"{sum(run['requests'] - run['ok'] for run in runs)} |")
    shared = [r["shared"]["convergence_ms"] for r in rounds
              if "shared" in r and "convergence_ms" in r["shared"]]
    if shared:
        lines += ["", "registration convergence (POST at one replica until all 3 list it): "
                  f"p50 {span([c['p50'] for c in shared], 1)} ms, p99 "
                  f"{span([c['p99'] for c in shared], 1)} ms, max "
                  f"{span([c['max'] for c in shared], 1)} ms"]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.replicas", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", type=lambda s: [m.strip() for m in s.split(",") if m.strip()],
                   default=list(MODES), help="comma-separated, of: " + ", ".join(MODES))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--warmup", type=int, default=300)
    p.add_argument("--concurrency", type=int, default=48)
    p.add_argument("--stream", action="store_true")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--images", type=int, default=1, help="images per request (E->P->D)")
    p.add_argument("--encoders", type=int, default=3)
    p.add_argument("--prefills", type=int, default=2)
    p.add_argument("--decodes", type=int, default=2)
    p.add_argument("--token-interval", type=float, default=DEFAULT_TOKEN_INTERVAL)
    p.add_argument("--prefill-time", type=float, default=DEFAULT_PREFILL_TIME)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--model", default="fake-model")
    p.add_argument("--registrations", type=int, default=100,
                   help="registrations timed for the convergence figure (shared mode)")
    p.add_argument("--state-url", help="a Redis to use (default: a redis-server started here)")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    unknown = set(args.modes) - set(MODES)
    if unknown:
        p.error(f"unknown mode(s): {', '.join(sorted(unknown))}")
    # What bench.compare's start_backends reads.
    args.layout = "epd" if args.images else "pd"
    args.rest_cpus = None
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = trio.run(run, args)
    print(render(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    failed = sum(run["requests"] - run["ok"] for r in report["rounds"] for run in r.values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
