"""Routing counters: in-process, or shared by the worker processes of one ``epd-trio serve``.

Why shared memory: with ``--workers N`` each process has its own cursors; if each starts at 0,
the first requests of every worker all go to encoder 0 and slot 0 (the upstream bug again, across
processes), and short bursts, where the kernel hands a few connections to each worker, stay
skewed. One counter in shared memory, advanced under one cross-process lock, gives every worker
the next position of a single global sequence: the distribution is exactly round-robin whatever
the accept pattern. The critical section is an add on one machine word (microseconds, never a
blocking wait in practice), so taking a ``multiprocessing`` lock inside the event loop is fine.
The shared implementation lives with the shared roster, in ``_state/roster_store.py``; this module only
names what a counter is, so it depends on nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


class Counter(Protocol):
    """A monotonic position: ``fetch_add(n)`` returns the old value and adds ``n``."""

    def fetch_add(self, n: int) -> int: ...


class LocalCounter:
    """A counter owned by one process (the default)."""

    def __init__(self, start: int = 0) -> None:
        self._value = start

    def fetch_add(self, n: int) -> int:
        old = self._value
        self._value = old + n
        return old


class PoolCounters(Protocol):
    """Each model pool's own three counters, by the model's index in ``Roster.models`` (its
    slot) and the stage: another model's traffic never moves them."""

    def counter(self, index: int, stage: str) -> Counter: ...

    def peek(self, index: int, stage: str) -> int:
        """The value now, without a step (a roster change reads it, under the store's lock)."""
        ...


class LocalPoolCounters:
    """The pools' counters of one process, made on first use. (Where a replica's rotation
    starts is its pools' epoch, not the counter's value: ``_models/pools.with_pool_epochs``.)"""

    def __init__(self) -> None:
        self._counters: dict[tuple[int, str], LocalCounter] = {}

    def counter(self, index: int, stage: str) -> LocalCounter:
        found = self._counters.get((index, stage))
        if found is None:
            found = self._counters[(index, stage)] = LocalCounter()
        return found

    def peek(self, index: int, stage: str) -> int:
        return self.counter(index, stage).fetch_add(0)


@dataclass(frozen=True, slots=True)
class CursorCounters:
    """The routing counters of a proxy: the three of the roster (encoder items, prefill slots,
    decode slots) and each model pool's own."""

    encode: Counter
    prefill: Counter
    decode: Counter
    pools: PoolCounters = field(default_factory=LocalPoolCounters)

    @classmethod
    def local(cls) -> CursorCounters:
        return cls(LocalCounter(), LocalCounter(), LocalCounter())
