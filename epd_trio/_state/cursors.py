"""The objects that own the routing counters (the only mutable routing state in the proxy).

The arithmetic lives in ``_core/routing.py``; these classes only hold the position and make each
read-and-advance one indivisible step per request. One proxy owns one ``EncoderCursor`` and two
``SlotCursor`` objects (prefill and decode each have their own counter: docs/discussion/protocol.md,
"Decision"; a shared one would pin prefill slot i to decode slot i).

A cursor routes over the instance list of one roster version. Its counter step may belong to a
newer one (another worker of ``epd-trio serve`` changed the roster; the shared counter's step
recorded that roster as data), so after each step a cursor given a ``Follow`` compares the
step's version with its list's and, when they differ, has the owner pull before it maps the
value: the pull is the cursor's own explicit call, at one known point, and nothing updates a
cursor from inside its counter step.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass
from functools import partial

import trio

from .._core.counters import Counter, LocalCounter
from .._core.failover import Allowed, Slot, next_slot
from .._core.policies import PrefixHint, SlotKey, StagePolicy, rotation
from .._core.routing import Epoch, Instance, dp_slots, encoder_rr_assignment, rebase_epoch, slot_keys

#: Which instances may be chosen right now (live, not already tried by this request...).
Usable = Callable[[Instance], bool]
#: The loads of some slots of the cursor's stage, in the order asked (``Loads.read``, bound).
LoadView = Callable[[Sequence[SlotKey]], list[int]]
#: The global cursor of a stage (``EPD_GLOBAL_CURSOR``): its position for the next ``n`` slots,
#: or None when it cannot be had in time (the cursor then uses its own counter).
GlobalCursor = Callable[[int], Awaitable[int | None]]


def _no_load(keys: Sequence[SlotKey]) -> list[int]:
    return [0] * len(keys)


@dataclass(frozen=True, slots=True)
class Follow:
    """How a cursor keeps its list with its counter: ``version()`` is the roster version the
    last counter step's value belongs to (what the roster store recorded in that step, no
    I/O); ``pull()`` has the roster's owner follow that version, which ``update``s this cursor
    (and the other cursors, the health states and the pools) before the value is mapped."""

    version: Callable[[], int]
    pull: Callable[[], None]


def _catch_up(follow: Follow | None, version: int) -> bool:
    """After a counter step: pull when the step's roster is not the list's; True when pulled."""
    if follow is None or follow.version() == version:
        return False
    follow.pull()
    return True


class EncoderCursor:
    """Global round-robin position over the encoders, persisting across requests.

    ``assign`` reads and advances the cursor under a ``trio.Lock`` in one step, before any
    sub-request is sent, so concurrent requests get disjoint, consecutive encoder ranges (300
    concurrent single-image requests over 3 encoders give exactly 100 items each).

    The encoder list may change (``update``: instances registering or leaving); the rotation
    then continues where it stood instead of restarting at encoder 0 (``rebase_position``).

    With another ``policy`` than round-robin, the cursor still advances by the item count (it
    is the rotation the policy breaks ties with), and item ``i`` is chosen among the encoders
    in rotation order from the cursor's position plus ``i``, on the ``loads`` read once per
    request and raised by each item already assigned (so one request's items spread).
    """

    def __init__(
        self, encoders: Sequence[Instance], start: int = 0, counter: Counter | None = None,
        *, policy: StagePolicy | None = None, loads: LoadView = _no_load,
        global_cursor: GlobalCursor | None = None, follow: Follow | None = None,
    ) -> None:
        """``global_cursor``: where a request's items start, when several replicas share one
        rotation (the position is then taken over the encoders in their shared order).
        ``follow``: the roster's owner, asked after each counter step (see the module)."""
        self._encoders = tuple(encoders)
        self._global = global_cursor
        self._policy = policy if policy is not None else StagePolicy()
        self._loads = loads
        self._counter = counter if counter is not None else LocalCounter(start)
        self._next = start
        self._epoch: Epoch = (0, 0)
        self._follow = follow
        #: The roster version ``_encoders`` belongs to (-1: none followed yet).
        self._version = -1
        self._lock = trio.Lock()

    @property
    def encoders(self) -> tuple[Instance, ...]:
        return self._encoders

    @property
    def policy(self) -> StagePolicy:
        return self._policy

    @property
    def position(self) -> int:
        """Where the next request starts (an index into ``encoders``)."""
        k0, i0 = self._epoch
        return (i0 + self._next - k0) % len(self._encoders) if self._encoders else 0

    def update(
        self, encoders: Sequence[Instance], epoch: Epoch | None = None, version: int | None = None
    ) -> None:
        """Change the encoder list; the rotation continues where it stood.

        ``epoch`` is where it continues (the proxy passes the one its roster computed, so that
        every worker process agrees); by default it is computed here from the counter.
        ``version`` is the roster version of ``encoders`` (what ``Follow.version`` is compared
        with).
        """
        encoders = tuple(encoders)
        if epoch is None:
            epoch = rebase_epoch(self._epoch, slot_keys(self._encoders, dp=False),
                                 slot_keys(encoders, dp=False), self._counter.fetch_add(0))
        self._encoders, self._epoch = encoders, epoch
        if version is not None:
            self._version = version

    async def assign(
        self, count: int, usable: Usable | None = None, uuids: Sequence[str] = ()
    ) -> list[Instance]:
        """The encoder for each of ``count`` items of one request, among the ``usable`` ones.

        Raises ``LookupError`` when no encoder is usable. Skipping an encoder keeps the others
        in their order; the cursor is a position in the usable list, so it stays fair.
        ``uuids`` (the items' ``uuid``, in order) are the hints of ``cache_aware``.
        """
        shared = None if self._global is None else await self._global(count)
        async with self._lock:
            candidates = _usable(self._encoders, usable)
            if not candidates:
                raise LookupError("no usable encoder")
            start = self._counter.fetch_add(count)
            # The value may belong to a newer roster than this list (another worker changed
            # it): follow that roster now, so the value is mapped over its own list.
            if _catch_up(self._follow, self._version):
                candidates = _usable(self._encoders, usable)
                if not candidates:
                    raise LookupError("no usable encoder")
            k0, i0 = self._epoch
            self._next = start + count
        position = i0 + start - k0 if shared is None else shared
        if not self._policy.reads_loads:
            assigned, _ = encoder_rr_assignment(candidates, position, count)
            return assigned
        return self._choose(candidates, position, count, uuids)

    def _choose(
        self, candidates: Sequence[Instance], position: int, count: int, uuids: Sequence[str]
    ) -> list[Instance]:
        keys: list[SlotKey] = [(e.url, None) for e in candidates]
        loads = self._loads(keys)
        assigned = []
        for i in range(count):
            order = rotation(len(keys), position + i)
            chosen = order[self._policy.choose(
                [keys[j] for j in order], [loads[j] for j in order],
                uuids[i] if i < len(uuids) else None)]
            loads[chosen] += 1
            assigned.append(candidates[chosen])
        return assigned


def _usable(instances: Sequence[Instance], usable: Usable | None) -> Sequence[Instance]:
    return instances if usable is None else [e for e in instances if usable(e)]


class SlotCursor:
    """Flat interleaved ``(instance, dp_rank)`` routing for one stage (prefill or decode).

    Request ``k`` (from 1) gets ``slots[(k - 1) % len(slots)]``; see ``dp_slots`` for the order.
    Advancing is synchronous (no checkpoint between read and write), so it is atomic under trio.
    When the instance list changes (``update``), the rotation continues where it stood.

    With another ``policy``, the counter still advances once per decision, and the policy
    chooses among the candidates in rotation order from there, on their ``loads`` (and, to
    break ties, their ``sizes``: the work in flight there).
    """

    def __init__(
        self, instances: Sequence[Instance], counter: Counter | None = None,
        *, policy: StagePolicy | None = None, loads: LoadView = _no_load,
        sizes: LoadView | None = None, global_cursor: GlobalCursor | None = None,
        follow: Follow | None = None,
    ) -> None:
        """``follow``: the roster's owner, asked after each counter step (see the module)."""
        self._policy = policy if policy is not None else StagePolicy()
        #: Shared by the replicas (``choose_slot`` takes a position from it per decision).
        self.global_cursor = global_cursor
        self._loads = loads
        self._sizes = sizes
        self._instances = tuple(instances)
        self._slots = dp_slots(self._instances)
        self._key_of = _keys_of(self._instances, self._slots)
        self._rotations: dict[
            int, tuple[list[tuple[int, int | None]], tuple[SlotKey, ...]]] = {}
        self._counter = counter if counter is not None else LocalCounter()
        self._epoch: Epoch = (0, 0)
        self._follow = follow
        #: The roster version ``_instances`` belongs to (-1: none followed yet).
        self._version = -1

    @property
    def instances(self) -> tuple[Instance, ...]:
        return self._instances

    @property
    def slot_count(self) -> int:
        return len(self._slots)

    def update(
        self, instances: Sequence[Instance], epoch: Epoch | None = None, version: int | None = None
    ) -> None:
        """Change the instance list; the rotation continues where it stood (see
        ``EncoderCursor.update``)."""
        instances = tuple(instances)
        if epoch is None:
            epoch = rebase_epoch(self._epoch, slot_keys(self._instances, dp=True),
                                 slot_keys(instances, dp=True), self._counter.fetch_add(0))
        self._instances, self._slots, self._epoch = instances, dp_slots(instances), epoch
        self._key_of = _keys_of(instances, self._slots)
        self._rotations = {}
        if version is not None:
            self._version = version

    def _candidates(
        self, usable: Usable | None, exclude: Collection[tuple[Instance, int | None]]
    ) -> list[tuple[int, int | None]]:
        """The usable slots minus ``exclude``, in flat interleaved order: ``self._slots`` itself
        when nothing is filtered out (the common case, whose rotations ``next`` caches).

        ``usable`` is asked once per instance, not once per slot (two DP8 instances: 2 calls,
        not 16), since it judges instances."""
        instances = self._instances
        allowed = (range(len(instances)) if usable is None else
                   [i for i, inst in enumerate(instances) if usable(inst)])
        if len(allowed) == len(instances) and not exclude:
            return self._slots
        allowed_set = set(allowed)
        return [
            (index, rank) for index, rank in self._slots
            if index in allowed_set and (instances[index], rank) not in exclude
        ]

    def _rotation(
        self, position: int
    ) -> tuple[list[tuple[int, int | None]], tuple[SlotKey, ...]]:
        """All slots and their keys in rotation order from ``position``, built once per roster
        (a policy reads them on every decision)."""
        cached = self._rotations.get(position)
        if cached is None:
            cached = self._rotated(self._slots, position)
            self._rotations[position] = cached
        return cached

    def _rotated(
        self, slots: list[tuple[int, int | None]], position: int
    ) -> tuple[list[tuple[int, int | None]], tuple[SlotKey, ...]]:
        order = slots[position:] + slots[:position]
        key_of = self._key_of
        return order, tuple(key_of[slot] for slot in order)

    @property
    def policy(self) -> StagePolicy:
        return self._policy

    def next(
        self, usable: Usable | None = None, exclude: Collection[tuple[Instance, int | None]] = (),
        hint: PrefixHint | None = None, shared: int | None = None,
    ) -> tuple[Instance, int | None]:
        """The slot for the next request among the ``usable`` instances' slots, minus ``exclude``.

        Unusable instances' slots are left out and the rest keep their flat interleaved order
        (the counter walks the remaining cycle). Raises ``LookupError`` when none is usable
        (without advancing the counter). ``hint`` is the prompt, for ``cache_aware``.
        ``shared`` is the global cursor's position, which wins over this cursor's own (the
        counter still advances, so a fallback continues the local rotation).
        """
        slots = self._candidates(usable, exclude)
        if not slots:
            raise LookupError("no usable instance for this stage")
        k = self._counter.fetch_add(1)
        if _catch_up(self._follow, self._version):  # the value's roster first (see the module)
            slots = self._candidates(usable, exclude)
            if not slots:
                raise LookupError("no usable instance for this stage")
        k0, i0 = self._epoch
        position = (i0 + k - k0 if shared is None else shared) % len(slots)
        if self._policy.reads_loads and len(slots) > 1:
            order, keys = (self._rotation(position) if slots is self._slots
                           else self._rotated(slots, position))
            read_sizes = self._sizes
            sizes = None if read_sizes is None else partial(read_sizes, keys)
            index, rank = order[self._policy.choose(keys, self._loads(keys), hint, sizes)]
        else:
            index, rank = slots[position]
        return self._instances[index], rank


async def choose_slot(
    cursor: SlotCursor, usable: Allowed, hint: PrefixHint | None, tried: Collection[Slot],
    *, routable: Allowed | None = None, any_slot: bool = False,
) -> Slot | None:
    """The next slot of a prefill or decode leg that already tried ``tried``: the stage's
    policy chooses within each step of ``fallback_steps`` (untried ``usable`` instances first;
    with ``any_slot``, other DP ranks, and a single slot again), among the instances a leg may
    go to at all (``routable``; None: any).

    One function for the pipeline and ``bench.policies``, so the decision cost the bench
    reports is the one a request pays.
    """

    async def choose(allowed: Allowed | None, exclude: Collection[Slot]) -> Slot:
        if routable is not None:
            step = allowed
            allowed = routable if step is None else (
                lambda inst: routable(inst) and step(inst))
        if cursor.global_cursor is None:
            return cursor.next(allowed, exclude, hint)
        return cursor.next(allowed, exclude, hint, await cursor.global_cursor(1))

    return await next_slot(choose, tried, usable, other_ranks=any_slot,
                           slot_count=cursor.slot_count)


def _keys_of(
    instances: Sequence[Instance], slots: Sequence[tuple[int, int | None]]
) -> dict[tuple[int, int | None], SlotKey]:
    """Each slot's identity (URL, rank), computed once per roster rather than per decision."""
    return {(index, rank): (instances[index].url, rank) for index, rank in slots}
