"""The fake vLLM server behaves like the real one where the proxy depends on it."""

import hashlib
import subprocess
import sys

import httpx
import orjson
import trio

from epd_trio.testing import FakeVLLM
from epd_trio.testing.process import read_url

from helpers import chat_body, image, url_uuid


async def test_rank_header_is_checked_like_vllm(nursery: trio.Nursery) -> None:
    fake = FakeVLLM("decode", dp_size=2)
    await nursery.start(fake.serve)
    async with httpx.AsyncClient(trust_env=False) as client:
        url = fake.url + "/v1/chat/completions"
        for rank, status in [("0", 200), ("1", 200), ("2", 400), ("-1", 400), ("x", 400)]:
            r = await client.post(url, json=chat_body(), headers={"x-data-parallel-rank": rank})
            assert r.status_code == status, rank
        r = await client.post(url, json=chat_body(), headers={"x-data-parallel-rank": "2"})
        assert r.json()["error"]["message"] == "data_parallel_rank 2 is out of range [0, 2)."
        r = await client.post(url, json=chat_body(), headers={"x-request-id": "abc"})
        assert r.json()["id"] == "chatcmpl-abc" and r.headers["x-request-id"] == "abc"


async def test_encoder_and_prefill_answers(nursery: trio.Nursery) -> None:
    encoder, prefill = FakeVLLM("encode"), FakeVLLM("prefill")
    for fake in (encoder, prefill):
        await nursery.start(fake.serve)
    async with httpx.AsyncClient(trust_env=False) as client:
        item = {**image(1), "uuid": "u1"}
        r = await client.post(encoder.url + "/v1/chat/completions", json=chat_body(item, image(2)))
        assert set(r.json()["ec_transfer_params"]) == {"u1", _content_hash(image(2))}
        r = await client.post(prefill.url + "/v1/chat/completions",
                              json=chat_body(kv_transfer_params={"do_remote_decode": True}))
        params = r.json()["kv_transfer_params"]
        assert params["do_remote_prefill"] is True and params["remote_block_ids"]
        assert {"remote_engine_id", "remote_host", "remote_port", "tp_size",
                "remote_request_id"} <= set(params)
        r = await client.post(prefill.url + "/v1/chat/completions", json=chat_body())
        assert r.json()["kv_transfer_params"] is None
    assert url_uuid(image(1)) != "u1"


def _content_hash(part: dict) -> str:
    return hashlib.sha256(orjson.dumps(part, option=orjson.OPT_SORT_KEYS)).hexdigest()


async def test_runs_on_its_own() -> None:
    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", "epd_trio.testing", "--role", "prefill", "--dp", "2"],
        stdout=subprocess.PIPE,
    )
    try:
        assert process.stdout is not None
        url = await read_url(process.stdout, rb"on (http://\S+)")
        async with httpx.AsyncClient(trust_env=False) as client:
            r = await client.get(url + "/health")
            assert r.status_code == 200
    finally:
        process.terminate()
        with trio.fail_after(15):
            assert await process.wait() == 0


async def test_a_stream_sends_its_headers_before_the_engine_answers(nursery: trio.Nursery) -> None:
    # Real vLLM answers a stream's 200 at once and its first chunk only once the engine has the
    # first token (seconds later when a KV pull is slow): the fake does the same.
    fake = FakeVLLM("decode")
    engine = trio.Event()
    fake.behaviour.gate = engine.wait
    await nursery.start(fake.serve)
    async with httpx.AsyncClient(trust_env=False, timeout=10) as client, client.stream(
            "POST", fake.url + "/v1/chat/completions", json=chat_body(stream=True)) as r:
        assert r.status_code == 200 and r.headers["content-type"] == "text/event-stream"
        assert fake.requests()[0].sent == b""  # headers only: the gate is still closed
        engine.set()
        body = b"".join([chunk async for chunk in r.aiter_raw()])
    assert body.startswith(b"data: ") and body.endswith(b"data: [DONE]\n\n")
