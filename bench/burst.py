"""Burst benchmark: many simultaneous requests through the proxy, and what it cost.

    python -m bench.burst                                 # embedded fake cluster + real proxy
    python -m bench.burst --requests 4096 --concurrency 4096          # everything at once
    python -m bench.burst --stream --concurrency 64 --compare-direct  # CPU/request vs direct
    python -m bench.burst --target http://host:8000                    # an existing proxy

Side by side with reference proxies, on lean fakes that stream like vLLM: ``bench.compare``.

With no ``--target`` it starts the fake vLLM cluster (``python -m epd_trio.testing --cluster``,
one process) and the proxy as a real ``epd-trio serve`` subprocess, so the proxy's own CPU time
(all its processes) is measured, then stops both. Reported: outcomes by kind, throughput,
latency and time-to-first-byte percentiles, per-instance request/item counts with Jain's
fairness index, DP ranks covered, and proxy CPU milliseconds per request (and microseconds per
token for streams). The fakes write every stream chunk separately, ``--token-interval`` apart
(``epd_trio.testing --chunk-delay``), as vLLM's engine emits tokens: with no spacing a proxy
reads many tokens per wake-up and looks cheaper per token than it is.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import resource
import signal
import subprocess
import sys
from collections import Counter
from dataclasses import asdict
from typing import Any
from urllib.parse import urlsplit

import httpx
import orjson
import trio

from bench._load import Progress, Result, run_load
from bench.lean_fake import DEFAULT_TOKEN_INTERVAL
from epd_trio.testing.media import png_data_url
from epd_trio.testing.process import read_until, read_url

CHAT = "/v1/chat/completions"


# -- pure helpers -------------------------------------------------------------------------------
def percentile(sorted_values: list[float], q: float) -> float | None:
    """Nearest-rank percentile of an ascending list (None when empty)."""
    if not sorted_values:
        return None
    rank = max(1, min(len(sorted_values), math.ceil(q / 100 * len(sorted_values))))
    return sorted_values[rank - 1]


def jain_index(counts: list[int]) -> float | None:
    """Jain's fairness index: 1.0 when every instance got the same, 1/n when one got all."""
    if not counts or not any(counts):
        return None
    return sum(counts) ** 2 / (len(counts) * sum(c * c for c in counts))


def summarize(results: list[Result], wall: float) -> dict[str, Any]:
    ok = [r for r in results if r.error is None]
    latencies = sorted(r.latency for r in ok)
    ttfbs = sorted(r.ttfb for r in ok if r.ttfb is not None)

    def dist(values: list[float]) -> dict[str, float | None]:
        return {f"p{q}": percentile(values, q) for q in (50, 90, 99)} | {
            "max": values[-1] if values else None}

    return {
        "requests": len(results), "ok": len(ok), "failed": len(results) - len(ok),
        "failures": dict(Counter(r.error for r in results if r.error is not None)),
        "wall_seconds": wall, "throughput_rps": len(ok) / wall if wall > 0 else None,
        "latency_seconds": dist(latencies), "ttfb_seconds": dist(ttfbs),
    }


def make_body_factory(images: int, stream: bool, max_tokens: int, model: str):
    def make(i: int) -> bytes:
        content: list[dict[str, Any]] = [
            {"type": "image_url", "image_url": {"url": png_data_url(seed=i * images + k)}}
            for k in range(images)
        ]
        content.append({"type": "text", "text": f"Describe request {i}."})
        return orjson.dumps({"model": model, "stream": stream, "max_tokens": max_tokens,
                             "messages": [{"role": "user", "content": content}]})
    return make


# -- processes ----------------------------------------------------------------------------------
def _proc_stats() -> dict[int, tuple[int, float]]:
    """Every live process's parent and user + system CPU seconds (from /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    stats: dict[int, tuple[int, float]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        stats[int(entry)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
    return stats


def _tree(pid: int, stats: dict[int, tuple[int, float]]) -> set[int]:
    tree, grew = {pid}, True
    while grew:
        grew = False
        for child, (parent, _) in stats.items():
            if parent in tree and child not in tree:
                tree.add(child)
                grew = True
    return tree


def process_tree_wakeups(pid: int) -> int:
    """Voluntary context switches of every thread of ``pid`` and its live descendants.

    Each one is a thread that went to sleep (an ``epoll_wait`` with nothing ready) and so
    costs a wake-up later: tokens relayed per wake-up say how much a proxy batched, which
    moves its CPU per token more than anything in its own code (issue 33)."""
    total = 0
    for process in _tree(pid, _proc_stats()):
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{process}/task"):
                with contextlib.suppress(OSError), \
                        open(f"/proc/{process}/task/{task}/status") as f:
                    total += next(int(line.split()[1]) for line in f
                                  if line.startswith("voluntary_ctxt_switches"))
    return total


def process_tree(pid: int) -> set[int]:
    """``pid`` and all its live descendants (a server's worker processes)."""
    return _tree(pid, _proc_stats())


def process_tree_cpu(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and all its live descendants (from /proc)."""
    stats = _proc_stats()
    return sum(stats[p][1] for p in _tree(pid, stats) if p in stats)


async def stop(process: trio.Process) -> None:
    if process.returncode is None:
        process.send_signal(signal.SIGTERM)
        with trio.move_on_after(20):
            await process.wait()
        if process.returncode is None:
            process.kill()
            await process.wait()


# -- the run ------------------------------------------------------------------------------------
async def _fetch_json(url: str) -> Any:
    async with httpx.AsyncClient(trust_env=False, timeout=10) as client:
        r = await client.get(url)
        r.raise_for_status()
        return r.json()


async def fake_stats(urls: dict[str, list[str]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for role, role_urls in urls.items():
        out[role] = [dict(await _fetch_json(u + "/fake/stats"), url=u) for u in role_urls]
    return out


def diff_stats(before: dict[str, list[dict]], after: dict[str, list[dict]]) -> dict[str, Any]:
    report: dict[str, Any] = {}
    for role, instances in after.items():
        rows = []
        for b, a in zip(before[role], instances, strict=True):
            ranks = {k: a["ranks"].get(k, 0) - b["ranks"].get(k, 0) for k in a["ranks"]}
            rows.append({"url": a["url"], "requests": a["requests"] - b["requests"],
                         "items": a["items"] - b["items"],
                         "ranks": {k: v for k, v in sorted(ranks.items()) if v}})
        if not rows:
            continue
        key = "items" if role == "encode" else "requests"
        dp = max(a["dp_size"] for a in instances)
        covered = sum(1 for r in rows for k in r["ranks"] if k != "none") if dp > 1 else len(
            [r for r in rows if r["requests"]])
        total = sum(a["dp_size"] for a in instances) if dp > 1 else len(rows)
        report[role] = {"instances": rows, "fairness": jain_index([r[key] for r in rows]),
                        "fairness_of": key, "slots_covered": f"{covered}/{total}"}
    return report


async def burst(args: argparse.Namespace, url: str, label: str) -> dict[str, Any]:
    parts = urlsplit(url)
    progress = Progress(total=args.requests)
    make_body = make_body_factory(args.images, args.stream, args.max_tokens, args.model)
    t0 = trio.current_time()
    cpu0 = _self_cpu()
    async with trio.open_nursery() as nursery:
        if not args.quiet and sys.stderr.isatty():
            nursery.start_soon(show_progress, progress, label)
        results = await run_load(parts.hostname or "127.0.0.1", parts.port or 80, CHAT,
                                 make_body, requests=args.requests,
                                 concurrency=args.concurrency, stream=args.stream,
                                 request_timeout=args.timeout, progress=progress)
        nursery.cancel_scope.cancel()
    wall = trio.current_time() - t0
    generator_ms = (_self_cpu() - cpu0) * 1000 / max(len(results), 1)
    if not args.quiet and sys.stderr.isatty():
        print(file=sys.stderr)
    return summarize(results, wall) | {"_results": results,
                                       "load_generator_cpu_ms_per_request": generator_ms}


def _self_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def show_progress(progress: Progress, label: str) -> None:
    width = 30
    while True:
        filled = int(width * progress.done / max(progress.total, 1))
        print(f"\r{label:<8} [{'#' * filled}{'.' * (width - filled)}] {progress.done}/"
              f"{progress.total} failed {progress.failed}", end="", file=sys.stderr, flush=True)
        await trio.sleep(0.25)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {"config": {k: v for k, v in vars(args).items()
                                         if k not in ("json", "plot")}}
    processes: list[trio.Process] = []
    urls: dict[str, list[str]] = {}
    proxy_pid = None
    fakes_pid = None
    try:
        if args.target:
            url = args.target.rstrip("/")
        else:
            fakes = await trio.lowlevel.open_process(
                [sys.executable, "-m", "epd_trio.testing", "--cluster", args.cluster,
                 "--tokens", str(args.max_tokens), "--chunk-delay", str(args.token_interval)],
                stdout=subprocess.PIPE)
            processes.append(fakes)
            fakes_pid = fakes.pid
            assert fakes.stdout is not None
            _, output = await read_until(fakes.stdout, rb"\bready\b", limit=60)
            env_lines = [line for line in output.decode().splitlines()
                         if line.startswith("EPD_")]
            settings = dict(line.split("=", 1) for line in env_lines)
            for role in ("encode", "prefill", "decode"):
                value = settings.get(f"EPD_{role.upper()}_URLS", "")
                urls[role] = [u.split("#")[0] for u in value.split(",") if u]
            cmd = [sys.executable, "-m", "epd_trio", "serve", "--port", "0",
                   "--workers", str(args.workers)]
            if args.max_connections:
                cmd += ["--max-connections", str(args.max_connections)]
            for role in ("encode", "prefill", "decode"):
                value = settings.get(f"EPD_{role.upper()}_URLS", "")
                if value:
                    cmd += [f"--{role}", *value.split(",")]
            proxy = await trio.lowlevel.open_process(cmd, stderr=subprocess.PIPE)
            processes.append(proxy)
            assert proxy.stderr is not None
            url = await read_url(proxy.stderr, rb"listening on (http://\S+)")
            proxy_pid = proxy.pid
            # Drain the proxy's stderr so it never blocks on a full pipe.
            nursery_output = proxy.stderr
        async with trio.open_nursery() as nursery:
            if proxy_pid is not None:
                nursery.start_soon(_drain, nursery_output)
            warm = argparse.Namespace(**{**vars(args), "requests": min(50, args.requests),
                                         "concurrency": min(8, args.concurrency), "quiet": True})
            await burst(warm, url, "warmup")
            before = await fake_stats(urls) if urls else None
            cpu0 = process_tree_cpu(proxy_pid) if proxy_pid else None
            fakes0 = process_tree_cpu(fakes_pid) if fakes_pid else None
            result = await burst(args, url, "proxy")
            cpu1 = process_tree_cpu(proxy_pid) if proxy_pid else None
            fakes1 = process_tree_cpu(fakes_pid) if fakes_pid else None
            results: list[Result] = result.pop("_results")
            report["proxy"] = result
            if cpu0 is not None and cpu1 is not None:
                report["proxy"]["cpu_ms_per_request"] = (cpu1 - cpu0) * 1000 / args.requests
                report["proxy"]["cpu_seconds"] = cpu1 - cpu0
                if args.stream and result["ok"]:
                    report["proxy"]["cpu_us_per_token"] = (
                        (cpu1 - cpu0) * 1e6 / (result["ok"] * args.max_tokens))
            if fakes0 is not None and fakes1 is not None:
                # The fake backends share the machine: their CPU is part of what a burst costs.
                report["proxy"]["fakes_cpu_ms_per_request"] = (fakes1 - fakes0) * 1000 / args.requests
            if before is not None:
                report["instances"] = diff_stats(before, await fake_stats(urls))
            if args.compare_direct:
                direct_url = args.direct or (urls.get("decode") or [None])[0]
                if direct_url is None:
                    raise SystemExit("--compare-direct needs --direct URL with --target")
                direct = await burst(args, direct_url, "direct")
                direct.pop("_results")
                report["direct"] = direct
                report["ratio"] = ratios(report["proxy"], direct)
            nursery.cancel_scope.cancel()
        report["_results"] = results
        return report
    finally:
        for process in reversed(processes):
            await stop(process)


async def _drain(stream: trio.abc.ReceiveStream) -> None:
    while await stream.receive_some():
        pass


def ratios(proxy: dict[str, Any], direct: dict[str, Any]) -> dict[str, Any]:
    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    out = {f"latency_{q}": ratio(proxy["latency_seconds"][q], direct["latency_seconds"][q])
           for q in ("p50", "p99")}
    out["throughput"] = ratio(proxy["throughput_rps"], direct["throughput_rps"])
    p50p, p50d = proxy["latency_seconds"]["p50"], direct["latency_seconds"]["p50"]
    out["added_latency_p50_ms"] = (p50p - p50d) * 1000 if p50p is not None and p50d else None
    return out


# -- output -------------------------------------------------------------------------------------
def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def render(report: dict[str, Any]) -> str:
    cfg = report["config"]
    lines = [f"burst: {cfg['requests']} requests, concurrency {cfg['concurrency']}, "
             f"{'stream' if cfg['stream'] else 'non-stream'}, {cfg['images']} image(s), "
             f"max_tokens {cfg['max_tokens']}" + (f", target {cfg['target']}" if cfg["target"]
                                                  else f", cluster {cfg['cluster']}, "
                                                  f"{cfg['workers']} proxy worker(s)")]
    for name in ("proxy", "direct"):
        r = report.get(name)
        if not r:
            continue
        share = 100 * r["ok"] / r["requests"] if r["requests"] else 0.0
        lines.append(f"\n[{name}] ok {r['ok']}/{r['requests']} ({share:.1f} %)"
                     f", {r['throughput_rps'] or 0:.0f} req/s over {r['wall_seconds']:.2f} s")
        for kind, n in sorted(r["failures"].items()):
            lines.append(f"  failed: {kind}: {n}")
        for key, title in (("latency_seconds", "latency"), ("ttfb_seconds", "ttfb")):
            d = r[key]
            lines.append(f"  {title:<8} ms  p50 {_ms(d['p50'])}  p90 {_ms(d['p90'])}  "
                         f"p99 {_ms(d['p99'])}  max {_ms(d['max'])}")
        lines.append(f"  load generator CPU: {r['load_generator_cpu_ms_per_request']:.2f} ms "
                     "per request")
        if "cpu_ms_per_request" in r:
            per_token = (f", {r['cpu_us_per_token']:.0f} µs per token"
                         if "cpu_us_per_token" in r else "")
            lines.append(f"  proxy CPU: {r['cpu_ms_per_request']:.2f} ms per request{per_token} "
                         f"({r['cpu_seconds']:.2f} s in all)")
        if "fakes_cpu_ms_per_request" in r:
            lines.append(f"  fake backends CPU: {r['fakes_cpu_ms_per_request']:.2f} ms per request "
                         "(all legs, one process)")
    if "ratio" in report and None not in report["ratio"].values():
        q = report["ratio"]
        lines.append(f"\n[proxy / direct] latency p50 x{q['latency_p50']:.2f}, p99 "
                     f"x{q['latency_p99']:.2f}, throughput x{q['throughput']:.2f}, added p50 "
                     f"{q['added_latency_p50_ms']:.1f} ms")
    for role, info in report.get("instances", {}).items():
        fair = info["fairness"]
        lines.append(f"\n[{role}] fairness ({info['fairness_of']}) "
                     f"{'-' if fair is None else f'{fair:.3f}'}, slots covered "
                     f"{info['slots_covered']}")
        for row in info["instances"]:
            ranks = " ".join(f"r{k}:{v}" for k, v in row["ranks"].items() if k != "none")
            lines.append(f"  {row['url']}  requests {row['requests']}  items {row['items']}"
                         + (f"  ranks {ranks}" if ranks else ""))
    return "\n".join(lines)


def plot(results: list[Result], path: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "--plot needs matplotlib (pip install matplotlib); skipped"
    latencies = sorted(r.latency * 1000 for r in results if r.error is None)
    fig, (hist, cdf) = plt.subplots(1, 2, figsize=(10, 4))
    hist.hist(latencies, bins=50)
    hist.set_xlabel("latency (ms)")
    hist.set_ylabel("requests")
    cdf.plot(latencies, [i / len(latencies) for i in range(1, len(latencies) + 1)])
    cdf.set_xlabel("latency (ms)")
    cdf.set_ylabel("fraction of requests")
    fig.tight_layout()
    fig.savefig(path)
    return f"plot written to {path}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.burst", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", help="burst this proxy (or vLLM server) instead of a local one")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=64,
                   help="connections in flight (= --requests: all at once)")
    p.add_argument("--stream", action="store_true")
    p.add_argument("--images", type=int, default=1, help="media items per request")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--token-interval", type=float, default=DEFAULT_TOKEN_INTERVAL,
                   help="seconds between two stream chunks of the fake cluster, one write each "
                   f"(default {DEFAULT_TOKEN_INTERVAL}, like a real engine's step)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per request")
    p.add_argument("--model", default="fake-model")
    p.add_argument("--cluster", default="3,2x2,2x2", metavar="E,PxDP,DxDP",
                   help="fake cluster layout when no --target (default 3,2x2,2x2)")
    p.add_argument("--workers", type=int, default=1, help="proxy worker processes")
    p.add_argument("--max-connections", type=int, default=0,
                   help="the proxy's --max-connections (default: its own default)")
    p.add_argument("--compare-direct", action="store_true",
                   help="also send the same load straight to a decode instance")
    p.add_argument("--direct", help="the decode URL for --compare-direct with --target")
    p.add_argument("--json", metavar="PATH", help="write the whole report as JSON")
    p.add_argument("--plot", metavar="PATH.png", help="latency histogram and CDF (matplotlib)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = trio.run(run, args)
    results: list[Result] = report.pop("_results")
    print(render(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report | {"results": [asdict(r) for r in results]}, f, indent=1)
        print(f"report written to {args.json}")
    if args.plot:
        print(plot(results, args.plot))
    return 0 if report["proxy"]["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
