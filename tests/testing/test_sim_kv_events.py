"""The simulated engine's prefix cache reports vLLM's KV events to a sink, one batch a step."""

from __future__ import annotations

from collections.abc import Sequence

import trio

from epd_trio._kv.wire import BlockStored, KvEvent
from epd_trio.testing.prefix_cache import EventSink
from epd_trio.testing.sim_engine import EngineConfig, SimEngine


def sink_into(batches: list[tuple[int, list[KvEvent]]]) -> EventSink:
    """An in-process sink (what the bench hands the engine) that keeps every batch."""

    def sink(rank: int, events: Sequence[KvEvent]) -> None:
        batches.append((rank, list(events)))
    return sink


async def test_the_simulated_engine_publishes_a_batch_per_step(
        autojump_clock: trio.abc.Clock) -> None:
    batches: list[tuple[int, list[KvEvent]]] = []
    engine = SimEngine(EngineConfig(block_tokens=4, cache_blocks=2), event_sink=sink_into(batches))
    prompts = [list(range(1, 10)), [1, 2, 3, 4, 50, 51, 52, 53], list(range(1, 10))]
    hits: list[int] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        for prompt in prompts:
            async for _ in engine.generate(0, prompt, 1, prefill=True, hit_limit=len(prompt) - 1,
                                           on_admit=hits.append):
                pass
        engine.reset_prefix_cache()
        nursery.cancel_scope.cancel()
    assert hits == [0, 4, 4]
    kinds = [[type(e).__name__ for e in batch] for _, batch in batches]
    assert kinds == [["BlockStored"], ["BlockRemoved", "BlockStored"], ["BlockRemoved", "BlockStored"],
                     ["AllBlocksCleared"]]
    first, shared = batches[0][1][0], batches[1][1][1]
    assert isinstance(first, BlockStored) and isinstance(shared, BlockStored)
    assert shared.parent_block_hash == first.block_hashes[0]  # chained on the shared first block
    assert shared.token_ids == [50, 51, 52, 53]
    assert engine.ranks[0].hits == 8 and engine.ranks[0].queries == 9 + 8 + 9
