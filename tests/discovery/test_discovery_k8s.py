"""Kubernetes discovery against a FAKE API server (epd_trio/testing/kube_api.py), on trio's virtual clock.

The fake serves list and chunked watch as the API does; these tests drive it through pods
becoming Ready and going away, bookmarks, 410 Gone (as a status and as an ERROR event), a
dropped watch connection and an API server that is unreachable for a while. The roster is the
real one (``_core/roster.replace_source`` in a ``LocalRosterStore``). The last tests run the
whole proxy with traffic on the real clock: discovered pods follow the proxy's own rules (its
probes, a load-aware policy, ``epd-trio serve --workers 2``, replicas sharing a roster in Redis).
"""

from __future__ import annotations

import itertools
import os
import sys
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack
from typing import Any

import httpx
import pytest
import trio

from epd_trio._core.config import Settings
from epd_trio._core.counters import CursorCounters
from epd_trio._core.discovery import Discovered
from epd_trio._core.roster import Roster, replace_source
from epd_trio._discovery.k8s import REQUEST_TIMEOUT, KubernetesDiscovery
from epd_trio._discovery.kube_api import KubeApi
from epd_trio._proxy import Proxy
from epd_trio._state.roster_store import LocalRosterStore
from epd_trio.testing import Behaviour, FakeVLLM, serve_proxy
from epd_trio.testing.cluster import answered
from epd_trio.testing.kube_api import FakeKubeApi, make_pod

from helpers import (
    CHAT,
    POD_ADDRESSES,
    chat_body,
    every_worker_lists,
    instances_listing,
    serve_on_addresses,
    server_process,
)

DECODE = {"app": "vllm", "role": "decode"}
SELECTOR = "app=vllm,role=decode"
PREFILL = {"app": "vllm", "role": "prefill"}


class Roles:
    """The roster as the proxy would keep it, for discovery alone (no prober, no traffic)."""

    def __init__(self) -> None:
        self.store = LocalRosterStore(CursorCounters.local())
        self.store.attach(Roster())

    def apply(self, source: str, role: str, found: Sequence[Discovered]) -> tuple[list[str], list[str]]:
        return self.store.update(lambda r, c: replace_source(r, source, role, found, c))

    def urls(self, stage: str) -> list[str]:
        return [i.url for i in self.store.current().of(stage)]


async def start(nursery: trio.Nursery, fake: FakeKubeApi, roles: Roles,
                selectors: Sequence[tuple[str, str]] = (("decode", "app=vllm,role=decode"),)
                ) -> KubernetesDiscovery:
    discovery = KubernetesDiscovery(selectors, roles.apply, port=8000,
                                    api=KubeApi(override=fake.url, namespace="ns"),
                                    jitter=lambda: 1.0)
    await nursery.start(discovery.run)
    return discovery


async def until(discovery: KubernetesDiscovery, predicate: Callable[[], bool]) -> None:
    with trio.fail_after(60):
        await discovery.wait_until(predicate)


@pytest.fixture
async def fake(nursery: trio.Nursery) -> FakeKubeApi:
    api = FakeKubeApi(page_size=2)
    await nursery.start(api.serve)
    return api


async def test_list_then_watch_ready_pods_only(
    nursery: trio.Nursery, fake: FakeKubeApi, autojump_clock: Any
) -> None:
    fake.put(make_pod("d0", "127.0.1.1", DECODE))
    fake.put(make_pod("d1", "127.0.1.2", DECODE, ready=False))
    fake.put(make_pod("d2", "127.0.1.3", DECODE, phase="Pending"))
    fake.put(make_pod("p0", "127.0.1.9", PREFILL, annotations={"epd-trio.io/dp-size": "2"}))
    listed_at = fake.resource_version
    roles = Roles()
    found = await start(nursery, fake, roles, [("decode", "app=vllm,role=decode"),
                                               ("prefill", "app=vllm,role=prefill")])
    # Known before run() reported started: the proxy serves with them from its first request.
    assert roles.urls("decode") == ["http://127.0.1.1:8000"]
    assert [(i.url, i.dp_size) for i in roles.store.current().of("prefill")] == [
        ("http://127.0.1.9:8000", 2)]
    # The decode list came in pages of 2 (continue), then the watch started at its version.
    decode_lists = [q for q in fake.lists() if q["labelSelector"] == "app=vllm,role=decode"]
    assert [q.get("continue") for q in decode_lists] == [None, "2"]
    await fake.wait_until(lambda: fake.watching == 2)
    watch = next(q for q in fake.watches() if q["labelSelector"] == "app=vllm,role=decode")
    assert watch["resourceVersion"] == str(listed_at)
    assert watch["allowWatchBookmarks"] == "true"

    fake.put(make_pod("d1", "127.0.1.2", DECODE))  # becomes Ready
    await until(found, lambda: len(roles.urls("decode")) == 2)
    fake.put(make_pod("d0", "127.0.1.1", DECODE, deleting=True))  # terminating: leaves at once
    await until(found, lambda: roles.urls("decode") == ["http://127.0.1.2:8000"])
    fake.delete("d0")
    fake.put(make_pod("d3", "127.0.1.4", {"app": "vllm", "role": "other"}))  # not selected
    fake.delete("d1")
    await until(found, lambda: roles.urls("decode") == [])
    assert found.lists == {"decode": 1, "prefill": 1} and found.reconnects["decode"] == 0


async def test_an_unusable_pod_is_skipped_warned_once_and_the_watch_goes_on(
    nursery: trio.Nursery, fake: FakeKubeApi, autojump_clock: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 31: discovery survives what the API server feeds it. A pod whose annotation
    makes no instance (a port of 0, a dp-size over 1024) is skipped, with one warning naming
    it, not one per event; the good pods serve and later events are still followed."""
    fake.put(make_pod("d0", "127.0.1.1", DECODE))
    fake.put(make_pod("bad", "127.0.1.2", DECODE, annotations={"epd-trio.io/port": "0"}))
    roles = Roles()
    found = await start(nursery, fake, roles)
    assert roles.urls("decode") == ["http://127.0.1.1:8000"]
    fake.put(make_pod("big", "127.0.1.3", DECODE, annotations={"epd-trio.io/dp-size": "5000"}))
    fake.put(make_pod("d1", "127.0.1.4", DECODE))
    await until(found, lambda: len(roles.urls("decode")) == 2)
    warned = [r.getMessage() for r in caplog.records
              if r.levelname == "WARNING" and " skipped: " in r.getMessage()]
    assert len(warned) == 2, warned
    assert any("pod bad skipped: epd-trio.io/port" in w for w in warned)
    assert any("pod big skipped: epd-trio.io/dp-size must be an integer from 1 to 1024" in w
               for w in warned)


async def test_a_pod_relabelled_out_of_the_selector_leaves(
    nursery: trio.Nursery, fake: FakeKubeApi, autojump_clock: Any
) -> None:
    """A Ready pod whose labels stop matching arrives as DELETED (the API server's watch cache
    turns the change into a deletion for that selector) and leaves; relabelled back, ADDED."""
    fake.put(make_pod("d0", "127.0.1.1", DECODE))
    fake.put(make_pod("d1", "127.0.1.2", DECODE))
    roles = Roles()
    found = await start(nursery, fake, roles)
    await fake.wait_until(lambda: fake.watching == 1)
    fake.put(make_pod("d0", "127.0.1.1", {"app": "vllm", "role": "canary"}))  # Running, Ready
    await until(found, lambda: roles.urls("decode") == ["http://127.0.1.2:8000"])
    assert fake.sent[-1] == (SELECTOR, "DELETED", "d0")
    fake.put(make_pod("d0", "127.0.1.1", {"app": "vllm", "role": "canary", "x": "y"}))
    fake.put(make_pod("d0", "127.0.1.1", DECODE))  # unseen, then back in
    await until(found, lambda: len(roles.urls("decode")) == 2)
    assert fake.sent[-2:] == [(SELECTOR, "DELETED", "d0"), (SELECTOR, "ADDED", "d0")]
    assert found.lists["decode"] == 1 and found.reconnects["decode"] == 0  # the watch said it


async def test_an_expired_continue_token_lists_from_the_start(
    nursery: trio.Nursery, fake: FakeKubeApi, autojump_clock: Any
) -> None:
    for n in range(5):
        fake.put(make_pod(f"d{n}", f"127.0.1.{n + 1}", DECODE))
    fake.expire_continues = 1
    roles = Roles()
    await start(nursery, fake, roles)
    assert [q.get("continue") for q in fake.lists()] == [None, "2", None, "2", "4"]
    assert len(roles.urls("decode")) == 5


async def test_bookmarks_move_the_version_a_dropped_watch_resumes_from(
    nursery: trio.Nursery, fake: FakeKubeApi, autojump_clock: Any
) -> None:
    fake.put(make_pod("d0", "127.0.1.1", DECODE))
    roles = Roles()
    found = await start(nursery, fake, roles)
    await fake.wait_until(lambda: fake.watching == 1)
    marked = fake.bookmark()
    await until(found, lambda: found.views["decode"].resource_version == str(marked))  # type: ignore[union-attr]
    fake.drop_watches()  # the connection is cut mid-stream
    await fake.wait_until(lambda: len(fake.watches()) == 2 and fake.watching == 1)
    assert fake.watches()[1]["resourceVersion"] == str(marked)
    assert found.reconnects["decode"] == 1 and found.lists["decode"] == 1  # no relist
    assert roles.urls("decode") == ["http://127.0.1.1:8000"]  # kept throughout
    fake.put(make_pod("d1", "127.0.1.2", DECODE))
    await until(found, lambda: len(roles.urls("decode")) == 2)


async def test_a_malformed_watch_line_reconnects_and_keeps_the_view(
    nursery: trio.Nursery, fake: FakeKubeApi, autojump_clock: Any
) -> None:
    fake.put(make_pod("d0", "127.0.1.1", DECODE))
    roles = Roles()
    found = await start(nursery, fake, roles)
    await fake.wait_until(lambda: fake.watching == 1)
    version = fake.put(make_pod("d1", "127.0.1.2", DECODE))
    await until(found, lambda: len(roles.urls("decode")) == 2)
    fake.send_raw(b'{"type": "ADDED"}\n')  # no object: not a watch event
    await fake.wait_until(lambda: len(fake.watches()) == 2 and fake.watching == 1)
    assert found.reconnects["decode"] == 1 and found.lists["decode"] == 1
    assert fake.watches()[1]["resourceVersion"] == str(version)
    assert len(roles.urls("decode")) == 2


@pytest.mark.parametrize("gone_as", ["status", "event"])
async def test_410_gone_lists_again(
    nursery: trio.Nursery, fake: FakeKubeApi, autojump_clock: Any, gone_as: str
) -> None:
    fake.gone_as = gone_as
    fake.put(make_pod("d0", "127.0.1.1", DECODE))
    roles = Roles()
    found = await start(nursery, fake, roles)
    await fake.wait_until(lambda: fake.watching == 1)
    fake.stop()  # unreachable while the cluster changes and etcd compacts
    await until(found, lambda: found.reconnects["decode"] >= 3)
    assert roles.urls("decode") == ["http://127.0.1.1:8000"]  # the last view keeps serving
    fake.put(make_pod("d1", "127.0.1.2", DECODE))
    fake.compact()
    await nursery.start(fake.serve, fake.port)
    await until(found, lambda: found.lists["decode"] == 2)
    assert roles.urls("decode") == ["http://127.0.1.1:8000", "http://127.0.1.2:8000"]
    # A 410 on an open watch (an ERROR event) lists again too.
    await fake.wait_until(lambda: fake.watching == 1)
    fake.put(make_pod("d2", "127.0.1.3", DECODE))
    fake.compact()
    fake.expire_watches()
    await until(found, lambda: found.lists["decode"] == 3)
    assert len(roles.urls("decode")) == 3


async def test_lists_refused_with_410_again_and_again_back_off(
    nursery: trio.Nursery, fake: FakeKubeApi, autojump_clock: Any
) -> None:
    """The first 410 lists again at once (a continue token or version that just expired);
    the next ones wait, doubling to 30 s: not a loop hammering the API server."""
    fake.put(make_pod("d0", "127.0.1.1", DECODE))
    fake.gone_lists = 10
    roles = Roles()
    found = await start(nursery, fake, roles)  # reports started once it backs off
    with trio.fail_after(200):
        await found.wait_until(lambda: roles.urls("decode") == ["http://127.0.1.1:8000"])
    times = fake.times_of("list")
    gaps = [round(b - a, 3) for a, b in itertools.pairwise(times)]
    assert gaps == [0, 0.5, 1, 2, 4, 8, 16, 30, 30, 30]  # the 11th list is answered
    assert found.lists["decode"] == 1


async def test_the_watch_is_renewed_when_the_api_ends_it(
    nursery: trio.Nursery, fake: FakeKubeApi, autojump_clock: Any
) -> None:
    roles = Roles()
    found = await start(nursery, fake, roles)
    await fake.wait_until(lambda: len(fake.watches()) == 3)  # each ends after timeoutSeconds
    assert found.reconnects["decode"] == 0 and found.lists["decode"] == 1
    assert {q["timeoutSeconds"] for q in fake.watches()} == {"60"}


async def test_a_stalled_list_times_out_after_the_request_timeout(
    nursery: trio.Nursery, fake: FakeKubeApi, autojump_clock: Any
) -> None:
    """A list gets REQUEST_TIMEOUT (10 s), not the watch's read timeout (90 s)."""
    fake.stall_lists = True
    roles = Roles()
    started = trio.current_time()
    found = await start(nursery, fake, roles)  # reports started once the first list failed
    assert trio.current_time() - started == pytest.approx(REQUEST_TIMEOUT, abs=0.1)
    assert found.reconnects["decode"] == 1 and roles.urls("decode") == []
    fake.stall_lists = False
    fake.put(make_pod("d0", "127.0.1.1", DECODE))
    await until(found, lambda: roles.urls("decode") == ["http://127.0.1.1:8000"])


async def test_watches_ending_at_once_without_an_event_back_off(
    nursery: trio.Nursery, fake: FakeKubeApi, autojump_clock: Any
) -> None:
    """A watch that ends cleanly within a second having delivered nothing is an error (as
    client-go's reflector has it): reconnect after the backoff, not in a busy loop."""
    fake.put(make_pod("d0", "127.0.1.1", DECODE))
    fake.end_watches = 9
    roles = Roles()
    found = await start(nursery, fake, roles)
    await until(found, lambda: found.reconnects["decode"] >= 6)  # the 6th has ended too
    times = fake.times_of("watch")
    assert [round(b - a, 3) for a, b in itertools.pairwise(times[:6])] == [0.5, 1, 2, 4, 8]
    assert found.lists["decode"] == 1 and roles.urls("decode") == ["http://127.0.1.1:8000"]
    # A watch that delivers an event is progress, however short: the next one comes at once,
    # and the backoff starts over.
    fake.put(make_pod("d1", "127.0.1.2", DECODE))  # the 7th watch (after 16 s) delivers it
    await until(found, lambda: len(roles.urls("decode")) == 2)
    await fake.wait_until(lambda: len(fake.watches()) >= 9)
    times = fake.times_of("watch")
    assert [round(b - a, 3) for a, b in itertools.pairwise(times[5:9])] == [16, 0, 0.5]
    await fake.wait_until(lambda: fake.watching == 1)  # the 10th lasts: no more reconnects
    reconnects = found.reconnects["decode"]
    await trio.sleep(30)
    assert found.reconnects["decode"] == reconnects and fake.watching == 1


async def test_an_error_status_backs_off_and_keeps_the_view(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    fake = FakeKubeApi(namespace="elsewhere")  # every call is a 404 for namespace "ns"
    await nursery.start(fake.serve)
    roles = Roles()
    found = await start(nursery, fake, roles)
    started = trio.current_time()
    await until(found, lambda: found.reconnects["decode"] >= 5)
    # Backoff 0.5, 1, 2, 4 s between the five tries.
    assert trio.current_time() - started == pytest.approx(7.5, abs=0.1)
    assert roles.urls("decode") == []


def proxy_settings(fake: FakeKubeApi, port: int, **extra: Any) -> Settings:
    return Settings(service_discovery=True, decode_selector=SELECTOR,
                    service_discovery_api=fake.url, service_discovery_namespace="ns",
                    service_discovery_port=port, **extra)


def discovery_of(proxy: Proxy) -> KubernetesDiscovery:
    (found,) = [s for s in proxy.membership.discovery if isinstance(s, KubernetesDiscovery)]
    return found


def decode_urls(proxy: Proxy) -> list[str]:
    proxy.sync()
    return [inst.url for inst in proxy.roster.of("decode")]


async def pods(nursery: trio.Nursery, fake: FakeKubeApi, count: int = 2,
               **behaviour: Any) -> tuple[int, list[FakeVLLM]]:
    """``count`` decode fakes on the pod addresses, one pod each in the fake API."""
    decodes = [FakeVLLM(role="decode", behaviour=Behaviour(**behaviour)) for _ in range(count)]
    port = await serve_on_addresses(nursery, decodes)
    for n, address in enumerate(POD_ADDRESSES[:count]):
        fake.put(make_pod(f"d{n}", address, DECODE))
    return port, decodes


async def test_discovered_pods_serve_traffic_and_leave_without_a_failure(
    nursery: trio.Nursery, fake: FakeKubeApi
) -> None:
    port, decodes = await pods(nursery, fake)
    async with serve_proxy(proxy_settings(fake, port)) as (url, proxy), \
            httpx.AsyncClient(base_url=url, timeout=10) as client:
        found = discovery_of(proxy)
        assert len(proxy.roster.of("decode")) == 2
        statuses = [(await client.post(CHAT, json=chat_body())).status_code for _ in range(4)]
        assert all(len(d.requests()) == 2 for d in decodes)
        fake.put(make_pod("d0", POD_ADDRESSES[0], DECODE, ready=False))
        with trio.fail_after(10):
            await found.wait_until(lambda: len(decode_urls(proxy)) == 1)
        statuses += [(await client.post(CHAT, json=chat_body())).status_code for _ in range(4)]
        assert len(decodes[0].requests()) == 2 and len(decodes[1].requests()) == 6
        assert set(statuses) == {200}
        listing = proxy.instances()["instances"]["decode"]
        assert [e["discovered_by"] for e in listing] == [f"kubernetes decode {SELECTOR}"]


async def test_a_discovered_pod_failing_its_probes_leaves_the_rotation_and_comes_back(
    nursery: trio.Nursery, fake: FakeKubeApi
) -> None:
    """The pod stays Ready (the API says nothing): the proxy's own probes take it out."""
    port, (sick, well) = await pods(nursery, fake)
    settings = proxy_settings(fake, port, health_interval=0.05, health_threshold=1)
    async with serve_proxy(settings) as (url, proxy), \
            httpx.AsyncClient(base_url=url, timeout=10) as client:
        state = proxy.registry.state("decode", sick.url)
        changed = trio.Event()
        proxy.registry.on_change.append(lambda s: changed.set())
        sick.behaviour.healthy = False
        with trio.fail_after(10):
            while state.live:
                await changed.wait()
                changed = trio.Event()
        before = len(sick.requests())
        for _ in range(4):
            assert (await client.post(CHAT, json=chat_body())).status_code == 200
        assert len(sick.requests()) == before and len(well.requests()) >= 4
        assert len(decode_urls(proxy)) == 2  # still discovered, only out of the rotation
        sick.behaviour.healthy = True
        with trio.fail_after(10):
            while not state.live:
                await changed.wait()
                changed = trio.Event()
        for _ in range(4):
            assert (await client.post(CHAT, json=chat_body())).status_code == 200
        assert len(sick.requests()) == before + 2


@pytest.mark.parametrize("policy", ["least_loaded", "power_of_two"])
async def test_a_load_aware_policy_routes_over_discovered_pods(
    nursery: trio.Nursery, fake: FakeKubeApi, policy: str
) -> None:
    """One request held at whichever pod gets it first: the next ones go to the other."""
    release, holding = trio.Event(), trio.Event()

    async def hold_the_first() -> None:
        if not holding.is_set():
            holding.set()  # the fake counts the request in flight before its gate
            await release.wait()

    port, decodes = await pods(nursery, fake, gate=hold_the_first)
    async with serve_proxy(proxy_settings(fake, port, decode_policy=policy)) as (url, _proxy), \
            httpx.AsyncClient(base_url=url, timeout=10) as client:

        async def post() -> None:
            assert (await client.post(CHAT, json=chat_body())).status_code == 200

        async with trio.open_nursery() as senders:
            senders.start_soon(post)
            with trio.fail_after(10):
                await holding.wait()
            busy, idle = decodes if decodes[0].in_flight else decodes[::-1]
            for _ in range(4):
                await post()
            assert len(idle.requests()) == 4 and len(busy.requests()) == 1
            release.set()


async def test_one_worker_of_several_discovers_and_every_worker_routes_over_the_pods(
    nursery: trio.Nursery, fake: FakeKubeApi
) -> None:
    port, decodes = await pods(nursery, fake, count=3)
    fake.delete("d2")  # joins later
    command = [sys.executable, "-m", "epd_trio", "serve", "--port", "0", "--workers", "2",
               "--service-discovery", "--decode-selector", "app=vllm", "role=decode",
               "--service-discovery-api", fake.url, "--service-discovery-namespace", "ns",
               "--service-discovery-port", str(port)]
    async with server_process(nursery, command, {**os.environ, "EPD_ADMIN_KEY": "k"}) as served:
        url = served.url
        await every_worker_lists(url, 2, "k")
        fake.put(make_pod("d2", POD_ADDRESSES[2], DECODE))
        await every_worker_lists(url, 3, "k")
        workers, statuses = set(), []
        with trio.fail_after(30):
            while len(workers) < 2 or len(statuses) < 9:
                async with httpx.AsyncClient(trust_env=False, timeout=10) as client:
                    response = await client.post(url + CHAT, json=chat_body())
                statuses.append(response.status_code)
                workers.add((await instances_listing(url, "k"))["worker_pid"])
        assert set(statuses) == {200}
        assert all(d.requests() for d in decodes)
        # One watch per selector for the whole process tree: one worker discovers.
        log = served.log
        assert log.count(b"Kubernetes discovery in namespace") == 1, log.decode(errors="replace")
        assert {q["labelSelector"] for q in fake.watches()} == {SELECTOR}


async def test_with_a_shared_roster_each_replica_watches_and_shares_none_of_it(
    nursery: trio.Nursery, fake: FakeKubeApi, redis_server: Any
) -> None:
    port, decodes = await pods(nursery, fake, count=3)
    fake.delete("d1")
    fake.delete("d2")
    prefix = "kdisc:"
    async with AsyncExitStack() as stack:
        fleet = []
        for index in range(2):
            settings = proxy_settings(fake, port, admin_key="k", state_url=redis_server.url,
                                      state_prefix=prefix, replica_id=f"r{index}",
                                      state_resync_interval=0.2, state_timeout=10.0)
            fleet.append(await stack.enter_async_context(serve_proxy(settings)))
        for _url, proxy in fleet:
            assert decode_urls(proxy) == [f"http://{POD_ADDRESSES[0]}:{port}"]
        # Each replica holds its own watch (two lists, two watches for one selector).
        await fake.wait_until(lambda: fake.watching == 2)
        assert len(fake.lists()) == 2
        fake.put(make_pod("d1", POD_ADDRESSES[1], DECODE))
        for _url, proxy in fleet:
            with trio.fail_after(10):
                await discovery_of(proxy).wait_until(
                    lambda p=proxy: len(decode_urls(p)) == 2)
                await answered(proxy)
        assert redis_server.command("SCARD", f"{prefix}instances") == "0"  # nothing shared
        async with httpx.AsyncClient(timeout=10) as client:
            for url, _proxy in fleet:
                for _ in range(2):
                    assert (await client.post(url + CHAT, json=chat_body())).status_code == 200
        assert [len(d.requests()) for d in decodes[:2]] == [2, 2]
        fake.delete("d0")  # each replica's own watch takes it out: the store never had it
        for _url, proxy in fleet:
            with trio.fail_after(10):
                await discovery_of(proxy).wait_until(
                    lambda p=proxy: decode_urls(p) == [f"http://{POD_ADDRESSES[1]}:{port}"])
        assert redis_server.command("SCARD", f"{prefix}instances") == "0"
