"""precise_cache_aware against real vLLM 0.32 on CPU: its KV cache events and its render endpoint.

The servers (conftest ``kv_servers``, ``cluster.start_kv_cluster``): two prefills (NIXL
producers) and a decode (NIXL consumer) of the tiny text model, each publishing its KV cache
events over ZMQ with a replay socket, serving the render endpoint (``--enable-scale-out``),
with 32-token blocks. The proxy runs in-process in front of them, told each server's event
sockets in its URL's fragment.

Every prompt is new to the servers (a random tag in its first words), so that a reused server's
prefix cache or an earlier test's blocks never count. Where a request landed is read on both
sides: the proxy's count of legs sent per instance, and vLLM's own ``vllm:prefix_cache_hits``.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import httpx
import pytest
import trio
import zmq

from epd_trio import Proxy, Settings
from epd_trio._core.policies import CachedPrefix
from epd_trio._core.routing import parse_instance
from epd_trio._kv.keys import ROOT_KEY, chain_keys, request_keys
from epd_trio._kv.prompt import RenderedPrompt, rendered_prompt
from epd_trio._kv.wire import BlockStored, decode_batch, split_message
from epd_trio.testing import serve_proxy

from .cluster import KV_BLOCK_SIZE, MODEL_NAME, Cluster
from helpers import metric as proxy_metric

pytestmark = pytest.mark.vllm_e2e

CHAT = "/v1/chat/completions"
ADMIN = "e2e-admin-key"
#: vLLM's counter of prompt tokens served from its prefix cache (``_total`` in the exposition).
PREFIX_HITS = "vllm:prefix_cache_hits"
#: A shared prefix of this many words: about 10 tokens a word with the tiny tokenizer and the
#: chat template, so well over several 32-token blocks.
PREFIX_WORDS = 40
#: Seconds for an engine's events to reach the proxy's index (a loaded 2-core machine).
EVENTS_DEADLINE = 30.0
#: Seconds for a new proxy's every slot to be exact. Three engines on 2 cores put the load at
#: 9 to 10, and once every replay of a 30 s wait went unanswered within the proxy's 2 s; the
#: proxy asks again after 2, 4, 8, 16 and 32 s (its first-replay back-off), so this covers six
#: asks where 30 s covered four.
SYNC_DEADLINE = 90.0
#: Render calls on a loaded machine can take seconds; the default (0.5 s) would fall back.
RENDER_TIMEOUT = 30.0

Observe = Callable[[str], None]


# -- requests and metrics --------------------------------------------------------------------------
def new_prefix(words: int = PREFIX_WORDS) -> str:
    """A prefix no server has seen: a random tag first, so even its first block is new."""
    tag = secrets.token_hex(6)
    return f"tag {tag}: " + " ".join(f"{tag[i % 12]}item{i} of the list," for i in range(words))


def chat(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": text}],
            "max_tokens": 4, "temperature": 0, **extra}


async def vllm_metric(client: httpx.AsyncClient, url: str, name: str) -> float:
    """The sum of a vLLM counter's samples on ``url``/metrics (``name`` or ``name_total``)."""
    page = (await client.get(url + "/metrics")).text
    values = []
    for line in page.splitlines():
        for full in (name, name + "_total"):
            if line.startswith(full) and line[len(full):len(full) + 1] in ("{", " "):
                values.append(float(line.rsplit(" ", 1)[1]))
    assert values, f"{url}/metrics has no {name}"
    return sum(values)


async def prefix_hits(client: httpx.AsyncClient, servers: Cluster) -> dict[str, float]:
    return {name: await vllm_metric(client, servers.url(name), PREFIX_HITS)
            for name in ("prefill0", "prefill1")}


# -- the proxy and its index -----------------------------------------------------------------------
@asynccontextmanager
async def proxy_over(servers: Cluster, **settings: Any) -> AsyncIterator[tuple[str, Proxy]]:
    """The proxy in front of prefill0 + prefill1 -> decode, following their KV events; every
    slot exact (each asked its replay socket) before it is yielded."""
    instances = {name: parse_instance(server.kv_events) for name, server in servers.servers.items()}
    config = Settings(prefill_urls=(instances["prefill0"], instances["prefill1"]),
                      decode_urls=(instances["decode"],), kv_block_size=KV_BLOCK_SIZE,
                      admin_key=ADMIN, render_timeout=RENDER_TIMEOUT,
                      **{"prefill_policy": "precise_cache_aware", **settings})
    async with serve_proxy(config) as (url, proxy):
        await until(proxy, lambda: len(slots(proxy)) == 3
                    and all(s["trust"] == "exact" for s in slots(proxy).values()),
                    SYNC_DEADLINE)
        yield url, proxy


def slots(proxy: Proxy) -> dict[str, dict[str, Any]]:
    """The index's report per instance URL (what ``GET /instances`` lists as ``kv_index``)."""
    assert proxy.kv is not None, "the proxy has no KV index"
    return {url: entry for (url, _rank), entry in proxy.kv.report().items()}


async def until(proxy: Proxy, ok: Callable[[], bool], deadline: float = EVENTS_DEADLINE) -> None:
    assert proxy.kv is not None, "the proxy has no KV index"
    with trio.move_on_after(deadline):
        await proxy.kv.events.wait_until(ok)
        return
    pytest.fail(f"the KV index did not get there in {deadline:g} s: {slots(proxy)}")


async def listing(client: httpx.AsyncClient, url: str) -> dict[str, dict[str, Any]]:
    """``GET /instances``' kv_index entries by instance URL."""
    response = await client.get(url + "/instances", headers={"x-api-key": ADMIN})
    assert response.status_code == 200, response.text
    return {entry["url"]: entry for entry in response.json()["kv_index"]}


def common_blocks(keys: list[int], others: list[int]) -> int:
    """How many leading blocks two prompts share (their keys agree up to there)."""
    count = 0
    for key, other in zip(keys, others, strict=False):
        if key != other:
            break
        count += 1
    return count


def sent(proxy: Proxy, servers: Cluster) -> dict[str, int]:
    """The prefill legs the proxy sent to each prefill."""
    return {name: proxy.registry.state("prefill", servers.url(name)).sent
            for name in ("prefill0", "prefill1")}


async def rendered(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> RenderedPrompt:
    """``body``'s prompt, from ``url``'s render endpoint."""
    response = await client.post(url + CHAT + "/render", json=body)
    assert response.status_code == 200, response.text
    prompt = rendered_prompt(response.json())
    assert prompt is not None
    return prompt


async def rendered_keys(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> list[int]:
    """The index keys of ``body``'s prompt, from ``url``'s render endpoint."""
    prompt = await rendered(client, url, body)
    return prompt.keys(KV_BLOCK_SIZE, cache_salt=body.get("cache_salt"))


def reusable_tokens(prompt: RenderedPrompt) -> int:
    """The proxy's prediction (``CachedPrefix.reusable``) of the cached tokens vLLM reports
    for ``prompt`` when a slot holds every full block of it: vLLM recomputes at least the
    last token to get its logits, so a prompt of exactly N blocks reuses N - 1 of them."""
    held = {("slot", None): len(prompt.keys(KV_BLOCK_SIZE)) * KV_BLOCK_SIZE}
    cached = CachedPrefix.reusable(len(prompt.token_ids), held, KV_BLOCK_SIZE)
    return cached.held.get(("slot", None), 0)


# -- tests -----------------------------------------------------------------------------------------
async def test_requests_sharing_a_prefix_land_on_the_prefill_that_holds_it(
    kv_servers: Cluster, client: httpx.AsyncClient, observe: Observe
) -> None:
    """The first request's prefill publishes the prefix's blocks; the next ones, by the index,
    all go to that prefill, and vLLM's own prefix-cache hits rise there and nowhere else."""
    prefix = new_prefix()
    first_body = chat(prefix + " first question")
    async with proxy_over(kv_servers) as (url, proxy):
        first = await client.post(url + CHAT, json=first_body)
        assert first.status_code == 200, first.text
        (holder,) = [name for name, count in sent(proxy, kv_servers).items() if count == 1]
        other = "prefill1" if holder == "prefill0" else "prefill0"
        holder_url = kv_servers.url(holder)
        keys = await rendered_keys(client, holder_url, first_body)
        shared = common_blocks(keys, await rendered_keys(client, holder_url,
                                                          chat(prefix + " question 0")))
        assert shared >= 5, "the shared prefix must span several blocks"
        await until(proxy, lambda: proxy.kv is not None
                    and proxy.kv.events.match(keys).get((holder_url, None), 0)
                    == len(keys) * KV_BLOCK_SIZE)
        hits, before = await prefix_hits(client, kv_servers), sent(proxy, kv_servers)
        for i in range(4):
            r = await client.post(url + CHAT, json=chat(prefix + f" question {i}"))
            assert r.status_code == 200, r.text
        after = sent(proxy, kv_servers)
        assert (after[holder] - before[holder], after[other] - before[other]) == (4, 0)
        assert proxy_metric(proxy, "epd_trio_kv_decisions_total", stage="prefill",
                            trust="exact") == 5
        assert proxy_metric(proxy, "epd_trio_kv_predicted_cached_tokens_total",
                            stage="prefill") >= 4 * shared * KV_BLOCK_SIZE
        now = await prefix_hits(client, kv_servers)
        assert now[holder] - hits[holder] >= 4 * shared * KV_BLOCK_SIZE
        assert now[other] == hits[other]
        entries = await listing(client, url)
    observe(f"prefix of {shared} blocks held by {holder}: 4/4 followers there, vLLM prefix "
            f"hits +{now[holder] - hits[holder]:g} tokens on it, +0 on {other}; kv_index "
            f"blocks {[(name, entries[kv_servers.url(name)]['blocks']) for name in kv_servers.servers]}")


async def test_a_prefix_loaded_on_one_prefill_directly_attracts_the_proxys_requests(
    kv_servers: Cluster, client: httpx.AsyncClient, observe: Observe
) -> None:
    """A request straight to prefill1 (the proxy never sees it): only its events tell the
    proxy, and every following request sharing that prefix goes to prefill1."""
    prefix = new_prefix()
    target = kv_servers.url("prefill1")
    async with proxy_over(kv_servers) as (url, proxy):
        direct = await client.post(target + CHAT, json=chat(prefix + " warm-up"))
        assert direct.status_code == 200, direct.text
        keys = await rendered_keys(client, target, chat(prefix + " warm-up"))
        shared = common_blocks(keys, await rendered_keys(client, target,
                                                          chat(prefix + " question 0")))
        assert shared >= 5, "the shared prefix must span several blocks"
        await until(proxy, lambda: proxy.kv is not None
                    and proxy.kv.events.match(keys).get((target, None), 0)
                    == len(keys) * KV_BLOCK_SIZE)
        hits = await prefix_hits(client, kv_servers)
        for i in range(4):
            r = await client.post(url + CHAT, json=chat(prefix + f" question {i}"))
            assert r.status_code == 200, r.text
        assert sent(proxy, kv_servers) == {"prefill0": 0, "prefill1": 4}
        now = await prefix_hits(client, kv_servers)
        assert now["prefill1"] - hits["prefill1"] >= 4 * shared * KV_BLOCK_SIZE
        assert now["prefill0"] == hits["prefill0"]
        entries = await listing(client, url)
        assert entries[target]["trust"] == "exact" and entries[target]["blocks"] >= len(keys)
    observe(f"{shared} shared blocks loaded on prefill1 directly: 4/4 proxied requests there, "
            f"vLLM prefix hits +{now['prefill1'] - hits['prefill1']:g} tokens on prefill1")


async def test_a_decode_publishes_the_blocks_it_pulled_over_nixl(
    kv_servers: Cluster, client: httpx.AsyncClient, observe: Observe
) -> None:
    """What real vLLM does: after a P -> D request, decode's own events announce the prompt's
    full blocks, pulled from the prefill over NIXL (decode computed none of them), with the
    same token ids the prefill announced: the index keys them alike on both slots. So the
    prefill bypass can count on a decode's pulled blocks, not only on what it computed."""
    prefix = new_prefix()
    decode = kv_servers.url("decode")
    async with proxy_over(kv_servers) as (url, proxy):
        pulls = await vllm_metric(client, decode, "vllm:nixl_xfer_time_seconds_count")
        computed = await vllm_metric(client, decode, "vllm:prompt_tokens")
        r = await client.post(url + CHAT, json=chat(prefix))
        assert r.status_code == 200, r.text
        (prefill,) = [name for name, count in sent(proxy, kv_servers).items() if count == 1]
        prompt = await rendered(client, kv_servers.url(prefill), chat(prefix))
        keys = prompt.keys(KV_BLOCK_SIZE)
        await until(proxy, lambda: proxy.kv is not None and proxy.kv.events.match(keys).get(
            (decode, None), 0) >= len(keys) * KV_BLOCK_SIZE)
        held = proxy.kv.events.match(keys) if proxy.kv is not None else {}
        assert held[(kv_servers.url(prefill), None)] == len(keys) * KV_BLOCK_SIZE
    assert await vllm_metric(client, decode, "vllm:nixl_xfer_time_seconds_count") == pulls + 1
    counted = await vllm_metric(client, decode, "vllm:prompt_tokens") - computed
    # Decode's prompt-token counter counts the prompt, but its prefix hits say it computed
    # none of the pulled tokens: a request straight to decode now reuses them all.
    hits = await vllm_metric(client, decode, PREFIX_HITS)
    again = await client.post(decode + CHAT, json=chat(prefix))
    cached = again.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == reusable_tokens(prompt)
    assert await vllm_metric(client, decode, PREFIX_HITS) - hits == cached
    observe(f"decode published the {len(keys)} blocks it pulled over NIXL from {prefill} "
            f"(its prompt tokens counted +{counted:g}); a direct request then had {cached} "
            "cached tokens")


def holds_all(proxy: Proxy, slot: str, keys: list[int]) -> bool:
    """Whether the proxy's index has every block of ``keys`` on ``slot``."""
    return proxy.kv is not None and proxy.kv.events.match(keys).get(
        (slot, None), 0) >= len(keys) * KV_BLOCK_SIZE


async def sized_prefix(client: httpx.AsyncClient, url: str, *,
                       whole_blocks: bool) -> tuple[str, RenderedPrompt]:
    """A new prefix whose prompt is (or is not) a whole number of blocks: vLLM reuses one
    block less of the former, so the bypass test takes one of each, not whichever it drew."""
    text = new_prefix()
    for _ in range(4 * KV_BLOCK_SIZE):
        prompt = await rendered(client, url, chat(text))
        if (len(prompt.token_ids) % KV_BLOCK_SIZE == 0) == whole_blocks:
            return text, prompt
        text += " z"
    raise AssertionError(f"no prompt of whole_blocks={whole_blocks} within {4 * KV_BLOCK_SIZE} "
                         "appended words")


async def test_the_prefill_leg_is_skipped_when_decode_holds_the_pulled_prompt(
    kv_servers: Cluster, client: httpx.AsyncClient, observe: Observe
) -> None:
    """The bypass on real vLLM: a request's blocks, pulled by decode, let the next request with
    the same prompt skip its prefill leg (EPD_PD_UNCACHED_TOKEN_THRESHOLD covers the partial
    last block, or the last whole block, which vLLM computes again), and decode serves it from
    its prefix cache."""
    decode = kv_servers.url("decode")
    seen = []
    async with proxy_over(kv_servers, decode_policy="precise_cache_aware",
                          pd_uncached_token_threshold=KV_BLOCK_SIZE) as (url, proxy):
        for bypassed, whole_blocks in enumerate((False, True), start=1):
            prefix, prompt = await sized_prefix(client, decode, whole_blocks=whole_blocks)
            keys = prompt.keys(KV_BLOCK_SIZE)
            r = await client.post(url + CHAT, json=chat(prefix))
            assert r.status_code == 200, r.text
            await until(proxy, partial(holds_all, proxy, decode, keys))
            before = sent(proxy, kv_servers)
            hits = await vllm_metric(client, decode, PREFIX_HITS)
            again = await client.post(url + CHAT, json=chat(prefix))
            assert again.status_code == 200, again.text
            assert sent(proxy, kv_servers) == before  # no prefill leg
            assert proxy_metric(proxy, "epd_trio_prefill_bypassed_total") == bypassed
            cached = again.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached == reusable_tokens(prompt)
            assert cached == (len(keys) - whole_blocks) * KV_BLOCK_SIZE
            assert await vllm_metric(client, decode, PREFIX_HITS) - hits == cached
            seen.append(f"{len(prompt.token_ids)} tokens: {cached} from decode's prefix cache")
    observe("second request of a prompt went to decode alone; " + ", ".join(seen))


async def test_the_render_keys_match_the_blocks_vllm_published(
    kv_servers: Cluster, client: httpx.AsyncClient, observe: Observe
) -> None:
    """Our key function and vLLM agree on a real prompt: the keys of the render endpoint's
    token ids equal those of the engine's ``BlockStored`` events for it (token ids and extra
    keys as published), with and without a cache salt (vLLM's extra key on block 0)."""
    url = kv_servers.url("prefill0")
    server = kv_servers.servers["prefill0"]
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    try:
        sub.connect(f"tcp://127.0.0.1:{server.kv_events_port}")
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        await until_subscribed(sub, client, url)
        found = []
        for salt in (None, f"salt-{secrets.token_hex(4)}"):
            body = chat(new_prefix(), **({"cache_salt": salt} if salt else {}))
            prompt = await rendered(client, url, body)
            assert prompt.media == ()
            expected = request_keys(prompt.token_ids, KV_BLOCK_SIZE, cache_salt=salt)
            r = await client.post(url + CHAT, json=body)
            assert r.status_code == 200, r.text
            stored = await stored_events(sub, prompt.token_ids, len(expected))
            tokens = [t for event in stored for t in event.token_ids]
            extras = [e for event in stored for e in (event.extra_keys or [None] * len(
                event.block_hashes))]
            assert tokens == list(prompt.token_ids[:len(tokens)])
            assert chain_keys(ROOT_KEY, tokens, KV_BLOCK_SIZE, extras) == expected
            found.append((len(expected), salt, extras[0]))
    finally:
        sub.close(linger=0)
        context.term()
    observe(f"render keys == BlockStored keys: {found} (blocks, salt, block 0's extra keys)")


async def next_message(sub: zmq.Socket[bytes]) -> list[bytes]:
    """The next message on ``sub``, its frames: pyzmq has no trio integration, so the socket
    is polled."""
    while True:
        try:
            return sub.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            await trio.sleep(0.05)


async def until_subscribed(sub: zmq.Socket[bytes], client: httpx.AsyncClient, url: str) -> None:
    """Return once ``sub`` receives what the engine publishes: a PUB socket drops what it sends
    before a new subscription reaches it (ZMQ's slow joiner), and no wait is known to be long
    enough. So send prompts of fresh blocks until one's events arrive."""
    with trio.fail_after(EVENTS_DEADLINE):
        while True:
            r = await client.post(url + CHAT, json=chat(new_prefix()))
            assert r.status_code == 200, r.text
            with trio.move_on_after(2.0):  # lost if sent before the subscription: send another
                await next_message(sub)
                return


async def stored_events(sub: zmq.Socket[bytes], token_ids: Sequence[int],
                        blocks: int) -> list[BlockStored]:
    """The ``BlockStored`` events that store ``token_ids``' blocks in order, until they cover
    ``blocks`` blocks. Events of other prompts are passed over: the engine may still be
    publishing an earlier test's blocks (a decode's pull, a late batch) when this one starts."""
    stored: list[BlockStored] = []
    offset = 0
    with trio.fail_after(EVENTS_DEADLINE):
        while sum(len(event.block_hashes) for event in stored) < blocks:
            _topic, _seq, payload = split_message(await next_message(sub))
            for event in decode_batch(payload).events:
                tokens = list(event.token_ids) if isinstance(event, BlockStored) else []
                if tokens and tokens == list(token_ids[offset:offset + len(tokens)]):
                    stored.append(event)
                    offset += len(tokens)
    return stored


async def test_a_restarted_prefill_leaves_the_index_with_nothing_of_its_old_cache(
    kv_servers: Cluster, client: httpx.AsyncClient, observe: Observe
) -> None:
    """Stop and start prefill1: its new engine numbers its batches from 0 again, so the
    proxy drops what the old one held (``GET /instances``: its blocks go to what the new one
    published), and the old prefix no longer attracts requests there."""
    prefix = new_prefix()
    target = kv_servers.url("prefill1")
    async with proxy_over(kv_servers) as (url, proxy):
        direct = await client.post(target + CHAT, json=chat(prefix + " warm-up"))
        assert direct.status_code == 200, direct.text
        keys = await rendered_keys(client, target, chat(prefix))
        await until(proxy, lambda: slots(proxy).get(target, {}).get("blocks", 0) >= len(keys))
        old = (await listing(client, url))[target]
        started = trio.current_time()
        await trio.to_thread.run_sync(partial(kv_servers.restart, "prefill1"))
        restart = trio.current_time() - started
        # The new engine's first batch (seq 0) is what tells the proxy: load a new prompt.
        fresh = new_prefix(20)
        r = await client.post(target + CHAT, json=chat(fresh))
        assert r.status_code == 200, r.text
        fresh_keys = await rendered_keys(client, target, chat(fresh))
        await until(proxy, lambda: slots(proxy).get(target, {}).get("blocks") == len(fresh_keys))
        new = (await listing(client, url))[target]
        assert new["trust"] == "exact"
        assert proxy.kv is not None and (target, None) not in proxy.kv.events.match(keys)
    observe(f"prefill1 restarted in {restart:.0f} s: kv_index blocks {old['blocks']} -> "
            f"{new['blocks']} (its new engine's {len(fresh_keys)}), events {old['events']} -> "
            f"{new['events']}; the old prefix matches nothing there")
