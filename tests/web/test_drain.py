"""The shutdown drain in-process (``_web/drain``): what is cut when the grace period ends, and
how it is counted. ``tests/serve/test_serve.py`` runs it under the real ``epd-trio serve``."""

from __future__ import annotations

import gc
import warnings
from typing import Any

import httpx
import pytest
import trio
import trio.testing

from epd_trio import Instance
from epd_trio._app import create_app
from epd_trio._core.config import Settings
from epd_trio._serve.serving import quiet_config, serve_app
from epd_trio.testing import FakeVLLM

from helpers import CHAT, chat_body, metric, start_fakes


async def test_a_request_waiting_upstream_when_the_grace_ends_gets_503_shutting_down(
    client: httpx.AsyncClient, nursery: trio.Nursery
) -> None:
    decode = FakeVLLM("prefill_decode")
    decode.behaviour.hang = True  # the request is still waiting for its answer at the end
    await start_fakes(nursery, decode)
    app = create_app(Settings(decode_urls=(Instance(decode.url),), shutdown_grace=0))
    stop = trio.Event()  # a graceful stop at the end: the app closes its upstream client
    async with trio.open_nursery() as server:
        url = await server.start(serve_app, app, quiet_config(), stop)
        try:
            await drain_while_a_request_waits(client, url, app, decode)
        finally:
            stop.set()


async def drain_while_a_request_waits(client: httpx.AsyncClient, url: str, app: Any,
                                      decode: FakeVLLM) -> None:
    proxy, drain = app.extensions["epd_trio.proxy"], app.extensions["epd_trio.drain"]
    answers: list[httpx.Response] = []

    async def ask() -> None:
        answers.append(await client.post(url + CHAT, json=chat_body(),
                                         headers={"x-request-id": "held"}))

    async with trio.open_nursery() as requests:
        requests.start_soon(ask)
        with trio.fail_after(10):
            await decode.wait_until(lambda: len(decode.requests()) == 1)
        assert len(drain) == 1
        with trio.fail_after(10):
            await drain.run()
    (r,) = answers
    assert r.status_code == 503 and r.headers["x-request-id"] == "held"
    assert r.headers["connection"] == "close"
    error = r.json()["error"]
    assert error["code"] == "shutting_down" and "0 s shutdown grace period" in error["message"]
    assert metric(proxy, "epd_trio_requests_total", endpoint=CHAT, outcome="shutdown") == 1
    assert metric(proxy, "epd_trio_requests_total", endpoint=CHAT, outcome="cancelled") == 0
    assert proxy.registry.states()[0].errors == 0  # not the instance's fault
    # Draining: a new request is refused before its body is read, and counted alike.
    r = await client.post(url + CHAT, json=chat_body())
    assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
    assert metric(proxy, "epd_trio_requests_total", endpoint=CHAT, outcome="shutdown") == 2


async def test_a_body_still_arriving_when_the_grace_ends_gets_503_shutting_down(
    nursery: trio.Nursery,
) -> None:
    """The grace covers a request from its head on: one whose body is still arriving is in
    flight, and is answered (not dropped) when the grace ends."""
    decode = FakeVLLM("prefill_decode")
    await start_fakes(nursery, decode)
    app = create_app(Settings(decode_urls=(Instance(decode.url),), shutdown_grace=0))
    stop = trio.Event()
    async with trio.open_nursery() as server:
        url = await server.start(serve_app, app, quiet_config(), stop)
        try:
            host, port = url.removeprefix("http://").split(":")
            stream = await trio.open_tcp_stream(host, int(port))
            async with stream:
                await stream.send_all(f"POST {CHAT} HTTP/1.1\r\nhost: x\r\ncontent-length: 100"
                                      "\r\nx-request-id: slow\r\n\r\n{".encode())
                await trio.testing.wait_all_tasks_blocked()  # its body is being read
                drain = app.extensions["epd_trio.drain"]
                assert len(drain) == 1
                with trio.fail_after(10):
                    await drain.run()
                answer = b""
                with trio.fail_after(10):
                    while chunk := await stream.receive_some():
                        answer += chunk
        finally:
            stop.set()
    assert answer.startswith(b"HTTP/1.1 503 ") and b"shutting_down" in answer
    assert b"\r\nx-request-id: slow\r\n" in answer
    proxy = app.extensions["epd_trio.proxy"]
    assert metric(proxy, "epd_trio_requests_total", endpoint=CHAT, outcome="shutdown") == 1
    assert not decode.requests()


async def test_a_serve_cancelled_from_outside_closes_the_upstream_connections(
    client: httpx.AsyncClient, nursery: trio.Nursery
) -> None:
    """No graceful stop: the owner's nursery is cancelled (an embedding application's, a
    test's). The keep-alive connections to the instance, the request's and the model learner's,
    are closed, not left for the garbage collector."""
    (decode,) = await start_fakes(nursery, FakeVLLM("prefill_decode"))
    app = create_app(Settings(decode_urls=(Instance(decode.url),)))
    proxy = app.extensions["epd_trio.proxy"]
    async with trio.open_nursery() as server:
        url = await server.start(serve_app, app, quiet_config(), trio.Event())
        assert (await client.post(url + CHAT, json=chat_body())).status_code == 200
        server.cancel_scope.cancel()
    with pytest.raises(RuntimeError, match="outside start"):
        proxy.client(Instance(decode.url))
    peer = f"('127.0.0.1', {decode.url.rsplit(':', 1)[1]})"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        gc.collect()
    assert [str(w.message) for w in caught if peer in str(w.message)] == []
