"""One slot's sequence rules, as tables: each call to the feed and the step it answers."""

from __future__ import annotations

import pytest

from epd_trio._kv.feed import Action, Feed, Reset, Step

APPLY = Step(Action.APPLY)
SKIP = Step(Action.SKIP)
FRESH = Step(Action.APPLY, Reset.FRESH)     # seq 0 of an engine process: exact from here
LOST = Step(Action.APPLY, Reset.LOST)       # events gone for good: drop, degraded, then apply
REPLAY = Step(Action.REPLAY)
EMPTY = Step(Action.SKIP, Reset.FRESH)      # the replay holds nothing: the engine published none

SCENARIOS = {
    # name: (has a replay socket, [(call, seq, step)], counters expected at the end)
    "in order from the start": (False, [
        ("received", 0, FRESH), ("received", 1, APPLY), ("received", 2, APPLY),
    ], {}),
    "started late, no replay": (False, [
        ("received", 5, LOST), ("received", 6, APPLY),
    ], {"losses": 1, "gaps": 1}),
    "a gap, no replay": (False, [
        ("received", 0, FRESH), ("received", 1, APPLY), ("received", 3, LOST), ("received", 4, APPLY),
    ], {"gaps": 1, "losses": 1}),
    "a restart from seq 0": (False, [
        ("received", 0, FRESH), ("received", 1, APPLY), ("received", 2, APPLY),
        ("received", 0, FRESH), ("received", 1, APPLY),
    ], {"restarts": 1}),
    "a restart seen late, no replay": (False, [
        ("received", 0, FRESH), ("received", 5, LOST), ("received", 3, LOST), ("received", 4, APPLY),
    ], {"restarts": 1, "gaps": 2, "losses": 2}),
    "late start, the replay holds everything": (True, [
        ("begin", None, 0), ("replayed", 0, FRESH), ("replayed", 1, APPLY), ("replayed", 2, APPLY),
        ("replay_ended", None, SKIP), ("received", 2, SKIP), ("received", 3, APPLY),
    ], {"replays": 1, "duplicates": 1}),
    "start, nothing published yet": (True, [
        ("begin", None, 0), ("replay_ended", None, EMPTY), ("received", 0, FRESH),
    ], {"replays": 1}),
    "late start, the replay's buffer rolled over": (True, [
        ("begin", None, 0), ("replayed", 7, LOST), ("replayed", 8, APPLY), ("replay_ended", None, SKIP),
        ("received", 9, APPLY),
    ], {"losses": 1}),
    "the subscription joined after the empty replay": (True, [
        ("begin", None, 0), ("replay_ended", None, EMPTY), ("received", 2, REPLAY),
        ("replayed", 0, FRESH), ("replayed", 1, APPLY), ("replayed", 2, APPLY),
        ("replay_ended", None, SKIP), ("received", 3, APPLY),
    ], {"replays": 2, "duplicates": 1, "gaps": 1}),
    "a gap the replay fills": (True, [
        ("begin", None, 0), ("replay_ended", None, EMPTY), ("received", 0, FRESH),
        ("received", 1, APPLY), ("received", 4, REPLAY), ("replayed", 2, APPLY),
        ("replayed", 3, APPLY), ("replayed", 4, APPLY), ("replayed", 5, APPLY),
        ("replay_ended", None, SKIP), ("received", 5, SKIP), ("received", 6, APPLY),
    ], {"gaps": 1, "replays": 2, "duplicates": 2, "losses": 0}),
    "a gap the replay cannot fill": (True, [
        ("begin", None, 0), ("replay_ended", None, EMPTY), ("received", 0, FRESH),
        ("received", 5, REPLAY), ("replayed", 3, LOST), ("replayed", 4, APPLY),
        ("replay_ended", None, APPLY), ("received", 6, APPLY),
    ], {"gaps": 1, "losses": 1}),
    "a replay that ends short of the held batch": (True, [
        ("begin", None, 0), ("replay_ended", None, EMPTY), ("received", 0, FRESH),
        ("received", 5, REPLAY), ("replayed", 1, APPLY), ("replay_ended", None, LOST),
    ], {"losses": 1}),
    "a replay that times out": (True, [
        ("begin", None, 0), ("replay_ended", None, EMPTY), ("received", 0, FRESH),
        ("received", 3, REPLAY), ("replayed", 1, APPLY), ("replay_failed", None, LOST),
        ("received", 4, APPLY),
    ], {"replay_failures": 1, "losses": 1}),
    "no engine at the start: the slot stays as it was": (True, [
        ("begin", None, 0), ("replay_failed", None, SKIP), ("received", 0, FRESH),
    ], {"replay_failures": 1, "losses": 0}),
    "a restart seen late, with a replay": (True, [
        ("begin", None, 0), ("replay_ended", None, EMPTY), ("received", 0, FRESH),
        ("received", 1, APPLY), ("received", 2, APPLY),
        ("received", 1, Step(Action.REPLAY, Reset.LOST)),  # our entries are the old process's
        ("replayed", 0, FRESH), ("replayed", 1, APPLY), ("replay_ended", None, SKIP),
        ("received", 2, APPLY),
    ], {"restarts": 1, "replays": 2, "duplicates": 1, "gaps": 1}),
    "a batch that does not decode": (False, [
        ("received", 0, FRESH), ("malformed", None, Step(Action.SKIP, Reset.LOST)),
        ("received", 1, APPLY),
    ], {"losses": 1}),
}


@pytest.mark.parametrize("name", SCENARIOS)
def test_sequence_scenarios(name: str) -> None:
    has_replay, calls, counters = SCENARIOS[name]
    feed = Feed(has_replay=has_replay)
    for number, (call, seq, expected) in enumerate(calls):
        method = getattr(feed, call)
        answer = method() if seq is None else method(seq)
        assert answer == expected, f"call {number}: {call}({seq})"
    for counter, value in counters.items():
        assert getattr(feed, counter) == value, counter
    assert not feed.replaying


def test_replay_from_names_the_first_missing_seq() -> None:
    feed = Feed(has_replay=True)
    assert feed.begin() == 0
    feed.replay_ended()
    feed.received(0)
    feed.received(1)
    assert feed.received(5) == REPLAY
    assert feed.replaying and feed.replay_from == 2


def test_without_a_replay_socket_begin_asks_for_nothing() -> None:
    assert Feed(has_replay=False).begin() is None


def test_calls_out_of_order_are_bugs_not_steps() -> None:
    feed = Feed(has_replay=True)
    with pytest.raises(RuntimeError):
        feed.replayed(0)
    feed.begin()
    with pytest.raises(RuntimeError):
        feed.received(0)
