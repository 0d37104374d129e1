"""The pull rule: the request path pulls a new roster at known points; nothing pushes it in.

Two workers of ``epd-trio serve --workers N`` are two ``Proxy`` objects on two views of one
shared area, in one test process (``helpers.second_view``).
"""

from __future__ import annotations

from contextlib import AsyncExitStack
from typing import Any

import orjson
import trio
import trio.testing

from epd_trio import Instance, Settings
from epd_trio._core.counters import CursorCounters
from epd_trio._core.discovery import Discovered
from epd_trio._core.roster import Card, Roster
from epd_trio._membership.roster_owner import Membership
from epd_trio._pipeline import Reply
from epd_trio._proxy import Proxy
from epd_trio._state.roster_store import LocalRosterStore, SharedRoutingState

from helpers import second_view

ENCODERS = [f"http://e{i}:1" for i in range(4)]


def registration(role: str, url: str) -> bytes:
    """A registration that declares its model, so it serves it at once (no ``/v1/models``
    to ask: these proxies are not started)."""
    return orjson.dumps({"role": role, "url": url, "models": ["m"]})


def decodes(proxy: Proxy) -> list[str]:
    """The decode instances model ``m``'s pool routes over (none before it has one)."""
    route = proxy.models.by_name.get("m")
    return [] if route is None else urls(route.decodes.instances)


def workers() -> tuple[Proxy, Proxy]:
    shared = SharedRoutingState()
    settings = Settings(admin_key="k")
    return Proxy(settings, shared), Proxy(settings, second_view(shared))


def urls(instances: Any) -> list[str]:
    return [i.url for i in instances]


class Counting:
    """Stands in for the shared words or the lock and counts what is done with them."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.reads, self.acquired = inner, 0, 0

    def __getitem__(self, index: Any) -> Any:
        self.reads += 1
        return self.inner[index]

    def __setitem__(self, index: Any, value: Any) -> None:
        self.inner[index] = value

    def __enter__(self) -> Any:
        self.acquired += 1
        return self.inner.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        return self.inner.__exit__(*exc)


def test_a_pull_with_no_change_returns_none_and_costs_one_word_read() -> None:
    shared = SharedRoutingState()
    membership = Membership(Settings(admin_key="k"), shared)
    other = Membership(Settings(admin_key="k"), second_view(shared))
    assert membership.pull() is not None  # the first pull: the static configuration
    words, lock = Counting(shared._words), Counting(shared._lock)
    shared._words, shared._lock = words, lock
    assert membership.pull() is None
    assert (words.reads, lock.acquired) == (1, 0)
    # Another worker registers: the next pull finds the new version (and copies it, locked).
    assert other.register(registration("decode", "http://d:1"))
    pulled = membership.pull()
    assert pulled is not None and urls(pulled.of("decode")) == ["http://d:1"]
    assert membership.roster is pulled and lock.acquired == 1
    words.reads = 0
    assert membership.pull() is None and (words.reads, lock.acquired) == (1, 1)


def test_a_counter_step_records_the_roster_and_calls_nobody() -> None:
    a, b = workers()
    b_counters = b.membership._pool_counters.counter(0, "decode")  # model m's slot
    assert a.register(registration("decode", "http://d:1"))
    b_counters.fetch_add(1)  # a step of b's shared counter: it sees the new version...
    store = b.membership._store
    assert store.seen.version == a.roster.version == 1
    assert b.roster.version == 0 and not b.registry.has("decode")  # ...as data only
    b.sync()  # the pull: now b follows it, everywhere at once
    assert b.roster.version == 1 and b.registry.has("decode")
    assert decodes(b) == ["http://d:1"]


async def test_another_workers_change_is_seen_at_the_next_requests_top() -> None:
    a, b = workers()
    seen: list[tuple[int, list[str]]] = []

    async def run(*args: Any, **kwargs: Any) -> Reply:  # the pipeline, as the request enters it
        seen.append((b.roster.version, decodes(b)))
        return Reply(200, {}, body=b"{}")

    b.pipeline.run = run  # type: ignore[method-assign]

    async def request() -> None:
        async with AsyncExitStack() as resources:
            await b.handle("chat", b"{}", request_id="r", resources=resources)

    await request()
    assert a.register(registration("decode", "http://d:1"))  # between two requests of b
    assert b.roster.version == 0
    await request()
    assert seen == [(0, []), (1, ["http://d:1"])]


async def test_the_counter_value_maps_over_the_list_of_its_own_version() -> None:
    """A change by another worker captured by b's counter step is followed before the value
    is mapped; one more change made between that step and b's pull (another worker, in those
    microseconds) is not: b follows the version its value belongs to, and sees the next one
    at its next step. Both workers keep one exact rotation."""
    a, b = workers()
    for url in ENCODERS[:2]:
        assert a.register(registration("encode", url))
    b.sync()
    assert [urls(await p.route().encoders.assign(1)) for p in (a, b)] == [[ENCODERS[0]],
                                                                          [ENCODERS[1]]]
    assert a.register(registration("encode", ENCODERS[2]))
    captured = a.roster.version
    pull = b.membership.pull
    between: list[int] = []

    def pull_after_another_change(**kwargs: Any) -> Roster | None:
        if not between:  # once: a fourth encoder joins after b's step, before b's pull
            assert a.register(registration("encode", ENCODERS[3]))
            between.append(a.roster.version)
        return pull(**kwargs)

    b.membership.pull = pull_after_another_change  # type: ignore[method-assign]
    # Counter value 2 belongs to the three-encoder roster, which continued the rotation where
    # it stood (e0 next), and b maps it over that list.
    b_encoders = b.route().encoders
    assert urls(await b_encoders.assign(1)) == [ENCODERS[0]]
    assert b.roster.version == captured == between[0] - 1
    assert urls(b_encoders.encoders) == ENCODERS[:3]
    # The next steps belong to the four-encoder roster, on either worker: one rotation.
    picks = [urls(await p.route().encoders.assign(1))[0] for p in (b, a, b, a)]
    assert b.roster.version == a.roster.version == between[0]
    assert picks == [ENCODERS[1], ENCODERS[2], ENCODERS[3], ENCODERS[0]]


async def test_wait_roster_is_woken_by_a_change_the_membership_makes() -> None:
    proxy = Proxy(Settings(admin_key="k"))
    found = [Discovered(Instance("http://d:1"))]
    proxy.membership.learned({"http://d:1": (Card("m"),)})  # ignored: not a member yet
    done = trio.Event()

    async def wait() -> None:
        await proxy.wait_roster(lambda roster: bool(roster.of("decode")))
        done.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait)
        await trio.testing.wait_all_tasks_blocked()
        assert not done.is_set()
        # A discovery round (not a route of the proxy): the waiter pulls and sees it.
        assert proxy.membership.discovered("dns d", "decode", found) == (["http://d:1"], [])
        await done.wait()
    assert decodes(proxy) == []  # it serves nothing until it says so
    proxy.membership.learned({"http://d:1": (Card("m"),)})
    proxy.sync()
    assert decodes(proxy) == ["http://d:1"]


def test_a_membership_alone_owns_its_roster() -> None:
    """No proxy needed: the roster's owner registers, expires and is pulled from on its own."""
    store = LocalRosterStore(CursorCounters.local())
    membership = Membership(Settings(admin_key="k", instance_ttl=5.0), store)
    first = membership.pull()
    assert first is not None and first.version == 0 and membership.pull() is None
    assert membership.register(registration("decode", "http://d:1"))
    assert membership.roster is first  # changed in the store, not yet pulled
    assert urls(membership.pull().of("decode")) == ["http://d:1"]  # type: ignore[union-attr]
    registered = membership.roster.find("http://d:1")
    assert registered is not None
    later = registered.registered_at + 6.0
    assert membership.expire({"http://d:1": registered.registered_at}, now=later) == ["http://d:1"]
    assert membership.pull() is not None and membership.roster.find("http://d:1") is None
