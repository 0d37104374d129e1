"""Kubernetes discovery against a FAKE API server (tests/fake_kube_api.py), on trio's virtual clock.

The fake serves list and chunked watch as the API does; these tests drive it through pods
becoming Ready and going away, bookmarks, 410 Gone (as a status and as an ERROR event), a
dropped watch connection and an API server that is unreachable for a while. The roster is the
real one (``_core/roster.replace_source`` in a ``LocalRosterStore``); the last test runs the
whole proxy with traffic on the real clock.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import httpx
import pytest
import trio
from fake_kube_api import FakeKubeApi, make_pod

from epd_trio._core.counters import CursorCounters
from epd_trio._core.discovery import Discovered
from epd_trio._core.roster import Roster, replace_source
from epd_trio._discovery_k8s import KubernetesDiscovery
from epd_trio._kube_api import KubeApi
from epd_trio._roster_store import LocalRosterStore
from epd_trio.testing import FakeVLLM, serve_proxy

from helpers import CHAT, chat_body

DECODE = {"app": "vllm", "role": "decode"}
PREFILL = {"app": "vllm", "role": "prefill"}


class Roles:
    """The roster as the proxy would keep it, for discovery alone (no prober, no traffic)."""

    def __init__(self) -> None:
        self.store = LocalRosterStore(CursorCounters.local())
        self.store.attach(Roster(), lambda roster: None)

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


async def test_the_watch_is_renewed_when_the_api_ends_it(
    nursery: trio.Nursery, fake: FakeKubeApi, autojump_clock: Any
) -> None:
    roles = Roles()
    found = await start(nursery, fake, roles)
    await fake.wait_until(lambda: len(fake.watches()) == 3)  # each ends after timeoutSeconds
    assert found.reconnects["decode"] == 0 and found.lists["decode"] == 1
    assert {q["timeoutSeconds"] for q in fake.watches()} == {"60"}


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


async def test_discovered_pods_serve_traffic_and_leave_without_a_failure(
    nursery: trio.Nursery, fake: FakeKubeApi
) -> None:
    decodes = [FakeVLLM(role="decode"), FakeVLLM(role="decode")]
    first = await nursery.start(decodes[0].serve, "127.0.0.2", 0)
    port = int(first.rsplit(":", 1)[1])
    await nursery.start(decodes[1].serve, "127.0.0.3", port)
    fake.put(make_pod("d0", "127.0.0.2", DECODE))
    fake.put(make_pod("d1", "127.0.0.3", DECODE))
    from epd_trio._core.config import Settings
    settings = Settings(service_discovery=True, decode_selector="app=vllm,role=decode",
                        service_discovery_api=fake.url, service_discovery_namespace="ns",
                        service_discovery_port=port)
    async with serve_proxy(settings) as (url, proxy), \
            httpx.AsyncClient(base_url=url, timeout=10) as client:
        (found,) = proxy.discovery
        assert isinstance(found, KubernetesDiscovery)
        assert len(proxy.roster.of("decode")) == 2
        statuses = [(await client.post(CHAT, json=chat_body())).status_code for _ in range(4)]
        assert all(len(d.requests()) == 2 for d in decodes)
        fake.put(make_pod("d0", "127.0.0.2", DECODE, ready=False))
        with trio.fail_after(10):
            await found.wait_until(lambda: len(proxy.roster.of("decode")) == 1)
        statuses += [(await client.post(CHAT, json=chat_body())).status_code for _ in range(4)]
        assert len(decodes[0].requests()) == 2 and len(decodes[1].requests()) == 6
        assert set(statuses) == {200}
        listing = proxy.instances()["instances"]["decode"]
        assert [e["discovered_by"] for e in listing] == ["kubernetes decode app=vllm,role=decode"]
