"""Subscriptions against real ZMQ sockets on 127.0.0.1: the fake vLLM's KV event publisher
(``epd_trio.testing.kv_publisher``) driven by the test.

Every wait is on a condition (``KvEvents.wait_until``, ``wait_subscribed``) under a deadline;
nothing sleeps to synchronise.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import trio
from kv_helpers import BLOCK, prompt, stored

from epd_trio._kv.index import KvIndex, Trust
from epd_trio._kv.keys import request_keys
from epd_trio._kv.subscriber import KvEvents, SlotReport, SlotSource
from epd_trio._kv.wire import AllBlocksCleared, BlockRemoved
from epd_trio.testing.kv_publisher import KVEventPublisher
from epd_trio.testing.ports import free_port

SLOT = ("http://prefill:8000", 0)
DEADLINE = 10.0


@dataclass
class Engine:
    """One fake engine's publisher and the source a subscription follows."""

    publisher: KVEventPublisher
    source: SlotSource


@dataclass
class Follower:
    events: KvEvents
    nursery: trio.Nursery

    async def until(self, predicate: Callable[[dict[Any, SlotReport]], bool]) -> dict[Any, SlotReport]:
        """Wait until ``predicate(stats)`` holds; the stats then."""
        with trio.fail_after(DEADLINE):
            await self.events.wait_until(lambda: predicate(self.events.stats()))
        return self.events.stats()

    async def follow(self, *engines: Engine) -> None:
        """Follow these engines and wait until each is subscribed and its slot known."""
        subscribed = [engine.publisher.subscriptions() for engine in engines]
        await self.events.reconcile([engine.source for engine in engines])
        with trio.fail_after(DEADLINE):
            for engine, before in zip(engines, subscribed, strict=True):
                await engine.publisher.wait_subscribed(0, before + 1)

    def matched(self, tokens: list[int]) -> int:
        return self.events.match(request_keys(tokens, BLOCK)).get(SLOT, 0)


async def start_engine(nursery: trio.Nursery, slot: Any = SLOT, *, replay: bool = True,
                       **options: Any) -> Engine:
    publisher = KVEventPublisher(replay_port=0 if replay else None, **options)
    endpoints = await nursery.start(publisher.run)
    replay_endpoint = endpoints.replay[0] if endpoints.replay is not None else None
    return Engine(publisher, SlotSource(slot, endpoints.publish[0], replay_endpoint))


@asynccontextmanager
async def follower(*, replay_timeout: float = 2.0, **index_options: Any) -> AsyncIterator[Follower]:
    async with trio.open_nursery() as nursery:
        events = KvEvents(KvIndex(block_size=BLOCK, **index_options), replay_timeout=replay_timeout)
        await nursery.start(events.run)
        yield Follower(events, nursery)
        nursery.cancel_scope.cancel()


def trust(stats: dict[Any, SlotReport], slot: Any = SLOT) -> Trust | None:
    return stats[slot].index.trust if slot in stats else None


@pytest.mark.parametrize("positional", [False, True])
async def test_batches_in_order_land_in_the_index(positional: bool) -> None:
    async with follower() as f:
        engine = await start_engine(f.nursery, positional=positional)
        await f.follow(engine)
        await f.until(lambda s: trust(s) is Trust.EXACT)  # the empty replay: nothing published yet
        tokens = prompt(4, seed=1)
        engine.publisher.publish(0, [stored(tokens, 100)])
        engine.publisher.publish(0, [BlockRemoved((103,), "GPU")])
        stats = await f.until(lambda s: s[SLOT].index.removed == 1)
        assert f.matched(tokens) == 12
        assert (stats[SLOT].received, stats[SLOT].gaps, stats[SLOT].malformed) == (2, 0, 0)


async def test_a_late_subscriber_replays_what_the_engine_holds() -> None:
    async with follower() as f:
        engine = await start_engine(f.nursery)
        first, second = prompt(3, seed=1), prompt(3, seed=2)
        engine.publisher.publish(0, [stored(first, 100)])               # nobody subscribed yet
        engine.publisher.publish(0, [stored(second, 200)])
        await f.follow(engine)
        stats = await f.until(lambda s: s[SLOT].index.stored == 6)
        assert trust(stats) is Trust.EXACT                           # the replay reached seq 0
        assert (f.matched(first), f.matched(second)) == (12, 12)
        assert (stats[SLOT].replays, stats[SLOT].gaps) == (1, 0)


async def test_a_first_replay_left_unanswered_is_asked_again_until_it_is_answered() -> None:
    """An engine too busy to answer in time (or still starting) while no request flows: without
    a second ask nothing would ever arrive, and the slot would stay FALLBACK."""
    async with follower(replay_timeout=0.2) as f:
        engine = await start_engine(f.nursery)
        tokens = prompt(3, seed=1)
        engine.publisher.publish(0, [stored(tokens, 100)])          # nobody subscribed yet
        engine.publisher.answer_replays = False
        await f.follow(engine)
        stats = await f.until(lambda s: s[SLOT].replay_failures >= 1)
        assert trust(stats) is Trust.FALLBACK
        engine.publisher.answer_replays = True
        stats = await f.until(lambda s: trust(s) is Trust.EXACT)
        assert f.matched(tokens) == 12                               # from the replay alone
        assert stats[SLOT].received == 0 and stats[SLOT].replays >= 2


async def test_a_gap_is_filled_by_the_replay() -> None:
    async with follower() as f:
        engine = await start_engine(f.nursery)
        await f.follow(engine)
        await f.until(lambda s: trust(s) is Trust.EXACT)
        tokens = prompt(4, seed=1)
        engine.publisher.drop_next()                                 # lost on the way
        engine.publisher.publish(0, [stored(tokens[:8], 100)])
        engine.publisher.publish(0, [stored(tokens, 102, parent=101, start=8)])
        stats = await f.until(lambda s: s[SLOT].index.stored == 4)
        assert f.matched(tokens) == 16
        assert trust(stats) is Trust.EXACT
        assert (stats[SLOT].gaps, stats[SLOT].replays, stats[SLOT].index.losses) == (1, 2, 0)


async def test_a_gap_the_replay_cannot_fill_drops_the_slots_entries() -> None:
    async with follower(rebuild_window=3600.0) as f:
        engine = await start_engine(f.nursery)
        await f.follow(engine)
        await f.until(lambda s: trust(s) is Trust.EXACT)
        old, missed, new = prompt(3, seed=1), prompt(3, seed=2), prompt(3, seed=3)
        engine.publisher.publish(0, [stored(old, 100)])
        await f.until(lambda s: s[SLOT].index.stored == 3)
        engine.publisher.drop_next()
        seq = engine.publisher.publish(0, [BlockRemoved((100,), "GPU"), stored(missed, 200)])
        engine.publisher.forget(below=seq + 1)                       # rolled out of the buffer
        engine.publisher.publish(0, [stored(new, 300)])
        stats = await f.until(lambda s: s[SLOT].index.losses == 1)
        assert trust(stats) is Trust.DEGRADED
        assert stats[SLOT].index.entries == 3                        # only what came after the gap
        assert (f.matched(old), f.matched(new)) == (0, 0)            # degraded: reports nothing


async def test_without_a_replay_socket_a_gap_degrades_the_slot() -> None:
    async with follower(rebuild_window=3600.0) as f:
        engine = await start_engine(f.nursery, replay=False)
        await f.follow(engine)
        tokens = prompt(3, seed=1)
        engine.publisher.publish(0, [stored(tokens, 100)])
        await f.until(lambda s: trust(s) is Trust.EXACT)             # seq 0: seen from the start
        engine.publisher.drop_next()
        engine.publisher.publish(0, [stored(prompt(3, seed=2), 200)])
        engine.publisher.publish(0, [stored(prompt(3, seed=3), 300)])
        stats = await f.until(lambda s: s[SLOT].index.losses == 1)
        assert trust(stats) is Trust.DEGRADED and stats[SLOT].replays == 0


async def test_a_replay_that_times_out_degrades_the_slot_and_the_subscription_goes_on() -> None:
    async with follower(replay_timeout=0.3, rebuild_window=3600.0) as f:
        engine = await start_engine(f.nursery)
        await f.follow(engine)
        await f.until(lambda s: trust(s) is Trust.EXACT)
        engine.publisher.answer_replays = False
        engine.publisher.drop_next()
        engine.publisher.publish(0, [stored(prompt(3, seed=1), 100)])
        engine.publisher.publish(0, [stored(prompt(3, seed=2), 200)])
        stats = await f.until(lambda s: s[SLOT].replay_failures == 1)
        assert trust(stats) is Trust.DEGRADED
        engine.publisher.publish(0, [stored(prompt(3, seed=3), 300)])
        await f.until(lambda s: s[SLOT].index.stored == 6)


async def test_all_blocks_cleared_empties_the_slot() -> None:
    async with follower() as f:
        engine = await start_engine(f.nursery)
        await f.follow(engine)
        tokens = prompt(3, seed=1)
        engine.publisher.publish(0, [stored(tokens, 100)])
        await f.until(lambda s: s[SLOT].index.stored == 3)
        engine.publisher.publish(0, [AllBlocksCleared()])
        stats = await f.until(lambda s: s[SLOT].index.cleared == 1)
        assert stats[SLOT].index.entries == 0 and f.matched(tokens) == 0


async def test_an_engine_restart_starts_the_slot_afresh() -> None:
    async with follower() as f:
        engine = await start_engine(f.nursery)
        await f.follow(engine)
        before, after = prompt(3, seed=1), prompt(3, seed=2)
        for number in range(3):
            engine.publisher.publish(0, [stored(before, 100 + 10 * number)])
        await f.until(lambda s: s[SLOT].index.events == 3)
        engine.publisher.restart()                                   # numbers from 0 again
        engine.publisher.publish(0, [stored(after, 100)])
        stats = await f.until(lambda s: s[SLOT].restarts == 1 and s[SLOT].index.stored == 12)
        assert trust(stats) is Trust.EXACT
        assert (f.matched(before), f.matched(after)) == (0, 12)


async def test_the_cap_evicts_the_oldest_blocks() -> None:
    async with follower(max_blocks_per_slot=5) as f:
        engine = await start_engine(f.nursery)
        await f.follow(engine)
        first, second = prompt(3, seed=1), prompt(3, seed=2)
        engine.publisher.publish(0, [stored(first, 100)])
        engine.publisher.publish(0, [stored(second, 200)])
        stats = await f.until(lambda s: s[SLOT].index.stored == 6)
        assert (stats[SLOT].index.evictions, stats[SLOT].index.entries) == (1, 5)
        assert (f.matched(first), f.matched(second)) == (0, 12)


async def test_malformed_messages_are_counted_and_the_subscription_goes_on() -> None:
    async with follower(rebuild_window=3600.0) as f:
        engine = await start_engine(f.nursery)
        await f.follow(engine)
        await f.until(lambda s: trust(s) is Trust.EXACT)
        engine.publisher.send_raw(0, [b"", b"two frames"])
        engine.publisher.send_raw(0, [b"", b"short", b"payload"])
        engine.publisher.publish_payload(0, b"\xc1 not msgpack")   # a good seq, a bad batch
        tokens = prompt(3, seed=1)
        engine.publisher.publish(0, [stored(tokens, 100)])
        stats = await f.until(lambda s: s[SLOT].index.stored == 3)
        assert (stats[SLOT].malformed, stats[SLOT].received) == (3, 4)
        assert trust(stats) is Trust.DEGRADED                        # the bad batch's events: lost
        assert stats[SLOT].index.losses == 1


async def test_an_absent_publisher_raises_nothing_and_the_slot_waits_for_it() -> None:
    port, replay_port = free_port(), free_port()
    async with follower(replay_timeout=0.3) as f:
        source = SlotSource(SLOT, f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}")
        await f.events.reconcile([source])
        stats = await f.until(lambda s: s[SLOT].replay_failures == 1)
        assert trust(stats) is Trust.FALLBACK                        # absent is not lost
        publisher = KVEventPublisher(port=port, replay_port=replay_port)
        await f.nursery.start(publisher.run)
        with trio.fail_after(DEADLINE):
            await publisher.wait_subscribed()                        # ZMQ reconnected by itself
        tokens = prompt(2, seed=1)
        publisher.publish(0, [stored(tokens, 100)])
        await f.until(lambda s: trust(s) is Trust.EXACT)
        assert f.matched(tokens) == 8


async def test_an_endpoint_zmq_refuses_is_logged_and_the_slot_stays_fallback(
        caplog: pytest.LogCaptureFixture) -> None:
    async with follower() as f:
        await f.events.reconcile([SlotSource(SLOT, "tcp://no port here")])
        assert trust(f.events.stats()) is Trust.FALLBACK
        assert "cannot subscribe" in caplog.text


async def test_a_replay_endpoint_zmq_refuses_fails_the_replay_not_the_subscription() -> None:
    async with follower() as f:
        engine = await start_engine(f.nursery)
        source = SlotSource(SLOT, engine.source.endpoint, "tcp://no port here")
        await f.events.reconcile([source])
        with trio.fail_after(DEADLINE):
            await engine.publisher.wait_subscribed()
        await f.until(lambda s: s[SLOT].replay_failures == 1)
        tokens = prompt(2, seed=1)
        engine.publisher.publish(0, [stored(tokens, 100)])
        await f.until(lambda s: trust(s) is Trust.EXACT)
        assert f.matched(tokens) == 8


async def test_a_bug_applying_a_batch_degrades_the_slot_and_the_subscription_goes_on(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    async with follower(rebuild_window=3600.0) as f:
        engine = await start_engine(f.nursery)
        await f.follow(engine)
        await f.until(lambda s: trust(s) is Trust.EXACT)
        apply = f.events.index.apply

        def broken(slot: Any, events: Any) -> None:
            monkeypatch.setattr(f.events.index, "apply", apply)  # once
            raise RuntimeError("a bug")

        monkeypatch.setattr(f.events.index, "apply", broken)
        engine.publisher.publish(0, [stored(prompt(2, seed=1), 100)])
        stats = await f.until(lambda s: s[SLOT].index.losses == 1)
        assert trust(stats) is Trust.DEGRADED and "unexpected error" in caplog.text
        engine.publisher.publish(0, [stored(prompt(2, seed=2), 200)])
        await f.until(lambda s: s[SLOT].index.stored == 2)


async def test_reconcile_starts_stops_and_restarts_subscriptions() -> None:
    other = ("http://prefill:8000", 1)
    async with follower() as f:
        a, b = await start_engine(f.nursery), await start_engine(f.nursery, other)
        await f.follow(a, b)
        tokens = prompt(2, seed=1)
        a.publisher.publish(0, [stored(tokens, 100)])
        b.publisher.publish(0, [stored(tokens, 100)])
        await f.until(lambda s: s[SLOT].index.stored == 2 and s[other].index.stored == 2)
        assert f.events.match(request_keys(tokens, BLOCK)) == {SLOT: 8, other: 8}
        await f.events.reconcile([a.source])                          # other left the roster
        assert set(f.events.stats()) == {SLOT} and f.events.index.slots() == [SLOT]
        assert f.events.match(request_keys(tokens, BLOCK)) == {SLOT: 8}
        c = await start_engine(f.nursery)                              # SLOT's engine moved
        await f.follow(c)
        stats = await f.until(lambda s: trust(s) is Trust.EXACT)
        assert stats[SLOT].source == c.source and stats[SLOT].index.entries == 0
        a.publisher.publish(0, [stored(prompt(2, seed=2), 200)])          # the old engine: not followed
        c.publisher.publish(0, [stored(tokens, 300)])
        await f.until(lambda s: s[SLOT].index.stored == 2)
        assert f.matched(tokens) == 8


async def test_reconcile_needs_the_owner_running() -> None:
    with pytest.raises(RuntimeError, match="not running"):
        await KvEvents().reconcile([])
