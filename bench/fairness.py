"""Fair admission under a flood: an interactive tenant beside a batch tenant (issue 32).

    python -m bench.fairness                       # the figures in docs/how-to/fair-admission.md
    python -m bench.fairness --duration 10 --replicas 1 --modes fair

One invocation starts the lean fake backends (``bench.lean_fake``: headers first, one write per
token, spaced in time; it has no concurrency limit of its own, so the proxy's
``EPD_MAX_INFLIGHT`` is the capacity) and, for the 3-replica runs, a ``redis-server`` (no
persistence, a free loopback port). For each replica count and mode it starts that many
``epd-trio serve --workers 1`` processes and runs three phases of ``--duration`` seconds:

1. **capacity**: the batch tenant alone, a closed loop of ``--flood`` x the fleet's places in
   concurrent requests (it keeps every place busy and a queue ten times as deep waiting):
   its throughput is the fleet's capacity, in requests a second;
2. **idle**: the interactive tenant alone, open loop, one request every
   ``1 / (--share x capacity)`` seconds: its latency on a proxy with nothing else to do;
3. **flood**: both at once.

Reported per run: the interactive tenant's p50 / p99 latency in the flood and idle, their
ratio (done when p99 stays within 2x), its rejections (non-200 answers), and the batch tenant's
share of the remaining capacity (its flood throughput over capacity minus the interactive
throughput; 1.0 is work-conserving: no place idle while a batch request waits).

Modes: ``fair``: two tenants (``interactive`` at priority 0, ``batch`` at priority 1, both with
a large ``requests_per_minute`` so that, with Redis, every admission runs the shared script);
``fifo``: no tenants, today's single cap and line (the reference). Requests are non-stream
chat completions: the interactive tenant's of ``--max-tokens`` tokens, the batch tenant's of
``--batch-max-tokens`` (one count, or a range ``LOW-HIGH`` drawn uniformly per request;
by default 5-15, the interactive length's mean; 10 gives the lockstep case below).

Why a range for the batch: the fake answers exactly ``max_tokens`` tokens, and its engine steps
every stream at once, as vLLM's does. Batch requests of one length that started together then
finish in the same step, and the proxy refills their places in the same instant, so the flood
stays in lockstep: every place of a replica frees within a few ms once per service time, and an
interactive request waits for that one moment, uniformly up to a whole service time, however
many places there are. Real completions stop at their end-of-sequence token, at lengths that
differ, which spreads the frees; ``5-15`` keeps the mean (10) and so the capacity.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import httpx
import orjson
import trio

from bench.burst import percentile
from bench.compare import free_port, start_backends, stop, wait_ready
from epd_trio._admission.fair import FairAdmission
from epd_trio._admission.gate import Admission
from epd_trio._core.config import Settings
from epd_trio._core.counters import CursorCounters
from epd_trio._core.tenants import TenantTable, parse_tenants
from epd_trio._observe.metrics import ProxyMetrics
from epd_trio._replicas.limits import SharedLimits
from epd_trio._replicas.roster import ReplicatedRoster
from epd_trio._replicas.sync import StateLink
from epd_trio._state.loads import Loads, LocalLoadTable
from epd_trio.testing.redis_server import RedisServer

CHAT = "/v1/chat/completions"
MODES = ("fair", "fifo")
KEYS = {"interactive": "sk-bench-interactive", "batch": "sk-bench-batch"}
#: Large enough never to refuse: the limit is there so that each admission runs the script.
PER_MINUTE = 10_000_000
TENANTS = {"interactive": {"keys": [KEYS["interactive"]], "priority": 0,
                           "requests_per_minute": PER_MINUTE},
           "batch": {"keys": [KEYS["batch"]], "priority": 1, "requests_per_minute": PER_MINUTE}}


@contextmanager
def redis_url(needed: bool) -> Iterator[str | None]:
    if not needed:
        yield None
        return
    with RedisServer() as server:
        yield server.url


def replica_env(args: argparse.Namespace, mode: str, state_url: str | None, prefix: str,
                index: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPD_")}
    env.update(PYTHONUNBUFFERED="1", EPD_MAX_INFLIGHT=str(args.capacity),
               EPD_ADMISSION_TIMEOUT=str(args.admission_timeout))
    if mode == "fair":
        env.update(EPD_TENANTS=orjson.dumps(TENANTS).decode(),
                   EPD_PRIORITY_AGING=str(args.aging),
                   EPD_PRIORITY_HEADROOM=str(args.headroom))
    else:
        env["EPD_API_KEYS"] = ",".join(KEYS.values())
    if state_url is not None:
        env.update(EPD_STATE_URL=state_url, EPD_STATE_PREFIX=prefix,
                   EPD_REPLICA_ID=f"replica-{index}")
    return env


@asynccontextmanager
async def fleet(args: argparse.Namespace, mode: str, replicas: int, backends: Any,
                state_url: str | None, logdir: Path) -> Any:
    """``replicas`` proxies of ``mode``; yields their URLs, ready."""
    prefix = f"fair{uuid.uuid4().hex[:8]}:"
    async with AsyncExitStack() as stack:
        urls = []
        for index in range(replicas):
            port = free_port()
            cmd = [sys.executable, "-m", "epd_trio", "serve", "--host", "127.0.0.1", "--port",
                   str(port), "--workers", "1", "--decode", *backends.decode]
            log = logdir / f"{mode}-{replicas}-{index}.log"
            with open(log, "wb") as out:  # noqa: ASYNC230 (a local file, opened once)
                process = await trio.lowlevel.open_process(
                    cmd, stdout=out, stderr=subprocess.STDOUT,
                    env=replica_env(args, mode, state_url, prefix, index))
            stack.push_async_callback(stop, process)
            url = f"http://127.0.0.1:{port}"
            await wait_ready(process, url + "/ready", log)
            urls.append(url)
        yield urls


class Tally:
    """What one tenant got in one phase."""

    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.refused: dict[int, int] = {}

    def add(self, status: int, seconds: float) -> None:
        if status == 200:
            self.latencies.append(seconds)
        else:
            self.refused[status] = self.refused.get(status, 0) + 1

    def summary(self, duration: float) -> dict[str, Any]:
        ordered = sorted(self.latencies)
        return {"ok": len(ordered), "refused": self.refused,
                "per_second": len(ordered) / duration,
                "p50_ms": _ms(percentile(ordered, 50)), "p99_ms": _ms(percentile(ordered, 99))}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


async def phase(args: argparse.Namespace, urls: list[str], *, batch: bool,
                interactive_rate: float | None) -> dict[str, dict[str, Any]]:
    """One phase: the batch flood (closed loop) and/or the interactive tenant (open loop)."""
    messages = [{"role": "user", "content": "a short question"}]
    lengths = random.Random(0)  # the same draws each run
    low, high = args.batch_max_tokens
    tallies = {"batch": Tally(), "interactive": Tally()}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    end = trio.current_time() + args.duration

    async def one(client: httpx.AsyncClient, tenant: str, url: str) -> None:
        tokens = args.max_tokens if tenant == "interactive" else lengths.randint(low, high)
        body = {"model": "fake-model", "max_tokens": tokens, "messages": messages}
        started = trio.current_time()
        try:
            r = await client.post(url + CHAT, json=body,
                                  headers={"authorization": f"Bearer {KEYS[tenant]}"})
            status = r.status_code
        except httpx.HTTPError:
            status = 0
        if started < end:
            tallies[tenant].add(status, trio.current_time() - started)

    async def flood_worker(client: httpx.AsyncClient, url: str) -> None:
        while trio.current_time() < end:
            await one(client, "batch", url)

    async with httpx.AsyncClient(trust_env=False, timeout=args.timeout, limits=limits) as bc, \
            httpx.AsyncClient(trust_env=False, timeout=args.timeout, limits=limits) as ic, \
            trio.open_nursery() as nursery:
        if batch:
            for n in range(args.flood * args.capacity * len(urls)):
                nursery.start_soon(flood_worker, bc, urls[n % len(urls)])
        if interactive_rate:
            if batch:  # the flood's queue formed first
                await trio.sleep(min(2.0, args.duration / 4))
            n = 0
            next_at = trio.current_time()
            while next_at < end:
                await trio.sleep_until(next_at)
                nursery.start_soon(one, ic, "interactive", urls[n % len(urls)])
                n += 1
                next_at += 1 / interactive_rate
    measured = args.duration - (min(2.0, args.duration / 4) if batch and interactive_rate
                                else 0.0)
    return {tenant: tally.summary(args.duration if tenant == "batch" else measured)
            for tenant, tally in tallies.items()}


async def measure(args: argparse.Namespace, mode: str, replicas: int, backends: Any,
                  state_url: str | None, logdir: Path) -> dict[str, Any]:
    async with fleet(args, mode, replicas, backends, state_url, logdir) as urls:
        capacity = (await phase(args, urls, batch=True, interactive_rate=None))["batch"]
        rate = args.share * capacity["per_second"]
        idle = (await phase(args, urls, batch=False, interactive_rate=rate))["interactive"]
        flood = await phase(args, urls, batch=True, interactive_rate=rate)
    inter, batch = flood["interactive"], flood["batch"]
    remaining = capacity["per_second"] - inter["per_second"]
    return {
        "mode": mode, "replicas": replicas, "capacity_per_second": capacity["per_second"],
        "interactive_rate": rate, "idle": idle, "flood": flood,
        "p99_ratio": (inter["p99_ms"] / idle["p99_ms"]
                      if inter["p99_ms"] and idle["p99_ms"] else None),
        "interactive_refused": sum(inter["refused"].values()),
        "batch_share": batch["per_second"] / remaining if remaining > 0 else None,
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    backends_args = argparse.Namespace(
        layout="pd", encoders=0, prefills=0, decodes=args.decodes,
        token_interval=args.token_interval, prefill_time=args.prefill_time, rest_cpus=None)
    process, backends, described = await start_backends(backends_args)
    results = []
    try:
        with tempfile.TemporaryDirectory(prefix="bench-fairness-") as logs, \
                redis_url(any(r > 1 for r in args.replicas)) as state_url:
            for replicas in args.replicas:
                for mode in args.modes:
                    results.append(await measure(args, mode, replicas, backends,
                                                 state_url if replicas > 1 else None,
                                                 Path(logs)))
                    print(render_one(results[-1]), flush=True)
    finally:
        await stop(process)
    return {"backends": described, "settings": {k: v for k, v in vars(args).items()
                                                if k != "json"},
            "results": results, "when": time.strftime("%Y-%m-%d %H:%M:%S")}


async def admission_cost(args: argparse.Namespace) -> dict[str, Any]:
    """CPU per admission (place, priority, the tenant's own cap and per-minute limits, release
    and settlement), in process, without a server: today's single cap, the fair gate with its
    limits local, and the fair gate with its limits in a local ``redis-server``: the cap's
    lease and both buckets taken in its one script (its wall time: one round trip)."""
    n = args.cost_requests
    tables = {"t": {"keys": ["k"], "max_inflight": 10_000, "requests_per_minute": PER_MINUTE,
                    "tokens_per_minute": PER_MINUTE}}
    table = TenantTable(parse_tenants(tables))
    tenant = table.by_name["t"]
    body = {"model": "m", "messages": [{"role": "user", "content": "a short question"}],
            "max_tokens": 10}
    usage = b'{"usage": {"prompt_tokens": 5, "completion_tokens": 10}}'
    metrics = ProxyMetrics(tenants=True)

    async def fair_loop(admission: FairAdmission) -> tuple[float, float]:
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(n):
            async with AsyncExitStack() as resources:
                ticket = await admission.enter(tenant, resources)
                await ticket.admitted(dict(body))
                ticket.answered(usage)
        return ((time.process_time() - cpu) / n * 1e6, (time.perf_counter() - wall) / n * 1e6)

    cap = Admission(10_000, 1.0)
    cpu = time.process_time()
    for _ in range(n):
        async with AsyncExitStack() as resources:
            await cap.enter(resources)
    single = (time.process_time() - cpu) / n * 1e6
    local = await fair_loop(FairAdmission(max_inflight=10_000, timeout=1.0, table=table,
                                          aging=0.5, observer=metrics))
    with RedisServer() as redis:
        settings = Settings(decode_urls=(), admin_key="x", state_url=redis.url,
                            tenants=parse_tenants(tables))
        link = StateLink(settings, ReplicatedRoster(CursorCounters.local()), Loads(LocalLoadTable()),
                         metrics, replica_id="cost", live=lambda _: True)
        async with trio.open_nursery() as nursery:
            await nursery.start(link.run)
            with trio.fail_after(10):
                while link.limits_link is None:
                    await link.next_change()
            limits = SharedLimits(link, metrics, timeout=settings.state_limits_timeout)
            shared = await fair_loop(FairAdmission(
                max_inflight=10_000, timeout=1.0, table=table, aging=0.5, observer=metrics,
                shared=limits, leases=limits))
            nursery.cancel_scope.cancel()
    return {"requests": n, "single_cap_cpu_us": round(single, 1),
            "fair_local_cpu_us": round(local[0], 1), "fair_redis_cpu_us": round(shared[0], 1),
            "fair_redis_wall_us": round(shared[1], 1)}


def render_one(r: dict[str, Any]) -> str:
    inter, idle = r["flood"]["interactive"], r["idle"]
    share = "n/a" if r["batch_share"] is None else f"{r['batch_share']:.2f}"
    ratio = "n/a" if r["p99_ratio"] is None else f"x{r['p99_ratio']:.2f}"
    return (f"{r['replicas']} replica(s), {r['mode']:4}: capacity "
            f"{r['capacity_per_second']:.0f}/s; interactive {r['interactive_rate']:.1f}/s: "
            f"p50 {inter['p50_ms']} ms, p99 {inter['p99_ms']} ms in the flood vs p99 "
            f"{idle['p99_ms']} ms idle ({ratio}), refused {r['interactive_refused']}; "
            f"batch got {share} of the remaining capacity")


def token_range(text: str) -> tuple[int, int]:
    """``10`` -> (10, 10); ``5-15`` -> (5, 15)."""
    low, _, high = text.partition("-")
    bounds = (int(low), int(high or low))
    if not 1 <= bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"{text!r}: a count, or LOW-HIGH with 1 <= LOW <= HIGH")
    return bounds


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.fairness", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", type=lambda s: [m.strip() for m in s.split(",") if m.strip()],
                   default=list(MODES), help="comma-separated, of: " + ", ".join(MODES))
    p.add_argument("--replicas", type=lambda s: [int(n) for n in s.split(",")],
                   default=[1, 3], help="comma-separated replica counts (3: sharing Redis)")
    p.add_argument("--duration", type=float, default=20.0, help="seconds per phase")
    p.add_argument("--capacity", type=int, default=8, help="EPD_MAX_INFLIGHT per replica")
    p.add_argument("--flood", type=int, default=10,
                   help="the batch tenant's concurrency, as a multiple of the fleet's places")
    p.add_argument("--share", type=float, default=0.1,
                   help="the interactive tenant's rate, as a fraction of capacity")
    p.add_argument("--aging", type=float, default=0.5, help="EPD_PRIORITY_AGING")
    p.add_argument("--headroom", type=int, default=0, help="EPD_PRIORITY_HEADROOM")
    p.add_argument("--admission-timeout", type=float, default=30.0)
    p.add_argument("--max-tokens", type=int, default=10,
                   help="the interactive tenant's completion length")
    p.add_argument("--batch-max-tokens", type=token_range, default=(5, 15),
                   metavar="N|LOW-HIGH",
                   help="the batch tenant's completion length: one count, or a uniform range "
                        "(see the module docstring for why a range)")
    p.add_argument("--token-interval", type=float, default=0.01)
    p.add_argument("--prefill-time", type=float, default=0.002)
    p.add_argument("--decodes", type=int, default=2)
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--cost", action="store_true",
                   help="only measure admission's own cost per request, in process")
    p.add_argument("--cost-requests", type=int, default=20000)
    args = p.parse_args(argv)
    unknown = set(args.modes) - set(MODES)
    if unknown:
        p.error(f"unknown mode(s): {', '.join(sorted(unknown))}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cost:
        cost = trio.run(admission_cost, args)
        print(f"admission per request, over {cost['requests']}: single cap "
              f"{cost['single_cap_cpu_us']} µs CPU; fair, limits local "
              f"{cost['fair_local_cpu_us']} µs CPU; fair, limits in Redis "
              f"{cost['fair_redis_cpu_us']} µs CPU, {cost['fair_redis_wall_us']} µs wall")
        return 0
    report = trio.run(run, args)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
