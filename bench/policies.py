"""Routing policies compared on the simulated engine: the same open-loop mixed load through each.

    python -m bench.policies                           # the README's table (about 5 min)
    python -m bench.policies --duration 10 --load 0.6  # shorter, lighter
    python -m bench.policies --loads 0.5,0.7,0.9 --plot policies.png

One process: fake vLLM servers with the simulated batch engine (``epd_trio.testing.sim_engine``:
``max_num_seqs`` batch and queue per DP rank, step time by batch, one token per step, prefill by
uncached tokens with a bounded per-rank prefix cache, an encoder cache), the real proxy app on
Hypercorn, and an open-loop client: Poisson arrivals at ``--load`` times the cluster's estimated
capacity, each request on its own connection, whatever the answers' pace (so queues can form).
Every policy set gets a fresh cluster and the same request sequence (``--seed``).

The workload (``--long-share`` etc.): short and long answers (90/10 by default, by
``max_tokens``); a share of prompts starting with one of a few long shared prefixes (a system
prompt), the rest unique; a share of requests with one image from a small pool.

Reported per policy set and request class: p50/p99 time to first byte and end-to-end latency,
throughput (tokens/s), the prefill prefix-cache hit rate (from the engines' ``/metrics``) against
the ideal (one cache large enough for everything: every repeated block hits), the encoder cache
hit rate, and the load spread (most requests on one slot over the mean, per stage). Then the cost
of one policy decision on the pipeline's own path, measured in this process
(``--decision-rounds``; ``--decisions-only`` runs just that).

The capacity estimate is the decode stage's: ranks x ``max_num_seqs`` / (mean tokens x the step
time of a full batch). The per-rank prefix cache is ``--cache-blocks`` blocks of 16 tokens: the
default (256) holds 8 of the 16 shared prefixes, so a rank that sees all of them (round-robin)
thrashes, and one that sees its quarter (cache_aware) does not.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Sequence
from contextlib import AsyncExitStack, ExitStack
from dataclasses import dataclass, field, replace
from typing import Any

import orjson
import trio

from bench._load import _exchange, request_head
from bench.burst import percentile
from epd_trio import Settings
from epd_trio._core.policies import PrefixHint, prefix_hint, prompt_text
from epd_trio._core.routing import Instance
from epd_trio._proxy import Proxy
from epd_trio._state.cursors import choose_slot
from epd_trio._state.loads import DECODE_TOKENS
from epd_trio.testing import FakeVLLM
from epd_trio.testing.cluster import serve_proxy
from epd_trio.testing.fake_vllm import Behaviour, prompt_words
from epd_trio.testing.redis_server import RedisServer
from epd_trio.testing.sim_engine import EngineConfig, SimEngine, prompt_blocks

CHAT = "/v1/chat/completions"
#: The policy sets compared by default: label -> (encode, prefill, decode, size tie-break).
POLICY_SETS: dict[str, tuple[str, str, str, bool]] = {
    "round_robin": ("round_robin", "round_robin", "round_robin", True),
    "decode least_loaded (counts only)": ("round_robin", "round_robin", "least_loaded", False),
    "decode least_loaded": ("round_robin", "round_robin", "least_loaded", True),
    "decode power_of_two": ("round_robin", "round_robin", "power_of_two", True),
    "cache_aware + least_loaded": ("cache_aware", "cache_aware", "least_loaded", True),
}


@dataclass(frozen=True, slots=True)
class Job:
    """One request of the workload."""

    at: float
    long: bool
    body: bytes
    prefill_blocks: tuple[int, ...]
    tokens: int


@dataclass(slots=True)
class Outcome:
    job: Job
    ttfb: float | None = None
    latency: float | None = None
    error: str | None = None


@dataclass(slots=True)
class Run:
    label: str
    load: float
    rate: float
    outcomes: list[Outcome] = field(default_factory=list)
    wall: float = 0.0
    hit_rate: float | None = None
    encoder_hit_rate: float | None = None
    spread: dict[str, float | None] = field(default_factory=dict)
    overrun: float | None = None


# -- the workload (pure) -------------------------------------------------------------------------
def workload(args: argparse.Namespace, rate: float) -> list[Job]:
    """The request sequence of one run: Poisson arrivals at ``rate`` for ``args.duration`` s."""
    rng = random.Random(args.seed)
    prefixes = [" ".join(f"p{k}w{i}" for i in range(args.prefix_words))
                for k in range(args.prefixes)]
    jobs, at, n = [], 0.0, 0
    while True:
        at += rng.expovariate(rate)
        if at >= args.duration:
            return jobs
        n += 1
        long = rng.random() < args.long_share
        tokens = args.long_tokens if long else args.short_tokens
        question = " ".join(f"q{n}w{i}" for i in range(args.question_words))
        if rng.random() < args.prefix_share:
            system = prefixes[rng.randrange(len(prefixes))]
        else:
            system = " ".join(f"u{n}w{i}" for i in range(args.prefix_words // 2))
        user: list[dict[str, Any]] = [{"type": "text", "text": question}]
        if rng.random() < args.image_share:
            user.append({"type": "image_url", "image_url": {
                "url": f"https://images.example/{rng.randrange(args.images)}.png"}})
        body = {"model": "fake-model", "stream": True, "max_tokens": tokens,
                "messages": [{"role": "system", "content": system},
                             {"role": "user", "content": user}]}
        words = prompt_words(body)  # what the engine sees, media uuids aside (not yet set)
        jobs.append(Job(at, long, orjson.dumps(body),
                        tuple(prompt_blocks(words, 16)), tokens))


def ideal_hit_rate(jobs: Sequence[Job], block_tokens: int = 16) -> float:
    """The hit rate of one unbounded prefix cache over the whole sequence: the best any routing
    can do (a block's first occurrence always misses)."""
    seen: set[int] = set()
    hits = total = 0
    for job in jobs:
        prompt = json_prompt_tokens(job)
        total += prompt
        cached = 0
        for block in job.prefill_blocks:
            if block not in seen:
                break
            cached += 1
        hits += cached * block_tokens
        seen.update(job.prefill_blocks)
    return hits / total if total else 0.0


def json_prompt_tokens(job: Job) -> int:
    return len(prompt_words(orjson.loads(job.body)))


def capacity(args: argparse.Namespace, config: EngineConfig) -> float:
    """Requests/s the decode stage sustains with full batches (the estimate ``--load`` scales)."""
    mean_tokens = args.long_share * args.long_tokens + (1 - args.long_share) * args.short_tokens
    full_step = config.step_base + config.step_per_seq * config.max_num_seqs
    ranks = args.decodes * args.decode_dp
    return ranks * config.max_num_seqs / (mean_tokens * full_step)


# -- one run ---------------------------------------------------------------------------------------
async def _fetch(host: str, port: int, path: str) -> bytes:
    stream = await trio.open_tcp_stream(host, port)
    async with stream:
        head = f"GET {path} HTTP/1.1\r\nhost: {host}:{port}\r\nconnection: close\r\n\r\n"
        await stream.send_all(head.encode())
        chunks = []
        while data := await stream.receive_some(65536):
            chunks.append(data)
    raw = b"".join(chunks)
    return raw.split(b"\r\n\r\n", 1)[1]


def _counter(fakes: Sequence[FakeVLLM], name: str) -> float:
    total = 0.0
    for fake in fakes:
        assert fake.engine is not None
        for line in fake.engine.metrics_text(fake.model, fake.role == "encode").splitlines():
            if line.startswith(name + "_total{"):
                total += float(line.rsplit(" ", 1)[1])
    return total


def _spread(fakes: Sequence[FakeVLLM]) -> float | None:
    """Most requests on one slot over the mean per slot."""
    counts = []
    for fake in fakes:
        per_rank = _per_rank(fake)
        counts += [per_rank.get(r, 0) for r in range(fake.dp_size)]
    if not counts or not sum(counts):
        return None
    return max(counts) / statistics.fmean(counts)


def _per_rank(fake: FakeVLLM) -> dict[int, int]:
    per_rank: dict[int, int] = {}
    for r in fake.requests():
        per_rank[r.rank or 0] = per_rank.get(r.rank or 0, 0) + 1
    return per_rank


async def run_once(args: argparse.Namespace, label: str, policies: tuple[str, str, str, bool],
                   load: float, config: EngineConfig, jobs: list[Job], rate: float,
                   replicas: int = 1, state_url: str | None = None,
                   placement: bool = True) -> Run:
    """One policy set on a fresh cluster; with ``replicas`` > 1, that many proxies share the
    engines (and a state store, ``state_url``), and each request goes to one of them at
    random (as a Kubernetes Service spreads connections). ``placement=False`` turns off the
    replicas' shared placement of unseen prompts (``StagePolicy.placement``), to show what
    ``cache_aware`` does without it: each replica learns its affinities alone."""
    behaviour = Behaviour(tokens=1 << 20)  # max_tokens decides
    run = Run(label if replicas == 1 else
              f"{label}, {replicas} replicas{'' if placement else ', no placement'}", load, rate)
    async with trio.open_nursery() as nursery:
        def fakes(role: Any, count: int, dp: int) -> list[FakeVLLM]:
            return [FakeVLLM(role=role, dp_size=dp, behaviour=behaviour,
                             engine=SimEngine(config, dp)) for _ in range(count)]
        enc = fakes("encode", args.encoders, 1)
        pre = fakes("prefill", args.prefills, args.prefill_dp)
        dec = fakes("decode", args.decodes, args.decode_dp)
        for fake in (*enc, *pre, *dec):
            await nursery.start(fake.serve)
        settings = Settings(
            encode_urls=tuple(Instance(f.url) for f in enc),
            prefill_urls=tuple(Instance(f.url, args.prefill_dp) for f in pre),
            decode_urls=tuple(Instance(f.url, args.decode_dp) for f in dec),
            encode_policy=policies[0], prefill_policy=policies[1], decode_policy=policies[2],
            size_tiebreak=policies[3], metrics=False, health_interval=60.0)
        async with AsyncExitStack() as stack:
            fleet = f"bench{random.getrandbits(32):08x}:"
            urls, proxies = [], []
            for index in range(replicas):
                if replicas > 1:
                    settings = replace(settings, state_url=state_url, state_prefix=fleet,
                                       replica_id=f"replica-{index}")
                url, proxy = await stack.enter_async_context(serve_proxy(settings))
                urls.append(url.removeprefix("http://").split(":"))
                proxies.append(proxy)
                for cursor in (proxy.encoders, proxy.prefills, proxy.decodes):
                    cursor.policy.placement = placement
            with trio.fail_after(30):  # every replica has read the shared state once
                for proxy in proxies:
                    if proxy.state is not None:
                        await proxy.state.roster_loaded.wait()
            spread = random.Random(args.seed)
            started = trio.current_time()

            async def send(job: Job) -> None:
                outcome = Outcome(job)
                run.outcomes.append(outcome)
                t0 = trio.current_time()
                host, port = urls[spread.randrange(len(urls))]
                head = request_head("POST", CHAT, f"{host}:{port}", len(job.body))
                with trio.move_on_after(args.timeout):
                    try:
                        stream = await trio.open_tcp_stream(host, int(port))
                        async with stream:
                            answer = await _exchange(stream, head, job.body, True, False, t0)
                        outcome.ttfb = answer.ttfb
                        outcome.latency = trio.current_time() - t0
                        if answer.status != 200 or (answer.sse and answer.sse.errors):
                            outcome.error = f"HTTP {answer.status}"
                    except (OSError, trio.BrokenResourceError, EOFError) as exc:
                        outcome.error = type(exc).__name__
                if outcome.latency is None and outcome.error is None:
                    outcome.error = "timeout"

            async with trio.open_nursery() as clients:
                for job in jobs:
                    await trio.sleep_until(started + job.at)
                    clients.start_soon(send, job)
            run.wall = trio.current_time() - started
        queries = _counter(pre, "vllm:prefix_cache_queries")
        run.hit_rate = _counter(pre, "vllm:prefix_cache_hits") / queries if queries else None
        items = _counter(enc, "fake:encoder_cache_queries")
        run.encoder_hit_rate = (_counter(enc, "fake:encoder_cache_hits") / items
                                if items else None)
        run.spread = {"encode": _spread(enc), "prefill": _spread(pre), "decode": _spread(dec)}
        ranks = [rank for fake in dec if fake.engine for rank in fake.engine.ranks]
        modelled = sum(r.modelled for r in ranks)
        run.overrun = sum(r.elapsed for r in ranks) / modelled - 1 if modelled else None
        nursery.cancel_scope.cancel()
    return run


# -- the report ----------------------------------------------------------------------------------
def summary(run: Run) -> dict[str, Any]:
    ok = [o for o in run.outcomes if o.error is None]
    row: dict[str, Any] = {"policy": run.label, "load": run.load, "rate": round(run.rate, 2),
                           "requests": len(run.outcomes), "failed": len(run.outcomes) - len(ok)}
    for name, long in (("short", False), ("long", True)):
        mine = [o for o in ok if o.job.long is long]
        ttfb = sorted(o.ttfb for o in mine if o.ttfb is not None)
        e2e = sorted(o.latency for o in mine if o.latency is not None)
        row[name] = {"n": len(mine), "ttfb_p50": percentile(ttfb, 50),
                     "ttfb_p99": percentile(ttfb, 99), "e2e_p50": percentile(e2e, 50),
                     "e2e_p99": percentile(e2e, 99)}
    tokens = sum(o.job.tokens for o in ok)
    row["tokens_per_s"] = tokens / run.wall if run.wall else None
    row["requests_per_s"] = len(ok) / run.wall if run.wall else None
    row["hit_rate"] = run.hit_rate
    row["encoder_hit_rate"] = run.encoder_hit_rate
    row["spread"] = run.spread
    row["step_overrun"] = run.overrun
    row["worst"] = [{"at": round(o.job.at, 3), "long": o.job.long, "ttfb": o.ttfb,
                     "e2e": o.latency} for o in sorted(
                         ok, key=lambda o: -(o.ttfb or 0))[:5]]
    return row


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f} %"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def render(rows: list[dict[str, Any]], ideal: float, decisions: dict[str, float]) -> str:
    lines = [
        "| policy (decode, or E/P/D) | load | short TTFT p50 / p99 ms | short e2e p50 / p99 ms "
        "| long e2e p50 / p99 ms | tokens/s | prefix hit (ideal "
        f"{100 * ideal:.0f} %) | encoder hit | spread P / D | step overrun |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        s, lg = r["short"], r["long"]
        lines.append(
            f"| {r['policy']} | {r['load']:.0%} ({r['rate']}/s) "
            f"| {_ms(s['ttfb_p50'])} / {_ms(s['ttfb_p99'])} "
            f"| {_ms(s['e2e_p50'])} / {_ms(s['e2e_p99'])} "
            f"| {_ms(lg['e2e_p50'])} / {_ms(lg['e2e_p99'])} "
            f"| {r['tokens_per_s']:.0f} | {_pct(r['hit_rate'])} | {_pct(r['encoder_hit_rate'])} "
            f"| {_x(r['spread']['prefill'])} / {_x(r['spread']['decode'])} "
            f"| {_pct(r['step_overrun'])} |"
            + (f" {r['failed']} failed" if r["failed"] else ""))
    lines.append("")
    lines.append(render_decisions(decisions))
    return "\n".join(lines)


def render_decisions(decisions: dict[str, float]) -> str:
    return ("decision cost (µs per decode decision, the pipeline's path, 2 instances x DP8, "
            "16 slots, best of 5): "
            + ", ".join(f"{name} {cost:.1f}" for name, cost in decisions.items()))


def decision_costs(rounds: int) -> dict[str, float]:
    """Microseconds per decode decision of each policy, on the path a request takes: a
    ``Proxy`` built from ``Settings`` (16 slots: 2 instances x DP8; the default size
    tie-break) and ``choose_slot`` on its health view, as the pipeline calls it, with the
    prompt's hint (``prompt_text`` and ``prefix_hint``; 16 prompts with 2 KiB shared prefixes)
    computed for ``cache_aware``, as the pipeline does per request. Each decision takes its
    slot (and its ``max_tokens``); the one 32 decisions back is released, so about 32 are in
    flight. The best of 5 equal chunks of ``rounds``: on a shared machine the others' load
    only ever adds to a chunk's time."""
    return trio.run(_decision_costs, rounds)


async def _decision_costs(rounds: int) -> dict[str, float]:
    from collections import deque

    instances = tuple(Instance(f"http://i{k}:8000", 8) for k in range(2))
    prompts = [{"messages": [
        {"role": "system", "content": f"You are careful assistant number {p}. " * 60},
        {"role": "user", "content": f"Question {q}: what is the weather like?"}]}
        for p in range(16) for q in range(4)]
    costs = {}
    clock = time.perf_counter
    for name in ("round_robin", "least_loaded", "power_of_two", "cache_aware"):
        proxy = Proxy(Settings(decode_urls=instances, decode_policy=name), moriio_listener=False)
        cursor, loads = proxy.decodes, proxy.loads
        usable = proxy.registry.usable("decode")
        held: deque[Any] = deque()
        elapsed = 0.0
        chunk = max(rounds // 5, 1)
        best = math.inf
        for i in range(chunk * 5):
            prompt = prompts[i % len(prompts)]
            started = clock()
            hint: PrefixHint | None = (prefix_hint(prompt_text(prompt)) if name == "cache_aware"
                                       else None)
            slot = await choose_slot(cursor, usable, hint, ())
            elapsed += clock() - started
            assert slot is not None
            key = (slot[0].url, slot[1])
            held.append((loads.take("decode", key), loads.take(DECODE_TOKENS, key, 16)))
            if len(held) > 32:
                for release in held.popleft():
                    release()
            if (i + 1) % chunk == 0:
                best, elapsed = min(best, elapsed / chunk), 0.0
        costs[name] = best * 1e6
    return costs


def plot(rows: list[dict[str, Any]], path: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "--plot needs matplotlib (pip install matplotlib); skipped"
    fig, ax = plt.subplots(figsize=(6, 4))
    for label in dict.fromkeys(r["policy"] for r in rows):
        mine = [r for r in rows if r["policy"] == label]
        ax.plot([r["load"] for r in mine], [r["short"]["e2e_p99"] * 1000 for r in mine],
                marker="o", label=label)
    ax.set_xlabel("offered load (share of estimated capacity)")
    ax.set_ylabel("short requests: p99 end-to-end (ms)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    return f"plot written to {path}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.policies", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policies", default=",".join(POLICY_SETS),
                   help="policy sets to compare: names of the defaults, or E/P/D triples like "
                   "round_robin/cache_aware/least_loaded, with /counts appended for no size "
                   "tie-break (comma-separated)")
    p.add_argument("--load", type=float, default=0.8, help="share of estimated capacity")
    p.add_argument("--loads", help="several loads, comma-separated (for --plot)")
    p.add_argument("--duration", type=float, default=50.0, help="seconds of arrivals per run")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    p.add_argument("--encoders", type=int, default=2)
    p.add_argument("--prefills", type=int, default=2)
    p.add_argument("--prefill-dp", type=int, default=2)
    p.add_argument("--decodes", type=int, default=2)
    p.add_argument("--decode-dp", type=int, default=2)
    p.add_argument("--long-share", type=float, default=0.1)
    p.add_argument("--short-tokens", type=int, default=16)
    p.add_argument("--long-tokens", type=int, default=256)
    p.add_argument("--prefix-share", type=float, default=0.7,
                   help="share of prompts starting with a shared prefix")
    p.add_argument("--prefixes", type=int, default=16, help="distinct shared prefixes")
    p.add_argument("--prefix-words", type=int, default=512, help="tokens per shared prefix")
    p.add_argument("--question-words", type=int, default=32)
    p.add_argument("--image-share", type=float, default=0.3)
    p.add_argument("--images", type=int, default=24, help="distinct images")
    defaults = EngineConfig()
    p.add_argument("--max-num-seqs", type=int, default=4)
    # Twice the engine's default step times: the client, proxy and fakes share one event loop,
    # whose lag lengthens every simulated step (the "step overrun" column); longer steps keep
    # that lag a smaller share of them on a busy machine.
    p.add_argument("--step-base", type=float, default=2 * defaults.step_base)
    p.add_argument("--step-per-seq", type=float, default=2 * defaults.step_per_seq)
    p.add_argument("--prefill-per-token", type=float, default=2 * defaults.prefill_per_token)
    p.add_argument("--cache-blocks", type=int, default=256,
                   help="prefix-cache blocks (16 tokens) per rank")
    p.add_argument("--encoder-cache-items", type=int, default=8)
    p.add_argument("--replicas", default="1",
                   help="proxy replicas sharing the engines, comma-separated to compare "
                   "(e.g. 1,3); more than 1 shares their state through Redis: --state-url, or "
                   "a redis-server the bench starts on a free port")
    p.add_argument("--state-url", help="the Redis of --replicas (default: one started here)")
    p.add_argument("--compare-placement", action="store_true",
                   help="with --replicas above 1, also run without cache_aware's shared "
                   "placement (each replica learning alone), to show what it brings")
    p.add_argument("--decision-rounds", type=int, default=20_000)
    p.add_argument("--decisions-only", action="store_true",
                   help="only measure the cost of one decision per policy (seconds, no engine)")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--plot", metavar="PATH.png", help="short p99 e2e vs load (matplotlib)")
    return p.parse_args(argv)


def policy_sets(spec: str) -> dict[str, tuple[str, str, str, bool]]:
    """Named default sets, or ``E/P/D`` triples (``/counts`` appended: no size tie-break)."""
    sets = {}
    for name in (s.strip() for s in spec.split(",") if s.strip()):
        if name in POLICY_SETS:
            sets[name] = POLICY_SETS[name]
        else:
            parts = name.split("/")
            counts = parts[3:] == ["counts"]
            if len(parts) != 3 + counts:
                raise SystemExit(f"bench.policies: bad policy set {name!r}")
            sets[name] = (parts[0], parts[1], parts[2], not counts)
    return sets


async def run_all(args: argparse.Namespace) -> list[Run]:
    config = replace(EngineConfig(), max_num_seqs=args.max_num_seqs, step_base=args.step_base,
                     step_per_seq=args.step_per_seq, prefill_per_token=args.prefill_per_token,
                     cache_blocks=args.cache_blocks,
                     encoder_cache_items=args.encoder_cache_items)
    loads = [float(x) for x in args.loads.split(",")] if args.loads else [args.load]
    counts = [int(x) for x in args.replicas.split(",")]
    runs = []
    with ExitStack() as stack:
        state_url = args.state_url
        if state_url is None and max(counts) > 1:
            state_url = stack.enter_context(RedisServer()).url
        for load in loads:
            rate = load * capacity(args, config)
            jobs = workload(args, rate)
            for label, policies in policy_sets(args.policies).items():
                for count in counts:
                    for placement in ((True, False) if count > 1 and args.compare_placement
                                      else (True,)):
                        print(f"  {label} x{count} at {load:.0%} ({rate:.1f} requests/s, "
                              f"{len(jobs)} requests)...", file=sys.stderr, flush=True)
                        runs.append(await run_once(args, label, policies, load, config, jobs,
                                                   rate, count, state_url, placement))
    return runs


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.decisions_only:
        print(render_decisions(decision_costs(args.decision_rounds)))
        return 0
    cpu = time.process_time()
    runs = trio.run(run_all, args)
    cpu = time.process_time() - cpu
    rows = [summary(r) for r in runs]
    config_rate = runs[0].rate / runs[0].load if runs else math.nan
    jobs = workload(args, runs[0].rate) if runs else []
    ideal = ideal_hit_rate(jobs)
    decisions = decision_costs(args.decision_rounds)
    print(render(rows, ideal, decisions))
    print(f"estimated capacity {config_rate:.1f} requests/s; this process used {cpu:.0f} s of "
          "CPU (client, proxy and fakes share one event loop)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "ideal_hit_rate": ideal, "decisions_us": decisions}, f,
                      indent=1)
    if args.plot:
        print(plot(rows, args.plot))
    return 0 if all(r["failed"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
