"""Side by side: the same load through epd_trio and through reference proxies, in one run.

    python -m bench.compare --stream --max-tokens 128 --concurrency 64 --requests 1000
    python -m bench.compare --stream --max-tokens 16 --concurrency 64 --requests 2000
    python -m bench.compare --max-tokens 16 --concurrency 64 --requests 3000        # non-stream
    python -m bench.compare --stream --max-tokens 32 --concurrency 1 --requests 300  # TTFB, gaps
    python -m bench.compare --requests 4096 --concurrency 4096 --max-tokens 8        # the burst
    python -m bench.compare --layout epd --stream ...   # E->P->D (the EPD proxy only)

One invocation starts the lean fake backends (``bench.lean_fake``: headers first, one write per
token, ``--token-interval`` apart) once, then for each round and each peer: starts the peer as a
subprocess, waits until it is ready, warms it up, sends the measured load, and stops it. The
peers' order rotates from round to round, so a drift of the machine does not always land on
the same one. Measured per peer and round:

- proxy CPU (user + system, from /proc, of the peer's whole process tree) per request, and per
  generated token for streams; the fake backends' CPU (one process, every leg) and the load
  generator's (this process) per request: all three share the machine;
- requests/s, latency and time to first byte percentiles, and for streams the gaps between
  consecutive SSE events as the client saw them.

Peers (``--peers``; the references are optional and skipped, with the reason, when absent):

- ``epd_trio``: ``python -m epd_trio serve`` at its default settings.
- ``hypercorn``: the same app under plain Hypercorn, as the design card runs it (``hypercorn
  --worker-class trio epd_trio.app:app``, the instances in ``EPD_*_URLS``): Hypercorn's own
  connection class, without ``epd-trio serve``'s (``hypercorn@DIR``: from another checkout).
- ``vllm-router``: the Rust router from PyPI (``pip install vllm-router``, in a venv of its own),
  ``--vllm-pd-disaggregation --prefill URL --decode URL --policy round_robin``. It has no encoder
  stage: it is skipped in the ``epd`` layout.
- ``vllm-epd-proxy``: ``examples/disaggregated/disaggregated_encoder/disagg_epd_proxy.py`` from
  vllm-project/vllm (FastAPI + uvicorn + aiohttp), run as upstream ships it, with a Python that
  has its dependencies. In the P->D layout its required ``--encode-servers-urls`` names the decode
  instance; text requests never reach it.
- ``direct``: the load straight to the decode instance (one leg, no proxy): the floor.
- ``epd_trio:wN``: epd_trio with ``--workers N`` (``--proxy-cpus`` / ``--rest-cpus`` pin the
  peers and the fakes + load generator apart, as ``taskset -c`` does).
- ``epd_trio@DIR``: epd_trio from another checkout (``git worktree add DIR REV``), to measure a
  change side by side with the commit before it.
- ``epd_trio+otel``: epd_trio with OpenTelemetry tracing on, every request sampled
  (``OTEL_TRACES_SAMPLER=always_on``), exporting over OTLP/HTTP to a receiver in this process
  (``epd_trio.testing.otlp_receiver``; its CPU is the load generator's); ``epd_trio+otel=R``
  samples with the default parent-based ratio ``R`` instead (``R=0``: on, nothing sampled).
  Combines with ``@DIR`` and ``:wN`` (``epd_trio@DIR+otel``).
- ``epd_trio+pools``: epd_trio configured by model tables alone (``--models``): the measured
  model's pool (every backend) beside two more models' pools (one combined instance each,
  started by the lean fakes with ``--other-models``). The load names the measured model: what
  routing by model costs a request, side by side with ``epd_trio`` (one pool, learned).

A peer's name may end in ``/embeddings`` (``epd_trio/embeddings``, ``direct/embeddings``): the
same peer, loaded with ``POST /v1/embeddings`` (one input, the lean fakes answer one vector of
``EMBEDDING_DIM`` floats after ``--prefill-time``) instead of the chat request: what an
embeddings request costs beside a non-stream chat, side by side (non-stream runs only; the
references route chat alone here). Each such peer's ratio to its chat peer is reported.

Clients (``--client``): ``epoll`` (default; ``bench._epoll_load``: one epoll loop, each request
written with one ``send``), ``split`` (the same loop writing each request's head and body with two
``send`` calls, as httpx and so the OpenAI SDK do), ``aiohttp`` (``bench._aiohttp_load``: a plain
aiohttp ``ClientSession`` in a process of its own, under ``--aiohttp-python``), ``openai``
(``bench._openai_load``: the OpenAI SDK's ``AsyncOpenAI``, on httpx, in a process of its own,
under ``--openai-python``). The load
generator's CPU in the report is the client's, whichever it is.

Fakes (``--fake``): ``lean`` (default; ``bench.lean_fake``, every stream on one engine grid, or
each on its own timer with ``--pacing stream``), ``aiohttp`` (``bench/aiohttp_fake.py``, an
aiohttp server, each stream on its own timer, under ``--fake-python``). ``--lab`` is issue 33's
independent setup: ``--fake aiohttp --client aiohttp --token-interval 0.005``. For streams the
report gives each peer's tokens per wake-up (its threads' voluntary context switches).

``--instructions`` also counts the instructions each ``epd_trio`` peer's process executes per
measured request, under callgrind (``bench._callgrind``: nearly deterministic where CPU time
moves 10 to 40 % between rounds; the peer runs tens of times slower, so use a few hundred
requests at low concurrency; one worker).

docs/discussion/performance.md says how to install the references and gives the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import trio

from bench import _callgrind
from bench._epoll_load import run_load_epoll
from bench._load import Result
from bench.burst import make_body_factory, percentile, process_tree_cpu, process_tree_wakeups
from bench.lean_fake import DEFAULT_PREFILL_TIME, DEFAULT_TOKEN_INTERVAL, PACINGS
from epd_trio.testing.process import read_until, stop_process

CHAT = "/v1/chat/completions"
EMBEDDINGS = "/v1/embeddings"
#: A peer name's suffix that loads it with embeddings requests instead of chat.
EMBEDDINGS_SUFFIX = "/embeddings"
REFS = Path.home() / ".cache" / "epd-refs"
DEFAULT_VLLM_ROUTER = REFS / "vllm-router-venv" / "bin" / "vllm-router"
DEFAULT_EPD_PROXY = REFS / "disagg_epd_proxy.py"
DEFAULT_EPD_PROXY_PYTHON = REFS / "epd-proxy-venv" / "bin" / "python"
#: A Python with aiohttp for ``--client aiohttp`` (the EPD proxy's venv has it).
DEFAULT_AIOHTTP_PYTHON = DEFAULT_EPD_PROXY_PYTHON
#: A Python with the OpenAI SDK for ``--client openai`` (install_references.sh makes it).
DEFAULT_OPENAI_PYTHON = REFS / "openai-venv" / "bin" / "python"
CLIENTS = ("epoll", "split", "aiohttp", "openai")
#: The clients that run as a process of their own: their script, and the option naming the
#: Python that runs it.
CLIENT_SCRIPTS = {"aiohttp": (Path(__file__).with_name("_aiohttp_load.py"), "aiohttp_python"),
                  "openai": (Path(__file__).with_name("_openai_load.py"), "openai_python")}
#: The fakes of ``--fake aiohttp`` (each stream on its own timer; see the module).
AIOHTTP_FAKE = Path(__file__).with_name("aiohttp_fake.py")
FAKES = ("lean", "aiohttp")
#: Seconds between tokens in issue 33's independent measurement (``--lab``).
LAB_TOKEN_INTERVAL = 0.005
PEERS = ("epd_trio", "hypercorn", "vllm-router", "vllm-epd-proxy", "direct")
DEFAULT_PEERS = "epd_trio,vllm-router,vllm-epd-proxy"
#: Seconds a peer gets to answer its readiness probe after it was started.
READY_TIMEOUT = 60.0


@dataclass(frozen=True)
class Backends:
    """The lean fakes' URLs, by role."""

    encode: tuple[str, ...]
    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    #: ``(model, URL)``: one combined instance per other model (``+pools`` peers).
    others: tuple[tuple[str, str], ...] = ()

    def by_role(self) -> list[tuple[str, tuple[str, ...]]]:
        """``(role, URLs)`` of the roles the layout has, in the request's order."""
        return [(role, urls) for role, urls in (("encode", self.encode),
                                                ("prefill", self.prefill),
                                                ("decode", self.decode)) if urls]


@dataclass(frozen=True)
class Peer:
    """How to start one peer: its command for a port (None: no process) and its ready path."""

    name: str
    command: Callable[[int], list[str]] | None
    ready_path: str = "/health"
    #: Where to run it (an ``epd_trio@DIR`` peer: another checkout, first on the import path).
    cwd: str | None = None
    #: Environment variables it gets on top of this process's (``+otel``: tracing on).
    env: dict[str, str] | None = None
    #: The path its load posts to (``/embeddings`` peers: ``EMBEDDINGS``).
    path: str = CHAT


# -- pure helpers -------------------------------------------------------------------------------
def peer_commands(args: argparse.Namespace, backends: Backends) -> tuple[list[Peer], list[str]]:
    """The peers to run, in ``--peers`` order, and a line for each one skipped (and why)."""
    peers: list[Peer] = []
    skipped: list[str] = []
    for full_name in args.peers:
        name, embeddings, _ = full_name.partition(EMBEDDINGS_SUFFIX)
        if embeddings and not name.startswith(("epd_trio", "hypercorn", "direct")):
            skipped.append(f"{full_name}: skipped, only epd_trio, hypercorn and direct are "
                           "loaded with embeddings here")
            continue
        before = len(peers)
        _add_peer(args, backends, name, peers, skipped)
        if embeddings and len(peers) > before:
            peers[-1] = replace(peers[-1], name=full_name, path=EMBEDDINGS)
    return peers, skipped


def _add_peer(args: argparse.Namespace, backends: Backends, name: str, peers: list[Peer],
              skipped: list[str]) -> None:
    """``name``'s peer appended to ``peers``, or a line saying why not to ``skipped``."""
    e, p, d = backends.encode, backends.prefill, backends.decode
    if name == "epd_trio" or name.startswith(("epd_trio@", "epd_trio:w", "epd_trio+")):
        pooled = "+pools" in name
        name_base, traced, otel = name.replace("+pools", "").partition("+otel")
        env = None
        if traced:
            ratio = otel.removeprefix("=")
            env = {"OTEL_EXPORTER_OTLP_ENDPOINT": args.otlp_endpoint or "http://127.0.0.1:9",
                   "OTEL_TRACES_SAMPLER": "parentbased_traceidratio" if ratio else "always_on",
                   **({"OTEL_TRACES_SAMPLER_ARG": ratio} if ratio else {})}
        base, _, workers_tag = name_base.partition(":w")
        workers = int(workers_tag) if workers_tag else args.workers
        checkout = base.partition("@")[2] or None
        if checkout is not None and not (Path(checkout) / "epd_trio" / "__init__.py").is_file():
            skipped.append(f"{name}: skipped, {checkout} is not an epd_trio checkout")
            return

        def epd_trio(port: int, workers: int = workers, pooled: bool = pooled) -> list[str]:
            cmd = [sys.executable, "-m", "epd_trio", "serve", "--host", "127.0.0.1",
                   "--port", str(port), "--workers", str(workers)]
            if pooled:  # the measured model in a table of its own, beside the others'
                return [*cmd, "--models", models_tables(backends, args.model)]
            for role, urls in backends.by_role():
                cmd += [f"--{role}", *urls]
            return cmd
        peers.append(Peer(name, epd_trio, "/ready", cwd=checkout, env=env))
    elif name == "hypercorn" or name.startswith("hypercorn@"):
        checkout = name.partition("@")[2] or None
        if checkout is not None and not (Path(checkout) / "epd_trio" / "__init__.py").is_file():
            skipped.append(f"{name}: skipped, {checkout} is not an epd_trio checkout")
            return

        def plain(port: int) -> list[str]:
            return [sys.executable, "-m", "hypercorn", "--worker-class", "trio",
                    "--bind", f"127.0.0.1:{port}", "epd_trio.app:app"]
        urls = {f"EPD_{role.upper()}_URLS": " ".join(u) for role, u in backends.by_role()}
        peers.append(Peer(name, plain, "/ready", cwd=checkout, env=urls))
    elif name == "vllm-router":
        if e:
            skipped.append("vllm-router: skipped, it has no encoder stage (layout epd)")
        elif not p:
            skipped.append("vllm-router: skipped, its P/D mode needs a prefill instance")
        elif not os.access(args.vllm_router, os.X_OK):
            skipped.append(f"vllm-router: skipped, {args.vllm_router} not found (see "
                           "docs/discussion/performance.md, or --vllm-router / EPD_BENCH_VLLM_ROUTER)")
        else:
            def router(port: int) -> list[str]:
                cmd = [str(args.vllm_router), "--host", "127.0.0.1", "--port", str(port),
                       "--vllm-pd-disaggregation", "--policy", "round_robin"]
                for url in p:
                    cmd += ["--prefill", url]
                for url in d:
                    cmd += ["--decode", url]
                return cmd
            peers.append(Peer(name, router))
    elif name == "vllm-epd-proxy":
        if not Path(args.epd_proxy).is_file():
            skipped.append(f"vllm-epd-proxy: skipped, {args.epd_proxy} not found (see "
                           "docs/discussion/performance.md, or --epd-proxy / EPD_BENCH_EPD_PROXY)")
        elif not os.access(args.epd_proxy_python, os.X_OK):
            skipped.append(f"vllm-epd-proxy: skipped, no Python at {args.epd_proxy_python} "
                           "(--epd-proxy-python / EPD_BENCH_EPD_PROXY_PYTHON)")
        else:
            def epd_proxy(port: int) -> list[str]:
                return [str(args.epd_proxy_python), str(args.epd_proxy), "--host",
                        "127.0.0.1", "--port", str(port),
                        "--encode-servers-urls", ",".join(e or d),
                        "--prefill-servers-urls", ",".join(p) or "disable",
                        "--decode-servers-urls", ",".join(d)]
            peers.append(Peer(name, epd_proxy))
    else:  # direct
        peers.append(Peer(name, None))


#: The other models of a ``+pools`` peer: two more pools, three in all.
OTHER_MODELS = ("pool-b", "pool-c")


def models_tables(backends: Backends, measured: str) -> str:
    """``--models`` for a ``+pools`` peer: the measured model's pool (every backend of the
    layout, under the name the load asks for) and one pool per other model (its own
    instance), as JSON tables."""
    tables: dict[str, dict[str, list[str]]] = {
        measured: {role: list(urls) for role, urls in backends.by_role()}}
    for model, url in backends.others:
        tables[model] = {"decode": [url]}
    return json.dumps(tables)


def embeddings_body_factory(model: str) -> Callable[[int], bytes]:
    """The body of embeddings request ``i``: one input, the chat load's text."""
    def make(i: int) -> bytes:
        return json.dumps({"model": model, "input": f"Describe request {i}."}).encode()
    return make


def rotated(items: list[Any], by: int) -> list[Any]:
    """``items`` rotated left by ``by`` (round r starts with peer r)."""
    if not items:
        return items
    by %= len(items)
    return items[by:] + items[:by]


def summarize_run(results: list[Result], wall: float, *, requests: int, stream: bool,
                  max_tokens: int, proxy_cpu: float | None, fakes_cpu: float,
                  generator_cpu: float, proxy_wakeups: int | None = None,
                  proxy_instructions: int | None = None) -> dict[str, Any]:
    """One peer's one round, in numbers (CPU arguments in seconds; output in ms and µs)."""
    ok = [r for r in results if r.error is None]
    failures: dict[str, int] = {}
    for r in results:
        if r.error is not None:
            failures[r.error] = failures.get(r.error, 0) + 1
    latencies = sorted(r.latency for r in ok)
    ttfbs = sorted(r.ttfb for r in ok if r.ttfb is not None)
    gaps = sorted(g for r in ok for g in (r.gaps or ()))
    tokens = len(ok) * max_tokens
    out: dict[str, Any] = {
        "requests": len(results), "ok": len(ok), "failures": failures,
        "wall_seconds": wall, "rps": len(ok) / wall if wall > 0 else None,
        "latency_ms": {f"p{q}": _ms(percentile(latencies, q)) for q in (50, 90, 99)},
        "ttfb_ms": {f"p{q}": _ms(percentile(ttfbs, q)) for q in (50, 90, 99)},
        "proxy_cpu_ms_per_request": (None if proxy_cpu is None
                                     else proxy_cpu * 1000 / max(requests, 1)),
        "proxy_cpu_us_per_token": (None if proxy_cpu is None or not stream or not tokens
                                   else proxy_cpu * 1e6 / tokens),
        "fakes_cpu_ms_per_request": fakes_cpu * 1000 / max(requests, 1),
        "load_generator_cpu_ms_per_request": generator_cpu * 1000 / max(requests, 1),
        "proxy_wakeups_per_request": (None if proxy_wakeups is None
                                      else proxy_wakeups / max(requests, 1)),
        "tokens_per_proxy_wakeup": (None if proxy_wakeups is None or not stream or not tokens
                                    else tokens / max(proxy_wakeups, 1)),
        "proxy_instructions_per_request": (None if proxy_instructions is None
                                           else proxy_instructions / max(requests, 1)),
    }
    if stream:
        out["gap_ms"] = {f"p{q}": _ms(percentile(gaps, q)) for q in (50, 90, 99)} | {
            "max": _ms(gaps[-1] if gaps else None)}
        out["events_per_request"] = (statistics.fmean(r.events for r in ok) if ok else None)
    return out


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def span(values: list[float | None], digits: int = 2) -> str:
    """``"a-b"`` for the range of the known values (one value: itself; none: ``-``)."""
    known = [v for v in values if v is not None]
    if not known:
        return "-"
    lo, hi = min(known), max(known)
    if f"{lo:.{digits}f}" == f"{hi:.{digits}f}":
        return f"{lo:.{digits}f}"
    return f"{lo:.{digits}f}-{hi:.{digits}f}"


def round_ratios(rounds: list[dict[str, dict[str, Any]]], ours: str, ref: str,
                 key: Callable[[dict[str, Any]], float | None]) -> list[float]:
    """``ours / ref`` of one figure, per round where both have it (same round: same machine)."""
    out = []
    for by_peer in rounds:
        a = key(by_peer[ours]) if ours in by_peer else None
        b = key(by_peer[ref]) if ref in by_peer else None
        if a is not None and b:
            out.append(a / b)
    return out


RATIO_FIGURES: tuple[tuple[str, Callable[[dict[str, Any]], float | None]], ...] = (
    ("proxy CPU/request", lambda r: r["proxy_cpu_ms_per_request"]),
    ("proxy instructions/request", lambda r: r.get("proxy_instructions_per_request")),
    ("req/s", lambda r: r["rps"]),
    ("latency p50", lambda r: r["latency_ms"]["p50"]),
    ("TTFB p50", lambda r: r["ttfb_ms"]["p50"]),
    ("fakes CPU/request", lambda r: r["fakes_cpu_ms_per_request"]),
    ("load-gen CPU/request", lambda r: r["load_generator_cpu_ms_per_request"]),
)


def _fakes(cfg: dict[str, Any]) -> str:
    """The fakes as the report names them: which server, and how its streams are paced."""
    fake = cfg.get("fake", "lean")
    return "aiohttp (paced per stream)" if fake == "aiohttp" else (
        f"lean (paced per {cfg.get('pacing', 'engine')})")


def render(report: dict[str, Any]) -> str:
    cfg = report["config"]
    rounds: list[dict[str, dict[str, Any]]] = report["rounds"]
    names = [n for n in cfg["peers"] if any(n in r for r in rounds)]
    kind = (f"stream, max_tokens {cfg['max_tokens']}" if cfg["stream"]
            else f"non-stream, max_tokens {cfg['max_tokens']}")
    lines = [f"compare: client {cfg.get('client', 'epoll')}, layout {cfg['layout']}, {kind}, "
             f"C={cfg['concurrency']}, "
             f"{cfg['requests']} requests x {len(rounds)} round(s), token interval "
             f"{cfg['token_interval'] * 1000:g} ms, {_fakes(cfg)} fakes "
             f"({report['backends']})"]
    lines += [f"  {line}" for line in report["skipped"]]
    if "spans_received" in report:
        lines.append(f"  spans received from the +otel peers: {report['spans_received']}")
    width = max([15, *(len(n) + 2 for n in names)])
    header = (f"{'peer':<{width}}{'ok':>11}{'req/s':>10}{'lat p50 ms':>15}{'lat p99 ms':>15}"
              f"{'TTFB p50 ms':>14}{'proxy ms/req':>14}{'µs/token':>10}{'fakes ms/req':>13}"
              f"{'loadgen ms/req':>16}")
    lines += ["", header]
    lat_digits = 0 if all((r[n]["latency_ms"]["p50"] or 0) >= 100 for r in rounds for n in r) else 1
    for name in names:
        runs = [r[name] for r in rounds if name in r]
        ok = f"{sum(r['ok'] for r in runs)}/{sum(r['requests'] for r in runs)}"
        lines.append(
            f"{name:<{width}}{ok:>11}{span([r['rps'] for r in runs], 0):>10}"
            f"{span([r['latency_ms']['p50'] for r in runs], lat_digits):>15}"
            f"{span([r['latency_ms']['p99'] for r in runs], lat_digits):>15}"
            f"{span([r['ttfb_ms']['p50'] for r in runs], lat_digits):>14}"
            f"{span([r['proxy_cpu_ms_per_request'] for r in runs]):>14}"
            f"{span([r['proxy_cpu_us_per_token'] for r in runs], 0):>10}"
            f"{span([r['fakes_cpu_ms_per_request'] for r in runs]):>13}"
            f"{span([r['load_generator_cpu_ms_per_request'] for r in runs]):>16}")
    if cfg["stream"]:
        lines += ["", "client-side gaps between SSE events (ms), TTFB (ms), events/request:"]
        for name in names:
            runs = [r[name] for r in rounds if name in r]
            lines.append(
                f"  {name:<15} gap p50 {span([r['gap_ms']['p50'] for r in runs], 2)}  "
                f"p90 {span([r['gap_ms']['p90'] for r in runs], 2)}  "
                f"p99 {span([r['gap_ms']['p99'] for r in runs], 2)}  "
                f"max {span([r['gap_ms']['max'] for r in runs], 1)}  |  TTFB p50 "
                f"{span([r['ttfb_ms']['p50'] for r in runs], 2)}  p99 "
                f"{span([r['ttfb_ms']['p99'] for r in runs], 2)}  |  events "
                f"{span([r['events_per_request'] for r in runs], 1)}  |  tokens per proxy "
                f"wake-up {span([r.get('tokens_per_proxy_wakeup') for r in runs], 2)}")
    counted = {n: [r[n].get("proxy_instructions_per_request") for r in rounds if n in r]
               for n in names}
    counted = {n: v for n, v in counted.items() if any(x is not None for x in v)}
    if counted:
        lines += ["", "proxy instructions per request (callgrind), millions:"]
        lines += [f"  {name:<{width}}{span([x and x / 1e6 for x in v], 3)}"
                  for name, v in counted.items()]
    failures = {n: f for n in names for r in rounds if n in r and (f := r[n]["failures"])}
    for name, fails in failures.items():
        lines.append(f"  {name} failures: " + ", ".join(f"{k}: {v}" for k, v in fails.items()))
    if "epd_trio" in names:
        refs = [n for n in names if n != "epd_trio" and not n.endswith(EMBEDDINGS_SUFFIX)]
        for ref in refs:
            parts = []
            for title, key in RATIO_FIGURES:
                ratios = round_ratios(rounds, "epd_trio", ref, key)
                if ratios:  # instructions: nearly exact, so one more digit
                    parts.append(f"{title} x{span(ratios, 3 if 'instr' in title else 2)}")
            if parts:
                lines.append(f"\nepd_trio / {ref} (per round): " + ", ".join(parts))
    for name in names:
        chat = name.removesuffix(EMBEDDINGS_SUFFIX)
        if name != chat and chat in names:
            ratios = round_ratios(rounds, name, chat, RATIO_FIGURES[0][1])
            if ratios:
                lines.append(f"\n{name} / {chat} (per round): proxy CPU/request "
                             f"x{span(ratios)}")
    return "\n".join(lines)


# -- processes ----------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def stop(process: trio.Process, grace: float = 10.0) -> None:
    await stop_process(process, grace)


async def wait_ready(process: trio.Process, url: str, log: Path) -> None:
    async with httpx.AsyncClient(trust_env=False, timeout=2) as client:
        with trio.move_on_after(READY_TIMEOUT):
            while process.returncode is None:
                try:
                    if (await client.get(url)).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                await trio.sleep(0.1)
    tail = (await trio.Path(log).read_text(errors="replace"))[-3000:]
    raise RuntimeError(f"{process.args!r} was not ready at {url} (exit {process.returncode}):"
                       f"\n{tail}")


async def start_backends(args: argparse.Namespace) -> tuple[trio.Process, Backends, str]:
    encoders = getattr(args, "encoders", None)  # bench.replicas asks for several
    if encoders is None:
        encoders = 1 if args.layout == "epd" else 0
    if getattr(args, "fake", "lean") == "aiohttp":
        cmd = [str(args.fake_python), str(AIOHTTP_FAKE), "--encoders", str(encoders)]
    else:
        cmd = [sys.executable, "-m", "bench.lean_fake", "--encoders", str(encoders),
               "--pacing", getattr(args, "pacing", "engine")]
    cmd += ["--prefills", str(args.prefills), "--decodes", str(args.decodes),
            "--token-interval", str(args.token_interval), "--prefill-time",
            str(args.prefill_time)]
    if any("+pools" in name for name in getattr(args, "peers", ())):
        cmd += ["--other-models", ",".join(OTHER_MODELS)]
    process = await trio.lowlevel.open_process(cmd, stdout=subprocess.PIPE,
                                               preexec_fn=pinned(args.rest_cpus))
    assert process.stdout is not None
    _, output = await read_until(process.stdout, rb"\bready\b", limit=30)
    settings = dict(line.split("=", 1) for line in output.decode().splitlines() if "=" in line)

    def urls(role: str) -> tuple[str, ...]:
        return tuple(u for u in settings.get(f"EPD_{role}_URLS", "").split(",") if u)

    others = tuple(tuple(pair.split("=", 1)) for pair in urls("OTHER"))
    backends = Backends(urls("ENCODE"), urls("PREFILL"), urls("DECODE"),
                        others)  # type: ignore[arg-type]
    described = ", ".join(f"{len(listed)} {role}" for role, listed in backends.by_role())
    return process, backends, described


def pinned(cpus: set[int] | None) -> Callable[[], None] | None:
    """For a child process: run it on ``cpus`` only (inherited by its own children, so by
    every worker of a peer), like ``taskset -c``."""
    if cpus is None:
        return None
    return partial(os.sched_setaffinity, 0, cpus)


def _cpu_list(text: str) -> set[int]:
    """``taskset -c`` syntax: ``0``, ``0,2``, ``0-3``."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def _self_cpu() -> float:
    times = os.times()
    return times.user + times.system


async def measure(args: argparse.Namespace, peer: Peer, backends: Backends, fakes_pid: int,
                  logdir: Path) -> dict[str, Any]:
    """Start ``peer``, warm it up, send the measured load, stop it; its figures."""
    process = None
    counting = args.instructions and peer.command is not None and peer.name.startswith("epd_trio")
    log = logdir / f"{peer.name.replace('/', '_')}.log"
    try:
        if peer.command is None:
            url = backends.decode[0]
        else:
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            command = peer.command(port)
            if counting:
                command = _callgrind.wrapped(command, logdir)
            with open(log, "wb") as out:  # noqa: ASYNC230 (a local file, opened once)
                process = await trio.lowlevel.open_process(
                    command, stdout=out, stderr=subprocess.STDOUT, cwd=peer.cwd,
                    preexec_fn=pinned(args.proxy_cpus),
                    env={**os.environ, "PYTHONUNBUFFERED": "1",
                         **({"PYTHONPATH": peer.cwd} if peer.cwd else {}), **(peer.env or {}),
                         **(_callgrind.QUIET if counting else {})})
            await wait_ready(process, url + peer.ready_path, log)
        host, port_ = url.removeprefix("http://").rsplit(":", 1)
        make_body = (embeddings_body_factory(args.model) if peer.path == EMBEDDINGS else
                     make_body_factory(args.images, args.stream, args.max_tokens, args.model))

        async def load(requests: int, concurrency: int) -> tuple[list[Result], float]:
            """The results, and the CPU seconds a client process of its own spent."""
            if args.client in CLIENT_SCRIPTS:
                return await run_load_process(args, host, int(port_), peer.path, make_body,
                                              requests, concurrency, logdir)
            # The epoll client runs in a thread: this process has nothing else to do meanwhile,
            # and its CPU (os.times: every thread) is the load generator's.
            return await trio.to_thread.run_sync(partial(
                run_load_epoll, host, int(port_), peer.path, make_body, requests=requests,
                concurrency=concurrency, stream=args.stream, request_timeout=args.timeout,
                record_gaps=args.stream, split_head=args.client == "split")), 0.0

        await load(args.warmup, min(args.concurrency, 16))
        if counting:
            assert process is not None
            await _callgrind.start(process.pid)
        proxy0 = process_tree_cpu(process.pid) if process else None
        wakes0 = process_tree_wakeups(process.pid) if process else None
        fakes0, self0, t0 = process_tree_cpu(fakes_pid), _self_cpu(), trio.current_time()
        results, client_cpu = await load(args.requests, args.concurrency)
        wall = trio.current_time() - t0
        self1, fakes1 = _self_cpu(), process_tree_cpu(fakes_pid)
        proxy1 = process_tree_cpu(process.pid) if process else None
        wakes1 = process_tree_wakeups(process.pid) if process else None
        instructions = None
        if counting:
            assert process is not None
            instructions = await _callgrind.read(process.pid, logdir)
        return summarize_run(
            results, wall, requests=args.requests, stream=args.stream,
            max_tokens=args.max_tokens,
            proxy_cpu=None if proxy0 is None or proxy1 is None else proxy1 - proxy0,
            fakes_cpu=fakes1 - fakes0, generator_cpu=self1 - self0 + client_cpu,
            proxy_wakeups=None if wakes0 is None or wakes1 is None else wakes1 - wakes0,
            proxy_instructions=instructions)
    finally:
        if process is not None:
            await stop(process)


async def run_load_process(args: argparse.Namespace, host: str, port: int, path: str,
                           make_body: Callable[[int], bytes], requests: int, concurrency: int,
                           logdir: Path) -> tuple[list[Result], float]:
    """``bench._aiohttp_load`` or ``bench._openai_load`` in a process of its own; its results
    and its CPU seconds.

    The bodies are made here (the client's Python has only its client library) and written to a
    file, one a line; the client's wall clock starts after its imports, so they are not in its
    figures."""
    bodies = logdir / "bodies.jsonl"
    bodies.write_bytes(b"\n".join(make_body(i) for i in range(requests)) + b"\n")
    script, python = CLIENT_SCRIPTS[args.client]
    cmd = [str(getattr(args, python)), str(script), "--host", host, "--port", str(port),
           "--path", path, "--bodies", str(bodies), "--concurrency", str(concurrency),
           "--timeout", str(args.timeout)]
    if args.stream:
        cmd += ["--stream", "--record-gaps"]
    done = await trio.run_process(cmd, capture_stdout=True, capture_stderr=True, check=False,
                                  preexec_fn=pinned(args.rest_cpus))
    if done.returncode != 0:
        raise RuntimeError(f"the {args.client} client failed ({done.returncode}):\n"
                           f"{done.stderr.decode(errors='replace')[-3000:]}")
    report = json.loads(done.stdout)
    return [Result(**r) for r in report["results"]], float(report["cpu"])


async def run(args: argparse.Namespace) -> dict[str, Any]:
    with contextlib.ExitStack() as stack:
        if any("+otel" in name for name in args.peers) and args.otlp_endpoint is None:
            from epd_trio.testing.otlp_receiver import OtlpReceiver  # the otel extra
            receiver = stack.enter_context(OtlpReceiver())
            args.otlp_endpoint = receiver.endpoint
            report = await _run(args)
            report["spans_received"] = len(receiver.spans)
            return report
        return await _run(args)


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    fakes, backends, described = await start_backends(args)
    try:
        peers, skipped = peer_commands(args, backends)  # the report lists the skipped ones
        if not peers:
            raise SystemExit("no peer to run:\n" + "\n".join(skipped))
        rounds: list[dict[str, dict[str, Any]]] = []
        with tempfile.TemporaryDirectory(prefix="epd-compare-") as tmp:
            for index in range(args.rounds):
                by_peer: dict[str, dict[str, Any]] = {}
                for peer in rotated(peers, index):
                    if not args.quiet:
                        print(f"round {index + 1}/{args.rounds}: {peer.name} ...",
                              file=sys.stderr, flush=True)
                    by_peer[peer.name] = await measure(args, peer, backends, fakes.pid,
                                                       Path(tmp))
                rounds.append(by_peer)
        config = {k: v for k, v in vars(args).items() if k != "json"}
        config = {k: str(v) if isinstance(v, Path) else v for k, v in config.items()}
        return {"config": config, "backends": described, "skipped": skipped, "rounds": rounds}
    finally:
        await stop(fakes)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.compare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peers", default=DEFAULT_PEERS,
                   type=lambda s: [x.strip() for x in s.split(",") if x.strip()],
                   help=f"comma-separated, of {', '.join(PEERS)} (default {DEFAULT_PEERS})")
    p.add_argument("--layout", choices=("pd", "epd"), default="pd",
                   help="pd: text, prefill then decode (default); epd: one image per request, "
                   "encode, prefill, decode")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--stream", action="store_true")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--images", type=int, default=None,
                   help="media items per request (default: 1 in the epd layout, else 0)")
    p.add_argument("--rounds", type=int, default=2, help="rounds of every peer (default 2)")
    p.add_argument("--warmup", type=int, default=64, help="requests before each measurement")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    p.add_argument("--token-interval", type=float, default=None,
                   help=f"the fakes' seconds between tokens (default {DEFAULT_TOKEN_INTERVAL}; "
                   f"{LAB_TOKEN_INTERVAL} with --lab)")
    p.add_argument("--prefill-time", type=float, default=DEFAULT_PREFILL_TIME,
                   help=f"the fakes' prefill/encode seconds (default {DEFAULT_PREFILL_TIME})")
    p.add_argument("--prefills", type=int, default=1)
    p.add_argument("--decodes", type=int, default=1)
    p.add_argument("--workers", type=int, default=1,
                   help="epd_trio worker processes (a peer epd_trio:wN runs N, e.g. "
                   "--peers epd_trio:w1,epd_trio:w2)")
    p.add_argument("--proxy-cpus", type=_cpu_list, default=None, metavar="LIST",
                   help="run every peer on these CPUs only (taskset -c syntax: 1, 0-1)")
    p.add_argument("--rest-cpus", type=_cpu_list, default=None, metavar="LIST",
                   help="run the fakes and the load generator on these CPUs only")
    p.add_argument("--model", default="fake-model")
    p.add_argument("--lab", action="store_true",
                   help="issue 33's independent setup: --fake aiohttp --client aiohttp "
                   f"--token-interval {LAB_TOKEN_INTERVAL} (an option given as well wins)")
    p.add_argument("--client", choices=CLIENTS, default=None,
                   help="the load: epoll (one send per request; default), split (head and body "
                   "as two sends, as httpx / the OpenAI SDK write), aiohttp (an aiohttp "
                   "ClientSession in a process of its own), openai (the OpenAI SDK's "
                   "AsyncOpenAI, on httpx, in a process of its own)")
    p.add_argument("--aiohttp-python", type=Path, default=Path(os.environ.get(
        "EPD_BENCH_AIOHTTP_PYTHON", DEFAULT_AIOHTTP_PYTHON)),
        help="a Python with aiohttp, for --client aiohttp (default: the EPD proxy's venv)")
    p.add_argument("--openai-python", type=Path, default=Path(os.environ.get(
        "EPD_BENCH_OPENAI_PYTHON", DEFAULT_OPENAI_PYTHON)),
        help="a Python with the openai package, for --client openai")
    p.add_argument("--fake", choices=FAKES, default=None,
                   help="the fake backends: lean (bench.lean_fake: one engine steps every "
                   "stream on one grid; default), aiohttp (bench/aiohttp_fake.py: an aiohttp "
                   "server, each stream on its own timer, as issue 33's lab measured)")
    p.add_argument("--pacing", choices=PACINGS, default="engine",
                   help="the lean fakes' token timing: engine (one grid for every stream, as an "
                   "engine steps its batch; default), stream (a timer per stream, as "
                   "--fake aiohttp paces them)")
    p.add_argument("--fake-python", type=Path, default=Path(os.environ.get(
        "EPD_BENCH_FAKE_PYTHON", DEFAULT_AIOHTTP_PYTHON)),
        help="a Python with aiohttp, for --fake aiohttp (default: the EPD proxy's venv)")
    p.add_argument("--vllm-router", type=Path, default=Path(os.environ.get(
        "EPD_BENCH_VLLM_ROUTER", DEFAULT_VLLM_ROUTER)))
    p.add_argument("--epd-proxy", type=Path, default=Path(os.environ.get(
        "EPD_BENCH_EPD_PROXY", DEFAULT_EPD_PROXY)), help="path to disagg_epd_proxy.py")
    p.add_argument("--epd-proxy-python", type=Path, default=Path(os.environ.get(
        "EPD_BENCH_EPD_PROXY_PYTHON", DEFAULT_EPD_PROXY_PYTHON)),
        help="a Python with fastapi, uvicorn, uvloop, aiohttp, msgspec")
    p.add_argument("--otlp-endpoint", default=None, metavar="URL",
                   help="where +otel peers export (default: a receiver in this process)")
    p.add_argument("--instructions", action="store_true",
                   help="count each epd_trio peer's instructions per request under callgrind "
                   "(valgrind; nearly deterministic; slow: a few hundred requests, one worker)")
    p.add_argument("--json", metavar="PATH", help="write the whole report as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    args = p.parse_args(argv)
    bases = [x.removesuffix(EMBEDDINGS_SUFFIX) for x in args.peers]
    unknown = [x for x in bases if x not in PEERS
               and not x.startswith(("epd_trio@", "epd_trio:w", "epd_trio+otel", "epd_trio+pools",
                                     "hypercorn@"))]
    if unknown:
        p.error(f"unknown peer(s) {unknown}; choose from {PEERS}")
    if args.images is None:
        args.images = 1 if args.layout == "epd" else 0
    for name, plain, lab in (("token_interval", DEFAULT_TOKEN_INTERVAL, LAB_TOKEN_INTERVAL),
                             ("client", "epoll", "aiohttp"), ("fake", "lean", "aiohttp")):
        if getattr(args, name) is None:
            setattr(args, name, lab if args.lab else plain)
    if args.client in CLIENT_SCRIPTS:
        python = getattr(args, CLIENT_SCRIPTS[args.client][1])
        if not os.access(python, os.X_OK):
            option = CLIENT_SCRIPTS[args.client][1].replace("_", "-")
            p.error(f"--client {args.client}: no Python at {python} (--{option} / "
                    f"EPD_BENCH_{option.upper().replace('-', '_')}; "
                    "bench/install_references.sh makes one)")
    if args.stream and any(x.endswith(EMBEDDINGS_SUFFIX) for x in args.peers):
        p.error("/embeddings peers measure non-stream requests: leave out --stream")
    if any(x.endswith(EMBEDDINGS_SUFFIX) for x in args.peers) and args.fake == "aiohttp":
        p.error("/embeddings peers need the lean fakes (--fake lean): they answer embeddings")
    if any("+pools" in x for x in args.peers) and args.fake == "aiohttp":
        p.error("+pools peers need the lean fakes (--fake lean): they start the other models")
    if args.instructions:
        why = _callgrind.available()
        if why is not None:
            p.error(f"--instructions: {why}")
        if args.workers != 1 or any(":w" in x for x in args.peers):
            p.error("--instructions counts one process: one worker (no --workers, no :wN peer)")
    if args.fake == "aiohttp" and args.pacing != "engine":
        p.error("--pacing is the lean fakes' option (--fake aiohttp paces every stream alone)")
    if args.fake == "aiohttp" and not os.access(args.fake_python, os.X_OK):
        p.error(f"--fake aiohttp: no Python at {args.fake_python} (--fake-python / "
                "EPD_BENCH_FAKE_PYTHON; bench/install_references.sh makes one)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.rest_cpus is not None:  # this process is the load generator
        os.sched_setaffinity(0, args.rest_cpus)
    report = trio.run(run, args)
    print(render(report))
    if args.json:
        with open(args.json, "w") as f:
            # default=sorted: the CPU sets of --proxy-cpus / --rest-cpus, as lists
            json.dump(report, f, indent=1, default=sorted)
        print(f"report written to {args.json}")
    failed = any(r["ok"] != r["requests"] for rnd in report["rounds"] for r in rnd.values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
