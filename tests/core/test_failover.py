"""``with_failover`` directly: which failures are retried, where, and how often (no sockets)."""

from __future__ import annotations

import pytest

from epd_trio import Instance
from epd_trio._core.errors import (
    UpstreamError,
    UpstreamStatusError,
    UpstreamTimeout,
    UpstreamTransportError,
)
from epd_trio._core.failover import Failover, Slot, is_retryable, with_failover

A, B, C = (Instance(f"http://{n}:1") for n in "abc")
SLOTS: list[Slot] = [(A, None), (B, None), (C, None)]


def transport(stage: str, slot: Slot) -> UpstreamError:
    return UpstreamTransportError("refused", stage=stage, instance=slot[0].url)


def status(code: int, stage: str = "prefill") -> UpstreamError:
    return UpstreamStatusError(stage=stage, instance=A.url, upstream_status=code,
                               upstream_body=b"{}")


class Script:
    """An attempt that fails with the given errors in order, then answers ``ok``; and a
    ``pick_next`` that offers the untried slots of ``SLOTS`` in order."""

    def __init__(self, *errors: UpstreamError | None) -> None:
        self.errors = list(errors)
        self.tried: list[Slot] = []
        self.offered: list[set[Slot]] = []
        self.retried: list[tuple[str, str, str]] = []

    async def attempt(self, slot: Slot) -> str:
        self.tried.append(slot)
        error = self.errors.pop(0) if self.errors else None
        if error is not None:
            raise error
        return f"ok at {slot[0].url}"

    async def pick_next(self, tried: set[Slot]) -> Slot | None:
        self.offered.append(set(tried))
        return next((s for s in SLOTS if s not in tried), None)

    def on_retry(self, stage: str, instance: Instance, error: UpstreamError) -> None:
        self.retried.append((stage, instance.url, type(error).__name__))


@pytest.mark.parametrize(("error", "retryable"), [
    (transport("decode", SLOTS[0]), True),
    (UpstreamTimeout("slow", stage="decode", instance=A.url), True),
    (status(500), True),
    (status(503), True),
    (status(400), False),
    (status(404), False),
    (status(401), False),  # shown as a 502 to the client, but the request itself was refused
])
def test_is_retryable(error: UpstreamError, retryable: bool) -> None:
    assert is_retryable(error) is retryable


async def test_a_retryable_failure_moves_to_the_next_untried_slot() -> None:
    script = Script(transport("prefill", SLOTS[0]), transport("prefill", SLOTS[1]))
    result = await with_failover(Failover(max_attempts=3), "prefill", SLOTS[0], script.attempt,
                                 script.pick_next, script.on_retry)
    assert result == "ok at http://c:1"
    assert script.tried == SLOTS
    assert script.offered == [{SLOTS[0]}, {SLOTS[0], SLOTS[1]}]
    assert script.retried == [("prefill", "http://a:1", "UpstreamTransportError"),
                              ("prefill", "http://b:1", "UpstreamTransportError")]


async def test_max_attempts_bounds_the_attempts_and_the_last_failure_is_raised() -> None:
    last = transport("prefill", SLOTS[1])
    script = Script(transport("prefill", SLOTS[0]), last)
    with pytest.raises(UpstreamTransportError) as info:
        await with_failover(Failover(max_attempts=2), "prefill", SLOTS[0], script.attempt,
                            script.pick_next, script.on_retry)
    assert info.value is last
    assert script.tried == SLOTS[:2] and len(script.retried) == 1


async def test_one_attempt_by_default() -> None:
    script = Script(transport("encode", SLOTS[0]))
    with pytest.raises(UpstreamTransportError):
        await with_failover(Failover(), "encode", SLOTS[0], script.attempt, script.pick_next)
    assert script.tried == SLOTS[:1] and script.offered == []


async def test_a_4xx_is_never_retried() -> None:
    script = Script(status(400))
    with pytest.raises(UpstreamStatusError):
        await with_failover(Failover(max_attempts=3), "prefill", SLOTS[0], script.attempt,
                            script.pick_next, script.on_retry)
    assert script.tried == SLOTS[:1] and script.retried == []


async def test_an_inner_stage_failure_is_not_retried_by_the_outer_stage() -> None:
    """A decode attempt whose prefill failed: prefill had its own failover already."""
    script = Script(transport("prefill", SLOTS[0]))
    with pytest.raises(UpstreamTransportError):
        await with_failover(Failover(max_attempts=3), "decode", SLOTS[0], script.attempt,
                            script.pick_next, script.on_retry)
    assert script.tried == SLOTS[:1] and script.retried == []


async def test_no_untried_slot_left_raises_the_failure_without_a_retry() -> None:
    script = Script(*(transport("decode", s) for s in SLOTS))
    with pytest.raises(UpstreamTransportError) as info:
        await with_failover(Failover(max_attempts=10), "decode", SLOTS[0], script.attempt,
                            script.pick_next, script.on_retry)
    assert info.value.instance == "http://c:1"
    assert script.tried == SLOTS and len(script.retried) == 2  # the third found nowhere to go


async def test_a_non_upstream_error_passes_through_untouched() -> None:
    async def attempt(slot: Slot) -> str:
        raise KeyError("bug")

    async def pick_next(tried: set[Slot]) -> Slot | None:
        raise AssertionError("no retry for a bug")

    with pytest.raises(KeyError):
        await with_failover(Failover(max_attempts=3), "decode", SLOTS[0], attempt, pick_next)
