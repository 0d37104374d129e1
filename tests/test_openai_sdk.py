"""The official ``openai`` SDK, sync and async, works against the proxy unmodified.

The proxy runs on Hypercorn's trio worker in front of fake vLLM instances (E -> P -> D). The sync
client runs in a worker thread; the async one runs on trio-asyncio's loop (asyncio code inside
this Trio test). Both go through the SDK's own parsing: response models, SSE streams, errors.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from functools import partial
from typing import Any

import httpx
import openai
import orjson
import pytest
import trio
import trio_asyncio

from epd_trio.testing import Cluster, FakeVLLM, run_cluster

from helpers import image, url_uuid

MODEL = "fake-model"
TOKENS = 5
CHAT = [{"role": "user", "content": [image(1), {"type": "text", "text": "describe this"}]}]
PROMPT = "once upon a time"


def sdk_options(c: Cluster) -> dict[str, Any]:
    # No retries: every failure must show on the first attempt, and the tests stay fast.
    return {"base_url": c.proxy_url + "/v1", "api_key": "unused", "max_retries": 0,
            "timeout": 20.0}


async def in_thread(fn: Callable[[], Any]) -> Any:
    with trio.fail_after(30):
        return await trio.to_thread.run_sync(fn)


async def on_asyncio(program: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    async with trio_asyncio.open_loop():
        with trio.fail_after(30):
            return await trio_asyncio.aio_as_trio(program)()


def sync_calls(c: Cluster) -> dict[str, Any]:
    with openai.OpenAI(**sdk_options(c)) as client:
        return {
            "chat": client.chat.completions.create(
                model=MODEL, messages=CHAT, max_tokens=TOKENS,
                extra_headers={"x-request-id": "sdk-chat"}),
            "chat_stream": list(client.chat.completions.create(
                model=MODEL, messages=CHAT, max_tokens=TOKENS, stream=True,
                stream_options={"include_usage": True})),
            "completion": client.completions.create(model=MODEL, prompt=PROMPT,
                                                    max_tokens=TOKENS),
            "completion_stream": list(client.completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=TOKENS, stream=True)),
            "models": [m.id for m in client.models.list()],
        }


async def async_calls(c: Cluster) -> dict[str, Any]:
    async with openai.AsyncOpenAI(**sdk_options(c)) as client:
        chat_stream = await client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=TOKENS, stream=True,
            stream_options={"include_usage": True})
        completion_stream = await client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=TOKENS, stream=True)
        return {
            "chat": await client.chat.completions.create(
                model=MODEL, messages=CHAT, max_tokens=TOKENS,
                extra_headers={"x-request-id": "sdk-chat"}),
            "chat_stream": [chunk async for chunk in chat_stream],
            "completion": await client.completions.create(model=MODEL, prompt=PROMPT,
                                                          max_tokens=TOKENS),
            "completion_stream": [chunk async for chunk in completion_stream],
            "models": [m.id async for m in client.models.list()],
        }


def decode_answer(decode: FakeVLLM, path: str) -> dict[str, Any]:
    """The JSON body decode sent for its (one) non-stream request on ``path``."""
    (answer,) = [orjson.loads(r.sent) for r in decode.requests(path) if not r.body.get("stream")]
    return answer


def check_results(results: dict[str, Any], c: Cluster) -> None:
    (decode,) = c.decodes
    chat = results["chat"]
    sent = decode_answer(decode, "/v1/chat/completions")
    assert chat.id == "chatcmpl-sdk-chat" == sent["id"]  # our x-request-id reached decode
    assert chat.choices[0].message.content == sent["choices"][0]["message"]["content"]
    assert len(chat.choices[0].message.content.split()) == TOKENS
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage.completion_tokens == TOKENS

    *chunks, usage_chunk = results["chat_stream"]
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
    assert streamed == chat.choices[0].message.content  # same prompt, same greedy answer
    assert chunks[-1].choices[0].finish_reason == "length"
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == TOKENS

    completion = results["completion"]
    sent = decode_answer(decode, "/v1/completions")
    assert completion.choices[0].text == sent["choices"][0]["text"]
    assert "".join(c.choices[0].text for c in results["completion_stream"]) == (
        completion.choices[0].text)
    assert results["completion_stream"][-1].choices[0].finish_reason == "length"
    assert results["models"] == [MODEL]

    # Both chat requests went E -> P -> D with the item's uuid; completions skipped the encoder.
    (encoder,) = c.encoders
    assert [r.body["messages"][0]["content"][0]["uuid"] for r in encoder.requests()] == [
        url_uuid(image(1))] * 2
    generations = [r for r in decode.requests() if r.method == "POST"]
    assert len(c.prefills[0].requests()) == 4 and len(generations) == 4


async def test_sync_client() -> None:
    async with run_cluster(encoders=1, prefills=1, decodes=1) as c:
        check_results(await in_thread(lambda: sync_calls(c)), c)


async def test_async_client() -> None:
    async with run_cluster(encoders=1, prefills=1, decodes=1) as c:
        check_results(await on_asyncio(lambda: async_calls(c)), c)


def sync_error(c: Cluster, **request: Any) -> openai.APIError:
    """The exception the sync SDK raises for a chat request (a streamed one is read to the end)."""
    with openai.OpenAI(**sdk_options(c)) as client:
        with pytest.raises(openai.APIError) as info:
            answer = client.chat.completions.create(model=MODEL, max_tokens=TOKENS, **request)
            if request.get("stream"):
                list(answer)
        return info.value


async def async_error(c: Cluster, **request: Any) -> openai.APIError:
    async with openai.AsyncOpenAI(**sdk_options(c)) as client:
        with pytest.raises(openai.APIError) as info:
            answer = await client.chat.completions.create(model=MODEL, max_tokens=TOKENS,
                                                          **request)
            if request.get("stream"):
                async for _ in answer:
                    pass
        return info.value


async def test_errors_reach_the_sdk_as_its_own_exceptions(client: httpx.AsyncClient) -> None:
    async with run_cluster(encoders=1, prefills=1, decodes=1, max_connections=1,
                           queue_timeout=0.2) as c:
        # Bad input: the proxy's own 400.
        for error in [await in_thread(lambda: sync_error(c, messages="hello")),
                      await on_asyncio(lambda: async_error(c, messages="hello"))]:
            assert isinstance(error, openai.BadRequestError) and error.status_code == 400
            assert error.body == {"message": "'messages' is required and must be a non-empty "
                                  "array", "type": "invalid_request_error", "param": "messages",
                                  "code": 400}

        # vLLM's own 400 (prompt too long at prefill), relayed unchanged.
        c.prefills[0].behaviour.max_model_len = 1
        error = await in_thread(lambda: sync_error(c, messages=CHAT))
        assert isinstance(error, openai.BadRequestError)
        assert "maximum context length is 1 tokens" in error.message
        c.prefills[0].behaviour.max_model_len = 4096

        # An encoder failure: 502 naming the stage and the instance.
        (encoder,) = c.encoders
        encoder.behaviour.fail_status = 500
        error = await in_thread(lambda: sync_error(c, messages=CHAT))
        assert isinstance(error, openai.InternalServerError) and error.status_code == 502
        assert (error.body["stage"], error.body["instance"]) == ("encode", encoder.url)
        assert "encode stage failed" in error.message
        encoder.behaviour.fail_status = None

        # A decode stream that breaks after its first bytes: the SDK raises on the error event.
        (decode,) = c.decodes
        decode.behaviour.break_after = 2
        for error in [await in_thread(lambda: sync_error(c, messages=CHAT, stream=True)),
                      await on_asyncio(lambda: async_error(c, messages=CHAT, stream=True))]:
            assert type(error) is openai.APIError
            assert error.message.startswith(f"decode stage failed at {decode.url}")
        decode.behaviour.break_after = None

        # The proxy's own limit: decode's one place is taken, so the next request gets a 503.
        decode.behaviour.hang = True
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(client.post, c.proxy_url + "/v1/chat/completions",
                                       json={"model": MODEL, "messages": CHAT}))
            with trio.fail_after(10):
                await decode.wait_until(lambda: decode.in_flight == 1)
            error = await in_thread(lambda: sync_error(c, messages=CHAT))
            nursery.cancel_scope.cancel()
        assert isinstance(error, openai.InternalServerError) and error.status_code == 503
        assert error.body["type"] == "proxy_overloaded"
