"""An alias's target (``_models/choice``): exact weighted turns, and the sticky weighted hash."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from epd_trio._models.choice import WeightedTurns, sticky_choice


def test_turns_give_each_target_exactly_its_share_interleaved() -> None:
    turns = WeightedTurns([90, 10])
    picks = [turns.next() for _ in range(1000)]
    assert Counter(picks) == {0: 900, 1: 100}
    # Interleaved, not in runs: the canary's turns are spread over every 10 requests.
    assert all(picks[k:k + 10].count(1) == 1 for k in range(0, 1000, 10))


def test_turns_skip_a_target_that_cannot_serve_and_share_among_the_rest() -> None:
    turns = WeightedTurns([2, 1, 1])
    picks = [turns.next([True, False, True]) for _ in range(300)]
    assert Counter(picks) == {0: 200, 2: 100}
    assert turns.next([False, False, False]) is None
    with pytest.raises(ValueError):
        WeightedTurns([1, 0])


def test_a_session_key_always_gets_the_same_target() -> None:
    names, weights = ("v1", "v2"), (90.0, 10.0)
    for key in ("alice", "bob", "carol", ""):
        first = sticky_choice(key, names, weights)
        assert all(sticky_choice(key, names, weights) == first for _ in range(20))


def test_sticky_shares_follow_the_weights() -> None:
    names, weights = ("v1", "v2", "v3"), (60.0, 30.0, 10.0)
    picks = Counter(sticky_choice(f"session-{i}", names, weights) for i in range(20_000))
    for index, weight in enumerate(weights):
        assert abs(picks[index] / 20_000 - weight / 100) < 0.015, picks


def test_raising_a_weight_moves_keys_only_to_that_target_and_only_its_share() -> None:
    """Rendezvous hashing: going from 90/10 to 80/20 moves keys from v1 to v2, never the
    other way, and about 10 % of them (what the new share needs)."""
    keys = [f"k{i}" for i in range(20_000)]
    before = [sticky_choice(k, ("v1", "v2"), (90.0, 10.0)) for k in keys]
    after = [sticky_choice(k, ("v1", "v2"), (80.0, 20.0)) for k in keys]
    moves = Counter((a, b) for a, b in zip(before, after, strict=True) if a != b)
    assert set(moves) == {(0, 1)}
    assert abs(moves[(0, 1)] / len(keys) - 0.10) < 0.01


def test_a_target_that_cannot_serve_loses_only_its_own_keys_which_come_back() -> None:
    names, weights = ("a", "b", "c"), (1.0, 1.0, 1.0)
    keys = [f"user{i}" for i in range(3000)]
    normal = [sticky_choice(k, names, weights) for k in keys]
    without_b = [sticky_choice(k, names, weights, [True, False, True]) for k in keys]
    for was, now in zip(normal, without_b, strict=True):
        assert now != 1
        if was != 1:
            assert now == was  # the others' sessions do not move
    assert [sticky_choice(k, names, weights) for k in keys] == normal
    assert sticky_choice("x", names, weights, [False] * 3) is None


@pytest.mark.parametrize("weights", list(itertools.permutations([5.0, 3.0, 2.0])))
def test_turns_are_exact_over_a_cycle_whatever_the_order(weights: tuple[float, ...]) -> None:
    turns = WeightedTurns(weights)
    assert Counter(turns.next() for _ in range(10)) == {i: int(w) for i, w in enumerate(weights)}
