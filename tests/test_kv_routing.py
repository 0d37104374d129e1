"""Routing on what the engines hold, end to end: fake vLLMs that publish vLLM's KV cache events
over real ZMQ sockets and serve vLLM's render endpoint, and the real proxy in between.

What is checked: a prefix loaded on one prefill instance directly (not through the proxy)
attracts the requests that share it; a render that fails routes by load and never fails the
request; a slot with no events is not trusted; the prefill leg is skipped when decode already
holds the prompt; ``GET /instances`` and ``/metrics`` say what each slot and decision was.
"""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import trio
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from epd_trio import Settings
from epd_trio._core.routing import parse_instance
from epd_trio._observe.tracing import create_tracing
from epd_trio._proxy import Proxy
from epd_trio.testing import FakeVLLM
from epd_trio.testing.cluster import serve_proxy
from epd_trio.testing.fake_kv import KVConfig
from epd_trio.testing.kv_publisher import KVEventPublisher

from helpers import instances_listing, metric, server_process

BLOCK = 4
#: 40 words: with the fake's chat template, ten full blocks of four tokens.
SHARED = " ".join(f"w{i}" for i in range(40))
ADMIN = "admin-key"


def chat(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": "fake-model", "max_tokens": 2,
            "messages": [{"role": "user", "content": text}], **extra}


def legs(fake: FakeVLLM) -> list[Any]:
    """The completion legs a fake answered (render calls left out)."""
    return [r for r in fake.received if r.path == "/v1/chat/completions"]


async def kv_fake(nursery: trio.Nursery, role: str) -> tuple[FakeVLLM, str]:
    """A fake vLLM with a prefix cache of 4-token blocks that publishes its events, and its URL
    for the proxy, naming its publisher and replay socket in the fragment."""
    publisher = KVEventPublisher(dp_size=1, topic="kv")
    fake = FakeVLLM(role, kv=KVConfig(block_size=BLOCK, publisher=publisher), render=True)
    await nursery.start(fake.serve)
    assert publisher.endpoints is not None and publisher.endpoints.replay is not None
    return fake, (f"{fake.url}#kv_events={publisher.endpoints.publish[0]}"
                  f"&kv_events_replay={publisher.endpoints.replay[0]}")


@asynccontextmanager
async def proxy_over(prefills: list[str], decodes: list[str], **settings: Any,
                     ) -> AsyncIterator[tuple[str, Proxy]]:
    config = Settings(prefill_urls=tuple(parse_instance(u) for u in prefills),
                      decode_urls=tuple(parse_instance(u) for u in decodes),
                      kv_block_size=BLOCK, admin_key=ADMIN, **settings)
    async with serve_proxy(config) as (url, proxy):
        yield url, proxy


async def all_exact(proxy: Proxy, count: int) -> None:
    assert proxy.kv is not None
    with trio.fail_after(10):
        await proxy.kv.until_exact(count)


async def until_held(proxy: Proxy, url: str, tokens: int) -> None:
    """Until the index says ``url`` holds at least ``tokens`` tokens in total."""
    assert proxy.kv is not None
    events = proxy.kv.events
    with trio.fail_after(10):
        await events.wait_until(
            lambda: events.stats()[(url, None)].index.entries * BLOCK >= tokens)


async def test_a_prefix_loaded_on_one_prefill_directly_attracts_its_requests(
    nursery: trio.Nursery, client: httpx.AsyncClient,
) -> None:
    (p0, u0), (p1, u1), (d0, ud) = [await kv_fake(nursery, role)
                                    for role in ("prefill", "prefill", "decode")]
    async with proxy_over([u0, u1], [ud], prefill_policy="precise_cache_aware") as (url, proxy):
        await all_exact(proxy, 3)
        # A warm-up job reaches p1 without the proxy: only its events tell the proxy.
        r = await client.post(f"{p1.url}/v1/chat/completions",
                              json=chat(SHARED + " warm"))
        assert r.status_code == 200
        await until_held(proxy, p1.url, 40)
        before = len(legs(p0)), len(legs(p1))
        for i in range(6):
            r = await client.post(f"{url}/v1/chat/completions", json=chat(SHARED + f" q{i}"))
            assert r.status_code == 200, r.text
        # Every one went to p1, though round-robin order and equal loads favour p0 first.
        assert (len(legs(p0)) - before[0], len(legs(p1)) - before[1]) == (0, 6)
        assert metric(proxy, "epd_trio_kv_decisions_total", stage="prefill",
                      trust="exact") == 6
        assert metric(proxy, "epd_trio_kv_predicted_cached_tokens_total", stage="prefill") >= 6 * 40
        listing = await client.get(f"{url}/instances", headers={"x-api-key": ADMIN})
        slots = {entry["url"]: entry for entry in listing.json()["kv_index"]}
        assert set(slots) == {p0.url, p1.url, d0.url}
        assert {entry["trust"] for entry in slots.values()} == {"exact"}
        assert slots[p1.url]["blocks"] >= 10 and slots[p1.url]["events"] >= 1


async def test_a_failed_render_routes_by_load_and_the_request_still_succeeds(
    nursery: trio.Nursery, client: httpx.AsyncClient,
) -> None:
    (p0, u0), (p1, u1), (_, ud) = [await kv_fake(nursery, role)
                                   for role in ("prefill", "prefill", "decode")]
    async with proxy_over([u0, u1], [ud], prefill_policy="precise_cache_aware") as (url, proxy):
        await all_exact(proxy, 3)
        for fake in (p0, p1):
            fake.behaviour.render_fail_status = 500
        r = await client.post(f"{url}/v1/chat/completions", json=chat(SHARED))
        assert r.status_code == 200, r.text
        assert metric(proxy, "epd_trio_kv_render_seconds_count", outcome="error") == 1
        assert metric(proxy, "epd_trio_kv_decisions_total", stage="prefill", trust="exact") == 0


async def test_a_slot_without_events_holds_nothing(
    nursery: trio.Nursery, client: httpx.AsyncClient,
) -> None:
    """p1 is told to publish where nothing listens: it stays FALLBACK and never attracts."""
    (_, u0), (_, ud) = [await kv_fake(nursery, role) for role in ("prefill", "decode")]
    p1 = FakeVLLM("prefill", render=True)
    await nursery.start(p1.serve)
    silent = f"{p1.url}#kv_events=tcp://127.0.0.1:9"
    async with proxy_over([u0, silent], [ud], prefill_policy="precise_cache_aware",
                          ) as (url, proxy):
        assert proxy.kv is not None
        with trio.fail_after(10):
            await proxy.kv.events.wait_until(
                lambda: proxy.kv is not None and len(proxy.kv.events.stats()) == 3)
        assert proxy.kv.trust((p1.url, None)).value == "fallback"
        r = await client.post(f"{url}/v1/chat/completions", json=chat(SHARED))
        assert r.status_code == 200
        listing = (await client.get(f"{url}/instances", headers={"x-api-key": ADMIN})).json()
        trust = {entry["url"]: entry["trust"] for entry in listing["kv_index"]}
        assert trust[p1.url] == "fallback"


async def test_the_prefill_leg_is_skipped_when_decode_holds_the_prompt(
    nursery: trio.Nursery, client: httpx.AsyncClient,
) -> None:
    (p0, u0), (d0, ud) = [await kv_fake(nursery, role) for role in ("prefill", "decode")]
    async with proxy_over([u0], [ud], decode_policy="precise_cache_aware",
                          pd_uncached_token_threshold=8) as (url, proxy):
        await all_exact(proxy, 2)
        body = chat(SHARED)
        r = await client.post(f"{url}/v1/chat/completions", json=body)
        assert r.status_code == 200
        assert len(legs(p0)) == 1  # the first turn went through prefill
        # Decode stored the blocks it pulled (the fake does, as vLLM's decode caches them).
        await until_held(proxy, d0.url, 40)
        r = await client.post(f"{url}/v1/chat/completions", json=body)
        assert r.status_code == 200
        assert len(legs(p0)) == 1  # the second turn: decode alone
        assert "kv_transfer_params" not in legs(d0)[-1].body
        assert metric(proxy, "epd_trio_prefill_bypassed_total") == 1


async def test_each_replica_routes_on_the_events_it_reads_itself(
    nursery: trio.Nursery, client: httpx.AsyncClient,
) -> None:
    """Two proxy replicas over the same engines, no shared store: each subscribes on its own,
    and both send a prefix loaded directly on p1 there."""
    (p0, u0), (p1, u1), (_, ud) = [await kv_fake(nursery, role)
                                   for role in ("prefill", "prefill", "decode")]
    async with proxy_over([u0, u1], [ud], prefill_policy="precise_cache_aware") as (a, pa), \
            proxy_over([u0, u1], [ud], prefill_policy="precise_cache_aware") as (b, pb):
        for proxy in (pa, pb):
            await all_exact(proxy, 3)
        r = await client.post(f"{p1.url}/v1/chat/completions", json=chat(SHARED + " warm"))
        assert r.status_code == 200
        for proxy in (pa, pb):
            await until_held(proxy, p1.url, 40)
        before = len(legs(p0)), len(legs(p1))
        for i in range(4):
            for url in (a, b):
                r = await client.post(f"{url}/v1/chat/completions", json=chat(SHARED + f" {i}"))
                assert r.status_code == 200, r.text
        assert (len(legs(p0)) - before[0], len(legs(p1)) - before[1]) == (0, 8)


async def test_every_worker_of_epd_trio_serve_subscribes_and_routes_on_the_index(
    nursery: trio.Nursery, client: httpx.AsyncClient,
) -> None:
    (p0, u0), (p1, u1), (_, ud) = [await kv_fake(nursery, role)
                                   for role in ("prefill", "prefill", "decode")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPD_")}
    env.update(EPD_PREFILL_URLS=f"{u0},{u1}", EPD_DECODE_URLS=ud, EPD_ADMIN_KEY=ADMIN,
               EPD_PREFILL_POLICY="precise_cache_aware", EPD_KV_BLOCK_SIZE=str(BLOCK))
    command = [sys.executable, "-m", "epd_trio", "serve", "--port", "0", "--workers", "2"]
    async with server_process(nursery, command, env, limit=60) as served:
        r = await client.post(f"{p1.url}/v1/chat/completions", json=chat(SHARED + " warm"))
        assert r.status_code == 200
        # Each worker has its own index: wait until two of them say p1 holds the prefix.
        ready: set[int] = set()
        with trio.fail_after(60):
            while len(ready) < 2:
                report = await instances_listing(served.url, ADMIN)
                held = {e["url"]: e for e in report["kv_index"]}
                if held[p1.url]["trust"] == "exact" and held[p1.url]["blocks"] >= 10:
                    ready.add(report["worker_pid"])
                else:
                    await trio.sleep(0.05)
        before = len(legs(p0)), len(legs(p1))
        async with httpx.AsyncClient(trust_env=False, timeout=10) as fresh:
            for i in range(6):  # a connection each, so both workers take some
                r = await fresh.post(f"{served.url}/v1/chat/completions",
                                     json=chat(SHARED + f" {i}"), headers={"connection": "close"})
                assert r.status_code == 200, r.text
        assert (len(legs(p0)) - before[0], len(legs(p1)) - before[1]) == (0, 6)


async def test_the_render_call_has_its_own_span_and_carries_the_trace(
    nursery: trio.Nursery, client: httpx.AsyncClient,
) -> None:
    exporter = InMemorySpanExporter()
    tracing = create_tracing({}, exporter=exporter)
    (p0, u0), (_, ud) = [await kv_fake(nursery, role) for role in ("prefill", "decode")]
    config = Settings(prefill_urls=(parse_instance(u0),), decode_urls=(parse_instance(ud),),
                      kv_block_size=BLOCK, prefill_policy="precise_cache_aware")
    async with serve_proxy(config, tracing=tracing) as (url, proxy):
        await all_exact(proxy, 2)
        r = await client.post(f"{url}/v1/chat/completions", json=chat(SHARED))
        assert r.status_code == 200
    spans = exporter.get_finished_spans()
    (server,) = [s for s in spans if s.kind is SpanKind.SERVER]
    (render,) = [s for s in spans if s.name == "render"]
    assert render.kind is SpanKind.CLIENT and render.parent.span_id == server.context.span_id
    assert render.attributes["url.full"] == f"{p0.url}/v1/chat/completions/render"
    assert render.attributes["epd_trio.outcome"] == "ok"
    (call,) = [r for r in p0.received if r.path.endswith("/render")]
    assert call.headers["traceparent"].split("-")[2] == f"{render.context.span_id:016x}"
