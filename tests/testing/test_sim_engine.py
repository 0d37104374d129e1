"""The simulated batch engine (``epd_trio.testing.sim_engine``) on virtual time: its mechanism
is what the policy benchmark's figures rest on."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from epd_trio._core.engine_load import engine_loads, rank_loads
from epd_trio.testing.sim_engine import EngineConfig, SimEngine, prompt_blocks

CONFIG = EngineConfig(max_num_seqs=2, step_base=0.010, step_per_seq=0.005,
                      prefill_per_token=0.001, block_tokens=4, cache_blocks=4)


async def _generate(engine: SimEngine, words: list[str], tokens: int, times: list[float],
                    rank: int = 0, prefill: bool = True) -> None:
    async for _ in engine.generate(rank, words, tokens, prefill=prefill):
        times.append(trio.current_time())


async def test_steps_batch_queue_and_cost_by_batch_size(autojump_clock: trio.abc.Clock) -> None:
    engine = SimEngine(CONFIG)
    runs: list[list[float]] = [[], [], []]
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        async with trio.open_nursery() as clients:
            for times in runs:
                clients.start_soon(_generate, engine, [], 2, times, 0, False)
            await trio.sleep(0.001)  # virtual time: inside the first step
            assert (len(engine.ranks[0].running), len(engine.ranks[0].waiting)) == (2, 1)
        nursery.cancel_scope.cancel()
    runs.sort()  # trio starts the three in no particular order
    step2 = 0.010 + 2 * 0.005  # two running
    assert runs[0] == pytest.approx([step2, 2 * step2])
    assert runs[1] == runs[0]
    step1 = 0.010 + 0.005  # the third waited for a place, then ran alone
    assert runs[2] == pytest.approx([2 * step2 + step1, 2 * step2 + 2 * step1])


async def test_prefill_costs_the_uncached_tokens_and_the_cache_is_bounded(
        autojump_clock: trio.abc.Clock) -> None:
    engine = SimEngine(CONFIG)
    prompt = [f"w{i}" for i in range(8)]  # two blocks
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        for expected_prefill in (8, 0):
            times: list[float] = []
            start = trio.current_time()
            await _generate(engine, prompt, 1, times)
            assert times[0] - start == pytest.approx(0.015 + 0.001 * expected_prefill)
        # Three other 2-block prompts push the first one out (4 blocks per rank).
        for other in range(3):
            await _generate(engine, [f"o{other}-{i}" for i in range(8)], 1, [])
        start, times = trio.current_time(), []
        await _generate(engine, prompt, 1, times)
        assert times[0] - start == pytest.approx(0.015 + 0.008)
        nursery.cancel_scope.cancel()
    rank = engine.ranks[0]
    assert len(rank.cache) <= CONFIG.cache_blocks
    assert (rank.queries, rank.hits) == (8 * 6, 8)


async def test_a_request_left_early_leaves_the_batch(autojump_clock: trio.abc.Clock) -> None:
    engine = SimEngine(CONFIG)
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        ticks = engine.generate(0, [], 100, prefill=False)
        await anext(ticks)
        assert len(engine.ranks[0].running) == 1
        await ticks.aclose()
        await trio.sleep(0.1)
        assert engine.ranks[0].running == []
        nursery.cancel_scope.cancel()


async def test_the_encoder_is_slower_for_uncached_items(autojump_clock: trio.abc.Clock) -> None:
    engine = SimEngine(EngineConfig(encode_miss=0.03, encode_hit=0.002, encoder_cache_items=1))
    start = trio.current_time()
    await engine.encode(["a", "b"])
    await engine.encode(["b"])
    assert trio.current_time() - start == pytest.approx(0.06 + 0.002)
    assert (engine.encoder_queries, engine.encoder_hits) == (3, 1)


async def test_metrics_has_vllms_gauges_per_engine(autojump_clock: trio.abc.Clock) -> None:
    engine = SimEngine(CONFIG, dp_size=2)
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        for _ in range(3):
            nursery.start_soon(_generate, engine, [], 5, [], 1, False)
        await trio.sleep(0.001)
        text = engine.metrics_text("m", encoder=False)
        nursery.cancel_scope.cancel()
    assert 'vllm:num_requests_running{engine="1",model_name="m"} 2.0' in text
    assert 'vllm:num_requests_waiting{engine="1",model_name="m"} 1.0' in text
    assert "vllm:prefix_cache_hits_total" in text
    loads = engine_loads(text)
    assert (loads["1"].running, loads["1"].waiting, loads["0"].running) == (2, 1, 0)
    assert rank_loads(loads, 2) == {0: 0, 1: 3}


def test_blocks_are_chained_and_only_full_blocks_count() -> None:
    words = [str(i) for i in range(10)]
    blocks = prompt_blocks(words, 4)
    assert len(blocks) == 2
    assert prompt_blocks(["x", *words[1:]], 4)[1] != blocks[1]  # the chain carries the prefix


def test_bad_parameters_are_refused() -> None:
    with pytest.raises(ValueError):
        EngineConfig(max_num_seqs=0)
    with pytest.raises(ValueError):
        EngineConfig(step_base=-1)
