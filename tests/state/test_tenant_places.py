"""A tenant's ``max_inflight`` across the workers of ``epd-trio serve --workers N``: two views
of one shared table (what two spawned workers get) hold the cap once between them, a waiter
whose place another worker frees starts within ``WORKERS_RECHECK``, and the real
``--workers 2`` never has more of the tenant's requests upstream than its cap."""

from __future__ import annotations

import os
import sys
from contextlib import AsyncExitStack

import httpx
import orjson
import pytest
import trio
import trio.testing

from epd_trio._admission.fair import WORKERS_RECHECK, FairAdmission
from epd_trio._core.errors import RateLimited
from epd_trio._core.tenants import TenantTable, parse_tenants
from epd_trio._state.roster_store import SharedRoutingState
from epd_trio._state.tenant_places import SharedTenantPlaces
from epd_trio.testing import FakeVLLM

from helpers import CHAT, chat_body, scrape, second_view, server_process, start_fakes

TABLES = {"team": {"keys": ["sk-team"], "max_inflight": 2}}
TEAM_HEAD = [(b"authorization", b"Bearer sk-team")]


def worker_gate(places: SharedTenantPlaces, timeout: float = 10.0) -> FairAdmission:
    return FairAdmission(max_inflight=100, timeout=timeout,
                         table=TenantTable(parse_tenants(TABLES)), aging=0.5, places=places)


def test_a_take_below_the_cap_is_atomic_and_seen_by_every_view() -> None:
    state = SharedRoutingState()
    one, other = state.places, second_view(state).places
    assert one.take("team", 2) and other.take("team", 2)
    assert not one.take("team", 2) and not other.take("team", 2)
    assert one.count("team") == other.count("team") == 2
    other.give("team")
    assert one.count("team") == 1 and one.take("team", 2)


def test_a_full_table_counts_the_newcomer_in_its_worker_only() -> None:
    places = SharedTenantPlaces(slots=1)
    assert places.take("first", 1) and places.take("second", 1)
    assert not places.take("second", 1) and places.count("second") == 1
    places.give("second")
    assert places.count("second") == 0


async def test_two_workers_hold_a_tenants_cap_once_between_them() -> None:
    state = SharedRoutingState()
    first, second = worker_gate(state.places), worker_gate(second_view(state).places, 0.05)
    async with AsyncExitStack() as holder:
        for _ in range(2):
            await first.enter(first.tenant_of(TEAM_HEAD), holder)
        with pytest.raises(RateLimited) as refused:
            await second.enter(second.tenant_of(TEAM_HEAD), AsyncExitStack())
    assert refused.value.payload()["error"]["param"] == "max_inflight"
    assert state.places.count("team") == 0


async def test_a_waiter_starts_when_another_worker_frees_its_place(
    autojump_clock: trio.testing.MockClock,
) -> None:
    state = SharedRoutingState()
    first, second = worker_gate(state.places), worker_gate(second_view(state).places)
    started: list[float] = []
    admitted = trio.Event()

    async def wait_in_second() -> None:
        async with AsyncExitStack() as resources:
            await second.enter(second.tenant_of(TEAM_HEAD), resources)
            started.append(trio.current_time())
            admitted.set()

    async with trio.open_nursery() as nursery:
        following = await nursery.start(second.follow_workers)
        holder = AsyncExitStack()
        for _ in range(2):
            await first.enter(first.tenant_of(TEAM_HEAD), holder)
        nursery.start_soon(wait_in_second)
        await trio.testing.wait_all_tasks_blocked()
        assert sum(second.depth().values()) == 1
        freed = trio.current_time()
        await holder.aclose()  # the first worker's release: nothing in the second hears it
        await admitted.wait()
        following.cancel()
    assert 0 < started[0] - freed <= WORKERS_RECHECK * 1.5


class RacedPlaces:
    """A table whose read is stale: another worker takes the last place between the read
    and the take (the race ``dispatch`` must survive)."""

    def count(self, tenant: str) -> int:
        return 0

    def take(self, tenant: str, cap: int) -> bool:
        return False

    def give(self, tenant: str) -> None:
        raise AssertionError("nothing was taken")


async def test_a_waiter_that_loses_the_race_for_a_place_keeps_its_turn() -> None:
    admission = worker_gate(RacedPlaces())  # type: ignore[arg-type]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(admission.enter, admission.tenant_of(TEAM_HEAD), AsyncExitStack())
        await trio.testing.wait_all_tasks_blocked()
        admission.dispatch()  # the read says free, the take says no: back in the line
        assert admission.depth() == {("team", 0): 1} and admission.inflight == 0
        nursery.cancel_scope.cancel()


async def test_epd_trio_serve_with_two_workers_holds_a_tenants_cap_once(
    nursery: trio.Nursery,
) -> None:
    """A tenant capped at 2 has two requests upstream through the first worker, then one more
    there and three through the second (each on a connection whose worker is known): the
    engine never holds more than 2 of them (4 when each worker counts alone), and every one
    is served: the second worker's waiters start when the first frees a place, which wakes
    nobody in the second (its look every ``WORKERS_RECHECK`` does)."""
    gate = trio.Semaphore(0)
    decode = FakeVLLM(role="prefill_decode")
    peak = [0]

    async def held() -> None:
        peak[0] = max(peak[0], decode.in_flight)
        await gate.acquire()

    decode.behaviour.gate = held
    await start_fakes(nursery, decode)
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPD_")}
    env.update({"EPD_DECODE_URLS": decode.url, "EPD_TENANTS": orjson.dumps(TABLES).decode(),
                "EPD_ADMISSION_TIMEOUT": "10", "EPD_ADMIN_KEY": "admin"})
    command = [sys.executable, "-m", "epd_trio", "serve", "--port", "0", "--workers", "2"]
    statuses: list[int] = []
    async with server_process(nursery, command, env, limit=60) as served, \
            AsyncExitStack() as connections:
        per_worker: dict[int, list[httpx.AsyncClient]] = {}
        with trio.fail_after(30):  # fresh connections until each worker holds three
            while len(per_worker) < 2 or min(map(len, per_worker.values())) < 3:
                client = await connections.enter_async_context(
                    httpx.AsyncClient(trust_env=False, timeout=60))
                r = await client.get(served.url + "/instances", headers={"x-api-key": "admin"})
                per_worker.setdefault(r.json()["worker_pid"], []).append(client)

        async def ask(client: httpx.AsyncClient) -> None:
            r = await client.post(served.url + CHAT, json=chat_body(),
                                  headers={"authorization": "Bearer sk-team"})
            statuses.append(r.status_code)

        first, second = per_worker.values()
        async with trio.open_nursery() as clients:
            for client in first[:2]:  # the cap's two places, both in the first worker
                clients.start_soon(ask, client)
            with trio.fail_after(30):
                await decode.wait_until(lambda: decode.in_flight == 2)
            for client in [first[2], *second[:3]]:
                clients.start_soon(ask, client)
            with trio.fail_after(30):  # every request arrived: upstream or in a queue
                async with httpx.AsyncClient(trust_env=False, timeout=10) as probe:
                    while True:  # each scrape a round trip: the loop does not spin
                        samples = await scrape(probe, served.url, {"x-api-key": "admin"})
                        queued = samples.sum("epd_trio_tenant_queue_depth", tenant="team")
                        if decode.in_flight + queued == 6:
                            break
            for _ in range(6):
                gate.release()
    assert statuses == [200] * 6 and peak[0] == 2, (statuses, peak)
