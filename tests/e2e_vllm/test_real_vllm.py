"""The proxy in front of real vLLM 0.32 servers on CPU: only the real server proves the protocol.

The session's cluster (conftest) is an encoder (encoder-cache producer), a prefill (encoder-cache
consumer, NIXL KV producer) and a decode (NIXL KV consumer) serving a tiny random-weight Qwen2-VL
model. The proxy under test runs in-process on Hypercorn's trio worker on a free port.

How answers are compared: with ``temperature: 0`` the output depends only on the prompt, so the
proxy must return exactly what decode answers when asked directly (no ``kv_transfer_params``:
decode then does the whole request itself; a fresh ``cache_salt`` keeps that run out of its
prefix cache, and out of the proxied runs' way). Nothing is hard-coded: the model's text is
random. Counters on the servers' ``/metrics`` show the hand-offs really happened; waiting for
them polls the real server with a bounded deadline (its metrics are updated per engine step).

The test that stops the encoder is last in this file; the ``cluster`` fixture restarts it for
any test that runs after it anyway (``-k``, reordering).
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import trio

from epd_trio import Instance, Proxy, Settings
from epd_trio._core.ec_handoff import EncoderReport, consumer_body, match_reports
from epd_trio._core.engine_load import engine_loads
from epd_trio._core.rewrite import build_encoder_body, parse_request, with_item_uuids
from epd_trio._core.tenants import Tenant
from epd_trio._upstream.load_scraper import scrape_once
from epd_trio.testing import serve_proxy
from epd_trio.testing.media import png_data_url

from . import amx
from .cluster import MAX_MODEL_LEN, MODEL_NAME, Cluster, start_single
from .provision import VLLM_CLI
from helpers import client_cancels, poll_until, queued
from helpers import metric as proxy_metric

pytestmark = pytest.mark.vllm_e2e

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MAX_TOKENS = 16
#: The proxy's count of prefill answers without kv_transfer_params (decode then recomputes).
KV_MISSING = "epd_trio_prefill_kv_transfer_params_missing_total"
#: D's counter of KV transfers it pulled over NIXL (a histogram's sample count).
NIXL_PULLS = "vllm:nixl_xfer_time_seconds_count"
#: New images every session: a reused cluster's encoder remembers the items it has seen (and then
#: writes no new cache entry), so a test's image must be one it has never encoded.
SESSION_SEED = secrets.randbits(48)
#: ``vllm bench serve`` through the proxy: prompts per run and requests in flight. The text
#: prompts are over two KV blocks long (128 tokens a block here); the image prompts are one
#: 64x64 image each plus text, so they go E -> P -> D.
BENCH_PROMPTS = 32
BENCH_CONCURRENCY = 4
BENCH_DATASETS = {
    "random": ["--random-input-len", "300", "--random-output-len", "16"],
    "random-mm": ["--random-input-len", "150", "--random-output-len", "16",
                  "--random-mm-base-items-per-request", "1",
                  "--random-mm-limit-mm-per-prompt", '{"image": 1, "video": 0}',
                  "--random-mm-bucket-config", "{(64, 64, 1): 1.0}"],
}
#: Seconds allowed for a server's /metrics to show what just happened (updated per engine step).
METRICS_DEADLINE = 10.0

Observe = Callable[[str], None]


# -- requests --------------------------------------------------------------------------------------
def image_part(seed: int, **extra: Any) -> dict[str, Any]:
    """A 64x48 PNG (Qwen2-VL needs at least 28 px a side), new to the encoder in this session."""
    url = png_data_url(64, 48, SESSION_SEED + seed)
    return {"type": "image_url", "image_url": {"url": url}, **extra}


def url_uuid(part: dict[str, Any]) -> str:
    """The uuid docs/discussion/protocol.md gives an item without its own: the SHA-256 of its URL."""
    return hashlib.sha256(part["image_url"]["url"].encode()).hexdigest()


def chat(*parts: dict[str, Any], text: str, **extra: Any) -> dict[str, Any]:
    content: Any = [*parts, {"type": "text", "text": text}] if parts else text
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": content}],
            "max_tokens": MAX_TOKENS, "temperature": 0, **extra}


def completion(prompt: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            **extra}


def salted(body: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """``body`` with a fresh ``cache_salt``: no prefix-cache hit from any earlier request."""
    return {**body, "cache_salt": f"e2e-{uuid.uuid4().hex}", **extra}


def sse_events(raw: bytes) -> list[Any]:
    """The ``data:`` payloads of an SSE body, JSON-decoded (``[DONE]`` kept as the string)."""
    events = []
    lines = raw.split(b"\n")
    if not raw.endswith(b"\n"):  # read mid-stream: the last line is not complete yet
        lines.pop()
    for line in lines:
        if line.startswith(b"data: "):
            data = line[len(b"data: "):].strip()
            events.append("[DONE]" if data == b"[DONE]" else orjson.loads(data))
    return events


def generated_text(response: httpx.Response, stream: bool) -> str:
    """The generated text of a chat or completions answer (a stream: its joined deltas)."""
    assert response.status_code == 200, response.text
    if not stream:
        (choice,) = response.json()["choices"]
        return choice["message"]["content"] if "message" in choice else choice["text"]
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.content)
    assert events[-1] == "[DONE]", events[-3:]
    text = ""
    for event in events[:-1]:
        for choice in event["choices"]:
            text += (choice["delta"].get("content") or "") if "delta" in choice else choice["text"]
    return text


async def ask(client: httpx.AsyncClient, url: str, path: str, body: dict[str, Any]) -> str:
    response = await client.post(url + path, json=body)
    return generated_text(response, bool(body.get("stream")))


async def direct_answer(client: httpx.AsyncClient, cluster: Cluster, path: str,
                        body: dict[str, Any]) -> str:
    """Decode's own greedy answer: the whole request on D, no hand-off, no cached prefix."""
    return await ask(client, cluster.url("decode"), path, salted(body, stream=False))


# -- metrics ---------------------------------------------------------------------------------------
async def metric(client: httpx.AsyncClient, url: str, name: str) -> float:
    """The sum of a metric's samples (all label sets) on one server's Prometheus ``/metrics``."""
    response = await client.get(url + "/metrics")
    assert response.status_code == 200
    values = [float(line.rsplit(" ", 1)[1]) for line in response.text.splitlines()
              if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " ")]
    assert values, f"{url}/metrics has no {name}"
    return sum(values)


async def wait_metric(client: httpx.AsyncClient, url: str, name: str,
                      ok: Callable[[float], bool], deadline: float = METRICS_DEADLINE) -> float:
    """Poll ``name`` on ``url`` until ``ok(value)`` holds; fail after ``deadline`` seconds."""
    value = await metric(client, url, name)
    with trio.move_on_after(deadline):
        while not ok(value):
            await trio.sleep(0.1)
            value = await metric(client, url, name)
        return value
    pytest.fail(f"{name} on {url} is still {value} after {deadline:g} s")


def kv_missing(proxy: Proxy) -> float:
    """The proxy's count of prefill answers that lacked ``kv_transfer_params`` (it must exist)."""
    exposition = proxy.metrics.exposition()
    assert exposition is not None and KV_MISSING.encode() in exposition
    return proxy_metric(proxy, KV_MISSING)


# -- proxies ---------------------------------------------------------------------------------------
@asynccontextmanager
async def proxy_for(
    cluster: Cluster, *, combined: bool = False, **settings: Any
) -> AsyncIterator[tuple[str, Proxy]]:
    """The proxy in front of E -> P -> D, or (``combined``) E -> PD with the prefill instance as
    the combined one: a fourth server would cost another ~2 GB and busy-polling core, and an
    instance asked without ``kv_transfer_params`` simply does the whole request. ``settings``
    override other ``Settings`` fields."""
    config = Settings(
        encode_urls=(Instance(cluster.url("encode")),),
        prefill_urls=() if combined else (Instance(cluster.url("prefill")),),
        decode_urls=(Instance(cluster.url("prefill" if combined else "decode")),),
        **settings,
    )
    async with serve_proxy(config) as served:
        yield served


async def kv_block_size(client: httpx.AsyncClient, url: str) -> int:
    """The server's KV block size in tokens, from vLLM's ``vllm:cache_config_info`` labels."""
    page = (await client.get(url + "/metrics")).text
    for line in page.splitlines():
        if line.startswith("vllm:cache_config_info{"):
            labels = dict(pair.split("=", 1) for pair in line[line.index("{") + 1:
                                                               line.index("}")].split(","))
            return int(labels["block_size"].strip('"'))
    pytest.fail(f"{url}/metrics has no vllm:cache_config_info")


async def direct_usage(client: httpx.AsyncClient, cluster: Cluster, path: str,
                       body: dict[str, Any]) -> tuple[str, int]:
    """Decode's own greedy answer (as ``direct_answer``) and the prompt's length in tokens."""
    response = await client.post(cluster.url("decode") + path, json=salted(body, stream=False))
    return generated_text(response, stream=False), response.json()["usage"]["prompt_tokens"]


def long_text(words: int) -> str:
    """A prompt of about ``words`` distinct words (several tokens each with the tiny tokenizer)."""
    return " ".join(f"item{i} of the list," for i in range(words))


def assert_every_process_asked(servers: Cluster, name: str) -> int:
    """The harness's ``.pth`` line, which asks for AMX (issue 30), ran in every process of
    server ``name`` that runs the vLLM venv's Python, its spawned engine core included (on a
    CPU without AMX, Linux refuses the request; it was made all the same). How many there are."""
    processes = servers.python_processes(name)
    assert any("EngineCore" in command for _, command, _ in processes), processes
    assert all(ran for *_, ran in processes), processes
    return len(processes)


def assert_alive(servers: Cluster) -> None:
    """No server died: else the failure says of what (a SIGILL names the AMX permission)."""
    deaths = servers.deaths()
    assert not deaths, "\n".join(deaths)


# -- tests -----------------------------------------------------------------------------------------
# The first two run first (conftest.FIRST): each is a fresh server's first forward, one token.
async def test_a_one_token_prompt_as_a_plain_servers_first_request(
    client: httpx.AsyncClient, observe: Observe, say: Callable[[str], None]
) -> None:
    """Issue 30 with no proxy and no connector: a plain vLLM server whose first prompt is one
    token. On a CPU with AMX, that forward runs AMX attention before anything asked Linux for
    AMX; without the permission (amx.py) the engine dies of SIGILL and the request gets a 500
    "EngineCore encountered an issue", and the server exits."""
    single = await trio.to_thread.run_sync(partial(start_single, log=say))
    try:
        url = single.url("single")
        processes = assert_every_process_asked(single, "single")
        assert await metric(client, url, "vllm:prompt_tokens_total") == 0  # its first forward
        tokenized = await client.post(url + "/tokenize", json={
            "model": MODEL_NAME, "prompt": "Hello", "add_special_tokens": False})
        assert tokenized.status_code == 200, tokenized.text
        one_token = tokenized.json()["tokens"][:1]
        body = {"model": MODEL_NAME, "prompt": one_token, "max_tokens": 4, "temperature": 0}
        first = await client.post(url + COMPLETIONS, json=body)
        assert_alive(single)
        assert first.status_code == 200, first.text
        assert first.json()["usage"]["prompt_tokens"] == 1
        assert single.healthy() == []
    finally:
        await trio.to_thread.run_sync(single.stop)
    observe(f"prompt {one_token} (1 token) as a fresh server's first: 200 "
            f"{first.json()['choices'][0]['text']!r}; its {processes} Python processes (engine "
            f"core included) asked for AMX; CPU {'with' if amx.cpu_has_amx() else 'without'} AMX")


def counted(tokens: int) -> dict[str, Any]:
    """A completion of exactly ``tokens`` tokens (``ignore_eos``): its length is its run time."""
    return {"model": MODEL_NAME, "prompt": "Count on: one two three", "max_tokens": tokens,
            "temperature": 0, "ignore_eos": True}


async def served_in_turn(client: httpx.AsyncClient, engine: str, headroom: int,
                         long_tokens: int) -> list[str]:
    """The order in which four requests end, behind a proxy of 2 places with ``headroom``:
    batch A (long) runs in the engine, batch B waits there, batch C waits in the proxy, then
    interactive I (a better band) comes."""
    config = Settings(decode_urls=(Instance(engine),), max_inflight=2, admission_timeout=120,
                      tenants=(Tenant("batch", priority=1), Tenant("interactive", priority=0)),
                      tenant_header="x-tenant", priority_headroom=headroom)
    ended: list[str] = []
    async with serve_proxy(config) as (url, proxy):

        async def send(name: str, tenant: str, tokens: int) -> None:
            r = await client.post(url + COMPLETIONS, json=counted(tokens),
                                  headers={"x-tenant": tenant})
            assert r.status_code == 200, r.text
            ended.append(name)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send, "A", "batch", long_tokens)
            await wait_metric(client, engine, "vllm:num_requests_running", lambda v: v == 1)
            nursery.start_soon(send, "B", "batch", 16)
            await wait_metric(client, engine, "vllm:num_requests_waiting", lambda v: v == 1)
            nursery.start_soon(send, "C", "batch", 16)
            # C waits in the proxy (its gauge has no event to wait on)
            await poll_until(lambda: queued(proxy, "batch", 1) == 1, METRICS_DEADLINE)
            nursery.start_soon(send, "I", "interactive", 16)
            if headroom:
                await wait_metric(client, engine, "vllm:num_requests_waiting", lambda v: v == 2)
            else:
                await poll_until(lambda: queued(proxy, "interactive", 0) == 1, METRICS_DEADLINE)
            assert ended == [], f"{ended} ended before I came: A's {long_tokens} tokens too few"
        assert proxy_metric(proxy, "epd_trio_tenant_headroom_admitted_total",
                            tenant="interactive", priority="0") == headroom
    return ended


async def test_priority_scheduling_serves_the_request_in_the_headroom_first(
    client: httpx.AsyncClient, observe: Observe, say: Callable[[str], None]
) -> None:
    """What ``EPD_PRIORITY_HEADROOM`` is for, on a real engine with ``--scheduling-policy
    priority`` that runs one sequence at a time (``--max-num-seqs 1``), behind a proxy of 2
    places. With one place of headroom, interactive I reaches the engine while batch A runs,
    and the engine serves it before batch B, which was waiting there first. Without, I waits in
    the proxy until A ends, and the engine has started B by then: it can only order the
    requests it holds."""
    single = await trio.to_thread.run_sync(partial(
        start_single, log=say, name="priority",
        args=["--scheduling-policy", "priority", "--max-num-seqs", "1"]))
    try:
        engine = single.url("priority")
        # A must outlast the set-up of B, C and I (a few polls): about 4 s of its tokens.
        started = time.perf_counter()
        r = await client.post(engine + COMPLETIONS, json=counted(64))
        assert r.status_code == 200, r.text
        per_token = (time.perf_counter() - started) / 64
        long_tokens = min(3500, max(256, int(4 / per_token)))
        orders = {headroom: await served_in_turn(client, engine, headroom, long_tokens)
                  for headroom in (1, 0)}
    finally:
        await trio.to_thread.run_sync(single.stop)
    assert orders == {1: ["A", "I", "B", "C"], 0: ["A", "B", "I", "C"]}
    observe(f"--scheduling-policy priority, --max-num-seqs 1, 2 proxy places (A: {long_tokens} "
            f"tokens, {per_token * 1000:.1f} ms each): ended {' '.join(orders[1])} with one "
            f"place of headroom, {' '.join(orders[0])} without")


async def test_a_text_request_as_the_clusters_first_request_pulls_its_kv(
    cluster: Cluster, client: httpx.AsyncClient, observe: Observe
) -> None:
    """Issues 23 and 30: the very first request a fresh cluster sees is text-only, through
    P -> D. Its KV pull is decode's first NIXL hand-shake and transfer, with no encoder-cache
    entry anywhere and nothing run on decode before (the other tests all ask decode directly
    first), so decode's first forward is the one-token step after the pull: on an AMX CPU
    without the AMX permission, the SIGILL of issue 30. The counters at 0 prove the order
    (conftest.FIRST) on a cluster this session started."""
    decode = cluster.url("decode")
    pulls = await metric(client, decode, NIXL_PULLS)
    prompts = await metric(client, decode, "vllm:prompt_tokens_total")
    if cluster.owned:  # started by this session: nothing has reached decode yet
        assert (pulls, prompts) == (0, 0)
        for name in cluster.servers:
            assert_every_process_asked(cluster, name)
    body = chat(text="Hello there, friend.")
    started = trio.current_time()
    async with proxy_for(cluster) as (url, proxy):
        response = await client.post(url + CHAT, json=salted(body))
        assert_alive(cluster)
        got = generated_text(response, stream=False)
        assert kv_missing(proxy) == 0
        assert proxy.registry.state("encode", cluster.url("encode")).sent == 0
    proxied = trio.current_time() - started
    after = await wait_metric(client, decode, NIXL_PULLS, lambda v: v >= pulls + 1)
    assert cluster.healthy() == []  # decode's engine survived its first pull
    started = trio.current_time()
    assert got == await direct_answer(client, cluster, CHAT, body)
    direct = trio.current_time() - started
    observe(f"{'first request of a fresh cluster' if pulls == 0 else 'reused cluster'}: "
            f"{got!r} in {proxied:.1f} s (= decode direct, {direct:.1f} s); decode NIXL pulls "
            f"+{after - pulls:g}; all servers healthy")


async def test_prompts_longer_than_one_kv_block_equal_decode_direct_answer(
    cluster: Cluster, client: httpx.AsyncClient, observe: Observe
) -> None:
    """A pulled prompt of several KV blocks (the short prompts elsewhere fit in one): text
    through P -> D and an image with a long text through E -> P -> D, stream and not."""
    decode = cluster.url("decode")
    block = await kv_block_size(client, decode)
    cases = {"text": chat(text=long_text(block // 2)),
             "image": chat(image_part(seed=4004), text=long_text(block // 2))}
    pulls = await metric(client, decode, NIXL_PULLS)
    seen = {}
    async with proxy_for(cluster) as (url, proxy):
        for name, body in cases.items():
            want, tokens = await direct_usage(client, cluster, CHAT, body)
            assert tokens > 2 * block, (name, tokens, block)
            for stream in (False, True):
                assert await ask(client, url, CHAT, salted(body, stream=stream)) == want, name
            seen[name] = tokens
        assert kv_missing(proxy) == 0
    after = await wait_metric(client, decode, NIXL_PULLS, lambda v: v >= pulls + 4)
    assert cluster.healthy() == []
    observe(f"KV block {block} tokens; prompts of {seen} tokens (= "
            f"{ {k: -(-v // block) for k, v in seen.items()} } blocks) equal decode direct, "
            f"stream and not; decode NIXL pulls +{after - pulls:g}")


async def test_image_request_through_e_p_d_equals_decode_direct_answer(
    cluster: Cluster, client: httpx.AsyncClient, observe: Observe
) -> None:
    image = image_part(seed=1001)
    item = url_uuid(image)
    assert not cluster.ec_file(item).exists()
    body = chat(image, text="What is in this image?")
    want = await direct_answer(client, cluster, CHAT, body)
    decode = cluster.url("decode")
    pulls = await metric(client, decode, NIXL_PULLS)
    async with proxy_for(cluster) as (url, proxy):
        got = {stream: await ask(client, url, CHAT, salted(body, stream=stream))
               for stream in (False, True)}
    assert got == {False: want, True: want}
    # The encoder wrote its cache entry under the uuid the proxy gave the item, which is where
    # the prefill looked it up.
    assert cluster.ec_file(item).exists()
    assert kv_missing(proxy) == 0  # prefill returned kv_transfer_params each time
    after = await wait_metric(client, decode, NIXL_PULLS, lambda v: v >= pulls + 2)
    observe(f"answer {want!r} (stream and non-stream, = decode direct); encoder cache file "
            f"{item[:12]}.../encoder_cache.safetensors written; decode NIXL pulls "
            f"+{after - pulls:g}")


async def test_a_tenants_priority_is_taken_by_every_real_leg(
    cluster: Cluster, client: httpx.AsyncClient, observe: Observe,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Fair admission's wire (issue 32): every leg carries the effective priority, and real
    vLLM's encoder, prefill and decode all take a non-zero ``priority`` on their default
    ``fcfs`` policy (vLLM's field description warns that a server without priority scheduling
    may refuse one): the answer is decode's own, stream and not. A client's lower priority (3)
    is kept; a better one (-1) is held to its tenant's band (2), as the request log says."""
    caplog.set_level(logging.INFO, logger="epd_trio.requests")
    image = image_part(seed=1003)
    body = chat(image, text="Describe the image.")
    want = await direct_answer(client, cluster, CHAT, body)
    async with proxy_for(cluster, tenants=(Tenant("default", priority=2),),
                         request_log=True) as (url, proxy):
        for stream in (False, True):
            for asked in (3, -1):
                response = await client.post(
                    url + CHAT, json=salted(body, stream=stream, priority=asked),
                    headers={"x-request-id": f"asked{asked}-{stream}"})
                assert generated_text(response, stream) == want, (stream, asked)
        assert proxy_metric(proxy, "epd_trio_tenant_admitted_total", tenant="default",
                            priority="2") == 4
        assert kv_missing(proxy) == 0
    logged = {rec.fields["request_id"]: rec.fields["priority"]  # type: ignore[attr-defined]
              for rec in caplog.records if rec.name == "epd_trio.requests"}
    assert logged == {f"asked{asked}-{stream}": effective for stream in (False, True)
                      for asked, effective in ((3, 3), (-1, 2))}
    observe(f"4 requests at priorities 3 and 2 (a client's -1 held to its tenant's 2) through "
            f"E -> P -> D: answer {want!r} each time (= decode direct)")


async def test_text_requests_through_p_d_equal_decode_direct_answer(
    cluster: Cluster, client: httpx.AsyncClient, observe: Observe
) -> None:
    # Fields the prefill leg must rewrite or drop for vLLM to accept a one-token, non-stream
    # prefill: max_completion_tokens (capped to 1), stream_options (only valid with stream),
    # min_tokens (more than one token).
    chat_body = {**chat(text="Say something about structured concurrency."),
                 "max_completion_tokens": MAX_TOKENS}
    del chat_body["max_tokens"]
    cases = [(CHAT, chat_body, {"stream_options": {"include_usage": True}}),
             (COMPLETIONS, completion("def nursery(scope):", min_tokens=4), {})]
    decode = cluster.url("decode")
    pulls = await metric(client, decode, NIXL_PULLS)
    async with proxy_for(cluster) as (url, proxy):
        streams = {}
        for path, body, stream_extra in cases:
            want = await direct_answer(client, cluster, path, body)
            assert await ask(client, url, path, salted(body)) == want
            streams[path] = await client.post(url + path, json=salted(body, stream=True, **stream_extra))
            assert generated_text(streams[path], stream=True) == want, path
            observe(f"{path}: {want!r} (stream and non-stream, = decode direct)")
        usage = sse_events(streams[CHAT].content)[-2]["usage"]  # include_usage's last chunk
        assert usage["completion_tokens"] == MAX_TOKENS
        assert proxy.registry.state("encode", cluster.url("encode")).sent == 0  # no media
        assert kv_missing(proxy) == 0
        models = await client.get(url + "/v1/models")
        assert models.status_code == 200
        assert [m["id"] for m in models.json()["data"]] == [MODEL_NAME]
    after = await wait_metric(client, decode, NIXL_PULLS, lambda v: v >= pulls + 4)
    observe(f"decode NIXL pulls +{after - pulls:g} for 4 requests; stream usage {usage}")


async def test_encoder_plus_combined_instance_layout(
    cluster: Cluster, client: httpx.AsyncClient, observe: Observe
) -> None:
    # The client names the item itself: its uuid, not the URL's hash, keys the encoder cache.
    own_uuid = f"client-item-{uuid.uuid4().hex}"
    body = chat(image_part(seed=2002, uuid=own_uuid), text="Describe it.")
    want = await direct_answer(client, cluster, CHAT, body)
    async with proxy_for(cluster, combined=True) as (url, proxy):
        assert proxy.settings.layout == "E+PD"
        got = {stream: await ask(client, url, CHAT, salted(body, stream=stream))
               for stream in (False, True)}
        combined = proxy.registry.state("decode", cluster.url("prefill"))
        assert combined.sent == 2 and combined.errors == 0
    assert got == {False: want, True: want}
    assert cluster.ec_file(own_uuid).exists()
    observe(f"E -> PD answer {want!r} (= decode direct); encoder cache keyed by the client's uuid")


async def test_the_encoders_metadata_rewrite_is_answered_like_the_raw_media(
    cluster: Cluster, client: httpx.AsyncClient, observe: Observe
) -> None:
    """The EC hand-off on real vLLM: the encoder (ECExampleConnector, Qwen2-VL-style model)
    reports per-item metadata, the consumer accepts the metadata-only ``image_embeds`` part the
    proxy builds from it (reading the pixels' encoding from the encoder cache), and the answer
    equals decode's own on the raw media, through the proxy with the rewrite on and off."""
    image = image_part(seed=3003)
    body = chat(image, text="What is in this image?")
    want = await direct_answer(client, cluster, CHAT, body)
    request = parse_request(orjson.dumps(body), "chat")
    tagged, items = with_item_uuids(request)
    encoder = cluster.url("encode")
    r = await client.post(encoder + CHAT, json=build_encoder_body(tagged, items))
    assert r.status_code == 200, r.text
    reported = r.json()["ec_transfer_params"]
    (entry,) = reported.values()
    assert "image_grid_thw" in entry["metadata"], reported
    handoff = match_reports([EncoderReport(encoder, (0,), reported)], [items[0]["uuid"]])
    rewritten = consumer_body(tagged, request.media, handoff, rewrite=True)
    (part,) = [p for p in rewritten["messages"][0]["content"] if p["type"] != "text"]
    assert part["type"] == "image_embeds" and "image_url" not in part
    # The combined instance (the prefill server, an EC consumer) answers the rewritten body.
    assert await ask(client, cluster.url("prefill"), CHAT, salted(rewritten)) == want
    for rewrite in (True, False):
        async with proxy_for(cluster, combined=True, ec_rewrite=rewrite) as (url, _):
            assert await ask(client, url, CHAT, salted(body)) == want
        async with proxy_for(cluster, ec_rewrite=rewrite) as (url, _):
            assert await ask(client, url, CHAT, salted(body, stream=True)) == want
    observe(f"encoder reported {entry['metadata']}; the metadata-only image_embeds part answered "
            f"{want!r} (= decode direct on the raw image), and so did E -> PD and E -> P -> D "
            f"through the proxy with the rewrite on and off")


async def run_bench(cluster: Cluster, url: str, dataset: str, out: Path) -> dict[str, Any]:
    """``vllm bench serve`` (vLLM's own benchmark client) against ``url``; its saved result."""
    cmd = [str(cluster.home.python), str(VLLM_CLI), "bench", "serve", "--backend", "openai-chat",
           "--endpoint", CHAT, "--base-url", url, "--model", MODEL_NAME,
           "--tokenizer", str(cluster.home.model(cluster.model)), "--dataset-name", dataset,
           *BENCH_DATASETS[dataset], "--ignore-eos", "--num-prompts", str(BENCH_PROMPTS),
           "--max-concurrency", str(BENCH_CONCURRENCY), "--seed", str(SESSION_SEED % 2**31),
           "--disable-tqdm", "--save-result", "--save-detailed", "--result-dir", str(out),
           "--result-filename", "result.json"]
    done = await trio.run_process(cmd, env=cluster.home.server_env(out / "tmp"), check=False,
                                  capture_stdout=True, capture_stderr=True)
    output = (done.stdout + done.stderr).decode(errors="replace")
    tail = "\n".join(line for line in output.splitlines() if "leaked" not in line)[-3000:]
    assert done.returncode == 0, f"vllm bench serve exited {done.returncode}:\n{tail}"
    return json.loads((out / "result.json").read_text())


@pytest.mark.parametrize("dataset", sorted(BENCH_DATASETS))
async def test_vllm_bench_serve_through_the_proxy_completes_every_request(
    cluster: Cluster, client: httpx.AsyncClient, observe: Observe, tmp_path: Path, dataset: str
) -> None:
    """Issue 23: vLLM's own benchmark client, as a new user points it at the proxy: every
    request completes (its ``completed`` and ``failed`` counts, and each request's error)."""
    decode = cluster.url("decode")
    block = await kv_block_size(client, decode)
    pulls = await metric(client, decode, NIXL_PULLS)
    async with proxy_for(cluster) as (url, proxy):
        result = await run_bench(cluster, url, dataset, tmp_path)
        assert kv_missing(proxy) == 0
        encoded = proxy.registry.state("encode", cluster.url("encode")).sent
    errors = [e for e in result["errors"] if e]
    assert (result["completed"], result["failed"], errors[:3]) == (BENCH_PROMPTS, 0, [])
    assert result["output_lens"] == [16] * BENCH_PROMPTS  # --ignore-eos: every token came
    if dataset == "random":
        assert min(result["input_lens"]) > 2 * block and encoded == 0
    else:  # one image per prompt, the bench's first test request included
        assert encoded >= BENCH_PROMPTS
    # Every request pulled its KV over NIXL. (The bench's initial test request is its first
    # prompt, sent again in the run: decode may answer that one from its own prefix cache.)
    after = await wait_metric(client, decode, NIXL_PULLS, lambda v: v >= pulls + BENCH_PROMPTS)
    assert cluster.healthy() == []
    observe(f"{dataset}: {result['completed']}/{BENCH_PROMPTS} completed at concurrency "
            f"{BENCH_CONCURRENCY}, prompts {min(result['input_lens'])}-"
            f"{max(result['input_lens'])} tokens, {result['duration']:.1f} s, mean TTFT "
            f"{result['mean_ttft_ms']:.0f} ms; encoder requests {encoded}; decode NIXL pulls "
            f"+{after - pulls:g}")


async def test_client_disconnect_mid_stream_aborts_decode(
    cluster: Cluster, client: httpx.AsyncClient, observe: Observe
) -> None:
    decode = cluster.url("decode")
    running = "vllm:num_requests_running"
    await wait_metric(client, decode, running, lambda v: v == 0)
    generated = await metric(client, decode, "vllm:generation_tokens_total")
    # As long as the context allows, never stopping early: the whole answer takes seconds here
    # (~1000 tokens/s on an idle engine), an abort leaves it a few tokens long.
    max_tokens = MAX_MODEL_LEN - 64
    body = chat(text="Go on forever.", stream=True, ignore_eos=True, max_tokens=max_tokens)
    async with proxy_for(cluster) as (url, proxy):
        async with client.stream("POST", url + CHAT, json=salted(body)) as response:
            assert response.status_code == 200
            received = b""
            async for chunk in response.aiter_raw():  # until decode's first generated token
                received += chunk
                if any(isinstance(e, dict) and e["choices"][0]["delta"].get("content")
                       for e in sse_events(received)):
                    break
        closed = trio.current_time()
        # httpx closed the connection: the proxy must close its decode leg, and vLLM abort.
        # (The gauge is refreshed with every engine step, so after a generated token a 0 means
        # the request is no longer running.)
        await wait_metric(client, decode, running, lambda v: v == 0, deadline=5.0)
        stopped_after = trio.current_time() - closed
        assert client_cancels(proxy) == {"decode": 1}
    tokens = await metric(client, decode, "vllm:generation_tokens_total") - generated
    assert 1 <= tokens < max_tokens  # it generated, and was aborted rather than finished
    observe(f"decode's running gauge at 0 {stopped_after:.2f} s after the client closed; "
            f"{tokens:g} of {max_tokens} tokens generated")


async def test_prompt_longer_than_the_context_is_vllms_400(
    cluster: Cluster, client: httpx.AsyncClient, observe: Observe
) -> None:
    too_long = " ".join(["word"] * (MAX_MODEL_LEN + 100))
    cases = [(CHAT, chat(text=too_long)), (COMPLETIONS, completion(too_long))]
    decode = cluster.url("decode")
    for path, body in cases:
        direct = await client.post(decode + path, json=body)
        assert direct.status_code == 400
        for combined in (False, True):  # the 400 of prefill (E->P->D), of decode (E->PD)
            async with proxy_for(cluster, combined=combined) as (url, _):
                for stream in (False, True):
                    response = await client.post(url + path, json={**body, "stream": stream})
                    assert response.status_code == 400, response.text
                    assert response.json() == direct.json()  # vLLM's own error, unchanged
    observe(f"400 {direct.json()['error']['message'][:90]!r}... relayed unchanged "
            "(chat and completions, stream and not, from prefill and from a combined instance)")


async def test_the_load_scrape_reads_vllms_own_gauges(
    cluster: Cluster, client: httpx.AsyncClient, observe: Observe
) -> None:
    """The names and labels ``_core/engine_load`` parses are what real vLLM exports (issue 14):
    one series per engine, ``engine="0"`` here, and a KV usage between 0 and 1."""
    decode = cluster.url("decode")
    async with proxy_for(cluster) as (_, proxy):
        scraped = await scrape_once([("decode", Instance(decode))], proxy.client, 10.0)
    page = (await client.get(decode + "/metrics")).text
    loads = engine_loads(page)
    assert set(loads) >= {"0"}, page[:2000]
    assert 0 <= loads["0"].kv_usage <= 1
    assert ("decode", (decode, None)) in scraped
    observe(f"decode /metrics: engine 0 running {loads['0'].running:g}, waiting "
            f"{loads['0'].waiting:g}, kv {loads['0'].kv_usage:.3f}; scraped {scraped}")


async def test_encoder_stopped_fails_media_cleanly_and_text_still_works(
    cluster: Cluster, client: httpx.AsyncClient, observe: Observe
) -> None:
    encoder = cluster.url("encode")
    text = chat(text="Still there?")
    want = await direct_answer(client, cluster, CHAT, text)
    async with proxy_for(cluster, health_interval=0.2) as (url, proxy):
        evicted = trio.Event()
        proxy.registry.on_change.append(
            lambda state: state.stage == "encode" and not state.live and evicted.set())
        cluster.stop(["encode"])
        response = await client.post(url + CHAT, json=chat(image_part(seed=3003), text="And this?"))
        assert response.status_code in (502, 503), response.text
        error = response.json()["error"]
        assert (error["stage"], error["instance"]) == ("encode", encoder)
        assert "encode" in error["message"] and encoder in error["message"]
        assert await ask(client, url, CHAT, salted(text)) == want
        # The failed request and the prober (every 0.2 s here) take the dead encoder out.
        with trio.fail_after(30):
            await evicted.wait()
        health = await client.get(url + "/health")
        assert health.status_code == 200 and health.json()["status"] == "unavailable"
        (state,) = health.json()["roles"]["encode"]
        assert state["state"] == "unhealthy"
    observe(f"media request: {response.status_code} {error['message']!r}; text request: 200, "
            f"= decode direct; proxy /health 200 unavailable, encoder {state['state']} after "
            f"{state['consecutive_failures']} failures")
