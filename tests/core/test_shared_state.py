"""The shared state as values: records, announcements, the merge, reseeding, load hashes."""

from __future__ import annotations

import random

import orjson
import pytest

from epd_trio._core.moriio import MoriioPeer
from epd_trio._core.roster import Member, Roster, static_roster
from epd_trio._core.routing import Instance
from epd_trio._core.shared_state import (
    DEAD_REPLICA_LIMIT,
    MAX_LOAD_INTERVAL,
    MalformedEntry,
    Record,
    decode_announcement,
    decode_record,
    encode_announcement,
    encode_record,
    load_expiry,
    load_fields,
    merge,
    parse_load_field,
    reseeded,
    sum_loads,
    to_local_time,
    worker_replica_id,
)

ZERO = {"encode": 0, "prefill": 0, "decode": 0}


def member(url: str, role: str = "decode", dp: int = 1, at: float = 100.0, **kw: object) -> Member:
    return Member(Instance(url, dp), role, registered_at=at, **kw)  # type: ignore[arg-type]


def test_a_record_round_trips() -> None:
    plain = Record(member("http://d:1", dp=4, ec_zmq_addrs=()))
    peer = Record(member("http://p:1", "prefill", moriio=MoriioPeer("host:1,handshake:2", 2, 1)),
                  "WRITE")
    for record in (plain, peer):
        assert decode_record(encode_record(record), url=record.member.url) == record


MALFORMED = [
    b"not json",
    b"[1, 2]",
    orjson.dumps({"v": 2, "url": "http://d:1"}),
    orjson.dumps({"v": 1, "url": "http://d:1", "role": "decoder", "dp_size": 1,
                  "ec_zmq_addrs": [], "registered_at": 1, "moriio": None, "transfer_mode": None}),
    orjson.dumps({"v": 1, "url": "ftp://d:1", "role": "decode", "dp_size": 1,
                  "ec_zmq_addrs": [], "registered_at": 1, "moriio": None, "transfer_mode": None}),
    orjson.dumps({"v": 1, "url": "http://d:1", "role": "decode", "dp_size": 0,
                  "ec_zmq_addrs": [], "registered_at": 1, "moriio": None, "transfer_mode": None}),
    orjson.dumps({"v": 1, "url": "http://d:1", "role": "decode", "dp_size": 1,
                  "ec_zmq_addrs": "x", "registered_at": 1, "moriio": None, "transfer_mode": None}),
    orjson.dumps({"v": 1, "url": "http://d:1", "role": "decode", "dp_size": 1,
                  "ec_zmq_addrs": [], "registered_at": "now", "moriio": None,
                  "transfer_mode": None}),
    orjson.dumps({"v": 1, "url": "http://d:1", "role": "decode", "dp_size": 1,
                  "ec_zmq_addrs": [], "registered_at": 1, "moriio": ["a", 1, 1],
                  "transfer_mode": "SIDEWAYS"}),
    orjson.dumps({"v": 1, "url": "http://d:1", "role": "decode", "dp_size": 1,
                  "ec_zmq_addrs": [], "registered_at": 1}),
    orjson.dumps({"v": 1, "url": "http://other:1", "role": "decode", "dp_size": 1,
                  "ec_zmq_addrs": [], "registered_at": 1, "moriio": None, "transfer_mode": None}),
]


@pytest.mark.parametrize("raw", MALFORMED)
def test_a_malformed_record_is_refused_not_guessed(raw: bytes) -> None:
    with pytest.raises(MalformedEntry):
        decode_record(raw, url="http://d:1")


@pytest.mark.parametrize("url", ["http://d:abc", "http://d:99999", "http://u:pw@d:1",
                                 "http://d :1", "http://d:0"])
@pytest.mark.parametrize("dp_size", [1, 100000])
def test_a_record_with_a_bad_url_or_size_from_the_store_is_skipped(url: str,
                                                                   dp_size: int) -> None:
    """Issue 31: another replica (an older version, a hand-edited key) must not hand this one
    an instance whose URL or size would kill its prober; the state link skips the record."""
    raw = orjson.dumps({"v": 1, "url": url, "role": "decode", "dp_size": dp_size,
                        "ec_zmq_addrs": [], "registered_at": 1, "moriio": None,
                        "transfer_mode": None})
    with pytest.raises(MalformedEntry):
        decode_record(raw)


def test_announcements_round_trip_and_refuse_garbage() -> None:
    record = Record(member("http://d:1"))
    put = decode_announcement(encode_announcement("put", "http://d:1", "r1", encode_record(record)))
    assert (put.op, put.url, put.origin, put.record) == ("put", "http://d:1", "r1", record)
    gone = decode_announcement(encode_announcement("delete", "http://d:1", "r2"))
    assert (gone.op, gone.record) == ("delete", None)
    for raw in (b"{}", b"nope", encode_announcement("put", "http://d:1", "r1"),
                encode_announcement("explode", "http://d:1", "r1"),
                encode_announcement("put", "http://x:1", "r", encode_record(record))):
        with pytest.raises(MalformedEntry):
            decode_announcement(raw)


def test_merge_orders_static_first_then_registered_by_url_whatever_the_arrival() -> None:
    base = static_roster([], [], [Instance("http://static:1")])
    records = {u: Record(member(u)) for u in ("http://c:1", "http://a:1", "http://b:1")}
    one, skipped = merge(base, records, ZERO)
    two, _ = merge(base, dict(reversed(list(records.items()))), ZERO)
    assert skipped == []
    assert [i.url for i in one.of("decode")] == ["http://static:1", "http://a:1", "http://b:1",
                                                 "http://c:1"]
    assert one.members == two.members and one.version == two.version == 1


def test_merge_skips_what_contradicts_this_replica() -> None:
    base = static_roster([], [Instance("http://p:1")], [Instance("http://d:1")])
    records = {
        "http://p:1": Record(member("http://p:1", "encode")),           # a static prefill
        "http://pd:1": Record(member("http://pd:1", "prefill_decode")),  # a mix with P+D
        "http://m1:1": Record(member("http://m1:1", "prefill", moriio=MoriioPeer("a")), "READ"),
        "http://m2:1": Record(member("http://m2:1", "decode", moriio=MoriioPeer("b")), "WRITE"),
    }
    roster, skipped = merge(base, records, ZERO)
    assert [url for url, _ in skipped] == ["http://m2:1", "http://p:1", "http://pd:1"]
    assert roster.transfer_mode == "READ"
    assert [i.url for i in roster.of("prefill")] == ["http://p:1", "http://m1:1"]


def test_merge_takes_a_static_instances_record_whole() -> None:
    """A static prefill that also registered over MoRIIO and HTTP: the record carries both
    paths' fields, and the merge keeps them all (and the static flag)."""
    base = static_roster([], [Instance("http://p:1")], [Instance("http://d:1")])
    record = Record(member("http://p:1", "prefill", moriio=MoriioPeer("a"),
                           ec_zmq_addrs=("tcp://p:7001",)), "READ")
    roster, skipped = merge(base, {"http://p:1": record}, ZERO)
    p = roster.find("http://p:1")
    assert skipped == [] and p is not None and p.static
    assert (p.moriio, p.ec_zmq_addrs) == (MoriioPeer("a"), ("tcp://p:7001",))


def test_merge_keeps_the_version_when_only_registration_times_move() -> None:
    first, _ = merge(Roster(), {"http://a:1": Record(member("http://a:1", at=1.0))}, ZERO)
    again, _ = merge(first, {"http://a:1": Record(member("http://a:1", at=9.0))}, ZERO)
    assert again.version == first.version and again.members[0].registered_at == 9.0


def test_reseeded_restarts_only_the_stages_that_changed_at_the_offset_given() -> None:
    old = static_roster([Instance("http://e:1")], [], [Instance("http://d:1")])
    new, _ = merge(old, {"http://d2:1": Record(member("http://d2:1"))}, ZERO)
    counters = {"encode": 7, "prefill": 0, "decode": 40}
    seeded = reseeded(old, new, counters, lambda slots: slots - 1)
    assert seeded.epochs["decode"] == (40, 1) and seeded.epochs["encode"] == old.epochs["encode"]
    every = reseeded(Roster(), old, counters, lambda slots: slots - 1, every_stage=True)
    assert every.epochs["encode"] == (7, 0) and every.epochs["prefill"] == (0, 0)


def test_random_offsets_spread_replicas_that_see_the_same_change() -> None:
    old = Roster()
    new, _ = merge(old, {f"http://d{i}:1": Record(member(f"http://d{i}:1")) for i in range(8)},
                   ZERO)
    starts = {reseeded(old, new, ZERO, random.Random(seed).randrange).epochs["decode"][1]
              for seed in range(20)}
    assert len(starts) > 3  # not all at slot 0, nor all at one place


def test_load_fields_round_trip_and_sum_over_replicas() -> None:
    mine = load_fields([("decode", ("http://d:1", 3), 2), ("encode", ("http://e:1", None), 1),
                        ("decode", ("http://d:1", 0), 0)])
    assert len(mine) == 2
    assert parse_load_field(next(iter(mine))) == ("decode", ("http://d:1", 3))
    theirs = {b"decode\x1fhttp://d:1\x1f3": b"5", b"garbage": b"1",
              b"decode\x1fhttp://d:1\x1f0": b"-4", b"prefill\x1fhttp://p:1\x1f": b"x"}
    total, bad = sum_loads([{k.encode(): str(v).encode() for k, v in mine.items()}, theirs])
    assert total == {("decode", ("http://d:1", 3)): 7, ("encode", ("http://e:1", None)): 1}
    assert bad == 3


def test_wall_times_map_onto_the_local_clock_never_into_its_future() -> None:
    assert to_local_time(wall=95.0, now_wall=100.0, now_local=1000.0) == 995.0
    assert to_local_time(wall=105.0, now_wall=100.0, now_local=1000.0) == 1000.0


def test_each_worker_of_a_named_replica_gets_an_id_of_its_own() -> None:
    ids = [worker_replica_id("fleet-a", k) for k in range(3)]
    assert ids == ["fleet-a-w0", "fleet-a-w1", "fleet-a-w2"]
    assert worker_replica_id("host-123", 0) != "host-123"  # never the base itself


@pytest.mark.parametrize(("interval", "expiry"), [
    (0.05, 0.6), (0.25, 3.0), (0.4, 4.8), (0.5, 5.0), (1.0, 5.0)])
def test_a_replicas_counts_expire_after_many_intervals_but_within_5_s(
    interval: float, expiry: float,
) -> None:
    assert load_expiry(interval) == pytest.approx(expiry)


def test_every_accepted_load_interval_keeps_the_5_s_promise_and_several_publications() -> None:
    for step in range(1, 1001):
        interval = MAX_LOAD_INTERVAL * step / 1000
        assert load_expiry(interval) <= DEAD_REPLICA_LIMIT == 5.0
        assert load_expiry(interval) >= 5 * interval  # five publications, at the longest
