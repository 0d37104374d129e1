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
    prefill, which runs beside decode): their failures are retried here too, and ``on_retry``
    names the stage that failed (a failed WRITE prefill is a prefill retry, not a decode one).
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
                on_retry(error.stage if error.stage in also_retry else stage, slot[0], error)
            slot = following


#: Which instances a fallback step may choose (None: any), and which slots it must not.
Allowed = Callable[[Instance], bool]
#: Choose a slot among the ``allowed`` instances' slots minus ``exclude``, by the stage's
#: policy; raises ``LookupError`` when there is none.
Choose = Callable[[Allowed | None, Collection[Slot]], Awaitable[Slot]]


def fallback_steps(
    tried: Collection[Slot], usable: Allowed, *, other_ranks: bool, slot_count: int
) -> list[tuple[Allowed | None, Collection[Slot]]]:
    """Where a request that already tried ``tried`` looks next, in this order (the first step
    that has a candidate wins, and the policy chooses within it):

    1. a usable instance not tried yet;
    2. (after a failure) an instance not tried yet that is out of rotation;
    3. with ``other_ranks``, an untried slot (another DP rank) of a usable instance;
    4. with ``other_ranks`` and a single slot in the stage, that slot again.

    Why an instance out of rotation: it may be back already (restarted and listening, its
    next probe not yet due), and trying it beats failing the request for sure, as panic
    mode does for a whole stage.

    Why the same slot: with one decode slot there is no *other* to fail over to, and the
    failures worth retrying (a failed KV pull, an engine hiccup) are often transient, so
    upstream's proxy retries its only decode instance; the retry stays within
    ``decode_retries``. The first choice of a request is step 1 alone (``tried`` is empty).
    """
    if not tried and not other_ranks:  # every request's first choice: no filter to add
        return [(usable, ())]
    urls = {instance.url for instance, _ in tried}
    steps: list[tuple[Allowed | None, Collection[Slot]]] = [
        (lambda inst: inst.url not in urls and usable(inst), ())]
    if tried:
        steps.append((lambda inst: inst.url not in urls, ()))
    if other_ranks:
        steps.append((usable, tried))
        if slot_count == 1:
            steps.append((None, ()))
    return steps


async def next_slot(
    choose: Choose, tried: Collection[Slot], usable: Allowed, *, other_ranks: bool = False,
    slot_count: int = 0,
) -> Slot | None:
    """The first slot ``fallback_steps`` yields, chosen by ``choose``; None when no step has
    one (the retries end there)."""
    for allowed, exclude in fallback_steps(tried, usable, other_ranks=other_ranks,
                                           slot_count=slot_count):
        try:
            return await choose(allowed, exclude)
        except LookupError:
            continue
    return None
