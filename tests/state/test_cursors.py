"""Cursor objects: one locked read-and-advance per request, fair under concurrency."""

from collections import Counter

import trio
import trio.testing

from epd_trio import EncoderCursor, Instance, SlotCursor, flat_interleaved_dp_route


async def test_encoder_cursor_is_fair_under_concurrency() -> None:
    encoders = [Instance(f"http://e{i}:1") for i in range(3)]
    cursor = EncoderCursor(encoders)
    hits: Counter[str] = Counter()

    async def request(n_items: int) -> None:
        await trio.testing.wait_all_tasks_blocked()  # everyone reaches the cursor together
        for inst in await cursor.assign(n_items):
            hits[inst.url] += 1

    async with trio.open_nursery() as nursery:
        for i in range(300):
            nursery.start_soon(request, 1 + i % 3)  # 600 items in all
    assert hits == {e.url: 200 for e in encoders}
    assert cursor.position == 0


async def test_encoder_cursor_gives_consecutive_ranges() -> None:
    encoders = [Instance(f"http://e{i}:1") for i in range(3)]
    cursor = EncoderCursor(encoders, start=2)
    assert [i.url for i in await cursor.assign(2)] == ["http://e2:1", "http://e0:1"]
    assert [i.url for i in await cursor.assign(1)] == ["http://e1:1"]


def test_slot_cursor_walks_the_flat_interleaved_order() -> None:
    instances = [Instance("http://a:1", 4), Instance("http://b:1", 2)]
    cursor = SlotCursor(instances)
    got = [cursor.next() for _ in range(12)]
    expected = []
    for k in range(1, 13):
        index, rank = flat_interleaved_dp_route(k, instances)
        expected.append((instances[index], rank))
    assert got == expected
    assert cursor.slot_count == 6
