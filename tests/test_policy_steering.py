"""Each routing policy steering real requests over real sockets (fake vLLM on ephemeral ports).

Load is made by holding one request at a known fake (its ``gate``); every check waits on the
fakes' own state, never on time.
"""

from __future__ import annotations

import httpx
import pytest
import trio
import trio.testing

from epd_trio import Instance, Settings
from epd_trio._upstream.load_scraper import scrape_once
from epd_trio.testing import Behaviour, FakeVLLM, run_cluster, serve_proxy
from epd_trio.testing.sim_engine import EngineConfig, SimEngine

from helpers import CHAT, chat_body, image, start_fakes, url_uuid


def _holding(release: trio.Event) -> Behaviour:
    async def gate() -> None:
        await release.wait()
    return Behaviour(gate=gate)


async def _post(client: httpx.AsyncClient, url: str, body: dict) -> int:
    response = await client.post(url + CHAT, json=body)
    return response.status_code


@pytest.mark.parametrize("policy, to_idle", [
    ("round_robin", 2), ("least_loaded", 4), ("power_of_two", 4)])
async def test_decode_policies_and_a_busy_slot(
        policy: str, to_idle: int, client: httpx.AsyncClient) -> None:
    release = trio.Event()
    async with trio.open_nursery() as nursery:
        busy, idle = await start_fakes(
            nursery, FakeVLLM(role="prefill_decode", behaviour=_holding(release)),
            FakeVLLM(role="prefill_decode"))
        settings = Settings(decode_urls=(Instance(busy.url), Instance(idle.url)),
                            decode_policy=policy)
        async with serve_proxy(settings) as (url, proxy):
            nursery.start_soon(_post, client, url, chat_body())  # rotation first: busy
            await busy.wait_until(lambda: busy.in_flight == 1)
            assert proxy.loads.read("decode", [(busy.url, None)]) == [1]
            # Four more, one after the other. Round-robin alternates (two of them wait behind
            # the held one, here answered once released); the load-aware ones, with two slots,
            # always compare both and go to the idle one.
            async with trio.open_nursery() as senders:
                for _ in range(4):
                    if policy == "round_robin":
                        senders.start_soon(_post, client, url, chat_body())
                    else:
                        assert await _post(client, url, chat_body()) == 200
                release.set()
            assert len(idle.requests()) == to_idle
            assert len(busy.requests()) == 5 - to_idle
        nursery.cancel_scope.cancel()
    assert proxy.loads.read("decode", [(busy.url, None), (idle.url, None)]) == [0, 0]


async def test_cache_aware_prefill_keeps_each_prefix_on_one_slot(
        client: httpx.AsyncClient) -> None:
    async with run_cluster(prefills=2, prefill_dp=2, decodes=1,
                           prefill_policy="cache_aware") as c:
        systems = {name: f"You are assistant {name}. " * 80 for name in "XYZ"}
        for turn in range(4):
            for system in systems.values():
                body = {"model": "fake-model", "max_tokens": 2, "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": f"question {turn}"}]}
                assert (await client.post(c.proxy_url + CHAT, json=body)).status_code == 200
        slots: dict[str, set[tuple[str, int | None]]] = {name: set() for name in systems}
        for fake in c.prefills:
            for r in fake.requests():
                name = next(n for n, s in systems.items()
                            if r.body["messages"][0]["content"] == s)
                slots[name].add((fake.url, r.rank))
        assert all(len(seen) == 1 for seen in slots.values()), slots  # round-robin: 4 each
        assert len(set().union(*slots.values())) == 3  # misses spread by load and rotation


async def test_cache_aware_encode_sends_an_image_back_to_its_encoder(
        client: httpx.AsyncClient) -> None:
    async with run_cluster(encoders=3, decodes=1, encode_policy="cache_aware") as c:
        for _ in range(3):
            for n in range(3):
                body = chat_body(image(n), image(10 + n))
                assert (await client.post(c.proxy_url + CHAT, json=body)).status_code == 200
        where: dict[str, set[str]] = {}
        for fake in c.encoders:
            for r in fake.requests():
                for part in r.body["messages"][0]["content"]:
                    where.setdefault(part["uuid"], set()).add(fake.url)
        assert set(where) == {url_uuid(image(n)) for n in (0, 1, 2, 10, 11, 12)}
        assert all(len(urls) == 1 for urls in where.values()), where  # round-robin: 3 each
        assert len({url for urls in where.values() for url in urls}) == 3  # and spread


async def test_a_scrape_sees_load_the_proxy_did_not_send(client: httpx.AsyncClient) -> None:
    async with trio.open_nursery() as nursery:
        # ``busy`` runs two requests of a client that bypasses the proxy, in an engine whose
        # step takes an hour: they stay running for the whole test.
        busy, idle = await start_fakes(
            nursery, FakeVLLM(role="prefill_decode", engine=SimEngine(EngineConfig(
                step_base=3600.0))),
            FakeVLLM(role="prefill_decode", engine=SimEngine()))
        settings = Settings(decode_urls=(Instance(busy.url), Instance(idle.url)),
                            decode_policy="least_loaded")
        async with serve_proxy(settings) as (url, proxy):
            for _ in range(2):
                nursery.start_soon(_post, client, busy.url, chat_body())
            await busy.wait_until(lambda: busy.in_flight == 2)
            await trio.testing.wait_all_tasks_blocked()  # both are in the engine's batch
            scraped = await scrape_once([("decode", i) for i in settings.decode_urls],
                                        proxy.client, 5.0)
            assert scraped == {("decode", (busy.url, None)): 2, ("decode", (idle.url, None)): 0}
            proxy.loads.scraped = scraped
            for _ in range(3):  # the proxy's own count says both are idle; the scrape does not
                assert await _post(client, url, chat_body()) == 200
            assert len(idle.requests()) == 3
            assert len(busy.requests()) == 2
        nursery.cancel_scope.cancel()
