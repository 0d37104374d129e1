"""The roster (pure): registration bodies, membership changes, and the rotation across them."""

from __future__ import annotations

import itertools
import re

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epd_trio import EncoderCursor, Instance, SlotCursor
from epd_trio._core.errors import BadRequest
from epd_trio._core.moriio import MoriioPeer, MoriioRegistration
from epd_trio._core.names import STAGES
from epd_trio._core.roster import (
    Conflict,
    Member,
    Roster,
    expired,
    forget,
    layout_name,
    parse_registration,
    register,
    register_moriio,
    silent_moriio,
    static_roster,
    unregister,
)
from epd_trio._core.routing import (
    KvEventEndpoints,
    parse_instance,
    rebase_epoch,
    rebase_position,
    slot_keys,
)
from epd_trio._core.shared_state import Record, decode_record, encode_record
from epd_trio._state.cursors import Follow

ZERO = {"encode": 0, "prefill": 0, "decode": 0}


def body(**fields: object) -> bytes:
    return orjson.dumps(fields)


# -- rebase arithmetic --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "old, new, position, expected",
    [
        ("ABC", "ABCD", 2, 2),   # next is C: still C, then D joins the cycle after it
        ("ABC", "ABCD", 0, 0),   # a cycle just ended: A again, D after C
        ("ABC", "AC", 1, 1),     # next (B) left: the first survivor after it (C)
        ("ABC", "AB", 2, 0),     # next (C) left, wrap around to A
        ("ABC", "BC", 5, 1),     # positions wrap (5 % 3 = 2: C, at 1 in the new list)
        ("ABC", "XYZ", 1, 0),    # nothing survives: start over
        ("", "AB", 7, 0),        # from nothing
        ("AB", "", 1, 0),        # to nothing
        ("ABCD", "AXBCD", 1, 2),  # an insertion before the next slot does not move it
    ],
)
def test_rebase_position(old: str, new: str, position: int, expected: int) -> None:
    assert rebase_position(list(old), list(new), position) == expected


def test_rebase_epoch_continues_from_the_counter() -> None:
    # Counter 7 over [A, B, C] from epoch (0, 0) is slot 7 % 3 = 1 (B): B stays next.
    assert rebase_epoch((0, 0), list("ABC"), list("ABCD"), 7) == (7, 1)
    # An epoch (k0, i0) shifts the mapping: counter 7 is slot (2 + 7 - 5) % 3 = 1.
    assert rebase_epoch((5, 2), list("ABC"), list("BC"), 7) == (7, 0)


def _walk(sequence: list[str], order: list[str]) -> bool:
    """Is ``sequence`` a contiguous cyclic walk of ``order`` (every step goes to the next one)?"""
    index = {name: i for i, name in enumerate(order)}
    return all(index[b] == (index[a] + 1) % len(order) for a, b in itertools.pairwise(sequence))


@settings(max_examples=200, deadline=None)
@given(
    steady=st.lists(st.integers(1, 3), min_size=1, max_size=3),
    steps=st.lists(st.tuples(st.integers(0, 7), st.booleans(), st.integers(1, 3)), max_size=12),
)
def test_no_skip_and_no_reset_across_changes(
    steady: list[int], steps: list[tuple[int, bool, int]]
) -> None:
    """Instances that stay across any mix of arrivals and departures are served as one unbroken
    round-robin: none skipped, none served twice before the others had their turn."""
    base = [Instance(f"http://s{i}:1", dp) for i, dp in enumerate(steady)]
    extra: list[Instance] = []
    cursor = SlotCursor(base)
    picks: list[tuple[str, int | None]] = []
    for n, (count, add, dp) in enumerate(steps):
        picks += [(i.url, r) for i, r in (cursor.next() for _ in range(count))]
        if add:
            extra.append(Instance(f"http://x{n}:1", dp))
        elif extra:
            extra.pop(0)
        cursor.update([*base, *extra])
    picks += [(i.url, r) for i, r in (cursor.next() for _ in range(7))]
    # Within the steady instances' slots the order is the flat interleaved one of the base set
    # (extra instances come after them in each rank, so they never reorder the steady ones).
    order = slot_keys(base, dp=True)
    steady_picks = [p for p in picks if p in order]
    assert steady_picks[0] == order[0]  # the very first pick is slot 0
    names = {key: str(i) for i, key in enumerate(order)}
    assert _walk([names[p] for p in steady_picks], [names[k] for k in order])


async def test_encoder_cursor_continues_after_a_registration() -> None:
    e = [Instance(f"http://e{i}:1") for i in range(3)]
    cursor = EncoderCursor(e[:2])
    first = [(await cursor.assign(1))[0].url for _ in range(3)]
    assert first == [e[0].url, e[1].url, e[0].url]
    cursor.update(e)  # no reset to e0: e1 was next and stays next
    after = [(await cursor.assign(1))[0].url for _ in range(4)]
    assert after == [e[1].url, e[2].url, e[0].url, e[1].url]
    cursor.update([e[0], e[2]])  # e2 was next: still next
    assert [i.url for i in await cursor.assign(3)] == [e[2].url, e[0].url, e[2].url]
    assert cursor.position == 0  # e0 is next
    assert [i.url for i in await cursor.assign(1)] == [e[0].url]


class Recording:
    """A counter whose step records the roster version its value belongs to, as the shared
    counter does (``pending``: another worker's change, captured by the next step)."""

    def __init__(self) -> None:
        self.value, self.version = 0, 0
        self.pending: int | None = None

    def fetch_add(self, n: int) -> int:
        old, self.value = self.value, self.value + n
        if self.pending is not None:
            self.version, self.pending = self.pending, None
        return old


async def test_encoder_cursor_pulls_the_roster_its_counter_step_belongs_to() -> None:
    """In a worker, taking the shared counter can capture another worker's change: the cursor
    pulls it before mapping the value, so the request is routed over the new list (and the
    epoch that came with it); with no change, nothing is pulled."""
    e = [Instance(f"http://e{i}:1") for i in range(3)]
    counter, pulled = Recording(), []

    def pull() -> None:  # the owner following the version the step recorded
        pulled.append(counter.version)
        cursor.update(e, (0, 1), counter.version)  # another worker's change, at counter 0

    cursor = EncoderCursor((), counter=counter, follow=Follow(lambda: counter.version, pull))
    cursor.update(e[:1], (0, 0), version=0)
    counter.pending = 1
    assert [i.url for i in await cursor.assign(2)] == [e[1].url, e[2].url]
    assert pulled == [1]
    assert [i.url for i in await cursor.assign(1)] == [e[0].url]
    assert pulled == [1]


def test_slot_cursor_pulls_the_roster_its_counter_step_belongs_to() -> None:
    """The same rule for prefill and decode: the value is mapped over the list it belongs to."""
    d = [Instance(f"http://d{i}:1") for i in range(3)]
    counter, pulled = Recording(), []

    def pull() -> None:
        pulled.append(counter.version)
        cursor.update(d, (0, 2), counter.version)

    cursor = SlotCursor((), counter=counter, follow=Follow(lambda: counter.version, pull))
    cursor.update(d[:1], (0, 0), version=0)
    assert cursor.next() == (d[0], None) and pulled == []
    counter.pending = 1
    assert cursor.next() == (d[0], None)  # value 1 over the new list, from d2 at 0: d0
    assert cursor.next() == (d[1], None) and pulled == [1]


# -- registration bodies ------------------------------------------------------------------------
def test_parse_registration_defaults_and_fields() -> None:
    member = parse_registration(body(role="prefill_decode", url="http://pd:8000/", dp_size=2,
                                     ec_zmq_addrs=["tcp://pd:1", "tcp://pd:2"], extra=1), 5.0)
    assert member == Member(Instance("http://pd:8000", 2), "prefill_decode",
                            ec_zmq_addrs=("tcp://pd:1", "tcp://pd:2"), registered_at=5.0)
    assert member.stage == "decode"
    assert parse_registration(body(role="encode", url="http://e:1"), 0).instance.dp_size == 1


@pytest.mark.parametrize(
    "raw, fragment",
    [
        (b"{", "not valid JSON"),
        (b"[]", "JSON object"),
        (body(url="http://e:1"), "'role' must be one of"),
        (body(role="router", url="http://e:1"), "'role' must be one of"),
        (body(role="encode"), "'url' is required"),
        (body(role="encode", url="e:8000"), "http:// or https://"),
        (body(role="encode", url="http://e:1?x=1"), "plain base URL"),
        (body(role="encode", url="http://e:1", dp_size=0), "'dp_size'"),
        (body(role="encode", url="http://e:1", dp_size=True), "'dp_size'"),
        (body(role="encode", url="http://e:1", dp_size="2"), "'dp_size'"),
        (body(role="encode", url="http://e:1", ec_zmq_addrs="tcp://x"), "list of address"),
        (body(role="decode", url="http://d:1", ec_zmq_addrs=["tcp://d:1"]), "consumers"),
        (body(role="prefill", url="http://p:1", dp_size=2, ec_zmq_addrs=["tcp://p:1"]),
         "one address per DP rank"),
    ],
)
def test_bad_registrations_are_400(raw: bytes, fragment: str) -> None:
    with pytest.raises(BadRequest, match=fragment) as info:
        parse_registration(raw, 0)
    assert info.value.status == 400


# -- changes ------------------------------------------------------------------------------------
def reg(kind: str, url: str, dp: int = 1, at: float = 0.0) -> Member:
    return Member(Instance(url, dp), kind, registered_at=at)


def test_registration_is_idempotent_and_refreshes_without_a_new_version() -> None:
    roster, created = register(Roster(), reg("encode", "http://e:1", at=1.0), ZERO)
    assert created and roster.version == 1 and roster.of("encode") == (Instance("http://e:1"),)
    again, created = register(roster, reg("encode", "http://e:1", at=31.0), ZERO)
    assert not created and again.version == 1  # a heartbeat: no re-sync of the workers
    assert again.find("http://e:1").registered_at == 31.0
    resized, created = register(again, reg("encode", "http://e:1", dp=2), ZERO)
    assert not created and resized.version == 2  # a real change


def test_role_change_is_409_and_mixing_is_400() -> None:
    roster, _ = register(Roster(), reg("prefill", "http://p:1"), ZERO)
    with pytest.raises(Conflict) as conflict:
        register(roster, reg("decode", "http://p:1"), ZERO)
    assert conflict.value.status == 409 and "already known as prefill" in conflict.value.message
    with pytest.raises(BadRequest, match="cannot mix") as mixed:
        register(roster, reg("prefill_decode", "http://pd:1"), ZERO)
    assert mixed.value.status == 400
    pd_roster, _ = register(Roster(), reg("prefill_decode", "http://pd:1"), ZERO)
    for kind in ("prefill", "decode"):
        with pytest.raises(BadRequest, match="cannot mix"):
            register(pd_roster, reg(kind, "http://x:1"), ZERO)


def test_static_instances_meet_registrations() -> None:
    # Static decodes without static prefill may be either kind: a PD may register beside them.
    roster = static_roster([], [], [Instance("http://d0:1")])
    roster, created = register(roster, reg("prefill_decode", "http://pd:1"), ZERO)
    assert created and roster.of("decode") == (Instance("http://d0:1"), Instance("http://pd:1"))
    # A static instance registering itself is known: not new, still static (and now it said
    # what it is); saying "split decode" beside a combined one would be a mix.
    with pytest.raises(BadRequest, match="cannot mix"):
        register(roster, reg("decode", "http://d0:1"), ZERO)
    roster, created = register(roster, reg("prefill_decode", "http://d0:1", at=9.0), ZERO)
    d0 = roster.find("http://d0:1")
    assert not created and d0.static and d0.role == "prefill_decode" and d0.registered_at == 9.0
    # With a static prefill, its decodes are split-role ones.
    split = static_roster([], [Instance("http://p0:1")], [Instance("http://d0:1")])
    with pytest.raises(BadRequest, match="cannot mix"):
        register(split, reg("prefill_decode", "http://pd:1"), ZERO)
    assert layout_name(split) == "P+D" and layout_name(Roster()) == "none"


def test_unregister_and_epochs_follow_the_counters() -> None:
    roster = static_roster([Instance(f"http://e{i}:1") for i in range(3)], [], [])
    # 7 items went out (counter 7 = e1 next); e1 leaves: e2 is next, at index 1 of [e0, e2].
    smaller, removed = unregister(roster, "http://e1:1", {**ZERO, "encode": 7})
    assert removed and smaller.version == 1 and smaller.epochs["encode"] == (7, 1)
    assert smaller.epochs["decode"] == (0, 0)  # untouched roles keep theirs
    same, removed = unregister(smaller, "http://e1:1", {**ZERO, "encode": 9})
    assert not removed and same is smaller
    assert Roster.from_bytes(smaller.to_bytes()) == smaller


def test_expired_needs_silence_and_eviction_for_the_ttl() -> None:
    roster = static_roster([Instance("http://static:1")], [], [])
    for url, at in (("http://quiet:1", 0.0), ("http://chatty:1", 95.0), ("http://up:1", 0.0)):
        roster, _ = register(roster, reg("encode", url, at=at), ZERO)
    evicted = {"http://static:1": 0.0, "http://quiet:1": 10.0, "http://chatty:1": 10.0}
    # quiet: evicted at 10, silent since 0 -> gone at 100 + 10; chatty registered at 95;
    # up is live (not evicted); static is never forgotten.
    assert expired(roster, evicted, 109.0, 100.0) == []
    assert expired(roster, evicted, 110.0, 100.0) == ["http://quiet:1"]
    assert expired(roster, evicted, 195.0, 100.0) == ["http://quiet:1", "http://chatty:1"]
    smaller = forget(roster, ["http://quiet:1"], ZERO)
    assert [m.url for m in smaller.members] == ["http://static:1", "http://chatty:1",
                                                "http://up:1"]


# -- two registration paths for one URL ---------------------------------------------------------
URL = "http://10.0.0.1:8100"
ZMQ_A = "host:10.0.0.1,handshake:6301,notify:61001"
ZMQ_B = "host:10.0.0.1,handshake:6302,notify:61002"
EC = ("tcp://10.0.0.1:7001",)


def over_http(roster: Roster, at: float, dp: int = 1, ec: tuple[str, ...] = ()) -> Roster:
    """``POST /instances`` as vLLM's registrar sends it (role, url, dp_size, ec_zmq_addrs)."""
    return register(roster, Member(Instance(URL, dp), "prefill", ec_zmq_addrs=ec,
                                   registered_at=at), ZERO)[0]


def over_moriio(roster: Roster, at: float, dp: int = 1, zmq: str = ZMQ_A) -> Roster:
    """A MoRIIO heartbeat (role, http address, dp/tp sizes, ZMQ address, mode)."""
    registration = MoriioRegistration("prefill", Instance(URL, dp), MoriioPeer(zmq, dp, 1), "READ")
    return register_moriio(roster, registration, ZERO, now=at)[0]


PATHS = {"http": over_http, "moriio": over_moriio}


@pytest.mark.parametrize(("steps", "dp", "ec", "zmq", "versions"), [
    # A refresh over HTTP keeps the MoRIIO peer, and one over MoRIIO the EC addresses; neither
    # is a routing change, so no new version (no worker re-sync per heartbeat).
    ([("moriio", {}), ("http", {})], 1, (), ZMQ_A, 1),
    ([("http", {"ec": EC}), ("moriio", {})], 1, EC, ZMQ_A, 2),
    ([("moriio", {}), ("http", {"ec": EC}), ("moriio", {}), ("http", {"ec": EC})],
     1, EC, ZMQ_A, 2),
    # What a path carries, it may change: HTTP its EC addresses (also to none), MoRIIO its
    # peer, either the DP size (both send it).
    ([("http", {"ec": EC}), ("moriio", {}), ("http", {})], 1, (), ZMQ_A, 3),
    ([("http", {"ec": EC}), ("moriio", {}), ("moriio", {"zmq": ZMQ_B})], 1, EC, ZMQ_B, 3),
    ([("moriio", {}), ("http", {"dp": 2, "ec": EC * 2})], 2, EC * 2, ZMQ_A, 2),
])
def test_a_refresh_changes_only_what_its_path_carries(
    steps: list[tuple[str, dict[str, object]]], dp: int, ec: tuple[str, ...], zmq: str,
    versions: int,
) -> None:
    roster = Roster()
    for at, (path, fields) in enumerate(steps, start=1):
        roster = PATHS[path](roster, float(at), **fields)  # type: ignore[operator]
    (member,) = roster.members
    assert (member.instance.dp_size, member.ec_zmq_addrs) == (dp, ec)
    assert member.moriio is not None and member.moriio.zmq_address == zmq
    assert member.registered_at == len(steps)  # the last refresh, whichever path sent it
    assert roster.version == versions and roster.transfer_mode == "READ"


def test_either_path_keeps_a_doubly_registered_instance_from_going_silent() -> None:
    roster = over_http(over_moriio(Roster(), 100.0), 200.0)
    assert silent_moriio(roster, now=205.0, ttl=10.0) == []  # HTTP refreshed it at 200
    assert silent_moriio(roster, now=210.0, ttl=10.0) == [URL]


def test_a_static_instance_stays_static_whichever_path_refreshes_it() -> None:
    roster = static_roster([], [Instance(URL)], [Instance("http://d:1")])
    roster = over_http(over_moriio(roster, 1.0), 2.0, ec=EC)
    member = roster.find(URL)
    assert member is not None and member.static and member.moriio is not None
    assert member.ec_zmq_addrs == EC


def test_a_registration_names_its_kv_event_endpoints_and_they_travel_with_the_roster() -> None:
    body = {"role": "prefill", "url": "http://p0:8000", "dp_size": 2,
            "kv_events_endpoint": "tcp://p0:5557", "kv_events_replay_endpoint": "tcp://p0:5600"}
    member = parse_registration(orjson.dumps(body), 1.0)
    assert member.instance.kv_events == KvEventEndpoints("tcp://p0:5557", "tcp://p0:5600")
    roster, _ = register(Roster(), member, dict.fromkeys(STAGES, 0))
    again = Roster.from_bytes(roster.to_bytes())  # the workers' shared memory
    assert again.members[0].instance.kv_events == member.instance.kv_events
    record = decode_record(encode_record(Record(member)))  # the replicas' shared records
    assert record.member.instance.kv_events == member.instance.kv_events


@pytest.mark.parametrize("fields, named", [
    ({"kv_events_endpoint": "tcp://p0:99999"}, "'kv_events_endpoint'"),
    ({"kv_events_endpoint": 5557}, "'kv_events_endpoint'"),
    ({"kv_events_replay_endpoint": "tcp://p0:5600"}, "needs 'kv_events_endpoint'"),
])
def test_a_bad_kv_event_endpoint_is_a_400_naming_the_field(fields: dict, named: str) -> None:
    body = {"role": "decode", "url": "http://d0:8000", **fields}
    with pytest.raises(BadRequest, match=re.escape(named)):
        parse_registration(orjson.dumps(body), 1.0)


def test_a_static_instances_kv_events_survive_its_own_registration() -> None:
    static = static_roster((), (parse_instance("http://p0:8000#kv_events=tcp://p0:5557"),), ())
    plain = parse_registration(orjson.dumps({"role": "prefill", "url": "http://p0:8000"}), 1.0)
    roster, _ = register(static, plain, dict.fromkeys(STAGES, 0))
    assert roster.members[0].instance.kv_events == KvEventEndpoints("tcp://p0:5557")
