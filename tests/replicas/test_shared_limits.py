"""Tenants' per-minute limits shared by replicas through a real redis-server: one limit across
three replica processes, tokens settled across replicas, and Redis killed under load with no
request failed (each replica then enforces its share, counted)."""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from functools import partial
from typing import Any

import httpx
import orjson
import trio
import trio.testing

from epd_trio import Instance, Settings
from epd_trio._core.tenants import parse_tenants, token_reservation
from epd_trio._proxy import Proxy
from epd_trio.testing import FakeVLLM, serve_proxy

from helpers import CHAT, chat_body, metric, queued, server_process, start_fakes
from real_servers import RedisServer

SERVE = [sys.executable, "-m", "epd_trio", "serve", "--port", "0"]
TABLES = {"team": {"keys": ["sk-team"], "requests_per_minute": 30},
          "metered": {"keys": ["sk-tpm"], "tokens_per_minute": 1200},
          "bulk": {"keys": ["sk-bulk"], "requests_per_minute": 1_000_000},
          "capped": {"keys": ["sk-capped"], "max_inflight": 2},
          "wide": {"keys": ["sk-wide"], "max_inflight": 20},
          "trio": {"keys": ["sk-trio"], "requests_per_minute": 3}}
TEAM = {"authorization": "Bearer sk-team"}
METERED = {"authorization": "Bearer sk-tpm"}
WIDE = {"authorization": "Bearer sk-wide"}
CAPPED = {"authorization": "Bearer sk-capped"}


class Engine:
    """A gate for the fake engine: counts the requests it holds (and the most at once), holds
    them until ``release`` is set, then gives each ``work`` seconds of engine time."""

    def __init__(self, work: float = 0.0) -> None:
        self.now = self.peak = 0
        self.release = trio.Event()
        self._work = work

    async def __call__(self) -> None:
        self.now += 1
        self.peak = max(self.peak, self.now)
        try:
            await self.release.wait()
            await trio.sleep(self._work)  # the engine's time, not a synchronisation
        finally:
            self.now -= 1


@asynccontextmanager
async def held_replica(redis: RedisServer, nursery: trio.Nursery
                       ) -> AsyncIterator[tuple[str, Proxy, FakeVLLM, Engine]]:
    """One replica in front of a fake engine whose requests ``Engine`` holds until released."""
    (decode,) = await start_fakes(nursery, FakeVLLM(role="prefill_decode"))
    engine = Engine()
    decode.behaviour.gate = engine
    async with fleet(redis, decode, count=1) as [(url, proxy)]:
        yield url, proxy, decode, engine


async def wide(client: httpx.AsyncClient, url: str, statuses: list[int]) -> None:
    """One request of the capped tenant ``wide`` at ``url``; its status goes to ``statuses``."""
    r = await client.post(url + CHAT, json=chat_body(), headers=WIDE)
    statuses.append(r.status_code)


@asynccontextmanager
async def fleet(redis: RedisServer, decode: FakeVLLM, count: int = 3,
                **settings: Any) -> AsyncIterator[list[tuple[str, Proxy]]]:
    """``count`` in-process replicas with the tenants of ``TABLES``, their links up."""
    config: dict[str, Any] = {
        "decode_urls": (Instance(decode.url),), "state_url": redis.url,
        "state_prefix": f"l{uuid.uuid4().hex[:8]}:", "state_load_interval": 0.05,
        "state_timeout": 10.0, "tenants": parse_tenants(TABLES), **settings}
    async with AsyncExitStack() as stack:
        started = [await stack.enter_async_context(
            serve_proxy(Settings(**config, replica_id=f"r{n}"))) for n in range(count)]
        with trio.fail_after(10):
            for _, proxy in started:
                assert proxy.state is not None
                while proxy.state.limits_link is None or proxy.state.live_replicas < count:
                    await proxy.state.next_load_read()
        yield started


async def test_one_limit_holds_across_three_replica_processes(nursery: trio.Nursery) -> None:
    """30 a minute for the tenant, 60 asked through three ``epd-trio serve`` processes: 30
    pass (31 at most: the bucket refills 0.5 a second while the test runs), not 90."""
    with RedisServer() as redis:
        (decode,) = await start_fakes(nursery, FakeVLLM(role="prefill_decode"))
        env = {k: v for k, v in os.environ.items() if not k.startswith("EPD_")}
        env.update({"EPD_STATE_URL": redis.url, "EPD_STATE_PREFIX": f"p{uuid.uuid4().hex[:6]}:",
                    "EPD_DECODE_URLS": decode.url, "EPD_TENANTS": orjson.dumps(TABLES).decode(),
                    "EPD_STATE_TIMEOUT": "10"})
        async with AsyncExitStack() as stack:
            urls = [(await stack.enter_async_context(
                server_process(nursery, SERVE, env, limit=60))).url for _ in range(3)]
            async with httpx.AsyncClient(trust_env=False, timeout=10) as client:
                with trio.fail_after(30):
                    for url in urls:  # the shared roster loaded: the limits' link is up too
                        while (await client.get(url + "/ready")).status_code != 200:  # noqa: ASYNC110
                            await trio.sleep(0.02)  # another process: nothing to wait on
                statuses = [(await client.post(urls[n % 3] + CHAT, json=chat_body(),
                                               headers=TEAM)).status_code for n in range(60)]
                metrics = [(await client.get(url + "/metrics")).text for url in urls]
    assert set(statuses) == {200, 429}
    assert 30 <= statuses.count(200) <= 31, statuses.count(200)
    for text in metrics:  # every decision was the shared one
        assert "epd_trio_state_local_limits_total 0.0" in text


async def test_a_buckets_debt_outlives_its_expiry_until_repaid(
    redis_server: RedisServer, client: httpx.AsyncClient, nursery: trio.Nursery,
) -> None:
    """A request larger than the whole bucket passes when it is full and leaves it in debt
    (5002 of 1200 a minute: 3802 owed, 190 s to repay). A bucket Redis lets expire reads full
    again, so its key lives until the debt is repaid, not the fixed 2 minutes."""
    async with held_replica(redis_server, nursery) as (url, proxy, _, engine):
        key = f"{proxy.state.keys.prefix}limit:metered:tokens_per_minute"
        async with trio.open_nursery() as held:
            held.start_soon(partial(client.post, url + CHAT, json=chat_body(max_tokens=5000),
                                    headers=METERED))
            with trio.fail_after(5):
                while not engine.now:  # noqa: ASYNC110
                    await trio.sleep(0.01)  # its way is over sockets: no event to wait on
            level = float(redis_server.command("HGET", key, "level"))
            assert -3803 < level < -3800
            assert int(redis_server.command("PTTL", key)) > 120_000 + 3800 * 60_000 / 1200
            engine.release.set()


async def test_tokens_reserved_at_one_replica_are_settled_for_all(
    redis_server: RedisServer, client: httpx.AsyncClient, nursery: trio.Nursery,
) -> None:
    """1002 of 1200 reserved at r0, about 10 used: once settled, r1 and r2 admit another
    1002 each in turn (non-stream, stream, non-stream), and a stream whose client leaves
    settles too; unsettled, the bucket would hold 198."""
    (decode,) = await start_fakes(nursery, FakeVLLM(role="prefill_decode"))
    async with fleet(redis_server, decode) as replicas:
        body = chat_body(max_tokens=1000)
        key = f"{replicas[0][1].state.keys.prefix}limit:metered:tokens_per_minute"
        for n, stream in enumerate((False, True, False)):
            url = replicas[n][0]
            r = await client.post(url + CHAT, json={**body, "stream": stream}, headers=METERED)
            assert r.status_code == 200, r.text
            with trio.fail_after(5):  # the settlement is sent after the answer, unawaited
                while float(redis_server.command("HGET", key, "level") or 0) < 1100:  # noqa: ASYNC110
                    await trio.sleep(0.01)
        # A stream its client leaves after the first bytes settles what it used too.
        decode.behaviour.tokens, decode.behaviour.chunk_delay = 1000, 0.05
        async with client.stream("POST", replicas[1][0] + CHAT, headers=METERED,
                                 json={**body, "stream": True}) as r:
            async for _ in r.aiter_bytes():
                break
        with trio.fail_after(5):
            while float(redis_server.command("HGET", key, "level") or 0) < 1100:  # noqa: ASYNC110
                await trio.sleep(0.01)
        decode.behaviour.tokens, decode.behaviour.chunk_delay = 8, 0.0
        r = await client.post(replicas[0][0] + CHAT, json=chat_body(max_tokens=5000),
                              headers=METERED)
        assert r.status_code == 429 and r.json()["error"]["param"] == "tokens_per_minute"


async def test_redis_killed_under_load_fails_no_request_and_each_replica_takes_its_share(
    client: httpx.AsyncClient, nursery: trio.Nursery,
) -> None:
    redis = RedisServer().start()
    try:
        (decode,) = await start_fakes(nursery, FakeVLLM(role="prefill_decode"))
        async with fleet(redis, decode, state_timeout=1.0) as replicas:
            statuses: list[int] = []
            done = trio.Event()

            async def load(url: str) -> None:
                while not done.is_set():
                    r = await client.post(url + CHAT, json=chat_body(),
                                          headers={"authorization": "Bearer sk-bulk"})
                    statuses.append(r.status_code)

            async with trio.open_nursery() as traffic:
                for url, _ in replicas:
                    traffic.start_soon(load, url)
                with trio.fail_after(10):
                    while len(statuses) < 10:  # noqa: ASYNC110 - mid-run: traffic flowing
                        await trio.sleep(0.01)
                redis.kill()
                for _, proxy in replicas:
                    with trio.fail_after(10):
                        while proxy.state.up:
                            await proxy.state.next_change()
                served_while_down = len(statuses)
                with trio.fail_after(10):
                    while len(statuses) < served_while_down + 30:  # noqa: ASYNC110
                        await trio.sleep(0.01)
                done.set()
            assert statuses and set(statuses) == {200}
            # The team tenant's 30 a minute, split over 3 live replicas: 10 here.
            url, proxy = replicas[0]
            team = [(await client.post(url + CHAT, json=chat_body(), headers=TEAM)).status_code
                    for _ in range(15)]
            assert team.count(200) == 10 and team.count(429) == 5
            # Every decision since the kill was local (the load's, and these 15), counted.
            assert sum(metric(p, "epd_trio_state_local_limits_total")
                       for _, p in replicas) >= 30 + 15
    finally:
        redis.kill()


async def test_max_inflight_counts_the_other_replicas_requests(
    redis_server: RedisServer, client: httpx.AsyncClient, nursery: trio.Nursery,
) -> None:
    """Two requests of a tenant capped at 2 hang at r0; once r1 has read r0's published
    counts, r1 keeps a third waiting and answers 429 ``max_inflight`` at its deadline."""
    (decode,) = await start_fakes(nursery, FakeVLLM(role="prefill_decode"))
    decode.behaviour.hang = True
    capped = {"authorization": "Bearer sk-capped"}
    async with fleet(redis_server, decode, count=2, admission_timeout=0.3) as replicas:
        (url0, _), (url1, proxy1) = replicas
        async with trio.open_nursery() as held:
            for _ in range(2):
                held.start_soon(partial(client.post, url0 + CHAT, json=chat_body(),
                                        headers=capped))
            with trio.fail_after(10):
                await decode.wait_until(lambda: len(decode.requests()) == 2)
                while proxy1.state.others_inflight("capped") < 2:
                    await proxy1.state.next_load_read()
            r = await client.post(url1 + CHAT, json=chat_body(), headers=capped)
            assert r.status_code == 429, r.text
            assert r.json()["error"]["param"] == "max_inflight"
            assert len(decode.requests()) == 2  # the third never reached the engine
            held.cancel_scope.cancel()


async def test_a_waiter_held_by_other_replicas_starts_when_they_release(
    redis_server: RedisServer, client: httpx.AsyncClient, nursery: trio.Nursery,
) -> None:
    """r1's request waits on the tenant's cap, held by r0's two: when r0's end, r1 learns it
    from r0's next published counts and starts it, with no release of its own."""
    (decode,) = await start_fakes(nursery, FakeVLLM(role="prefill_decode"))
    decode.behaviour.hang = True
    capped = {"authorization": "Bearer sk-capped"}
    async with fleet(redis_server, decode, count=2, admission_timeout=30) as replicas:
        (url0, _), (url1, proxy1) = replicas
        answers: list[int] = []
        holding = trio.CancelScope()

        async def hold_two() -> None:
            with holding:
                async with trio.open_nursery() as two:
                    for _ in range(2):
                        two.start_soon(partial(client.post, url0 + CHAT, json=chat_body(),
                                               headers=capped))

        async def third() -> None:
            r = await client.post(url1 + CHAT, json=chat_body(), headers=capped)
            answers.append(r.status_code)

        async with trio.open_nursery() as requests:
            requests.start_soon(hold_two)
            with trio.fail_after(10):
                await decode.wait_until(lambda: len(decode.requests()) == 2)
                while proxy1.state.others_inflight("capped") < 2:
                    await proxy1.state.next_load_read()
            decode.behaviour.hang = False
            requests.start_soon(third)
            for _ in range(3):  # r1 has read the counts again: still waiting
                await proxy1.state.next_load_read()
            assert answers == [] and len(decode.requests()) == 2
            holding.cancel()  # r0's two end (their client left)
            with trio.fail_after(10):
                await decode.wait_until(lambda: len(decode.requests()) == 3)
        assert answers == [200]


async def test_a_tenants_max_inflight_holds_exactly_across_three_replicas(
    redis_server: RedisServer, client: httpx.AsyncClient, nursery: trio.Nursery,
) -> None:
    """60 requests of a tenant capped at 20, all at once through three replicas: exactly 20
    reach the engine and the 40 others wait, though each replica's view of the others' counts
    lags (the store's leases decide); released with 20 ms of engine time each, the engine
    never holds more than 20 of them, and every request is answered 200."""
    (decode,) = await start_fakes(nursery, FakeVLLM(role="prefill_decode"))
    engine = Engine(work=0.02)
    decode.behaviour.gate = engine
    # Every decision the store's (none on a replica's share, as under a store too slow).
    async with fleet(redis_server, decode, admission_timeout=60,
                     state_limits_timeout=10.0) as replicas:
        statuses: list[int] = []
        async with trio.open_nursery() as requests:
            for n in range(60):
                requests.start_soon(wide, client, replicas[n % 3][0], statuses)
            with trio.fail_after(20):
                await decode.wait_until(lambda: len(decode.requests()) >= 20)
                while sum(queued(p, "wide") for _, p in replicas) < 40:
                    for _, proxy in replicas:
                        await proxy.state.next_load_read()
                for _ in range(3):  # every replica has read the others' counts again since
                    for _, proxy in replicas:
                        await proxy.state.next_load_read()
            assert len(decode.requests()) == 20 and engine.now == 20
            engine.release.set()
    assert statuses == [200] * 60
    assert engine.peak == 20


async def test_with_redis_gone_each_replica_holds_its_share_of_max_inflight(
    client: httpx.AsyncClient, nursery: trio.Nursery,
) -> None:
    """Redis killed under three replicas: a tenant capped at 20 gets 6 places at each (20 / 3),
    10 requests at each put 18 on the engine and queue 12, every decision counted; released,
    all 30 are answered 200."""
    redis = RedisServer().start()
    try:
        (decode,) = await start_fakes(nursery, FakeVLLM(role="prefill_decode"))
        engine = Engine()
        decode.behaviour.gate = engine
        async with fleet(redis, decode, state_timeout=1.0, admission_timeout=60) as replicas:
            redis.kill()
            for _, proxy in replicas:
                with trio.fail_after(10):
                    while proxy.state.up:
                        await proxy.state.next_change()
            statuses: list[int] = []
            async with trio.open_nursery() as requests:
                for n in range(30):
                    requests.start_soon(wide, client, replicas[n % 3][0], statuses)
                with trio.fail_after(10):
                    await decode.wait_until(lambda: len(decode.requests()) >= 18)
                    while any(queued(p, "wide") < 4 for _, p in replicas):  # noqa: ASYNC110
                        await trio.sleep(0.01)  # requests still arriving: no event to wait on
                assert len(decode.requests()) == 18
                assert [metric(p, "epd_trio_state_local_limits_total") for _, p in replicas] \
                    == [6, 6, 6]
                engine.release.set()
            assert statuses == [200] * 30
    finally:
        redis.kill()


async def test_a_store_that_lost_the_places_gets_them_back_from_the_replicas(
    redis_server: RedisServer, client: httpx.AsyncClient, nursery: trio.Nursery,
) -> None:
    """Two requests of a capped tenant held at r0; the store loses every key and r0's
    connections (a restart without persistence): r0 writes its two leases back as soon as it
    reconnects, so the store counts them again."""
    async with held_replica(redis_server, nursery) as (url, proxy, decode, engine):
        key = f"{proxy.state.keys.prefix}limit:capped:max_inflight"
        async with trio.open_nursery() as held:
            for _ in range(2):
                held.start_soon(partial(client.post, url + CHAT, json=chat_body(),
                                        headers=CAPPED))
            with trio.fail_after(10):
                await decode.wait_until(lambda: len(decode.requests()) == 2)
            assert int(redis_server.command("ZCARD", key)) == 2
            redis_server.command("FLUSHALL")
            redis_server.command("CLIENT", "KILL", "TYPE", "normal")
            with trio.fail_after(10):
                while proxy.state.up:
                    await proxy.state.next_change()
                while not proxy.state.up:
                    await proxy.state.next_change()
                while int(redis_server.command("ZCARD", key)) < 2:  # noqa: ASYNC110
                    await trio.sleep(0.01)  # the store is another process: nothing to wait on
            engine.release.set()
        with trio.fail_after(5):  # both given back when they ended (unawaited)
            while int(redis_server.command("ZCARD", key)):  # noqa: ASYNC110
                await trio.sleep(0.01)


async def test_a_lease_its_replica_stopped_renewing_frees_its_place(
    redis_server: RedisServer, client: httpx.AsyncClient, nursery: trio.Nursery,
) -> None:
    """Two places of a tenant capped at 2 held by leases that ended (a replica killed
    without giving them back): the next request takes a place; two live leases in their
    stead, and it waits, then gets 429 ``max_inflight``."""
    (decode,) = await start_fakes(nursery, FakeVLLM(role="prefill_decode"))
    async with fleet(redis_server, decode, count=1, admission_timeout=0.3) as [(url, proxy)]:
        key = f"{proxy.state.keys.prefix}limit:capped:max_inflight"
        redis_server.command("ZADD", key, "1", "dead:1", "2", "dead:2")
        r = await client.post(url + CHAT, json=chat_body(), headers=CAPPED)
        assert r.status_code == 200, r.text
        forever = str(2**50)
        redis_server.command("ZADD", key, forever, "alive:1", forever, "alive:2")
        r = await client.post(url + CHAT, json=chat_body(), headers=CAPPED)
        assert r.status_code == 429 and r.json()["error"]["param"] == "max_inflight", r.text
        assert len(decode.requests()) == 1


async def test_tokens_per_minute_holds_across_three_replicas_under_a_burst(
    redis_server: RedisServer, client: httpx.AsyncClient, nursery: trio.Nursery,
) -> None:
    """30 requests at once through three replicas, each reserving more than 100 tokens of a
    tenant's 1,200 a minute and using about as many: what they used stays within 5 % of the
    limit (and its refill while they ran), and at least as many pass as the limit holds
    reservations."""
    (decode,) = await start_fakes(nursery, FakeVLLM(role="prefill_decode"))
    decode.behaviour.tokens = 100
    async with fleet(redis_server, decode) as replicas:
        answers: list[httpx.Response] = []

        async def one(url: str) -> None:
            answers.append(await client.post(url + CHAT, json=chat_body(max_tokens=100),
                                             headers=METERED))

        started = trio.current_time()
        async with trio.open_nursery() as requests:
            for n in range(30):
                requests.start_soon(one, replicas[n % 3][0])
        elapsed = trio.current_time() - started
    passed = [r for r in answers if r.status_code == 200]
    assert {r.status_code for r in answers} == {200, 429}
    used = sum(r.json()["usage"]["total_tokens"] for r in passed)
    # Each reservation is at least what it used, and every one is settled now.
    assert used <= 1.05 * (1200 + 20 * elapsed), (used, elapsed)
    assert len(passed) >= 1200 // token_reservation(chat_body(max_tokens=100))


def command_calls(redis: RedisServer, name: str) -> int:
    """How many times Redis ran ``name`` since its stats were reset (``INFO commandstats``)."""
    for line in redis.command("INFO", "commandstats").splitlines():
        if line.startswith(f"cmdstat_{name}:"):
            return int(line.split("calls=", 1)[1].split(",", 1)[0])
    return 0


def errors_of(redis: RedisServer, code: str) -> int:
    """How many replies Redis gave with error ``code`` since its stats were reset."""
    for line in redis.command("INFO", "errorstats").splitlines():
        if line.startswith(f"errorstat_{code}:"):
            return int(line.split("count=", 1)[1].split(",", 1)[0])
    return 0


async def test_admissions_go_by_sha_and_survive_a_script_flush(
    redis_server: RedisServer, client: httpx.AsyncClient, nursery: trio.Nursery,
) -> None:
    """Each admission is one ``EVALSHA``; Redis without the script (a fresh one, then a
    ``SCRIPT FLUSH``) answers ``NOSCRIPT`` once and gets the ``EVAL``; no decision falls back
    to the replica's share, and the bucket counts across the flush (3 a minute: the 4th is
    refused)."""
    (decode,) = await start_fakes(nursery, FakeVLLM(role="prefill_decode"))
    async with fleet(redis_server, decode, count=1, state_limits_timeout=10.0) as [(url, proxy)]:
        redis_server.command("SCRIPT", "FLUSH")
        redis_server.command("CONFIG", "RESETSTAT")
        team = {"authorization": "Bearer sk-trio"}
        statuses = []
        for n in range(4):
            if n == 2:
                redis_server.command("SCRIPT", "FLUSH")
            r = await client.post(url + CHAT, json=chat_body(), headers=team)
            statuses.append(r.status_code)
        assert statuses == [200, 200, 200, 429]
        # After each flush, the first take's EVALSHA meets NOSCRIPT once and its EVAL loads
        # the script again. (EVALs are not counted: the replica's load exchange is one too.)
        assert errors_of(redis_server, "NOSCRIPT") == 2
        assert command_calls(redis_server, "evalsha") >= 4
        assert metric(proxy, "epd_trio_state_local_limits_total") == 0


async def test_the_limits_timeout_is_a_setting(
    redis_server: RedisServer, client: httpx.AsyncClient, nursery: trio.Nursery,
) -> None:
    """``EPD_STATE_LIMITS_TIMEOUT`` 0: no answer from the store can come in time, so every
    decision is the replica's share, counted."""
    (decode,) = await start_fakes(nursery, FakeVLLM(role="prefill_decode"))
    async with fleet(redis_server, decode, count=1, state_limits_timeout=0.0) as [(url, proxy)]:
        r = await client.post(url + CHAT, json=chat_body(), headers=TEAM)
        assert r.status_code == 200
        assert metric(proxy, "epd_trio_state_local_limits_total") == 1
