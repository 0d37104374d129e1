"""MoRIIO registration over a real ZMQ socket: join, refresh, TTL, mode lock, bad traffic."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import msgpack
import pytest
import trio
import trio.testing

from epd_trio import Settings
from epd_trio._core.moriio import MAX_FRAME_BYTES
from epd_trio._core.roster import Roster
from epd_trio._core.routing import dp_slots
from epd_trio._proxy import Proxy
from epd_trio.testing import serve_proxy
from epd_trio.testing.moriio import MoriioStandIn, moriio_address

ADMIN = {"x-api-key": "admin"}


def moriio_settings(**extra: Any) -> Settings:
    return Settings(kv_connector="moriio", moriio_registration="127.0.0.1:0", **extra)


@asynccontextmanager
async def running_proxy(
    clock: Callable[[], float] | None = None, **extra: Any
) -> AsyncIterator[Proxy]:
    """A proxy with its background tasks (listener, prober) but no HTTP side."""
    proxy = Proxy(moriio_settings(**extra), clock=clock or trio.current_time)
    async with trio.open_nursery() as nursery:
        await proxy.start(nursery)
        try:
            yield proxy
        finally:
            await proxy.aclose()


def stand_in(proxy: Proxy, n: int, role: str = "P", **extra: Any) -> MoriioStandIn:
    assert proxy.membership.moriio_endpoint is not None
    return MoriioStandIn(proxy.membership.moriio_endpoint, role, f"127.0.0.{n}:{8000 + n}",  # type: ignore[arg-type]
                         moriio_address(f"127.0.0.{n}", 6300 + n, 61000 + n), **extra)


def url_of(beat: MoriioStandIn) -> str:
    return f"http://{beat.http_address}"


def urls(roster: Roster, stage: str | None = None) -> list[str]:
    return [m.url for m in roster.members if stage is None or m.stage == stage]


async def test_instances_join_the_roster_with_their_sizes_and_show_everywhere(
    client: httpx.AsyncClient,
) -> None:
    async with serve_proxy(moriio_settings(admin_key="admin")) as (url, proxy), \
            trio.open_nursery() as nursery:
        prefill = stand_in(proxy, 1, "P", dp_size=2, tp_size=4)
        decodes = [stand_in(proxy, 2, "D"), stand_in(proxy, 3, "D", dp_size=8)]
        for beat in (prefill, *decodes):
            await nursery.start(beat.run)
        await proxy.wait_roster(lambda r: len(r.members) == 3)
        assert urls(proxy.roster, "prefill") == ["http://127.0.0.1:8001"]
        # Per-instance DP sizes in the flat interleaved rotation (not the first one's for all).
        assert sorted(i.dp_size for i in proxy.roster.of("decode")) == [1, 8]
        assert len(dp_slots(proxy.roster.of("decode"))) == 9
        assert proxy.roster.transfer_mode == "READ"
        listing = (await client.get(url + "/instances", headers=ADMIN)).json()
        (entry,) = listing["instances"]["prefill"]
        assert entry["source"] == "moriio" and entry["dp_size"] == 2 and entry["tp_size"] == 4
        assert entry["zmq_address"] == prefill.zmq_address
        health = (await client.get(url + "/health")).json()
        assert {e["url"] for e in health["roles"]["decode"]} == {
            "http://127.0.0.2:8002", "http://127.0.0.3:8003"}
        nursery.cancel_scope.cancel()


async def test_http_and_moriio_registrations_of_one_url_keep_each_others_fields(
    client: httpx.AsyncClient,
) -> None:
    """vLLM's HTTP registrar and its MoRIIO heartbeat both announce a prefill: a refresh over
    one path must not drop what the other registered (its ZMQ peer, its EC addresses)."""
    async with serve_proxy(moriio_settings(admin_key="admin")) as (url, proxy), \
            trio.open_nursery() as nursery:
        beat = stand_in(proxy, 1, "P", interval=1000.0)  # beats only when told to
        await nursery.start(beat.run)
        await proxy.wait_roster(lambda r: r.moriio_peer(url_of(beat)) is not None)
        ec = ["tcp://127.0.0.1:7001"]
        r = await client.post(url + "/instances", headers=ADMIN,
                              json={"role": "prefill", "url": url_of(beat), "ec_zmq_addrs": ec})
        assert r.status_code == 200 and r.json() == {"registered": False}
        (entry,) = (await client.get(url + "/instances", headers=ADMIN)).json()["instances"]["prefill"]
        assert entry["source"] == "moriio" and entry["zmq_address"] == beat.zmq_address
        assert entry["ec_zmq_addrs"] == ec
        version = proxy.roster.version
        listener = proxy.membership.moriio_listener
        assert listener is not None
        seen = listener.received
        beat.beat()  # a MoRIIO heartbeat after the HTTP registration
        await listener.wait_until(lambda: listener.received > seen)
        listing = (await client.get(url + "/instances", headers=ADMIN)).json()
        (entry,) = listing["instances"]["prefill"]
        assert entry["ec_zmq_addrs"] == ec and entry["zmq_address"] == beat.zmq_address
        assert listing["version"] == version  # a heartbeat changed nothing but the time
        nursery.cancel_scope.cancel()


async def test_a_silent_instance_leaves_after_the_ttl_and_a_beating_one_stays(
    mock_clock: trio.testing.MockClock,
) -> None:
    async with running_proxy(moriio_ttl=10.0) as proxy, trio.open_nursery() as nursery:
        silent, beating = stand_in(proxy, 1, interval=1000.0), stand_in(proxy, 2, interval=3.0)
        await nursery.start(silent.run)
        await nursery.start(beating.run)
        await proxy.wait_roster(lambda r: len(r.members) == 2)
        listener = proxy.membership.moriio_listener
        assert listener is not None
        for beats in range(3):  # 9 s of virtual time, in heartbeats of 3 s
            mock_clock.jump(3.0)
            await listener.wait_until(lambda b=beats: listener.received >= 3 + b)
        proxy.sync()  # the listener changed the roster: pull, as a request would
        assert len(proxy.roster.members) == 2
        mock_clock.jump(3.0)  # 12 s: past the TTL for the silent one only
        await proxy.wait_roster(lambda r: urls(r) == ["http://127.0.0.2:8002"])
        silent.beat()  # it comes back by registering again
        await proxy.wait_roster(lambda r: len(r.members) == 2)
        nursery.cancel_scope.cancel()


async def test_the_first_mode_is_locked_in_and_the_other_refused_at_error_level(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, "epd_trio")
    async with running_proxy() as proxy, trio.open_nursery() as nursery:
        await nursery.start(stand_in(proxy, 1, "P", transfer_mode="WRITE").run)
        await proxy.wait_roster(lambda r: r.transfer_mode == "WRITE")
        await nursery.start(stand_in(proxy, 2, "D", transfer_mode="READ").run)
        await nursery.start(stand_in(proxy, 3, "D", transfer_mode="WRITE").run)
        await proxy.wait_roster(lambda r: len(r.members) == 2)
        listener = proxy.membership.moriio_listener
        assert listener is not None
        # The refused one handled (a heartbeat of P could make three messages before it).
        await listener.wait_until(lambda: listener.dropped >= 1)
        proxy.sync()  # the listener changed the roster: pull, as a request would
        assert urls(proxy.roster) == ["http://127.0.0.1:8001", "http://127.0.0.3:8003"]
        refused = [r for r in caplog.records if "127.0.0.2:8002" in r.getMessage()]
        assert [r.levelno for r in refused] == [logging.ERROR]
        assert "transfer mode READ" in refused[0].getMessage()
        nursery.cancel_scope.cancel()


async def test_malformed_traffic_is_dropped_and_registration_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, "epd_trio")
    async with running_proxy() as proxy, trio.open_nursery() as nursery:
        bad, big, good = stand_in(proxy, 1), stand_in(proxy, 2), stand_in(proxy, 3)
        for beat in (bad, big, good):
            beat.interval = 1000.0
        big.register_at_start = False
        # A peer over the frame limit is cut off by ZMQ before its frame is buffered.
        await nursery.start(big.run)
        big.send(b"x" * (MAX_FRAME_BYTES * 4))
        await nursery.start(bad.run)  # its own first registration is good
        garbage = [
            [b"\xc1"], [msgpack.packb([1, 2])], [msgpack.packb({"type": "Z"})],
            [msgpack.packb({"type": "D"})], [msgpack.packb({**bad.payload(), "dp_size": -1})],
            [msgpack.packb(bad.payload()), b"second frame"], [b""],
            [msgpack.packb({**bad.payload(), "http_address": None})],
            [msgpack.packb({**bad.payload(), "http_address": "u:pw@127.0.0.1:8009"})],
            [msgpack.packb({**bad.payload(), "http_address": "127.0.0.1:\uff18"})],
        ]
        for frames in garbage:
            bad.send(*frames)
        await nursery.start(good.run)
        bad.send(msgpack.packb({"type": "HELLO"}))
        bad.send(msgpack.packb({**bad.payload(), "tp_size": 2}))  # the last: ordered after all
        await proxy.wait_roster(lambda r: (m := r.find(url_of(bad))) is not None
                                and m.moriio is not None and m.moriio.tp_size == 2)
        await proxy.wait_roster(lambda r: r.find(url_of(good)) is not None)
        listener = proxy.membership.moriio_listener
        assert listener is not None
        assert listener.dropped == len(garbage)
        proxy.sync()  # the listener changed the roster: pull, as a request would
        assert proxy.roster.find("http://127.0.0.1:8002") is None  # never registered
        dropped = [r for r in caplog.records if "registration dropped" in r.getMessage()]
        assert len(dropped) == len(garbage)  # one line each: all different reasons
        nursery.cancel_scope.cancel()


async def test_a_flood_of_garbage_costs_one_log_line_and_serving_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, "epd_trio")
    async with running_proxy() as proxy, trio.open_nursery() as nursery:
        flood = stand_in(proxy, 1)
        flood.interval = 1000.0
        await nursery.start(flood.run)
        await proxy.wait_roster(lambda r: len(r.members) == 1)
        # As many as ZMQ queues (its send high-water mark is 1000 messages): more is refused at
        # the sender, which is the flood control of a DEALER.
        for _ in range(800):
            assert flood.send(b"\xc1 not msgpack")
        assert flood.send(msgpack.packb({**flood.payload(), "tp_size": 3}))
        await proxy.wait_roster(lambda r: r.members[0].moriio is not None
                                and r.members[0].moriio.tp_size == 3)
        listener = proxy.membership.moriio_listener
        assert listener is not None
        assert listener.dropped == 800
        lines = [r for r in caplog.records if "registration dropped" in r.getMessage()]
        assert len(lines) == 1
        nursery.cancel_scope.cancel()


async def test_a_registration_port_in_use_stops_start_up_with_a_clear_error() -> None:
    async with running_proxy() as first:
        taken = first.membership.moriio_endpoint
        assert taken is not None
        proxy = Proxy(Settings(kv_connector="moriio", moriio_registration=taken))
        async with trio.open_nursery() as nursery:
            with pytest.raises(OSError, match="EPD_MORIIO_REGISTRATION"):
                await proxy.start(nursery)
            await proxy.aclose()
