"""Several proxy replicas sharing one view through a real redis-server (EPD_STATE_URL).

Each test runs its replicas in-process (the real app on Hypercorn, real sockets) against the
session's redis-server, under a key prefix of its own. Convergence is awaited on the replicas'
own roster events (``Proxy.wait_roster``) with a deadline, never with a sleep.
"""

from __future__ import annotations

import logging
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import coredis
import httpx
import pytest
import trio

from epd_trio import Instance, Settings
from epd_trio._core.roster import Roster
from epd_trio._proxy import Proxy
from epd_trio.testing import Behaviour, FakeVLLM, serve_proxy
from epd_trio.testing.moriio import MoriioStandIn
from epd_trio.testing.registrar import run_registrar

from helpers import CHAT, chat_body, image, metric, moriio_pair, start_fakes
from real_servers import RedisServer, tls_redis_server

ADMIN = {"x-api-key": "admin-secret"}
#: Seconds a change may take to reach every replica (the issue's p99 target is 1 s).
CONVERGE = 5.0


@asynccontextmanager
async def replicas(
    redis: RedisServer, count: int = 3, *, prefix: str | None = None, first: int = 0,
    **settings: Any,
) -> AsyncIterator[list[tuple[str, Proxy]]]:
    """``count`` replicas of one fleet (their own key prefix unless ``prefix``), named
    ``r<first>``, ``r<first + 1>``..."""
    prefix = prefix or f"t{uuid.uuid4().hex[:8]}:"
    config: dict[str, Any] = {"admin_key": "admin-secret", "state_url": redis.url,
                              "state_prefix": prefix, "health_interval": 0.2,
                              "state_resync_interval": 0.2, "state_load_interval": 0.05,
                              # Generous: a CI machine running the suite lags the event loop
                              # by seconds at times; the link must not flap because of it.
                              "state_timeout": 10.0, **settings}
    async with AsyncExitStack() as stack:
        started = []
        for index in range(count):
            replica = Settings(**config, replica_id=f"r{first + index}")
            started.append(await stack.enter_async_context(serve_proxy(replica)))
        with trio.fail_after(CONVERGE):
            for _, proxy in started:
                assert proxy.state is not None
                await proxy.state.roster_loaded.wait()
        yield started


async def wait_for(proxy: Proxy, predicate: Callable[[Roster], bool],
                   within: float = CONVERGE) -> None:
    """Until ``predicate`` holds on ``proxy``'s roster (re-checked at each new version and
    every 50 ms of the link's own progress)."""
    with trio.fail_after(within):
        while not predicate(proxy.roster):
            with trio.move_on_after(0.05):
                await proxy.wait_roster(predicate)


def decode_urls(roster: Roster) -> list[str]:
    """The decode instances of ``roster`` that have said what they serve: those a request may
    go to (a newcomer is asked at once by each replica, which takes a round trip)."""
    return [inst.url for inst in roster.of("decode") if inst.url in roster.served]


async def register_and_route_through_each(
    client: httpx.AsyncClient, fleet: list[tuple[str, Proxy]], decode: str, *,
    routable: Callable[[Proxy], bool], requests: int, text: str,
) -> None:
    """Register the decode instance ``decode`` through replica 0, wait until replica 1 has it,
    then through each replica, once ``routable(proxy)``, send ``requests`` chat requests:
    every one a 200."""
    (url0, _), (_, proxy1), *_ = fleet
    r = await client.post(url0 + "/instances", headers=ADMIN,
                          json={"role": "decode", "url": decode})
    assert r.status_code == 200, r.text
    await wait_for(proxy1, lambda roster: decode in decode_urls(roster))
    for url, proxy in fleet:
        await wait_for(proxy, lambda _, p=proxy: routable(p))
        for _ in range(requests):
            r = await client.post(url + CHAT, json=chat_body(text=text))
            assert r.status_code == 200, r.text


async def test_a_registration_at_one_replica_is_routed_by_all(
    redis_server: RedisServer, client: httpx.AsyncClient
) -> None:
    async with trio.open_nursery() as nursery:
        (decode,) = await start_fakes(nursery, FakeVLLM(role="decode"))
        async with replicas(redis_server, decode_urls=()) as fleet:
            (url0, _), *_ = fleet
            r = await client.post(url0 + "/instances", headers=ADMIN,
                                  json={"role": "decode", "url": decode.url})
            assert r.status_code == 200, r.text
            for _, proxy in fleet:
                await wait_for(proxy, lambda roster: decode.url in
                               decode_urls(roster))
            # Every replica routes to it (each probes it on its own first).
            for url, proxy in fleet:
                await wait_for(proxy, lambda _, p=proxy: p.ready())
                r = await client.post(url + CHAT, json=chat_body(text="hi"))
                assert r.status_code == 200, r.text
            listing = (await client.get(fleet[2][0] + "/instances", headers=ADMIN)).json()
            assert listing["replica"] == "r2"
            assert [e["url"] for e in listing["instances"]["decode"]] == [decode.url]
            assert listing["state"]["up"] is True and "admin" not in str(listing["state"])
            # Unregistered at another replica: gone from every one.
            r = await client.request("DELETE", fleet[1][0] + "/instances", headers=ADMIN,
                                     params={"url": decode.url})
            assert r.status_code == 200, r.text
            for _, proxy in fleet:
                await wait_for(proxy, lambda roster: not roster.of("decode"))
        nursery.cancel_scope.cancel()


async def test_an_instance_nobody_routes_to_expires_after_its_ttl(
    redis_server: RedisServer, client: httpx.AsyncClient
) -> None:
    # Nothing listens there: every replica's probes fail, nobody keeps the entry alive.
    dead = "http://127.0.0.1:9"
    async with replicas(redis_server, decode_urls=(), instance_ttl=0.6,
                        health_threshold=1) as fleet:
        r = await client.post(fleet[0][0] + "/instances", headers=ADMIN,
                              json={"role": "decode", "url": dead})
        assert r.status_code == 200
        for _, proxy in fleet:
            await wait_for(proxy, lambda roster: bool(roster.of("decode")))
        for _, proxy in fleet:
            await wait_for(proxy, lambda roster: not roster.of("decode"))
        assert redis_server.command("EXISTS", f"{fleet[0][1].state.keys.instance(dead)}") == "0"


async def test_a_live_instance_outlives_its_ttl_while_a_replica_routes_to_it(
    redis_server: RedisServer, client: httpx.AsyncClient
) -> None:
    async with trio.open_nursery() as nursery:
        (decode,) = await start_fakes(nursery, FakeVLLM(role="decode"))
        async with replicas(redis_server, decode_urls=(), instance_ttl=1.0) as fleet:
            await client.post(fleet[0][0] + "/instances", headers=ADMIN,
                              json={"role": "decode", "url": decode.url})
            proxy = fleet[1][1]
            await wait_for(proxy, lambda _: proxy.ready())
            assert proxy.state is not None
            # Three TTLs later (what is tested is the passage of time), the entry is still
            # there: the replicas that route to it refresh it at every resync.
            await trio.sleep(3.0)
            assert decode_urls(proxy.roster) == [decode.url]
        nursery.cancel_scope.cancel()


async def test_a_malformed_entry_is_skipped_and_counted(
    redis_server: RedisServer, client: httpx.AsyncClient
) -> None:
    async with trio.open_nursery() as nursery:
        (decode,) = await start_fakes(nursery, FakeVLLM(role="decode"))
        prefix = f"t{uuid.uuid4().hex[:8]}:"
        for url, raw in (("http://bad:1", "not json"), ("http://worse:1", '{"v": 99}')):
            redis_server.command("SET", f"{prefix}instance:{url}", raw)
            redis_server.command("SADD", f"{prefix}instances", url)
        redis_server.command("PUBLISH", f"{prefix}roster", "garbage")
        async with replicas(redis_server, 2, prefix=prefix,
                            decode_urls=(Instance(decode.url),)) as fleet:
            for url, proxy in fleet:
                assert decode_urls(proxy.roster) == [decode.url]
                assert metric(proxy, "epd_trio_state_malformed_entries_total") == 2
                r = await client.post(url + CHAT, json=chat_body(text="hi"))
                assert r.status_code == 200
            # A malformed announcement while serving: skipped, counted, the link stays up.
            redis_server.command("PUBLISH", f"{prefix}roster", '{"op": "put", "url": 1}')
            proxy = fleet[0][1]
            with trio.fail_after(CONVERGE):
                while metric(proxy, "epd_trio_state_malformed_entries_total") < 3:
                    await proxy.state.next_load_read()
            assert proxy.state.up
        nursery.cancel_scope.cancel()


async def test_the_global_cursor_splits_items_exactly_across_replicas(
    redis_server: RedisServer, client: httpx.AsyncClient
) -> None:
    async with trio.open_nursery() as nursery:
        encoders = await start_fakes(nursery, *(FakeVLLM(role="encode") for _ in range(3)))
        (decode,) = await start_fakes(nursery, FakeVLLM(role="prefill_decode"))
        # A generous timeout: requests through 3 replicas in one event loop lag it far more
        # than a production replica's; a fallback here would be the loop's fault, not Redis's.
        async with replicas(redis_server, 3, global_cursor=True, global_cursor_timeout=5.0,
                            encode_urls=tuple(Instance(e.url) for e in encoders),
                            decode_urls=(Instance(decode.url),)) as fleet:

            # 32 at a time: 300 at once through 3 replicas in one event loop lag it by seconds.
            limit = trio.CapacityLimiter(32)

            async def send(n: int) -> None:
                url = fleet[n % 3][0]
                async with limit:
                    r = await client.post(url + CHAT, json=chat_body(image(n)))
                assert r.status_code == 200, r.text

            async with trio.open_nursery() as senders:
                for n in range(300):
                    senders.start_soon(send, n)
            fallbacks = [metric(proxy, "epd_trio_global_cursor_fallbacks_total", stage="encode")
                         for _, proxy in fleet]
            assert fallbacks == [0, 0, 0]
            assert [len(e.requests()) for e in encoders] == [100, 100, 100]
            # The split came from the global cursor (independent cursors give it by chance).
            keys = fleet[0][1].state.keys
            assert redis_server.command("GET", keys.cursor("encode", "fake-model")) == "300"
        nursery.cancel_scope.cancel()


async def test_load_aware_routing_sees_another_replicas_requests(
    redis_server: RedisServer, client: httpx.AsyncClient
) -> None:
    held = trio.Event()
    async with trio.open_nursery() as nursery:
        busy, idle = await start_fakes(
            nursery, FakeVLLM(role="prefill_decode", behaviour=Behaviour(gate=held.wait)),
            FakeVLLM(role="prefill_decode"))
        prefix = f"t{uuid.uuid4().hex[:8]}:"
        async with (replicas(redis_server, 1, prefix=prefix, decode_urls=(Instance(busy.url),),
                             decode_policy="least_loaded") as (a,),
                    replicas(redis_server, 1, prefix=prefix, first=1, decode_policy="least_loaded",
                             decode_urls=(Instance(busy.url), Instance(idle.url))) as (b,),
                    trio.open_nursery() as waiting):
            for _ in range(3):  # held at the busy instance, through replica a
                waiting.start_soon(partial(client.post, a[0] + CHAT, json=chat_body(text="hold")))
            link = b[1].state
            assert link is not None
            with trio.fail_after(CONVERGE):
                while b[1].loads.read("decode", [(busy.url, None)]) != [3]:
                    await link.next_load_read()
            for _ in range(4):
                r = await client.post(b[0] + CHAT, json=chat_body(text="route me"))
                assert r.status_code == 200
            assert len(idle.requests(CHAT)) == 4  # none to the instance a keeps busy
            held.set()
        nursery.cancel_scope.cancel()


async def test_no_state_store_means_no_client_no_task_no_extra_metric() -> None:
    code = ("import sys; from epd_trio import Instance, Settings; from epd_trio._proxy import Proxy; "
            "p = Proxy(Settings(decode_urls=(Instance('http://d:1'),))); "
            "assert p.state is None and 'coredis' not in sys.modules; "
            "assert 'epd_trio_state_backend_up' not in p.metrics.exposition().decode(); "
            "print('ok')")
    result = await trio.run_process([sys.executable, "-c", code], capture_stdout=True)
    assert result.stdout.strip() == b"ok"


async def test_redis_killed_and_restarted_empty_under_load_fails_no_request(
    client: httpx.AsyncClient
) -> None:
    redis = RedisServer().start()
    try:
        async with trio.open_nursery() as nursery:
            decodes = await start_fakes(nursery, FakeVLLM(role="prefill_decode"),
                                        FakeVLLM(role="prefill_decode"))
            async with replicas(redis, 3, decode_urls=(), decode_policy="least_loaded",
                                global_cursor=True, global_cursor_timeout=0.5,
                                state_timeout=1.0) as fleet:
                for n, fake in enumerate(decodes):
                    r = await client.post(fleet[n][0] + "/instances", headers=ADMIN,
                                          json={"role": "prefill_decode", "url": fake.url})
                    assert r.status_code == 200
                for _, proxy in fleet:
                    await wait_for(proxy, lambda roster: len(decode_urls(roster)) == 2)
                    await wait_for(proxy, lambda _, p=proxy: p.ready())
                statuses: list[int] = []
                done = trio.Event()

                async def load(url: str) -> None:
                    while not done.is_set():
                        r = await client.post(url + CHAT, json=chat_body(text="steady"))
                        statuses.append(r.status_code)

                fewest = [2]

                async def watch(proxy: Proxy) -> None:  # no replica drops an instance, ever
                    while not done.is_set():
                        fewest[0] = min(fewest[0], len(proxy.roster.of("decode")))
                        with trio.move_on_after(0.01):
                            await proxy.wait_roster(lambda roster: len(roster.of("decode")) < 2)

                async with trio.open_nursery() as traffic:
                    for url, proxy in fleet:
                        traffic.start_soon(load, url)
                        traffic.start_soon(watch, proxy)
                    await trio.sleep(0.3)  # traffic flowing (time is what this measures)
                    redis.kill()
                    for _, proxy in fleet:  # every replica notices, and keeps routing
                        with trio.fail_after(CONVERGE):
                            while proxy.state.up:
                                await proxy.state.next_change()
                    served_while_down = len(statuses)
                    await trio.sleep(0.5)
                    assert len(statuses) > served_while_down  # requests kept flowing
                    redis.start()  # back, empty: no persistence
                    for _, proxy in fleet:
                        with trio.fail_after(CONVERGE):
                            while not proxy.state.up:
                                await proxy.state.next_change()
                    await trio.sleep(0.3)
                    done.set()
                assert statuses and set(statuses) == {200}, sorted(set(statuses))
                assert fewest == [2]
                # The replicas wrote back what they knew: both instances are in the store
                # again, and no replica dropped one it was routing to.
                keys = fleet[0][1].state.keys
                assert sorted(redis.command("SMEMBERS", keys.index).split()) == sorted(
                    f.url for f in decodes)
                for _, proxy in fleet:
                    assert len(proxy.roster.of("decode")) == 2
                    assert metric(proxy, "epd_trio_state_backend_up") == 1
                    assert metric(proxy, "epd_trio_global_cursor_fallbacks_total",
                                  stage="decode") > 0  # counted while Redis was gone
            nursery.cancel_scope.cancel()
    finally:
        redis.kill()


async def test_unreachable_at_start_serves_static_and_says_why_it_is_not_ready(
    client: httpx.AsyncClient
) -> None:
    redis = RedisServer()  # not started: nothing listens on its port yet
    try:
        async with trio.open_nursery() as nursery:
            static, registered = await start_fakes(nursery, FakeVLLM(role="prefill_decode"),
                                                   FakeVLLM(role="prefill_decode"))
            settings = Settings(admin_key="admin-secret", state_url=redis.url,
                                state_prefix="start:", decode_urls=(Instance(static.url),),
                                state_resync_interval=0.2, health_interval=0.2)
            async with serve_proxy(settings) as (url, proxy):
                r = await client.post(url + CHAT, json=chat_body(text="static still works"))
                assert r.status_code == 200
                assert (await client.get(url + "/health")).status_code == 200
                ready = await client.get(url + "/ready")
                assert ready.status_code == 503
                assert "shared roster is not loaded yet" in ready.json()["reason"]
                assert metric(proxy, "epd_trio_state_backend_up") == 0
                # A registration taken meanwhile is kept, routed, and written on connect.
                r = await client.post(url + "/instances", headers=ADMIN,
                                      json={"role": "prefill_decode", "url": registered.url})
                assert r.status_code == 200
                assert len(proxy.roster.of("decode")) == 2
                redis.start()
                assert proxy.state is not None
                with trio.fail_after(CONVERGE):
                    await proxy.state.roster_loaded.wait()
                assert (await client.get(url + "/ready")).status_code == 200
                assert metric(proxy, "epd_trio_state_backend_up") == 1
                assert redis.command("SMEMBERS", "start:instances") == registered.url
            nursery.cancel_scope.cancel()
    finally:
        redis.kill()


async def test_vllms_registrar_against_three_replicas_whether_it_names_all_or_one(
    redis_server: RedisServer,
) -> None:
    async with trio.open_nursery() as nursery:
        listed, unlisted = await start_fakes(nursery, FakeVLLM(role="prefill_decode"),
                                             FakeVLLM(role="prefill_decode"))
        async with replicas(redis_server, 3, decode_urls=()) as fleet:
            urls = [url for url, _ in fleet]
            # One registrar naming every replica, another naming only the first: both reach
            # all three (the second through the store).
            async with run_registrar(urls, role="prefill_decode", url=listed.url,
                                     api_key="admin-secret") as everywhere, \
                    run_registrar(urls[0], role="prefill_decode", url=unlisted.url,
                                  api_key="admin-secret") as one:
                with trio.fail_after(CONVERGE):
                    await everywhere.wait_until(lambda: everywhere.registered)
                    await one.wait_until(lambda: one.registered)
                for _, proxy in fleet:
                    await wait_for(proxy, lambda roster: sorted(decode_urls(roster)) ==
                                   sorted([listed.url, unlisted.url]))
            # Leaving the blocks sends the registrars' DELETEs: gone from every replica.
            for _, proxy in fleet:
                await wait_for(proxy, lambda roster: not roster.of("decode"))
        nursery.cancel_scope.cancel()


async def test_a_slow_redis_delays_no_request(
    redis_server: RedisServer, client: httpx.AsyncClient
) -> None:
    """Redis paused (every command waits): the only call on a request's path, the opt-in global
    cursor, gives up after its timeout and the replica's own cursor routes."""
    async with trio.open_nursery() as nursery:
        decodes = await start_fakes(nursery, FakeVLLM(role="prefill_decode"),
                                    FakeVLLM(role="prefill_decode"))
        async with replicas(redis_server, 1, global_cursor=True, global_cursor_timeout=0.05,
                            decode_urls=tuple(Instance(f.url) for f in decodes)) as [(url, proxy)]:
            pause = 6.0
            redis_server.command("CLIENT", "PAUSE", str(int(pause * 1000)), "ALL")
            started = time.monotonic()
            try:
                for _ in range(6):
                    r = await client.post(url + CHAT, json=chat_body(text="no waiting"))
                    assert r.status_code == 200
                elapsed = time.monotonic() - started
            finally:
                redis_server.command("CLIENT", "UNPAUSE")
            assert elapsed < pause / 2, elapsed  # no request waited for Redis
            assert metric(proxy, "epd_trio_global_cursor_fallbacks_total", stage="decode") >= 6
            assert [len(f.requests(CHAT)) for f in decodes] == [3, 3]  # still round-robin
        nursery.cancel_scope.cancel()


async def test_a_password_protected_redis_over_tcp_and_a_unix_socket_and_no_password_logged(
    tmp_path: Any, caplog: Any,
) -> None:
    redis = RedisServer(password="hunter2-secret", unix_socket=str(tmp_path / "redis.sock"))
    redis.start()
    try:
        # The global cursor's own lean connection authenticates and selects the database too.
        for url, db in ((redis.url.removesuffix("/0") + "/2", "2"), (redis.unix_url + "?db=1", "1")):
            settings = Settings(state_url=url, state_prefix="auth:", replica_id="a",
                                global_cursor=True, global_cursor_timeout=5.0,
                                decode_urls=(Instance("http://127.0.0.1:9"),))
            async with serve_proxy(settings) as (_, proxy):
                assert proxy.state is not None
                with trio.fail_after(CONVERGE):
                    await proxy.state.roster_loaded.wait()
                assert "hunter2" not in str(proxy.state.describe())
                assert await proxy.state.take("m", "decode", 5) == 0
                assert await proxy.state.take("m", "decode", 1) == 5
            # Namespaced by model: another model's traffic never moves it.
            assert redis.command("-n", db, "GET", "auth:cursor:m:decode") == "6"
            assert redis.command("-n", db, "EXISTS", "auth:fleet") == "1"
        # A wrong password: refused, retried, and still never written to the log.
        wrong = Settings(state_url=f"redis://:wrong-hunter2@127.0.0.1:{redis.port}/0",
                         state_prefix="auth:", decode_urls=(Instance("http://127.0.0.1:9"),))
        async with serve_proxy(wrong) as (_, proxy):
            assert proxy.state is not None
            with trio.fail_after(CONVERGE):
                while proxy.state.problem in (None, "not connected yet"):
                    await proxy.state.next_change()
            assert not proxy.state.up and not proxy.ready()
        assert "hunter2" not in caplog.text and "shared state" in caplog.text
    finally:
        redis.kill()


async def test_two_processes_under_one_replica_id_are_found_out(
    redis_server: RedisServer, caplog: Any,
) -> None:
    """Two live processes given one ``EPD_REPLICA_ID`` (plain ``hypercorn --workers 2``, or a
    pod template with a fixed id): each finds the other's mark on the id's owner key, says
    so in ``GET /instances`` and logs an error naming the setting. A replica of its own does
    not."""
    prefix = f"t{uuid.uuid4().hex[:8]}:"
    config: dict[str, Any] = {"state_url": redis_server.url, "state_prefix": prefix,
                              "state_load_interval": 0.05, "state_timeout": 10.0,
                              "decode_urls": (Instance("http://127.0.0.1:9"),)}
    async with serve_proxy(Settings(**config, replica_id="same")) as (_, a), \
            serve_proxy(Settings(**config, replica_id="same")) as (_, b), \
            serve_proxy(Settings(**config, replica_id="alone")) as (_, alone):
        for proxy in (a, b):
            assert proxy.state is not None
            with trio.fail_after(CONVERGE):
                while not proxy.state.describe()["duplicate_id"]:
                    await proxy.state.next_load_read()
        assert alone.state is not None
        for _ in range(5):  # rounds enough for a clash to show
            await alone.state.next_load_read()
        assert alone.state.describe()["duplicate_id"] is False
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert any("'same' is in use by another live process" in e and "EPD_REPLICA_ID" in e
               for e in errors), errors
    assert not any("'alone'" in e for e in errors)


#: Structural keys of the wrong type, or unreadable, written by hand with a raw client (bytes
#: and all): each is skipped and counted once per replica, and the fleet works on what it can
#: read. Each writes under the key prefix ``p``.
MALFORMED_KEYS: dict[str, Callable[[Any, bytes], Awaitable[Any]]] = {
    "index not a set": lambda r, p: r.set(p + b"instances", b"oops"),
    "fleet marker not a string": lambda r, p: r.hset(p + b"fleet", {b"a": b"b"}),
    "index member not UTF-8": lambda r, p: r.sadd(p + b"instances", [b"http://\xff\xfe:1"]),
    "instance entry not a string": lambda r, p: r.eval(
        "redis.call('sadd', KEYS[1], ARGV[1]); redis.call('hset', KEYS[2], 'a', 'b')",
        [p + b"instances", p + b"instance:http://h:1"], [b"http://h:1"]),
    "replicas set not a sorted set": lambda r, p: r.set(p + b"replicas", b"oops"),
    "another replica's load not a hash": lambda r, p: r.eval(
        "redis.call('zadd', KEYS[1], ARGV[1], 'ghost'); redis.call('set', KEYS[2], 'x')",
        [p + b"replicas", p + b"load:ghost"], [b"99999999999999"]),
    "cursor not a number": lambda r, p: r.set(p + b"cursor:fake-model:decode", b"oops"),
}


@pytest.mark.parametrize("kind", list(MALFORMED_KEYS))
async def test_a_malformed_structural_key_is_skipped_and_counted(
    redis_server: RedisServer, client: httpx.AsyncClient, caplog: Any, kind: str,
) -> None:
    caplog.set_level(logging.INFO, logger="epd_trio")  # "connected as replica" is INFO
    prefix = f"t{uuid.uuid4().hex[:8]}:"
    async with coredis.Redis(host="127.0.0.1", port=redis_server.port) as raw:
        await MALFORMED_KEYS[kind](raw, prefix.encode())
    async with trio.open_nursery() as nursery:
        static, registered = await start_fakes(nursery, FakeVLLM(role="decode"),
                                               FakeVLLM(role="decode"))
        # Ready, each on what it can read (before: every session failed, forever).
        async with replicas(redis_server, 2, prefix=prefix, global_cursor=True,
                            global_cursor_timeout=5.0,
                            decode_urls=(Instance(static.url),)) as fleet:
            await register_and_route_through_each(client, fleet, registered.url,
                                                  routable=Proxy.ready, requests=2, text="hi")
            for _, proxy in fleet:
                assert proxy.state is not None
                with trio.fail_after(CONVERGE):
                    for _ in range(3):  # the load exchange goes on
                        await proxy.state.next_load_read()
            for _, proxy in fleet:
                assert proxy.state is not None and proxy.state.up
                assert metric(proxy, "epd_trio_state_malformed_entries_total") == 1
        nursery.cancel_scope.cancel()
    # Never a reconnect: one session per replica.
    assert sum("connected as replica" in r.getMessage() for r in caplog.records) == 2


#: Seconds a replica may take to get its link back once Redis answers again (its reconnect
#: backoff is capped at 5 s, jittered by +-25 %).
RECONNECT = 15.0


async def link_state(fleet: list[tuple[str, Proxy]], up: bool) -> None:
    """Until every replica's link is ``up`` (or down)."""
    for _, proxy in fleet:
        assert proxy.state is not None
        with trio.fail_after(RECONNECT):
            while proxy.state.up != up:
                await proxy.state.next_change()


def live(proxy: Proxy, url: str) -> bool:
    return proxy.registry.state_for("decode", Instance(url)).live


async def test_no_http_instance_expires_while_the_store_is_unreachable_for_longer_than_its_ttl(
    client: httpx.AsyncClient,
) -> None:
    """Redis frozen for three TTLs: both replicas go on listing and routing what they knew,
    an instance that stopped answering meanwhile included (without a store it would be
    forgotten after one TTL). Once Redis is back, the TTL rules resume: the silent one goes,
    the live one stays."""
    redis = RedisServer().start()
    ttl = 1.0
    try:
        async with trio.open_nursery() as nursery:
            steady, doomed = await start_fakes(nursery, FakeVLLM(role="prefill_decode"),
                                               FakeVLLM(role="prefill_decode"))
            async with replicas(redis, 2, decode_urls=(), instance_ttl=ttl, health_threshold=1,
                                state_timeout=0.5) as fleet:
                for fake in (steady, doomed):
                    r = await client.post(fleet[0][0] + "/instances", headers=ADMIN,
                                          json={"role": "prefill_decode", "url": fake.url})
                    assert r.status_code == 200, r.text
                both = sorted([steady.url, doomed.url])
                for _, proxy in fleet:
                    await wait_for(proxy, lambda roster: sorted(decode_urls(roster)) == both)
                    await wait_for(proxy, lambda _, p=proxy: live(p, steady.url) and
                                   live(p, doomed.url))
                redis.pause()
                try:
                    await link_state(fleet, up=False)
                    doomed.behaviour.healthy = False  # out of rotation, and silent
                    for _, proxy in fleet:
                        await wait_for(proxy, lambda _, p=proxy: not live(p, doomed.url))
                    await trio.sleep(3 * ttl)  # what is tested is the passage of time
                    for url, proxy in fleet:
                        assert sorted(decode_urls(proxy.roster)) == both
                        listing = (await client.get(url + "/instances", headers=ADMIN)).json()
                        assert sorted(e["url"] for e in
                                      listing["instances"]["prefill_decode"]) == both
                        before = len(steady.requests(CHAT))
                        for _ in range(3):
                            r = await client.post(url + CHAT, json=chat_body(text="outage"))
                            assert r.status_code == 200, r.text
                        assert len(steady.requests(CHAT)) == before + 3
                finally:
                    redis.resume()
                await link_state(fleet, up=True)
                # Back: the entries the store lost during the outage are written back, and the
                # TTL rules apply again. Nobody routes to the silent one: it goes.
                for _, proxy in fleet:
                    await wait_for(proxy, lambda roster: decode_urls(roster) == [steady.url],
                                   within=3 * ttl + CONVERGE)
                keys = fleet[0][1].state.keys
                assert redis.command("EXISTS", keys.instance(steady.url)) == "1"
            nursery.cancel_scope.cancel()
    finally:
        redis.kill()


async def test_no_moriio_instance_expires_while_the_store_is_unreachable_for_longer_than_its_ttl(
    client: httpx.AsyncClient,
) -> None:
    """The same for MoRIIO heartbeats: the decode instance stops beating during an outage of
    three TTLs, and both replicas still list and route it; once Redis is back it goes after
    one TTL, while the prefill instance, which kept beating, stays."""
    redis = RedisServer().start()
    ttl = 1.0
    try:
        prefill, decode = moriio_pair("READ", 6700, 63300)
        async with trio.open_nursery() as nursery:
            await start_fakes(nursery, prefill, decode)
            async with replicas(redis, 2, decode_urls=(), kv_connector="moriio",
                                moriio_registration="127.0.0.1:0", moriio_ttl=ttl,
                                state_timeout=0.5) as fleet, \
                    trio.open_nursery() as beating:
                heard = fleet[0][1].membership.moriio_endpoint
                assert heard is not None
                beats = {}
                for role, fake in (("P", prefill), ("D", decode)):
                    assert fake.moriio is not None
                    beats[role] = MoriioStandIn(heard, role,  # type: ignore[arg-type]
                                                fake.url.removeprefix("http://"),
                                                fake.moriio.zmq_address, interval=0.2)
                decode_beats = trio.CancelScope()

                async def beat_decode(task_status: trio.TaskStatus[None]) -> None:
                    with decode_beats:
                        await beats["D"].run(task_status=task_status)

                await beating.start(beats["P"].run)
                await beating.start(beat_decode)
                for _, proxy in fleet:
                    await wait_for(proxy, lambda roster: decode.url in roster.served
                                   and prefill.url in roster.served)
                    await wait_for(proxy, lambda _, p=proxy: p.ready())
                redis.pause()
                try:
                    await link_state(fleet, up=False)
                    decode_beats.cancel()  # it never beats again
                    await trio.sleep(3 * ttl)  # what is tested is the passage of time
                    for url, proxy in fleet:
                        assert proxy.roster.find(decode.url) is not None
                        listing = (await client.get(url + "/instances", headers=ADMIN)).json()
                        assert [e["url"] for e in listing["instances"]["decode"]] == [decode.url]
                        r = await client.post(url + CHAT, json=chat_body(text="moriio outage"))
                        assert r.status_code == 200, r.text
                    assert len(decode.requests(CHAT)) == 2
                finally:
                    redis.resume()
                await link_state(fleet, up=True)
                for _, proxy in fleet:
                    await wait_for(proxy, lambda roster: roster.find(decode.url) is None,
                                   within=3 * ttl + CONVERGE)
                    assert proxy.roster.find(prefill.url) is not None
                beating.cancel_scope.cancel()
            nursery.cancel_scope.cancel()
    finally:
        redis.kill()


async def test_a_registration_taken_after_the_link_was_lost_is_written_on_reconnect(
    client: httpx.AsyncClient,
) -> None:
    """Lost while serving (not at start): a registration at one replica meanwhile is kept and
    routed there at once, and reaches the other replica through Redis once the link is back."""
    redis = RedisServer().start()
    try:
        async with trio.open_nursery() as nursery:
            first, late = await start_fakes(nursery, FakeVLLM(role="prefill_decode"),
                                            FakeVLLM(role="prefill_decode"))
            async with replicas(redis, 2, decode_urls=(), state_timeout=0.5) as fleet:
                (url0, proxy0), (url1, proxy1) = fleet
                r = await client.post(url0 + "/instances", headers=ADMIN,
                                      json={"role": "prefill_decode", "url": first.url})
                assert r.status_code == 200
                await wait_for(proxy1, lambda roster: decode_urls(roster) == [first.url])
                redis.pause()
                try:
                    await link_state(fleet, up=False)
                    r = await client.post(url0 + "/instances", headers=ADMIN,
                                          json={"role": "prefill_decode", "url": late.url})
                    assert r.status_code == 200, r.text
                    await wait_for(proxy0, lambda _: live(proxy0, late.url))
                    for _ in range(4):  # routed at once by the replica that took it
                        r = await client.post(url0 + CHAT, json=chat_body(text="late"))
                        assert r.status_code == 200, r.text
                    assert len(late.requests(CHAT)) == 2
                    assert decode_urls(proxy1.roster) == [first.url]  # cut off: not yet
                finally:
                    redis.resume()
                await link_state(fleet, up=True)
                expected = sorted([first.url, late.url])
                await wait_for(proxy1, lambda roster: sorted(decode_urls(roster)) == expected)
                keys = proxy0.state.keys
                assert sorted(redis.command("SMEMBERS", keys.index).split()) == expected
                await wait_for(proxy1, lambda _: live(proxy1, late.url))
                for _ in range(4):
                    r = await client.post(url1 + CHAT, json=chat_body(text="late"))
                    assert r.status_code == 200, r.text
                assert len(late.requests(CHAT)) == 4
            nursery.cancel_scope.cancel()
    finally:
        redis.kill()


async def test_a_tls_redis_with_a_private_ca_carries_the_roster_and_the_global_cursor(
    client: httpx.AsyncClient, tmp_path: Path,
) -> None:
    """``rediss://...?ssl_ca_certs=`` to a redis-server that speaks TLS only, its certificate
    signed by a CA made for the test: the coredis link (roster, announcements, loads) and the
    global cursor's own lean link both verify it and work; without the CA the system's
    authorities refuse the server, and the link says why."""
    redis = tls_redis_server(tmp_path)
    try:
        assert redis.url.startswith("rediss://")
        async with trio.open_nursery() as nursery:
            static, registered = await start_fakes(nursery, FakeVLLM(role="decode"),
                                                   FakeVLLM(role="decode"))
            async with replicas(redis, 2, global_cursor=True, global_cursor_timeout=5.0,
                                decode_urls=(Instance(static.url),)) as fleet:
                await register_and_route_through_each(
                    client, fleet, registered.url, routable=lambda p: live(p, registered.url),
                    requests=3, text="tls")
                for _, proxy in fleet:
                    assert proxy.state is not None
                    assert proxy.state.describe()["backend"].startswith("rediss://")
                    assert metric(proxy, "epd_trio_global_cursor_fallbacks_total",
                                  stage="decode") == 0
                    with trio.fail_after(CONVERGE):  # the load exchange runs over TLS too
                        await proxy.state.next_load_read()
                # Six decisions, each one increment of the shared cursor: an exact split.
                (_, proxy0), _ = fleet
                assert proxy0.state is not None
                keys = proxy0.state.keys
                assert redis.command("GET", keys.cursor("decode", "fake-model")) == "6"
                assert [len(f.requests(CHAT)) for f in (static, registered)] == [3, 3]
            nursery.cancel_scope.cancel()
        # The same server without the private CA: refused by the system's authorities.
        untrusted = Settings(state_url=f"rediss://127.0.0.1:{redis.port}/0", state_prefix="tls:",
                             decode_urls=(Instance("http://127.0.0.1:9"),))
        async with serve_proxy(untrusted) as (_, proxy):
            assert proxy.state is not None
            with trio.fail_after(CONVERGE):
                while proxy.state.problem in (None, "not connected yet"):
                    await proxy.state.next_change()
            assert not proxy.state.up and "CERTIFICATE_VERIFY_FAILED" in proxy.state.problem
    finally:
        redis.kill()


async def test_replicas_see_the_same_pools_and_each_model_has_its_own_global_cursor(
    redis_server: RedisServer, client: httpx.AsyncClient,
) -> None:
    """Two models behind two replicas over one Redis: each replica learns the same pools (each
    asks the instances itself), and the global cursor is one key per model, so model A's
    requests alternate exactly over A's decodes whichever replica takes them, and B's
    traffic never moves A's cursor."""
    async with trio.open_nursery() as nursery:
        fakes = {name: [FakeVLLM("prefill_decode", model=name) for _ in range(2)]
                 for name in ("A", "B")}
        await start_fakes(nursery, *fakes["A"], *fakes["B"])
        urls = tuple(Instance(f.url) for group in fakes.values() for f in group)
        async with replicas(redis_server, 2, decode_urls=urls, global_cursor=True,
                            global_cursor_timeout=5.0) as fleet:
            for _, proxy in fleet:
                assert {m: [i.url for i in route.decodes.instances]
                        for m, route in proxy.models.by_name.items()} == {
                    m: [f.url for f in group] for m, group in fakes.items()}
            for n, model in enumerate("ABAABBAABA"):
                url = fleet[n % 2][0]
                r = await client.post(url + CHAT, json={**chat_body(), "model": model})
                assert r.status_code == 200, r.text
            # Six of A, four of B, each split exactly, whichever replica took them.
            assert [len(f.requests()) for f in fakes["A"]] == [3, 3]
            assert [len(f.requests()) for f in fakes["B"]] == [2, 2]
            keys = fleet[0][1].state.keys
            assert redis_server.command("GET", keys.cursor("decode", "A")) == "6"
            assert redis_server.command("GET", keys.cursor("decode", "B")) == "4"
        nursery.cancel_scope.cancel()
