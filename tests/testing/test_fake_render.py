"""The fake vLLM's render endpoints answer vLLM's GenerateRequest with the cache's own tokens."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import trio

from epd_trio._kv.wire import BlockStored, KvEvent
from epd_trio.testing import FakeVLLM
from epd_trio.testing.fake_kv import KVConfig

#: vLLM's GenerateRequest fields, in declaration order (pydantic dumps them so).
GENERATE_REQUEST = ["request_id", "token_ids", "assistant_tokens_mask", "token_offsets", "features",
                    "sampling_params", "model", "stream", "stream_options", "cache_salt", "priority",
                    "kv_transfer_params"]


def chat(*messages: tuple[str, Any]) -> dict[str, Any]:
    return {"model": "fake-model", "max_tokens": 3,
            "messages": [{"role": role, "content": content} for role, content in messages]}


async def test_chat_render_shares_prefixes_and_matches_the_cached_blocks(
        nursery: trio.Nursery) -> None:
    events: list[KvEvent] = []
    fake = FakeVLLM("decode", render=True, kv=KVConfig(
        block_size=4, prompt_tokens_details=True, sink=lambda _, batch: events.extend(batch)))
    await nursery.start(fake.serve)
    system = ("system", "you are a careful assistant who answers briefly")
    first = chat(system, ("user", "what is the capital of france"))
    second = chat(system, ("user", "and of spain"))
    async with httpx.AsyncClient(trust_env=False, base_url=fake.url) as client:
        r = await client.post("/v1/chat/completions/render", json=first,
                              headers={"x-request-id": "r1"})
        assert r.status_code == 200
        rendered = r.json()
        other = (await client.post("/v1/chat/completions/render", json=second)).json()
        cached = []
        for body in (first, second):
            answer = (await client.post("/v1/chat/completions", json=body)).json()
            cached.append(answer["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert list(rendered) == GENERATE_REQUEST
    assert rendered["request_id"] == "chatcmpl-r1" and rendered["features"] is None
    assert rendered["sampling_params"]["max_tokens"] == 3 and rendered["model"] == "fake-model"
    ids, other_ids = rendered["token_ids"], other["token_ids"]
    shared = next(i for i, (a, b) in enumerate(zip(ids, other_ids, strict=False)) if a != b)
    assert shared == 1 + 8 + 1 + 1  # <|system|> 8 words <|end|> <|user|>
    # The cache stored exactly the rendered tokens, and the second request hit the shared blocks.
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert stored[0].token_ids == ids[:len(ids) // 4 * 4]
    assert cached == [0, shared // 4 * 4]


async def test_media_features_and_completions(nursery: trio.Nursery) -> None:
    fake = FakeVLLM("prefill", render=True)
    await nursery.start(fake.serve)
    item = {"type": "image_url", "image_url": {"url": "https://x/1.png"}, "uuid": "u1"}
    body = chat(("user", [{"type": "text", "text": "describe"}, item]))
    async with httpx.AsyncClient(trust_env=False, base_url=fake.url) as client:
        rendered = (await client.post("/v1/chat/completions/render", json=body)).json()
        r = await client.post("/v1/completions/render",
                              json={"model": "fake-model", "prompt": ["a b c", "a b d e"]})
        batch = r.json()
    features = rendered["features"]
    assert features["mm_hashes"] == {"image": ["u1"]}
    assert features["mm_placeholders"] == {"image": [{"offset": 3, "length": 4}]}
    assert len(features["kwargs_data"]["image"]) == 1
    assert len(set(rendered["token_ids"][3:7])) == 1  # the pads
    assert [len(p["token_ids"]) for p in batch] == [3, 4]
    assert batch[0]["token_ids"][:2] == batch[1]["token_ids"][:2]
    assert list(batch[0]) == GENERATE_REQUEST


async def test_render_fails_slows_or_is_absent_on_demand(nursery: trio.Nursery) -> None:
    fake, absent = FakeVLLM("decode", render=True), FakeVLLM("decode")
    for f in (fake, absent):
        await nursery.start(f.serve)
    fake.behaviour.render_fail_status, fake.behaviour.render_fail_count = 500, 1
    body = chat(("user", "hello"))
    async with httpx.AsyncClient(trust_env=False) as client:
        statuses = [(await client.post(fake.url + "/v1/chat/completions/render", json=body)).status_code
                    for _ in range(2)]
        assert statuses == [500, 200]
        r = await client.post(absent.url + "/v1/chat/completions/render", json=body)
        assert r.status_code == 404
        fake.behaviour.render_latency = 30.0
        with pytest.raises(httpx.ReadTimeout):
            await client.post(fake.url + "/v1/chat/completions/render", json=body, timeout=0.2)
        with trio.fail_after(5):  # the abandoned render is cancelled, as on a client disconnect
            await fake.wait_until(lambda: fake.disconnects == 1)
        fake.behaviour.render_latency, fake.behaviour.max_model_len = 0.0, 2
        r = await client.post(fake.url + "/v1/chat/completions/render", json=body)
        assert r.status_code == 400 and "maximum context length is 2" in r.json()["error"]["message"]
