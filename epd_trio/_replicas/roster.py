"""The roster of a replica that shares its registrations with the others (``EPD_STATE_URL``).

The ``RosterStore`` the proxy routes on when a state store is configured. Routing never waits
for the store: a change made here (a registration, an unregistration) applies to this
replica's view at once, like ``LocalRosterStore``, and is queued as a pending write that the
sync task (``_replicas/sync.py``) takes to the store and announces. Changes made at other replicas
come back from that task: one announcement at a time (the fast path), or a full snapshot (the
periodic resync, and after every reconnect). Pending writes win over what the store says until
they are written, so a registration taken while the store is unreachable is neither lost nor
undone by a resync, and is written back on reconnect.

What is shared is the registered instances; static instances stay each replica's own
configuration. The view is rebuilt from the records with ``shared_state.merge`` (static first,
then registered ones by URL: every replica orders them alike), and each stage whose slots
changed restarts at a random offset (``reseeded``), as it does at start.

Synchronous and without I/O, like the other stores: the sync task calls it from the same
event loop, and the roster owner pulls ``seen`` from it (``_membership/roster_owner``).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import TypeVar

from .._core.counters import CursorCounters
from .._core.names import STAGES
from .._core.roster import Member, Roster, changed_members
from .._core.shared_state import Record, merge, records_of, reseeded, to_local_time
from .._state.roster_store import Change

T = TypeVar("T")
log = logging.getLogger("epd_trio")

#: Where a queued write stands: a record to put (``quiet``: only its registration time moved,
#: so nobody needs to be told), or None to delete.
Pending = tuple[Record, bool] | None


class ReplicatedRoster:
    """This replica's view of the shared roster, and the writes it owes the store."""

    def __init__(
        self, counters: CursorCounters, *, clock: Callable[[], float] = time.monotonic,
        moriio_clock: Callable[[], float] | None = None,
        wall: Callable[[], float] = time.time, rng: random.Random | None = None,
    ) -> None:
        """``clock`` stamps HTTP registrations and ``moriio_clock`` MoRIIO ones (the proxy's
        clocks); ``wall`` is the time records carry. A record that cannot join this view is
        logged once per reason."""
        self._counters = counters
        self._clock = clock
        self._moriio_clock = moriio_clock or clock
        self._wall = wall
        self._rng = rng or random.Random()
        self._roster = Roster()
        #: The shared members as this replica knows them (registration times on local clocks).
        self._records: dict[str, Record] = {}
        self._pending: dict[str, Pending] = {}
        #: Writes taken by the sync task and not yet confirmed written.
        self._inflight: dict[str, Pending] = {}
        #: Writes confirmed, by the count of confirmed batches when they were: a snapshot read
        #: before a write landed must not undo it (``write_mark``).
        self._written: dict[str, tuple[int, Pending]] = {}
        self._batches = 0
        self._skipped: dict[str, str] = {}
        #: Called when a write is queued (the sync task's wake-up).
        self.on_pending: Callable[[], None] | None = None
        #: Called when the view changed (the roster owner's wake-up, for whoever waits on a
        #: change; the roster itself is pulled at the owner's next point, not handed over).
        self.on_change: Callable[[], None] | None = None
        #: Whether the shared roster has been read once (``/ready`` waits for it).
        self.loaded = False
        #: What every new view gets before it is installed (the roster owner's: the model
        #: pools' epochs); called with the old view, the new one and the counters' values.
        self.refine: Callable[[Roster, Roster, Mapping[str, int]], Roster] | None = None

    # -- RosterStore -----------------------------------------------------------------------------
    @property
    def seen(self) -> Roster:
        return self._roster

    def attach(self, initial: Roster) -> None:
        self._roster = reseeded(Roster(), initial, self._values(), self.offset, every_stage=True)

    def update(self, change: Change[T]) -> T:
        values = self._values()
        new, result = change(self._roster, values)
        if new is self._roster:
            return result
        # Diff what this view held against what the change left: a record this replica could
        # not take (``merge`` skipped it) is not in the view, so no change here deletes it.
        before, after = records_of(self._roster), records_of(new)
        for url, record in after.items():
            known = before.get(url)
            if known != record:
                quiet = known is not None and _same_but_time(known, record)
                self._pending[url] = (self._to_wall(record), quiet)
        for url in before.keys() - after.keys():
            self._pending[url] = None
        self._records = {**{url: r for url, r in self._records.items() if url not in before},
                         **after}
        self._install(values, statics_from=new)
        if self.on_pending is not None:
            self.on_pending()
        return result

    def look(self) -> Roster:
        return self._roster

    def current(self) -> Roster:
        return self._roster

    # -- what the sync task calls ------------------------------------------------------------------
    def take_pending(self) -> dict[str, Pending]:
        """The writes owed to the store; the caller writes them, then says ``written`` (or
        ``requeue``s them). Until then they stay this replica's: nothing read from the store
        meanwhile undoes them."""
        pending, self._pending = self._pending, {}
        self._inflight.update(pending)
        return pending

    def written(self, writes: Mapping[str, Pending]) -> None:
        """``writes`` are in the store now."""
        self._batches += 1
        for url, write in writes.items():
            if url in self._inflight and self._inflight[url] is write:
                del self._inflight[url]
            self._written[url] = (self._batches, write)

    def requeue(self, writes: Mapping[str, Pending]) -> None:
        """Writes that failed: owed again, unless a newer change to the same URL came since."""
        for url, write in writes.items():
            if url in self._inflight and self._inflight[url] is write:
                del self._inflight[url]
            self._pending.setdefault(url, write)

    def write_mark(self) -> int:
        """Taken before reading a snapshot: writes confirmed after it win over what it read."""
        return self._batches

    def known_records(self) -> list[Record]:
        """Every shared member this replica knows, as records with wall-clock times: what it
        writes back after a reconnect or when the store lost its data."""
        return [self._to_wall(record) for record in self._records.values()]

    def live_registered(self, live: Callable[[Member], bool]) -> list[str]:
        """URLs of HTTP-registered members this replica sees as ``live`` (it keeps their
        entries alive: an instance is forgotten only when nobody routes to it and it is
        silent, as without a store)."""
        return [record.member.url for record in self._records.values()
                if record.member.moriio is None and live(record.member)]

    def _ours(self, url: str) -> bool:
        return url in self._pending or url in self._inflight

    def apply_put(self, record: Record) -> None:
        """Another replica registered or refreshed an instance (``record`` has wall time)."""
        url = record.member.url
        if self._ours(url):
            return  # our own newer change is on its way to the store
        self._records[url] = self._joined(self._to_local(record))
        self._install(self._values())

    def apply_delete(self, url: str) -> None:
        """Another replica unregistered ``url``: gone from every replica, a static one too (an
        instance that says it is stopping must get no more requests)."""
        if self._ours(url):
            return
        self._records.pop(url, None)
        roster = self._roster
        self._install(self._values(), statics_from=replace(
            roster, members=tuple(m for m in roster.members if m.url != url)))

    def apply_snapshot(self, records: Iterable[Record], mark: int | None = None) -> None:
        """The whole shared roster as the store held it when read (wall times), ``mark``
        (``write_mark``) taken before the read: this replica's writes not yet written, or
        confirmed after the mark, win over it."""
        fresh = {record.member.url: self._joined(self._to_local(record)) for record in records}
        mark = self._batches if mark is None else mark
        overlay = {url: write for url, (batch, write) in self._written.items() if batch > mark}
        overlay.update(self._inflight)
        overlay.update(self._pending)
        for url, write in overlay.items():
            if write is None:
                fresh.pop(url, None)
            else:
                fresh[url] = self._to_local(write[0])
        self._written = {url: entry for url, entry in self._written.items() if entry[0] > mark}
        self._records = fresh
        self.loaded = True
        self._install(self._values())

    def keep_view(self) -> None:
        """The store's roster could not be read whole (its index is not a set: written by
        hand): keep the view as it is, changes announced by the others still apply, and count
        it as loaded, so that the replica is ready on what it can read."""
        self.loaded = True

    def _joined(self, record: Record) -> Record:
        """``record`` with what another registration path told this replica about the same
        instance: an HTTP registration carries no MoRIIO peer, a MoRIIO heartbeat no encoder-
        cache addresses, and a record written by a replica that heard only one path must not
        erase the other (only an unregistration removes an instance, whole)."""
        known = self._records.get(record.member.url)
        if known is None:
            return record
        member, old = record.member, known.member
        if member.moriio is None and old.moriio is not None:
            member = replace(member, moriio=old.moriio)
            record = replace(record, member=member, transfer_mode=known.transfer_mode)
        if not member.ec_zmq_addrs and old.ec_zmq_addrs:
            record = replace(record, member=replace(member, ec_zmq_addrs=old.ec_zmq_addrs))
        return record

    # -- internals ------------------------------------------------------------------------------
    def _install(self, values: Mapping[str, int], statics_from: Roster | None = None) -> None:
        """Rebuild the view from the records (and the static members of ``statics_from``, by
        default the current view); wake the owner when routing changed."""
        old = self._roster
        source = statics_from or old
        merged, skipped = merge(source, self._records, values)
        for url, why in skipped:
            if self._skipped.get(url) != why:
                log.warning("shared instance %s skipped: %s", url, why)
        self._skipped = dict(skipped)
        new = changed_members(old, merged.members, values, merged.transfer_mode)
        if source is not old:  # what the change said each instance serves (no record has it)
            new = replace(new, served=source.served)
        new = reseeded(old, new, values, self.offset)
        if self.refine is not None:
            new = self.refine(old, new, values)
        self._roster = new
        if new.version != old.version and self.on_change is not None:
            self.on_change()

    def _values(self) -> dict[str, int]:
        return {stage: getattr(self._counters, stage).fetch_add(0) for stage in STAGES}

    def offset(self, slots: int) -> int:
        """Where a changed stage or pool starts its rotation here: a random slot."""
        return self._rng.randrange(slots) if slots else 0

    def _local_clock(self, member: Member) -> Callable[[], float]:
        return self._moriio_clock if member.moriio is not None else self._clock

    def _to_wall(self, record: Record) -> Record:
        member = record.member
        if member.registered_at <= 0:
            return record
        local_now = self._local_clock(member)()
        wall = self._wall() - max(0.0, local_now - member.registered_at)
        return replace(record, member=replace(member, registered_at=wall))

    def _to_local(self, record: Record) -> Record:
        member = record.member
        local = to_local_time(member.registered_at, self._wall(), self._local_clock(member)())
        return replace(record, member=replace(member, registered_at=local, static=False))


def _same_but_time(a: Record, b: Record) -> bool:
    return replace(a.member, registered_at=0.0) == replace(b.member, registered_at=0.0) and \
        a.transfer_mode == b.transfer_mode
