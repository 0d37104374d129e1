"""The generic nursery fan-out: ordered results, first failure wins and cancels the rest."""

from functools import partial

import pytest
import trio
import trio.testing

from epd_trio import fan_out


async def test_results_come_back_in_input_order(autojump_clock: trio.abc.Clock) -> None:
    async def job(value: int, delay: float) -> int:
        await trio.sleep(delay)
        return value

    results = await fan_out([partial(job, i, d) for i, d in enumerate([3, 1, 2, 0])])
    assert results == [0, 1, 2, 3]
    assert await fan_out([]) == []


async def test_first_failure_cancels_siblings_and_is_raised_plain() -> None:
    started, cancelled, finished = trio.Event(), [], []

    async def slow(name: str) -> None:
        try:
            started.set()
            await trio.sleep_forever()
        except trio.Cancelled:
            cancelled.append(name)
            raise
        finally:
            finished.append(name)

    async def failing() -> None:
        await started.wait()
        raise KeyError("boom")

    async def late_failure() -> None:
        try:
            await trio.sleep_forever()
        finally:
            raise RuntimeError("consequence, not cause")

    with pytest.raises(KeyError, match="boom"):  # not an ExceptionGroup
        await fan_out([partial(slow, "a"), failing, partial(slow, "b"), late_failure])
    assert sorted(cancelled) == ["a", "b"] and sorted(finished) == ["a", "b"]


async def test_outer_cancellation_cancels_every_job() -> None:
    running, cancelled = [], []

    async def job(i: int) -> None:
        running.append(i)
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            cancelled.append(i)
            raise

    seen: list[BaseException] = []

    async def caller() -> None:
        try:
            await fan_out([partial(job, i) for i in range(5)])
        except BaseException as exc:
            seen.append(exc)
            raise

    async with trio.open_nursery() as nursery:
        nursery.start_soon(caller)
        await trio.testing.wait_all_tasks_blocked()
        assert sorted(running) == list(range(5))
        nursery.cancel_scope.cancel()
    assert sorted(cancelled) == list(range(5))
    (exc,) = seen
    assert isinstance(exc, trio.Cancelled)  # one plain Cancelled, not a group of them


async def test_one_job_runs_inline_with_the_same_outcome() -> None:
    async def ok() -> str:
        await trio.lowlevel.checkpoint()
        return "done"

    async def fails() -> str:
        raise KeyError("the one failure")

    assert await fan_out([ok]) == ["done"]
    with pytest.raises(KeyError, match="the one failure"):  # plain, not in a group
        await fan_out([fails])
    with trio.move_on_after(0) as scope:  # cancellation passes straight through
        await fan_out([ok])
    assert scope.cancelled_caught
