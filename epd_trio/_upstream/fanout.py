"""Run N async jobs concurrently in one nursery: all results in input order, or the first failure.

Why not a bare nursery: when one child raises, a trio nursery cancels the others but then raises
an ``ExceptionGroup`` (strict groups are the default), which callers must unpick to find the one
failure that matters, and which would carry every sibling's noise. ``fan_out`` records the *first*
``Exception``, cancels the siblings itself, and re-raises that exception unchanged, so a caller
writes ``except UpstreamError`` as if it had made one call.

Cancellation from outside (e.g. the client disconnected) is not a failure: ``trio.Cancelled``
passes straight through, after every job has been cancelled and has finished its cleanup.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import trio

T = TypeVar("T")

_UNSET = object()


async def fan_out(jobs: Sequence[Callable[[], Awaitable[T]]]) -> list[T]:
    """Run every job concurrently; return their results in the order of ``jobs``.

    On the first job that raises an ``Exception``, every other job is cancelled (each gets
    ``trio.Cancelled`` at its next checkpoint, so an in-flight HTTP request closes its
    connection), and that first exception is raised once all jobs have finished. Exceptions from
    jobs that fail later, while being cancelled, are dropped: they are consequences, not causes.
    """
    if len(jobs) == 1:
        # One job (a request with one image: the common case) needs no nursery: awaited
        # inline it has the same outcome, its exception unchanged, without a task to spawn.
        return [await jobs[0]()]
    results: list[object] = [_UNSET] * len(jobs)
    first_failure: list[Exception] = []

    async def run(index: int, job: Callable[[], Awaitable[T]], scope: trio.CancelScope) -> None:
        try:
            results[index] = await job()
        except Exception as exc:
            if not first_failure:
                first_failure.append(exc)
            scope.cancel()

    try:
        async with trio.open_nursery() as nursery:
            for index, job in enumerate(jobs):
                nursery.start_soon(run, index, job, nursery.cancel_scope)
    except BaseExceptionGroup as group:
        # Jobs only let BaseExceptions through; when those are all Cancelled (we are being
        # cancelled from outside), re-raise one plain Cancelled so callers can `except` it.
        if group.split(trio.Cancelled)[1] is None:
            raise _first_leaf(group) from None
        raise
    if first_failure:
        raise first_failure[0]
    return results  # type: ignore[return-value]


def _first_leaf(group: BaseExceptionGroup[BaseException]) -> BaseException:
    first = group.exceptions[0]
    return _first_leaf(first) if isinstance(first, BaseExceptionGroup) else first
