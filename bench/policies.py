"""Routing policies compared on the simulated engine: the same open-loop mixed load through each.

    python -m bench.policies                           # every default set (about 6 min)
    python -m bench.policies --duration 10 --load 0.6  # shorter, lighter
    python -m bench.policies --duration 10 --replicas 3 --direct-share 0.2
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
hit rate, and the load spread (most requests on one slot over the mean, per stage). Beside the
ideal, two upper bounds for what it does not model: the ranks' caches bounded
(``bounded_ideal_hit_rate``) and, with direct traffic, the direct requests' slots given
(``placed_ideal_hit_rate``). Then the cost of one policy decision on the pipeline's own path,
measured in this process (``--decision-rounds``; ``--decisions-only`` runs just that).

precise_cache_aware routes on the engines' own KV cache events: every prefill and decode fake
renders prompts (``render=True``) and publishes its cache's events on vLLM's ZMQ wire (a
``KVEventPublisher`` each, for every policy set alike), named in the proxy's URLs where a stage's
policy is precise. ``--replicas N``: N proxies over the same engines, each subscribing itself
(cache_aware's placement is shared through Redis). ``--direct-share``: requests sent straight to
a prefill engine, unseen by the proxy. ``--cache-share``: each rank's cache sized as a share of
the workload's reused blocks.

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
from collections import OrderedDict
from collections.abc import Container, Sequence
from contextlib import AsyncExitStack, ExitStack
from dataclasses import dataclass, field, fields, replace
from itertools import pairwise
from typing import Any

import orjson
import trio

from bench._load import _exchange, request_head
from bench.burst import percentile
from epd_trio import Settings
from epd_trio._core.policies import PrefixHint, prefix_hint, prompt_text
from epd_trio._core.rewrite import item_uuid
from epd_trio._core.roster import Card
from epd_trio._core.routing import Instance, parse_instance
from epd_trio._proxy import Proxy
from epd_trio._state.cursors import choose_slot
from epd_trio._state.loads import DECODE_TOKENS
from epd_trio.testing import FakeVLLM
from epd_trio.testing.cluster import serve_proxy
from epd_trio.testing.fake_kv import KVConfig
from epd_trio.testing.fake_vllm import Behaviour
from epd_trio.testing.kv_publisher import KVEventPublisher
from epd_trio.testing.prefix_cache import chained_hashes
from epd_trio.testing.redis_server import RedisServer
from epd_trio.testing.render import render_chat
from epd_trio.testing.sim_engine import EngineConfig, SimEngine

CHAT = "/v1/chat/completions"
#: The request id prefix of the requests sent straight to a prefill engine.
DIRECT_ID = "direct-"
#: The engines' block size (``EngineConfig.block_tokens``) and the proxy's ``kv_block_size``.
BLOCK_TOKENS = 16
#: The policy sets compared by default: label -> (encode, prefill, decode, size tie-break).
POLICY_SETS: dict[str, tuple[str, str, str, bool]] = {
    "round_robin": ("round_robin", "round_robin", "round_robin", True),
    "decode least_loaded (counts only)": ("round_robin", "round_robin", "least_loaded", False),
    "decode least_loaded": ("round_robin", "round_robin", "least_loaded", True),
    "decode power_of_two": ("round_robin", "round_robin", "power_of_two", True),
    "cache_aware + least_loaded": ("cache_aware", "cache_aware", "least_loaded", True),
    "precise_cache_aware + least_loaded": ("cache_aware", "precise_cache_aware", "least_loaded",
                                           True),
}


@dataclass(frozen=True, slots=True)
class Job:
    """One request of the workload."""

    at: float
    long: bool
    body: bytes
    #: The rendered prompt's block hashes (media items named by the proxy's uuid) and length.
    prefill_blocks: tuple[int, ...]
    tokens: int
    prompt_tokens: int = 0
    #: Sent straight to this prefill slot (index over instances x DP ranks), not through the
    #: proxy: a prefill leg some other client sends (``--direct-share``). None: through the proxy.
    direct: int | None = None


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
    #: With direct requests: the prefill hit rate of the proxied ones alone (the answers'
    #: ``usage.prompt_tokens_details.cached_tokens``).
    proxied_hit_rate: float | None = None
    spread: dict[str, float | None] = field(default_factory=dict)
    overrun: float | None = None
    #: The precise policy's counters, summed over the replicas (``KV_SAMPLES``); None without.
    kv: dict[str, float] | None = None


# -- the workload (pure) -------------------------------------------------------------------------
def workload(args: argparse.Namespace, rate: float) -> list[Job]:
    """The request sequence of one run: Poisson arrivals at ``rate`` for ``args.duration`` s.
    A ``--direct-share`` of them (drawn from their own random sequence, so the rest of the
    workload does not change with it) go straight to a prefill slot."""
    rng = random.Random(args.seed)
    direct_rng = random.Random(args.seed + 1)
    slots = args.prefills * args.prefill_dp
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
        tagged = with_uuids(body)  # as the proxy sends it on, and as the engine caches it
        rendered = render_chat(tagged)
        blocks = chained_hashes(rendered.token_ids, BLOCK_TOKENS, seed=0,
                                extra_keys=rendered.extra_keys(BLOCK_TOKENS))
        direct = (direct_rng.randrange(slots) if direct_rng.random() < args.direct_share
                  else None)
        jobs.append(Job(at, long, orjson.dumps(body if direct is None else tagged),
                        tuple(blocks), tokens, len(rendered.token_ids), direct))


def with_uuids(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` with each media part's ``uuid`` as the proxy sets it (``item_uuid``): a direct
    request names its items the same way, so its blocks are the proxied requests' blocks."""
    messages = []
    for message in body["messages"]:
        content = message["content"]
        if isinstance(content, list):
            content = [{**part, "uuid": item_uuid(part)} if part.get("type") == "image_url"
                       else part for part in content]
        messages.append({**message, "content": content})
    return {**body, "messages": messages}


def reused_blocks(jobs: Sequence[Job]) -> int:
    """The workload's reusable working set: distinct blocks found in at least two requests."""
    seen: set[int] = set()
    again: set[int] = set()
    for job in jobs:
        for block in set(job.prefill_blocks):
            (again if block in seen else seen).add(block)
    return len(again)


def _cached_tokens(job: Job, cache: Container[int], block_tokens: int) -> int:
    """The tokens of ``job``'s leading blocks found in ``cache`` (as vLLM, the last prompt
    token is always computed, so a prompt of whole blocks leaves its last one out)."""
    limit = min(len(job.prefill_blocks), max(job.prompt_tokens - 1, 0) // block_tokens)
    cached = 0
    while cached < limit and job.prefill_blocks[cached] in cache:
        cached += 1
    return cached * block_tokens


def ideal_hit_rate(jobs: Sequence[Job], block_tokens: int = 16, *,
                   proxied_only: bool = False) -> float:
    """The hit rate of one unbounded prefix cache over the whole sequence (direct requests
    included, as the engines count them): the best any routing can do (a block's first
    occurrence always misses; as vLLM, the last prompt token is always computed).
    ``proxied_only``: the same cache, counting only the proxied requests' lookups."""
    seen: set[int] = set()
    hits = total = 0
    for job in jobs:
        if proxied_only and job.direct is not None:
            seen.update(job.prefill_blocks)
            continue
        total += job.prompt_tokens
        hits += _cached_tokens(job, seen, block_tokens)
        seen.update(job.prefill_blocks)
    return hits / total if total else 0.0


def pooled_hit_rate(jobs: Sequence[Job], blocks: int, block_tokens: int = 16) -> float:
    """The hit rate of one LRU prefix cache of ``blocks`` blocks over the whole sequence: the
    prefill ranks' caches pooled, as if routing made them one. A reference for bounded caches,
    where the unbounded ideal is out of reach; not a bound (a router that kept unique prompts
    off the ranks holding shared prefixes could beat plain LRU)."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = total = 0
    for job in jobs:
        total += job.prompt_tokens
        hits += _cached_tokens(job, cache, block_tokens)
        for block in reversed(job.prefill_blocks):  # tail first, as the engines' caches do
            cache[block] = None
            cache.move_to_end(block)
        while len(cache) > blocks:
            cache.popitem(last=False)
    return hits / total if total else 0.0


def _presentations(jobs: Sequence[Job],
                   block_tokens: int) -> dict[int, list[tuple[int, bool]]]:
    """Per block, each job that carries it, in order: (job index, whether a hit there would
    count, i.e. the block lies within the job's lookup limit: vLLM computes the last prompt
    token, so a prompt of whole blocks never hits its last one)."""
    shown: dict[int, list[tuple[int, bool]]] = {}
    for t, job in enumerate(jobs):
        limit = min(len(job.prefill_blocks), max(job.prompt_tokens - 1, 0) // block_tokens)
        for i, block in enumerate(dict.fromkeys(job.prefill_blocks)):
            shown.setdefault(block, []).append((t, i < limit))
    return shown


def bounded_ideal_hit_rate(jobs: Sequence[Job], blocks: int, block_tokens: int = 16) -> float:
    """An upper bound on the hit rate any routing reaches when the prefill ranks hold
    ``blocks`` blocks between them (their caches' total), on this sequence in arrival order.

    Why it bounds every router: a hit of block x on a rank at job b needs x on that rank since
    the job before b that carried x (x can only have entered a rank when a job carried it), so
    x is in the union of the ranks' caches over that interval, and the union never holds more
    than ``blocks``. Relaxing further (a job's blocks need not share a rank, a block need not be
    stored, a hit need not have its leading blocks: the hits are counted block by block), the
    best schedule is the largest set of such intervals, one per hit, never more than ``blocks``
    deep at once: for equal weights the greedy by earliest end (keep an interval if the depth
    allows) finds it (Yannakakis and Gavril, 1987), which is Belady's MIN with bypass.

    Arrival order: the engines admit in their own order, which can let a run pass the bound by
    a point or two, as it passes the unbounded ideal."""
    intervals = []
    for shown in _presentations(jobs, block_tokens).values():
        for (a, _), (b, counted) in pairwise(shown):
            if counted:  # held from job a through job b - 1, a hit at b
                intervals.append((b, a))
    intervals.sort()
    depth = [0] * len(jobs)
    hits = 0
    for b, a in intervals:
        if max(depth[a:b]) < blocks:
            for t in range(a, b):
                depth[t] += 1
            hits += 1
    total = sum(job.prompt_tokens for job in jobs)
    return hits * block_tokens / total if total else 0.0


def placed_ideal_hit_rate(jobs: Sequence[Job], slots: int, block_tokens: int = 16) -> float:
    """An upper bound on the hit rate over all requests when the direct ones stay where their
    sender put them (``Job.direct``) and only the proxied ones are routed, caches unbounded.

    Each block alone: a job finds it on its slot only if an earlier job carrying it went
    there; a dynamic programme over the set of slots holding the block (2^``slots`` states)
    chooses the proxied jobs' slots best for that block, knowing the future. Each block
    choosing its own slots relaxes "a job goes to one slot", and the sum of the blocks' bests
    bounds what any routing of whole jobs reaches."""
    hits = 0
    for shown in _presentations(jobs, block_tokens).values():
        best: dict[int, int] = {0: 0}  # slots holding the block -> most hits so far
        for t, counted in shown:
            direct = jobs[t].direct
            choices = range(slots) if direct is None else (direct,)
            after: dict[int, int] = {}
            for mask, got in best.items():
                for slot in choices:
                    bit = 1 << slot
                    value = got + (counted and bool(mask & bit))
                    if after.get(mask | bit, -1) < value:
                        after[mask | bit] = value
            best = after
        hits += max(best.values())
    total = sum(job.prompt_tokens for job in jobs)
    return hits * block_tokens / total if total else 0.0


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
    for r in fake.requests(CHAT):
        if r.path != CHAT:  # a render call
            continue
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
    precise = [stage for stage, name in zip(("prefill", "decode"), policies[1:3], strict=True)
               if name == "precise_cache_aware"]
    async with trio.open_nursery() as nursery:
        async def fakes(role: Any, count: int, dp: int) -> list[tuple[FakeVLLM, str]]:
            """Each prefill and decode fake renders and publishes its KV events over ZMQ (for
            every policy set alike, so the engines do the same work); its URL names them
            (``#kv_events=...``) where the stage's policy is precise."""
            made = []
            for _ in range(count):
                publisher = KVEventPublisher(dp_size=dp) if role != "encode" else None
                fake = FakeVLLM(role=role, dp_size=dp, behaviour=behaviour,
                                engine=SimEngine(config, dp), render=role != "encode",
                                kv=None if publisher is None else KVConfig(publisher=publisher,
                                                                   prompt_tokens_details=True))
                await nursery.start(fake.serve)
                spec = f"{fake.url}#dp={dp}"
                if role in precise and publisher is not None and publisher.endpoints:
                    ends = publisher.endpoints
                    spec += f"&kv_events={ends.publish[0]}"
                    if ends.replay:
                        spec += f"&kv_events_replay={ends.replay[0]}"
                made.append((fake, spec))
            return made
        enc_specs = await fakes("encode", args.encoders, 1)
        pre_specs = await fakes("prefill", args.prefills, args.prefill_dp)
        dec_specs = await fakes("decode", args.decodes, args.decode_dp)
        enc, pre, dec = ([f for f, _ in specs] for specs in (enc_specs, pre_specs, dec_specs))
        settings = Settings(
            encode_urls=tuple(Instance(f.url) for f in enc),
            prefill_urls=tuple(parse_instance(spec) for _, spec in pre_specs),
            decode_urls=tuple(parse_instance(spec) for _, spec in dec_specs),
            encode_policy=policies[0], prefill_policy=policies[1], decode_policy=policies[2],
            size_tiebreak=policies[3], metrics=bool(precise), health_interval=60.0,
            kv_block_size=config.block_tokens, render_timeout=args.render_timeout)
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
                route = proxy.route()
                for cursor in (route.encoders, route.prefills, route.decodes):
                    cursor.policy.placement = placement
            with trio.fail_after(30):  # every replica has read the shared state once
                for proxy in proxies:
                    if proxy.state is not None:
                        await proxy.state.roster_loaded.wait()
            followed = sum(f.dp_size for f in pre) * ("prefill" in precise) + sum(
                f.dp_size for f in dec) * ("decode" in precise)
            with trio.fail_after(30):  # every replica follows every slot, each one exact
                for proxy in proxies:
                    if followed:
                        await _all_exact(proxy, followed)
            direct_slots = [(f, rank) for f in pre for rank in range(f.dp_size)]
            spread = random.Random(args.seed)
            started = trio.current_time()

            async def send(job: Job) -> None:
                outcome = Outcome(job)
                run.outcomes.append(outcome)
                t0 = trio.current_time()
                body, extra, streamed = job.body, b"", True
                if job.direct is None:
                    host, port = urls[spread.randrange(len(urls))]
                else:  # a prefill leg another client sends: one token, the KV kept for decode
                    fake, rank = direct_slots[job.direct]
                    host, port = fake.url.removeprefix("http://").split(":")
                    body = orjson.dumps({**orjson.loads(job.body), "max_tokens": 1,
                                         "stream": False, "kv_transfer_params": {
                                             "do_remote_decode": True,
                                             "do_remote_prefill": False}})
                    extra = f"x-request-id: {DIRECT_ID}{job.at:.6f}\r\n".encode()
                    if fake.dp_size > 1:
                        extra += f"x-data-parallel-rank: {rank}\r\n".encode()
                    streamed = False
                head = request_head("POST", CHAT, f"{host}:{port}", len(body))
                if extra:  # before the blank line that ends the head
                    head = head[:-2] + extra + b"\r\n"
                with trio.move_on_after(args.timeout):
                    try:
                        stream = await trio.open_tcp_stream(host, int(port))
                        async with stream:
                            answer = await _exchange(stream, head, body, streamed, False, t0)
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
        if any(job.direct is not None for job in jobs):
            run.proxied_hit_rate = _proxied_hit_rate(pre)
        items = _counter(enc, "fake:encoder_cache_queries")
        run.encoder_hit_rate = (_counter(enc, "fake:encoder_cache_hits") / items
                                if items else None)
        run.spread = {"encode": _spread(enc), "prefill": _spread(pre), "decode": _spread(dec)}
        if precise:
            run.kv = {name: sum(_sample(p, f"epd_trio_kv_{name}", **labels) for p in proxies)
                      for name, labels in KV_SAMPLES.items()}
        ranks = [rank for fake in dec if fake.engine for rank in fake.engine.ranks]
        modelled = sum(r.modelled for r in ranks)
        run.overrun = sum(r.elapsed for r in ranks) / modelled - 1 if modelled else None
        nursery.cancel_scope.cancel()
    return run


def _proxied_hit_rate(prefills: Sequence[FakeVLLM]) -> float | None:
    """The prefill legs' cached share of their prompts, the direct requests left out."""
    cached = prompt = 0
    for fake in prefills:
        for record in fake.requests():
            if record.path != CHAT or (record.request_id or "").startswith(DIRECT_ID):
                continue
            try:
                usage = orjson.loads(bytes(record.sent))["usage"]
            except (orjson.JSONDecodeError, KeyError, TypeError):
                continue
            prompt += usage["prompt_tokens"]
            cached += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return cached / prompt if prompt else None


async def _all_exact(proxy: Proxy, count: int) -> None:
    """Until ``proxy`` follows ``count`` slots, each exact (its replay socket asked)."""
    assert proxy.kv is not None
    await proxy.kv.until_exact(count)


#: The precise policy's counters the report sums over replicas (prefill stage).
KV_SAMPLES = {
    "decisions_total": {"stage": "prefill", "trust": "exact"},
    "render_seconds_count": {"outcome": "ok"},
    "predicted_cached_tokens_total": {"stage": "prefill"},
}


def _sample(proxy: Proxy, name: str, **labels: str) -> float:
    registry = proxy.metrics.registry
    return 0.0 if registry is None else registry.get_sample_value(name, labels) or 0.0


# -- the report ----------------------------------------------------------------------------------
def summary(run: Run) -> dict[str, Any]:
    """Latencies and throughput of the proxied requests (the direct ones are counted apart:
    they only fill the engines' caches); the hit rate is the engines', over all of them."""
    proxied = [o for o in run.outcomes if o.job.direct is None]
    direct = [o for o in run.outcomes if o.job.direct is not None]
    ok = [o for o in proxied if o.error is None]
    row: dict[str, Any] = {"policy": run.label, "load": run.load, "rate": round(run.rate, 2),
                           "requests": len(proxied), "failed": len(proxied) - len(ok),
                           "direct": len(direct),
                           "direct_failed": sum(o.error is not None for o in direct)}
    ttfb = sorted(o.ttfb for o in ok if o.ttfb is not None)
    row["ttfb_p50"], row["ttfb_p99"] = percentile(ttfb, 50), percentile(ttfb, 99)
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
    row["proxied_hit_rate"] = run.proxied_hit_rate
    row["encoder_hit_rate"] = run.encoder_hit_rate
    row["spread"] = run.spread
    row["step_overrun"] = run.overrun
    row["kv"] = run.kv
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


def render(rows: list[dict[str, Any]], ideal: float, decisions: dict[str, float],
           proxied_ideal: float | None = None) -> str:
    proxied = proxied_ideal is not None
    lines = [
        "| policy (decode, or E/P/D) | load | TTFT p50 / p99 ms | short TTFT p50 / p99 ms "
        "| short e2e p50 / p99 ms | long e2e p50 / p99 ms | tokens/s | prefix hit (ideal "
        f"{100 * ideal:.0f} %) | "
        + (f"proxied prefix hit (ideal {100 * proxied_ideal:.0f} %) | " if proxied else "")
        + "encoder hit | spread P / D | step overrun |",
        "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if proxied else ""),
    ]
    notes = []
    for r in rows:
        s, lg = r["short"], r["long"]
        if r.get("kv") is not None:
            kv = r["kv"]
            notes.append(f"{r['policy']}: {kv['decisions_total']:.0f} of {r['requests']} "
                         f"prefill choices on an exact slot's index ({kv['render_seconds_count']:.0f}"
                         " renders answered in time)")
        lines.append(
            f"| {r['policy']} | {r['load']:.0%} ({r['rate']}/s) "
            f"| {_ms(r['ttfb_p50'])} / {_ms(r['ttfb_p99'])} "
            f"| {_ms(s['ttfb_p50'])} / {_ms(s['ttfb_p99'])} "
            f"| {_ms(s['e2e_p50'])} / {_ms(s['e2e_p99'])} "
            f"| {_ms(lg['e2e_p50'])} / {_ms(lg['e2e_p99'])} "
            f"| {r['tokens_per_s']:.0f} | {_pct(r['hit_rate'])} "
            + (f"| {_pct(r['proxied_hit_rate'])} " if proxied else "")
            + f"| {_pct(r['encoder_hit_rate'])} "
            f"| {_x(r['spread']['prefill'])} / {_x(r['spread']['decode'])} "
            f"| {_pct(r['step_overrun'])} |"
            + (f" {r['failed']} failed" if r["failed"] else ""))
    lines.append("")
    if rows and rows[0].get("direct"):
        lines.append(f"{rows[0]['direct']} more requests went straight to the prefill engines "
                     "(not in the latencies and throughput; in the hit rate).")
    lines += notes
    if notes or (rows and rows[0].get("direct")):
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
        # Not started, so nobody asks the instances: they say what they serve here.
        proxy.membership.learned({inst.url: (Card("bench"),) for inst in instances})
        proxy.sync()
        cursor, loads = proxy.route("bench").decodes, proxy.loads
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


_RENDER_TIMEOUT = next(f.default for f in fields(Settings) if f.name == "render_timeout")


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
    p.add_argument("--cache-share", type=float,
                   help="instead of --cache-blocks: each rank's cache holds this share of the "
                   "workload's reusable working set (its distinct blocks found in two requests "
                   "or more), e.g. 0.25")
    p.add_argument("--direct-share", type=float, default=0.0,
                   help="share of the requests sent straight to a prefill engine (a prefill leg "
                   "another client sends), not through the proxy: they fill caches only the "
                   "engines' KV events tell the proxy of")
    p.add_argument("--render-timeout", type=float, default=_RENDER_TIMEOUT,
                   help="seconds the proxy waits for a render (EPD_RENDER_TIMEOUT) before "
                   "routing that request by cache_aware")
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
            if args.cache_share is not None:  # sized from this workload
                reused = reused_blocks(jobs)
                config = replace(config, cache_blocks=max(1, round(args.cache_share * reused)))
                print(f"  cache: {config.cache_blocks} blocks per rank, {args.cache_share:.0%} "
                      f"of the {reused} blocks found in two requests or more",
                      file=sys.stderr, flush=True)
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
    proxied_ideal = (ideal_hit_rate(jobs, proxied_only=True)
                     if any(job.direct is not None for job in jobs) else None)
    decisions = decision_costs(args.decision_rounds)
    print(render(rows, ideal, decisions, proxied_ideal))
    per_rank = (max(1, round(args.cache_share * reused_blocks(jobs)))
                if args.cache_share is not None else args.cache_blocks)
    pooled_blocks = per_rank * args.prefills * args.prefill_dp
    pooled = pooled_hit_rate(jobs, pooled_blocks)
    bounded = bounded_ideal_hit_rate(jobs, pooled_blocks)
    print(f"the prefill ranks' caches pooled as one LRU of {pooled_blocks} blocks would hit "
          f"{100 * pooled:.0f} % (a reference for bounded caches, not a bound); no routing "
          f"can pass {100 * bounded:.0f} % with {pooled_blocks} blocks in all (Belady's MIN "
          f"on them pooled; the unbounded ideal is {100 * ideal:.0f} %)")
    placed = (placed_ideal_hit_rate(jobs, args.prefills * args.prefill_dp)
              if proxied_ideal is not None else None)
    if placed is not None:
        print(f"with the direct requests where they went and the proxied ones routed at best, "
              f"caches unbounded: at most {100 * placed:.0f} % over all requests")
    print(f"estimated capacity {config_rate:.1f} requests/s; this process used {cpu:.0f} s of "
          "CPU (client, proxy and fakes share one event loop)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "ideal_hit_rate": ideal, "pooled_lru_hit_rate": pooled,
                       "bounded_ideal_hit_rate": bounded, "placed_ideal_hit_rate": placed,
                       "proxied_ideal_hit_rate": proxied_ideal, "decisions_us": decisions}, f,
                      indent=1)
    if args.plot:
        print(plot(rows, args.plot))
    return 0 if all(r["failed"] == 0 and r["direct_failed"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
