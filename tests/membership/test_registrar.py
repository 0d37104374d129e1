"""vLLM's registrar (``epd_trio.testing.registrar``): its schedule on trio's virtual clock with a
scripted transport, then against real proxies over real sockets."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import httpx
import orjson
import pytest
import trio
import trio.testing

from epd_trio import Settings
from epd_trio._core.roster import Roster
from epd_trio._proxy import Proxy
from epd_trio.testing import FakeVLLM, serve_proxy
from epd_trio.testing.ports import free_port
from epd_trio.testing.registrar import (
    DEFAULT_ANNOUNCE_INTERVAL,
    DEFAULT_RETRY_INTERVAL,
    Registrar,
    run_registrar,
)

from helpers import start_fakes

KEY = "admin-secret"
ADMIN = {"x-api-key": KEY}


# -- the schedule, on virtual time ----------------------------------------------------------------
async def _hang(request: httpx.Request) -> httpx.Response:
    await trio.sleep_forever()
    raise AssertionError("unreachable")


def _refuse(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("connection refused", request=request)


def _status(code: int) -> Callable[[httpx.Request], httpx.Response]:
    return lambda request: httpx.Response(code, text=f"status {code}")


#: What proxy B answers, request by request (proxy A always says 200).
B_SCRIPT = [_refuse, _hang, _status(401), _status(201), _status(200), _status(500), _status(200)]


async def test_the_schedule_is_vllms_on_virtual_time(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, "epd_trio.testing.registrar")
    seen: list[tuple[float, str, str, dict[str, Any], str | None]] = []
    script = iter(B_SCRIPT)

    def handle(request: httpx.Request) -> Any:
        seen.append((trio.current_time(), request.method, request.url.host,
                     orjson.loads(request.content), request.headers.get("x-api-key")))
        assert request.url.path == "/instances"
        if request.url.host == "a" or request.method == "DELETE":
            return httpx.Response(200, json={"registered": True})
        return next(script)(request)

    registrar = Registrar(["http://a:8000/", "http://b:8000"], role="prefill",
                          url="http://inst:9000/", ec_zmq_addrs=["tcp://inst:7001"],
                          api_key=KEY, transport=httpx.MockTransport(handle))
    assert (registrar.retry_interval, registrar.announce_interval) == (5.0, 30.0)  # vLLM's
    assert (DEFAULT_RETRY_INTERVAL, DEFAULT_ANNOUNCE_INTERVAL) == (5.0, 30.0)
    async with trio.open_nursery() as nursery:
        await nursery.start(registrar.run)
        await registrar.wait_until(lambda: registrar.rounds == len(B_SCRIPT))
        nursery.cancel_scope.cancel()
    # Start-up: every 5 s to both until one round is all 200. Refused at 0; a hang times out at
    # 5 + 5; a 401 at 15 and a 201 at 20 are refusals too; all 200 at 25. Then every 30 s,
    # whatever the answer (B's 500 at 55 is not retried sooner); the DELETE round when stopped.
    post_times = [0.0, 5.0, 15.0, 20.0, 25.0, 55.0, 85.0]
    expected = [(t, "POST", host) for t in post_times for host in ("a", "b")]
    expected += [(85.0, "DELETE", "a"), (85.0, "DELETE", "b")]
    assert sorted((t, m, h) for t, m, h, _, _ in seen) == sorted(expected)
    record = {"role": "prefill", "url": "http://inst:9000", "ec_zmq_addrs": ["tcp://inst:7001"],
              "dp_size": 1}
    assert all(body == record and key == KEY for _, _, _, body, key in seen)
    assert registrar.registered and registrar.rounds == len(B_SCRIPT) + 1
    refusals = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert [m.split(" with ")[1].split(":")[0] for m in refusals] == ["401", "201", "500"]
    assert any("connection refused" in r.getMessage() and r.levelno == logging.DEBUG
               for r in caplog.records)


async def test_one_url_as_a_string_and_no_key_header_without_a_key(
    autojump_clock: trio.testing.MockClock,
) -> None:
    headers: list[str | None] = []

    def handle(request: httpx.Request) -> httpx.Response:
        headers.append(request.headers.get("x-api-key"))
        return httpx.Response(200)

    async with run_registrar("http://only:1", role="encode", url="http://e:1",
                             transport=httpx.MockTransport(handle)) as registrar:
        await registrar.wait_until(lambda: registrar.registered)
        assert registrar.proxy_urls == ["http://only:1"] and registrar.accepted == {
            "http://only:1": True}
    assert headers == [None, None]  # one POST, one DELETE: vLLM sends no key header
    with pytest.raises(ValueError, match="at least one proxy"):
        Registrar([], role="encode", url="http://e:1")


# -- against real proxies -------------------------------------------------------------------------
def listed(url: str) -> Callable[[Roster], bool]:
    return lambda roster: roster.find(url) is not None


async def serve_until(
    stop: trio.Event, port: int = 0, *, task_status: trio.TaskStatus[tuple[str, Proxy]],
) -> None:
    """A real proxy (admin key, no static instance) served until ``stop``: a task, so that
    one can start after the registrar and still outlive it."""
    async with serve_proxy(Settings(admin_key=KEY, decode_urls=()), port=port) as served:
        task_status.started(served)
        await stop.wait()


async def test_registers_with_every_proxy_retries_a_down_one_re_announces_and_leaves(
    client: httpx.AsyncClient, nursery: trio.Nursery,
) -> None:
    (fake,) = await start_fakes(nursery, FakeVLLM("prefill_decode", dp_size=2))
    stop = trio.Event()
    url_a, a = await nursery.start(serve_until, stop)
    url_b, b = await nursery.start(serve_until, stop)
    late_port = free_port()
    late_url = f"http://127.0.0.1:{late_port}"
    async with run_registrar([url_a, url_b, late_url], role="prefill_decode", url=fake.url,
                             dp_size=2, api_key=KEY, retry_interval=0.02,
                             announce_interval=0.2) as registrar:
        # The third proxy is down: the first rounds reach the other two only, and retry.
        await registrar.wait_until(lambda: registrar.rounds >= 2)
        assert not registrar.registered
        assert registrar.accepted == {url_a: True, url_b: True, late_url: False}
        await a.wait_roster(listed(fake.url))
        await b.wait_roster(listed(fake.url))
        _, late = await nursery.start(serve_until, stop, late_port)
        await late.wait_roster(listed(fake.url))
        await registrar.wait_until(lambda: registrar.registered)
        for url in (url_a, url_b, late_url):
            listing = (await client.get(url + "/instances", headers=ADMIN)).json()
            (entry,) = listing["instances"]["prefill_decode"]
            assert (entry["url"], entry["dp_size"], entry["source"]) == (fake.url, 2, "registered")
        # Re-announcing refills a proxy that lost the instance (as one restarted empty would).
        before = b.roster.version
        r = await client.delete(url_b + "/instances", headers=ADMIN, params={"url": fake.url})
        assert r.json() == {"removed": True}
        await b.wait_roster(lambda roster: roster.version >= before + 2  # removed, then back
                            and roster.find(fake.url) is not None)
        # Stop between rounds (a POST cancelled in flight could land after the DELETE).
        seen = registrar.rounds
        await registrar.wait_until(lambda: registrar.rounds > seen)
    # Leaving the block stopped it: one DELETE round, and every proxy has forgotten it.
    assert registrar.accepted == {url_a: True, url_b: True, late_url: True}
    for proxy in (a, b, late):
        assert proxy.roster.find(fake.url) is None
    stop.set()
