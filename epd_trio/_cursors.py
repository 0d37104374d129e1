"""The objects that own the routing counters (the only mutable routing state in the proxy).

The arithmetic lives in ``_routing.py``; these classes only hold the position and make each
read-and-advance one indivisible step per request. One proxy owns one ``EncoderCursor`` and two
``SlotCursor`` objects (prefill and decode each have their own counter, PROTOCOL.md "Decision": a
shared one would pin prefill slot i to decode slot i).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import trio

from ._counters import Counter, LocalCounter
from ._routing import Instance, dp_slots, encoder_rr_assignment

#: Which instances may be chosen right now (live, not already tried by this request...).
Usable = Callable[[Instance], bool]


class EncoderCursor:
    """Global round-robin position over the encoders, persisting across requests.

    ``assign`` reads and advances the cursor under a ``trio.Lock`` in one step, before any
    sub-request is sent, so concurrent requests get disjoint, consecutive encoder ranges (300
    concurrent single-image requests over 3 encoders give exactly 100 items each).
    """

    def __init__(
        self, encoders: Sequence[Instance], start: int = 0, counter: Counter | None = None
    ) -> None:
        self._encoders = tuple(encoders)
        self._counter = counter if counter is not None else LocalCounter(start)
        self._start = start
        self._lock = trio.Lock()

    @property
    def encoders(self) -> tuple[Instance, ...]:
        return self._encoders

    @property
    def position(self) -> int:
        """Where the next request starts (modulo the number of usable encoders)."""
        return self._start % len(self._encoders) if self._encoders else 0

    async def assign(self, count: int, usable: Usable | None = None) -> list[Instance]:
        """The encoder for each of ``count`` items of one request, among the ``usable`` ones.

        Raises ``LookupError`` when no encoder is usable. Skipping an encoder keeps the others
        in their order; the cursor is a position in the usable list, so it stays fair.
        """
        candidates = [e for e in self._encoders if usable is None or usable(e)]
        if not candidates:
            raise LookupError("no usable encoder")
        async with self._lock:
            start = self._counter.fetch_add(count)
            self._start = start + count
        assigned, _ = encoder_rr_assignment(candidates, start, count)
        return assigned


class SlotCursor:
    """Flat interleaved ``(instance, dp_rank)`` routing for one role (prefill or decode).

    Request ``k`` (from 1) gets ``slots[(k - 1) % len(slots)]``; see ``dp_slots`` for the order.
    Advancing is synchronous (no checkpoint between read and write), so it is atomic under trio.
    """

    def __init__(self, instances: Sequence[Instance], counter: Counter | None = None) -> None:
        self._instances = tuple(instances)
        self._slots = dp_slots(self._instances)
        self._counter = counter if counter is not None else LocalCounter()

    @property
    def instances(self) -> tuple[Instance, ...]:
        return self._instances

    @property
    def slot_count(self) -> int:
        return len(self._slots)

    def next(
        self, usable: Usable | None = None, exclude: Collection[tuple[Instance, int | None]] = ()
    ) -> tuple[Instance, int | None]:
        """The slot for the next request among the ``usable`` instances' slots, minus ``exclude``.

        Unusable instances' slots are left out and the rest keep their flat interleaved order
        (the counter walks the remaining cycle). Raises ``LookupError`` when none is usable.
        """
        slots = self._slots if usable is None and not exclude else [
            (index, rank) for index, rank in self._slots
            if (usable is None or usable(self._instances[index]))
            and (self._instances[index], rank) not in exclude
        ]
        if not slots:
            raise LookupError("no usable instance for this role")
        index, rank = slots[self._counter.fetch_add(1) % len(slots)]
        return self._instances[index], rank
