"""The prober's schedule, on virtual time: each instance on its own clock (no sockets)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import pytest
import trio
import trio.testing

from epd_trio import Instance
from epd_trio._core.errors import UpstreamTimeout
from epd_trio._core.health import InstanceState, Registry
from epd_trio._upstream.prober import run_prober

A, B, C = (Instance(f"http://{n}:1") for n in "abc")


class Checks:
    """Records when each instance was probed; ``hang`` ones answer nothing for 10 s, then fail."""

    def __init__(self, *hang: Instance) -> None:
        self.hang = {i.url for i in hang}
        self.times: dict[str, list[float]] = {}

    async def __call__(self, state: InstanceState) -> None:
        self.times.setdefault(state.url, []).append(trio.current_time())
        if state.url in self.hang:
            await trio.sleep(10)
            raise UpstreamTimeout("no answer within 10 s", stage=state.stage, instance=state.url)


async def probe_for(seconds: float, checks: Checks, registry: Registry,
                    then: Callable[[], None] | None = None, more: float = 0.0) -> None:
    """Run the prober (interval 1 s) for ``seconds`` of virtual time; then call ``then`` and run
    ``more`` seconds."""
    async with trio.open_nursery() as nursery:
        await nursery.start(partial(run_prober, checks, registry, interval=1.0))
        await trio.sleep(seconds)
        if then is not None:
            then()
            await trio.sleep(more)
        nursery.cancel_scope.cancel()


async def test_a_hung_instance_does_not_pace_the_others(
    autojump_clock: trio.testing.MockClock,
) -> None:
    registry = Registry.from_stages({"decode": [A, B], "prefill": [C]}, threshold=1)
    checks = Checks(B)
    await probe_for(5.5, checks, registry)
    assert checks.times[A.url] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert checks.times[C.url] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert checks.times[B.url] == [0.0]  # still waiting for its first answer
    assert registry.state("decode", B.url).live  # no verdict on it yet


async def test_a_failed_probe_is_followed_by_the_next_one_interval_later(
    autojump_clock: trio.testing.MockClock,
) -> None:
    registry = Registry.from_stages({"decode": [A, B]}, threshold=1)
    checks = Checks(B)
    await probe_for(12.5, checks, registry)
    assert checks.times[B.url] == [0.0, 11.0]  # timed out at 10, next probe 1 s after
    assert not registry.state("decode", B.url).live
    assert len(checks.times[A.url]) == 13


async def test_instances_that_join_or_leave_are_followed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    registry = Registry.from_stages({"decode": [A]})
    checks = Checks()
    # A leaves and B joins after 1.5 s.
    await probe_for(1.5, checks, registry, lambda: registry.set_members({"decode": [B]}), 2.0)
    assert checks.times[A.url] == [0.0, 1.0]
    assert checks.times[B.url] == [2.0, 3.0]  # picked up at the next look (within interval)


class Broken(Checks):
    """``B``'s probe raises what no transport error is (as the HTTP client did for a port of
    ``abc``: ``ValueError``)."""

    async def __call__(self, state: InstanceState) -> None:
        await super().__call__(state)
        if state.url == B.url:
            raise ValueError("Port could not be cast to integer value as 'abc'")


async def test_an_unexpected_probe_error_fails_its_instance_not_the_prober(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 31: one instance's bad port killed the prober of every worker."""
    registry = Registry.from_stages({"decode": [A, B]}, threshold=1)
    checks = Broken()
    await probe_for(3.5, checks, registry)
    assert checks.times[A.url] == [0.0, 1.0, 2.0, 3.0]
    assert checks.times[B.url] == [0.0, 1.0, 2.0, 3.0]  # probed on, failing each time
    assert registry.state("decode", A.url).live and not registry.state("decode", B.url).live
    assert f"health probe of decode {B.url} failed unexpectedly" in caplog.text
    assert "Port could not be cast" in caplog.text  # the traceback, logged
