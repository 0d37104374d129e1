"""The admission queue: priority bands, and tenants taking turns by weight inside a band.

The rules, in order, each time a place frees (``pop``):

1. **Bands.** A waiter is in its tenant's band (its priority: lower is served first).
2. **Aging.** A band moves up one step (its priority number minus one) for every ``aging``
   seconds its oldest waiter has waited, but never above the best band waiting; bands at the
   same step take turns, one place each: of those, the band that got a place least recently
   goes first. So a lower band is never starved: with ``aging`` 0.5 s, a batch band at
   priority 1 beside an interactive band at 0 gets every other place once its oldest has
   waited 0.5 s, and the interactive band still gets the others (it is never put behind the
   whole batch queue, which strict promotion above it would do under a flood deeper than
   ``aging`` seconds of service). An interactive request that arrives while the batch band
   has taken the last places goes first: the turn is owed to it. (A counter that ticked only
   while bands were tied remembered the turn across such episodes: one interactive request
   alone took two tied places, lost then won, so every later one waited for the second place
   to free, not the first, which under a flood was most of its wait.) ``aging`` 0 turns aging
   off (strict bands).
3. **Turns inside a band.** Deficit round-robin: each tenant with waiters, in turn, is credited
   its ``weight`` and serves one waiter per whole credit, so over many turns tenants are served
   in proportion to their weights, and one tenant's thousand waiters do not starve another's
   one. A tenant whose queue empties leaves the turn and its credit is forgotten.
4. **Work-conserving.** A tenant that may not start another request now (``blocked``: it is at
   its own ``max_inflight``) is skipped, so a free place never stays idle while anyone else
   could use it.

A waiter that gives up (its deadline) is marked ``cancelled`` and dropped when reached.
Nothing here knows time or I/O: ``now`` comes in as an argument.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

#: Bands whose last place ``FairQueue`` remembers beyond those waiting (a guard, see ``_served``).
MAX_REMEMBERED_BANDS = 64


@dataclass(slots=True, eq=False)
class Waiter:
    """One request waiting for a place; ``token`` is the caller's (what to wake)."""

    tenant: str
    priority: int
    weight: float
    enqueued: float
    token: Any = None
    cancelled: bool = False


@dataclass(slots=True)
class _Band:
    queues: dict[str, deque[Waiter]] = field(default_factory=dict)
    #: Tenants with waiters, the head's turn first.
    turns: deque[str] = field(default_factory=deque)
    credit: dict[str, float] = field(default_factory=dict)


class FairQueue:
    """The waiters of one admission gate (see the module docstring for the rules)."""

    def __init__(self, aging: float) -> None:
        self._aging = aging
        self._bands: dict[int, _Band] = {}
        self._waiting = 0
        #: Places given so far, and the count at the last place each band got: among bands at
        #: the same step (aging), the one served least recently goes first. Kept after a band
        #: empties, so a band that empties after every place it gets, its next request arriving
        #: before the next place frees, still takes turns instead of going first every time.
        self._given = 0
        self._last_given: dict[int, int] = {}
        #: The band of the last ``pop`` and its count before it (``requeue`` puts it back).
        self._before_last: tuple[int, int | None] | None = None

    def __len__(self) -> int:
        """Waiters, the cancelled not yet dropped included."""
        return self._waiting

    def push(self, waiter: Waiter) -> None:
        band = self._bands.get(waiter.priority)
        if band is None:
            band = self._bands[waiter.priority] = _Band()
        queue = band.queues.get(waiter.tenant)
        if queue is None:
            queue = band.queues[waiter.tenant] = deque()
            band.turns.append(waiter.tenant)
            # The first tenant of a band starts its turn now; later ones when theirs comes.
            band.credit[waiter.tenant] = waiter.weight if len(band.turns) == 1 else 0.0
        queue.append(waiter)
        self._waiting += 1

    def requeue(self, waiter: Waiter) -> None:
        """A waiter ``pop`` gave out that could not start after all (another process took
        its tenant's last place in between): back at the head of its tenant's line, with
        the credit its turn spent, and its band's turn among tied bands as before."""
        undo, self._before_last = self._before_last, None
        if undo is not None and undo[0] == waiter.priority:
            if undo[1] is None:
                self._last_given.pop(waiter.priority, None)
            else:
                self._last_given[waiter.priority] = undo[1]
        band = self._bands.get(waiter.priority)
        if band is None:
            band = self._bands[waiter.priority] = _Band()
        queue = band.queues.get(waiter.tenant)
        if queue is None:
            queue = band.queues[waiter.tenant] = deque()
            band.turns.append(waiter.tenant)
            band.credit[waiter.tenant] = waiter.weight if len(band.turns) == 1 else 0.0
        else:
            band.credit[waiter.tenant] += 1.0
        queue.appendleft(waiter)
        self._waiting += 1

    def depth(self) -> dict[tuple[str, int], int]:
        """Waiters (the cancelled left out) per (tenant, band)."""
        return {(tenant, priority): n for priority, band in self._bands.items()
                for tenant, queue in band.queues.items()
                if (n := sum(not w.cancelled for w in queue))}

    def pop(self, now: float, blocked: Collection[str] = ()) -> Waiter | None:
        """The waiter that gets the place that just freed, or None (no one may take it)."""
        for priority in self._band_order(now):
            waiter = self._pop_band(priority, blocked)
            if waiter is not None:
                self._served(priority)
                return waiter
        return None

    def _served(self, priority: int) -> None:
        self._before_last = (priority, self._last_given.get(priority))
        self._last_given[priority] = self._given
        self._given += 1
        if len(self._last_given) > MAX_REMEMBERED_BANDS:
            # Bands come from the tenants' tables, so this holds a few; the bound is only a
            # guard: a band forgotten while empty counts as never served when it returns.
            self._last_given = {p: n for p, n in self._last_given.items()
                                if p in self._bands or p == priority}

    def _band_order(self, now: float) -> list[int]:
        oldest = {priority: when for priority in list(self._bands)
                  if (when := self._oldest(priority)) is not None}
        if not oldest:
            return []
        best = min(oldest)
        aging = self._aging
        ranked = sorted(
            (max(best, priority - (int((now - when) // aging) if aging > 0 else 0)), priority)
            for priority, when in oldest.items())
        first = ranked[0][0]
        tied = [priority for step, priority in ranked if step == first]
        rest = [priority for step, priority in ranked if step != first]
        if len(tied) > 1:  # bands at the same step take turns: the least recently served first
            last = self._last_given
            tied.sort(key=lambda priority: (last.get(priority, -1), priority))
        return tied + rest

    def _oldest(self, priority: int) -> float | None:
        """The enqueue time of the band's oldest live waiter (the cancelled dropped on the
        way); None, and the band forgotten, when it has none."""
        band = self._bands[priority]
        oldest = None
        for tenant in list(band.queues):
            queue = band.queues[tenant]
            while queue and queue[0].cancelled:
                queue.popleft()
                self._waiting -= 1
            if not queue:
                self._leave(band, tenant)
            elif oldest is None or queue[0].enqueued < oldest:
                oldest = queue[0].enqueued
        if not band.queues:
            del self._bands[priority]
        return oldest

    def _leave(self, band: _Band, tenant: str) -> None:
        del band.queues[tenant], band.credit[tenant]
        was_head = band.turns[0] == tenant
        band.turns.remove(tenant)
        if was_head and band.turns:
            head = band.turns[0]
            band.credit[head] += self._weight_of(band, head)

    @staticmethod
    def _weight_of(band: _Band, tenant: str) -> float:
        return band.queues[tenant][0].weight

    def _pop_band(self, priority: int, blocked: Collection[str]) -> Waiter | None:
        band = self._bands[priority]
        if all(tenant in blocked for tenant in band.turns):
            return None
        while True:
            tenant = band.turns[0]
            if tenant not in blocked and band.credit[tenant] >= 1.0:
                queue = band.queues[tenant]
                waiter = queue.popleft()
                self._waiting -= 1
                while queue and queue[0].cancelled:
                    queue.popleft()
                    self._waiting -= 1
                if waiter.cancelled:
                    if not queue:
                        self._leave(band, tenant)
                        if not band.turns:
                            del self._bands[priority]
                            return None
                        if all(t in blocked for t in band.turns):
                            return None
                    continue
                band.credit[tenant] -= 1.0
                if not queue:
                    self._leave(band, tenant)
                    if not band.turns:
                        del self._bands[priority]
                return waiter
            # The turn passes: a blocked tenant keeps no credit for a turn it could not use.
            if tenant in blocked:
                band.credit[tenant] = 0.0
            band.turns.rotate(-1)
            head = band.turns[0]
            band.credit[head] += self._weight_of(band, head)
