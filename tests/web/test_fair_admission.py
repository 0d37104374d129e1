"""Fair admission over real sockets: a tenant's limits answered as OpenAI-style 429s, its
priority on every leg, and its tokens settled on what a request used (stream, non-stream,
cancelled); a malformed table refused at start."""

from __future__ import annotations

import logging
import os
import sys
from functools import partial

import httpx
import pytest
import trio
import trio.testing

from epd_trio._core.config import ConfigError, settings_from
from epd_trio._core.tenants import parse_tenants
from epd_trio.testing import Cluster, run_cluster

from helpers import (
    CHAT,
    Samples,
    chat_body,
    hold_admission_places,
    image,
    metric,
    post_until_cancelled,
    queued,
)

TENANTS = parse_tenants({
    "interactive": {"keys": ["sk-int-1"], "requests_per_minute": 2},
    "batch": {"keys": ["sk-batch-1"], "priority": 1},
    "metered": {"keys": ["sk-tpm-1"], "tokens_per_minute": 1200},
})


def key(value: str) -> dict[str, str]:
    return {"authorization": f"Bearer {value}"}


def admitted(c: Cluster, tenant: str, priority: int) -> float:
    return metric(c.proxy, "epd_trio_tenant_admitted_total", tenant=tenant,
                  priority=str(priority))


async def test_over_requests_per_minute_a_tenant_gets_a_429_naming_the_limit(
    client: httpx.AsyncClient,
) -> None:
    async with run_cluster(decodes=1, tenants=TENANTS) as c:
        for _ in range(2):
            r = await client.post(c.proxy_url + CHAT, json=chat_body(), headers=key("sk-int-1"))
            assert r.status_code == 200
        r = await client.post(c.proxy_url + CHAT, json=chat_body(), headers=key("sk-int-1"))
        assert r.status_code == 429
        assert 29 <= int(r.headers["retry-after"]) <= 30  # 2 a minute: the next in 30 s
        error = r.json()["error"]
        assert error["param"] == "requests_per_minute" and error["code"] == "rate_limit_exceeded"
        assert "requests_per_minute" in error["message"] and "interactive" in error["message"]
        assert len(c.decodes[0].requests()) == 2  # the refused one reached no instance
        # Another tenant is not held by it; a key of no tenant is refused (keys are the auth).
        r = await client.post(c.proxy_url + CHAT, json=chat_body(), headers=key("sk-batch-1"))
        assert r.status_code == 200
        r = await client.post(c.proxy_url + CHAT, json=chat_body(), headers=key("sk-nobody"))
        assert r.status_code == 401
        metrics = Samples((await client.get(c.proxy_url + "/metrics")).text)
        assert metrics.get("epd_trio_tenant_admitted_total", tenant="interactive",
                           priority="0") == 3  # a place, then refused on its rate
        assert metrics.get("epd_trio_tenant_rejected_total", tenant="interactive", priority="0",
                           reason="requests_per_minute") == 1
        assert metrics.get("epd_trio_tenant_admitted_total", tenant="batch", priority="1") == 1
        # The 429 is its own outcome, apart from the other 4xx (the 401).
        assert metrics.by("epd_trio_requests_total", "outcome", endpoint=CHAT) == {
            "ok": 3, "rate_limited": 1, "client_error": 1}


@pytest.mark.parametrize(("headers", "asked", "sent"), [
    (key("sk-batch-1"), -3, 1),         # raising above its tenant's: the tenant's
    (key("sk-batch-1"), 4, 4),          # lowering: allowed
    (key("sk-batch-1"), None, 1),
    ({**key("sk-plain"), "x-tenant": "bulk"}, None, 2),  # no tenant's key: the header
    ({**key("sk-plain"), "x-tenant": "batch"}, None, None),  # not a tenant with keys: default
    (key("sk-plain"), -2, None),        # default (0): nothing sent, as vLLM's default
])
async def test_the_effective_priority_goes_on_every_leg(
    client: httpx.AsyncClient, headers: dict[str, str], asked: int | None, sent: int | None,
) -> None:
    """Encode (one sub-request per image), prefill and decode all get the effective priority."""
    tenants = parse_tenants({"batch": {"keys": ["sk-batch-1"], "priority": 1},
                             "bulk": {"priority": 2}})
    async with run_cluster(encoders=1, prefills=1, decodes=1, tenants=tenants,
                           api_keys=("sk-plain",), tenant_header="x-tenant") as c:
        extra = {} if asked is None else {"priority": asked}
        r = await client.post(c.proxy_url + CHAT, json=chat_body(image(0), image(1), **extra),
                              headers=headers)
        assert r.status_code == 200, r.text
        assert c.encoders[0].requests()
        for server in (*c.encoders, *c.prefills, *c.decodes):
            for received in server.requests():
                assert received.body.get("priority") == sent


async def used_in_full(client: httpx.AsyncClient, url: str, **extra: object) -> None:
    """A request of the metered tenant that reserves 1002 of its 1200 tokens a minute."""
    body = chat_body(**{**{"max_tokens": 1000}, **extra})
    if body.get("stream"):
        async with client.stream("POST", url + CHAT, json=body, headers=key("sk-tpm-1")) as r:
            assert r.status_code == 200
            await r.aread()
    else:
        r = await client.post(url + CHAT, json=body, headers=key("sk-tpm-1"))
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("extra", [
    {},                                                            # non-stream: its usage
    {"stream": True, "stream_options": {"include_usage": True}},   # a stream's usage event
    {"stream": True},                                              # a stream: its events
])
async def test_tokens_are_settled_on_what_a_request_used(
    client: httpx.AsyncClient, extra: dict[str, object],
) -> None:
    """1002 reserved of 1200; about 10 used. Unsettled, a second request (1002 more) would
    wait 40 s for the refill; settled, it passes at once."""
    async with run_cluster(decodes=1, tenants=TENANTS) as c:
        await used_in_full(client, c.proxy_url, **extra)
        await trio.testing.wait_all_tasks_blocked()
        await used_in_full(client, c.proxy_url, **extra)
        await trio.testing.wait_all_tasks_blocked()
        r = await client.post(c.proxy_url + CHAT, json=chat_body(max_tokens=1000),
                              headers=key("sk-tpm-1"))
        assert r.status_code == 200
        r = await client.post(c.proxy_url + CHAT, json=chat_body(max_tokens=5000),
                              headers=key("sk-tpm-1"))  # more than the whole bucket, not full
        assert r.status_code == 429 and r.json()["error"]["param"] == "tokens_per_minute"


async def test_a_cancelled_stream_settles_what_it_used(client: httpx.AsyncClient) -> None:
    async with run_cluster(decodes=1, tenants=TENANTS) as c:
        (decode,) = c.decodes
        decode.behaviour.tokens = 1000
        decode.behaviour.chunk_delay = 0.05
        body = chat_body(max_tokens=1000, stream=True)
        async with client.stream("POST", c.proxy_url + CHAT, json=body,
                                 headers=key("sk-tpm-1")) as r:
            async for _ in r.aiter_bytes():
                break  # the client leaves after its first bytes
        with trio.fail_after(10):
            await decode.wait_until(lambda: decode.requests()[0].disconnected)
        await trio.testing.wait_all_tasks_blocked(cushion=0.05)
        decode.behaviour.chunk_delay = 0.0
        r = await client.post(c.proxy_url + CHAT, json=chat_body(max_tokens=1000),
                              headers=key("sk-tpm-1"))
        assert r.status_code == 200, r.text


async def test_the_request_log_names_the_tenant_its_priority_and_its_wait(
    client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    """The request's trace starts once it is admitted, so its wait for a place is a field of
    its own; a refusal at admission names its tenant."""
    caplog.set_level(logging.INFO, logger="epd_trio.requests")
    async with run_cluster(decodes=1, tenants=TENANTS, max_inflight=1, admission_timeout=10,
                           request_log=True) as c:
        (decode,) = c.decodes
        decode.behaviour.hang = True
        async with trio.open_nursery() as nursery:
            holder = trio.CancelScope()
            nursery.start_soon(partial(
                post_until_cancelled, client, c.proxy_url + CHAT, holder, json=chat_body(),
                headers={**key("sk-batch-1"), "x-request-id": "holder"}))
            with trio.fail_after(10):
                await decode.wait_until(lambda: len(decode.requests()) == 1)
            waited: list[float] = []

            async def wait() -> None:
                start = trio.current_time()
                r = await client.post(c.proxy_url + CHAT, json=chat_body(priority=2),
                                      headers={**key("sk-int-1"), "x-request-id": "waiter"})
                waited.append(trio.current_time() - start)
                assert r.status_code == 200, r.text

            nursery.start_soon(wait)
            with trio.fail_after(10):
                while not queued(c.proxy, "interactive"):  # noqa: ASYNC110
                    await trio.sleep(0.005)  # the request is on its way: no event to wait on
            decode.behaviour.hang = False
            holder.cancel()
        # Over its requests_per_minute (2), refused once its body is read.
        r = await client.post(c.proxy_url + CHAT, json=chat_body(),
                              headers={**key("sk-int-1"), "x-request-id": "limited"})
        assert r.status_code == 200
        r = await client.post(c.proxy_url + CHAT, json=chat_body(),
                              headers={**key("sk-int-1"), "x-request-id": "refused"})
        assert r.status_code == 429
    # Refused before its body, for want of a place: its tenant is all the line knows.
    async with run_cluster(decodes=1, tenants=TENANTS, max_inflight=1, admission_timeout=0,
                           request_log=True) as c:
        async with hold_admission_places(c.proxy_url, 1, api_key="sk-batch-1"):
            with trio.fail_after(10):
                while not admitted(c, "batch", priority=1):  # noqa: ASYNC110
                    await trio.sleep(0.005)  # its headers are on their way
            r = await client.post(c.proxy_url + CHAT, json=chat_body(),
                                  headers={**key("sk-batch-1"), "x-request-id": "full"})
        assert r.status_code == 503
    lines = {f["request_id"]: f for rec in caplog.records if rec.name == "epd_trio.requests"
             for f in [rec.fields]}  # type: ignore[attr-defined]
    holder_line, waiter_line = lines["holder"], lines["waiter"]
    assert (holder_line["tenant"], holder_line["priority"]) == ("batch", 1)
    assert holder_line["queued_s"] == 0.0 and holder_line["outcome"] == "cancelled"
    assert (waiter_line["tenant"], waiter_line["priority"]) == ("interactive", 2)
    assert 0 < waiter_line["queued_s"] <= waited[0]  # its wait, outside its duration
    assert waiter_line["queued_s"] + waiter_line["duration_s"] <= waited[0]
    refused = lines["refused"]
    assert (refused["tenant"], refused["priority"], refused["status"]) == ("interactive", 0, 429)
    assert refused["outcome"] == "rate_limited"
    full = lines["full"]
    assert (full["tenant"], full["outcome"]) == ("batch", "overloaded")
    assert "priority" not in full and "queued_s" not in full


async def test_with_headroom_a_better_band_reaches_the_engine_past_a_full_cap(
    client: httpx.AsyncClient,
) -> None:
    """``EPD_PRIORITY_HEADROOM=1`` over one place held by a batch request: an interactive
    request is answered at once, a second batch one is not let past the cap."""
    async with run_cluster(decodes=1, tenants=TENANTS, max_inflight=1, admission_timeout=0,
                           priority_headroom=1) as c:
        (decode,) = c.decodes
        decode.behaviour.hang = True
        async with trio.open_nursery() as nursery:
            holder = trio.CancelScope()
            nursery.start_soon(partial(post_until_cancelled, client, c.proxy_url + CHAT, holder,
                                       json=chat_body(), headers=key("sk-batch-1")))
            with trio.fail_after(10):
                await decode.wait_until(lambda: len(decode.requests()) == 1)
            r = await client.post(c.proxy_url + CHAT, json=chat_body(), headers=key("sk-batch-1"))
            assert r.status_code == 503  # the cap holds for its own band
            decode.behaviour.hang = False
            r = await client.post(c.proxy_url + CHAT, json=chat_body(), headers=key("sk-int-1"))
            assert r.status_code == 200, r.text
            assert len(decode.requests()) == 2
            holder.cancel()
        assert [metric(c.proxy, "epd_trio_tenant_headroom_admitted_total", tenant=name,
                       priority=band) for name, band in (("interactive", "0"), ("batch", "1"))
                ] == [1, 0]


def test_a_malformed_table_is_refused_with_one_line_naming_it() -> None:
    with pytest.raises(ConfigError) as env:
        settings_from({"EPD_DECODE_URLS": "http://d:1",
                       "EPD_TENANTS": '{"batch": {"weight": -1}}'})
    assert str(env.value).startswith("EPD_TENANTS: tenants.batch: weight must be")
    with pytest.raises(ConfigError) as file:
        settings_from({"EPD_DECODE_URLS": "http://d:1"},
                      {"tenants": {"batch": {"max_inflight": "many"}}})
    assert str(file.value).startswith("tenants (config file): tenants.batch: max_inflight")


async def test_epd_trio_serve_refuses_a_malformed_table_at_start() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPD_")}
    with trio.fail_after(60):
        result = await trio.run_process(
            [sys.executable, "-m", "epd_trio", "serve", "--port", "0"],
            env={**env, "EPD_DECODE_URLS": "http://127.0.0.1:9",
                 "EPD_TENANTS": '{"batch": {"priority": "high"}}'},
            capture_stdout=True, capture_stderr=True, check=False)
    assert result.returncode == 2
    (line,) = result.stderr.decode().strip().splitlines()
    assert line.endswith("EPD_TENANTS: tenants.batch: priority must be an integer, got 'high'")
