"""The routing policies' selection logic (pure), and the cursors that apply it per stage."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from epd_trio import ConfigError, EncoderCursor, Instance, SlotCursor, settings_from
from epd_trio._core.failover import fallback_steps, next_slot
from epd_trio._core.policies import (
    ENCODE_POLICIES,
    OWNERS_PER_KEY,
    POLICIES,
    PREFIX_BLOCK_CHARS,
    PREFIX_MAX_BLOCKS,
    AffinityIndex,
    Balance,
    CachedPrefix,
    PrefixIndex,
    SlotKey,
    StagePolicy,
    least_loaded,
    longest_held,
    power_of_two,
    prefix_hint,
    prompt_text,
    rotation,
)
from epd_trio._state.loads import Loads

A, B, C, D = (("http://a:1", None), ("http://b:1", None), ("http://c:1", None),
              ("http://d:1", None))


@pytest.mark.parametrize("loads, expected", [
    ([0], 0), ([3, 1, 2], 1), ([1, 1, 1], 0), ([2, 0, 0, 1], 1), ([5, 4, 4], 1),
])
def test_least_loaded_takes_the_first_minimum_in_rotation_order(
        loads: list[int], expected: int) -> None:
    assert least_loaded(loads) == expected


def test_sizes_break_only_the_ties_of_the_smallest_load() -> None:
    assert least_loaded([1, 0, 0, 0], [0, 9, 4, 4]) == 2  # among the zeros, the smallest size
    assert least_loaded([0, 1, 0], [5, 0, 5]) == 0        # equal sizes: the rotation's first
    assert least_loaded([2, 1, 3], [0, 9, 0]) == 1        # no tie: the size is not weighed
    reads: list[int] = []

    def sizes() -> list[int]:
        reads.append(1)
        return [3, 3, 1]

    assert least_loaded([4, 2, 7], sizes) == 1 and reads == []  # no tie: sizes never read
    assert least_loaded([2, 2, 2], sizes) == 2 and reads == [1]


def test_a_cursor_reads_the_sizes_of_its_candidates_in_rotation_order() -> None:
    instances = [Instance("http://a:1", 2), Instance("http://b:1", 2)]
    sizes = {("http://a:1", 0): 8, ("http://b:1", 0): 8, ("http://a:1", 1): 1,
             ("http://b:1", 1): 8}
    asked: list[list[SlotKey]] = []

    def read_sizes(keys: list[SlotKey]) -> list[int]:
        asked.append(list(keys))
        return [sizes[key] for key in keys]

    cursor = SlotCursor(instances, policy=StagePolicy("least_loaded"),
                        loads=lambda keys: [0] * len(keys), sizes=read_sizes)
    assert cursor.next() == (instances[0], 1)  # all idle: the least work in flight wins
    assert asked == [[("http://a:1", 0), ("http://b:1", 0), ("http://a:1", 1),
                      ("http://b:1", 1)]]
    cursor.next()
    assert asked[1][0] == ("http://b:1", 0)  # the next decision's rotation starts one on


def test_rotation_starts_at_the_cursor() -> None:
    assert rotation(4, 0) == [0, 1, 2, 3]
    assert rotation(4, 6) == [2, 3, 0, 1]


def test_power_of_two_compares_the_rotations_slot_with_a_random_other() -> None:
    rng = random.Random(7)
    # The idle slot wins whenever it is drawn as the other candidate: half the time of 2 others.
    wins = Counter(power_of_two([5, 5, 0], rng) for _ in range(3000))
    assert set(wins) == {0, 2}  # slot 1 would need to beat slot 0: a tie goes to the rotation
    assert 1300 < wins[2] < 1700
    assert power_of_two([9], rng) == 0
    assert Counter(power_of_two([1, 1, 1], rng) for _ in range(100)) == {0: 100}
    assert power_of_two([3, 2], rng) == 1


def test_balance_needs_both_the_absolute_and_the_relative_gap() -> None:
    balance = Balance(abs_threshold=8, rel_threshold=1.5)
    assert not balance.overloaded(1, 0)        # infinitely relative, but tiny
    assert not balance.overloaded(8, 0)        # exactly at the absolute margin
    assert balance.overloaded(9, 0)
    assert not balance.overloaded(100, 90)     # large gap, small ratio
    assert balance.overloaded(100, 60)


def test_the_affinity_index_is_bounded_lru() -> None:
    index = AffinityIndex(capacity=3)
    for key in "wxyz":
        index.record(key, A)
    assert len(index) == 3 and index.peek("w") == ()
    index.owners("x")  # touched: now y goes first
    index.record("v", B)
    assert index.peek("y") == () and index.peek("x") == (A,)
    for slot in (B, C, D, A, ("http://e:1", None)):
        index.record("x", slot)
    owners = index.peek("x")
    assert len(owners) == OWNERS_PER_KEY and owners[0] == ("http://e:1", None)
    with pytest.raises(ValueError):
        AffinityIndex(0)


def test_prefix_hints_share_blocks_exactly_as_far_as_the_prompts_agree() -> None:
    shared = "s" * (3 * PREFIX_BLOCK_CHARS)
    one, two = prefix_hint(shared + "x" * 10), prefix_hint(shared + "y" * 10)
    assert one.blocks[:3] == two.blocks[:3] and one.blocks[3] != two.blocks[3]
    assert one.chars == 3 * PREFIX_BLOCK_CHARS + 10
    long = prefix_hint("z" * (10 * PREFIX_BLOCK_CHARS * PREFIX_MAX_BLOCKS))
    assert len(long.blocks) == PREFIX_MAX_BLOCKS  # bounded work per request
    assert prefix_hint("").blocks == ()


def test_prompt_text_reads_roles_text_and_media_uuids() -> None:
    chat = {"messages": [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": [
                             {"type": "text", "text": "look"},
                             {"type": "image_url", "image_url": {"url": "x"}, "uuid": "u1"}]}]}
    text = prompt_text(chat)
    assert "be brief" in text and "look" in text and "u1" in text
    assert prompt_text({"messages": [{"role": "user", "content": "hi"}]}) != prompt_text(
        {"messages": [{"role": "system", "content": "hi"}]})
    assert prompt_text({"prompt": "once upon"}) == "once upon"
    assert prompt_text({"prompt": [1, 2, 3]}) == "[1, 2, 3]"


def test_the_prefix_index_finds_the_deepest_candidate_owner() -> None:
    index = PrefixIndex(capacity=1000)
    base = "p" * (4 * PREFIX_BLOCK_CHARS)
    index.record(prefix_hint(base[: 2 * PREFIX_BLOCK_CHARS]), A)
    index.record(prefix_hint(base), B)
    hint = prefix_hint(base + "question")
    assert index.match(hint, {A, B}) == ((B,), 4 * PREFIX_BLOCK_CHARS)  # deepest: B only
    # B left the rotation: A still holds the first two blocks.
    assert index.match(hint, {A, C}) == ((A,), 2 * PREFIX_BLOCK_CHARS)
    assert index.match(hint, {C}) == ((), 0)
    assert index.match(prefix_hint("other"), {A, B}) == ((), 0)


def _prefix_policy(**kwargs: object) -> StagePolicy:
    return StagePolicy("cache_aware", Balance(4, 1.5), **kwargs)  # type: ignore[arg-type]


def test_cache_aware_keeps_a_prefix_on_its_slot_until_it_is_overloaded() -> None:
    policy = _prefix_policy()
    keys = [A, B, C]
    system = "You are a helpful assistant. " * 20
    first = policy.choose(keys, [0, 0, 0], prefix_hint(system + "q1"))
    assert first == 0  # a miss: least loaded, rotation first
    # Later requests with the prefix follow it, whatever the rotation says...
    rotated = [B, C, A]
    assert rotated[policy.choose(rotated, [0, 0, 0], prefix_hint(system + "q2"))] == A
    assert rotated[policy.choose(rotated, [2, 1, 4], prefix_hint(system + "q3"))] == A
    # ... until A is more than 4 requests and 1.5x above the least loaded candidate.
    assert rotated[policy.choose(rotated, [1, 2, 6], prefix_hint(system + "q4"))] == B
    # Diverted, B now holds it too: the least loaded of the two owners gets the next one.
    assert rotated[policy.choose(rotated, [3, 0, 2], prefix_hint(system + "q5"))] == A
    # A prompt that matches too little of a known one is a miss (threshold 0.3).
    short = system[:PREFIX_BLOCK_CHARS] + "x" * (4 * PREFIX_BLOCK_CHARS)
    assert policy.choose(keys, [1, 0, 1], prefix_hint(short)) == 1


def test_cache_aware_ignores_slots_that_are_not_candidates() -> None:
    policy = _prefix_policy()
    hint = prefix_hint("shared prefix " * 40)
    assert policy.choose([A, B], [0, 0], hint) == 0
    # A is evicted (or already tried): the prefix is a miss among the rest, not an error.
    assert policy.choose([B, C], [3, 1], hint) == 1
    assert policy.choose([B, C], [0, 5], hint) == 0  # A, then C, recorded: C is busy, B not


def test_cache_aware_encode_affinity_by_uuid_within_the_load_cap() -> None:
    policy = StagePolicy("cache_aware", Balance(2, 1.5))
    assert policy.choose([A, B], [0, 0], "img-1") == 0
    assert policy.choose([B, A], [0, 2], "img-1") == 1  # A: +2 is within the cap
    assert policy.choose([B, A], [0, 3], "img-1") == 0  # A: +3 and 3 > 1.5 x 0: overloaded
    assert policy.choose([B, A], [1, 1], None) == 0     # no hint: least loaded


def test_the_cache_stays_bounded_under_unique_traffic() -> None:
    policy = StagePolicy("cache_aware", cache_size=50)
    for i in range(500):
        policy.choose([A, B], [i % 2, 0], prefix_hint(f"unique prompt number {i} " * 10))
        policy.choose([A, B], [0, 0], f"uuid-{i}")
    assert len(policy._prefixes or ()) <= 50 and len(policy._media or ()) <= 50


def test_unknown_policies_are_refused() -> None:
    with pytest.raises(ValueError, match="round_robin, least_loaded"):
        StagePolicy("random")


# -- the cursors with a policy ---------------------------------------------------------------


def _slot_cursor(policy: str, instances: list[Instance]) -> tuple[SlotCursor, Loads]:
    loads = Loads()
    cursor = SlotCursor(instances, policy=StagePolicy(policy, rng=random.Random(1)),
                        loads=lambda keys: loads.read("decode", keys))
    return cursor, loads


@pytest.mark.parametrize("policy", ["least_loaded", "power_of_two", "cache_aware"])
def test_under_uniform_load_every_policy_is_round_robin(policy: str) -> None:
    instances = [Instance("http://a:1", 2), Instance("http://b:1", 2)]
    plain = SlotCursor(instances)
    cursor, _ = _slot_cursor(policy, instances)
    assert [cursor.next() for _ in range(8)] == [plain.next() for _ in range(8)]
    # After a roster change too (the rotations a policy reads are rebuilt, not reused).
    changed = [Instance("http://c:1"), instances[1], Instance("http://d:1", 3)]
    plain.update(changed)
    cursor.update(changed)
    assert [cursor.next() for _ in range(10)] == [plain.next() for _ in range(10)]


def test_least_loaded_avoids_the_busy_slot_and_releasing_brings_it_back() -> None:
    instances = [Instance("http://a:1"), Instance("http://b:1"), Instance("http://c:1")]
    cursor, loads = _slot_cursor("least_loaded", instances)
    release = loads.take("decode", ("http://a:1", None), 5)
    picked = [cursor.next()[0].url for _ in range(4)]
    assert "http://a:1" not in picked
    release()
    release()  # idempotent
    assert loads.read("decode", [("http://a:1", None)]) == [0]
    # The rotation went on meanwhile: a is next in rotation order again.
    assert Counter(cursor.next()[0].url for _ in range(3)) == {
        "http://a:1": 1, "http://b:1": 1, "http://c:1": 1}


def test_least_loaded_follows_instances_joining_and_leaving() -> None:
    a, b, c = (Instance(f"http://{n}:1") for n in "abc")
    cursor, loads = _slot_cursor("least_loaded", [a, b])
    for url in ("http://a:1", "http://b:1"):
        loads.take("decode", (url, None), 3)
    cursor.update([a, b, c])  # c joins idle: it takes the traffic until it catches up
    picked = []
    for _ in range(3):
        instance, rank = cursor.next()
        loads.take("decode", (instance.url, rank))
        picked.append(instance.url)
    assert picked == ["http://c:1"] * 3
    cursor.update([a])  # b and c leave
    assert {cursor.next()[0].url for _ in range(3)} == {"http://a:1"}


def test_least_loaded_with_every_slot_evicted_raises_like_round_robin() -> None:
    cursor, _ = _slot_cursor("least_loaded", [Instance("http://a:1"), Instance("http://b:1")])
    with pytest.raises(LookupError):
        cursor.next(lambda instance: False)


async def test_an_encoder_cursor_spreads_one_requests_items_by_load() -> None:
    encoders = [Instance(f"http://e{i}:1") for i in range(3)]
    loads = Loads()
    cursor = EncoderCursor(encoders, policy=StagePolicy("least_loaded"),
                           loads=lambda keys: loads.read("encode", keys))
    loads.take("encode", ("http://e0:1", None), 2)
    got = [e.url for e in await cursor.assign(4)]
    # e0 starts 2 items ahead: the other two take items until they catch up, then rotation.
    assert Counter(got) == {"http://e1:1": 2, "http://e2:1": 2}
    loads.take("encode", ("http://e1:1", None), 2)
    loads.take("encode", ("http://e2:1", None), 2)
    assert len({e.url for e in await cursor.assign(3)}) == 3  # level again: round-robin


async def test_encode_cache_aware_sends_a_known_uuid_back_to_its_encoder() -> None:
    encoders = [Instance(f"http://e{i}:1") for i in range(3)]
    cursor = EncoderCursor(encoders, policy=StagePolicy("cache_aware"))
    first = await cursor.assign(2, uuids=["u1", "u2"])
    assert first[0] != first[1]
    for _ in range(5):
        assert await cursor.assign(2, uuids=["u1", "u2"]) == first
    # An encoder out of rotation: its items go elsewhere, the other's stay.
    moved = await cursor.assign(2, lambda e: e != first[0], uuids=["u1", "u2"])
    assert moved[1] == first[1] and moved[0] != first[0]


# -- failover follows the policy -------------------------------------------------------------


async def test_failover_steps_choose_by_policy_within_each_step() -> None:
    a, b, c = (Instance(f"http://{n}:1") for n in "abc")
    cursor, loads = _slot_cursor("least_loaded", [a, b, c])
    loads.take("decode", ("http://b:1", None), 9)

    async def choose(allowed: object, exclude: object) -> tuple[Instance, int | None]:
        return cursor.next(allowed, exclude)  # type: ignore[arg-type]

    tried = {(a, None)}
    # Untried usable instances first; among them the least loaded (c), not the rotation's b.
    assert await next_slot(choose, tried, lambda inst: True) == (c, None)
    # Only out-of-rotation instances left untried: the least loaded of those.
    assert await next_slot(choose, tried, lambda inst: inst == a) == (c, None)
    assert await next_slot(choose, {(a, None), (b, None), (c, None)}, lambda inst: True) is None


def test_fallback_steps_are_the_documented_order() -> None:
    a = Instance("http://a:1", 2)
    usable = lambda inst: True  # noqa: E731
    assert len(fallback_steps((), usable, other_ranks=True, slot_count=2)) == 2
    steps = fallback_steps({(a, 0)}, usable, other_ranks=True, slot_count=1)
    assert len(steps) == 4
    first, _ = steps[0]
    assert first is not None and not first(a)  # the tried instance is not "untried"
    assert steps[2] == (usable, {(a, 0)}) and steps[3] == (None, ())


def test_slot_keys_of_two_ranks_differ() -> None:
    loads = Loads()
    key0: SlotKey = ("http://a:1", 0)
    loads.take("prefill", key0, 2)
    assert loads.read("prefill", [key0, ("http://a:1", 1)]) == [2, 0]
    assert loads.read("decode", [key0]) == [0]  # per stage


def test_the_affinity_index_counts_what_each_slot_holds() -> None:
    index = AffinityIndex(capacity=3)
    index.record("k1", A)
    index.record("k1", A)  # the same owner again: no double count
    index.record("k2", B)
    index.record("k2", A)
    assert index.held == {A: 2, B: 1}
    for key in ("k3", "k4"):  # k1 then k2 age out with their owners
        index.record(key, C)
    assert index.held == {A: 1, B: 1, C: 2}
    index.record("k5", C)
    assert index.held == {C: 3}
    for slot in (A, B, D, ("http://e:1", None)):  # a fifth owner pushes the oldest (C) out
        index.record("k5", slot)
    assert index.held[C] == 2 and len(index.peek("k5")) == OWNERS_PER_KEY


def test_cache_aware_sends_new_prefixes_to_the_slot_holding_the_least() -> None:
    policy = _prefix_policy()
    keys = [A, B]
    for n in range(3):  # A holds three prefixes (B was busy then)
        assert policy.choose(keys, [0, 5], prefix_hint(f"prefix {n} " * 40)) == 0
    # A miss with equal loads: B (holding nothing), though A is first in rotation.
    assert policy.choose(keys, [0, 0], prefix_hint("a new prefix " * 40)) == 1
    assert policy.choose(keys, [0, 1], prefix_hint("another one " * 40)) == 0  # load first


def test_cache_aware_finds_its_slot_from_every_rotation_and_after_a_roster_change() -> None:
    a, b, c = (Instance(f"http://{n}:1", 2) for n in "abc")
    cursor, _ = _slot_cursor("cache_aware", [a, b, c])
    hint = prefix_hint("a long shared system prompt " * 40)
    home = cursor.next(hint=hint)
    # Six slots: each decision starts the rotation elsewhere, and the index it finds the
    # preferred slot at (cached per rotation) must be right from each of them.
    assert [cursor.next(hint=hint) for _ in range(12)] == [home] * 12
    others = [inst for inst in (a, b, c) if inst != home[0]]
    cursor.update(others)  # the home instance leaves: its rotations' positions are stale
    moved = cursor.next(hint=hint)
    assert moved[0] in others
    assert [cursor.next(hint=hint) for _ in range(8)] == [moved] * 8


# -- placement across replicas (EPD_STATE_URL) ------------------------------------------------------
def test_rendezvous_ignores_order_and_moves_only_what_a_departed_slot_won() -> None:
    from epd_trio._core.policies import rendezvous, stable_hash
    marks = [stable_hash(f"slot{i}") for i in range(6)]
    anchors = [stable_hash(f"prompt {n}") for n in range(300)]
    winners = [marks[rendezvous(marks, a)] for a in anchors]
    assert [marks[::-1][rendezvous(marks[::-1], a)] for a in anchors] == winners
    assert len(set(winners)) == 6  # every slot wins some
    fewer = marks[:5]
    for anchor, winner in zip(anchors, winners, strict=True):
        if winner in fewer:  # a key whose slot stayed does not move
            assert fewer[rendezvous(fewer, anchor)] == winner


def test_replicas_place_an_unseen_prompt_alike_and_within_the_balance() -> None:
    from epd_trio._core.policies import Balance, StagePolicy, prefix_hint
    keys = [("http://a", 0), ("http://a", 1), ("http://b", 0), ("http://b", 1)]
    for n in range(20):
        hint = prefix_hint(f"system prompt {n} " * 60)
        one, two = StagePolicy("cache_aware", placement=True), StagePolicy("cache_aware",
                                                                             placement=True)
        first = keys[one.choose(keys, [0, 0, 0, 0], hint)]
        order = keys[n % 4:] + keys[:n % 4]  # another replica's rotation
        assert order[two.choose(order, [0, 0, 0, 0], hint)] == first
        # The same prompt's winner, overloaded beyond the balance, gives way to the least loaded.
        three = StagePolicy("cache_aware", Balance(2, 1.5), placement=True)
        loads = [9 if key == first else 0 for key in keys]
        assert keys[three.choose(keys, loads, hint)] != first


A, B, C = ("http://a", None), ("http://b", None), ("http://c", 1)


@pytest.mark.parametrize(
    "held, loads, expected",
    [
        ({B: 64}, [0, 0, 0], 1),                 # the one slot holding anything
        ({A: 32, C: 96}, [0, 0, 0], 2),          # the longest prefix, not the first holder
        ({A: 64, B: 64}, [3, 1, 0], 1),          # equal prefixes: the less loaded holder
        ({A: 64, B: 64}, [1, 1, 0], 0),          # ... then rotation order
        ({}, [2, 1, 0], -1),                     # a miss
        ({A: 96}, [20, 0, 4], -1),               # overloaded (by > 8 and > 1.5x): gives way
        ({A: 96}, [8, 0, 4], 0),                 # within the absolute margin: kept
    ],
)
def test_longest_held_prefers_the_longest_prefix_within_the_balance(
    held: dict, loads: list[int], expected: int
) -> None:
    cached = CachedPrefix(prompt_tokens=128, held=held)
    assert longest_held([A, B, C], loads, cached, Balance(8, 1.5)) == expected


def test_precise_cache_aware_routes_on_what_the_engines_hold_else_like_cache_aware() -> None:
    policy = StagePolicy("precise_cache_aware")
    # held wins over rotation order; a miss goes to the least loaded slot
    assert policy.choose([A, B, C], [0, 0, 0], CachedPrefix(128, {C: 32})) == 2
    assert policy.choose([A, B, C], [2, 0, 1], CachedPrefix(128, {})) == 1
    # without tokens (render failed) it is cache_aware: a prompt seen before goes back
    hint = prefix_hint("x" * 2000)
    first = policy.choose([A, B, C], [0, 0, 0], hint)
    assert policy.choose([A, B, C], [0, 0, 0], hint) == first
    assert CachedPrefix(128, {A: 96}).uncached(A) == 32
    assert CachedPrefix(128, {A: 96}).uncached(B) == 128


def test_an_engine_reuses_no_block_holding_the_prompts_last_token() -> None:
    # vLLM computes the last token for its logits: 4 cached blocks of a 128-token prompt give
    # 3 reused, so the bypass sees 32 tokens to compute; a 129-token prompt reuses all 4.
    exact = CachedPrefix.reusable(128, {A: 128, B: 96, C: 0}, 32)
    assert exact.held == {A: 96, B: 96} and exact.uncached(A) == 32
    assert CachedPrefix.reusable(129, {A: 128}, 32).held == {A: 128}
    assert CachedPrefix.reusable(32, {A: 32}, 32).held == {}
    assert CachedPrefix.reusable(0, {}, 32).held == {}


def test_the_encode_stage_takes_no_precise_policy() -> None:
    assert "precise_cache_aware" in POLICIES and "precise_cache_aware" not in ENCODE_POLICIES
    with pytest.raises(ConfigError, match="EPD_ENCODE_POLICY"):
        settings_from({"EPD_DECODE_URLS": "http://d:1", "EPD_ENCODE_POLICY": "precise_cache_aware"})
