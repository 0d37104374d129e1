"""Each model's pool, derived from the roster (``_models/pools``): who serves what, what a model
needs, and each pool's own rotation across changes."""

from __future__ import annotations

import random
from dataclasses import replace

from epd_trio._core.config import settings_from
from epd_trio._core.roster import Card, Member, Roster, register, static_roster
from epd_trio._core.routing import Instance, slot_keys
from epd_trio._models.pools import (
    ANY_POOL,
    pending,
    pools_of,
    reloaded_adapters,
    set_served,
    unserved_pins,
    with_pool_epochs,
)
from epd_trio._models.tables import parse_tables

E0, E1, E2 = (Instance(f"http://e{i}:1") for i in range(3))
P0, P1 = (Instance(f"http://p{i}:1", 2) for i in range(2))
D0, D1, D2 = (Instance(f"http://d{i}:1") for i in range(3))
ZERO = {"encode": 0, "prefill": 0, "decode": 0}


def cards(*names: str) -> tuple[Card, ...]:
    return tuple(Card(name, root="/m/" + name) for name in names)


def urls(instances: tuple[Instance, ...]) -> list[str]:
    return [i.url for i in instances]


def fleet() -> Roster:
    """Two models: A (E+P+D on e0, e1, p0, d0, d1), B (P+D on p1, d1, d2); d1 serves both."""
    roster = static_roster([E0, E1], [P0, P1], [D0, D1, D2])
    return set_served(roster, {
        E0.url: cards("A"), E1.url: cards("A"), P0.url: cards("A"), P1.url: cards("B"),
        D0.url: cards("A"), D1.url: cards("A", "B"), D2.url: cards("B")})


def test_each_model_gets_the_instances_that_list_it_every_entry_counted() -> None:
    pools = pools_of(fleet(), {})
    assert list(pools) == ["A", "B"]
    a, b = pools["A"], pools["B"]
    assert (urls(a.of("encode")), urls(a.of("prefill")), urls(a.of("decode"))) == (
        ["http://e0:1", "http://e1:1"], ["http://p0:1"], ["http://d0:1", "http://d1:1"])
    assert (urls(b.of("encode")), urls(b.of("prefill")), urls(b.of("decode"))) == (
        [], ["http://p1:1"], ["http://d1:1", "http://d2:1"])  # d1's second name counts
    assert a.needs == {"encode", "prefill", "decode"} and b.needs == {"prefill", "decode"}
    assert a.cards[0] == Card("A", root="/m/A")


def test_an_instance_that_never_answered_serves_nothing_but_its_stage_is_needed() -> None:
    roster = static_roster([E0], [], [D0])
    roster = set_served(roster, {D0.url: cards("A")})  # e0 has not answered
    pools = pools_of(roster, {})
    assert urls(pools["A"].of("encode")) == []
    # Its stage stays needed: media is refused (503 naming encode), not sent unencoded.
    assert pools["A"].needs == {"encode", "decode"}
    assert pending(roster) is None  # one instance answered: unknown names are 404s now
    assert "has said what it serves" in (pending(static_roster([E0], [], [D0])) or "")
    assert "no decode instance" in (pending(Roster()) or "")


def test_a_404_serves_any_name_in_every_pool_and_the_any_pool() -> None:
    roster = set_served(static_roster([], [], [D0, D1]), {D0.url: cards("A"), D1.url: None})
    pools = pools_of(roster, {})
    assert urls(pools["A"].of("decode")) == ["http://d0:1", "http://d1:1"]
    assert urls(pools[ANY_POOL].of("decode")) == ["http://d1:1"]


def test_a_registration_declares_names_until_the_instance_answers() -> None:
    d3 = Instance("http://d3:1")
    member = Member(d3, "decode", registered_at=1.0, models=("C",))
    roster, _ = register(fleet(), member, ZERO)
    assert urls(pools_of(roster, {})["C"].of("decode")) == ["http://d3:1"]
    answered = set_served(roster, {d3.url: cards("B")})  # its own answer wins
    assert "C" not in pools_of(answered, {})


def test_a_table_pins_its_instances_and_an_instance_that_does_not_serve_it_is_left_out() -> None:
    settings = settings_from({}, {"models": {
        "A": {"decode": ["http://d0:1", "http://d1:1"], "prefill": ["http://p0:1#dp=2"]},
        "B": {"decode": ["http://d2:1"]}}})
    tables = parse_tables(settings).pools
    roster = set_served(static_roster([], [P0], [D0, D1, D2]), {
        P0.url: cards("A"), D0.url: cards("A"), D1.url: cards("Z"), D2.url: cards("B", "A")})
    pools = pools_of(roster, tables)
    assert urls(pools["A"].of("decode")) == ["http://d0:1"]  # d1 lists Z, d2 is B's
    assert urls(pools["B"].of("decode")) == ["http://d2:1"]
    # d1 also lists Z, which has no table: what it learned decides.
    assert urls(pools["Z"].of("decode")) == ["http://d1:1"]
    assert unserved_pins(roster, tables) == [("A", "http://d1:1")]
    assert pools["A"].needs == {"prefill", "decode"}


def test_a_pool_continues_its_rotation_when_an_instance_joins_and_other_pools_stay() -> None:
    roster = fleet()
    counters = {(0, "decode"): 7, (1, "decode"): 3}

    def peek(index: int, stage: str) -> int:
        return counters.get((index, stage), 0)

    first = with_pool_epochs(Roster(), roster, {}, peek)
    assert first.models == ("A", "B") and first.version == 1
    a_epoch, b_epoch = first.pool_epochs[("A", "decode")], first.pool_epochs[("B", "decode")]
    # d2 starts serving A too: A's decode pool grows, B's is unchanged.
    grown = set_served(first, {D2.url: cards("B", "A")})
    second = with_pool_epochs(first, grown, {}, peek)
    assert second.version == first.version + 1
    assert second.pool_epochs[("B", "decode")] == b_epoch
    k0, i0 = second.pool_epochs[("A", "decode")]
    assert k0 == 7
    # The slot next at counter 7 before the change is still next after it (d1: 7 % 2 = 1).
    old = slot_keys((D0, D1), True)
    new = slot_keys((D0, D1, D2), True)
    assert new[i0] == old[(a_epoch[1] + 7 - a_epoch[0]) % 2]
    # Nothing new: the same roster back, no version.
    assert with_pool_epochs(second, second, {}, peek) is second


def test_with_an_offset_a_changed_pool_starts_there_and_an_unchanged_one_stays() -> None:
    """Replicas sharing a store (``offset``: the store's random slot) must not start a pool
    that had no instance at slot 0 together, nor continue a grown one in lockstep."""
    counters = {(0, "decode"): 7, (1, "decode"): 3}

    def peek(index: int, stage: str) -> int:
        return counters.get((index, stage), 0)

    first = with_pool_epochs(Roster(), fleet(), {}, peek, offset=lambda slots: slots - 1)
    assert first.pool_epochs[("A", "decode")] == (7, 1)  # d0 and d1: 2 slots
    grown = set_served(first, {D2.url: cards("B", "A")})
    second = with_pool_epochs(first, grown, {}, peek, offset=lambda slots: slots - 1)
    assert second.pool_epochs[("A", "decode")] == (7, 2)  # d2 too: 3 slots
    assert second.pool_epochs[("B", "decode")] == first.pool_epochs[("B", "decode")]
    starts = {with_pool_epochs(Roster(), fleet(), {}, peek,
                               offset=random.Random(seed).randrange).pool_epochs[("A", "decode")]
              for seed in range(8)}
    assert len(starts) > 1  # without the offset, every replica's is (7, 0)
    assert with_pool_epochs(Roster(), fleet(), {}, peek).pool_epochs[("A", "decode")] == (7, 0)


def test_answers_of_instances_that_left_are_dropped_and_model_slots_are_kept() -> None:
    roster = with_pool_epochs(Roster(), fleet(), {}, lambda i, s: 0)
    smaller = replace(roster, members=tuple(m for m in roster.members if m.url != D2.url))
    after = with_pool_epochs(roster, smaller, {}, lambda i, s: 0)
    assert D2.url not in after.served
    assert after.models == ("A", "B")  # B's counters keep their slot


def test_an_adapter_that_appears_goes_or_changes_root_is_a_reload() -> None:
    base = Card("L", root="/m/L")
    before = {"http://d0:1": (base, Card("sql", "/a/sql-v1", "L"), Card("x", "/a/x", "L")),
              "http://d1:1": (base, Card("sql", "/a/sql-v1", "L")), "http://gone:1": (base,)}
    after = {"http://d0:1": (base, Card("sql", "/a/sql-v2", "L"), Card("new", "/a/new", "L")),
             "http://d1:1": (base, Card("sql", "/a/sql-v1", "L")), "http://d2:1": None}
    assert reloaded_adapters(before, after) == [
        ("http://d0:1", "new"), ("http://d0:1", "sql"), ("http://d0:1", "x")]
    assert reloaded_adapters(after, after) == []
