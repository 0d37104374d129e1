"""One slot's sequence numbers: what to do with each batch an engine publishes (sans-I/O).

vLLM numbers its batches 0, 1, 2... per engine process (``ZmqEventPublisher``: ``count()``), sends
them on PUB, where a slow subscriber loses messages silently, and keeps the last 10,000 in a
buffer its replay socket serves. ``Feed`` is told each sequence number as it arrives and answers
with a ``Step``: what to do with the batch (apply it, skip it, or hold it while the replay socket
fills a gap) and whether the slot's index entries must be reset first:

    FRESH  the batch is seq 0 of an engine process (directly or from the replay): every later
           event will be seen, so the slot starts from nothing and is exact (also an engine
           restart, seen as the sequence going back: its cache is empty now)
    LOST   events are missing that nothing will bring back (started late with no replay, the
           replay's first seq is past the missing one, a malformed batch): the slot's entries
           may be wrong, so they are dropped and the slot is degraded until rebuilt

A gap with a replay socket: the batch is held and ``replay_from`` is the first seq to ask for;
each replayed seq goes to ``replayed()``; then ``replay_ended()`` (or ``replay_failed()`` on a
timeout) says what to do with the held batch. While replaying, the caller does not read live
messages (ZMQ queues them), so the live ones read afterwards that the replay already applied are
recognised as duplicates: their seq is above every live seq seen before, but below ``expected``.
A live seq at or below one already seen live cannot come from the same process (PUB never
resends), so it is a restart. Not seen: a restart whose new numbers overtake the old ones before
its first message arrives (the roster's health checks drop a slot that went away).

Start: with a replay socket, ``begin()`` asks for everything from seq 0 (the subscriber may start
after the engine). An empty replay means the engine has published nothing: exact and empty. A
failed replay before anything arrived leaves the slot as it was (an absent engine is not a
lost one); the next live batch decides.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Action(enum.Enum):
    APPLY = "apply"    # decode the batch and apply it to the index
    SKIP = "skip"      # already applied (a duplicate), or nothing to apply
    REPLAY = "replay"  # hold the batch; ask the replay socket for seq >= Feed.replay_from


class Reset(enum.Enum):
    NONE = "none"
    FRESH = "fresh"    # drop the slot's entries; it is exact from here (history seen from seq 0)
    LOST = "lost"      # drop the slot's entries; it is degraded (events lost for good)


@dataclass(frozen=True, slots=True)
class Step:
    """What the caller does with one batch: first the reset, then the action."""

    action: Action
    reset: Reset = Reset.NONE


APPLY = Step(Action.APPLY)
SKIP = Step(Action.SKIP)


class Feed:
    """The sequence state of one slot's subscription. Counters are public for the stats."""

    def __init__(self, *, has_replay: bool) -> None:
        self.has_replay = has_replay
        #: The next seq to apply; None: nothing applied from this engine process yet.
        self.expected: int | None = None
        #: The highest seq received live (a live seq at or below it means a restart).
        self.live_high: int | None = None
        #: Set while a replay is in progress: the first seq asked for.
        self.replay_from: int | None = None
        self._held: int | None = None
        self.gaps = 0
        self.replays = 0
        self.replay_failures = 0
        self.restarts = 0
        self.duplicates = 0
        self.losses = 0

    @property
    def replaying(self) -> bool:
        return self.replay_from is not None

    def begin(self) -> int | None:
        """Start: the seq to ask the replay socket for first (0: all it holds), or None."""
        if not self.has_replay:
            return None
        self._start_replay(0, held=None)
        return 0

    def received(self, seq: int) -> Step:
        """A batch read live from the PUB socket."""
        if self.replaying:
            raise RuntimeError("live batches are not read during a replay")
        restarted = self.live_high is not None and seq <= self.live_high
        self.live_high = seq
        if restarted:
            self.restarts += 1
            self.expected = None
            return self._first(seq, restart=True)
        if self.expected is None:
            return self._first(seq, restart=False)
        if seq == self.expected:
            self.expected = seq + 1
            return APPLY
        if seq < self.expected:
            self.duplicates += 1
            return SKIP
        self.gaps += 1
        if self.has_replay:
            self._start_replay(self.expected, held=seq)
            return Step(Action.REPLAY)
        return self._lost(seq, Action.APPLY)

    def replayed(self, seq: int) -> Step:
        """A batch from the replay socket (in order, oldest first)."""
        if not self.replaying:
            raise RuntimeError("no replay in progress")
        if self.expected is None:
            if seq == 0:
                self.expected = 1
                return Step(Action.APPLY, Reset.FRESH)
            return self._lost(seq, Action.APPLY)  # the buffer no longer holds seq 0
        if seq < self.expected:
            self.duplicates += 1
            return SKIP
        if seq == self.expected:
            self.expected = seq + 1
            return APPLY
        return self._lost(seq, Action.APPLY)  # the buffer starts past the missing batch

    def replay_ended(self) -> Step:
        """The end marker came: what to do with the held batch (if any)."""
        held = self._end_replay()
        if held is None:
            if self.expected is None:  # nothing was ever published: exact, and empty
                return Step(Action.SKIP, Reset.FRESH)
            return SKIP
        if self.expected is None or held > self.expected:
            return self._lost(held, Action.APPLY)
        if held < self.expected:
            self.duplicates += 1
            return SKIP
        self.expected = held + 1
        return APPLY

    def replay_failed(self) -> Step:
        """The replay timed out (or its socket failed): what to do with the held batch."""
        self.replay_failures += 1
        held = self._end_replay()
        if held is None:
            return SKIP  # nothing received yet: the slot stays as it was
        return self._lost(held, Action.APPLY)

    def malformed(self) -> Step:
        """The batch the last step said to apply could not be decoded: its events are lost (a
        replay would send the same bytes)."""
        self.losses += 1
        return Step(Action.SKIP, Reset.LOST)

    def _first(self, seq: int, *, restart: bool) -> Step:
        if seq == 0:
            self.expected = 1
            return Step(Action.APPLY, Reset.FRESH)
        self.gaps += 1  # seq 0 .. seq - 1 were missed
        if self.has_replay:
            self._start_replay(0, held=seq)
            # After a restart our entries describe the old process: drop them now, not after
            # the replay; a replay that reaches seq 0 makes the slot exact again.
            return Step(Action.REPLAY, Reset.LOST if restart else Reset.NONE)
        return self._lost(seq, Action.APPLY)

    def _lost(self, seq: int, action: Action) -> Step:
        self.losses += 1
        self.expected = seq + 1
        return Step(action, Reset.LOST)

    def _start_replay(self, start: int, *, held: int | None) -> None:
        self.replays += 1
        self.replay_from = start
        self._held = held

    def _end_replay(self) -> int | None:
        held, self._held, self.replay_from = self._held, None, None
        return held
