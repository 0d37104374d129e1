"""Bounded failover: retry a failed upstream attempt on another instance, when that can help.

What is retried: a connect/transport error, a timeout, or a 5xx: failures that say something
about the *instance*, so another one may succeed. A 4xx is never retried (the client's request is
wrong and would be wrong everywhere), and nothing is retried after a byte reached the client (the
callers only use this before that point). Each retry goes to an instance not yet tried by this
request, so a hung or dead instance costs one attempt, not ``max_attempts``; when no untried
usable instance is left, the last failure is raised as it is.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import TypeVar

from ._errors import UpstreamError, UpstreamStatusError
from ._routing import Instance

T = TypeVar("T")
Slot = tuple[Instance, int | None]


def is_retryable(error: UpstreamError) -> bool:
    """Could another instance succeed where this one failed?"""
    if isinstance(error, UpstreamStatusError):
        return error.upstream_status >= 500
    return True


@dataclass(frozen=True, slots=True)
class Failover:
    """How one stage retries, and the hooks the proxy uses to count attempts.

    ``track(stage, slot)`` wraps every attempt (the proxy counts in-flight requests and DP-rank
    hits, and feeds failures to the health registry there); ``on_retry`` is told about each retry.
    """

    max_attempts: int = 1
    track: Callable[[str, Slot], AbstractContextManager[object]] | None = None
    on_retry: Callable[[str, Instance, UpstreamError], None] | None = None

    @contextmanager
    def tracking(self, stage: str, slot: Slot) -> Iterator[None]:
        if self.track is None:
            yield
        else:
            with self.track(stage, slot):
                yield


#: One attempt, no hooks: the behaviour when a caller asks for no failover.
NO_FAILOVER = Failover()


async def with_failover(
    policy: Failover,
    stage: str,
    first: Slot,
    attempt: Callable[[Slot], Awaitable[T]],
    pick_next: Callable[[set[Slot]], Awaitable[Slot | None]],
) -> T:
    """Run ``attempt`` on ``first``; on a retryable failure, on ``pick_next(tried_slots)``, ...

    At most ``policy.max_attempts`` attempts. ``pick_next`` returns ``None`` when no untried
    instance is usable, which ends the retries. Only failures of ``stage`` itself are retried
    here: an attempt that fails in an inner stage (the prefill inside a decode attempt) has
    already had that stage's own failover, and retrying it again would multiply the attempts.
    """
    slot, tried, attempts = first, set[Slot](), 0
    while True:
        attempts += 1
        try:
            with policy.tracking(stage, slot):
                return await attempt(slot)
        except UpstreamError as error:
            if (attempts >= policy.max_attempts or error.stage != stage
                    or not is_retryable(error)):
                raise
            tried.add(slot)
            following = await pick_next(tried)
            if following is None:
                raise
            if policy.on_retry is not None:
                policy.on_retry(stage, slot[0], error)
            slot = following
