"""The fake vLLM's prefix cache reports vLLM's KV cache events, and counts its hits like vLLM."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import httpx
import msgpack
import orjson
import trio

from epd_trio._kv.wire import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from epd_trio.testing import FakeVLLM
from epd_trio.testing.fake_kv import KVConfig
from epd_trio.testing.kv_publisher import KVEventPublisher
from epd_trio.testing.prefix_cache import PrefixCache
from epd_trio.testing.render import render_chat
from epd_trio.testing.sim_engine import EngineConfig, SimEngine
from epd_trio.testing.zmq_peer import subscriber

from helpers import scrape


def chat(text: str, *parts: dict[str, Any], **extra: Any) -> dict[str, Any]:
    content: Any = [{"type": "text", "text": text}, *parts] if parts else text
    return {"model": "fake-model", "max_tokens": 2,
            "messages": [{"role": "user", "content": content}], **extra}


class Sink:
    """An in-process event sink (what the bench hands the engine)."""

    def __init__(self) -> None:
        self.batches: list[tuple[int, list[KvEvent]]] = []

    def __call__(self, rank: int, events: Sequence[KvEvent]) -> None:
        self.batches.append((rank, list(events)))

    def events(self) -> list[KvEvent]:
        return [e for _, batch in self.batches for e in batch]


async def test_stored_blocks_on_the_wire_and_cached_tokens(nursery: trio.Nursery) -> None:
    publisher = KVEventPublisher(dp_size=2, topic="kv")
    fake = FakeVLLM("prefill_decode", dp_size=2, kv=KVConfig(
        block_size=4, publisher=publisher, prompt_tokens_details=True))
    await nursery.start(fake.serve)
    assert publisher.endpoints is not None
    body = chat("one two three four five six seven eight nine ten")  # 13 tokens: 3 full blocks
    tokens = render_chat(body).token_ids
    assert len(tokens) == 13
    with subscriber(publisher.endpoints.publish[1]) as sub:
        await publisher.wait_subscribed(1)
        async with httpx.AsyncClient(trust_env=False, base_url=fake.url) as client:
            answers = []
            for request in (body, body, chat("something else entirely here")):
                r = await client.post("/v1/chat/completions", json=request,
                                      headers={"x-data-parallel-rank": "1"})
                answers.append(r.json()["usage"])
            metrics = await scrape(client, fake.url)
        with trio.fail_after(5):
            first, second = await sub.receive(), await sub.receive()
        fake.kv_state.restart(1, clear=True)  # type: ignore[union-attr]  # a restarted vLLM
        with trio.fail_after(5):
            again = await sub.receive()
    assert int.from_bytes(again[1], "big") == 0 and len(fake.kv_state.caches[1]) == 0  # type: ignore[union-attr]
    assert msgpack.unpackb(again[2])[1] == [{"type": "AllBlocksCleared"}]
    assert [a["prompt_tokens_details"]["cached_tokens"] for a in answers] == [0, 12, 0]
    assert answers[0]["prompt_tokens"] == 13
    # The repeat published nothing: the next batch on the wire is the third request's.
    assert [int.from_bytes(m[1], "big") for m in (first, second)] == [0, 1]
    _, events, rank = msgpack.unpackb(first[2])
    assert rank == 1 and len(events) == 1
    stored = events[0]
    assert stored["type"] == "BlockStored" and stored["parent_block_hash"] is None
    assert len(stored["block_hashes"]) == 3 and stored["token_ids"] == tokens[:12]
    assert stored["block_size"] == 4 and stored["extra_keys"] == [None, None, None]
    assert stored["medium"] == "GPU" and stored["group_idx"] == 0
    assert all(0 <= h < 2**64 for h in stored["block_hashes"])
    assert metrics.get("vllm:prefix_cache_queries_total", engine="1", model_name="fake-model") == 13 * 2 + 7
    assert metrics.get("vllm:prefix_cache_hits_total", engine="1", model_name="fake-model") == 12
    assert metrics.get("vllm:prefix_cache_hits_total", engine="0", model_name="fake-model") == 0


async def test_eviction_reset_and_the_hashes_are_per_instance(nursery: trio.Nursery) -> None:
    sinks = [Sink(), Sink()]
    fakes = [FakeVLLM("decode", kv=KVConfig(block_size=4, capacity_blocks=2, sink=sink))
             for sink in sinks]
    for fake in fakes:
        await nursery.start(fake.serve)
    first, second = chat("a b c d e f g"), chat("h i j k l m n")  # 10 tokens: 2 blocks each
    async with httpx.AsyncClient(trust_env=False) as client:
        for fake in fakes:
            await client.post(fake.url + "/v1/chat/completions", json=first)
        await client.post(fakes[0].url + "/v1/chat/completions", json=second)
        r = await client.post(fakes[0].url + "/reset_prefix_cache")
        assert r.status_code == 200
    stored_a, removed, stored_b, cleared = sinks[0].events()
    assert isinstance(stored_a, BlockStored) and isinstance(stored_b, BlockStored)
    # The second prompt needed the room: the first one's blocks go, reported before the store,
    # tail first as vLLM evicts them.
    assert removed == BlockRemoved(stored_a.block_hashes[::-1], "GPU", 0)
    assert stored_b.parent_block_hash is None and len(stored_b.block_hashes) == 2
    assert cleared == AllBlocksCleared() and len(fakes[0].kv_state.caches[0]) == 0  # type: ignore[union-attr]
    other = sinks[1].events()[0]
    assert isinstance(other, BlockStored) and other.token_ids == stored_a.token_ids
    assert other.block_hashes != stored_a.block_hashes  # seeded per instance: opaque to a proxy


def test_eviction_takes_a_prompts_tail_before_its_head() -> None:
    """A one-block prompt after a two-block one evicts the tail: the head, which every prompt
    with that prefix needs first, stays (vLLM frees a request's blocks in reverse)."""
    cache = PrefixCache(block_size=4, capacity=2, record_events=True)
    head, tail, other = 1, 2, 3
    cache.admit([head, tail], 8)
    cache.take_events()
    cache.admit([other], 4)
    assert cache.take_events()[0] == BlockRemoved([tail], "GPU", 0)
    assert cache.admit([head, 4], 8, store=False) == 4  # the shared head still hits


async def test_media_blocks_carry_vllms_extra_keys_and_decode_stores_pulled_kv(
        nursery: trio.Nursery) -> None:
    sink, quiet = Sink(), Sink()
    decode = FakeVLLM("decode", kv=KVConfig(block_size=4, sink=sink))
    no_store = FakeVLLM("decode", kv=KVConfig(block_size=4, sink=quiet, decode_stores_remote=False))
    for fake in (decode, no_store):
        await nursery.start(fake.serve)
    item = {"type": "image_url", "image_url": {"url": "https://x/1.png"}, "uuid": "u1"}
    body = chat("look at this", item, kv_transfer_params={"do_remote_prefill": True},
                cache_salt="salty")
    async with httpx.AsyncClient(trust_env=False) as client:
        for fake in (decode, no_store):
            r = await client.post(fake.url + "/v1/chat/completions", json=body)
            assert r.status_code == 200
    # <|user|> look at this <|vision_start|> pad*4 <|vision_end|> <|end|> <|assistant|>: 12
    # tokens, the pads at 5..8: each block they overlap gets (uuid, item offset - block start).
    (event,) = sink.events()
    assert isinstance(event, BlockStored) and len(event.block_hashes) == 3
    assert event.extra_keys == [("salty",), (("u1", 1),), (("u1", -3),)]
    assert quiet.batches == [] and no_store.kv_state.caches[0].queries == 12  # type: ignore[union-attr]


async def test_with_the_simulated_engine_the_engine_caches_the_rendered_tokens(
        nursery: trio.Nursery) -> None:
    sink = Sink()
    engine = SimEngine(EngineConfig(block_tokens=4, step_base=0.001, step_per_seq=0.0))
    fake = FakeVLLM("decode", engine=engine, kv=KVConfig(sink=sink, prompt_tokens_details=True))
    await nursery.start(fake.serve)
    body = {**chat("one two three four five six seven eight nine ten"), "stream": True,
            "stream_options": {"include_usage": True}}
    cached = []
    async with httpx.AsyncClient(trust_env=False, base_url=fake.url) as client:
        for _ in range(2):
            r = await client.post("/v1/chat/completions", json=body)
            usage = next(line for line in r.text.splitlines() if '"usage"' in line)
            cached.append(orjson.loads(usage.removeprefix("data: "))["usage"])
    assert [u["prompt_tokens_details"]["cached_tokens"] for u in cached] == [0, 12]
    (stored,) = sink.events()
    assert isinstance(stored, BlockStored)
    assert stored.token_ids == render_chat(body).token_ids[:12]
    assert engine.ranks[0].hits == 12
