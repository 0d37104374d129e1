"""Admission control over real sockets: a cap on client requests in flight, a bounded wait."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import httpx
import pytest
import trio
import trio.testing

from epd_trio.testing import Cluster, FakeVLLM, run_cluster

from helpers import CHAT, Samples, chat_body, post_until_cancelled


@asynccontextmanager
async def one_place_taken(
    client: httpx.AsyncClient, admission_timeout: float, **settings: Any
) -> AsyncIterator[tuple[Cluster, FakeVLLM, trio.CancelScope]]:
    """A proxy with room for one request, and that one in flight (its decode hangs) until the
    yielded scope is cancelled."""
    async with run_cluster(decodes=1, max_inflight=1, admission_timeout=admission_timeout,
                           **settings) as c:
        (decode,) = c.decodes
        decode.behaviour.hang = True
        async with trio.open_nursery() as nursery:
            holder = trio.CancelScope()
            nursery.start_soon(partial(post_until_cancelled, client, c.proxy_url + CHAT, holder,
                                       json=chat_body()))
            with trio.fail_after(10):
                await decode.wait_until(lambda: len(decode.requests()) == 1)
            yield c, decode, holder
            holder.cancel()


async def test_requests_over_the_cap_wait_then_get_a_503_with_retry_after(
    client: httpx.AsyncClient,
) -> None:
    async with one_place_taken(client, admission_timeout=0.2) as (c, decode, holder):
        started = trio.current_time()
        r = await client.post(c.proxy_url + CHAT, json=chat_body())
        waited = trio.current_time() - started
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        error = r.json()["error"]
        assert error["code"] == "proxy_at_capacity" and "EPD_MAX_INFLIGHT" in error["message"]
        assert "stage" not in error and "instance" not in error  # blamed on nobody
        assert 0.2 <= waited < 5  # it waited for a place, then gave up at the deadline
        assert len(decode.requests()) == 1  # the refused one never reached an instance
        holder.cancel()  # the first client leaves: its place frees
        await trio.testing.wait_all_tasks_blocked()
        decode.behaviour.hang = False
        r = await client.post(c.proxy_url + CHAT, json=chat_body())
        assert r.status_code == 200
        metrics = Samples((await client.get(c.proxy_url + "/metrics")).text)
        assert metrics.get("epd_trio_admission_refusals_total") == 1
        assert metrics.get("epd_trio_requests_total", endpoint=CHAT, outcome="overloaded",
                           model="") == 1  # refused before its body: no model


async def test_a_waiting_request_gets_the_place_that_frees(client: httpx.AsyncClient) -> None:
    answers: list[int] = []
    async with one_place_taken(client, admission_timeout=30) as (c, decode, holder):
        decode.behaviour.hang = False

        async def waiter() -> None:
            answers.append((await client.post(c.proxy_url + CHAT, json=chat_body())).status_code)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter)
            await trio.testing.wait_all_tasks_blocked(cushion=0.05)
            assert answers == [] and len(decode.requests()) == 1  # still waiting for a place
            holder.cancel()
    assert answers == [200]


async def test_a_zero_admission_timeout_refuses_at_once(
    client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="epd_trio.requests")
    async with one_place_taken(client, admission_timeout=0, request_log=True) as (c, _, _):
        with trio.fail_after(1):
            r = await client.post(c.proxy_url + CHAT, json=chat_body(),
                                  headers={"x-request-id": "full"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "proxy_at_capacity"
        # Issue 31: a refusal has its id and its request line, like an answer.
        assert r.headers["x-request-id"] == "full"
        assert [(f["request_id"], f["outcome"], f["status"]) for rec in caplog.records
                if rec.name == "epd_trio.requests"
                for f in [rec.fields]] == [("full", "overloaded", 503)]  # type: ignore[attr-defined]
