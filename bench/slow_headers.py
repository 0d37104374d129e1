"""Slow-header (slowloris) attack: how long the proxy holds an attacker's socket, and whether a
normal client still gets in meanwhile.

    python -m bench.slow_headers                          # 2000 attackers, epd-trio serve defaults
    python -m bench.slow_headers --keep-alive 10          # a shorter head deadline
    python -m bench.slow_headers --entry hypercorn        # plain hypercorn --worker-class trio
    python -m bench.slow_headers --proxy-nofile 1024      # the proxy under a distro's fd limit

It starts lean fake backends (``bench.lean_fake``: one prefill, one decode) and the proxy as a
subprocess, the way users run it (``epd-trio serve``, or ``hypercorn --worker-class trio
epd_trio.app:app`` with ``--entry hypercorn``), then opens ``--connections`` attacker
connections. Each sends a request line and then one byte of header every ``--interval``
seconds, never finishing its head: a server that only times out *reads* (a per-read idle timer)
never closes it. Meanwhile a prober sends a normal chat request on a fresh connection every
``--probe-interval`` seconds.

Reported: how long attackers were held before the proxy closed them (p50/max; none is left open
at the end if the head is bounded), how many were open over time next to the proxy's RSS
(``VmRSS`` of all its processes, from ``/proc``) and open file descriptors, and the normal
requests' latency during the attack. Exit status 1 when a normal request failed or took longer
than ``--latency-limit``, or when an attacker was still open after ``--duration``.

Both this process and the proxy need a file descriptor per connection: this process raises its
own soft ``RLIMIT_NOFILE`` to the hard limit; the proxy inherits it unless ``--proxy-nofile``
says otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any
from urllib.parse import urlsplit

import orjson
import trio

from bench._load import _exchange, classify, request_head
from bench._wire import WireError
from bench.burst import percentile, process_tree, stop
from epd_trio.testing.process import read_until, read_url

CHAT = "/v1/chat/completions"
#: What an attacker trickles after its request line, one byte at a time, over and over: valid
#: header lines, so the head stays well-formed and only its slowness is the problem.
TRICKLE = b"x-slow: a\r\n"


# -- what was seen ------------------------------------------------------------------------------
@dataclass(slots=True)
class Attacker:
    """One slow-header connection. ``closed`` is None while it is open (or never connected)."""

    connected: float | None = None
    closed: float | None = None
    sent: int = 0
    #: ``closed by the proxy`` (end of file), ``reset by the proxy``, ``connect failed: ...``,
    #: or None while still open.
    ending: str | None = None
    answered: bytes = b""


@dataclass(slots=True)
class Probe:
    """One normal request sent during the run."""

    started: float
    latency: float
    error: str | None
    attackers_open: int


@dataclass(slots=True)
class Sample:
    at: float
    attackers_open: int
    rss_kib: int
    fds: int


@dataclass
class Run:
    attackers: list[Attacker]
    probes: list[Probe] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    all_ended: trio.Event = field(default_factory=trio.Event)
    _ended: int = 0

    def attacker_ended(self) -> None:
        self._ended += 1
        if self._ended == len(self.attackers):
            self.all_ended.set()

    def open_count(self) -> int:
        return sum(1 for a in self.attackers if a.connected is not None and a.closed is None)


# -- /proc --------------------------------------------------------------------------------------
def rss_kib(pids: set[int]) -> int:
    """Sum of ``VmRSS`` (KiB) over ``pids`` that are still alive."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
                        break
        except OSError:
            continue
    return total


def open_fds(pids: set[int]) -> int:
    """File descriptors open in ``pids`` (each accepted connection is one)."""
    total = 0
    for pid in pids:
        try:
            total += len(os.listdir(f"/proc/{pid}/fd"))
        except OSError:
            continue
    return total


def raise_nofile(needed: int) -> int:
    """Raise this process's soft fd limit to its hard limit; refuse to run if that is too few."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if hard < needed:
        raise SystemExit(f"need {needed} file descriptors, the hard limit is {hard} "
                         "(raise it: ulimit -Hn, or fewer --connections)")
    return hard


# -- the clients --------------------------------------------------------------------------------
async def attack(host: str, port: int, me: Attacker, *, interval: float, first_delay: float,
                 connect_limiter: trio.CapacityLimiter, done: Callable[[], None]) -> None:
    """Open a connection and trickle its head until the proxy closes it (or we are cancelled);
    ``done`` is called once it has ended, not when cancelled."""
    async with connect_limiter:
        try:
            stream = await trio.open_tcp_stream(host, port)
        except OSError as exc:
            me.ending = f"connect failed: {classify(exc)}"
            done()
            return
    me.connected = trio.current_time()
    line = f"POST {CHAT} HTTP/1.1\r\n".encode()
    async with stream:
        try:
            await stream.send_all(line)
            me.sent = len(line)
            wait = first_delay
            while True:
                # Wait for the next byte's turn, but notice at once when the proxy closes: the
                # close is what this bench measures.
                with trio.move_on_after(wait):
                    data = await stream.receive_some(4096)
                    if not data:
                        me.ending = "closed by the proxy"
                        break
                    me.answered += data  # a 4xx, say; keep reading until it closes
                    continue
                await stream.send_all(TRICKLE[me.sent % len(TRICKLE):][:1])
                me.sent += 1
                wait = interval
        except (OSError, trio.BrokenResourceError) as exc:
            me.ending = f"reset by the proxy ({classify(exc)})"
        finally:
            if me.ending is not None:
                me.closed = trio.current_time()
                done()


async def normal_request(host: str, port: int, body: bytes, limit: float) -> str | None:
    """One chat request on a fresh connection (a new client must get in); None when it is OK."""
    head = request_head("POST", CHAT, f"{host}:{port}", len(body))
    with trio.move_on_after(limit):
        try:
            async with await trio.open_tcp_stream(host, port) as stream:
                answer = await _exchange(stream, head, body, False, False, trio.current_time())
        except (OSError, EOFError, trio.BrokenResourceError, WireError) as exc:
            return classify(exc)
        return None if answer.status == 200 else f"HTTP {answer.status}"
    return "timeout"


async def probe_forever(host: str, port: int, run: Run, every: float, limit: float) -> None:
    body = orjson.dumps({"model": "fake-model", "max_tokens": 8,
                         "messages": [{"role": "user", "content": "hello"}]})
    while True:
        t0 = trio.current_time()
        open_now = run.open_count()
        error = await normal_request(host, port, body, limit)
        run.probes.append(Probe(t0, trio.current_time() - t0, error, open_now))
        await trio.sleep(max(0.0, every - (trio.current_time() - t0)))


async def sample_forever(run: Run, pid: int, every: float) -> None:
    while True:
        pids = process_tree(pid)
        run.samples.append(Sample(trio.current_time(), run.open_count(), rss_kib(pids),
                                  open_fds(pids)))
        await trio.sleep(every)


# -- the run ------------------------------------------------------------------------------------
async def start_proxy(args: argparse.Namespace, nursery: trio.Nursery,
                      processes: list[trio.Process]) -> tuple[str, int, trio.Process]:
    fakes = await trio.lowlevel.open_process(
        [sys.executable, "-m", "bench.lean_fake", "--prefills", "1", "--decodes", "1"],
        stdout=subprocess.PIPE)
    processes.append(fakes)
    assert fakes.stdout is not None
    _, output = await read_until(fakes.stdout, rb"\bready\b", limit=60)
    settings = dict(line.split("=", 1) for line in output.decode().splitlines()
                    if line.startswith("EPD_"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPD_")} | settings
    if args.entry == "serve":
        cmd = [sys.executable, "-m", "epd_trio", "serve", "--port", "0"]
        pattern = rb"listening on (http://\S+)"
    else:
        cmd = [sys.executable, "-m", "hypercorn", "--worker-class", "trio",
               "--bind", "127.0.0.1:0", "epd_trio.app:app"]
        pattern = rb"Running on (http://\S+)"
    if args.keep_alive is not None:
        cmd += ["--keep-alive", str(args.keep_alive)]
    limit = args.proxy_nofile

    def set_nofile() -> None:  # runs in the child, before exec
        if limit is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE,
                               (limit, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    proxy = await trio.lowlevel.open_process(cmd, env=env, stderr=subprocess.PIPE,
                                             preexec_fn=set_nofile)
    processes.append(proxy)
    assert proxy.stderr is not None
    url = await read_url(proxy.stderr, pattern, limit=60)
    nursery.start_soon(_drain, proxy.stderr)  # never let it block on a full pipe
    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or 80, proxy


async def _drain(stream: trio.abc.ReceiveStream) -> None:
    while await stream.receive_some():
        pass


async def run_attack(args: argparse.Namespace) -> dict[str, Any]:
    raise_nofile(args.connections + 256)
    processes: list[trio.Process] = []
    try:
        async with trio.open_nursery() as nursery:
            host, port, proxy = await start_proxy(args, nursery, processes)
            report = await _attack_proxy(args, host, port, proxy.pid)
            nursery.cancel_scope.cancel()
        return report
    finally:
        for process in reversed(processes):
            await stop(process)


async def _attack_proxy(args: argparse.Namespace, host: str, port: int,
                        pid: int) -> dict[str, Any]:
    warm_body = orjson.dumps({"model": "fake-model", "max_tokens": 8,
                              "messages": [{"role": "user", "content": "warm up"}]})
    for _ in range(20):  # imports, pools and first-use caches before the "before" figure
        if (error := await normal_request(host, port, warm_body, 10)) is not None:
            raise SystemExit(f"the proxy does not answer a normal request: {error}")
    before = Sample(trio.current_time(), 0, rss_kib(process_tree(pid)), open_fds(
        process_tree(pid)))
    rng = random.Random(args.seed)
    run = Run([Attacker() for _ in range(args.connections)])
    limiter = trio.CapacityLimiter(args.connect_concurrency)
    t0 = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sample_forever, run, pid, args.sample_interval)
        nursery.start_soon(probe_forever, host, port, run, args.probe_interval, args.probe_timeout)
        async with trio.open_nursery() as attackers:
            # A random first gap spreads the trickle evenly over the interval.
            for me in run.attackers:
                attackers.start_soon(partial(
                    attack, host, port, me, interval=args.interval, done=run.attacker_ended,
                    first_delay=rng.uniform(0, args.interval), connect_limiter=limiter))
            with trio.move_on_after(args.duration):
                await run.all_ended.wait()
            attackers.cancel_scope.cancel()
        ended = trio.current_time()
        nursery.cancel_scope.cancel()
    with trio.move_on_after(args.settle):  # let the proxy finish closing before "after"
        # Another process's fds: nothing to wait on but /proc.
        while open_fds(process_tree(pid)) > before.fds:  # noqa: ASYNC110
            await trio.sleep(0.1)
    after_probes = []
    for _ in range(10):
        s0 = trio.current_time()
        error = await normal_request(host, port, warm_body, args.probe_timeout)
        after_probes.append(Probe(s0, trio.current_time() - s0, error, 0))
    after = Sample(trio.current_time(), 0, rss_kib(process_tree(pid)),
                   open_fds(process_tree(pid)))
    return summarize(args, run, before, after, after_probes, t0, ended)


def _dist(values: list[float]) -> dict[str, float | None]:
    ordered = sorted(values)
    return {"p50": percentile(ordered, 50), "p99": percentile(ordered, 99),
            "max": ordered[-1] if ordered else None}


def summarize(args: argparse.Namespace, run: Run, before: Sample, after: Sample,
              after_probes: list[Probe], t0: float, ended: float) -> dict[str, Any]:
    connected = [a for a in run.attackers if a.connected is not None]
    closed = [a for a in connected if a.closed is not None]
    endings: dict[str, int] = {}
    for a in run.attackers:
        key = a.ending or "still open at the end"
        endings[key] = endings.get(key, 0) + 1
    held = [a.closed - a.connected for a in closed]  # type: ignore[operator]
    full = [p for p in run.probes if p.attackers_open >= 0.9 * len(connected) > 0]
    during = [p for p in run.probes if p.attackers_open > 0]
    peak = max(run.samples, key=lambda s: s.rss_kib) if run.samples else before
    most_open = max((s.attackers_open for s in run.samples), default=0)
    all_open = [s.at - t0 for s in run.samples if connected and s.attackers_open == len(connected)]
    return {
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "attack": {
            "connections": len(run.attackers), "connected": len(connected),
            "closed_by_proxy": len(closed), "endings": endings,
            "held_seconds": _dist(held),
            "bytes_sent": _dist([float(a.sent) for a in connected]),
            "answered": sorted({a.answered.split(b"\r\n", 1)[0].decode("latin-1")
                                for a in connected if a.answered}),
            "all_open_from_to_seconds": [all_open[0], all_open[-1]] if all_open else None,
            "seconds": ended - t0,
        },
        "normal_requests": {
            "during_attack": _probe_summary(during, args.latency_limit),
            "with_90pct_of_attackers_open": _probe_summary(full, args.latency_limit),
            "after_attack": _probe_summary(after_probes, args.latency_limit),
        },
        "proxy": {
            "rss_mib": {"before": before.rss_kib / 1024, "peak": peak.rss_kib / 1024,
                        "after": after.rss_kib / 1024},
            "fds": {"before": before.fds, "peak": max((s.fds for s in run.samples),
                                                      default=before.fds),
                    "after": after.fds},
            # The peak can come after the attackers left (freed memory is kept for reuse).
            "rss_kib_per_held_connection": (
                (peak.rss_kib - before.rss_kib) / most_open if most_open else None),
        },
        "probes": [{"t": round(p.started - t0, 3), "latency": round(p.latency, 4),
                    "error": p.error, "attackers_open": p.attackers_open} for p in run.probes],
        "timeline": [{"t": round(s.at - t0, 2), "attackers_open": s.attackers_open,
                      "rss_mib": round(s.rss_kib / 1024, 1), "fds": s.fds}
                     for s in run.samples],
    }


def _probe_summary(probes: list[Probe], limit: float) -> dict[str, Any]:
    ok = [p for p in probes if p.error is None]
    slow = [p for p in ok if p.latency > limit]
    errors: dict[str, int] = {}
    for p in probes:
        if p.error is not None:
            errors[p.error] = errors.get(p.error, 0) + 1
    return {"sent": len(probes), "ok": len(ok), "over_limit": len(slow), "errors": errors,
            "latency_seconds": _dist([p.latency for p in ok])}


def verdict(report: dict[str, Any]) -> list[str]:
    """What failed, in words: empty when the head is bounded and normal requests got in."""
    problems = []
    attack = report["attack"]
    open_left = attack["endings"].get("still open at the end", 0)
    if open_left:
        problems.append(f"{open_left} attackers still open after {attack['seconds']:.0f} s")
    for phase in ("during_attack", "after_attack"):
        p = report["normal_requests"][phase]
        if p["ok"] < p["sent"] or p["over_limit"]:
            problems.append(f"normal requests {phase.replace('_', ' ')}: {p['ok']}/{p['sent']} "
                            f"ok, {p['over_limit']} over the limit, errors {p['errors']}")
    return problems


def _s(value: float | None, unit: str = "s") -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.1f} ms" if unit == "ms" else f"{value:.2f} s"


def render(report: dict[str, Any]) -> str:
    c, a, proxy = report["config"], report["attack"], report["proxy"]
    held = a["held_seconds"]
    lines = [
        f"slow-header attack on {'epd-trio serve' if c['entry'] == 'serve' else 'hypercorn'}"
        f" (keep-alive {c['keep_alive'] if c['keep_alive'] is not None else 'default'}"
        f", proxy nofile {c['proxy_nofile'] or 'inherited'}): {a['connections']} connections, "
        f"1 byte every {c['interval']:g} s",
        f"  connected {a['connected']}, closed by the proxy {a['closed_by_proxy']}: "
        + ", ".join(f"{k} {v}" for k, v in sorted(a["endings"].items())),
        f"  held before the proxy closed them: p50 {_s(held['p50'])}, p99 {_s(held['p99'])}, "
        f"max {_s(held['max'])}; bytes sent p50 {a['bytes_sent']['p50']:.0f}",
    ]
    if a["answered"]:
        lines.append(f"  the proxy answered some: {', '.join(a['answered'])}")
    if a["all_open_from_to_seconds"]:
        start, end = a["all_open_from_to_seconds"]
        lines.append(f"  all {a['connected']} open from t={start:.1f} s to t={end:.1f} s")
    for phase, label in (("during_attack", "during the attack"),
                         ("with_90pct_of_attackers_open", "with >= 90 % of attackers open"),
                         ("after_attack", "after the attack")):
        p = report["normal_requests"][phase]
        lat = p["latency_seconds"]
        lines.append(f"  normal requests {label}: {p['ok']}/{p['sent']} ok, latency p50 "
                     f"{_s(lat['p50'], 'ms')}, p99 {_s(lat['p99'], 'ms')}, max "
                     f"{_s(lat['max'], 'ms')}; over {c['latency_limit']:g} s: {p['over_limit']}"
                     + (f"; errors {p['errors']}" if p["errors"] else ""))
    rss, fds = proxy["rss_mib"], proxy["fds"]
    per = proxy["rss_kib_per_held_connection"]
    lines.append(f"  proxy RSS: before {rss['before']:.1f} MiB, peak {rss['peak']:.1f} MiB, after "
                 f"{rss['after']:.1f} MiB" + (f" (~{per:.0f} KiB per held connection)"
                                              if per is not None else ""))
    lines.append(f"  proxy open fds: before {fds['before']}, peak {fds['peak']}, after "
                 f"{fds['after']}")
    timeline = report["timeline"]
    step = max(1, len(timeline) // 12)
    lines.append("  t (s)   attackers open   RSS MiB   fds")
    for row in timeline[::step] + ([timeline[-1]] if timeline and (len(timeline) - 1) % step
                                   else []):
        lines.append(f"  {row['t']:>5.0f}   {row['attackers_open']:>14}   {row['rss_mib']:>7.1f}"
                     f"   {row['fds']:>4}")
    problems = verdict(report)
    lines.append("verdict: " + ("; ".join(problems) if problems else
                                "the head is bounded and normal requests got in"))
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.slow_headers", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--connections", type=int, default=2000, help="attackers (default 2000)")
    p.add_argument("--interval", type=float, default=1.0,
                   help="seconds between two bytes of an attacker's head (default 1)")
    p.add_argument("--entry", choices=("serve", "hypercorn"), default="serve",
                   help="epd-trio serve (default) or hypercorn --worker-class trio")
    p.add_argument("--keep-alive", type=float, default=None,
                   help="passed to the proxy as --keep-alive (default: the entry's own)")
    p.add_argument("--proxy-nofile", type=int, default=None,
                   help="the proxy's soft RLIMIT_NOFILE (default: inherited, raised to hard)")
    p.add_argument("--connect-concurrency", type=int, default=200,
                   help="attackers connecting at once (default 200)")
    p.add_argument("--probe-interval", type=float, default=0.25,
                   help="seconds between two normal requests (default 0.25)")
    p.add_argument("--probe-timeout", type=float, default=10.0)
    p.add_argument("--latency-limit", type=float, default=1.0,
                   help="a normal request slower than this fails the run (default 1 s)")
    p.add_argument("--duration", type=float, default=180.0,
                   help="give up on attackers still open after this many seconds (default 180)")
    p.add_argument("--settle", type=float, default=5.0,
                   help="seconds to wait for the proxy's fds to drop before 'after' (default 5)")
    p.add_argument("--sample-interval", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write the whole report here")
    args = p.parse_args(argv)
    if args.connections < 1 or args.interval <= 0:
        p.error("--connections must be at least 1 and --interval positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = trio.run(run_attack, args)
    print(render(report), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 1 if verdict(report) else 0


if __name__ == "__main__":
    sys.exit(main())

