"""Bounded failover: retry a failed upstream attempt on another instance, when that can help.

What is retried: a connect/transport error, a timeout, or a 5xx: failures that say something
about the *instance*, so another one may succeed. A 4xx is never retried (the client's request is
wrong and would be wrong everywhere), and nothing is retried after a byte reached the client (the
callers only use this before that point). Each retry goes to an instance not yet tried by this
request, so a hung or dead instance costs one attempt, not ``max_attempts``; when no untried
usable instance is left, the last failure is raised as it is.

No I/O and no trio here: ``with_failover`` awaits only what it is given (the attempt and the
choice of the next slot), like h11's ``Connection`` works on the bytes it is handed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Collection
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from .errors import UpstreamError, UpstreamStatusError
from .routing import Instance

T = TypeVar("T")
#: Where one upstream call goes: an instance, and its DP rank (None when ``dp_size`` is 1).
Slot = tuple[Instance, int | None]
#: Told about each retry: the stage, the instance that failed, and why.
OnRetry = Callable[[str, Instance, UpstreamError], None]


def is_retryable(error: UpstreamError) -> bool:
    """Could another instance succeed where this one failed?"""
    if isinstance(error, UpstreamStatusError):
        return error.upstream_status >= 500
    return True


@dataclass(frozen=True, slots=True)
class Failover:
    """How many attempts one stage makes (the first one included)."""

    max_attempts: int = 1


#: One attempt: the behaviour when a caller asks for no failover.
NO_FAILOVER = Failover()


class LegObserver(Protocol):
    """What an upstream leg reports, and to whom: the one place attempts are accounted.

    ``leg(stage, slot)`` wraps every upstream call (in flight while the block runs, its outcome
    from how the block ends); ``retried`` is told about each failover. The proxy's
    ``RequestAccount`` feeds health, metrics and the request's trace from these two calls.
    """

    def leg(self, stage: str, slot: Slot) -> AbstractContextManager[Any]: ...

    def retried(self, stage: str, instance: Instance, error: UpstreamError) -> None: ...


class _Unobserved:
    """Counts nothing: for callers that embed a stage without the proxy's accounting."""

    def leg(self, stage: str, slot: Slot) -> AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def retried(self, stage: str, instance: Instance, error: UpstreamError) -> None:
        pass


UNOBSERVED: LegObserver = _Unobserved()


async def with_failover(
    policy: Failover,
    stage: str,
    first: Slot,
    attempt: Callable[[Slot], Awaitable[T]],
    pick_next: Callable[[set[Slot]], Awaitable[Slot | None]],
    on_retry: OnRetry | None = None,
    also_retry: Collection[str] = (),
) -> T:
    """Run ``attempt`` on ``first``; on a retryable failure, on ``pick_next(tried_slots)``, ...

    At most ``policy.max_attempts`` attempts. ``pick_next`` returns ``None`` when no untried
    instance is usable, which ends the retries. Only failures of ``stage`` itself are retried
    here: an attempt that fails in an inner stage (the prefill inside a decode attempt) has
    already had that stage's own failover, and retrying it again would multiply the attempts.
    ``also_retry`` names inner stages that have no failover of their own (MoRIIO WRITE mode's
    prefill, which runs beside decode): their failures are retried here too.
    """
    slot, tried, attempts = first, set[Slot](), 0
    while True:
        attempts += 1
        try:
            return await attempt(slot)
        except UpstreamError as error:
            if (attempts >= policy.max_attempts
                    or (error.stage != stage and error.stage not in also_retry)
                    or not is_retryable(error)):
                raise
            tried.add(slot)
            following = await pick_next(tried)
            if following is None:
                raise
            if on_retry is not None:
                on_retry(stage, slot[0], error)
            slot = following
