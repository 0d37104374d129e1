"""Replicas as separate processes (``epd-trio serve``, one of them with two workers, and plain
``hypercorn``) sharing one real redis-server: what an operator runs behind a Service."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from contextlib import AsyncExitStack
from typing import Any

import httpx
import trio

from epd_trio import Instance, Settings
from epd_trio._core.shared_state import load_field
from epd_trio.testing import Behaviour, FakeVLLM, serve_proxy
from epd_trio.testing.moriio import MoriioStandIn
from epd_trio.testing.ports import free_port
from epd_trio.testing.process import read_url, stop_process

from helpers import CHAT, chat_body, instances_listing, moriio_pair, server_process, start_fakes
from real_servers import RedisServer

SERVE = [sys.executable, "-m", "epd_trio", "serve", "--port", "0"]
HYPERCORN = [sys.executable, "-m", "hypercorn", "--worker-class", "trio", "epd_trio.app:app",
             "--bind", "127.0.0.1:0"]
HYPERCORN_SERVING = rb"Running on (http://\S+)"
ADMIN = {"x-api-key": "k"}
#: Seconds a replica process may take to start serving.
START = 60.0
#: Seconds a change may take to show on every replica (the target is 1 s at p99).
CONVERGE = 10.0


def fleet_env(redis: RedisServer, prefix: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPD_")}
    return {**env, "EPD_ADMIN_KEY": "k", "EPD_STATE_URL": redis.url, "EPD_STATE_PREFIX": prefix,
            "EPD_STATE_RESYNC_INTERVAL": "0.5", "EPD_HEALTH_INTERVAL": "0.5",
            "EPD_STATE_TIMEOUT": "10", **extra}


async def listing(url: str) -> dict[str, Any]:
    return await instances_listing(url, ADMIN["x-api-key"])


async def until(check: Callable[[dict[str, Any]], bool], url: str) -> float:
    """Seconds until ``check`` holds on ``url``'s ``GET /instances`` (polled: another process)."""
    started = time.monotonic()
    with trio.fail_after(CONVERGE):
        while not check(await listing(url)):  # noqa: ASYNC110 - no event crosses processes
            await trio.sleep(0.02)
    return time.monotonic() - started


def answered(report: dict[str, Any]) -> bool:
    """Every instance of ``report`` has said what it serves (each replica asks on its own)."""
    return all(entry["models_from"] == "/v1/models"
               for entries in report["instances"].values() for entry in entries)


def decode_urls(report: dict[str, Any]) -> list[str]:
    return [entry["url"] for role in ("decode", "prefill_decode")
            for entry in report["instances"][role]]


async def test_three_replica_processes_converge_on_registrations(nursery: trio.Nursery) -> None:
    redis = RedisServer().start()
    try:
        (decode,) = await start_fakes(nursery, FakeVLLM(role="prefill_decode"))
        env = fleet_env(redis, f"p{uuid.uuid4().hex[:8]}:")
        async with AsyncExitStack() as stack:
            urls = [
                (await stack.enter_async_context(server_process(
                    nursery, [*SERVE, "--workers", "2"], env, limit=START))).url,
                (await stack.enter_async_context(server_process(
                    nursery, SERVE, env, limit=START))).url,
                (await stack.enter_async_context(server_process(
                    nursery, HYPERCORN, env, pattern=HYPERCORN_SERVING, limit=START))).url,
            ]
            async with httpx.AsyncClient(trust_env=False, timeout=10) as client:
                r = await client.post(urls[2] + "/instances", headers=ADMIN,
                                      json={"role": "prefill_decode", "url": decode.url})
                assert r.status_code == 200, r.text
                for url in urls:
                    await until(lambda report: decode_urls(report) == [decode.url], url)
                for url in urls:  # each replica (each worker) routes to it
                    for _ in range(4):
                        r = await client.post(url + CHAT, json=chat_body(text="hi"))
                        assert r.status_code == 200, r.text
                # Two workers, two replicas of the fleet. Listings sent together, on fresh
                # connections, so that one idle worker does not accept them all (the kernel
                # hands a shared socket's connections to whichever worker waits first).
                replica_ids: set[str] = set()

                async def replica_of(url: str) -> None:
                    replica_ids.add((await listing(url))["replica"])

                with trio.fail_after(CONVERGE):
                    while len(replica_ids) < 2:
                        async with trio.open_nursery() as together:
                            for _ in range(8):
                                together.start_soon(replica_of, urls[0])
                assert len(replica_ids) == 2
                r = await client.request("DELETE", urls[1] + "/instances", headers=ADMIN,
                                         params={"url": decode.url})
                assert r.status_code == 200
                for url in urls:
                    await until(lambda report: decode_urls(report) == [], url)
    finally:
        redis.kill()


async def test_a_moriio_registration_through_one_replica_reaches_the_others(
    nursery: trio.Nursery,
) -> None:
    redis = RedisServer().start()
    try:
        prefill, decode = moriio_pair("READ", 6500, 63000)
        await start_fakes(nursery, prefill, decode)
        env = fleet_env(redis, f"m{uuid.uuid4().hex[:8]}:", EPD_KV_CONNECTOR="moriio")
        port = free_port()
        async with server_process(nursery, [*SERVE, "--moriio-registration", f"127.0.0.1:{port}"],
                                  env, limit=START) as heard_at, \
                server_process(nursery, HYPERCORN,
                               {**env, "EPD_MORIIO_REGISTRATION": "127.0.0.1:0"},
                               pattern=HYPERCORN_SERVING, limit=START) as other_at:
            heard, other = heard_at.url, other_at.url
            for role, fake in (("P", prefill), ("D", decode)):
                assert fake.moriio is not None
                await nursery.start(MoriioStandIn(f"127.0.0.1:{port}", role,  # type: ignore[arg-type]
                                                  fake.url.removeprefix("http://"),
                                                  fake.moriio.zmq_address).run)
            for url in (heard, other):
                await until(lambda report: report["layout"] == "P+D" and answered(report), url)
            report = await listing(other)
            (entry,) = report["instances"]["prefill"]
            assert entry["source"] == "moriio" and entry["transfer_mode"] == "READ"
            async with httpx.AsyncClient(trust_env=False, timeout=10) as client:
                for url in (heard, other):
                    r = await client.post(url + CHAT, json=chat_body(text="moriio"))
                    assert r.status_code == 200, r.text
            assert len(decode.requests()) == 2
    finally:
        redis.kill()


async def test_a_dead_replicas_requests_stop_counting_within_5_s(nursery: trio.Nursery) -> None:
    """A replica killed with requests in flight (SIGKILL: no goodbye) leaves no count behind:
    there is no shared decrement to miss, its published counts expire."""
    redis = RedisServer().start()
    held = trio.Event()
    try:
        (busy,) = await start_fakes(nursery, FakeVLLM(role="prefill_decode",
                                                      behaviour=Behaviour(gate=held.wait)))
        prefix = f"d{uuid.uuid4().hex[:8]}:"
        env = fleet_env(redis, prefix, EPD_DECODE_URLS=busy.url,
                        EPD_DECODE_POLICY="least_loaded")
        process = await trio.lowlevel.open_process(SERVE, env=env, stderr=subprocess.PIPE)
        try:
            assert process.stderr is not None
            url = await read_url(process.stderr, rb"listening on (http://\S+)", limit=60)

            async def hold() -> None:
                async with httpx.AsyncClient(trust_env=False, timeout=30) as client:
                    with contextlib.suppress(httpx.TransportError):
                        await client.post(url + CHAT, json=chat_body(text="hold"))

            for _ in range(3):
                nursery.start_soon(hold)
            settings = Settings(state_url=redis.url, state_prefix=prefix, replica_id="watcher",
                                decode_urls=(Instance(busy.url),), state_timeout=10.0)
            async with serve_proxy(settings) as (_, watcher):
                link = watcher.state
                assert link is not None
                with trio.fail_after(CONVERGE):
                    while watcher.loads.read("decode", [(busy.url, None)]) != [3]:
                        await link.next_load_read()
                process.kill()
                killed = time.monotonic()
                with trio.fail_after(CONVERGE):
                    while watcher.loads.read("decode", [(busy.url, None)]) != [0]:
                        await link.next_load_read()
                assert time.monotonic() - killed < 5.0
        finally:
            await stop_process(process, grace=0)
            held.set()
    finally:
        redis.kill()


async def test_workers_of_one_named_replica_are_replicas_of_their_own(
    nursery: trio.Nursery,
) -> None:
    """``EPD_REPLICA_ID`` with ``--workers 2``: each worker is ``<id>-w<k>``. Under one id the
    siblings took each other's announcements for their own (and ignored them) and overwrote
    one load hash, hiding each other's requests."""
    redis = RedisServer().start()
    held = trio.Event()
    try:
        (decode,) = await start_fakes(nursery, FakeVLLM(role="prefill_decode",
                                                        behaviour=Behaviour(gate=held.wait)))
        prefix = f"w{uuid.uuid4().hex[:8]}:"
        ids = {"fleet-a-w0", "fleet-a-w1"}
        # No periodic resync during the test: a sibling learns of the registration from its
        # announcement, the path the shared id broke.
        env = fleet_env(redis, prefix, EPD_REPLICA_ID="fleet-a",
                        EPD_STATE_RESYNC_INTERVAL="600")
        async with server_process(nursery, [*SERVE, "--workers", "2"], env,
                                  limit=START) as served:
            url = served.url
            # Both workers started and connected (each publishes its loads): a start-up wait,
            # bounded like one (the second worker may still be importing on a loaded machine).
            with trio.fail_after(START):
                zset = prefix + "replicas"
                while set(redis.command("ZRANGE", zset, "0", "-1").split()) != ids:  # noqa: ASYNC110
                    await trio.sleep(0.02)  # no event crosses processes
            async with httpx.AsyncClient(trust_env=False, timeout=10) as client:
                r = await client.post(url + "/instances", headers=ADMIN,
                                      json={"role": "prefill_decode", "url": decode.url})
                assert r.status_code == 200, r.text
            routing: set[str] = set()  # the workers that list it, probed and healthy
            with trio.fail_after(CONVERGE):
                while routing != ids:
                    report = await listing(url)  # a fresh connection: either worker
                    entries = report["instances"]["prefill_decode"]
                    if [(e["url"], e["probed"], e["state"]) for e in entries] == [
                            (decode.url, True, "healthy")]:
                        routing.add(report["replica"])

            async def hold() -> None:
                async with httpx.AsyncClient(trust_env=False, timeout=60) as client:
                    with contextlib.suppress(httpx.TransportError):
                        r = await client.post(url + CHAT, json=chat_body(text="hold"))
                        assert r.status_code == 200, r.text

            field = load_field("decode", (decode.url, None))

            def published() -> list[int]:  # each worker's count, in its own load hash
                return [int(redis.command("HGET", prefix + "load:" + i, field) or 0)
                        for i in sorted(ids)]

            # Requests held at the instance, each on a fresh connection, until both workers
            # have routed some there and published them.
            sent = 0
            with trio.fail_after(CONVERGE):
                while min(published()) == 0:
                    nursery.start_soon(hold)
                    sent += 1
                    await decode.wait_until(lambda n=sent: len(decode.requests(CHAT)) == n)
                    while sum(published()) != sent:  # noqa: ASYNC110 - no event crosses processes
                        await trio.sleep(0.02)
            settings = Settings(state_url=redis.url, state_prefix=prefix, replica_id="watcher",
                                decode_urls=(Instance(decode.url),), state_timeout=10.0)
            async with serve_proxy(settings) as (_, watcher):
                link = watcher.state
                assert link is not None
                with trio.fail_after(CONVERGE):  # the sum of both workers' counts
                    while watcher.loads.read("decode", [(decode.url, None)]) != [sent]:
                        await link.next_load_read()
            clean: set[str] = set()  # neither finds another process under its id
            with trio.fail_after(CONVERGE):
                while clean != ids:
                    report = await listing(url)
                    assert report["state"]["duplicate_id"] is False
                    clean.add(report["replica"])
            held.set()
    finally:
        held.set()
        redis.kill()
