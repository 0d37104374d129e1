"""The roster in shared memory, seen by two workers (two views of one area, in one process)."""

from __future__ import annotations

import orjson
import pytest

from epd_trio import Instance, Settings
from epd_trio._proxy import Proxy
from epd_trio._state.roster_store import RosterFull, SharedRoutingState

from helpers import second_view


def registration(role: str, url: str) -> bytes:
    """A registration declaring its model (these proxies are not started: nobody asks it)."""
    return orjson.dumps({"role": role, "url": url, "models": ["m"]})


async def test_a_registration_reaches_the_other_worker_exactly() -> None:
    settings = Settings(admin_key="k")
    shared = SharedRoutingState()
    a, b = Proxy(settings, shared), Proxy(settings, second_view(shared))
    urls = [f"http://e{i}:1" for i in range(3)]
    assert a.register(registration("prefill_decode", "http://pd:1"))
    assert a.register(registration("encode", urls[0]))
    assert not a.register(registration("encode", urls[0]))  # idempotent, through the same area
    assert b.roster.version == 0 and not b.registry.has("decode")  # b has not looked yet
    b.sync()  # what every request does first: one word read
    assert b.roster.version == a.roster.version == 2 and b.registry.has("decode")
    assert a.register(registration("encode", urls[1]))
    # b has not pulled since: taking the counter is where it notices, so the counter value
    # and the instance list it routes over belong together, and both workers share one rotation.
    picks = []
    for proxy in (b, a, b, b, a):
        encoders = proxy.route("m").encoders
        picks.append((await encoders.assign(1, proxy.registry.usable("encode")))[0].url)
    assert picks == [urls[0], urls[1], urls[0], urls[1], urls[0]]
    assert b.roster.version == 3 and b.roster.of("encode") == a.roster.of("encode")
    # b registers the third: a continues the rotation from where it stood (e1 next, no reset).
    assert b.register(registration("encode", urls[2]))
    picks = [(await p.route("m").encoders.assign(1))[0].url for p in (a, b, a, a)]
    assert picks == [urls[1], urls[2], urls[0], urls[1]]
    assert a.unregister(urls[1] + "/") and not b.unregister(urls[1])
    b.sync()
    assert [i.url for i in b.roster.of("encode")] == [urls[0], urls[2]]


def test_a_roster_that_does_not_fit_is_refused() -> None:
    shared = SharedRoutingState(capacity=400)
    proxy = Proxy(Settings(admin_key="k"), shared)
    assert proxy.register(registration("decode", "http://d0:1"))
    with pytest.raises(RosterFull) as info:
        for n in range(10):
            proxy.register(registration("decode", f"http://d{n + 1}:1"))
    assert info.value.status == 503
    assert proxy.roster.of("decode")[0] == Instance("http://d0:1")
