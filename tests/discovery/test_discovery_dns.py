"""DNS discovery against a real DNS server (dnsmasq on a loopback port), with traffic flowing.

The decode fakes listen on 127.0.0.2, .3 and .4 (all loopback) on one port, as the pods of a
headless Service do; the proxy expands ``dns+http://vllm-decode.test:PORT`` through dnsmasq.
Every wait is on an event: dnsmasq's reload line, a discovery round, a fake's request log.
"""

from __future__ import annotations

import os
import re
import socket
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import dns._asyncio_backend
import dns._trio_backend
import dns.asyncbackend
import httpx
import pytest
import trio
from dnsmasq import Dnsmasq, dnsmasq

import epd_trio.__main__ as epd_main
from epd_trio._core.config import ConfigError, Settings, settings_from
from epd_trio._core.discovery import EMPTY_CONFIRMATIONS, Empty, parse_dns_url
from epd_trio._discovery.dns import DnsDiscovery, ask, make_resolver
from epd_trio._discovery.start import check_discovery
from epd_trio._proxy import Proxy
from epd_trio.testing import FakeVLLM, serve_proxy
from epd_trio.testing.cluster import answered

from helpers import (
    CHAT,
    POD_ADDRESSES,
    chat_body,
    every_worker_lists,
    serve_on_addresses,
    server_process,
)

ADDRESSES = POD_ADDRESSES
NAME = "vllm-decode.test"


async def serve_fakes(
    nursery: trio.Nursery, addresses: tuple[str, ...], dp_size: int = 1
) -> tuple[int, list[FakeVLLM]]:
    """One decode fake per address, all on the same port."""
    fakes = [FakeVLLM(role="decode", dp_size=dp_size) for _ in addresses]
    return await serve_on_addresses(nursery, fakes, addresses), fakes


def settings_for(spec: str, server: Dnsmasq, **extra: Any) -> Settings:
    return Settings(decode_urls=(parse_dns_url(spec),), dns_nameserver=server.nameserver,
                    dns_interval=0.05, dns_timeout=0.3, **extra)


def decode_urls(proxy: Proxy) -> list[str]:
    proxy.sync()
    return [inst.url for inst in proxy.roster.of("decode")]


def discovery_of(proxy: Proxy) -> DnsDiscovery:
    (source,) = proxy.membership.discovery
    assert isinstance(source, DnsDiscovery)
    return source


@asynccontextmanager
async def traffic(url: str) -> AsyncIterator[list[int]]:
    """Requests sent one after another through the proxy for the block; yields their statuses."""
    statuses: list[int] = []
    async with httpx.AsyncClient(base_url=url, timeout=10) as client, trio.open_nursery() as n:

        async def send() -> None:
            while True:
                response = await client.post(CHAT, json=chat_body())
                statuses.append(response.status_code)

        n.start_soon(send)
        try:
            yield statuses
        finally:
            n.cancel_scope.cancel()


async def served_by(fake: FakeVLLM, more: int) -> None:
    """Wait until ``fake`` has served ``more`` requests beyond what it has now."""
    target = len(fake.requests()) + more
    await fake.wait_until(lambda: len(fake.requests()) >= target)


async def until(discovery: DnsDiscovery, predicate: Callable[[], bool]) -> None:
    with trio.fail_after(10):
        await discovery.wait_until(predicate)


async def test_records_added_and_removed_while_traffic_flows(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    port, (d2, d3, d4) = await serve_fakes(nursery, ADDRESSES, dp_size=2)
    async with dnsmasq(tmp_path, [(ADDRESSES[0], NAME), (ADDRESSES[1], NAME)]) as server, \
            serve_proxy(settings_for(f"dns+http://{NAME}:{port}#dp=2", server)) as (url, proxy):
        found = discovery_of(proxy)
        # Resolved before the proxy served its first request.
        assert decode_urls(proxy) == [f"http://{a}:{port}" for a in ADDRESSES[:2]]
        assert all(i.dp_size == 2 for i in proxy.roster.of("decode"))
        async with traffic(url) as statuses:
            await served_by(d2, 2)
            await served_by(d3, 2)
            await server.set_hosts([(a, NAME) for a in ADDRESSES])  # .4 joins
            await until(found, lambda: len(decode_urls(proxy)) == 3)
            await served_by(d4, 4)
            await server.set_hosts([(a, NAME) for a in ADDRESSES[1:]])  # .2 leaves
            await until(found, lambda: f"http://{ADDRESSES[0]}:{port}" not in decode_urls(proxy))
            left_at, d3_at, d4_at = len(d2.requests()), len(d3.requests()), len(d4.requests())
            await served_by(d3, 6)
            await served_by(d4, 6)
        assert len(d2.requests()) <= left_at + 1  # at most one request in flight when it left
        assert statuses and set(statuses) == {200}, statuses
        # The rotation went on alternating between the two that stayed.
        assert abs((len(d3.requests()) - d3_at) - (len(d4.requests()) - d4_at)) <= 2
        instances = proxy.instances()["instances"]["decode"]
        assert {e["discovered_by"] for e in instances} == {f"dns+http://{NAME}:{port}#dp=2"}
        assert {e["source"] for e in instances} == {"discovered"}


async def test_a_resolver_that_stops_answering_keeps_the_last_view(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    port, fakes = await serve_fakes(nursery, ADDRESSES[:2])
    async with dnsmasq(tmp_path, [(a, NAME) for a in ADDRESSES[:2]]) as server, \
            serve_proxy(settings_for(f"dns+http://{NAME}:{port}", server)) as (url, proxy):
        found = discovery_of(proxy)
        spec = f"dns+http://{NAME}:{port}"
        before = decode_urls(proxy)
        assert len(before) == 2
        server.pause()
        try:
            rounds = found.rounds
            await until(found, lambda: found.rounds >= rounds + 3)
            assert "no answer within" in (found.views[spec].problem or "")
            assert decode_urls(proxy) == before
            async with httpx.AsyncClient(base_url=url, timeout=10) as client:
                for _ in range(4):
                    assert (await client.post(CHAT, json=chat_body())).status_code == 200
            assert all(fake.requests() for fake in fakes)
        finally:
            server.resume()
        await until(found, lambda: found.views[spec].problem is None)
        assert decode_urls(proxy) == before


async def emptied_once_confirmed(found: DnsDiscovery, spec: str, proxy: Proxy, count: int) -> None:
    """Wait for the empty answer to empty the roster, checking that every round before the
    last confirmation kept all ``count`` instances."""
    await until(found, lambda: found.views[spec].empty_rounds >= 1)
    seen: list[tuple[int, int]] = []
    await until(found, lambda: seen.append(
        (found.views[spec].empty_rounds, len(decode_urls(proxy)))) or
        found.views[spec].empty_rounds > EMPTY_CONFIRMATIONS)
    assert {rounds for rounds, _count in seen} >= set(range(1, EMPTY_CONFIRMATIONS + 2))
    assert all(n == count for rounds, n in seen if rounds <= EMPTY_CONFIRMATIONS), seen
    assert decode_urls(proxy) == []


async def test_an_empty_answer_empties_the_roster_once_confirmed(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    port, _fakes = await serve_fakes(nursery, ADDRESSES[:2])
    async with dnsmasq(tmp_path, [(a, NAME) for a in ADDRESSES[:2]]) as server, \
            serve_proxy(settings_for(f"dns+http://{NAME}:{port}", server)) as (url, proxy):
        found = discovery_of(proxy)
        spec = f"dns+http://{NAME}:{port}"
        await server.set_hosts([("127.0.0.9", "other.test")])  # the name is now NXDOMAIN
        # Until confirmed, every round keeps both instances; then they go at once.
        await emptied_once_confirmed(found, spec, proxy, 2)
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            response = await client.post(CHAT, json=chat_body())
        assert response.status_code == 503
        # The name coming back brings them back.
        await server.set_hosts([(ADDRESSES[0], NAME)])
        await until(found, lambda: decode_urls(proxy) == [f"http://{ADDRESSES[0]}:{port}"])


async def test_a_name_left_without_addresses_empties_the_roster_once_confirmed(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """The name still exists (a TXT record) but has no A or AAAA record: NOERROR with no
    answer (dnspython's NoAnswer), not NXDOMAIN. Empty all the same, after two confirmations."""
    port, _fakes = await serve_fakes(nursery, ADDRESSES[:2])
    spec = f"dns+http://{NAME}:{port}"
    async with dnsmasq(tmp_path, [(a, NAME) for a in ADDRESSES[:2]], txt=[NAME]) as server, \
            serve_proxy(settings_for(spec, server)) as (_url, proxy):
        found = discovery_of(proxy)
        assert len(decode_urls(proxy)) == 2
        await server.set_hosts([])
        resolver = await make_resolver(server.nameserver, 1.0)
        for rdtype in ("A", "AAAA"):
            assert await ask(resolver, (NAME, rdtype), search=False) == Empty(
                f"{NAME}: no {rdtype} record")
        assert len(await resolver.resolve(NAME + ".", "TXT", search=False)) == 1  # it exists
        await emptied_once_confirmed(found, spec, proxy, 2)
        await server.set_hosts([(ADDRESSES[1], NAME)])
        await until(found, lambda: decode_urls(proxy) == [f"http://{ADDRESSES[1]}:{port}"])


async def test_srv_targets_and_ports(nursery: trio.Nursery, tmp_path: Path) -> None:
    fakes = [FakeVLLM(role="decode"), FakeVLLM(role="decode")]
    urls = [await nursery.start(partial(fake.serve)) for fake in fakes]
    ports = [int(u.rsplit(":", 1)[1]) for u in urls]
    srv = [f"_http._tcp.vllm.test,t{i}.test,{port}" for i, port in enumerate(ports)]
    hosts = [("127.0.0.1", "t0.test"), ("127.0.0.1", "t1.test")]
    async with dnsmasq(tmp_path, hosts, srv=srv) as server, \
            serve_proxy(settings_for("dnssrv+http://_http._tcp.vllm.test", server)) as (url, proxy):
        found = discovery_of(proxy)
        assert sorted(decode_urls(proxy)) == sorted(urls)
        async with traffic(url) as statuses:
            await served_by(fakes[0], 2)
            await served_by(fakes[1], 2)
            await server.set_hosts(hosts[:1])  # t1 has no address any more: it leaves
            await until(found, lambda: decode_urls(proxy) == [urls[0]])
            await served_by(fakes[0], 3)
        assert set(statuses) == {200}


async def test_an_srv_record_with_port_0_is_skipped_and_logged(
    nursery: trio.Nursery, tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 31: DNS discovery survives what it is fed. Port 0 is legal in an SRV record but
    no instance's port: that record is skipped (logged), the others serve."""
    fake = FakeVLLM(role="decode")
    url = await nursery.start(partial(fake.serve))
    port = int(url.rsplit(":", 1)[1])
    srv = [f"_http._tcp.vllm.test,t0.test,{port}", "_http._tcp.vllm.test,t1.test,0"]
    hosts = [("127.0.0.1", "t0.test"), ("127.0.0.2", "t1.test")]
    async with dnsmasq(tmp_path, hosts, srv=srv) as server, \
            serve_proxy(settings_for("dnssrv+http://_http._tcp.vllm.test", server)) as (url, proxy):
        assert decode_urls(proxy) == [f"http://127.0.0.1:{port}"]
        assert "record t1.test port 0 skipped" in caplog.text
        async with traffic(url) as statuses:
            await served_by(fake, 2)
        assert set(statuses) == {200}
        assert proxy.health()["status"] == "ok"


async def test_localhost_resolves_from_the_hosts_file(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """Issue 31: ``dns+http://localhost:PORT`` failed every round (dnspython asks DNS only,
    and this DNS server knows no ``localhost``); a name the hosts file lists is answered from
    it, as the system's resolver does (``hosts: files dns``)."""
    fake = FakeVLLM(role="decode")
    url = await nursery.start(partial(fake.serve, host="127.0.0.1"))
    port = int(url.rsplit(":", 1)[1])
    local = [line.split()[0] for line in (await trio.Path("/etc/hosts").read_text()).splitlines()
             if "localhost" in line.split("#")[0].split()[1:]]
    assert "127.0.0.1" in local, "this test needs /etc/hosts to name localhost"
    async with dnsmasq(tmp_path, [("127.0.0.1", "t0.test")]) as server, \
            serve_proxy(settings_for(f"dns+http://localhost:{port}", server)) as (url, proxy):
        assert f"http://127.0.0.1:{port}" in decode_urls(proxy)
        async with traffic(url) as statuses:
            await served_by(fake, 2)
        assert set(statuses) == {200}


async def test_srv_records_join_and_leave_while_traffic_flows(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """SRV records change only with a dnsmasq restart (same port): the rounds asked while it is
    down fail and keep the view, so the roster changes only when the new records answer."""
    fakes = [FakeVLLM(role="decode") for _ in range(3)]
    urls = [await nursery.start(partial(fake.serve)) for fake in fakes]
    ports = [int(u.rsplit(":", 1)[1]) for u in urls]
    records = [f"_http._tcp.vllm.test,t{i}.test,{port}" for i, port in enumerate(ports)]
    hosts = [("127.0.0.1", f"t{i}.test") for i in range(3)]
    async with dnsmasq(tmp_path, hosts, srv=records[:2]) as server, \
            serve_proxy(settings_for("dnssrv+http://_http._tcp.vllm.test", server)) as (url, proxy):
        found = discovery_of(proxy)
        assert sorted(decode_urls(proxy)) == sorted(urls[:2])
        async with traffic(url) as statuses:
            await served_by(fakes[0], 2)
            await served_by(fakes[1], 2)
            await server.set_srv(records)  # t2 joins
            await until(found, lambda: len(decode_urls(proxy)) == 3)
            await served_by(fakes[2], 3)
            await server.set_srv(records[1:])  # t0 leaves
            await until(found, lambda: urls[0] not in decode_urls(proxy))
            left_at = len(fakes[0].requests())
            await served_by(fakes[1], 3)
            await served_by(fakes[2], 3)
        assert sorted(decode_urls(proxy)) == sorted(urls[1:])
        assert len(fakes[0].requests()) <= left_at + 1  # at most one in flight when it left
        assert statuses and set(statuses) == {200}, statuses


async def test_the_queries_run_on_dnspythons_trio_backend(
    nursery: trio.Nursery, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every socket of a round is made by dnspython's trio backend, none by its asyncio one,
    even if dnspython's own guess (sniffing the running library) said asyncio: a backend
    picked wrongly cannot hide behind failed rounds that keep the last view."""
    made: list[str] = []
    trio_socket = dns._trio_backend.Backend.make_socket

    async def spy(self: Any, *args: Any, **kwargs: Any) -> Any:
        made.append(self.name())
        return await trio_socket(self, *args, **kwargs)

    async def refuse(self: Any, *args: Any, **kwargs: Any) -> Any:
        made.append(self.name())
        raise AssertionError("dnspython's asyncio backend under trio")

    monkeypatch.setattr(dns._trio_backend.Backend, "make_socket", spy)
    monkeypatch.setattr(dns._asyncio_backend.Backend, "make_socket", refuse)
    monkeypatch.setattr(dns.asyncbackend, "get_default_backend",
                        lambda: dns.asyncbackend.get_backend("asyncio"))  # a wrong guess
    spec = f"dns+http://{NAME}:8000"
    found_urls: list[list[str]] = []
    async with dnsmasq(tmp_path, [(ADDRESSES[0], NAME)]) as server, \
            trio.open_nursery() as rounds:
        found = DnsDiscovery([("decode", parse_dns_url(spec))],
                             lambda source, role, found: found_urls.append(
                                 [d.instance.url for d in found]) or ([], []),
                             nameserver=server.nameserver, interval=0.05, timeout=0.3)
        await rounds.start(found.run)
        await until(found, lambda: found.rounds >= 2)
        rounds.cancel_scope.cancel()
    assert found_urls[0] == [f"http://{ADDRESSES[0]}:8000"]
    assert len(made) >= 4 and set(made) == {"trio"}  # A and AAAA, two rounds


def names_looked_up(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The host names ``socket.getaddrinfo`` is asked for from now on (it still answers)."""
    asked: list[str] = []
    getaddrinfo = socket.getaddrinfo

    def counted(host: Any, *args: Any, **kwargs: Any) -> Any:
        asked.append(host)
        return getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", counted)
    return asked


async def test_a_nameserver_given_by_name_is_resolved_once_at_start(
    nursery: trio.Nursery, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    port, _fakes = await serve_fakes(nursery, ADDRESSES[:1])
    spec = f"dns+http://{NAME}:{port}"
    asked = names_looked_up(monkeypatch)
    async with dnsmasq(tmp_path, [(ADDRESSES[0], NAME)]) as server:
        settings = Settings(decode_urls=(parse_dns_url(spec),),
                            dns_nameserver=f"localhost:{server.port}", dns_interval=0.05,
                            dns_timeout=0.3)
        async with serve_proxy(settings) as (_url, proxy):
            found = discovery_of(proxy)
            assert decode_urls(proxy) == [f"http://{ADDRESSES[0]}:{port}"]
            assert "127.0.0.1" in found.resolver().nameservers
            rounds = found.rounds
            await until(found, lambda: found.rounds >= rounds + 3)
    assert asked.count("localhost") == 1  # once, not per round


async def test_two_names_registered_at_once_share_one_resolver(
    nursery: trio.Nursery, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No name configured, two registered in one round, the DNS server given by name: its
    name is resolved once, before either name's task starts (not by both at once)."""
    port, _fakes = await serve_fakes(nursery, ADDRESSES[:2])
    alias = "vllm-extra.test"
    asked = names_looked_up(monkeypatch)
    specs = [f"dns+http://{NAME}:{port}", f"dns+http://{alias}:{port}"]
    applied: dict[str, int] = {}

    def apply(source: str, role: str, instances: Any) -> tuple[list[str], list[str]]:
        applied[source] = len(instances)
        return [], []

    async with dnsmasq(tmp_path, [(ADDRESSES[0], NAME), (ADDRESSES[1], alias)]) as server:
        found = DnsDiscovery((), apply, nameserver=f"localhost:{server.port}", interval=0.05,
                             timeout=0.3, registered=lambda: [("decode", s) for s in specs])
        await nursery.start(found.run)
        await until(found, lambda: applied == {spec: 1 for spec in specs})
        assert "127.0.0.1" in found.resolver().nameservers
    assert asked.count("localhost") == 1


async def test_a_nameserver_name_that_does_not_resolve_fails_start_up(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    def unknown(*args: Any, **kwargs: Any) -> Any:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", unknown)
    settings = settings_from({"EPD_DECODE_URLS": "dns+http://vllm-decode.test:8000",
                              "EPD_DNS_NAMESERVER": "kube-dns.example:53"})
    message = r"EPD_DNS_NAMESERVER kube-dns.example does not resolve \(.*\); name the DNS server"
    # epd-trio serve, before any worker: a configuration error naming the setting, exit 2.
    refused = (r"EPD_DNS_NAMESERVER: kube-dns.example does not resolve \(.*\); name the DNS "
               r"server by its address")
    with pytest.raises(ConfigError, match=f"^{refused}$"):
        check_discovery(settings)

    def serve(*args: object) -> int:
        raise AssertionError("epd-trio serve started workers")

    monkeypatch.setattr(epd_main, "serve", serve)
    for variable in [v for v in os.environ if v.startswith("EPD_")]:
        monkeypatch.delenv(variable)
    monkeypatch.setenv("EPD_DECODE_URLS", "dns+http://vllm-decode.test:8000")
    monkeypatch.setenv("EPD_DNS_NAMESERVER", "kube-dns.example:53")
    assert epd_main.main(["serve", "--port", "0"]) == 2
    assert re.fullmatch(f"epd-trio: configuration error: {refused}\n", capsys.readouterr().err)
    found = DnsDiscovery(settings.dns_names(), lambda *a: ([], []),
                         nameserver=settings.dns_nameserver, interval=1, timeout=1)
    with pytest.raises(OSError, match=message):
        await found.run()  # in each process that discovers, before it reports started


async def test_a_name_failing_from_the_start_serves_nothing_and_keeps_trying(
    tmp_path: Path,
) -> None:
    bad = "dns+http://vllm-decode.test:1"
    async with dnsmasq(tmp_path, []) as server:
        server.pause()
        try:
            async with serve_proxy(settings_for(bad, server)) as (_url, proxy):
                found = discovery_of(proxy)
                assert decode_urls(proxy) == []
                rounds = found.rounds
                await until(found, lambda: found.rounds > rounds)
        finally:
            server.resume()


async def test_one_worker_of_several_discovers_and_every_worker_routes_over_it(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    port, fakes = await serve_fakes(nursery, ADDRESSES)
    alias = "vllm-extra.test"
    async with dnsmasq(tmp_path, [(ADDRESSES[0], NAME), (ADDRESSES[2], alias)]) as server:
        command = [sys.executable, "-m", "epd_trio", "serve", "--port", "0", "--workers", "2",
                   "--decode", f"dns+http://{NAME}:{port}", "--dns-nameserver", server.nameserver,
                   "--dns-interval", "0.05", "--dns-timeout", "0.3"]
        env = {**os.environ, "EPD_ADMIN_KEY": "k"}
        async with server_process(nursery, command, env) as served:
            url = served.url
            await every_worker_lists(url, 1, "k")
            await server.set_hosts([(a, NAME) for a in ADDRESSES[:2]] + [(ADDRESSES[2], alias)])
            await every_worker_lists(url, 2, "k")
            # A name registered with whichever worker takes the call reaches the one resolving.
            async with httpx.AsyncClient(trust_env=False, timeout=10) as client:
                r = await client.post(url + "/instances", headers={"x-api-key": "k"},
                                      json={"role": "decode", "url": f"dns+http://{alias}:{port}"})
            assert r.json() == {"registered": True}
            await every_worker_lists(url, 3, "k")
            statuses = []
            for _ in range(9):
                async with httpx.AsyncClient(trust_env=False, timeout=10) as client:
                    statuses.append((await client.post(url + CHAT, json=chat_body())).status_code)
            assert set(statuses) == {200}
            assert all(fake.requests() for fake in fakes)
            assert served.log.count(b"DNS discovery of") == 1, served.log.decode(errors="replace")


async def test_a_registered_dns_name_is_resolved_until_unregistered(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    port, fakes = await serve_fakes(nursery, ADDRESSES[:2], dp_size=2)
    spec = f"dns+http://{NAME}:{port}"
    admin = {"x-api-key": "admin-key"}
    async with dnsmasq(tmp_path, [(a, NAME) for a in ADDRESSES[:2]]) as server, \
            serve_proxy(Settings(admin_key="admin-key", dns_nameserver=server.nameserver,
                                 dns_interval=0.05, dns_timeout=0.3)) as (url, proxy), \
            httpx.AsyncClient(base_url=url, timeout=10) as client:
        found = discovery_of(proxy)
        assert decode_urls(proxy) == []
        r = await client.post("/instances", headers=admin,
                              json={"role": "decode", "url": spec, "dp_size": 2})
        assert r.status_code == 200 and r.json() == {"registered": True}
        # Registering it again is idempotent; another role for it is a conflict.
        r = await client.post("/instances", headers=admin, json={"role": "decode", "url": spec,
                                                                 "dp_size": 2})
        assert r.json() == {"registered": False}
        r = await client.post("/instances", headers=admin, json={"role": "prefill",
                                                                 "url": f"{spec}#dp=2"})
        assert r.status_code == 409
        await until(found, lambda: len(decode_urls(proxy)) == 2)
        await answered(proxy)
        assert {i.dp_size for i in proxy.roster.of("decode")} == {2}
        assert (await client.get("/instances", headers=admin)).json()["dns_names"] == [
            {"role": "decode", "url": f"{spec}#dp=2", "source": "registered"}]
        for _ in range(4):
            assert (await client.post(CHAT, json=chat_body())).status_code == 200
        assert all(fake.requests() for fake in fakes)
        r = await client.delete("/instances", headers=admin, params={"url": f"{spec}#dp=2"})
        assert r.status_code == 200
        assert decode_urls(proxy) == []  # at once, not at the next round
        await until(found, lambda: f"{spec}#dp=2" not in found.views)  # its task has ended
        assert decode_urls(proxy) == []
        r = await client.post("/instances", headers=admin,
                              json={"role": "decode", "url": "dns+http://10.0.0.1:80"})
        assert r.status_code == 400 and "names an address" in r.json()["error"]["message"]


async def test_with_a_shared_roster_each_replica_discovers_and_shares_none_of_it(
    nursery: trio.Nursery, tmp_path: Path, redis_server: Any
) -> None:
    port, fakes = await serve_fakes(nursery, ADDRESSES[:2])
    spec = f"dns+http://{NAME}:{port}"
    prefix = "disc:"
    async with dnsmasq(tmp_path, [(ADDRESSES[0], NAME)]) as server, AsyncExitStack() as stack:
        fleet = []
        for index in range(2):
            settings = settings_for(spec, server, admin_key="k", state_url=redis_server.url,
                                    state_prefix=prefix, replica_id=f"r{index}",
                                    state_resync_interval=0.2, state_timeout=10.0)
            fleet.append(await stack.enter_async_context(serve_proxy(settings)))
        for _url, proxy in fleet:
            assert decode_urls(proxy) == [f"http://{ADDRESSES[0]}:{port}"]
        await server.set_hosts([(a, NAME) for a in ADDRESSES[:2]])
        for _url, proxy in fleet:  # each replica's own loop sees the new record
            await until(discovery_of(proxy), lambda p=proxy: len(decode_urls(p)) == 2)
        assert redis_server.command("SCARD", f"{prefix}instances") == "0"  # nothing shared
        async with httpx.AsyncClient(timeout=10) as client:
            r = await client.post(fleet[0][0] + "/instances", headers={"x-api-key": "k"},
                                  json={"role": "decode", "url": f"dns+http://other.test:{port}"})
            assert r.status_code == 400 and "every replica" in r.json()["error"]["message"]
            for url, _proxy in fleet:
                assert (await client.post(url + CHAT, json=chat_body())).status_code == 200
        assert sum(len(f.requests()) for f in fakes) == 2
