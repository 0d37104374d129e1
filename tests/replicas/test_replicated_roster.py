"""ReplicatedRoster: a replica's view of the shared roster and the writes it owes (no I/O)."""

from __future__ import annotations

import random
from dataclasses import replace

from epd_trio._core.counters import CursorCounters
from epd_trio._core.roster import (
    Member,
    Roster,
    parse_registration,
    register,
    static_roster,
    unregister,
)
from epd_trio._core.routing import Instance
from epd_trio._core.shared_state import Record
from epd_trio._replicas.roster import ReplicatedRoster


class Clocks:
    def __init__(self) -> None:
        self.local, self.wall = 50.0, 10_000.0


def make(static: Roster | None = None, seed: int = 1) -> tuple[ReplicatedRoster, list[Roster],
                                                                 Clocks]:
    clocks = Clocks()
    store = ReplicatedRoster(CursorCounters.local(), clock=lambda: clocks.local,
                             wall=lambda: clocks.wall, rng=random.Random(seed))
    store.attach(static or Roster())
    seen: list[Roster] = []  # the view at each wake-up of its owner (who then pulls it)
    store.on_change = lambda: seen.append(store.seen)
    return store, seen, clocks


def registration(url: str, role: str = "decode", at: float = 50.0) -> Member:
    return parse_registration(f'{{"role": "{role}", "url": "{url}"}}'.encode(), at)


def put(store: ReplicatedRoster, member: Member) -> bool:
    return store.update(lambda roster, counters: register(roster, member, counters))


def test_a_local_registration_applies_at_once_and_is_owed_to_the_store() -> None:
    store, seen, clocks = make()
    assert put(store, registration("http://d:1"))
    assert [i.url for i in store.current().of("decode")] == ["http://d:1"]
    assert seen[-1] is store.current()
    pending = store.take_pending()
    (record, quiet), = pending.values()
    assert not quiet and record.member.registered_at == clocks.wall  # wall time in the store
    # A heartbeat that only moves the time is a quiet write: nobody needs telling.
    clocks.local += 30
    clocks.wall += 30
    put(store, registration("http://d:1", at=clocks.local))
    (record, quiet), = store.take_pending().values()
    assert quiet and record.member.registered_at == clocks.wall


def test_an_unregistration_is_owed_as_a_delete_and_a_failed_write_is_owed_again() -> None:
    store, _, _ = make()
    put(store, registration("http://d:1"))
    store.take_pending()
    store.update(lambda roster, counters: unregister(roster, "http://d:1", counters))
    writes = store.take_pending()
    assert writes == {"http://d:1": None}
    store.requeue(writes)
    put(store, registration("http://d:1"))  # newer than the failed delete: it wins
    store.requeue(writes)
    assert store.take_pending()["http://d:1"] is not None


def test_others_changes_apply_unless_ours_to_the_same_url_is_still_pending() -> None:
    store, _, clocks = make()
    theirs = Record(registration("http://e:1", "encode", at=clocks.wall - 5))
    store.apply_put(theirs)
    (entry,) = store.current().members
    assert entry.url == "http://e:1" and entry.registered_at == clocks.local - 5
    put(store, registration("http://d:1"))
    store.apply_delete("http://d:1")  # ours is pending: theirs is older than what we write
    assert store.current().find("http://d:1") is not None
    writes = store.take_pending()
    store.apply_delete("http://d:1")  # ours is in flight: still ours
    assert store.current().find("http://d:1") is not None
    store.written(writes)
    store.apply_delete("http://d:1")
    assert store.current().find("http://d:1") is None


def test_a_delete_from_another_replica_removes_a_static_instance_too() -> None:
    store, seen, _ = make(static_roster([], [], [Instance("http://s:1"), Instance("http://t:1")]))
    before = len(seen)
    store.apply_delete("http://s:1")
    assert [i.url for i in store.current().of("decode")] == ["http://t:1"]
    assert len(seen) == before + 1  # routing changed: the owner was woken


def test_a_snapshot_replaces_the_registered_members_but_pending_writes_win() -> None:
    store, _, clocks = make(static_roster([], [], [Instance("http://s:1")]))
    assert not store.loaded
    store.apply_put(Record(registration("http://gone:1", at=clocks.wall)))
    put(store, registration("http://mine:1"))  # taken while the store is unreachable
    store.apply_snapshot([Record(registration("http://new:1", at=clocks.wall))])
    assert store.loaded
    assert [i.url for i in store.current().of("decode")] == [
        "http://s:1", "http://mine:1", "http://new:1"]
    assert {r.member.url for r in store.known_records()} == {"http://mine:1", "http://new:1"}


def test_the_rotation_starts_at_a_random_offset_at_start_and_after_a_change() -> None:
    static = static_roster([], [], [Instance(f"http://d{i}:1", 4) for i in range(4)])
    starts = {make(static, seed)[0].current().epochs["decode"][1] for seed in range(12)}
    assert len(starts) > 3 and all(0 <= s < 16 for s in starts)
    store, _, _ = make(static, seed=3)
    before = store.current().epochs["decode"]
    put(store, registration("http://d9:1"))
    after = store.current().epochs["decode"]
    assert after != before and 0 <= after[1] < 17


def test_only_live_http_registrations_are_kept_alive_by_this_replica() -> None:
    store, _, _ = make()
    put(store, registration("http://up:1"))
    put(store, registration("http://down:1"))
    assert store.live_registered(lambda m: m.url == "http://up:1") == ["http://up:1"]


def test_a_record_this_replica_cannot_take_is_kept_and_never_deleted_by_it() -> None:
    store, _, clocks = make(static_roster([], [Instance("http://p:1")], []))
    # Another replica's combined instance clashes with this replica's static prefill.
    store.apply_put(Record(registration("http://pd:1", "prefill_decode", at=clocks.wall)))
    assert store.current().find("http://pd:1") is None
    put(store, registration("http://d:1"))
    assert list(store.take_pending()) == ["http://d:1"]  # no delete of http://pd:1
    assert {r.member.url for r in store.known_records()} == {"http://pd:1", "http://d:1"}


def test_a_write_taken_or_just_written_is_not_undone_by_a_snapshot_read_before_it() -> None:
    store, _, _ = make()
    put(store, registration("http://d:1"))
    mark = store.write_mark()
    writes = store.take_pending()  # on its way to the store
    store.apply_snapshot([], mark)  # read before the write landed
    assert store.current().find("http://d:1") is not None
    store.written(writes)
    store.apply_snapshot([], mark)  # still a read from before: the write stays
    assert store.current().find("http://d:1") is not None
    store.apply_snapshot([], store.write_mark())  # read after: the store says it is gone
    assert store.current().find("http://d:1") is None
    # A delete in flight is not undone by a snapshot that still holds the instance either.
    put(store, registration("http://e:1"))
    store.written(store.take_pending())
    store.update(lambda roster, counters: unregister(roster, "http://e:1", counters))
    mark = store.write_mark()
    store.take_pending()
    store.apply_snapshot([Record(registration("http://e:1"))], mark)
    assert store.current().find("http://e:1") is None


def test_a_record_from_another_path_never_erases_what_this_replica_heard_on_its_own() -> None:
    from epd_trio._core.moriio import MoriioPeer
    store, _, clocks = make()
    peer = MoriioPeer("host:10.0.0.1,handshake:6301,notify:61001")
    store.apply_put(Record(replace(registration("http://p:1", "prefill", at=clocks.wall),
                                   moriio=peer), "READ"))
    # Another replica heard only the HTTP registration (with its encoder-cache addresses).
    http = replace(registration("http://p:1", "prefill", at=clocks.wall), ec_zmq_addrs=("z:1",))
    store.apply_put(Record(http))
    member = store.current().find("http://p:1")
    assert member is not None and member.moriio == peer and member.ec_zmq_addrs == ("z:1",)
    store.apply_snapshot([Record(registration("http://p:1", "prefill", at=clocks.wall))])
    member = store.current().find("http://p:1")
    assert member is not None and member.moriio == peer and member.ec_zmq_addrs == ("z:1",)


def test_a_state_link_failure_shown_on_health_never_carries_a_password() -> None:
    """Issue 31: ``/health`` and ``/ready`` show why the state link is down, in the client
    library's words, which may hold the URL as given."""
    from epd_trio._replicas.sync import _described

    exc = ConnectionError("Error connecting to redis://:hunter2@r:6380")
    exc.__cause__ = OSError("connect to rediss://app:hunter2@r:6380 refused")
    shown = _described(exc)
    assert "hunter2" not in shown and "app" not in shown
    assert shown == ("ConnectionError: Error connecting to redis://***@r:6380 "
                     "(OSError: connect to rediss://***@r:6380 refused)")
