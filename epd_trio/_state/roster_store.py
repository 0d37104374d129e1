"""Where the roster lives: in one process, or in shared memory for the workers of ``epd-trio serve``.

The multi-worker problem: with ``--workers N`` each process has its own proxy, but a
registration (``POST /instances``) reaches only the worker that accepted its connection. So the
runner creates, before spawning the workers, one ``SharedRoutingState``: the three routing
counters, a roster version and the serialized roster, all in shared memory under **one**
cross-process lock. A change (register, unregister, forget) is made under that lock on the
current shared roster, with the counters' values of that instant (the new epochs are computed
from them), and bumps the version. A worker notices a change where it already takes the lock:
when it advances a routing counter (one more word read under the lock it holds anyway; the
serialized roster is copied out only when the version moved). That step records the roster as
data (``seen``) and calls nobody: the cursor that took the value asks ``seen``'s version
afterwards and, when its list is older, has the owner pull that roster before it maps the
value (``_state/cursors``, ``_membership/roster_owner``). So the counter value a request gets
and the instance list it is routed over always belong together, and every worker maps the same
counter value to the same instance: round-robin stays exact across workers and changes.
``look()`` (one unlocked word read) lets the points that take no counter (the top of a
request or a route, a housekeeping round) see changes too.

Why no listener: a store that pushed each new roster into the proxy called it from inside a
counter step, in the middle of a cursor's decision, so the cursors had to re-check what had
changed under them. A store that only records what it saw is read like h11's
``next_event()``: at points its owner chose.

Why shared memory and not a file: the counters already live there, a change has to be atomic
with them, and nothing outlives the runner (no stale file after a crash). The roster is small
(about 200 bytes an instance); the area holds ``capacity`` bytes (1 MiB: thousands of instances)
and a change that would not fit is refused with a 503.

Plain ``hypercorn --workers N`` has no parent process of ours to own this memory: each worker
then has its own roster (docs/how-to/operations.md says so).
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Mapping
from ctypes import c_char, c_int64
from multiprocessing.context import BaseContext
from typing import Any, Protocol, TypeVar

from .._core.counters import Counter, CursorCounters
from .._core.errors import RosterFull
from .._core.names import STAGES
from .._core.roster import MAX_MODELS, Roster
from .loads import LoadTable, LocalLoadTable, SharedLoadTable
from .rate_buckets import SharedRateBuckets
from .tenant_places import SharedTenantPlaces

T = TypeVar("T")
#: A change: the current roster and the counters' values -> the new roster and a result.
Change = Callable[[Roster, Mapping[str, int]], tuple[Roster, T]]

DEFAULT_CAPACITY = 1 << 20


class RosterStore(Protocol):
    """Holds the current roster and the newest one this process has seen; tells nobody.

    ``seen`` costs nothing (an attribute); ``look()`` refreshes it (for the shared store, one
    unlocked word read, and a copy only when the version moved); ``current()`` is the roster
    as it is now, registration times included (it may take the lock).
    """

    @property
    def seen(self) -> Roster: ...

    def attach(self, initial: Roster) -> None: ...

    def update(self, change: Change[T]) -> T: ...

    def look(self) -> Roster: ...

    def current(self) -> Roster: ...


def routing_state(
    shared: SharedRoutingState | None,
) -> tuple[CursorCounters, RosterStore, LoadTable]:
    """The counters, the roster store and the in-flight load table of one proxy: this
    process's own, or ``shared``'s."""
    if shared is None:
        counters = CursorCounters.local()
        return counters, LocalRosterStore(counters), LocalLoadTable()
    return shared.counters(), shared, shared.loads


class LocalRosterStore:
    """The roster of a single process: a change is seen at once, nothing to look for."""

    def __init__(self, counters: CursorCounters) -> None:
        self._counters = counters
        self._roster = Roster()

    @property
    def seen(self) -> Roster:
        return self._roster

    def attach(self, initial: Roster) -> None:
        self._roster = initial

    def update(self, change: Change[T]) -> T:
        values = {role: getattr(self._counters, role).fetch_add(0) for role in STAGES}
        self._roster, result = change(self._roster, values)
        return result

    def look(self) -> Roster:
        return self._roster

    def current(self) -> Roster:
        return self._roster


# Words of the shared array: the roster's three counters, its version, the length of its
# bytes, then each model pool's three counters (``Roster.models`` index, stage).
_COUNTER = {role: i for i, role in enumerate(STAGES)}
_VERSION = len(STAGES)
_LENGTH = _VERSION + 1
_POOLS = _LENGTH + 1
_WORDS = _POOLS + MAX_MODELS * len(STAGES)


def _pool_word(index: int, stage: str) -> int:
    if not 0 <= index < MAX_MODELS:
        raise IndexError(f"model index {index} outside the {MAX_MODELS} counter slots")
    return _POOLS + index * len(STAGES) + _COUNTER[stage]


class SharedRoutingState:
    """Counters + roster in shared memory (created by the runner before spawning the workers).

    Pickled into each spawned worker; the per-process part (the roster it last saw) is not
    pickled and starts empty there.
    """

    def __init__(self, context: BaseContext | None = None, capacity: int = DEFAULT_CAPACITY) -> None:
        ctx = context or multiprocessing.get_context("spawn")
        self._lock = ctx.Lock()
        self._words = ctx.RawArray(c_int64, _WORDS)
        self._blob = ctx.RawArray(c_char, capacity)
        #: The in-flight counts per slot the load-aware policies read (``_state/loads``).
        self.loads = SharedLoadTable(ctx)
        #: The tenants' per-minute buckets, shared by the workers (``_state/rate_buckets``).
        self.buckets = SharedRateBuckets(ctx)
        #: The capped tenants' requests in flight, counted by every worker
        #: (``_state/tenant_places``).
        self.places = SharedTenantPlaces(ctx)
        self._init_local()

    def _init_local(self) -> None:
        self._initial = Roster()
        self._seen: Roster = self._initial

    def __getstate__(self) -> dict[str, Any]:
        return {"_lock": self._lock, "_words": self._words, "_blob": self._blob,
                "loads": self.loads, "buckets": self.buckets, "places": self.places}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_local()

    def counters(self) -> CursorCounters:
        """The routing counters, bound to this state (taking one syncs the roster)."""
        return CursorCounters(*(_SharedCounter(self, _COUNTER[r]) for r in STAGES),
                              pools=_SharedPoolCounters(self))

    # -- RosterStore ---------------------------------------------------------------------------
    @property
    def seen(self) -> Roster:
        """The newest roster this process has seen: by its own change, by ``look``, or
        captured by a counter step of this process (the version its value belongs to)."""
        return self._seen

    def attach(self, initial: Roster) -> None:
        """``initial`` is version 0 (the static configuration, the same in every worker)."""
        self._initial = self._seen = initial
        self.look()  # a worker started after a change

    def update(self, change: Change[T]) -> T:
        with self._lock:
            roster = self._read_locked()
            values = {role: self._words[_COUNTER[role]] for role in STAGES}
            new, result = change(roster, values)
            if new is not roster:
                raw = new.to_bytes()
                if len(raw) > len(self._blob):
                    raise RosterFull(f"the roster would need {len(raw)} bytes; the shared area "
                                     f"holds {len(self._blob)}")
                self._blob[: len(raw)] = raw
                self._words[_LENGTH] = len(raw)
                self._words[_VERSION] = new.version
        self._seen = new
        return result

    def look(self) -> Roster:
        """``seen``, refreshed: one unlocked word read; the lock and a copy only when another
        worker changed the roster since."""
        if self._words[_VERSION] != self._seen.version:
            with self._lock:
                self._seen = self._read_locked()
        return self._seen

    def current(self) -> Roster:
        """The shared roster as it is now (registration times included)."""
        with self._lock:
            self._seen = self._read_locked()
        return self._seen

    # -- internals -------------------------------------------------------------------------------
    def _read_locked(self) -> Roster:
        length = self._words[_LENGTH]
        return Roster.from_bytes(self._blob[:length]) if length else self._initial

    def _fetch_add(self, index: int, n: int) -> int:
        """The counter's old value; the roster it belongs to is ``seen`` afterwards (copied in
        the same locked step when another worker changed it, then only parsed: data, no call)."""
        raw = None
        words = self._words
        with self._lock:
            old = words[index]
            words[index] = old + n
            if words[_VERSION] != self._seen.version:
                raw = self._blob[: words[_LENGTH]]
        if raw is not None:
            self._seen = Roster.from_bytes(raw) if raw else self._initial
        return old


class _SharedPoolCounters:
    """The model pools' counters of a ``SharedRoutingState`` (a step syncs the roster, as the
    roster's own counters do)."""

    def __init__(self, state: SharedRoutingState) -> None:
        self._state = state

    def counter(self, index: int, stage: str) -> Counter:
        return _SharedCounter(self._state, _pool_word(index, stage))

    def peek(self, index: int, stage: str) -> int:
        # Read under the store's lock by the change that asks (no second acquire: the lock
        # is not re-entrant), or alone where a torn read is impossible (one aligned word).
        return int(self._state._words[_pool_word(index, stage)])


class _SharedCounter(Counter):
    """One routing counter of a ``SharedRoutingState``."""

    def __init__(self, state: SharedRoutingState, index: int) -> None:
        self._state = state
        self._index = index

    def fetch_add(self, n: int) -> int:
        return self._state._fetch_add(self._index, n)
